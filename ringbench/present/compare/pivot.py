"""The metric of each case in a grid (rows: panels and lines; columns: x), and who wins where."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ringbench.present.compare.load import check_columns, python_value, varying_fields
from ringbench.present.compare.metrics import Metric, get_metric, spread_of
from ringbench.errors import CompareError
from ringbench.case.fields import VARIANT_OPTIONS

if TYPE_CHECKING:
    import pandas

#: Panels of the plot, and the leading columns of the pivot: one per world size and mode.
PANEL_FIELDS = ("world_size", "mode")

#: Variant options that change the problem itself (a window or a mask changes the work): part
#: of the case's shape when rows compete, like seqlen, never one more configuration.
SHAPE_OPTIONS = ("window", "mask")


@dataclass
class Pivot:
    """The metric of each case in a grid: one row per line of the plot, one column per x.

    Attributes:
        table: DataFrame indexed by ``index`` (a MultiIndex), one column per x value (sorted),
            float values, NaN where a case was not measured.
        metric: what the values are.
        x: the column the columns come from.
        index: the row fields: panel fields, then ``by``, then other fields that vary.
        panels: the panel fields among ``index``.
        lines: the fields that name a line within a panel.
        low, high: the p20 and p80 of each cell (``metrics.spread_of``), shaped as ``table``;
            NaN where the record has no spread.
        all_predicted: every record is a prediction (``ringbench predict``); where only some
            are, ``predicted`` is one of the ``lines`` fields instead.
    """

    table: "pandas.DataFrame"
    metric: Metric
    x: str
    index: list[str]
    panels: list[str]
    lines: list[str]
    low: "pandas.DataFrame | None" = None
    high: "pandas.DataFrame | None" = None
    all_predicted: bool = False

    def rows(self) -> list[tuple[list[Any], list[Any]]]:
        """(index values, metric values) per row, as plain Python values (None: not measured)."""
        out = []
        for key, values in self.table.iterrows():
            key = key if isinstance(key, tuple) else (key,)
            out.append(([python_value(k) for k in key], [python_value(v) for v in values]))
        return out

    def spreads(self) -> list[list[tuple[float, float] | None]]:
        """Per row of :meth:`rows`, per column, the cell's ``(p20, p80)``, or None without one."""
        if self.low is None or self.high is None:
            return [[None] * len(self.table.columns) for _ in range(len(self.table))]
        out = []
        for (_, lows), (_, highs) in zip(self.low.iterrows(), self.high.iterrows()):
            row = []
            for lo, hi in zip(lows, highs):
                lo, hi = python_value(lo), python_value(hi)
                row.append(None if lo is None or hi is None else (lo, hi))
            out.append(row)
        return out

    def columns(self) -> list[Any]:
        """The x values of the columns, as plain Python values."""
        return [python_value(x) for x in self.table.columns]


def pivot(frame: "pandas.DataFrame", *, metric: str = "tflops", x: str = "seqlen",
          by: Sequence[str] = ("variant", "kernel")) -> Pivot:
    """Arrange ``metric`` by ``x`` (columns) against the panels and ``by`` (rows).

    Rows are keyed by the world size and mode (the plot's panels, less any that is ``x`` or
    in ``by``), then the ``by`` fields, then every other spec field that varies in
    ``frame``, so that no cell mixes two cases, then ``predicted`` where the frame holds both
    predicted and measured records, so a prediction never shares a cell with a measurement.

    Args:
        frame: one row per case, as :func:`ringbench.present.compare.load.load_runs` gives.
        metric: a name of :data:`ringbench.present.compare.metrics.METRICS`.
        x: the column across (``seqlen``, ``world_size``...).
        by: the fields that name a line; one that is also ``x`` is left out of them (so
            ``--x kernel`` works with the default ``--by variant,kernel``).

    Returns:
        A :class:`Pivot`.

    Raises:
        CompareError: an unknown metric, an ``x`` or ``by`` that is not a column, records
            without the metric's column, or no field left to name a row.
    """
    m = get_metric(metric)
    check_columns(frame, [x, *by], "--x" if x not in frame.columns else "--by")
    by = [name for name in by if name != x]  # the column across cannot also name a line
    if m.column not in frame.columns:
        raise CompareError(f"the records hold no {m.column}, so --metric {metric} has nothing to show; "
                           "pass records of `ringbench run`")
    panels = [f for f in PANEL_FIELDS if f != x and f not in by and f in frame.columns]
    lines = list(dict.fromkeys([*by, *varying_fields(frame, exclude=[x, *panels, *by])]))
    predicted = frame["predicted"].astype(bool) if "predicted" in frame.columns else None
    if predicted is not None and predicted.any() and not predicted.all():
        lines.append("predicted")  # a prediction is its own line, beside the measurement
    index = [*panels, *lines]
    if not index:
        raise CompareError(f"--x {x} leaves no field to name a row; pass --by with another field, such as kernel")
    data = frame[[*index, x, m.column]].copy()
    data[m.column] = data[m.column].astype(float)
    spreads = [spread_of(m, row) for _, row in frame.iterrows()]
    data["_p20"] = [s[0] if s else float("nan") for s in spreads]
    data["_p80"] = [s[1] if s else float("nan") for s in spreads]
    for name in index:  # a list-valued field (document lengths) cannot key a row as it is
        if data[name].map(lambda v: isinstance(v, (list, dict))).any():
            data[name] = data[name].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
    data = data.drop_duplicates(subset=[*index, x], keep="last")
    keyed = data.set_index([*index, x])
    table = keyed[m.column].unstack(x)
    table = table.reindex(sorted(table.columns), axis=1).sort_index()
    low, high = (keyed[c].astype(float).unstack(x).reindex(index=table.index, columns=table.columns)
                 for c in ("_p20", "_p80"))
    return Pivot(table=table, metric=m, x=x, index=index, panels=panels, lines=lines, low=low, high=high,
                 all_predicted=bool(predicted is not None and len(predicted) and predicted.all()))


@dataclass
class Contest:
    """Who wins each column among rows that differ only in their variant, and how each of
    ringbench's variants stands against the best peer (``Variant.peer``: torch_cp, rfa_*, yc_*).

    Attributes:
        winners: (row, column) positions holding the best value of their group and column.
        vs_peer: (row, column) -> this row's value over the best peer's in its group and
            column, turned so that above 1 is better (for time and memory: peer / row).
        best_factorization: (row, column) positions holding the best value among rows that
            differ only in ``ulysses_degree`` (usp's factorizations U x R of the world size,
            ``--ulysses-degree auto``), where at least two were measured.
    """

    winners: set[tuple[int, int]]
    vs_peer: dict[tuple[int, int], float]
    best_factorization: set[tuple[int, int]] = field(default_factory=set)


def contest(p: Pivot) -> Contest:
    """Compare rows that share every index field but ``variant`` and the variants' own options
    (:data:`ringbench.case.fields.VARIANT_OPTIONS`, less :data:`SHAPE_OPTIONS`: the same panel,
    kernel, shape, window and mask), column by column, so each variant's best configuration counts.

    Returns:
        A :class:`Contest`; empty when ``variant`` is not a row field.
    """
    from ringbench.variants import VARIANTS

    result = Contest(set(), {})
    if "variant" not in p.index:
        return result
    at = p.index.index("variant")
    shared = [n for n, name in enumerate(p.index) if name != "variant"
              and (name not in VARIANT_OPTIONS or name in SHAPE_OPTIONS)]
    groups: dict[tuple, list[int]] = {}
    rows = p.rows()
    for i, (key, _) in enumerate(rows):
        groups.setdefault(tuple(key[n] for n in shared), []).append(i)
    better = max if p.metric.higher_is_better else min
    for members in groups.values():
        is_peer = {i: getattr(VARIANTS.get(rows[i][0][at]), "peer", False) for i in members}
        for j in range(len(p.table.columns)):
            values = {i: rows[i][1][j] for i in members if rows[i][1][j] is not None}
            if len(values) < 2:
                continue
            best = better(values.values())
            result.winners.update((i, j) for i, v in values.items() if v == best)
            peers = [v for i, v in values.items() if is_peer[i]]
            if not peers or len(peers) == len(values):
                continue
            peer = better(peers)
            for i, v in values.items():
                if not is_peer[i] and v and peer:
                    result.vs_peer[(i, j)] = v / peer if p.metric.higher_is_better else peer / v
    _mark_factorizations(p, result, better)
    return result


def _mark_factorizations(p: Pivot, result: Contest, better) -> None:
    """Fill ``result.best_factorization``: the best of rows that differ only in ``ulysses_degree``."""
    if "ulysses_degree" not in p.index:
        return
    at = p.index.index("ulysses_degree")
    groups: dict[tuple, list[int]] = {}
    rows = p.rows()
    for i, (key, _) in enumerate(rows):
        if key[at]:  # 0: a variant without a Ulysses degree
            groups.setdefault(tuple(v for n, v in enumerate(key) if n != at), []).append(i)
    for members in groups.values():
        for j in range(len(p.table.columns)):
            values = {i: rows[i][1][j] for i in members if rows[i][1][j] is not None}
            if len(values) >= 2:
                best = better(values.values())
                result.best_factorization.update((i, j) for i, v in values.items() if v == best)
