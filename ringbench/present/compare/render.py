"""The pivot and the gate's verdicts as text: a rich table, GitHub Markdown, JSON lines."""

from __future__ import annotations

import json
from typing import Any, Iterable

from rich.console import Console
from rich.text import Text

from ringbench.present.compare.gate import GateResult
from ringbench.present.compare.metrics import format_value, spread_text
from ringbench.present.compare.pivot import Contest, Pivot, contest
from ringbench.variants import plural
from ringbench.present.formatting import MISSING, axis_text, cell_text, compact_table, plain


# --------------------------------------------------------------------------- pivot

def _cell(p: Pivot, c: Contest, i: int, j: int, value: Any, spread: tuple[float, float] | None = None) -> str:
    """The text of row ``i``, column ``j``: the value, ``±S`` (half its p20-p80 range, where the
    record has one), ``×N`` against the best peer, and ``*`` for a winner (a space for the
    others, so the digits stay aligned)."""
    text = format_value(p.metric, value)
    if value is not None and spread is not None:
        text += " " + spread_text(p.metric, spread)
    if (i, j) in c.vs_peer:
        text += f" ×{c.vs_peer[(i, j)]:.2f}"
    if c.best_factorization:
        text += "†" if (i, j) in c.best_factorization else " "
    if not c.winners:
        return text
    return text + ("*" if (i, j) in c.winners else " ")


def peer_names() -> str:
    """The peer variants (``Variant.peer``), a family of several sharing a prefix as one
    (``torch_cp, rfa_*, yc_*``)."""
    from ringbench.variants import VARIANTS

    families: dict[str, list[str]] = {}
    for name, variant in VARIANTS.items():
        if variant.peer:
            families.setdefault(name.split("_")[0], []).append(name)
    return ", ".join(names[0] if len(names) == 1 else f"{prefix}_*" for prefix, names in families.items())


def contest_legend(c: Contest) -> str | None:
    """The line that explains the marks, or ``None`` when there are none."""
    if not c.winners and not c.best_factorization:
        return None
    legend = "* best of the variants (and their options) that share every other field" if c.winners else ""
    if c.vs_peer:
        legend += f"; ×N: against the best peer variant ({peer_names()}) there, above 1 is better"
    if c.best_factorization:
        legend += ("; " if legend else "") + "† best Ulysses x ring factorization (ulysses_degree) of its variant"
    return legend


def spread_legend(p: Pivot) -> str | None:
    """The line that explains ``±``, or ``None`` when no cell has a spread."""
    if not any(s is not None for row in p.spreads() for s in row):
        return None
    return "±: half the p20-p80 range of the iteration times (tflops: derived from them); none for older records"


def title(p: Pivot) -> str:
    """``TFLOP/s per GPU by seqlen``, with ``, predicted (not measured)`` where every record is a
    prediction; where only some are, their rows say ``predicted`` in their own column."""
    return f"{p.metric.label} by {p.x}" + (", predicted (not measured)" if p.all_predicted else "")


def print_pivot(p: Pivot, console: Console | None = None) -> None:
    """Print the pivot as a rich table: the row fields, then one column per x value.

    The best value among rows that differ only in their variant is marked ``*``, and
    ringbench's variants show ``×N``, their value against the best peer's (see
    :func:`ringbench.present.compare.pivot.contest`). A panel's fields are written on its first row only.
    On a narrow terminal the row labels wrap only at spaces, commas, ``/`` and ``:``; where a name
    still would not fit, known names are abbreviated (``W``, ``tflash``) and a legend under the table
    spells them out, and where the columns cannot fit at all each row becomes a block of
    ``header: value`` lines (:class:`ringbench.present.formatting.FitTable`). Markdown and JSON keep
    the full names.
    """
    console = console or Console()
    c = contest(p)
    # The title on its own line: a table title would wrap at the (narrow) table's width.
    console.print(Text(title(p), style="italic"))
    table = compact_table(None)
    rows, spreads = p.rows(), p.spreads()
    for name in p.index:
        # Row labels wrap at spaces, commas, / and : (or are abbreviated, with a legend, where
        # a name would not fit); the numbers never shrink.
        table.add_column(name)
    for j, value in enumerate(p.columns()):
        header = axis_text(p.x, value)
        width = max([len(header), *(len(_cell(p, c, i, j, vals[j], spreads[i][j]))
                                    for i, (_, vals) in enumerate(rows))])
        # Where nothing else fits, a value wraps at its space, over its ×N.
        table.add_column(header, justify="right", no_wrap=True, min_width=width, squeeze=True)
    previous: list[Any] = []
    for i, (key, values) in enumerate(rows):
        shown = [("" if n < len(p.panels) and previous[:n + 1] == key[:n + 1] else cell_text(name, k))
                 for n, (name, k) in enumerate(zip(p.index, key))]
        table.add_row(*shown, *(_cell(p, c, i, j, v, spreads[i][j]) for j, v in enumerate(values)),
                      end_section=False)
        previous = key
    console.print(table)
    for legend in (contest_legend(c), spread_legend(p)):
        if legend:
            console.print(Text(legend, style="dim"))


def pivot_markdown(p: Pivot) -> str:
    """The pivot as a GitHub Markdown table (no dependency), with a title line and the legend."""
    c = contest(p)
    headers = [*p.index, *(axis_text(p.x, v) for v in p.columns())]
    align = [":--"] * len(p.index) + ["--:"] * len(p.table.columns)
    lines = [f"**{title(p)}**", "", _md_row(headers), _md_row(align)]
    spreads = p.spreads()
    for i, (key, values) in enumerate(p.rows()):
        lines.append(_md_row([*(cell_text(n, k) for n, k in zip(p.index, key)),
                              *(_cell(p, c, i, j, v, spreads[i][j]) for j, v in enumerate(values))]))
    legend = contest_legend(c)
    # Escaped, so Markdown shows the star instead of starting a list.
    notes = ([f"\n\\{legend}"] if legend else []) + ([f"\n{spread_legend(p)}"] if spread_legend(p) else [])
    return "\n".join(lines + notes) + "\n"


def _md_row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def pivot_json_lines(p: Pivot) -> list[str]:
    """One JSON object per pivot row: the row fields, ``metric``, ``column``, ``x``, ``values``
    (x value as text -> the metric, null where not measured), ``best`` (the x values where the
    row is best of its group, see :func:`ringbench.present.compare.pivot.contest`), ``vs_best_peer``
    (x value -> ratio, for ringbench's variants where a peer was measured) and ``spread`` (x value
    -> ``[p20, p80]`` of the metric, where the record has the quantiles)."""
    c = contest(p)
    columns = [plain(x) for x in p.columns()]
    spreads = p.spreads()
    out = []
    for i, (key, values) in enumerate(p.rows()):
        row = dict(zip(p.index, key))
        row.update(metric=p.metric.name, column=p.metric.column, x=p.x,
                   values=dict(zip(columns, values)),
                   spread={x: list(s) for x, s, v in zip(columns, spreads[i], values) if s is not None
                           and v is not None},
                   best=[x for j, x in enumerate(columns) if (i, j) in c.winners],
                   best_factorization=[x for j, x in enumerate(columns) if (i, j) in c.best_factorization],
                   vs_best_peer={x: round(c.vs_peer[(i, j)], 4) for j, x in enumerate(columns)
                                 if (i, j) in c.vs_peer})
        out.append(json.dumps(row))
    return out


# --------------------------------------------------------------------------- regression gate

def _case_words(fields: list[str], values: dict[str, Any]) -> str:
    """A case named by its varying fields, such as ``zigzag cudnn 16k fwd_bwd``."""
    return " ".join(cell_text(f, values[f]) for f in fields)


def print_gate(result: GateResult, console: Console | None = None) -> None:
    """Print the matched cases, one row per case and metric (baseline, candidate, change %,
    verdict), then the unmatched cases and a summary line."""
    console = console or Console()
    rules = ", ".join(t.text() for t in result.thresholds) or "none, changes only"
    if result.beyond_spread and result.thresholds:
        rules += "; beyond the p20-p80 spread"
    console.print(Text(f"regression gate ({rules})", style="italic"))
    table = compact_table(None)
    several = len(result.metrics) > 1
    table.add_column("case")
    if several:
        table.add_column("metric", no_wrap=True)
    for header in ("baseline", "candidate", "change"):
        table.add_column(header if several or header == "change" else f"{result.metrics[0].name}\n{header}",
                         justify="right", no_wrap=True)
    table.add_column("verdict", min_width=9)
    for row in result.rows:
        for i, m in enumerate(result.metrics):
            bv, cv, change = row.values[m.name]
            better = change is not None and change != 0 and (change > 0) == m.higher_is_better
            verdict = row.verdicts[m.name]
            cells: list[Any] = [_case_words(result.fields, row.fields) if i == 0 else ""]
            if several:
                cells.append(m.name)
            spreads = row.spreads.get(m.name, (None, None))
            cells += [*(format_value(m, v) + (" " + spread_text(m, s) if s is not None and v is not None else "")
                        for v, s in zip((bv, cv), spreads)),
                      Text(MISSING if change is None else f"{change:+.1f}%",
                           style="" if change is None else ("green" if better else "yellow")),
                      Text(verdict, style="bold red" if verdict.startswith("REGRESSED") else "")]
            table.add_row(*cells, end_section=several and i == len(result.metrics) - 1)
    console.print(table)
    if any(s is not None for row in result.rows for pair in row.spreads.values() for s in pair):
        console.print(Text("±: half the p20-p80 range of the iteration times (tflops: derived from them)",
                           style="dim"))
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
    """One JSON object per matched case (its fields, per metric baseline, candidate,
    ``change_pct``, verdict, and ``baseline_spread`` and ``candidate_spread``: ``[p20, p80]`` or
    null, and ``regressed``), then one per unmatched case (``"matched": false``, ``only_in``)."""
    out = []
    for row in result.rows:
        out.append(json.dumps({
            "case_id": row.case_id, "matched": True, **row.fields,
            **{m: {"baseline": b, "candidate": c, "change_pct": ch, "verdict": row.verdicts[m],
                   **{f"{side}_spread": list(s) if s is not None else None
                      for side, s in zip(("baseline", "candidate"), row.spreads.get(m, (None, None)))}}
               for m, (b, c, ch) in row.values.items()},
            "regressed": row.regressed}))
    for side, cases in (("baseline", result.only_baseline), ("candidate", result.only_candidate)):
        for case_id, fields in cases:
            out.append(json.dumps({"case_id": case_id, "matched": False, "only_in": side, **fields}))
    return out
