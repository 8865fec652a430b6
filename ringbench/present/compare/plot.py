"""The pivot drawn with matplotlib: one panel per world size and mode, one line per row.

matplotlib and pandas are imported inside the functions; no pyplot, so no global state.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ringbench.present.compare.pivot import Pivot
from ringbench.present.formatting import axis_text, cell_text, docs_count, plain
from ringbench.variants import plural

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure

_MODE_WORDS = {"fwd": "forward", "fwd_bwd": "forward + backward"}
_X_WORDS = {"seqlen": "sequence length (tokens, all ranks)", "world_size": "world size (ranks)",
            "batch": "batch (sequences)"}


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


def _common_shape(frame: "pandas.DataFrame", shown: Iterable[str]) -> str:
    """The shape fields that hold one value in every row and are not ``shown`` elsewhere, for
    the title: ``32 heads, 8 KV heads, head dim 128, bf16, causal, batch 1``."""
    def one(column: str) -> Any:
        if column in shown or column not in frame.columns:
            return None
        values = {str(v) for v in frame[column].dropna()}
        return frame[column].dropna().iloc[0] if len(values) == 1 else None

    parts = []
    for column, noun in (("heads", "head"), ("kv_heads", "KV head")):
        if one(column) is not None:
            value = plain(one(column))
            parts.append(plural(int(value), noun) if value.isdigit() else f"{value} {noun}s")
    if one("head_dim") is not None:
        parts.append(f"head dim {plain(one('head_dim'))}")
    if one("dtype") is not None:
        parts.append(str(one("dtype")))
    if one("causal") is not None:
        parts.append("causal" if bool(one("causal")) else "non-causal")
    if one("batch") is not None:
        parts.append(f"batch {plain(one('batch'))}")
    return ", ".join(parts)


#: One colour per variant, the same in every plot. A peer that runs one of ringbench's schedules
#: (``rfa_zigzag``) takes that variant's colour, and is told apart by its dashes and open markers.
VARIANT_COLOURS: dict[str, str] = {
    "ring": "#1f77b4", "zigzag": "#d62728", "stripe": "#ff7f0e", "llama3": "#9467bd",
    "ring_varlen": "#17becf", "zigzag_varlen": "#e377c2", "llama3_varlen": "#8c564b", "torch_cp": "#2ca02c",
    "rfa_ring": "#1f77b4", "rfa_zigzag": "#d62728", "rfa_stripe": "#ff7f0e", "rfa_llama3_varlen": "#8c564b",
}
#: Colours of other names (a variant of one's own, a --by field's values), picked by a hash of
#: the name, so a name keeps its colour from plot to plot.
OTHER_COLOURS = ("#7f7f7f", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd")
#: Line style and marker of each kernel, the same in every plot; a peer's line is dashed instead,
#: and keeps its kernel's marker, open.
KERNEL_STYLES: dict[str, tuple[Any, str]] = {
    "torch-flash": ("-", "o"), "cudnn": ("-.", "s"), "torch-efficient": (":", "^"),
    "flash-attn": ((0, (3, 1, 1, 1, 1, 1)), "D"), "cpu": ("-", "v"), "math": (":", "P"),
}
OTHER_STYLES: tuple[tuple[Any, str], ...] = (("-", "h"), ("-.", "*"), (":", "X"), ((0, (3, 1, 1, 1, 1, 1)), "p"))
PEER_LINESTYLE = "--"
#: A predicted record's line (``ringbench predict``): long dashes, its kernel's marker kept filled,
#: so a prediction reads apart from the measurement beside it and from a peer.
PREDICTED_LINESTYLE = (0, (7, 3))
#: Markers of the lines of one variant and kernel after the first (which has its kernel's).
_SIBLING_MARKERS = ("o", "s", "D", "^", "X", "P", "*", "h")
#: Fields a legend entry shows as their value alone (the legend's title names them).
_BARE_FIELDS = ("variant", "kernel")


def _hashed(name: Any, choices: tuple) -> Any:
    return choices[zlib.crc32(str(name).encode()) % len(choices)]


def colour_of(variant: Any) -> str:
    """The colour of a variant (or of any other name) in every plot."""
    return VARIANT_COLOURS.get(str(variant)) or _hashed(variant, OTHER_COLOURS)


def _shade(colour: str, k: int) -> tuple[float, float, float]:
    """The ``k``-th shade of ``colour``: itself, then darker, lighter, darker still..."""
    from matplotlib.colors import to_rgb

    rgb = to_rgb(colour)
    if k == 0:
        return rgb
    amount = min(0.25 * ((k + 1) // 2) + 0.1, 0.7)
    target = 0.0 if k % 2 else 1.0
    return tuple(c + (target - c) * amount for c in rgb)


def _is_peer(variant: Any) -> bool:
    from ringbench.variants import VARIANTS

    return bool(getattr(VARIANTS.get(str(variant)), "peer", False))


def _single(frame: "pandas.DataFrame", column: str) -> Any:
    """The one value ``column`` holds in every row of ``frame``, else None."""
    if column not in frame.columns:
        return None
    values = list(dict.fromkeys(frame[column].dropna()))
    return values[0] if len(values) == 1 else None


def _line_styles(lines: list[str], line_keys: list[tuple], frame: "pandas.DataFrame") -> dict[tuple, dict]:
    """A fixed look per line: the colour of its variant (:func:`colour_of`), the line style and
    marker of its kernel (:data:`KERNEL_STYLES`); a peer (``Variant.peer``) dashed with open
    markers; lines of one variant and kernel that differ in other fields (rotate, docs...) in
    shades of the variant's colour, the one with the fewest fields set in the colour itself and
    the kernel's marker, each other in a marker of its own (:data:`_SIBLING_MARKERS`); a
    predicted record's line long-dashed (:data:`PREDICTED_LINESTYLE`) in the colour of the
    measurement it stands beside. A field that is not a line field but holds one value in every
    record counts as well."""
    def field(key: tuple, name: str) -> Any:
        return key[lines.index(name)] if name in lines else _single(frame, name)

    def set_fields(key: tuple) -> tuple:
        return tuple(v for n, v in zip(lines, key) if n not in _BARE_FIELDS and n != "predicted")

    def family(key: tuple) -> tuple:
        variant = field(key, "variant")
        return (variant if variant is not None else (key[0] if key else None), field(key, "kernel"))

    optional = [n for n in lines if n not in _BARE_FIELDS and n != "predicted"]  # the names of set_fields' values
    shades: dict[tuple, list[tuple]] = {}
    for key in line_keys:
        others = shades.setdefault(family(key), [])
        if set_fields(key) not in others:
            others.append(set_fields(key))
    for others in shades.values():
        others.sort(key=lambda values: (sum(1 for n, v in zip(optional, values)
                                            if v not in ("", None, 0, False) and not _is_default(n, v)), str(values)))
    out = {}
    for key in line_keys:
        colour_key, kernel = family(key)
        linestyle, marker = KERNEL_STYLES.get(str(kernel)) or _hashed(kernel, OTHER_STYLES)
        k = shades[(colour_key, kernel)].index(set_fields(key))
        colour = _shade(colour_of(colour_key), k)
        if k:  # a sibling of another shade: its own marker too, so shared points stay apart
            marker = _SIBLING_MARKERS[(k - 1) % len(_SIBLING_MARKERS)]
        peer = _is_peer(field(key, "variant"))
        predicted = field(key, "predicted") in (True, "True")
        out[key] = dict(color=colour, marker=marker,
                        linestyle=PEER_LINESTYLE if peer else PREDICTED_LINESTYLE if predicted else linestyle,
                        markerfacecolor="white" if peer else colour, markeredgecolor=colour)
    return out


#: How a legend names an optional field left at its default, on a line whose siblings set it.
_UNSET_WORDS = {"window": "no window", "mask": "no mask", "sink": "no sink", "emulate": "not emulated", "docs": "no docs",
                "doc_pad": "no pad", "profile": "not profiled", "flush_l2": "L2 warm"}


def _is_default(name: str, value: Any) -> bool:
    """Whether ``value`` is an optional field's default (``window`` 0, ``sink`` none...)."""
    from ringbench.case.fields import OPTIONAL_DEFAULTS

    return name in OPTIONAL_DEFAULTS and (value is None or str(value) == str(OPTIONAL_DEFAULTS[name]))


def _part(name: str, value: Any, files: dict[str, str] | None) -> str:
    """One field of a legend entry: the variant and the kernel by their value, ``emulated``,
    ``7 docs``, every other field as ``name=value``; '' for an empty value."""
    if name == "emulate":
        return "emulated" if value else _UNSET_WORDS["emulate"]
    if name == "predicted":
        return cell_text(name, value)
    if name == "flush_l2":
        return "L2 flushed" if value else _UNSET_WORDS["flush_l2"]
    shown = (files or {}).get(value, cell_text(name, value)) if name == "source" else cell_text(name, value)
    if not shown:
        return ""
    bare = name in _BARE_FIELDS or (name == "docs" and isinstance(value, str) and docs_count(value))
    return shown if bare else f"{name}={shown}"


def _line_labels(lines: list[str], line_keys: list[tuple], files: dict[str, str] | None = None
                 ) -> dict[tuple, str]:
    """A legend entry per line, saying only what tells it apart: ``zigzag / cpu / window=64``.

    The variant and the kernel by their value; a case field by ``name=value``; an optional field
    (window, sink, ulysses_degree, emulate...) only where it is set, and, on a line of a variant
    and kernel whose other lines set it while it does not, by its unset words (``no window``),
    never ``window=0``. ``files`` writes a ``source`` path shorter (its file name).
    """
    def family(key: tuple) -> tuple:
        return tuple(v for n, v in zip(lines, key) if n in _BARE_FIELDS)

    siblings: dict[tuple, list[tuple]] = {}
    for key in line_keys:
        siblings.setdefault(family(key), []).append(key)
    out = {}
    for key in line_keys:
        parts, unset = [], []
        for i, (name, value) in enumerate(zip(lines, key)):
            if not _is_default(name, value):
                parts.append(_part(name, value, files))
            elif any(not _is_default(name, other[i]) for other in siblings[family(key)]):
                unset.append(_UNSET_WORDS.get(name, f"{name} default"))
        named = [p for p in parts if p]
        bare = sum(1 for n in lines if n in _BARE_FIELDS)
        # a line that sets none of the options its siblings set says which ones it leaves unset
        out[key] = " / ".join(named + (unset if len(named) <= bare else []))
    return out


def _file_names(paths: list[Any]) -> dict[str, str]:
    """Each result file by its name alone (``llama3-8b.jsonl``), where no two share a name."""
    names = {str(p): Path(str(p)).name for p in paths}
    return names if len(set(names.values())) == len(names) else {}


def _layout(panel_keys: list[tuple], panels: list[str]) -> tuple[int, int, dict[tuple, tuple[int, int]]]:
    """Rows and columns of panels, and where each panel goes: a grid of world sizes (rows) by
    modes (columns) when every pair was measured, else the panels in order, three to a row
    (two when there are four), so no place is left empty."""
    if panels == ["world_size", "mode"]:
        grid_rows = list(dict.fromkeys(k[0] for k in panel_keys))
        grid_cols = sorted(dict.fromkeys(k[1] for k in panel_keys), key=str)
        if len(panel_keys) == len(grid_rows) * len(grid_cols):
            return len(grid_rows), len(grid_cols), {k: (grid_rows.index(k[0]), grid_cols.index(k[1]))
                                                    for k in panel_keys}
    n = max(len(panel_keys), 1)
    n_cols = n if n <= 3 else 2 if n == 4 else 3
    return math.ceil(n / n_cols), n_cols, {k: divmod(i, n_cols) for i, k in enumerate(panel_keys)}


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
    """``world size 2, forward + backward``."""
    words = []
    for name, value in zip(panels, key):
        if name == "world_size":
            words.append(f"world size {plain(value)}")
        elif name == "mode":
            words.append(_MODE_WORDS.get(value, str(value)))
        else:
            words.append(f"{name} {plain(value)}")
    return ", ".join(words)


def _all_emulated(frame: "pandas.DataFrame", panels: list[str], key: tuple) -> bool:
    """Whether every record drawn in the panel ``key`` was emulated (``emulated: true``)."""
    if "emulated" not in frame.columns:
        return False
    rows = frame
    for name, value in zip(panels, key):
        if name in rows.columns:
            rows = rows[rows[name].astype(str) == str(value)]
    return bool(len(rows)) and bool(rows["emulated"].fillna(False).astype(bool).all())


def plot(p: Pivot, frame: "pandas.DataFrame", path: Path | str | None = None) -> "Figure":
    """Draw the pivot: the metric against x, one panel per world size and mode, one line per row.

    Panels form a grid of world sizes (rows) by modes (columns) when every pair was measured,
    else they follow one another (:func:`_layout`); a panel with nothing measured is left out,
    so no panel is empty. The x axis is log2 with a tick at each measured value (``8k``,
    ``16k``...). A line has the colour of its variant in every plot (:data:`VARIANT_COLOURS`),
    the line style and marker of its kernel (:data:`KERNEL_STYLES`); a peer is dashed with open
    markers; lines that differ only in other fields are shades of the variant's colour. One
    legend below names the lines by what tells them apart (:func:`_line_labels`: ``rotate=alltoall``,
    ``window=64``, ``no window``, ``emulated``); a panel whose records are all emulated says so
    in its title; later lines draw smaller markers so a point shared by several shows each. A point
    whose record holds the quantiles (``time``, ``tflops``) has an error bar from its p20 to its p80
    (:meth:`Pivot.spreads`); older records draw none. The title gives the metric, the common shape, the
    device and the software versions. An efficiency plot draws the ideal, 1.0, as a dotted line.

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

    n_panel = len(p.panels)
    # Rows with nothing measured draw nothing, so they make no panel and no legend entry.
    rows = [(key, values) for key, values in p.rows() if any(v is not None for v in values)]
    panel_keys = list(dict.fromkeys(tuple(key[:n_panel]) for key, _ in rows))
    line_keys = list(dict.fromkeys(tuple(key[n_panel:]) for key, _ in rows))
    n_rows, n_cols, place = _layout(panel_keys, p.panels)

    # At least 9 in wide, so the title and a legend of many lines fit over one panel.
    fig = Figure(figsize=(max(4.6 * n_cols + 0.6, 9.0), 3.4 * n_rows + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    # TFLOP/s and efficiency read across panels on one scale; time and memory span decades.
    share = p.metric.name in ("tflops", "efficiency")
    axes: dict = {}
    for k, (r, c) in sorted(place.items(), key=lambda item: item[1]):
        first = next(iter(axes.values()), None)
        axes[k] = fig.add_subplot(n_rows, n_cols, r * n_cols + c + 1, sharey=first if share else None)
    xs = [float(v) for v in p.columns()]
    log2 = all(v > 0 for v in xs)
    style = _line_styles(p.lines, line_keys, frame)
    files = _file_names([k[p.lines.index("source")] for k in line_keys] if "source" in p.lines else [])
    labels = _line_labels(p.lines, line_keys, files)
    handles = {}
    spreads = {tuple(key): row for (key, _), row in zip(p.rows(), p.spreads())}
    for key, values in rows:
        panel, line = tuple(key[:n_panel]), tuple(key[n_panel:])
        pts = [(x, v, s) for x, v, s in zip(xs, values, spreads[tuple(key)]) if v is not None]
        label = labels[line] or p.metric.name
        # later lines draw smaller markers, so a point shared by several lines shows each of them
        size = max(3.0, 8.0 - 1.0 * line_keys.index(line))
        (handle,) = axes[panel].plot([x for x, _, _ in pts], [v for _, v, _ in pts], label=label, linewidth=1.6,
                                     markersize=size, **style[line])
        handles.setdefault(label, handle)
        bars = [(x, v, s) for x, v, s in pts if s is not None]
        if bars:  # the p20-p80 range of each point whose record has one (issue 25)
            below, above = [max(v - s[0], 0.0) for _, v, s in bars], [max(s[1] - v, 0.0) for _, v, s in bars]
            axes[panel].errorbar([x for x, _, _ in bars], [v for _, v, _ in bars], yerr=[below, above], fmt="none",
                                 ecolor=style[line]["color"], elinewidth=1.0, capsize=3, label="_spread")
    ticks = _ticks(xs, log2)
    occupied = set(place.values())
    for key, ax in axes.items():
        if log2:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(ticks, [axis_text(p.x, int(t) if float(t).is_integer() else t) for t in ticks])
        ax.set_xlim(min(xs) / 1.25 if log2 else None, max(xs) * 1.25 if log2 else None)
        ax.grid(True, which="major", alpha=0.3)
        title = _panel_title(p.panels, key) if p.panels else ""
        if _all_emulated(frame, p.panels, key):
            title += ", emulated (one process)" if title else "emulated (one process)"
        ax.set_title(title, fontsize=10)
        r, c = place[key]
        if (r + 1, c) not in occupied:  # the lowest panel of its column
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
    shape = _common_shape(frame, [*p.index, p.x])
    title = f"{p.metric.label}" + (f"  ·  {shape}" if shape else "")
    if p.all_predicted:
        title += "  ·  predicted (not measured)"
    fig.suptitle(f"{title}\n{_environment(frame)}", fontsize=10)
    if handles:
        named = " / ".join(n for n in p.lines if n in _BARE_FIELDS)
        peers = any(_is_peer(k[p.lines.index("variant")]) for k in line_keys) if "variant" in p.lines else False
        predicted = "predicted" in p.lines or p.all_predicted
        legend_title = "; ".join(t for t in (named, "peers dashed, open markers" if peers else "",
                                             "predicted long-dashed" if predicted else "") if t)
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncols=min(len(handles), 4), title=legend_title or None, fontsize=9, title_fontsize=9,
                   frameon=False)
    if path is not None:
        fig.savefig(path, dpi=150, bbox_inches="tight")  # never clip the title or the legend
    return fig
