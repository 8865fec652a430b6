"""The class of a matrix cell, from its verify record."""

from __future__ import annotations

import math
import re
from typing import Any, Optional




# --------------------------------------------------------------------------- classes

_RANK_PREFIX = re.compile(r"^\[rank \d+/\d+\] (?:out of memory: [^;]*; )?")


def _ratio(value: Any, finite: Any = True) -> float:
    """A check's ratio as a float: not a number, NaN or a non-finite tensor count as inf."""
    if not isinstance(value, (int, float)) or value != value or finite is False:
        return math.inf
    return float(value)


def _worst(checks: list[dict], *, failing: bool = False) -> Optional[dict]:
    """The check with the largest error over its allowance: ``{"tensor", "ratio", "rule"}``.

    ``rule`` is ``max`` (verify's max rule, ``ratio``) or, among ``failing`` checks, ``blocks``
    where the block-decomposition rule (``shadow_ratio``) or ``kernel`` where the kernel rule
    (``kernel_units`` over ``kernel_limit``) is the one the check failed by more.
    """
    def excess(c: dict) -> tuple[float, str]:
        top = (_ratio(c.get("ratio"), c.get("finite", True)), "max")
        if failing and c.get("shadow_passed") is False:
            top = max(top, (_ratio(c.get("shadow_ratio")), "blocks"))
        if failing and c.get("kernel_passed") is False and c.get("kernel_limit"):
            top = max(top, (_ratio(c["kernel_units"] / c["kernel_limit"]), "kernel"))
        return top

    if not checks:
        return None
    best = max(checks, key=excess)
    ratio, rule = excess(best)
    return {"tensor": best.get("tensor"), "ratio": ratio, "rule": rule}


def classify(record: dict) -> tuple[str, Optional[str], Optional[dict]]:
    """A cell's class from its record: ``(class, reason, worst)``.

    - ``skipped``: unsupported, with the refusal.
    - ``oom`` and ``timeout``: themselves, with the record's reason.
    - ``error``: a peer (``Variant.peer``) whose rank raised an exception is unsupported, with
      that exception's own text (``RuntimeError: FlashAttention only supports ...``); anything
      else (ringbench's variants, a crashed launch) is an error.
    - ``ok`` with every check passed: correct; worst is the check nearest its allowance.
    - otherwise (``fail``): mismatch, worst the failing check with the largest ratio; a failure
      without a failing tensor (context parallelism not active) keeps the record's reason.
    """
    from ringbench.records import build as records
    from ringbench.variants import VARIANTS

    status, reason = record.get("status"), record.get("reason")
    if status == "skipped":
        return "unsupported", reason, None
    if status in ("oom", "timeout"):
        return status, reason, None
    if status == "error":
        variant = VARIANTS.get((record.get("spec") or {}).get("variant"))
        first = (reason or "").splitlines()[0] if reason else ""
        if variant is not None and variant.peer and _RANK_PREFIX.match(first):
            return "unsupported", _RANK_PREFIX.sub("", first), None
        return "error", reason, None
    checks = record.get("checks") or []
    if status == "ok" and checks and all(records.check_passed(c) for c in checks):
        return "correct", None, _worst(checks)
    if status == "ok" and not checks:
        return "error", "the verify record holds no checks", None
    failing = [c for c in checks if not records.check_passed(c)]
    if failing:
        worst = _worst(failing, failing=True)
        return "mismatch", reason or f"{worst['tensor']} failed", worst
    return "mismatch", reason or "verify failed with every tensor within tolerance", _worst(checks)


