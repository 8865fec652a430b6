"""Presenting records: rich tables for the terminal and JUnit XML for CI.

Everything here reads the record dicts of docs/contracts.md and nothing else; it imports no
torch, so a report of old results works on a machine without GPUs.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from ringbench.case.fields import BY_NAME, GROWTH_KEY, VARIANT_OPTIONS, format_size
from ringbench.present.formatting import (MISSING, FitTable, compact_table, docs_count, milliseconds, number, rate,
                                          ratio_text, text)
from ringbench.records import cp_reasons
from ringbench.records.access import kernel_ran, record_field
from ringbench.variants import plural

_STATUS_STYLE = {"ok": "green", "skipped": "yellow"}
#: The bus GiB/s cell of a run whose bytes cannot be counted (``bytes_counted: false``).
NOT_COUNTED = "not counted"


def _status_text(status: Any) -> Text:
    status = text(status)
    return Text(status, style=_STATUS_STYLE.get(status, "bold red"))


def _heads(record: dict) -> str:
    heads, kv_heads = record_field(record, "heads"), record_field(record, "kv_heads")
    if heads is None:
        return MISSING
    return f"{heads}/{text(kv_heads)}"


def _causal(record: dict) -> str:
    """``causal`` or ``non-causal``; ``masked`` under a mask, which the options name (``mask=prefix:512``)."""
    if record_field(record, "mask"):
        return "masked"
    causal = record_field(record, "causal")
    return MISSING if causal is None else ("causal" if causal else "non-causal")


def _size(record: dict) -> str:
    seqlen = record_field(record, "seqlen")
    return MISSING if seqlen is None else format_size(int(seqlen))


def _batch(record: dict) -> Any:
    """The batch when it is not 1 (labels leave the common case out), else None."""
    batch = record_field(record, "batch")
    return None if batch is None or batch == 1 else batch


def _label(record: dict, *, world_size: bool = True) -> str:
    parts = [text(record_field(record, "variant"))]
    if record_field(record, "hf_model"):
        parts.insert(0, str(record_field(record, "hf_model")))
    if world_size:
        parts.append(f"W={text(record_field(record, 'world_size'))}")
    if _batch(record) is not None:
        parts.append(f"B={_batch(record)}")
    parts += [
        f"S={_size(record)}",
        f"H={_heads(record)}",
        f"D={_head_dims(record)}",
        text(record_field(record, "dtype")),
        _causal(record),
        text(kernel_ran(record)),
    ]
    if record_field(record, "mode") == "fwd":
        parts.append("fwd")
    return " ".join(parts + _options(record))


def _head_dims(record: dict) -> str:
    """``128``, or ``192/128`` where the value head dim differs (head_dim_v, MLA shapes)."""
    d, dv = record_field(record, "head_dim"), record_field(record, "head_dim_v")
    return text(d) if not dv or dv == d else f"{text(d)}/{text(dv)}"


def _options(record: dict) -> list[str]:
    """The optional case fields that are set, as a label names them: the variant's options
    (layout, ``stride=N``, rotate), the documents (``docs=3000,500``, or ``7 docs`` for many), their
    padding (``pad=8``), the sink (``sink=learnable``), the bias (``bias=alibi``), ``max-logit`` and
    ``L2 flushed`` (``--flush-l2``)."""
    out = [BY_NAME[name].text(value) for name in VARIANT_OPTIONS if (value := record_field(record, name))]
    docs = record_field(record, "docs")
    if docs:
        out.append(docs_count(docs) or f"docs={docs}")
    out += [BY_NAME[name].text(value) for name in ("doc_pad", "sink", "bias", "max_logit")
            if (value := record_field(record, name)) and value != "none"]
    if record_field(record, "flush_l2"):
        out.append("L2 flushed")
    return out


def case_label(record: dict) -> str:
    """A one-line name of a record's case, e.g. ``zigzag W=2 S=16k H=32/8 D=128 bf16 causal
    torch-flash``; ``B=<batch>`` follows the world size when the batch is not 1, and `` fwd``
    is appended for forward-only cases. A model check starts with the model's name
    (``llama-tiny zigzag W=2 ...``)."""
    return _label(record)


def _shape_cell(record: dict) -> str:
    """The shape cell of the run table, e.g. ``W2 16k 32/8×128`` over ``bf16 causal fwd_bwd``:
    world size, batch (``B2``, only when not 1), seqlen and Hq/Hkv×D (query heads / K/V heads ×
    head dim) on the first line; dtype, mask, mode and any layout, stride or documents on the
    second."""
    sizes = [f"W{text(record_field(record, 'world_size'))}"]
    if _batch(record) is not None:
        sizes.append(f"B{_batch(record)}")
    sizes += [_size(record), f"{_heads(record)}×{_head_dims(record)}"]
    kind = [text(record_field(record, "dtype")), _causal(record), text(record_field(record, "mode")),
            *_options(record), *(["emulated"] if record.get("emulated") else [])]
    return " ".join(sizes) + "\n" + " ".join(kind)


def print_run_table(records: list[dict], console: Console | None = None) -> None:
    """Print one row per ``run`` record: its case, shape, status and the measured figures.

    Columns: case (variant over the kernel that ran), shape (see below), status (with a
    note number ``[n]`` when a reason was recorded), ms (slowest rank's median time of one
    iteration), imbal. (max/min over ranks), TFLOP/s per GPU, eff. (efficiency against the
    same kernel on one rank's share), peak GiB (peak allocated, max over ranks) and bus GiB/s
    (``not counted`` where the variant's bytes cannot be seen, ``bytes_counted: false``, with a
    line after the table pointing to ``ringbench verify``, which proves its communication).
    The shape reads ``W2 16k 32/8×128`` over ``bf16 causal fwd_bwd``: world size, seqlen,
    Hq/Hkv×D, then dtype, mask and mode, with ``B<batch>`` after the world size when the
    batch is not 1. An emulated record (``run --emulate``) adds ``emulated`` to the shape, its
    eff. reads ``≤0.812`` (the bound) and a line under the table says so. Absent values show as ``-``. The reasons follow the table, one numbered
    line each.

    The figures, the case and the status never wrap or shorten; on a narrow terminal (80
    columns) the shape wraps at spaces, and where a word still would not fit, known names are
    abbreviated (``tflash``) with a legend under the table; where the columns cannot fit at all,
    each row is a block of ``header: value`` lines (:class:`ringbench.present.formatting.FitTable`).

    Args:
        records: record dicts as ``results.read_records`` returns them.
        console: where to print; a new ``rich.console.Console`` when None.
    """
    console = console or Console()
    table = compact_table("ringbench run")
    # The case is two names on two lines and the status one word and its note number: they never
    # wrap; the shape, two lines already, wraps further (at spaces) when the terminal is narrow.
    table.add_column("case", no_wrap=True)
    table.add_column("shape")
    table.add_column("status", no_wrap=True)
    for header in ("ms", "imbal.", "TFLOP/s\n/GPU", "eff.", "peak\nGiB", "bus\nGiB/s"):
        table.add_column(header, justify="right", no_wrap=True)
    reasons: list[str] = []
    for r in records:
        status = _status_text(r.get("status"))
        if r.get("status") != "ok" and r.get("reason"):
            reasons.append(str(r["reason"]))
            status.append(f" [{len(reasons)}]")
        table.add_row(
            f"{text(record_field(r, 'variant'))}\n{text(kernel_ran(r))}",
            _shape_cell(r),
            status,
            milliseconds(r.get("time_ms")),
            number(r.get("imbalance"), ".3f"),
            rate(r.get("tflops_per_gpu")),
            ("≤" if r.get("emulated") and r.get("efficiency") is not None else "")
            + number(r.get("efficiency"), ".3f"),
            number(r.get("peak_allocated_gib"), ".2f"),
            NOT_COUNTED if r.get("bytes_counted") is False else rate(r.get("bus_gib_s")),
        )
    console.print(table)
    for i, reason in enumerate(reasons, 1):
        console.print(Text(f"[{i}] {reason}", style="red"))
    _print_notes(records, console)
    if any(r.get("emulated") for r in records):
        console.print(Text("emulated: one process played every rank in turn (run --emulate), so ms is compute "
                           "alone and eff. (≤) the efficiency bound at that world size; a real run can only be "
                           "slower", style="dim"))
    uncounted = [text(record_field(r, "variant")) for r in records if r.get("bytes_counted") is False]
    for variant in dict.fromkeys(uncounted):
        console.print(Text(f"{NOT_COUNTED}: {variant} moves its bytes through collectives ringbench's counters "
                           f"cannot see, so bytes_sent is null and no byte rule refuses its timing; `ringbench "
                           f"verify --variant {variant}` proves that its ranks exchange data (cp_active)",
                           style="dim"))


def _print_notes(records: list[dict], console: Console) -> None:
    """Each distinct note the variants left in the records (such as expanded K/V), once."""
    for note in dict.fromkeys(n for r in records for n in r.get("notes") or []):
        console.print(Text(f"note: {note}", style="dim"))


def _check_passed(check: dict) -> bool:
    return bool(check.get("passed")) and check.get("finite", True) is not False


def _case_outcome(record: dict) -> str:
    """``passed``, ``failed``, ``errors`` or ``skipped`` for one verify record."""
    status = record.get("status")
    checks = record.get("checks") or []
    if status == "skipped":
        return "skipped"
    if status in ("ok", "fail") and not checks:
        return "errors"  # nothing was compared, so nothing was verified
    if status == "fail" or (status == "ok" and not all(_check_passed(c) for c in checks)):
        return "failed"
    if status == "ok":
        return "passed"
    return "errors"  # error, timeout, oom, and anything unknown: the run did not finish


def verify_summary(records: list[dict]) -> dict[str, int]:
    """Count verify outcomes, for the summary line and the exit code.

    A case passes when its status is ``ok`` and every check passed; an ``ok`` record with a
    failing check counts as failed, and an ``ok`` or ``fail`` record without checks as an
    error. ``error``, ``timeout``, ``oom`` and unknown statuses are
    errors. The caller should treat ``cases == 0`` as a failure too: nothing was verified.

    Args:
        records: verify record dicts.

    Returns:
        ``{"cases", "passed", "failed", "errors", "skipped"}`` counts.
    """
    counts = {"cases": len(records), "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for r in records:
        counts[_case_outcome(r)] += 1
    return counts


def _check_notes(check: dict) -> str:
    notes = []
    if check.get("finite") is False:
        notes.append("non-finite values")
    if check.get("dtype_ok") is False:
        notes.append("wrong dtype")
    if check.get("shape_ok") is False:
        notes.append("wrong shape")
    if check.get("shadow_passed") is False:
        notes.append(f"block-decomposition ratio {ratio_text(check.get('shadow_ratio'))} over 1: precision lost "
                     "in a merge or a sum")
    if check.get("kernel_passed") is False:
        notes.append(f"the kernel alone is {number(check.get('kernel_units'), '.3g')} eps off float64, over the "
                     "kernel rule's limit")
    return ", ".join(notes)


def _ratio(check: dict) -> Any:
    ratio = check.get("ratio")
    if ratio is None:
        err, allowed = check.get("err"), check.get("allowed")
        if isinstance(err, (int, float)) and isinstance(allowed, (int, float)) and allowed > 0:
            ratio = err / allowed
    return ratio


def _case_verdicts(record: dict) -> list[tuple[str, Text, str]]:
    """The rows a verify record's case gets under its tensors: ``(name, result, note)``.

    ``repeats`` when the case ran repeats (``deterministic`` not null): PASS when every repeat
    had the same bits; FAIL naming the first differing tensor and repeat; WARN where only
    gradients differed and the kernel's backward is documented as nondeterministic (the case
    passes unless ``require_deterministic``). ``cp-active`` when context parallelism was not
    shown active: FAIL when changing one rank's K/V left the others' output unchanged, n/a with
    the reason when the case cannot show it (world size 1, no document across a rank boundary).
    """
    rows: list[tuple[str, Text, str]] = []
    deterministic = record.get("deterministic")
    if deterministic is True:
        rows.append(("repeats", Text("PASS", style="green"),
                     f"deterministic over {text(record.get('repeats'))} repeats"))
    elif deterministic is False:
        first = record.get("first_difference") or {}
        differing = record.get("differing_tensors") or [first.get("tensor")]
        note = (f"not deterministic: {', '.join(map(text, differing))} at repeat {text(first.get('repeat'))}, "
                f"max |diff| {number(first.get('max_abs_diff'), '.3g')}")
        if _known_nondeterminism(record):
            rows.append(("repeats", Text("WARN", style="yellow"), note + f"; documented for {kernel_ran(record)}"))
        else:
            rows.append(("repeats", Text("FAIL", style="bold red"), note))
    elif deterministic is None and record_field(record, "hf_model") and (record_field(record, "repeat") or 1) > 1:
        rows.append(("repeats", Text("n/a", style="yellow"), "a model check runs once; --repeat repeats attention"))
    if record.get("cp_active") is False:
        rows.append(("cp-active", Text("FAIL", style="bold red"),
                     "changing one rank's K/V left another rank's output unchanged"))
    elif record.get("cp_active") is None and record.get("cp_active_reason"):
        # The short form: the whole sentence filled a narrow note column a dozen lines deep.
        rows.append(("cp-active", Text("n/a", style="yellow"), cp_reasons.short(str(record["cp_active_reason"]))))
    return rows


def _known_nondeterminism(record: dict) -> bool:
    """Whether a record's repeats differed only in gradients of a kernel whose backward is
    documented as nondeterministic, without ``require_deterministic`` (recorded, not failed)."""
    differing = set(record.get("differing_tensors") or ())
    return bool(record.get("deterministic") is False and record.get("nondeterministic_backward")
                and not differing & {"out", "lse"} and not record_field(record, "require_deterministic"))


def print_verify_table(records: list[dict], console: Console | None = None) -> None:
    """Print one row per (case, tensor) of verify records, then the notes and, last, the summary line.

    Columns: case label, tensor, err (max |variant - fp64|), allowed (2 * err_single +
    floor), ratio (err / allowed; pass needs <= 1), result (PASS / FAIL) and, when some row
    has one, a note (non-finite, wrong dtype or shape). A case whose status is neither ``ok``
    nor ``fail`` is one row with its status and a number ``[n]``; its reason follows the table,
    one numbered line each.
    A model check (``verify --model``) has one row per tensor (loss, then each parameter's
    gradient) and a line after the table naming its worst parameter gradient (largest ratio).
    Under a case's tensors come its case-wide verdicts (:func:`_case_verdicts`): ``repeats``
    when it ran repeats, ``cp-active`` when context parallelism was not shown active (FAIL, or
    n/a with the reason the case cannot show it).
    The numbers never wrap or shorten; on a narrow terminal the case label, tensor and note wrap
    at spaces, commas, ``/`` and ``:``, and where a word still would not fit, names are
    shortened (``tflash``; parameters as ``L1.in_norm``) with a legend under the table, or each
    row becomes a block of ``header: value`` lines. No number or word is split. The notes
    the variants left and the summary come last, so the verdict is the last line.

    Args:
        records: verify record dicts as ``results.read_records`` returns them.
        console: where to print; a new ``rich.console.Console`` when None.
    """
    console = console or Console()
    rows: list[tuple[list[Any], bool]] = []  # (cells without the note, last row of its case)
    notes: list[Any] = []
    reasons: list[str] = []  # of the cases that did not finish, numbered after the table
    for r in records:
        label = case_label(r)
        status = r.get("status")
        checks = r.get("checks") or []
        if status not in ("ok", "fail") or not checks:
            shown = _status_text(status if checks or status not in ("ok", "fail") else "error")
            reasons.append(_case_reason(r))
            shown.append(f" [{len(reasons)}]")
            rows.append(([label, MISSING, MISSING, MISSING, MISSING, shown], True))
            notes.append("")
            continue
        verdicts = _case_verdicts(r)
        for j, check in enumerate(checks):
            passed = _check_passed(check)
            rows.append(([
                label if j == 0 else "",
                text(check.get("tensor")),
                number(check.get("err"), ".3e"),
                number(check.get("allowed"), ".3e"),
                ratio_text(_ratio(check)),
                Text("PASS", style="green") if passed else Text("FAIL", style="bold red"),
            ], j == len(checks) - 1 and not verdicts))
            notes.append(_check_notes(check))
        for j, (name, result, note) in enumerate(verdicts):
            rows.append(([label if not checks and j == 0 else "", name, MISSING, MISSING, MISSING, result],
                         j == len(verdicts) - 1))
            notes.append(note)

    table = FitTable("ringbench verify", compact=False)
    # The label, the tensor and the note wrap at spaces on a narrow terminal (the label down the
    # case's rows); parameter names of a model check, which have none, are shortened there
    # (L1.in_norm), and the numbers never wrap.
    table.add_column("case", flow=True)
    table.add_column("tensor")
    for header in ("err", "allowed", "ratio"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("result", no_wrap=True)
    with_notes = any(str(note) for note in notes)
    if with_notes:
        table.add_column("note", max_width=60)
    for (cells, last), note in zip(rows, notes):
        table.add_row(*cells, *([note] if with_notes else []), end_section=last)
    console.print(table)
    for i, reason in enumerate(reasons, 1):
        console.print(Text(f"[{i}] {reason}", style="red"))
    for kernel, source in dict.fromkeys((text(kernel_ran(r)), r["nondeterministic_backward"])
                                        for r in records if _known_nondeterminism(r)):
        console.print(Text(f"note: {kernel}'s backward is documented as nondeterministic, so its gradients may "
                           f"differ between repeats and the case passes (--require-deterministic fails it): "
                           f"{source}", style="dim"))
    for r in records:
        worst = r.get("worst_param")
        if isinstance(worst, dict) and worst.get("tensor"):
            console.print(Text(f"{case_label(r)}: worst parameter gradient {worst['tensor']}, ratio "
                               f"{ratio_text(worst.get('ratio'))}", style="italic"))
    _print_notes(records, console)
    console.print(summary_line(records))


def summary_line(records: list[dict]) -> Text:
    """``4 cases: 1 passed, 1 failed, 1 error, 1 skipped`` (skipped only when some were), the
    verdict :func:`print_verify_table` prints last."""
    s = verify_summary(records)
    line = Text(f"{plural(s['cases'], 'case')}: ")
    line.append(f"{s['passed']} passed", style="green")
    line.append(", ")
    line.append(f"{s['failed']} failed", style="bold red" if s["failed"] else "")
    line.append(", ")
    line.append(plural(s["errors"], "error"), style="bold red" if s["errors"] else "")
    if s["skipped"]:
        line.append(f", {s['skipped']} skipped", style="yellow")
    return line


def growth_groups(records: list[dict]) -> list[tuple[dict, dict[int, dict]]]:
    """Group verify records by their problem with the world size left out.

    Two records are one problem when they agree on every case field but the world size
    (:data:`ringbench.case.fields.GROWTH_KEY`: the layout, stride, rotation, documents and model
    included) and on the kernel that ran. Only records with checks count (a case that errored compared
    nothing); when a world size has several, the last one is kept.

    Args:
        records: verify record dicts.

    Returns:
        ``(first record, {world_size: record})`` per problem that has checks at two or more
        world sizes, in the order the problems first appear.
    """
    groups: dict[tuple, tuple[dict, dict[int, dict]]] = {}
    for r in records:
        world_size = record_field(r, "world_size")
        if not r.get("checks") or not isinstance(world_size, int):
            continue
        key = tuple(record_field(r, k) for k in GROWTH_KEY) + (kernel_ran(r),)
        first, by_world = groups.setdefault(key, (r, {}))
        by_world[world_size] = r
    return [(first, dict(sorted(by_world.items()))) for first, by_world in groups.values()
            if len(by_world) >= 2]


def _growth(errs: dict[int, Any]) -> str:
    """The largest error at a world size above 1 over the error at 1, as text."""
    base = errs.get(1)
    others = [e for w, e in errs.items() if w != 1 and isinstance(e, (int, float))]
    if not isinstance(base, (int, float)) or not others:
        return MISSING
    if any(math.isnan(e) for e in [base, *others]):
        return "nan"
    worst = max(others)
    if base == 0:
        return "1.00" if worst == 0 else "inf"
    return f"{worst / base:.2f}"


def print_growth_table(records: list[dict], console: Console | None = None) -> None:
    """Print how each tensor's error moves with the world size, one table per problem.

    Records are grouped by their case with the world size left out (:func:`growth_groups`);
    each group with checks at two or more world sizes gets a table. Rows: the tensors
    (out, lse, dq, dk, dv). Columns: ``W=<n>`` per world size, ascending, holding err
    (max |variant - fp64|; red where that check failed), with ``W=1``, the variant on one
    rank, as the baseline; then ``max/W=1``, the largest err at a world size above 1 over the
    err at W=1: the growth a longer ring brings (``-`` without a W=1 record, below 1 when
    the ring was more accurate). Nothing is printed when no group qualifies.

    Where the records carry the block-decomposition check (``shadow_ratio``), a second section
    follows: one ``<tensor> shadow`` row per tensor whose cells read ``max/mean``, the largest
    |T - T_shadow| over its allowance (the judged statistic, pass <= 1; red where it failed)
    and the mean of that ratio over the elements; ``-`` where the check does not apply (a
    peer). A correct variant's max stays at or below 0.5 at every world size (one rounding);
    accumulation in the input dtype makes it grow with W. A line after the tables says so.

    Args:
        records: verify record dicts as ``results.read_records`` returns them.
        console: where to print; a new ``rich.console.Console`` when None.
    """
    console = console or Console()
    shown_shadow = False
    for first, by_world in growth_groups(records):
        # The title on its own line: a table title would wrap at the (narrow) table's width.
        console.print(Text(f"error growth: {_label(first, world_size=False)}", style="italic"))
        table = compact_table(None)
        table.add_column("tensor", no_wrap=True)
        for world_size in by_world:
            table.add_column(f"W={world_size}", justify="right", no_wrap=True)
        table.add_column("max/W=1", justify="right", no_wrap=True)
        checks = {w: {c.get("tensor"): c for c in r["checks"]} for w, r in by_world.items()}
        tensors = list(dict.fromkeys(t for by_tensor in checks.values() for t in by_tensor))
        shadowed = [t for t in tensors
                    if any((by_tensor.get(t) or {}).get("shadow_ratio") is not None for by_tensor in checks.values())]
        for tensor in tensors:
            cells: list[Any] = [text(tensor)]
            errs: dict[int, Any] = {}
            for world_size, by_tensor in checks.items():
                check = by_tensor.get(tensor)
                if check is None:
                    cells.append(MISSING)
                    continue
                errs[world_size] = check.get("err")
                cells.append(Text(number(check.get("err"), ".2e"),
                                  style="" if _check_passed(check) else "bold red"))
            cells.append(_growth(errs))
            table.add_row(*cells)
        for tensor in shadowed:
            row: list[Any] = [f"{text(tensor)} shadow"]
            for by_tensor in checks.values():
                check = by_tensor.get(tensor) or {}
                if check.get("shadow_ratio") is None:
                    row.append(MISSING)
                    continue
                cell = f"{number(check.get('shadow_ratio'), '.2f')}/{number(check.get('shadow_mean_ratio'), '.2f')}"
                row.append(Text(cell, style="bold red" if check.get("shadow_passed") is False else ""))
            table.add_row(*row, "")
        shown_shadow = shown_shadow or bool(shadowed)
        console.print(table)
    if shown_shadow:
        console.print(Text("shadow: max/mean over the elements of |T - T_shadow| over its allowance, T_shadow the "
                           "variant's own blocks merged in float64; pass <= 1, one rounding gives <= 0.5",
                           style="dim"))


def _case_reason(record: dict) -> str:
    if record.get("reason"):
        return str(record["reason"])
    if record.get("status") in ("ok", "fail") and not record.get("checks"):
        return f"status {record['status']} but no checks were recorded"
    return MISSING


def _property_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _failure_message(record: dict) -> str:
    bad = [c for c in record.get("checks") or [] if not _check_passed(c)]
    if not bad:
        return text(record.get("reason")) if record.get("reason") else "status fail"
    parts = []
    for c in bad:
        over_max = not (isinstance(c.get("ratio"), (int, float)) and c["ratio"] <= 1)
        part = (f"{text(c.get('tensor'))}: err {number(c.get('err'), '.3e')} > allowed "
                f"{number(c.get('allowed'), '.3e')}" if over_max else f"{text(c.get('tensor'))}: within the max rule")
        notes = _check_notes(c)
        parts.append(f"{part} ({notes})" if notes else part)
    return f"{len(bad)} of {plural(len(record.get('checks') or []), 'tensor')} failed: " + "; ".join(parts)


def write_junit(records: list[dict], path: Path | str) -> None:
    """Write verify records as JUnit XML, one testcase per case, for CI dashboards.

    The file holds ``<testsuites>`` with one ``<testsuite name="ringbench.verify">``. Its
    ``<properties>`` come from the first record's ``env`` (dicts and lists as JSON text).
    Each case is ``<testcase classname="ringbench.verify.<variant>" name="<case label>">``;
    a failing check gives ``<failure>`` naming each tensor over its allowance with err and
    allowed; status error, timeout or oom gives ``<error>`` with the reason; skipped gives
    ``<skipped>``. ``time`` is the record's ``elapsed_s`` when it has one, else 0.

    Args:
        records: verify record dicts.
        path: the XML file to write; parent folders are created.
    """
    summary = verify_summary(records)
    total_s = sum(float(r.get("elapsed_s") or 0.0) for r in records)
    suites = ET.Element("testsuites", tests=str(summary["cases"]),
                        failures=str(summary["failed"]), errors=str(summary["errors"]),
                        skipped=str(summary["skipped"]), time=f"{total_s:.3f}")
    suite = ET.SubElement(suites, "testsuite", name="ringbench.verify",
                          tests=str(summary["cases"]), failures=str(summary["failed"]),
                          errors=str(summary["errors"]), skipped=str(summary["skipped"]),
                          time=f"{total_s:.3f}")
    env = records[0].get("env") if records else None
    if isinstance(env, dict) and env:
        props = ET.SubElement(suite, "properties")
        for key, value in env.items():
            ET.SubElement(props, "property", name=str(key), value=_property_value(value))
    for r in records:
        case = ET.SubElement(suite, "testcase",
                             classname=f"ringbench.verify.{text(record_field(r, 'variant'))}",
                             name=case_label(r), time=f"{float(r.get('elapsed_s') or 0.0):.3f}")
        outcome = _case_outcome(r)
        if outcome == "failed":
            message = _failure_message(r)
            failure = ET.SubElement(case, "failure", message=message, type="tolerance")
            failure.text = json.dumps(r.get("checks") or [], indent=1)
        elif outcome == "errors":
            ET.SubElement(case, "error", message=_case_reason(r), type=text(r.get("status")))
        elif outcome == "skipped":
            ET.SubElement(case, "skipped", message=text(r.get("reason")))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.indent(suites)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
