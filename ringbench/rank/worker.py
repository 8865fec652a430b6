"""The per-rank entry point that torchrun starts: runs every case of one launch in order.

``python -m ringbench.rank.worker --cases FILE --results FILE`` (docs/contracts.md). The lowest
rank on node 0 (rank 0 on one node) appends one record per case as soon as the case ends, so
a later crash loses nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ringbench.records import envinfo, build as records, store as results
from ringbench.rank.bench import bench_case
from ringbench.rank.check import verify_case
from ringbench.rank.emulation import emulate_case
from ringbench.rank.lifeline import die_with_torchrun
from ringbench.case.spec import CaseSpec
from ringbench.variants import get_variant
from ringbench.variants.engines import merge
from ringbench.variants.kernels import get_kernel

#: Seconds a rank whose case raised waits for the other ranks' statuses. When they do not all
#: come (the others are stuck in a transfer with it), it re-raises, so the process ends, its
#: traceback lands in torchelastic's error file and torchrun ends the other ranks.
FAULT_WAIT_S = float(os.environ.get("RINGBENCH_FAULT_WAIT_S", "10"))


def _mark(rank: int, text: str) -> None:
    # A small progress file per rank lets the launcher say where a hung job stopped.
    folder = os.environ.get("RINGBENCH_PROGRESS_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"rank{rank}.txt", "a") as fh:
            fh.write(f"{dt.datetime.now(dt.timezone.utc).isoformat()} {text}\n")


def _pg_timeout() -> dt.timedelta:
    return dt.timedelta(seconds=float(os.environ.get("RINGBENCH_PG_TIMEOUT", "600")))


def _init(device_type: str) -> torch.device:
    timeout = _pg_timeout()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


_REQUESTED_RE = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)")
_FREE_RE = re.compile(r"of which ([\d.]+ ?[KMGT]?i?B) (?:is )?free")


def _reason_of(exc: BaseException, rank: int, world_size: int) -> str:
    """``[rank r/W] Type: message (at file.py:line in function)``, with the innermost frame where a
    variant, kernel or library raised (not where the harness refused a result, whose message
    says why); an out-of-memory error leads with the requested and free memory."""
    first = traceback.format_exception_only(type(exc), exc)[-1].strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and Path(frames[-1].filename).resolve().parent != Path(__file__).resolve().parent:
        first += f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})"
    if records.status_of_exception(exc) == "oom":
        text = str(exc)
        requested, free = _REQUESTED_RE.search(text), _FREE_RE.search(text)
        memory = ", ".join(f"{name} {m.group(1)}" for name, m in (("requested", requested), ("free", free)) if m)
        if memory:
            return f"[rank {rank}/{world_size}] out of memory: {memory}; {first}"
    return f"[rank {rank}/{world_size}] {first}"


def run_one(spec: CaseSpec, device: torch.device) -> tuple[dict, BaseException | None]:
    """Run one case on this rank; its outcome fields (status, reason, numbers) and the exception it raised."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    error = None
    variant = get_variant(spec.variant)
    try:
        # The variant's session sees the plain dict: variants know nothing of the harness.
        with variant.open_session(spec.to_dict(), None, device):
            if spec.task == "verify" and spec.hf_model:
                from ringbench.rank.model_check import check_model  # imports transformers

                fields = check_model(spec, device=device)
            elif spec.task == "verify":
                fields = verify_case(spec, device=device)
            elif spec.emulate:  # one process plays every rank (ringbench/rank/emulation.py)
                fields = {"status": "ok", "reason": None, **emulate_case(spec, device=device)}
            else:
                fields = {"status": "ok", "reason": None, **bench_case(spec, device=device)}
        kernel = get_kernel(spec.kernel)
        fields["kernel_version"] = kernel.version()
        fields["merge_path"] = None if variant.peer else merge.merge_path(device)
        notes = variant.notes(heads=spec.heads, kv_heads=spec.kv_heads,
                              ulysses_degree=variant.ulysses_degree(spec.world_size, spec.ulysses_degree)) + kernel.notes()
        if notes:
            fields["notes"] = notes
    except Exception as exc:  # a fault in one case is recorded, and the sweep goes on
        error = exc
        traceback.print_exc()  # the whole traceback goes to this rank's log
        fields = {"status": records.status_of_exception(exc), "reason": _reason_of(exc, rank, world_size)}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return fields, error


def _exchange_statuses(key: str, mine: tuple, error: BaseException | None, timeout: dt.timedelta) -> list:
    """Every rank's ``(status, reason)`` for one case, through the rendezvous store.

    The store, not a collective, so that a rank whose case raised can give up: when the other
    ranks' statuses do not come within ``FAULT_WAIT_S`` (they wait for it in a transfer), the
    original exception is raised again and ends this process (see ``FAULT_WAIT_S``).
    """
    store = dist.distributed_c10d._get_default_store()
    world_size = dist.get_world_size()
    keys = [f"{key}/rank{r}" for r in range(world_size)]
    store.set(keys[dist.get_rank()], json.dumps(mine))
    try:
        store.wait(keys, dt.timedelta(seconds=FAULT_WAIT_S) if error is not None else timeout)
    except Exception:
        if error is not None:
            store.set(f"{key}/gave_up", "1")  # the group is broken: ranks that fail after this one end too
            raise error from None
        raise
    if error is not None and store.check([f"{key}/gave_up"]):
        raise error  # a failure caused by a rank that gave up; the launch reports that rank first
    return [tuple(json.loads(store.get(k))) for k in keys]


def _record_writer() -> int:
    """The global rank that appends the records: the lowest one on node 0 (``RINGBENCH_NODE_RANK``).

    torchrun's c10d rendezvous orders the nodes its own way, so global rank 0 may live on any
    node; the records must land where node 0's CLI reads them.
    """
    node_ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(node_ranks, int(os.environ.get("RINGBENCH_NODE_RANK", "0")))
    return min((r for r, n in enumerate(node_ranks) if n == 0), default=0)


@record
def main(argv: list[str] | None = None) -> None:
    die_with_torchrun()  # a rank never outlives the torchrun that started it (ringbench.sweep.launch)
    parser = argparse.ArgumentParser(prog="python -m ringbench.rank.worker")
    parser.add_argument("--cases", required=True, type=Path)
    parser.add_argument("--results", required=True, type=Path)
    args = parser.parse_args(argv)
    payload = json.loads(args.cases.read_text())
    cases = [CaseSpec.from_dict(c) for c in payload["cases"]]
    _mark(int(os.environ.get("RANK", "0")), "init_process_group")
    device = _init(cases[0].device)
    envinfo.warm_cpu_math()
    rank = dist.get_rank()
    _mark(rank, "ready")
    writer = _record_writer()
    env = envinfo.collect() if rank == writer else None
    # No try/finally around the cases: a rank that re-raises a fault must not wait in
    # destroy_process_group for peers that are stuck in a transfer with it.
    for i, spec in enumerate(cases):
        _mark(rank, f"case {i + 1}/{len(cases)} start {spec.variant} S={spec.seqlen}")
        started = time.perf_counter()
        fields, error = run_one(spec, device)
        elapsed_s = time.perf_counter() - started
        if error is not None:
            _mark(rank, f"case {i + 1}/{len(cases)} raised {type(error).__name__}; waiting for the other ranks")
        statuses = _exchange_statuses(f"ringbench/case{i}", (fields["status"], fields.get("reason"), time.time()),
                                      error, _pg_timeout())
        # Every rank's status counts: the first fault (in time) is the case's, as the others
        # usually follow from it.
        bad = sorted((s for s in statuses if s[0] not in ("ok", "fail")), key=lambda s: s[2])
        if bad:
            fields = {"status": bad[0][0], "reason": bad[0][1]}
        if rank == writer:
            measured = {k: v for k, v in fields.items() if k not in ("status", "reason")}
            rec = records.build(spec, run_id=payload["run_id"], status=fields["status"], reason=fields.get("reason"),
                                fields=measured or None, env=env, elapsed_s=elapsed_s)
            results.append_record(args.results, rec)
        _mark(rank, f"case {i + 1}/{len(cases)} done {fields['status']}")
    dist.destroy_process_group()


def leave(code: int = 0) -> None:
    """End the rank with exit ``code`` once :func:`main` has returned (its records written, its
    process group destroyed), skipping Python's teardown of torch at exit: about half a second of
    CPU a process, a second or more a launch of several ranks on a few cores, and nothing a rank
    needs. What was printed is flushed first; a rank that raised never gets here (``record``
    writes its error file and it exits as before). The tests' case scripts end the same way."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
    leave()
