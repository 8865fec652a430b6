"""The record of a case: the one place that builds it, for every status, and judges it.

The worker builds the records of the cases it ran, the sweep those of the cases no launch
reported (a crash, a timeout) or that could not run here (skipped); both go through
:func:`build`, so every record of every status has the same fields (docs/contracts.md).
Torch-free.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from ringbench.case import work

#: Version of the record layout in docs/contracts.md; bump it when a field changes meaning.
SCHEMA_VERSION = 1
#: Every status a record can hold.
STATUSES = ("ok", "fail", "oom", "timeout", "error", "skipped")
#: Statuses that do not fail a command; every other one does.
PASSING = ("ok", "skipped")
#: The measurement fields of a run record (units in their names: ms, GiB, GiB/s).
RUN_FIELDS = ("time_ms", "time_ms_p20", "time_ms_p80", "per_rank_time_ms", "per_rank_time_ms_p20",
              "per_rank_time_ms_p80", "timed_iters", "imbalance", "flops_per_gpu", "tflops_per_gpu", "ref_time_ms",
              "ref_time_ms_p20", "ref_time_ms_p80", "per_rank_ref_time_ms", "ref_timed_iters", "ref_tflops", "efficiency",
              "peak_allocated_gib", "peak_reserved_gib", "l2_flush_bytes", "bytes_sent", "bytes_received",
              "bus_gib_s", "peak_tflops", "peak_source", "per_rank_busy_ms", "busy_imbalance", "profile")
#: The name of the exception class that means out of memory (torch.cuda.OutOfMemoryError is
#: torch.OutOfMemoryError); torchelastic's error files and tracebacks name it too.
OOM_ERROR = "OutOfMemoryError"
#: What PyTorch's CPU allocator says when host memory runs out (a plain RuntimeError).
CPU_OOM_TEXT = "can't allocate memory"


def build(case, *, run_id: str, status: str, reason: str | None = None, fields: dict[str, Any] | None = None,
          env: dict | None = None, elapsed_s: float | None = None) -> dict[str, Any]:
    """The record of one case.

    Args:
        case: its ``CaseSpec``.
        run_id: the sweep's id (one per command).
        status: one of :data:`STATUSES`.
        reason: why it is not ok (null when ok).
        fields: what the case measured or checked (bench's or check's fields); ``None`` for a
            case that produced none, whose run fields are then null (verify: no checks, and
            ``cp_active`` null).
        env: the environment (``ringbench.records.envinfo.collect``), or ``None`` when it could not be had.
        elapsed_s: wall seconds the case took on the writing rank, when it ran.

    Raises:
        ValueError: an unknown status.
    """
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is unknown; use one of {', '.join(STATUSES)}")
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "task": case.task,
        "run_id": run_id,
        "case_id": case.case_id(),
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "spec": case.to_dict(),
        "kernel": case.kernel,
        "status": status,
        "reason": reason,
        # From the mask alone (ringbench/case/work.py), so every record has it, whatever its status.
        **work.predicted_fields(case),
    }
    if fields is None:
        if case.task == "run":
            record.update(dict.fromkeys(RUN_FIELDS))
            record["flops_convention"] = "flash-attn"
        else:
            record.update(checks=[], cp_active=None)
    else:
        record.update(fields)
        record["status"], record["reason"] = status, reason
    if case.task == "run":  # one process played every rank (ringbench/rank/emulation.py)
        record["emulated"] = bool(getattr(case, "emulate", False))
    if elapsed_s is not None:
        record["elapsed_s"] = elapsed_s
    record["env"] = None if env is None else {**env, "kernel": case.kernel}
    return record


def status_of_exception(exc: BaseException) -> str:
    """``oom`` for an out-of-memory error (any class named :data:`OOM_ERROR` in its MRO, or the CPU
    allocator's :data:`CPU_OOM_TEXT`), else ``error``."""
    if any(c.__name__ == OOM_ERROR for c in type(exc).__mro__) or CPU_OOM_TEXT in str(exc):
        return "oom"
    return "error"


def status_of_failure(timed_out: bool, failure: str | None) -> str:
    """The status of a case a failed launch never reported: ``timeout``, ``oom`` (the launch's
    failure text names :data:`OOM_ERROR`) or ``error``."""
    if timed_out:
        return "timeout"
    return "oom" if failure and (OOM_ERROR in failure or CPU_OOM_TEXT in failure) else "error"


def check_passed(check: dict) -> bool:
    """Whether one verify check entry passed (and was finite)."""
    return bool(check.get("passed")) and check.get("finite", True) is not False


def is_done(record: dict) -> bool:
    """Whether ``--resume`` may skip the record's case: status ok and, for verify, checks that
    all passed (an ok verify record with a failing check counts as failed)."""
    if record.get("status") != "ok":
        return False
    if record.get("task") != "verify":
        return True
    checks = record.get("checks") or []
    return bool(checks) and all(check_passed(c) for c in checks)


def passed(record: dict) -> bool:
    """Whether the record lets its command exit 0 (status ok or skipped)."""
    return record.get("status") in PASSING
