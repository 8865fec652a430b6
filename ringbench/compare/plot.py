"""The pivot drawn with matplotlib: one panel per world size and mode, one line per row.

matplotlib and pandas are imported inside the functions; no pyplot, so no global state.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ringbench.compare.pivot import Pivot
from ringbench.formatting import axis_text, cell_text, plain

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
    if one("heads") is not None:
        parts.append(f"{plain(one('heads'))} heads")
    if one("kv_heads") is not None:
        parts.append(f"{plain(one('kv_heads'))} KV heads")
    if one("head_dim") is not None:
        parts.append(f"head dim {plain(one('head_dim'))}")
    if one("dtype") is not None:
        parts.append(str(one("dtype")))
    if one("causal") is not None:
        parts.append("causal" if bool(one("causal")) else "non-causal")
    if one("batch") is not None:
        parts.append(f"batch {plain(one('batch'))}")
    return ", ".join(parts)


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

    rows = p.rows()
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
    xs = [float(v) for v in p.columns()]
    log2 = all(v > 0 for v in xs)
    style = _line_styles(line_keys)
    handles = {}
    for key, values in rows:
        panel, line = tuple(key[:n_panel]), tuple(key[n_panel:])
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not pts:
            continue
        # An optional field left at its default ("") adds nothing to the label.
        label = " / ".join(t for t in (cell_text(n, v) for n, v in zip(p.lines, line)) if t) or p.metric.name
        (handle,) = axes[panel].plot([x for x, _ in pts], [v for _, v in pts], label=label, linewidth=1.6,
                                     markersize=5, **style[line])
        handles.setdefault(label, handle)
    ticks = _ticks(xs, log2)
    for key, ax in axes.items():
        if log2:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(ticks, [axis_text(p.x, int(t) if float(t).is_integer() else t) for t in ticks])
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
    shape = _common_shape(frame, [*p.index, p.x])
    title = f"{p.metric.label}" + (f"  ·  {shape}" if shape else "")
    fig.suptitle(f"{title}\n{_environment(frame)}", fontsize=10)
    if handles:
        fig.legend(list(handles.values()), list(handles.keys()), loc="outside lower center",
                   ncols=min(len(handles), 4), title=" / ".join(p.lines) or None, fontsize=9, title_fontsize=9,
                   frameon=False)
    if path is not None:
        fig.savefig(path, dpi=150, bbox_inches="tight")  # never clip the title or the legend
    return fig
