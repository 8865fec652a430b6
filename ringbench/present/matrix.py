"""The matrix's outputs: one object per cell, the Markdown tables and the picture."""

from __future__ import annotations

import json
import math
import os
import textwrap
from pathlib import Path
from typing import Any, Optional

from ringbench.variants import plural
from ringbench.present.formatting import ratio_text
from ringbench.sweep.matrix.grid import (BASE, BASE_SEQLEN, CLASSES, CLASS_MEANING, Cell, Grid, TEST_VARIANTS, _BY_KEY,
                                         base_seqlen)


# --------------------------------------------------------------------------- outputs

def cell_object(cell: Cell) -> dict[str, Any]:
    """One cell as ``--json`` prints it and ``matrix.jsonl`` holds it."""
    record = cell.record or {}
    return {
        "world_size": cell.world_size,
        "implementation": cell.implementation,
        "peer": _is_peer(cell.implementation),
        "columns": cell.columns,
        "class": cell.klass,
        "reason": cell.reason,
        "worst_tensor": (cell.worst or {}).get("tensor"),
        "worst_ratio": _json_number((cell.worst or {}).get("ratio")),
        "worst_rule": (cell.worst or {}).get("rule"),
        "status": record.get("status"),
        "kernel": record.get("kernel"),
        "notes": record.get("notes") or [],
        "case_id": cell.case_id,
        "spec": cell.case.to_dict() if cell.case is not None else None,
    }


def _json_number(value: Any) -> Any:
    """A ratio for strict JSON: inf as the string ``"inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _is_peer(name: str) -> bool:
    from ringbench.variants import VARIANTS

    return bool(getattr(VARIANTS.get(name), "peer", False))


def environment() -> dict[str, Any]:
    """The environment the title names: device, torch, git commit (``envinfo.collect``)."""
    from ringbench.records import envinfo

    try:
        return envinfo.collect()
    except Exception:  # the title is context; its failure must not cost the matrix
        return {}


def env_title(env: dict, device: str) -> str:
    """``cpu (x86_64, 2 cores) · torch 2.13.0+cpu · commit b9c0afe``."""
    if device == "cuda" and env.get("gpu_name"):
        where = f"{env.get('gpu_count') or 1} x {env['gpu_name']}"
    else:
        where = f"cpu ({env.get('cpu') or 'unknown'}, {plural(os.cpu_count() or 1, 'core')})"
    commit = env.get("git_commit") or "unknown"
    commit = commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
    return f"{where} · torch {env.get('torch', 'unknown')} · commit {commit}"


def base_text(device: str, world_sizes: tuple[int, ...] = ()) -> str:
    """What the base cell is, in one sentence; its tokens at each of ``world_sizes`` where they are
    not :data:`BASE_SEQLEN` (``grid.base_seqlen``: 64 per rank at least, a multiple of 2W)."""
    other = [f"{base_seqlen(device, w)} at W={w}" for w in world_sizes if base_seqlen(device, w) != BASE_SEQLEN[device]]
    tokens = f"{BASE_SEQLEN[device]} tokens" + (f" ({', '.join(other)})" if other else "")
    return (f"Base cell: causal, bf16, {BASE['heads']} query heads over {BASE['kv_heads']} K/V heads, head dim "
            f"{BASE['head_dim']}, {tokens} (varlen implementations: packed into four "
            "documents); each column changes one thing from it.")


def cell_text(cell: Optional[Cell], *, short: bool = False) -> str:
    """How a cell reads: ``correct 0.50``, ``mismatch dq ×12``, ``unsupported``...; ``short``: the
    picture's text (``0.50``, ``dq ×12``, what an unsupported cell's refusal is about)."""
    if cell is None or cell.klass is None:
        return "" if short else "-"
    if cell.klass == "correct":
        ratio = ratio_text(cell.worst["ratio"]) if cell.worst else ""
        return ratio if short else f"correct {ratio}".strip()
    if cell.klass == "mismatch":
        ratio = (cell.worst or {}).get("ratio")
        what = f"{cell.worst['tensor']} ×{_times(ratio)}" if ratio is not None and ratio > 1 else "failed"
        if ratio is not None and ratio > 1 and cell.worst.get("rule") in ("blocks", "kernel"):
            what += f" {cell.worst['rule']}"  # over the block-decomposition or kernel rule, not the max rule
        return what if short else f"mismatch {what}"
    if short:
        return refusal_topic(cell.reason) if cell.klass == "unsupported" else cell.klass
    return cell.klass


#: What an unsupported cell's refusal is about, by a phrase of its sentence (first match wins).
_TOPICS = (
    ("sliding window", "window"),
    ("cannot take mask", "mask"),
    ("attention sink", "sink"),
    ("cannot run on", "device"),
    ("is unavailable here", "library"),
    ("takes no documents", "form"),
    ("attends packed documents", "form"),
    ("document ", "doc length"),
    ("non-causal", "mask"),
    ("causal attention", "mask"),
    ("is not supported by the", "dtype"),
    ("seqlen ", "length"),
    ("GQA", "GQA"),
    ("head_dim", "head dim"),
    ("dtype", "dtype"),
    ("kernel", "kernel"),
)


def refusal_topic(reason: Optional[str]) -> str:
    """A word or two for the picture on what a refusal is about (``length``, ``device``...);
    ``n/a`` when no phrase of :data:`_TOPICS` is in it (a peer's own exception)."""
    for phrase, topic in _TOPICS:
        if phrase in (reason or ""):
            return topic
    return "n/a"


def _times(ratio: float) -> str:
    """A ratio above 1, short: ``1.9``, ``12.3``, ``456``, ``8e4``."""
    if not math.isfinite(ratio):
        return "inf"
    if ratio < 1000:
        return f"{ratio:.1f}" if ratio < 100 else f"{ratio:.0f}"
    mantissa, exponent = f"{ratio:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _one_line(text: str) -> str:
    return " ".join((text or "").split())


def _first_line(text: str, limit: int = 400) -> str:
    """The first line of a reason (a traceback's follows it), at most ``limit`` characters."""
    line = _one_line((text or "").splitlines()[0] if text else "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def markdown(grid: Grid, env: dict) -> str:
    """The matrix as Markdown: per world size one table per axis (rows: implementations), then
    the numbered reasons of every cell that is not correct."""
    notes: dict[str, int] = {}

    def entry(cell: Optional[Cell]) -> str:
        text = cell_text(cell)
        if cell is not None and cell.klass not in (None, "correct") and cell.reason:
            text += f" [{notes.setdefault(_first_line(cell.reason), len(notes) + 1)}]"
        return text.replace("|", "\\|")

    lines = ["# ringbench matrix", "", env_title(env, grid.device), "",
             base_text(grid.device, tuple(grid.world_sizes)) + " One `ringbench verify` case per cell, against float64 attention; "
             "the classes:", "", "| class | means |", "|---|---|"]
    lines += [f"| {k} | {CLASS_MEANING[k]} |" for k in CLASSES]
    for world_size in grid.world_sizes:
        counts = ", ".join(f"{n} {k}" for k, n in grid.counts(world_size).items() if n)
        lines += ["", f"## W={world_size}", "", f"{plural(sum(grid.counts(world_size).values()), 'cell')}: {counts}."]
        for axis in grid.axes:
            cols = [c for c in grid.columns if c.axis == axis]
            lines += ["", f"### {axis}", "", "| implementation | " + " | ".join(c.label for c in cols) + " |",
                      "|---|" + "---|" * len(cols)]
            for name in grid.implementations:
                row = [entry(grid.cell(name, world_size, c.key)) for c in cols]
                lines.append(f"| {_row_label(name)} | " + " | ".join(row) + " |")
    ran = notes_by_text(grid)
    if ran:
        lines += ["", "How they ran, as their records say:", ""]
        lines += [f"- {', '.join(names)}: {note}" for note, names in ran.items()]
    if notes:
        lines += ["", "## Reasons", ""]
        lines += [f"{i}. {text.replace('|', '/')}" for text, i in notes.items()]
    return "\n".join(lines) + "\n"


def notes_by_text(grid: Grid) -> dict[str, list[str]]:
    """Each distinct note the records carry (how a peer ran: ``ring-flash-attn's flash-attn calls
    served by ringbench's cpu kernel``), with the implementations whose records carry it."""
    out: dict[str, list[str]] = {}
    for cell in grid.cells:
        for note in (cell.record or {}).get("notes") or []:
            names = out.setdefault(note, [])
            if cell.implementation not in names:
                names.append(cell.implementation)
    return out


def _row_label(name: str) -> str:
    if _is_peer(name):
        return f"{name} (peer)"
    if name in TEST_VARIANTS:
        return f"{name} (test)"
    return name


_COLOURS = {"correct": "#43a047", "mismatch": "#e53935", "unsupported": "#d7d7d7", "oom": "#8e24aa",
            "timeout": "#fb8c00", "error": "#263238"}
_DARK = ("mismatch", "oom", "error")


def plot(grid: Grid, env: dict, path: Path) -> None:
    """The heatmap: one panel per world size, rows implementations, columns :data:`COLUMNS`
    grouped by axis, colour the class; the text a correct cell's worst ratio, a mismatch's worst
    tensor and ratio. The environment is in the title, the classes' legend on a line under it."""
    import matplotlib.pyplot as plt

    fig = figure(grid, env)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def figure(grid: Grid, env: dict):
    """The figure :func:`plot` saves (pyplot's; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    rows, cols = grid.implementations, grid.columns
    cmap = ListedColormap([_COLOURS[k] for k in CLASSES]).with_extremes(bad="white")
    norm = BoundaryNorm(np.arange(len(CLASSES) + 1) - 0.5, len(CLASSES))
    caption = (base_text(grid.device, tuple(grid.world_sizes)) + "\nGreen: the worst tensor's error over verify's allowance (twice one "
               "device's error plus a rounding), so 0.50 is as close to float64 as one device; red: the worst tensor, "
               "×N its allowance.\nGrey: what the implementation's refusal is about (the sentences are in matrix.md). "
               "Blank: not in the grid (a test variant's other columns)."
               + "".join(f"\n{', '.join(names)}: {note}." for note, names in notes_by_text(grid).items()))
    width = max(10.0, 2.0 + 0.82 * len(cols))  # inches; the legend and the title need 10
    caption = "\n".join(textwrap.fill(line, int(width * 15)) for line in caption.splitlines())
    caption_h = 0.2 + 0.15 * (caption.count("\n") + 1)
    panel_h = 0.36 * len(rows) + 1.3
    top_h = 0.85  # inches: the title, then the legend on its own line below it
    height = panel_h * len(grid.world_sizes) + top_h + caption_h
    fig, axes = plt.subplots(len(grid.world_sizes), 1, squeeze=False, figsize=(width, height))
    for ax, world_size in zip(axes[:, 0], grid.world_sizes):
        data = np.full((len(rows), len(cols)), np.nan)
        for i, name in enumerate(rows):
            for j, col in enumerate(cols):
                cell = grid.cell(name, world_size, col.key)
                if cell is None or cell.klass is None:
                    continue
                data[i, j] = CLASSES.index(cell.klass)
                ax.text(j, i, cell_text(cell, short=True), ha="center", va="center", fontsize=7.5,
                        color="white" if cell.klass in _DARK else "#202020")
        ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(cols)), [c.label for c in cols], rotation=35, ha="right", fontsize=8.5)
        ax.set_yticks(range(len(rows)), [_row_label(n) for n in rows], fontsize=8.5)
        ax.set_xticks(np.arange(len(cols) + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(len(rows) + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", linewidth=1.2)
        ax.tick_params(which="both", length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        start = 0
        for axis in grid.axes:
            n = sum(1 for c in cols if c.axis == axis)
            if start:
                ax.axvline(start - 0.5, color="white", linewidth=5)
            ax.annotate(axis, xy=(start + n / 2 - 0.5, 1), xycoords=("data", "axes fraction"), xytext=(0, 4),
                        textcoords="offset points", ha="center", va="bottom", fontsize=9, fontweight="bold")
            start += n
        counts = ", ".join(f"{n} {k}" for k, n in grid.counts(world_size).items() if n)
        ax.set_title(f"world size {world_size}   ({counts})", loc="left", fontsize=10, pad=20)
    fig.suptitle(f"ringbench matrix: {env_title(env, grid.device)}", fontsize=12, fontweight="bold", x=0.01,
                 y=1 - 0.08 / height, ha="left", va="top")
    fig.text(0.01, 0.1 / height, caption, fontsize=8, ha="left", va="bottom")
    # under the title, never over it: a long environment title spans the whole width
    fig.legend(handles=[Patch(color=_COLOURS[k], label=k) for k in CLASSES], loc="upper left", ncol=len(CLASSES),
               fontsize=8.5, frameon=False, bbox_to_anchor=(0.0, 1 - 0.4 / height))
    fig.tight_layout(rect=(0, caption_h / height, 1, 1 - top_h / height))
    return fig


def write(grid: Grid, out: Path, env: Optional[dict] = None) -> dict[str, Path]:
    """Write ``matrix.jsonl`` (one object per cell), ``matrix.md`` and ``matrix.png`` to ``out``."""
    env = environment() if env is None else env
    out.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": out / "matrix.jsonl", "md": out / "matrix.md", "png": out / "matrix.png"}
    paths["jsonl"].write_text("".join(json.dumps(cell_object(c)) + "\n" for c in grid.cells), encoding="utf-8")
    paths["md"].write_text(markdown(grid, env), encoding="utf-8")
    plot(grid, env, paths["png"])
    return paths


def print_summary(grid: Grid, console) -> None:
    """Per world size, the cells per class; then every cell that is not correct or unsupported."""
    from rich.text import Text

    for world_size in grid.world_sizes:
        counts = ", ".join(f"{n} {k}" for k, n in grid.counts(world_size).items() if n)
        console.print(Text(f"W={world_size}: {counts}"))
    for cell in grid.cells:
        if cell.klass in ("correct", "unsupported", None):
            continue
        where = ", ".join(_BY_KEY[k].label for k in cell.columns)
        line = f"  W={cell.world_size} {cell.implementation} ({where}): {cell_text(cell)}"
        if cell.klass != "mismatch" and cell.reason:
            line += f": {_first_line(cell.reason, 100)}"
        console.print(Text(line, style="red"))
