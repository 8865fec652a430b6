"""Run a batch of packed-documents (varlen) cases on every rank of a real torchrun job (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node W tests/dist/varlen_cases.py \
        --cases CASES.json --results RESULTS.jsonl

``CASES.json`` is a JSON list of case objects, each with a ``name`` and a ``kind``:

- ``verify``: ``spec`` is a ``CaseSpec.to_dict()``; the case goes through
  ``ringbench.check.verify_case``, the harness's own verify (the variant against the float64
  math kernel and the same kernel over the whole packed row, MEASUREMENT.md's rule). The
  record also carries the local shapes and dtypes of rank 0's results.
- ``bad_cu``: ``variant``, ``kernel``, ``seqlen`` and ``cu`` (the offsets every rank passes) or
  ``cu_by_rank`` (one list per rank), and optionally ``cu_dtype`` (``int32`` or ``int64``): the
  variant is called with that cu_seqlens; every rank's error message is recorded (or ``None``
  when it did not raise), so the test can check that all ranks raised together.

Rank 0 appends one JSON line per case to ``RESULTS.jsonl`` as soon as the case ends; a case
that raises unexpectedly is recorded with ``status: "error"`` and the next case runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from ringbench.check import verify_case
from ringbench.variants import get_variant


def _verify(case: dict) -> dict:
    return verify_case(case["spec"], device=torch.device("cpu"))


def _bad_cu(case: dict) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    variant = get_variant(case["variant"])
    local = case["seqlen"] // world_size
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, local, 2, 8, generator=gen)
    k = torch.randn(1, local, 1, 8, generator=gen)
    v = torch.randn(1, local, 1, 8, generator=gen)
    offsets = case["cu_by_rank"][rank] if "cu_by_rank" in case else case["cu"]
    cu = None if offsets is None else torch.tensor(offsets, dtype=getattr(torch, case.get("cu_dtype", "int32")))
    message = None
    try:
        variant.attention(q, k, v, causal=True, kernel=case["kernel"], cu_seqlens=cu)
    except ValueError as exc:
        message = str(exc)
    messages: list = [None] * world_size
    dist.all_gather_object(messages, message)
    return {"messages": messages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True, help="JSON list of case objects")
    parser.add_argument("--results", required=True, help="JSONL file rank 0 appends one line per case to")
    args = parser.parse_args(argv)

    timeout = dt.timedelta(seconds=float(os.environ.get("CASES_PG_TIMEOUT", "300")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Rank 0 computes the references while the others wait, so it gets two threads.
    torch.set_num_threads(2 if rank == 0 else 1)
    with open(args.cases) as fh:
        cases = json.load(fh)
    try:
        for case in cases:
            record = {"name": case["name"], "world_size": world_size, "status": "ok", "error": None}
            t0 = time.perf_counter()
            try:
                fields = {"verify": _verify, "bad_cu": _bad_cu}[case["kind"]](case)
            except Exception:  # recorded, and the next case runs
                fields = {"error": f"[rank {rank}/{world_size}] " + traceback.format_exc()}
                record["status"] = "error"
            dist.barrier()
            if rank == 0:
                record.update(fields)
                record["case_time_s"] = round(time.perf_counter() - t0, 3)
                with open(args.results, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                print(f"case {record['name']} W={world_size} status={record['status']} "
                      f"{fields.get('status', '')} {record['case_time_s']}s", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
