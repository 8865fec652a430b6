"""The measured values compare can show, their spread, and how a table writes them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from ringbench.errors import CompareError
from ringbench.present.formatting import MISSING, decimals, not_measured


@dataclass(frozen=True)
class Metric:
    """A measured value compare can show.

    Attributes:
        name: what the user types (``tflops``).
        column: the record field it reads (``tflops_per_gpu``).
        label: axis and table title, with the unit.
        digits: decimals shown in tables.
        higher_is_better: the direction of an improvement.
    """

    name: str
    column: str
    label: str
    digits: int
    higher_is_better: bool


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("tflops", "tflops_per_gpu", "TFLOP/s per GPU", 1, True),
    Metric("efficiency", "efficiency", "efficiency (vs. the kernel on one rank's share)", 3, True),
    Metric("time", "time_ms", "time per iteration (ms, slowest rank)", 3, False),
    Metric("memory", "peak_allocated_gib", "peak memory allocated (GiB, max over ranks)", 2, False),
)}


def get_metric(name: str) -> Metric:
    """The :class:`Metric` called ``name``.

    Raises:
        CompareError: an unknown name; the message lists the known ones.
    """
    try:
        return METRICS[name]
    except KeyError:
        raise CompareError(f"metric {name!r} is unknown; pass --metric with one of "
                           f"{', '.join(METRICS)}") from None


def format_value(metric: Metric, value: Any) -> str:
    """A value of ``metric`` with its decimals (see :func:`ringbench.present.formatting.decimals`);
    :data:`ringbench.present.formatting.MISSING` for None and NaN (not measured)."""
    if not_measured(value):
        return MISSING
    return decimals(value, metric.digits)


def _number(value: Any) -> float | None:
    """A finite number from a record or a frame row, else None (absent, NaN, text)."""
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def spread_of(metric: Metric, row: Mapping[str, Any]) -> tuple[float, float] | None:
    """The p20 and p80 of ``metric`` in one record (a dict or a frame row), or None where the
    metric has no spread or the record lacks the quantiles (written before issue 25).

    ``time``: ``time_ms_p20`` and ``time_ms_p80``, each the slowest rank's at that quantile.
    ``tflops``: derived from them, as TFLOP/s is FLOPs over time: its p20 is
    ``tflops_per_gpu * time_ms / time_ms_p80``, its p80 ``tflops_per_gpu * time_ms / time_ms_p20``.
    ``efficiency`` and ``memory``: None (efficiency's spread would mix the variant's with the
    reference's; memory is one peak).

    Returns:
        ``(p20, p80)`` in the metric's unit, ``p20 <= p80``.
    """
    p50, p20, p80 = (_number(row.get(c)) for c in ("time_ms", "time_ms_p20", "time_ms_p80"))
    if p50 is None or p20 is None or p80 is None or metric.name not in ("time", "tflops"):
        return None
    if metric.name == "time":
        return p20, p80
    tflops = _number(row.get(metric.column))
    if tflops is None or p20 <= 0 or p80 <= 0:
        return None
    return tflops * p50 / p80, tflops * p50 / p20


def spread_text(metric: Metric, spread: tuple[float, float] | None) -> str:
    """``±0.4``: half the p20-p80 range with the metric's decimals, or ``""`` without a spread."""
    if spread is None:
        return ""
    return "±" + decimals((spread[1] - spread[0]) / 2, metric.digits)
