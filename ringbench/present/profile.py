"""``run --profile``'s tables and pictures: a breakdown per rank of each profiled record.

The numbers come from ``rank/profile.py`` (its docstring says what each part means); this
module only shows them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from ringbench.rank.profile import PARTS


def profiled(records: Iterable[dict]) -> list[dict]:
    """The ok run records that carry a profile."""
    return [r for r in records if r.get("status") == "ok" and r.get("profile")]


def print_tables(records: list[dict], console=None) -> None:
    """Print one breakdown table per profiled record: a row per rank, ms per iteration.

    Columns: rank, wall, kernel, merge, comm (exposed communication; the device copies of an
    emulated run), host gap (the GPU idle, waiting for the host), other (device work outside
    the spans; on CPU the host's work too), busy (kernel + merge) and the share of the wall
    time the kernels fill. It fits 80 columns. Under a mask, a line of the predicted max/mean of
    the work per rank in each layout (the record's ``predicted_max_over_mean_by_layout``).
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
        for header in ("rank", "wall", "kernel", "merge", "comm", "host\ngap", "other", "busy", "kernel\n% wall"):
            table.add_column(header, justify="right", no_wrap=True)
        for p in prof["per_rank"]:
            share = 100 * p["kernel_ms"] / p["wall_ms"] if p["wall_ms"] > 0 else None
            table.add_row(str(p["rank"]), *(number(p.get(f"{k}_ms"), ".3f") for k in ("wall", *PARTS, "busy")),
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
        by_layout = r.get("predicted_max_over_mean_by_layout")
        if by_layout:  # a masked case: what each layout, the mask planner's included, would give
            found = ", ".join(f"{k} {number(v, '.3f')}" for k, v in by_layout.items())
            console.print(Text(f"predicted work max/mean under the mask by layout: {found}", style="dim"))


_MODE_WORDS = {"fwd": "forward", "fwd_bwd": "forward + backward"}


def _mode(record: dict) -> str:
    return str((record.get("spec") or {}).get("mode") or "")


def file_label(record: dict) -> str:
    """The case label as a file name part, safe on every filesystem:
    ``zigzag_W2_S16k_H32-8_D128_bf16_causal_torch-flash_fwd_bwd`` (``_emulated`` when it is)."""
    from ringbench.present.report import case_label

    words = [*case_label(record).split(), *([] if _mode(record) == "fwd" else [_mode(record)])]
    words += ["emulated"] if record.get("emulated") else []
    text = re.sub(r"(^|_)([A-Z])=", r"\1\2", "_".join(words)).replace("/", "-").replace("=", "-")
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-.")[:160]


def plot_path(out: Path, record: dict, *, unique: bool = True) -> Path:
    """Where :func:`write_plots` puts a record's picture: ``OUT/profile-<case label>.png``
    (:func:`file_label`); ``unique=False`` adds the case_id, for two cases of one label."""
    name = file_label(record) if unique else f"{file_label(record)}_{record['case_id']}"
    return Path(out) / f"profile-{name}.png"


def write_plots(records: list[dict], out: Path) -> list[Path]:
    """Draw a stacked bar per rank (kernel, merge, comm, host gap, other; ms per iteration) for every
    profiled record, one PNG each (:func:`plot_path`, :func:`figure`); returns the paths written."""
    import matplotlib.pyplot as plt

    written = []
    records = profiled(records)
    labels = [file_label(r) for r in records]
    for r, label in zip(records, labels):
        fig = figure(r)
        path = plot_path(out, r, unique=labels.count(label) == 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def figure(record: dict):
    """One profiled record's stacked bars (pyplot's figure; the caller closes it), titled by
    its case, its mode and the clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ringbench.present.report import case_label

    colours = {"kernel": "tab:blue", "merge": "tab:orange", "comm": "tab:red", "host_gap": "tab:olive",
               "other": "tab:gray"}
    ranks = record["profile"]["per_rank"]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(ranks) + 2), 3.6))
    bottom = [0.0] * len(ranks)
    for part in PARTS:
        heights = [max(0.0, p.get(f"{part}_ms") or 0.0) for p in ranks]
        ax.bar([p["rank"] for p in ranks], heights, bottom=bottom, color=colours[part], label=part.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per iteration")
    ax.set_xticks([p["rank"] for p in ranks])
    mode = _MODE_WORDS.get(_mode(record), _mode(record))
    ax.set_title(("emulated: " if record.get("emulated") else "") +
                 f"{case_label(record)}\n{mode}, {record['profile']['clock']}", fontsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
