"""The regression gate: a candidate's run records against a baseline's, case by case.

The sides are matched on ``case_id`` (the spec without iters, warmup and seed), taking each
side's latest record of a case whatever its status. A threshold such as ``tflops:-5%`` fails
a matched case whose TFLOP/s dropped by more than 5%; ``time:+5%`` one whose time grew by more
than 5%. A case ok in the baseline that is not ok in the candidate (oom, timeout, error) fails
too. Cases found on one side only are listed and never fail the gate.

With ``beyond_spread`` (``--beyond-spread``), a crossed rule fails a case only where the two
sides' p20-p80 ranges (``metrics.spread_of``) do not overlap, the candidate's lying wholly on the
worse side: a change within the noise of the iteration times is reported ``ok (within spread)``.
A case where either side lacks the quantiles (records written before them, efficiency, memory)
is judged by the rule alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ringbench.present.compare.load import latest_records, python_value, varying_fields
from ringbench.present.compare.metrics import METRICS, Metric, get_metric, spread_of
from ringbench.errors import CompareError
from ringbench.present.formatting import MISSING


@dataclass(frozen=True)
class Threshold:
    """A ``--fail-if`` rule: fail when ``metric`` moves past ``limit_pct`` in its direction.

    ``limit_pct`` is signed: ``-5.0`` fails a drop of more than 5%, ``+5.0`` a rise of more
    than 5%.
    """

    metric: Metric
    limit_pct: float

    def text(self) -> str:
        """The rule as the user writes it: ``tflops:-5%``."""
        return f"{self.metric.name}:{self.limit_pct:+g}%"

    def regressed(self, change_pct: float) -> bool:
        """Whether a change (in %) goes past the limit."""
        return change_pct < self.limit_pct if self.limit_pct < 0 else change_pct > self.limit_pct

    def beyond_spread(self, baseline: tuple[float, float], candidate: tuple[float, float]) -> bool:
        """Whether the candidate's ``(p20, p80)`` lies wholly on the worse side of the baseline's."""
        if self.metric.higher_is_better:
            return candidate[1] < baseline[0]
        return candidate[0] > baseline[1]


_THRESHOLD_RE = re.compile(r"\s*([a-z_]+)\s*:\s*([+-])\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*")


def parse_threshold(text: str) -> Threshold:
    """Parse ``tflops:-5%`` or ``time:+10%``.

    Raises:
        CompareError: not METRIC:[+-]N%, an unknown metric, a zero limit, a limit in the direction
            of an improvement (``tflops:+5%``, ``time:-5%``), or a drop of 100% or more.
    """
    match = _THRESHOLD_RE.fullmatch(text)
    if match is None:
        raise CompareError(f"--fail-if {text!r} is not METRIC:[+-]N%; write, for example, tflops:-5% (fail when "
                           "TFLOP/s drop more than 5%) or time:+5% (fail when time grows more than 5%)")
    name, sign, number = match.groups()
    if name not in METRICS:
        raise CompareError(f"--fail-if {text!r} names the metric {name!r}, which is unknown; use one of "
                           f"{', '.join(METRICS)}, such as tflops:-5% or time:+5%")
    metric = METRICS[name]
    limit = float(number) * (-1 if sign == "-" else 1)
    if limit == 0:
        raise CompareError(f"--fail-if {text!r} has a zero limit; give the change that is tolerated, such as "
                           f"{name}:{sign}5%")
    # a regression is a fall of a higher-is-better metric and a rise of a lower-is-better one
    worse = "-" if metric.higher_is_better else "+"
    if sign != worse:
        went = "rise" if sign == "+" else "fall"
        raise CompareError(f"--fail-if {text!r} would fail on a {went} of {name}, which is an improvement, and "
                           f"never on a regression; write {name}:{worse}{number}% to fail when {name} gets worse "
                           f"by more than {number}%")
    if limit <= -100:
        raise CompareError(f"--fail-if {text!r} can never fire: {name} cannot drop by more than 100%; give a "
                           f"limit under 100%, such as {name}:-5%")
    return Threshold(metric, limit)


@dataclass
class GateRow:
    """One matched case.

    Attributes:
        case_id: the case.
        fields: its varying spec fields (short names).
        values: metric name -> (baseline, candidate, change in %); None where not comparable.
        verdicts: metric name -> ``ok``, ``ok (within spread)`` (``--beyond-spread``: the rule
            was crossed within the spread), ``REGRESSED``, ``n/a`` (no value to compare), ``-``
            (no rule on this metric), or a status such as ``REGRESSED: candidate oom``.
        regressed: whether the case fails the gate.
        spreads: metric name -> (baseline's, candidate's) ``(p20, p80)``, each None where that
            record has none.
    """

    case_id: str
    fields: dict[str, Any]
    values: dict[str, tuple[Any, Any, Any]]
    verdicts: dict[str, str]
    regressed: bool
    spreads: dict[str, tuple[Any, Any]] = field(default_factory=dict)


@dataclass
class GateResult:
    """The outcome of :func:`gate`.

    Attributes:
        rows: matched cases, ordered by their fields.
        only_baseline, only_candidate: (case_id, fields) of unmatched cases.
        fields: the case fields shown (those that vary).
        metrics: the metrics shown.
        thresholds: the rules applied.
        beyond_spread: whether a crossed rule needs the spreads apart too (module docstring).
    """

    rows: list[GateRow]
    only_baseline: list[tuple[str, dict]]
    only_candidate: list[tuple[str, dict]]
    fields: list[str]
    metrics: list[Metric]
    thresholds: list[Threshold]
    beyond_spread: bool = False

    @property
    def regressions(self) -> int:
        """How many matched cases fail the gate."""
        return sum(r.regressed for r in self.rows)


def _verdict(change: float | None, base_status: Any, cand_status: Any, rule: Threshold | None,
             spreads: tuple[Any, Any] | None = None) -> tuple[str, bool]:
    """(verdict, regressed) of one metric of a matched case: its change in %, the statuses of
    both sides, the rule on the metric (None: no rule) and, under ``--beyond-spread``, both
    sides' ``(p20, p80)`` (None: the rule alone); see :class:`GateRow`."""
    if base_status != "ok":
        return f"baseline {base_status}: not compared", False
    if cand_status != "ok":
        return f"REGRESSED: candidate {cand_status}", True
    if rule is None:
        return MISSING, False
    if change is None:
        return "n/a", False
    if rule.regressed(change):
        if spreads is not None and None not in spreads and not rule.beyond_spread(*spreads):
            return "ok (within spread)", False
        return "REGRESSED", True
    return "ok", False


def gate(baseline: Sequence[Path | str], candidate: Sequence[Path | str], thresholds: Sequence[Threshold], *,
         metric: str = "tflops", where: str | None = None, beyond_spread: bool = False) -> GateResult:
    """Compare a candidate's run records with a baseline's, case by case.

    Args:
        baseline, candidate: ``.jsonl`` files or folders.
        thresholds: the ``--fail-if`` rules; none: only the changes of ``metric`` are shown.
        metric: the metric shown when there is no threshold.
        where: a pandas query applied to both sides.
        beyond_spread: a crossed rule fails a case only where the sides' p20-p80 ranges are
            apart, the candidate's on the worse side (module docstring).

    Returns:
        A :class:`GateResult`.

    Raises:
        CompareError: a side without run records, a bad ``where``, no case in common, or a
            threshold on a metric that no matched case has on both sides.
    """
    base = latest_records(baseline, where)
    cand = latest_records(candidate, where)
    import pandas as pd

    metrics = list(dict.fromkeys(t.metric for t in thresholds)) or [get_metric(metric)]
    rules = {t.metric.name: t for t in thresholds}
    union = pd.concat([base, cand], ignore_index=True)
    union.attrs["aliases"] = list(dict.fromkeys([*base.attrs.get("aliases", []), *cand.attrs.get("aliases", [])]))
    union.attrs["added"] = []
    fields = varying_fields(union) or ["variant", "kernel"]

    def info(row) -> dict:
        return {f: python_value(row.get(f)) for f in fields}

    base_by_id = {row["case_id"]: row for _, row in base.iterrows()}
    rows: list[GateRow] = []
    both_ok: list[int] = []  # indices of the rows ok on both sides
    only_candidate = []
    for _, c in cand.iterrows():
        b = base_by_id.get(c["case_id"])
        if b is None:
            only_candidate.append((c["case_id"], info(c)))
            continue
        values: dict[str, tuple[Any, Any, Any]] = {}
        verdicts: dict[str, str] = {}
        spreads: dict[str, tuple[Any, Any]] = {}
        regressed = False
        for m in metrics:
            bv, cv = python_value(b.get(m.column)), python_value(c.get(m.column))
            comparable = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (bv, cv)) and bv != 0
            values[m.name] = (bv, cv, (cv - bv) / abs(bv) * 100 if comparable else None)
            spreads[m.name] = (spread_of(m, b), spread_of(m, c))
            verdicts[m.name], failed = _verdict(values[m.name][2], b.get("status"), c.get("status"),
                                                rules.get(m.name), spreads[m.name] if beyond_spread else None)
            regressed = regressed or failed
        if b.get("status") == "ok" and c.get("status") == "ok":
            both_ok.append(len(rows))
        rows.append(GateRow(case_id=c["case_id"], fields=info(c), values=values, verdicts=verdicts,
                            regressed=regressed, spreads=spreads))
    cand_ids = set(cand["case_id"])
    only_baseline = [(row["case_id"], info(row)) for _, row in base.iterrows() if row["case_id"] not in cand_ids]
    if not rows:
        raise CompareError(f"no case of the candidate ({len(cand)}) matches a case of the baseline ({len(base)}) "
                           "by case_id, so nothing was compared; pass results of the same scenario")
    for t in thresholds:
        # a rule that no case ok on both sides can be judged by would pass a gate that checked nothing
        if both_ok and not any(rows[i].values[t.metric.name][2] is not None for i in both_ok):
            raise CompareError(f"--fail-if {t.text()!r} gates {t.metric.name}, but no matched case has "
                               f"{t.metric.column} on both sides, so every row would be n/a; gate a metric "
                               "the records have, such as tflops:-5% or time:+5%")

    def order(fields_of: dict) -> tuple:
        return tuple(_sort_key(fields_of[f]) for f in fields)

    rows.sort(key=lambda r: order(r.fields))
    only_baseline.sort(key=lambda c: order(c[1]))
    only_candidate.sort(key=lambda c: order(c[1]))
    return GateResult(rows=rows, only_baseline=only_baseline, only_candidate=only_candidate, fields=fields,
                      metrics=metrics, thresholds=list(thresholds), beyond_spread=beyond_spread)


def _sort_key(value: Any) -> tuple:
    """Numbers before text, each in its own order."""
    return (0, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, str(value))
