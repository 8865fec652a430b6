"""``ringbench advise --plot``: the predicted time of the leading variants against world size.

One line per leading candidate (``model.advise.scaling``: the best of each of the first
variants), the global sequence held fixed (strong scaling): on the left the time (log axes), on
the right each one's time over the fastest at that world size. Colours and line
styles are compare's (``compare.plot.colour_of``, ``KERNEL_STYLES``), so a variant looks the same
in every plot; every line is long-dashed, as compare draws predictions. A point that would not fit
in the GPU's memory has an open marker; a world size the rules refuse for a candidate has no point.
matplotlib is imported inside the function; no pyplot, so no global state.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_scaling(series: list[dict], path: Path | str | None, *, title: str, subtitle: str) -> "Figure":
    """Draw ``series`` (``model.advise.scaling``'s) and save it to ``path`` (.png, .svg, .pdf; None: do not save).

    Args:
        series: per candidate its ``label``, ``variant``, ``kernel`` and ``points`` (``world_size``,
            ``time_ms`` ms per iteration and ``fits``, or ``refused``).
        title: the first title line (the shape and the sequence); subtitle: the second (the
            cluster and the calibration).

    Returns:
        The matplotlib Figure (Agg canvas).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    from ringbench.present.compare.plot import KERNEL_STYLES, PREDICTED_LINESTYLE, colour_of

    fig = Figure(figsize=(11.0, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    times, ratios = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    sizes = sorted({p["world_size"] for s in series for p in s["points"] if "time_ms" in p})
    best = {w: min(p["time_ms"] for s in series for p in s["points"] if p["world_size"] == w and "time_ms" in p)
            for w in sizes}
    open_points = False
    for i, s in enumerate(series):
        pts = [p for p in s["points"] if "time_ms" in p]
        if not pts:
            continue
        colour = colour_of(s["variant"])
        marker = KERNEL_STYLES.get(s["kernel"], ("-", "o"))[1]
        size = max(4.0, 8.0 - i)  # later lines draw smaller markers, so shared points show each
        xs = [p["world_size"] for p in pts]
        for ax, ys in ((times, [p["time_ms"] for p in pts]), (ratios, [p["time_ms"] / best[p["world_size"]]
                                                                         for p in pts])):
            ax.plot(xs, ys, color=colour, linestyle=PREDICTED_LINESTYLE, linewidth=1.6, marker=marker,
                    markersize=size, label=s["label"] if ax is times else "_")
            unfit = [(x, y) for x, y, p in zip(xs, ys, pts) if not p["fits"]]
            if unfit:  # drawn over the filled marker: would not fit in memory
                open_points = True
                ax.plot([x for x, _ in unfit], [y for _, y in unfit], linestyle="none", marker=marker,
                        markersize=size, markerfacecolor="white", markeredgecolor=colour, label="_")
    for ax in (times, ratios):
        ax.set_xscale("log", base=2)
        if sizes:
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticks(sizes, [str(w) for w in sizes])
            ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 1.3)
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlabel("world size (GPUs; the same global sequence)")
    times.set_yscale("log")
    times.set_ylabel("predicted time per iteration (ms, slowest rank)")
    ratios.set_ylabel("time over the fastest at that world size")
    ratios.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="_fastest")
    fig.suptitle(f"{title}\n{subtitle}", fontsize=10)
    handles, labels = times.get_legend_handles_labels()
    if handles:
        note = "predicted, not measured" + ("; open markers: would not fit in the GPU's memory" if open_points else "")
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(handles), 3), title=note, fontsize=9,
                   title_fontsize=9, frameon=False)
    if path is not None:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    return fig
