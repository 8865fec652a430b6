"""The measured values compare can show, and how a table writes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
