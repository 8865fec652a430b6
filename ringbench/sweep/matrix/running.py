"""Running the matrix's cells through the sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ringbench.variants import plural
from ringbench.sweep.matrix.classes import classify
from ringbench.sweep.matrix.grid import Grid, _LAUNCH_APART


# --------------------------------------------------------------------------- running it

def run(grid: Grid, *, out: Path, timeout_s: Optional[float] = None, resume: bool = False, launcher=None,
        err=None, yes: bool = False) -> int:
    """Verify every cell the spec accepts, record the refused ones, and classify every cell.

    The launched cells go to ``sweep.run_sweep`` (its watchdog, one launch per world size, its
    records in ``OUT/verify.jsonl``), the refused ones as its ``skipped`` cases; the variants of
    :data:`_LAUNCH_APART` go to a second sweep of their own. With ``resume``, the sweep's resume
    reuses every ok record, and the matrix reuses a cell's latest mismatch, error, oom or
    timeout record too (a result, not a case left over), and a skipped record that gives the
    same reason; only cells without a record are launched. ``yes`` starts what the sweep's
    estimate would refuse on CPU (``--yes``: a sweep over 30 minutes, ranks the machine cannot hold).

    Returns:
        0 once every cell is classified; else the sweep's exit code, and the cells stay
        unclassified: 130 or 143 when it was interrupted, 2 when it refused to start (it printed
        why).
    """
    from rich.console import Console

    from ringbench.records import build as records, store as results
    from ringbench.sweep import run as sweep

    err = err or Console(stderr=True, soft_wrap=True)
    earlier: dict[str, dict] = {}
    if resume:
        for record in results.read_records(sweep.results_file(out, "verify")):
            if record.get("case_id"):
                earlier[record["case_id"]] = record  # the latest of each case
    cases, skipped, reused = [], {}, {}
    for cell in grid.cells:
        if cell.case is None:
            continue
        old = earlier.get(cell.case_id)
        if cell.refusal is not None:
            if old is not None and old.get("status") == "skipped" and old.get("reason") == cell.refusal:
                reused[cell.case_id] = old
            else:
                cases.append(cell.case)
                skipped[cell.case_id] = cell.refusal
        elif old is not None and old.get("status") != "skipped" and not records.is_done(old):
            reused[cell.case_id] = old
        else:
            cases.append(cell.case)  # the sweep's --resume reuses an ok record
    if reused:
        err.print(f"--resume: {plural(len(reused), 'cell')} {plural(len(reused), 'keeps its', 'keep their', bare=True)} "
                  "earlier record (a mismatch, error, oom, "
                  f"timeout or refusal is a result); drop --resume to verify them again", style="dim", markup=False)
    found = dict(reused)
    order = {c.case_id(): i for i, c in enumerate(cases)}
    apart = sorted((c for c in cases if c.variant in _LAUNCH_APART),
                   key=lambda c: (c.world_size, _LAUNCH_APART[c.variant], order[c.case_id()]))
    regular = [c for c in cases if c.variant not in _LAUNCH_APART]
    for part in (regular, apart) if apart else (regular,):
        ids = {c.case_id() for c in part}
        outcome = sweep.run_sweep(part, task="verify", out=out, timeout_s=timeout_s, resume=resume,
                                  skipped={k: v for k, v in skipped.items() if k in ids}, launcher=launcher,
                                  yes=yes)
        if outcome.exit_code >= 128 or (part and not outcome.records):
            return outcome.exit_code or 3  # interrupted, or refused before it started (it said why)
        found.update((r["case_id"], r) for r in outcome.records)
    for cell in grid.cells:
        cell.record = found.get(cell.case_id) if cell.case is not None else None
        if cell.record is not None:
            cell.klass, cell.reason, cell.worst = classify(cell.record)
        elif cell.refusal is not None:
            cell.klass, cell.reason, cell.worst = "unsupported", cell.refusal, None
        else:  # not expected: the sweep gives every case a record
            cell.klass, cell.reason, cell.worst = "error", "the sweep left no record of this cell", None
    return 0


