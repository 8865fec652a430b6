"""The per-rank entry point that torchrun starts: runs every case of one launch in order.

``python -m ringbench.worker --cases FILE --results FILE`` (docs/CONTRACTS.md). Rank 0
appends one record per case as soon as the case ends, so a later crash loses nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ringbench import envinfo, results
from ringbench.bench import bench_case
from ringbench.check import verify_case
from ringbench.spec import CaseSpec


def _mark(rank: int, text: str) -> None:
    # A small progress file per rank lets the launcher say where a hung job stopped.
    folder = os.environ.get("RINGBENCH_PROGRESS_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"rank{rank}.txt", "a") as fh:
            fh.write(f"{dt.datetime.now(dt.timezone.utc).isoformat()} {text}\n")


def _init(device_type: str) -> torch.device:
    timeout = dt.timedelta(seconds=float(os.environ.get("RINGBENCH_PG_TIMEOUT", "600")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def _status_of(exc: BaseException) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom"
    return "error"


def run_one(spec: dict, device: torch.device) -> dict:
    """Run one case on this rank and return its outcome fields (status, reason and numbers)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        if spec["task"] == "verify":
            fields = verify_case(spec, device=device)
        else:
            fields = {"status": "ok", "reason": None, **bench_case(spec, device=device)}
    except Exception as exc:  # a fault in one case is recorded, and the sweep goes on
        first = traceback.format_exception_only(type(exc), exc)[-1].strip()
        fields = {"status": _status_of(exc), "reason": f"[rank {rank}/{world_size}] {first}"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return fields


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ringbench.worker")
    parser.add_argument("--cases", required=True, type=Path)
    parser.add_argument("--results", required=True, type=Path)
    args = parser.parse_args(argv)
    payload = json.loads(args.cases.read_text())
    cases = payload["cases"]
    device = _init(cases[0]["device"])
    rank = dist.get_rank()
    env = envinfo.collect() if rank == 0 else None
    try:
        for i, spec in enumerate(cases):
            _mark(rank, f"case {i + 1}/{len(cases)} start {spec['variant']} S={spec['seqlen']}")
            started = time.perf_counter()
            fields = run_one(spec, device)
            elapsed_s = time.perf_counter() - started
            # Every rank's status counts: the worst one is the case's.
            statuses: list = [None] * dist.get_world_size()
            dist.all_gather_object(statuses, (fields["status"], fields.get("reason")))
            bad = [s for s in statuses if s[0] not in ("ok", "fail")]
            if bad and fields["status"] in ("ok", "fail"):
                fields = {"status": bad[0][0], "reason": bad[0][1]}
            if rank == 0:
                rec = {
                    "schema_version": results.SCHEMA_VERSION,
                    "task": spec["task"],
                    "run_id": payload["run_id"],
                    "case_id": CaseSpec.from_dict(spec).case_id(),
                    "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
                    "spec": spec,
                    "kernel": spec["kernel"],
                    **fields,
                    "elapsed_s": elapsed_s,
                    "env": {**env, "kernel": spec["kernel"]},
                }
                results.append_record(args.results, rec)
            _mark(rank, f"case {i + 1}/{len(cases)} done {fields['status']}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
