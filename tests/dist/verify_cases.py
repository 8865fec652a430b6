"""Run a batch of verify cases through the harness's own ``verify_case`` on every rank of a real
torchrun job (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node W tests/dist/verify_cases.py \
        --cases CASES.json --results RESULTS.jsonl

``CASES.json`` is a JSON list of ``{"name": str, "spec": CaseSpec.to_dict()}``, every spec at
the launch's world size. Each case goes through ``ringbench.rank.check.verify_case``: the max rule
against the float64 math kernel and the single-device kernel, and the block-decomposition
check against the variant's own kernel calls merged in float64. Rank 0 appends one JSON line
per case (``status``, ``reason``, ``checks``, ``cp_active``) as soon as it ends; a case that
raises is recorded with ``status: "error"`` and the next case runs.

A case without a ``spec`` is one of ``tests/dist/cases.py`` (``tests/test_variants_distributed.py``'s,
pooled into the same launch, ``helpers.VerifyPool``): it runs and is recorded as that script runs and
records it, rank 0 on one thread as there (two for a verify case, which computes its references alone).
"""

from __future__ import annotations

import sys

import torch

import cases  # tests/dist is the script's folder, so first on sys.path under torchrun
from ringbench.rank.worker import leave
from ringbench.rank.check import verify_case
from ringbench.case.spec import CaseSpec


#: Rank 0's threads: a verify case's references are computed on rank 0 alone while the others wait;
#: a tests/dist/cases.py case's on rank 0 and 1 at once (that script's own setting).
RANK0_THREADS = {"verify": 2, "cases": 1}


def _kind(case: dict) -> str:
    return "verify" if "spec" in case else "cases"


def _verify(case: dict) -> dict | None:
    kind = _kind(case)
    torch.set_num_threads(RANK0_THREADS[kind] if torch.distributed.get_rank() == 0 else 1)
    if kind == "cases":
        return cases.run_case(case)
    fields = verify_case(CaseSpec.from_dict(case["spec"]), device=torch.device("cpu"))
    return {"verdict": fields.pop("status"), **fields}


def _start(case: dict, world_size: int) -> dict:
    if _kind(case) == "cases":
        return cases._start(case, world_size)
    return {"name": case["name"], "world_size": world_size, "status": "ok", "error": None}


def _describe(record: dict) -> str:
    if "passed" in record:  # a tests/dist/cases.py record
        return cases._describe(record)
    worst = max((c.get("shadow_ratio") or 0.0 for c in record.get("checks") or []), default=float("nan"))
    return (f"case {record['name']} W={record['world_size']} status={record['status']} "
            f"verdict={record.get('verdict')} worst shadow ratio {worst:.3f} {record['case_time_s']}s")


def main(argv: list[str] | None = None) -> int:
    # Rank 0 computes the references while the others wait, so it gets two threads.
    return cases.drive(__doc__, _verify, _start, _describe, argv, rank0_threads=RANK0_THREADS["verify"])


if __name__ == "__main__":
    leave(main())
