"""``ringbench compare``: result records as a pivot table, a plot, and a regression gate.

Everything here reads the records of ringbench/CONTRACTS.md through :func:`ringbench.results.load`
and imports no torch; pandas and matplotlib are imported inside the functions that need them.

Which records count. Only ``run`` records with status ``ok``; the others are counted and
reported as left out. When one case (one ``case_id``) has several ok records, across files
or reruns, the latest (``created_at``) stands for it, unless a ``--by`` column that is not a
spec field (``source``, ``run_id``, ``env.torch``) tells them apart.

Columns. Records are flattened (``spec.seqlen``, ``env.torch``); every ``spec.<field>`` is
also there under its short name (``seqlen``, ``world_size``, ``variant``, ``heads``...), so
``--where``, ``--x`` and ``--by`` can use either. ``kernel`` is the kernel that ran.

The regression gate matches the baseline's and the candidate's cases on ``case_id`` (the spec
without iters, warmup and seed), taking each side's latest record of a case whatever its
status. A threshold such as ``tflops:-5%`` fails a matched case whose TFLOP/s dropped by
more than 5%; ``time:+5%`` one whose time grew by more than 5%. A case ok in the baseline
that is not ok in the candidate (oom, timeout, error) fails too. Cases found on one side
only are listed and never fail the gate.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ringbench.spec import plural

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure


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

#: Spec fields that choose how a variant runs, not the problem: compared within one group.
VARIANT_OPTIONS = ("layout", "heads_k_stride", "rotate")
#: Spec fields that do not tell cases apart (case_id leaves them out).
_NOT_CASE_FIELDS = ("task", "iters", "warmup", "seed")
#: Panels of the plot, and the leading columns of the pivot: one per world size and mode.
PANEL_FIELDS = ("world_size", "mode")
_MISSING = "-"


class CompareError(ValueError):
    """A compare request that cannot be served (bad option, no records); one sentence with the fix."""


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


# --------------------------------------------------------------------------- loading

@dataclass
class Loaded:
    """Records ready to compare.

    Attributes:
        frame: one row per case (see the module docstring), flattened, short names added.
        left_out: why other records were left out -> how many.
        aliases: the short names of the ``spec.<field>`` columns (``seqlen``...).
    """

    frame: "pandas.DataFrame"
    left_out: dict[str, int] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)

    def left_out_text(self) -> str | None:
        """``left out 3 records: 2 with status oom, 1 verify record``, or None."""
        total = sum(self.left_out.values())
        if not total:
            return None
        parts = ", ".join(f"{n} {why}" for why, n in self.left_out.items())
        return f"left out {plural(total, 'record')}: {parts}"



def read_frame(paths: Sequence[Path | str]) -> "pandas.DataFrame":
    """Every record under ``paths`` (files or folders), flattened, with short spec names.

    Raises:
        CompareError: a path that does not exist, or no record at all.
    """
    from ringbench import results

    try:
        frame = results.load(list(paths))
    except FileNotFoundError as exc:
        raise CompareError(str(exc)) from None
    if frame.empty:
        raise CompareError(f"no records found in {', '.join(map(str, paths))}; pass .jsonl files or folders "
                           "that `ringbench run` wrote")
    frame = frame.copy()
    from ringbench.spec import optional_field_defaults

    # Records written before an optional field existed lack it: they hold its default.
    for name, default in optional_field_defaults().items():
        column = f"spec.{name}"
        frame[column] = frame[column].fillna(default) if column in frame.columns else default
    added = []
    for column in [c for c in frame.columns if c.startswith("spec.")]:
        short = column[len("spec."):]
        if short not in frame.columns:
            frame[short] = frame[column]
            added.append(short)
    frame.attrs["aliases"] = [c[len("spec."):] for c in frame.columns if c.startswith("spec.")]
    frame.attrs["added"] = added
    return frame


def apply_where(frame: "pandas.DataFrame", where: str | None) -> "pandas.DataFrame":
    """Rows of ``frame`` for which the pandas query ``where`` holds (all when None).

    Raises:
        CompareError: an expression pandas cannot evaluate, or one that is not a condition.
    """
    if not where:
        return frame
    try:
        mask = frame.eval(where)
    except Exception as exc:  # pandas raises SyntaxError, UndefinedVariableError, TypeError, ...
        detail = " ".join(str(exc).split()) or type(exc).__name__
        detail = detail if len(detail) <= 100 else detail[:99] + "…"
        raise CompareError(f"--where {where!r} could not be evaluated ({detail}); write a pandas query on the "
                           "record columns, such as 'world_size == 2 and seqlen >= 16384'") from None
    import pandas as pd

    # Not getattr(mask, "dtype"): the records have a column of that name.
    if not isinstance(mask, pd.Series) or not pd.api.types.is_bool_dtype(mask.dtype):
        raise CompareError(f"--where {where!r} is not a condition on the records; write a comparison such as "
                           "'world_size == 2'")
    return frame[mask.fillna(False).astype(bool)]


def load_runs(paths: Sequence[Path | str], *, where: str | None = None, keep_apart: Iterable[str] = ()
              ) -> Loaded:
    """The ok ``run`` records under ``paths``, filtered by ``where``, one per case.

    Args:
        paths: ``.jsonl`` files and folders.
        where: a pandas query on the columns (see the module docstring), or None.
        keep_apart: columns that are not spec fields but keep two records of one case apart
            (a ``--by source`` column); spec columns among them are ignored.

    Returns:
        A :class:`Loaded`; its frame has at least one row.

    Raises:
        CompareError: no path, no records, a bad ``where``, or no ok run record left.
    """
    frame = read_frame(paths)
    _check_columns(frame, keep_apart, "--by")
    left_out: dict[str, int] = {}
    tasks = frame["task"] if "task" in frame.columns else frame.get("spec.task")
    if tasks is not None:
        others = tasks != "run"
        for task, n in tasks[others].value_counts(dropna=False).items():
            left_out[f"{task} record{'s' if n != 1 else ''}"] = int(n)
        frame = frame[~others]
    status = frame["status"] if "status" in frame.columns else None
    if status is not None:
        bad = status != "ok"
        for value, n in status[bad].value_counts(dropna=False).items():
            left_out[f"with status {value}"] = int(n)
        frame = frame[~bad]
    frame = apply_where(frame, where)
    if frame.empty:
        left = f" (left out first: {', '.join(f'{n} {why}' for why, n in left_out.items())})" if left_out else ""
        matching = f" matches --where {where!r}" if where else ""
        raise CompareError(f"no ok run record in {', '.join(map(str, paths))}{matching}{left}; pass the results "
                           f"of `ringbench run`{' or loosen --where' if where else ''}")
    frame, dropped = _latest_per_case(frame, [k for k in keep_apart if not _is_spec(frame, k)])
    if dropped:
        left_out["older records of a case shown with its latest"] = dropped
    return Loaded(frame=frame, left_out=left_out, aliases=list(frame.attrs.get("aliases", [])))


def _is_spec(frame: "pandas.DataFrame", column: str) -> bool:
    return column.startswith("spec.") or f"spec.{column}" in frame.columns or column == "kernel"


def _latest_per_case(frame: "pandas.DataFrame", apart: list[str]) -> tuple["pandas.DataFrame", int]:
    """Keep the latest record of each case_id (and ``apart`` value); returns (frame, dropped)."""
    if "case_id" not in frame.columns:
        return frame, 0
    keys = ["case_id", *apart]
    ordered = frame.sort_values("created_at", kind="stable") if "created_at" in frame.columns else frame
    kept = ordered.drop_duplicates(subset=keys, keep="last")
    return kept.sort_index(), len(frame) - len(kept)


def _check_columns(frame: "pandas.DataFrame", names: Iterable[str], option: str) -> None:
    aliases = frame.attrs.get("aliases", [])
    for name in names:
        if name not in frame.columns:
            raise CompareError(f"{option} {name!r} is not a record column; use a spec field ({', '.join(aliases)}) "
                               "or a flattened column such as source or env.torch")


def varying_fields(frame: "pandas.DataFrame", exclude: Iterable[str] = ()) -> list[str]:
    """Short spec fields that take more than one value in ``frame``, in spec order."""
    exclude = set(exclude) | set(_NOT_CASE_FIELDS)
    out = []
    for name in frame.attrs.get("aliases", []):
        if name in exclude or name not in frame.columns:
            continue
        values = frame[name].dropna()
        if values.astype(str).nunique() > 1:
            out.append(name)
    return out


# --------------------------------------------------------------------------- pivot

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
    """

    table: "pandas.DataFrame"
    metric: Metric
    x: str
    index: list[str]
    panels: list[str]
    lines: list[str]


def pivot(frame: "pandas.DataFrame", *, metric: str = "tflops", x: str = "seqlen",
          by: Sequence[str] = ("variant", "kernel")) -> Pivot:
    """Arrange ``metric`` by ``x`` (columns) against the panels and ``by`` (rows).

    Rows are keyed by the world size and mode (the plot's panels, less any that is ``x`` or
    in ``by``), then the ``by`` fields, then every other spec field that varies in
    ``frame``, so that no cell mixes two cases.

    Args:
        frame: one row per case, as :func:`load_runs` gives.
        metric: a name of :data:`METRICS`.
        x: the column across (``seqlen``, ``world_size``...).
        by: the fields that name a line.

    Returns:
        A :class:`Pivot`.

    Raises:
        CompareError: an unknown metric, or an ``x`` or ``by`` that is not a column.
    """
    m = get_metric(metric)
    _check_columns(frame, [x, *by], "--x" if x not in frame.columns else "--by")
    if m.column not in frame.columns:
        raise CompareError(f"the records hold no {m.column}, so --metric {metric} has nothing to show; "
                           "pass records of `ringbench run`")
    panels = [f for f in PANEL_FIELDS if f != x and f not in by and f in frame.columns]
    lines = list(dict.fromkeys([*by, *varying_fields(frame, exclude=[x, *panels, *by])]))
    index = [*panels, *lines]
    data = frame[[*index, x, m.column]].copy()
    data[m.column] = data[m.column].astype(float)
    for name in index:  # a list-valued field (document lengths) cannot key a row as it is
        if data[name].map(lambda v: isinstance(v, (list, dict))).any():
            data[name] = data[name].map(lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v)
    data = data.drop_duplicates(subset=[*index, x], keep="last")
    table = data.set_index([*index, x])[m.column].unstack(x)
    table = table.reindex(sorted(table.columns), axis=1).sort_index()
    return Pivot(table=table, metric=m, x=x, index=index, panels=panels, lines=lines)


def format_x(x: str, value: Any) -> str:
    """A column heading: seqlens as ``16k``, other values as they are."""
    if x == "seqlen" and isinstance(value, (int, float)) and float(value).is_integer():
        from ringbench.spec import format_size

        return format_size(int(value))
    return _plain(value)


def _plain(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return _MISSING
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def format_value(metric: Metric, value: Any) -> str:
    """A metric value with the metric's decimals, or 3 significant digits when that would
    show a small non-zero value (a CPU's TFLOP/s) as 0; ``-`` for missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return _MISSING
    if value and abs(value) < 10 ** -metric.digits * 10:
        return f"{value:.3g}"
    return f"{value:.{metric.digits}f}"


def _rows(p: Pivot) -> list[tuple[list[Any], list[Any]]]:
    """(index values, metric values) per row, as plain Python values."""
    rows = []
    for key, values in p.table.iterrows():
        key = key if isinstance(key, tuple) else (key,)
        rows.append(([_py(k) for k in key], [_py(v) for v in values]))
    return rows


def _py(value: Any) -> Any:
    """numpy scalars to Python, NaN to None."""
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


@dataclass
class Contest:
    """Who wins each column among rows that differ only in their variant, and how each of
    ringbench's variants stands against the best peer (``Variant.peer``: torch_cp, rfa_*).

    Attributes:
        winners: (row, column) positions holding the best value of their group and column.
        vs_peer: (row, column) -> this row's value over the best peer's in its group and
            column, turned so that above 1 is better (for time and memory: peer / row).
    """

    winners: set[tuple[int, int]]
    vs_peer: dict[tuple[int, int], float]


def contest(p: Pivot) -> Contest:
    """Compare rows that share every index field but ``variant`` and the variants' own options
    (``VARIANT_OPTIONS``: the same panel, kernel and shape), column by column, so each variant's
    best configuration counts. Empty when ``variant`` is not a row field."""
    from ringbench.variants import VARIANTS

    result = Contest(set(), {})
    if "variant" not in p.index:
        return result
    at = p.index.index("variant")
    shared = [n for n, name in enumerate(p.index) if name != "variant" and name not in VARIANT_OPTIONS]
    groups: dict[tuple, list[int]] = {}
    rows = _rows(p)
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
    return result


def _cell(p: Pivot, c: Contest, i: int, j: int, value: Any) -> str:
    text = format_value(p.metric, value)
    if (i, j) in c.vs_peer:
        text += f" ×{c.vs_peer[(i, j)]:.2f}"
    if not c.winners:
        return text
    return text + ("*" if (i, j) in c.winners else " ")  # the space keeps the digits aligned


def contest_legend(c: Contest) -> str | None:
    """The line that explains the marks, or ``None`` when there are none."""
    if not c.winners:
        return None
    legend = "* best of the variants (and their options) that share every other field"
    if c.vs_peer:
        legend += "; ×N: against the best peer variant (torch_cp, rfa_*) there, above 1 is better"
    return legend


def print_pivot(p: Pivot, console: Console | None = None) -> None:
    """Print the pivot as a rich table: the row fields, then one column per x value.

    The best value among rows that differ only in their variant is marked ``*``, and
    ringbench's variants show ``×N``, their value against the best peer's (see :func:`contest`).
    """
    console = console or Console()
    c = contest(p)
    # The title on its own line: a table title would wrap at the (narrow) table's width.
    console.print(Text(f"{p.metric.label} by {p.x}", style="italic"))
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    rows = _rows(p)
    for name in p.index:
        # Row labels may wrap; the numbers never shrink.
        table.add_column(name, overflow="fold")
    for j, value in enumerate(p.table.columns):
        header = format_x(p.x, _py(value))
        width = max([len(header), *(len(_cell(p, c, i, j, vals[j])) for i, (_, vals) in enumerate(rows))])
        table.add_column(header, justify="right", no_wrap=True, min_width=width)
    previous: list[Any] = []
    for i, (key, values) in enumerate(rows):
        # A panel's fields are written on its first row only, as a grouped table reads.
        shown = [("" if i < len(p.panels) and previous[:i + 1] == key[:i + 1] else _field_text(name, k))
                 for i, (name, k) in enumerate(zip(p.index, key))]
        table.add_row(*shown, *(_cell(p, c, i, j, v) for j, v in enumerate(values)),
                      end_section=False)
        previous = key
    console.print(table)
    legend = contest_legend(c)
    if legend:
        console.print(Text(legend, style="dim"))


def pivot_markdown(p: Pivot) -> str:
    """The pivot as a GitHub Markdown table (no dependency), with a title line."""
    c = contest(p)
    headers = [*p.index, *(format_x(p.x, _py(v)) for v in p.table.columns)]
    align = [":--"] * len(p.index) + ["--:"] * len(p.table.columns)
    lines = [f"**{p.metric.label} by {p.x}**", "", _md_row(headers), _md_row(align)]
    for i, (key, values) in enumerate(_rows(p)):
        lines.append(_md_row([*(_field_text(n, k) for n, k in zip(p.index, key)),
                              *(_cell(p, c, i, j, v) for j, v in enumerate(values))]))
    legend = contest_legend(c)
    # Escaped, so Markdown shows the star instead of starting a list.
    return "\n".join(lines + ([f"\n\\{legend}"] if legend else [])) + "\n"


def _md_row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def pivot_json_lines(p: Pivot) -> list[str]:
    """One JSON object per pivot row: the row fields, ``metric``, ``x``, ``values`` (x value
    as text -> the metric, null where not measured), ``best`` (the x values where the row is
    best of its group, see :func:`contest`) and ``vs_best_peer`` (x value -> ratio, for
    ringbench's variants where a peer was measured)."""
    c = contest(p)
    columns = [_plain(_py(x)) for x in p.table.columns]
    out = []
    for i, (key, values) in enumerate(_rows(p)):
        row = dict(zip(p.index, key))
        row.update(metric=p.metric.name, column=p.metric.column, x=p.x,
                   values=dict(zip(columns, values)),
                   best=[x for j, x in enumerate(columns) if (i, j) in c.winners],
                   vs_best_peer={x: round(c.vs_peer[(i, j)], 4) for j, x in enumerate(columns)
                                 if (i, j) in c.vs_peer})
        out.append(json.dumps(row))
    return out


# --------------------------------------------------------------------------- plot

def _environment(frame: "pandas.DataFrame") -> str:
    """``2 x NVIDIA H200 · torch 2.11.0+cu130 · CUDA 13.0 · NCCL 2.28.9 · ringbench 0.1.0``."""
    def values(column: str) -> list[str]:
        if column not in frame.columns:
            return []
        return sorted({str(v) for v in frame[column].dropna()})

    devices = []
    for device in values("device") or ["cuda"]:
        rows = frame[frame["device"] == device] if "device" in frame.columns else frame
        if device == "cpu":
            devices.append("CPU (gloo)")
            continue
        names = sorted({str(v) for v in rows.get("env.gpu_name", []) if isinstance(v, str)}) or ["GPU"]
        counts = sorted({int(v) for v in rows.get("env.gpu_count", []) if isinstance(v, (int, float))
                         and not math.isnan(v)})
        count = f"{'/'.join(map(str, counts))} x " if counts else ""
        devices.append(count + " / ".join(names))
    parts = [" + ".join(devices)]
    for column, name in (("env.torch", "torch"), ("env.cuda", "CUDA"), ("env.nccl", "NCCL"),
                         ("env.ringbench", "ringbench")):
        found = values(column)
        if found:
            parts.append(f"{name} {' / '.join(found)}")
    dates = sorted({str(v)[:10] for v in frame.get("created_at", []) if isinstance(v, str)})
    if dates:
        parts.append(dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}")
    return " · ".join(parts)


def _shape(frame: "pandas.DataFrame", shown: Iterable[str]) -> str:
    """The spec fields common to every row, such as ``32 heads, 8 KV heads, head dim 128, bf16,
    causal, batch 1``."""
    def one(column: str) -> Any:
        if column in shown or column not in frame.columns:
            return None
        values = {str(v) for v in frame[column].dropna()}
        return frame[column].dropna().iloc[0] if len(values) == 1 else None

    parts = []
    if one("heads") is not None:
        parts.append(f"{_plain(one('heads'))} heads")
    if one("kv_heads") is not None:
        parts.append(f"{_plain(one('kv_heads'))} KV heads")
    if one("head_dim") is not None:
        parts.append(f"head dim {_plain(one('head_dim'))}")
    if one("dtype") is not None:
        parts.append(str(one("dtype")))
    if one("causal") is not None:
        parts.append("causal" if bool(one("causal")) else "non-causal")
    if one("batch") is not None:
        parts.append(f"batch {_plain(one('batch'))}")
    return ", ".join(parts)


_MODE_WORDS = {"fwd": "forward", "fwd_bwd": "forward + backward"}
_X_WORDS = {"seqlen": "sequence length (tokens, all ranks)", "world_size": "world size (ranks)",
            "batch": "batch (sequences)"}


def _line_styles(line_keys: list[tuple]) -> dict[tuple, dict]:
    """Colour by the first line field (the variant), marker and dash by the rest (the kernel),
    so that lines of one variant read as a family; one field or many values: a colour each."""
    firsts = list(dict.fromkeys(k[0] for k in line_keys if k))
    rests = list(dict.fromkeys(k[1:] for k in line_keys if k))
    family = 1 < len(firsts) <= 10 and 1 < len(rests) <= 4
    markers, dashes = "os^Dv<>ph*", ["-", "--", "-.", ":"]
    out = {}
    for i, key in enumerate(line_keys):
        if family:
            c, r = firsts.index(key[0]), rests.index(key[1:])
            out[key] = dict(color=f"C{c}", marker=markers[r], linestyle=dashes[r])
        else:
            out[key] = dict(color=f"C{i % 10}", marker=markers[i % len(markers)], linestyle="-")
    return out


def _ticks(xs: list[float], log2: bool) -> list[float]:
    """The measured x values, plus every power of two between them on a log2 axis, so that
    the spacing reads as doubling (8k 16k 32k 64k 128k even when 32k was not measured)."""
    ticks = set(xs)
    if log2 and xs:
        power = 2 ** math.floor(math.log2(min(xs)))
        while power <= max(xs):
            if power >= min(xs):
                ticks.add(float(power))
            power *= 2
    return sorted(ticks)


def _panel_title(panels: list[str], key: tuple) -> str:
    words = []
    for name, value in zip(panels, key):
        if name == "world_size":
            words.append(f"world size {_plain(value)}")
        elif name == "mode":
            words.append(_MODE_WORDS.get(value, str(value)))
        else:
            words.append(f"{name} {_plain(value)}")
    return ", ".join(words)


def plot(p: Pivot, frame: "pandas.DataFrame", path: Path | str | None = None) -> "Figure":
    """Draw the pivot: the metric against x, one panel per world size and mode, one line per row.

    Panels are laid out with one row of panels per world size and one column per mode. The
    x axis is log2 with a tick at each measured value (``8k``, ``16k``...); lines keep their
    colour and marker across panels, and one legend below names them. The title gives the
    metric, the common shape, the device and the software versions. An efficiency plot
    draws the ideal, 1.0, as a dotted line.

    Args:
        p: the pivot to draw.
        frame: the records it came from, for the title.
        path: where to save it (``.png``, ``.svg`` or ``.pdf``); None: do not save.

    Returns:
        The matplotlib Figure (Agg canvas; no pyplot, so no global state).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    rows = _rows(p)
    n_panel = len(p.panels)
    panel_keys = list(dict.fromkeys(tuple(key[:n_panel]) for key, _ in rows))
    line_keys = list(dict.fromkeys(tuple(key[n_panel:]) for key, _ in rows))
    if "world_size" in p.panels and "mode" in p.panels and n_panel == 2:
        grid_rows = list(dict.fromkeys(k[0] for k in panel_keys))
        grid_cols = list(dict.fromkeys(k[1] for k in sorted(panel_keys, key=lambda k: str(k[1]))))
        place = {k: (grid_rows.index(k[0]), grid_cols.index(k[1])) for k in panel_keys}
    else:
        grid_rows, grid_cols = [None], panel_keys or [()]
        place = {k: (0, i) for i, k in enumerate(panel_keys)}
    n_rows, n_cols = len(grid_rows), len(grid_cols)

    # At least 9 in wide, so the title and a legend of many lines fit over one panel.
    fig = Figure(figsize=(max(4.6 * n_cols + 0.6, 9.0), 3.4 * n_rows + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    # TFLOP/s and efficiency read across panels on one scale; time and memory span decades.
    share = p.metric.name in ("tflops", "efficiency")
    axes: dict = {}
    for k, (r, c) in sorted(place.items(), key=lambda item: item[1]):
        first = next(iter(axes.values()), None)
        axes[k] = fig.add_subplot(n_rows, n_cols, r * n_cols + c + 1, sharey=first if share else None)
    xs = [float(_py(v)) for v in p.table.columns]
    log2 = all(v > 0 for v in xs)
    style = _line_styles(line_keys)
    handles = {}
    for key, values in rows:
        panel, line = tuple(key[:n_panel]), tuple(key[n_panel:])
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not pts:
            continue
        # An optional field left at its default ("") adds nothing to the label.
        label = " / ".join(t for t in (_field_text(n, v) for n, v in zip(p.lines, line)) if t) or p.metric.name
        (handle,) = axes[panel].plot([x for x, _ in pts], [v for _, v in pts], label=label, linewidth=1.6,
                                     markersize=5, **style[line])
        handles.setdefault(label, handle)
    ticks = _ticks(xs, log2)
    for key, ax in axes.items():
        if log2:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(ticks, [format_x(p.x, int(t) if float(t).is_integer() else t) for t in ticks])
        ax.set_xlim(min(xs) / 1.25 if log2 else None, max(xs) * 1.25 if log2 else None)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title(_panel_title(p.panels, key) if p.panels else "", fontsize=10)
        r, c = place[key]
        if r == n_rows - 1:
            ax.set_xlabel(_X_WORDS.get(p.x, p.x))
        if c == 0 or not share:
            ax.set_ylabel(p.metric.label if len(p.metric.label) < 40 else p.metric.label.split(" (")[0])
        if p.metric.name == "efficiency":
            ax.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="_ideal")
            ax.annotate("ideal", (0.01, 1.0), xycoords=("axes fraction", "data"), xytext=(2, 2),
                        textcoords="offset points", fontsize=8, color="grey")
            top = max([1.0, *(v for _, vs in rows for v in vs if v is not None)])
            ax.set_ylim(0, top * 1.1)
        elif p.metric.name == "time":
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    shape = _shape(frame, [*p.index, p.x])
    title = f"{p.metric.label}" + (f"  ·  {shape}" if shape else "")
    fig.suptitle(f"{title}\n{_environment(frame)}", fontsize=10)
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncols=min(len(handles), 4), title=" / ".join(p.lines) or None, fontsize=9, title_fontsize=9,
                   frameon=False)
    if path is not None:
        fig.savefig(path, dpi=150, bbox_inches="tight")  # never clip the title or the legend
    return fig


# --------------------------------------------------------------------------- regression gate

@dataclass(frozen=True)
class Threshold:
    """A ``--fail-if`` rule: fail when ``metric`` moves past ``limit_pct`` in its direction.

    ``limit_pct`` is signed: ``-5.0`` fails a drop of more than 5%, ``+5.0`` a rise of more
    than 5%.
    """

    metric: Metric
    limit_pct: float

    def text(self) -> str:
        return f"{self.metric.name}:{self.limit_pct:+g}%"

    def regressed(self, change_pct: float) -> bool:
        return change_pct < self.limit_pct if self.limit_pct < 0 else change_pct > self.limit_pct


_THRESHOLD_RE = re.compile(r"\s*([a-z_]+)\s*:\s*([+-])\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*")


def parse_threshold(text: str) -> Threshold:
    """Parse ``tflops:-5%`` or ``time:+10%``.

    Raises:
        CompareError: not METRIC:[+-]N%, an unknown metric, or a zero limit.
    """
    match = _THRESHOLD_RE.fullmatch(text)
    if match is None:
        raise CompareError(f"--fail-if {text!r} is not METRIC:[+-]N%; write, for example, tflops:-5% (fail when "
                           "TFLOP/s drop more than 5%) or time:+5% (fail when time grows more than 5%)")
    name, sign, number = match.groups()
    metric = get_metric(name)
    limit = float(number) * (-1 if sign == "-" else 1)
    if limit == 0:
        raise CompareError(f"--fail-if {text!r} has a zero limit; give the change that is tolerated, such as "
                           f"{name}:{sign}5%")
    return Threshold(metric, limit)


@dataclass
class GateRow:
    """One matched case.

    Attributes:
        case_id: the case.
        fields: its varying spec fields (short names).
        values: metric name -> (baseline, candidate, change in %); None where not comparable.
        verdicts: metric name -> ``ok``, ``REGRESSED``, ``n/a`` (no value to compare), ``-``
            (no rule on this metric), or a status such as ``REGRESSED: candidate oom``.
        regressed: whether the case fails the gate.
    """

    case_id: str
    fields: dict[str, Any]
    values: dict[str, tuple[Any, Any, Any]]
    verdicts: dict[str, str]
    regressed: bool


@dataclass
class GateResult:
    """The outcome of :func:`gate`.

    Attributes:
        rows: matched cases, in the candidate's order.
        only_baseline, only_candidate: (case_id, fields) of unmatched cases.
        fields: the case fields shown (those that vary).
        metrics: the metrics shown.
        thresholds: the rules applied.
    """

    rows: list[GateRow]
    only_baseline: list[tuple[str, dict]]
    only_candidate: list[tuple[str, dict]]
    fields: list[str]
    metrics: list[Metric]
    thresholds: list[Threshold]

    @property
    def regressions(self) -> int:
        return sum(r.regressed for r in self.rows)


def _latest_records(paths: Sequence[Path | str], where: str | None) -> "pandas.DataFrame":
    """Run records under ``paths`` filtered by ``where``, the latest of each case_id, any status."""
    frame = read_frame(paths)
    if "task" in frame.columns:
        frame = frame[frame["task"] == "run"]
    frame = apply_where(frame, where)
    if frame.empty or "case_id" not in frame.columns:
        raise CompareError(f"no run record in {', '.join(map(str, paths))}"
                           f"{' matches --where ' + repr(where) if where else ''}; pass the results of "
                           "`ringbench run`")
    return _latest_per_case(frame, [])[0]


def gate(baseline: Sequence[Path | str], candidate: Sequence[Path | str], thresholds: Sequence[Threshold], *,
         metric: str = "tflops", where: str | None = None) -> GateResult:
    """Compare a candidate's run records with a baseline's, case by case.

    Args:
        baseline, candidate: ``.jsonl`` files or folders.
        thresholds: the ``--fail-if`` rules; none: only the changes of ``metric`` are shown.
        metric: the metric shown when there is no threshold.
        where: a pandas query applied to both sides.

    Returns:
        A :class:`GateResult`.

    Raises:
        CompareError: a side without run records, a bad ``where``, or no case in common.
    """
    base = _latest_records(baseline, where)
    cand = _latest_records(candidate, where)
    import pandas as pd

    metrics = list(dict.fromkeys(t.metric for t in thresholds)) or [get_metric(metric)]
    union = pd.concat([base, cand], ignore_index=True)
    union.attrs["aliases"] = list(dict.fromkeys([*base.attrs.get("aliases", []), *cand.attrs.get("aliases", [])]))
    union.attrs["added"] = []
    fields = varying_fields(union) or ["variant", "kernel"]

    def info(row) -> dict:
        return {f: _py(row.get(f)) for f in fields}

    base_by_id = {row["case_id"]: row for _, row in base.iterrows()}
    rows: list[GateRow] = []
    only_candidate = []
    for _, c in cand.iterrows():
        b = base_by_id.get(c["case_id"])
        if b is None:
            only_candidate.append((c["case_id"], info(c)))
            continue
        values: dict[str, tuple[Any, Any, Any]] = {}
        for m in metrics:
            bv, cv = _py(b.get(m.column)), _py(c.get(m.column))
            comparable = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (bv, cv)) and bv != 0
            values[m.name] = (bv, cv, (cv - bv) / abs(bv) * 100 if comparable else None)
        rules = {t.metric.name: t for t in thresholds}
        verdicts: dict[str, str] = {}
        regressed = False
        for m in metrics:
            change = values[m.name][2]
            if b.get("status") != "ok":
                verdicts[m.name] = f"baseline {b.get('status')}: not compared"
            elif c.get("status") != "ok":
                verdicts[m.name], regressed = f"REGRESSED: candidate {c.get('status')}", True
            elif m.name not in rules:
                verdicts[m.name] = _MISSING
            elif change is None:
                verdicts[m.name] = "n/a"
            elif rules[m.name].regressed(change):
                verdicts[m.name], regressed = "REGRESSED", True
            else:
                verdicts[m.name] = "ok"
        rows.append(GateRow(case_id=c["case_id"], fields=info(c), values=values, verdicts=verdicts,
                            regressed=regressed))
    cand_ids = set(cand["case_id"])
    only_baseline = [(row["case_id"], info(row)) for _, row in base.iterrows() if row["case_id"] not in cand_ids]
    if not rows:
        raise CompareError(f"no case of the candidate ({len(cand)}) matches a case of the baseline ({len(base)}) "
                           "by case_id, so nothing was compared; pass results of the same scenario")

    def order(fields_of: dict) -> tuple:
        return tuple(_sort_key(fields_of[f]) for f in fields)

    rows.sort(key=lambda r: order(r.fields))
    only_baseline.sort(key=lambda c: order(c[1]))
    only_candidate.sort(key=lambda c: order(c[1]))
    return GateResult(rows=rows, only_baseline=only_baseline, only_candidate=only_candidate, fields=fields,
                      metrics=metrics, thresholds=list(thresholds))


def _sort_key(value: Any) -> tuple:
    return (0, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, str(value))


def _field_text(name: str, value: Any) -> str:
    if name == "docs" and isinstance(value, str) and value.count(",") >= 3:
        return f"{value.count(',') + 1} docs"  # the lengths themselves are in the records
    return format_x(name, value) if name == "seqlen" else _plain(value)


def _case_words(fields: list[str], values: dict[str, Any]) -> str:
    """A case named by its varying fields, such as ``zigzag cudnn 16k fwd_bwd``."""
    return " ".join(_field_text(f, values[f]) for f in fields)


def print_gate(result: GateResult, console: Console | None = None) -> None:
    """Print the matched cases, one row per case and metric (baseline, candidate, change %,
    verdict), then the unmatched cases and a summary line."""
    console = console or Console()
    rules = ", ".join(t.text() for t in result.thresholds) or "none, changes only"
    console.print(Text(f"regression gate ({rules})", style="italic"))
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    several = len(result.metrics) > 1
    table.add_column("case", no_wrap=True)
    if several:
        table.add_column("metric", no_wrap=True)
    for header in ("baseline", "candidate", "change"):
        table.add_column(header if several else f"{header}" if header == "change" else
                         f"{result.metrics[0].name}\n{header}", justify="right", no_wrap=True)
    table.add_column("verdict", overflow="fold", min_width=9)
    for row in result.rows:
        for i, m in enumerate(result.metrics):
            bv, cv, change = row.values[m.name]
            better = change is not None and change != 0 and (change > 0) == m.higher_is_better
            verdict = row.verdicts[m.name]
            cells: list[Any] = [_case_words(result.fields, row.fields) if i == 0 else ""]
            if several:
                cells.append(m.name)
            cells += [format_value(m, bv), format_value(m, cv),
                      Text(_MISSING if change is None else f"{change:+.1f}%",
                           style="" if change is None else ("green" if better else "yellow")),
                      Text(verdict, style="bold red" if verdict.startswith("REGRESSED") else "")]
            table.add_row(*cells, end_section=several and i == len(result.metrics) - 1)
    console.print(table)
    for side, cases in (("baseline", result.only_baseline), ("candidate", result.only_candidate)):
        if cases:
            console.print(Text(f"unmatched: {plural(len(cases), 'case')} only in the {side} (not gated):",
                               style="yellow"))
            for case_id, fields in cases:
                console.print(f"  {_case_words(result.fields, fields)}  ({case_id})", markup=False,
                              highlight=False)
    line = Text(f"{plural(len(result.rows), 'case')} matched: ")
    line.append(f"{result.regressions} regressed", style="bold red" if result.regressions else "green")
    line.append(f", {len(result.only_baseline) + len(result.only_candidate)} unmatched")
    console.print(line)


def gate_json_lines(result: GateResult) -> list[str]:
    """One JSON object per matched case, then one per unmatched case (``"matched": false``)."""
    out = []
    for row in result.rows:
        out.append(json.dumps({
            "case_id": row.case_id, "matched": True, **row.fields,
            **{m: {"baseline": b, "candidate": c, "change_pct": ch, "verdict": row.verdicts[m]}
               for m, (b, c, ch) in row.values.items()},
            "regressed": row.regressed}))
    for side, cases in (("baseline", result.only_baseline), ("candidate", result.only_candidate)):
        for case_id, fields in cases:
            out.append(json.dumps({"case_id": case_id, "matched": False, "only_in": side, **fields}))
    return out


# --------------------------------------------------------------------------- export

def to_parquet(frame: "pandas.DataFrame", path: Path | str) -> None:
    """Write the records (dotted columns, the short aliases left out) to a Parquet file.

    Raises:
        CompareError: neither pyarrow nor fastparquet is installed.
    """
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("pyarrow", "fastparquet")):
        raise CompareError("--to-parquet needs the pyarrow package (or fastparquet), which is not installed "
                           "here; pip install pyarrow, or read the .jsonl with ringbench.results.load")
    out = frame.drop(columns=[a for a in frame.attrs.get("added", []) if a in frame.columns])
    out.attrs = {}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    out.to_parquet(path, index=False)
