"""The tables of ``ringbench predict`` and ``ringbench advise``.

A predicted record (``ringbench.model.predict``) is a run record with ``predicted: true`` and a
``prediction`` object; these tables show its figures with their intervals, its critical path and
its bytes per link class. Torch-free.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ringbench.present.formatting import compact_table, milliseconds, number, rate, text
from ringbench.records.access import record_field
from ringbench.variants import plural

_PART_HEADERS = (("compute", "compute"), ("overhead", "overhead"), ("comm", "exposed\ncomm"), ("wait", "wait\npeers"))


def variant_cell(record: dict) -> str:
    """``usp U=8 x R=8`` (with the placement when it is not the grid's own), else the variant's name."""
    p = record.get("prediction") or {}
    name = text(record_field(record, "variant"))
    u, r = p.get("ulysses_degree"), p.get("ring_degree")
    if u and r and (record_field(record, "ulysses_degree") or (u > 1 and r > 1)):  # usp: every factorization
        name += f" U={u}xR={r}"
        if p.get("placement") == "ring-inner":
            name += " ring-inner"
    layout = record_field(record, "layout")
    if layout:
        name += f" {layout}"
    return name


def interval_text(value, bounds, fmt) -> str:
    """``12.3 (11.9-12.8)``."""
    if not bounds:
        return fmt(value)
    return f"{fmt(value)} ({fmt(bounds[0])}-{fmt(bounds[1])})"


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 1024 ** 3:.2f}"


def _path(record: dict) -> str:
    """The critical path as shares of the time: compute/overhead/exposed comm/waiting for peers."""
    parts, total = record["prediction"]["critical_path_ms"], record["time_ms"] or 1.0
    return "/".join(f"{100 * parts[k] / total:.0f}" for k, _ in _PART_HEADERS)


#: The footnote of an efficiency above 1 (docs/methodology.md, Efficiency, says more).
EFFICIENCY_NOTE = ("* efficiency above 1: the reference is the same kernel on one rank's share of the sequence, run "
                   "as one causal block, while a rank runs other shapes that the kernel runs at a higher rate (a "
                   "ring rank mostly full blocks, a Ulysses rank one causal call over the whole sequence at fewer "
                   "heads); compare TFLOP/s per GPU (docs/methodology.md, Efficiency).")


def efficiency_cell(value) -> str:
    """The efficiency with three decimals, marked ``*`` above 1 (:data:`EFFICIENCY_NOTE`)."""
    return number(value, ".3f") + ("*" if value is not None and value > 1 else "")


def labelled(records: list[dict], rows: list[dict]) -> list[dict]:
    """``model.against.compare``'s rows of ``records`` (one a record, in order), each with its case's
    ``label`` first (``report.case_label``)."""
    from ringbench.present.report import case_label

    return [{"label": case_label(rec), **row} for rec, row in zip(records, rows, strict=True)]


def _what_differs(records: list[dict]) -> list[str]:
    """Per record, the words of its case label (``case_label``: seqlen, heads, mask, window, documents...)
    that not every record shares, less what the variant cell shows: so rows of one variant under
    several masks or lengths say which is which."""
    from ringbench.present.report import case_label

    words = [case_label(r).split() for r in records]
    common = set.intersection(*map(set, words)) if words else set()
    shown = [{text(record_field(r, "variant")), f"W={record_field(r, 'world_size')}", text(r.get("kernel"))}
             for r in records]
    return [" ".join(w for w in ws if w not in common and w not in seen) for ws, seen in zip(words, shown)]


def print_predict_table(records: list[dict], console: Console | None = None) -> None:
    """One row per predicted record: the time with its interval under it, forward over backward
    ms, TFLOP/s per GPU, efficiency, estimated peak memory, GiB sent inside a node over GiB sent
    between nodes, and the slowest rank's critical path as percentages of its time (compute /
    overhead / exposed communication / waiting for slower peers); then where the figures come from."""
    console = console or Console()
    if not records:
        return
    table = compact_table("ringbench predict")
    table.add_column("variant", no_wrap=True)
    for header in ("ms\n(interval)", "fwd ms\nbwd ms", "TFLOP/s\n/GPU", "eff.", "peak\nGiB", "GiB intra\ninter",
                   "path %\nc/o/x/w"):
        table.add_column(header, justify="right", no_wrap=True)
    apart = _what_differs(records)
    for r, extra in zip(records, apart):
        p = r["prediction"]
        lo, hi = p["interval"]["time_ms"]
        by_class = p["bytes_by_link_class"]
        table.add_row(
            f"{variant_cell(r)}\nW={record_field(r, 'world_size')} {text(r.get('kernel'))}" + (f"\n{extra}" if extra else ""),
            f"{milliseconds(r['time_ms'])}\n{milliseconds(lo)}-{milliseconds(hi)}",
            f"{milliseconds(p['fwd_ms'])}\n{milliseconds(p['bwd_ms'])}",
            rate(r["tflops_per_gpu"]), efficiency_cell(r["efficiency"]), number(r["peak_allocated_gib"], ".2f"),
            f"{_gib(by_class.get('intra-node'))}\n{_gib(by_class.get('inter-node'))}", _path(r))
    console.print(table)
    for line in dict.fromkeys(f"{r['prediction']['cluster']}; calibration: {r['prediction']['calibration']}"
                              for r in records):
        console.print(Text(line, style="dim"))
    for note in dict.fromkeys(n for r in records for n in r["prediction"]["notes"]):
        console.print(Text(f"note: {note}", style="dim"))
    if any((r["efficiency"] or 0) > 1 for r in records):
        console.print(Text(EFFICIENCY_NOTE, style="dim"))
    console.print(Text("Predicted, not measured. path %: the slowest rank's time in compute, overhead (merges, "
                       "adds, copies, host launches), exposed communication and waiting for slower peers. Intervals "
                       "from the calibration's spread (10th-90th percentile calls); the model's own error is "
                       f"{records[0]['prediction']['validated_error']}; peak GiB is estimated from shapes.",
                       style="dim"))


def print_against(rows: list[dict], summary: dict, console: Console | None = None) -> None:
    """``predict --against``: per measured record its time, the prediction and the error (red past
    the worst bound); then the records it could not predict, each reason once, numbered; what it
    left out of the files; and the median and worst error against the bound, with what missed it."""
    console = console or Console()
    table = compact_table("ringbench predict --against")
    table.add_column("case", no_wrap=True)
    for header in ("measured\nms", "predicted\nms", "error"):
        table.add_column(header, justify="right", no_wrap=True)
    reasons = list(dict.fromkeys(r["reason"] for r in rows if r.get("refused")))
    worst = summary.get("worst_bound")
    for row in rows:
        label = row["label"] + (" (emulated)" if row.get("emulated") else "")
        if row.get("refused"):
            table.add_row(label, milliseconds(row["measured_ms"]), "-",
                          Text(f"not predicted [{reasons.index(row['reason']) + 1}]", style="yellow"))
            continue
        err = row["error"]
        style = "red" if worst is not None and abs(err) > worst else ""
        table.add_row(label, milliseconds(row["measured_ms"]), milliseconds(row["predicted_ms"]),
                      Text(f"{100 * err:+.1f}%", style=style))
    console.print(table)
    for i, reason in enumerate(reasons, 1):
        n = sum(1 for r in rows if r.get("reason") == reason)
        console.print(Text(f"not predicted [{i}] ({plural(n, 'record')}): {reason}", style="yellow"))
    if summary.get("left_out"):
        console.print(Text(summary["left_out"], style="dim"))
    if summary["count"]:
        line = (f"{plural(summary['count'], 'record')} predicted: median error {100 * summary['median']:.1f}%, "
                f"worst {100 * summary['worst']:.1f}%")
    else:
        line = "no record predicted"
    verdict = "within" if summary["passed"] else "past"
    line += f" ({verdict} the bound: {summary['bound']}"
    line += f"; {'; '.join(summary['failures'])})" if summary["failures"] else ")"
    console.print(Text(line, style="green" if summary["passed"] else "red"))


def refusal_lines(refused: list) -> list[str]:
    """``refused: WHO: REASON``, one line per reason, naming the candidates (without their kernel) it refuses."""
    out = []
    for reason in dict.fromkeys(c.refusal for c in refused):
        who = ", ".join(dict.fromkeys(c.label.split(",")[0] for c in refused if c.refusal == reason))
        out.append(f"refused: {who}: {reason}")
    return out


def print_advice(ranked: list, console: Console | None = None, *, top: int, cluster: str, calibration: str) -> None:
    """``ringbench advise``: the best ``top`` candidates with their figures and why each wins or loses
    (``=`` marks those tied with the first within the model's error), what decides between tied ones,
    each one's commands, then what does not fit and what the rules refuse."""
    from ringbench.model.predict import model_error, validated_error

    console = console or Console()
    fitting = [c for c in ranked if c.record and c.fits]
    shown = fitting[:top]
    table = compact_table("ringbench advise")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("candidate", no_wrap=True)
    for header in ("ms (interval)", "TFLOP/s\n/GPU", "eff.", "peak\nGiB"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("why")
    for i, c in enumerate(shown, 1):
        r = c.record
        table.add_row(f"{i}=" if c.tied else str(i), c.label, interval_text(r["time_ms"], c.band, milliseconds),
                      rate(r["tflops_per_gpu"]), efficiency_cell(r["efficiency"]),
                      number(r["peak_allocated_gib"], ".1f"), c.reason)
    console.print(Text(cluster, style="bold"))
    console.print(table)
    priced = next((c for c in ranked if c.record), None)
    error = f"{100 * (priced.error if priced and priced.error else model_error()):.1f}%"
    notes = [f"intervals: the calibration's 10th to 90th percentile calls, widened by the model's own error "
             f"({error}: the median of docs/validation.md's check of this GPU's calibration, or its 3% bound if "
             f"larger); the model is "
             f"{(priced.record['prediction'].get('validated_error') if priced else None) or validated_error()}."]
    if any(c.tied for c in shown):
        notes.append("=: tied with #1, its interval overlapping #1's; the model cannot order them.")
    if any((c.record["efficiency"] or 0) > 1 for c in shown):
        notes.append(EFFICIENCY_NOTE)
    for note in notes:
        console.print(Text(note, style="dim"))
    if fitting:
        best = fitting[0]
        tied = [i for i, c in enumerate(fitting, 1) if c.tied]
        if tied:
            seen = [i for i in tied if i <= top]
            names = (f"#1 to #{seen[-1]}" if seen == list(range(1, len(seen) + 1)) and len(seen) > 2
                     else ", ".join(f"#{i}" for i in seen))
            if len(tied) > len(seen):
                names += f" (and {len(tied) - len(seen)} more below the table: --top {tied[-1]} shows them)"
            console.print(Text(
                f"No single winner: {names} are tied within the model's error ({error}), so a measurement "
                "decides: run each one's commands below on real GPUs, verify to check it is right and run to time "
                "it, and take the fastest measured.", style="bold"))
        else:
            console.print(Text(f"Fastest: {best.label}, ahead of every other beyond the model's error ({error}); "
                               "check it on real GPUs with its commands below.", style="bold"))
        for i, c in enumerate(shown, 1):
            console.print(Text(f"#{i} {c.label}:"))
            console.print(Text(f"  {c.commands['verify']}"))
            console.print(Text(f"  {c.commands['run']}"))
        if "NODE_RANK" in best.commands["run"]:
            console.print(Text("  (on every node, NODE_RANK its index and HOST node 0's address)", style="dim"))
    elif any(c.record for c in ranked):
        console.print(Text("No candidate fits in the GPU's memory.", style="red"))
    dropped = [c for c in ranked if c.record and not c.fits]
    for c in dropped:
        console.print(Text(f"dropped: {c.label}: {c.reason}", style="yellow"))
    refused = [c for c in ranked if c.refusal]
    for line in refusal_lines(refused):
        console.print(Text(line, style="yellow"))
    console.print(Text(f"{len(fitting)} ranked, {len(dropped)} dropped (memory), {len(refused)} refused of "
                       f"{plural(len(ranked), 'candidate')}; calibration: {calibration}; predicted, not measured "
                       "(ringbench predict --against measures the model's error).", style="dim"))
