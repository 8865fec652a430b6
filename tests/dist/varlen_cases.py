"""Run a batch of packed-documents (varlen) cases on every rank of a real torchrun job (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node W tests/dist/varlen_cases.py \
        --cases CASES.json --results RESULTS.jsonl

``CASES.json`` is a JSON list of case objects, each with a ``name`` and a ``kind``:

- ``verify``: ``spec`` is a ``CaseSpec.to_dict()``; the case goes through
  ``ringbench.rank.check.verify_case``, the harness's own verify (the variant against the float64
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

import sys

import torch
import torch.distributed as dist

from cases import drive  # tests/dist is the script's folder, so first on sys.path under torchrun
from ringbench.rank.worker import leave
from ringbench.rank.check import verify_case
from ringbench.case.spec import CaseSpec
from ringbench.variants import get_variant


def _verify(case: dict) -> dict:
    return verify_case(CaseSpec.from_dict(case["spec"]), device=torch.device("cpu"))


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


def run_case(case: dict) -> dict:
    """Run one case of its ``kind`` on this rank (``tests/dist/verify_cases.py`` runs them too, pooled)."""
    return {"verify": _verify, "bad_cu": _bad_cu}[case["kind"]](case)


def _start(case: dict, world_size: int) -> dict:
    return {"name": case["name"], "world_size": world_size, "status": "ok", "error": None}


def _describe(record: dict) -> str:
    return f"case {record['name']} W={record['world_size']} status={record['status']} {record['case_time_s']}s"


def main(argv: list[str] | None = None) -> int:
    # Rank 0 computes the references while the others wait, so it gets two threads.
    return drive(__doc__, run_case, _start, _describe, argv, rank0_threads=2)


if __name__ == "__main__":
    leave(main())
