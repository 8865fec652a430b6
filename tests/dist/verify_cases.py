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
A case with ``"script": "varlen"`` is one of ``tests/dist/varlen_cases.py`` (``tests/test_varlen_distributed.py``'s,
pooled likewise): its ``kind`` (``verify`` or ``bad_cu``) runs and is recorded as that script runs and records
it, rank 0 on two threads as there. A case with ``"script": "timing"`` (``tests/test_timing.py``'s) runs
``tests/dist/timing_loop.py``'s loop on every rank (``iters``, ``min_time_ms``) and records every rank's result
as ``ranks``, in rank order. A case with ``"script": "emulation"`` (``tests/test_emulation.py``'s) runs that
``helpers.real_and_emulated`` on every rank, which writes each rank's tensors to the case's ``out`` folder.
"""

from __future__ import annotations

import sys

import torch

import cases  # tests/dist is the script's folder, so first on sys.path under torchrun
import timing_loop
import varlen_cases
from ringbench.rank.worker import leave
from ringbench.rank.check import verify_case
from ringbench.case.spec import CaseSpec


#: Rank 0's threads: a verify case's references are computed on rank 0 alone while the others wait;
#: a tests/dist/cases.py case's on rank 0 and 1 at once (that script's own setting); a
#: tests/dist/varlen_cases.py case's as that script sets them; the timing loop and the emulation
#: compute nothing on rank 0 alone.
RANK0_THREADS = {"verify": 2, "cases": 1, "varlen": 2, "timing": 1, "emulation": 1}


def _kind(case: dict) -> str:
    if case.get("script") in ("varlen", "timing", "emulation"):
        return case["script"]
    return "verify" if "spec" in case else "cases"


def _every_rank(mine: dict) -> dict | None:
    """Every rank's ``mine``, in rank order, on rank 0 (``{"ranks": [...]}``); None on the others."""
    ranks: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    return {"ranks": ranks} if torch.distributed.get_rank() == 0 else None


def _verify(case: dict) -> dict | None:
    kind = _kind(case)
    torch.set_num_threads(RANK0_THREADS[kind] if torch.distributed.get_rank() == 0 else 1)
    if kind == "cases":
        return cases.run_case(case)
    if kind == "varlen":
        return varlen_cases.run_case(case)
    if kind == "timing":
        return _every_rank(timing_loop.budget(case["iters"], case["min_time_ms"]))
    if kind == "emulation":
        from helpers import real_and_emulated  # tests/ is on sys.path (tests/dist/cases.py puts it there)

        real_and_emulated(case["out"])
        return None
    fields = verify_case(CaseSpec.from_dict(case["spec"]), device=torch.device("cpu"))
    return {"verdict": fields.pop("status"), **fields}


def _start(case: dict, world_size: int) -> dict:
    if _kind(case) == "cases":
        return cases._start(case, world_size)
    if _kind(case) == "varlen":
        return {**varlen_cases._start(case, world_size), "script": "varlen"}
    if _kind(case) in ("timing", "emulation"):
        return {"name": case["name"], "world_size": world_size, "status": "ok", "error": None,
                "script": case["script"]}
    return {"name": case["name"], "world_size": world_size, "status": "ok", "error": None}


def _describe(record: dict) -> str:
    if "passed" in record:  # a tests/dist/cases.py record
        return cases._describe(record)
    if record.get("script") == "varlen":  # a tests/dist/varlen_cases.py record
        return varlen_cases._describe(record)
    if record.get("script") in ("timing", "emulation"):
        return (f"case {record['name']} W={record['world_size']} status={record['status']} "
                f"{record['case_time_s']}s" + (f" ranks {record['ranks']}" if "ranks" in record else ""))
    worst = max((c.get("shadow_ratio") or 0.0 for c in record.get("checks") or []), default=float("nan"))
    return (f"case {record['name']} W={record['world_size']} status={record['status']} "
            f"verdict={record.get('verdict')} worst shadow ratio {worst:.3f} {record['case_time_s']}s")


def main(argv: list[str] | None = None) -> int:
    # Rank 0 computes the references while the others wait, so it gets two threads.
    return cases.drive(__doc__, _verify, _start, _describe, argv, rank0_threads=RANK0_THREADS["verify"])


if __name__ == "__main__":
    leave(main())
