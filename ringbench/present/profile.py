"""``run --profile``'s tables and pictures: a breakdown per rank of each profiled record.

The numbers come from ``rank/profile.py`` (its docstring says what each part means); this
module only shows them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from ringbench.rank.profile import PARTS


def profiled(records: Iterable[dict]) -> list[dict]:
    """The ok run records that carry a profile."""
    return [r for r in records if r.get("status") == "ok" and r.get("profile")]


def print_tables(records: list[dict], console=None) -> None:
    """Print one breakdown table per profiled record: a row per rank, ms per iteration.

    Columns: rank, wall, kernel, merge, comm (exposed communication; the device copies of an
    emulated run), other (launch gaps and the rest), busy (kernel + merge) and the share of
    the wall time the kernels fill. It fits 80 columns.
    """
    from rich.console import Console
    from rich.text import Text

    from ringbench.present.formatting import compact_table, number
    from ringbench.present.report import case_label

    console = console or Console()
    for r in profiled(records):
        prof = r["profile"]
        what = "emulated, " if r.get("emulated") else ""
        table = compact_table(f"profile: {case_label(r)} ({what}ms per iteration, mean of {prof['iters']}, "
                              f"{prof['clock']})")
        for header in ("rank", "wall", "kernel", "merge", "comm", "other", "busy", "kernel\n% wall"):
            table.add_column(header, justify="right", no_wrap=True)
        for p in prof["per_rank"]:
            share = 100 * p["kernel_ms"] / p["wall_ms"] if p["wall_ms"] > 0 else None
            table.add_row(str(p["rank"]), *(number(p[f"{k}_ms"], ".3f") for k in ("wall", *PARTS, "busy")),
                          number(share, ".1f"))
        console.print(table)
        if r.get("per_rank_busy_ms") is None:
            console.print(Text(f"note: {r['spec']['variant']} reports no kernel spans (ringbench's own engines "
                               "do), so its profile holds wall times alone", style="dim"))
        elif r.get("busy_imbalance") is not None:
            walls = [p["wall_ms"] for p in prof["per_rank"]]
            wall = max(walls) / min(walls) if min(walls) > 0 else float("nan")
            console.print(Text(f"work imbalance (busy max/min) {r['busy_imbalance']:.3f}; wall max/min of these "
                               f"iterations {wall:.3f}", style="dim"))


def plot_path(out: Path, record: dict) -> Path:
    """Where :func:`write_plots` puts a record's picture: ``OUT/profile-<case_id>.png``."""
    return Path(out) / f"profile-{record['case_id']}.png"


def write_plots(records: list[dict], out: Path) -> list[Path]:
    """Draw a stacked bar per rank (kernel, merge, comm, other; ms per iteration) for every
    profiled record, one PNG each (:func:`plot_path`); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ringbench.present.report import case_label

    written = []
    colours = {"kernel": "tab:blue", "merge": "tab:orange", "comm": "tab:red", "other": "tab:gray"}
    for r in profiled(records):
        ranks = r["profile"]["per_rank"]
        fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(ranks) + 2), 3.6))
        bottom = [0.0] * len(ranks)
        for part in PARTS:
            heights = [max(0.0, p[f"{part}_ms"]) for p in ranks]
            ax.bar([p["rank"] for p in ranks], heights, bottom=bottom, color=colours[part], label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xlabel("rank")
        ax.set_ylabel("ms per iteration")
        ax.set_xticks([p["rank"] for p in ranks])
        ax.set_title(("emulated: " if r.get("emulated") else "") + case_label(r), fontsize=7)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        path = plot_path(out, r)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
