"""The validation page (``docs/validation.md``): ringbench's model checked against what was measured.

Three checks (issue 24, item 4; the first on two cards), each with its bound, its result and pass or fail:

- **(a)** ringbench's own run records on one H200 (world size 1 and emulated world sizes), every
  committed file of them, as ``predict --against`` reads them; bound: median error <= 3%, worst
  <= 8%, at least 30 records predicted; and the same check on one H100, with the calibration it
  measured in the same lease;
- **(b)** the real two-GPU records of 2026-11-30 (NCCL over NVLink); bound: every zigzag, ring
  and varlen record within 10%, predicted at or above the measurement (its time at most the
  measured one), as the engine measured there was slower than today's;
- **(c)** ring-flash-attn's published table on 8 x H800 (``model.published``), predicted on an
  H800 derived from the H200 calibration by peak ratio with H800's NVLink fabric row; bounds:
  ring and stripe within 5 points of their figures, zigzag between 85% and 100%; the other rows
  are reported with the same reading.

The page's tables sit between ``<!-- validation:begin -->`` and ``<!-- validation:end -->``;
``python -m ringbench.present.validation`` (from the checkout's root) writes them, and
``tests/test_validation.py`` fails when they differ from what the command gives now (a changed
model, calibration or record). Nothing in them depends on the day or the machine.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ringbench.model.against import Bound
from ringbench.model.predict import MEDIAN_BOUND, VALIDATED
from ringbench.present.predict import labelled
from ringbench.variants import plural

#: The checkout's root (this file is ringbench/present/validation.py).
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "validation.md"
MARKER = "validation"
#: The command that rewrites the page's tables, as the stale-page message names it.
REGENERATE = "python -m ringbench.present.validation"
REFERENCE = "results/reference"
#: The shipped H200 calibration, from which check (c) derives the H800.
H200_CALIBRATION = Path(__file__).resolve().parents[1] / "model" / "calibrations" / "h200.json"
#: The variants check (b) bounds: the ring family and the varlen variants (issue 24's "zigzag, ring and varlen").
RING_AND_VARLEN = ("ring", "zigzag", "ring_varlen", "zigzag_varlen", "llama3_varlen")


@dataclass(frozen=True)
class RecordCheck:
    """A check of measured records: its files (relative to the root), its bound and what it bounds.

    Attributes:
        key, title: ``a`` and its heading.
        files: the ``.jsonl`` files, relative to the checkout's root.
        bound: the ``predict --against`` bound (check a), or the band of check (b) (``worst`` the
            largest error, one-sided: the predicted time at most the measured one).
        bounded: which rows the bound holds for (None: every predicted row).
        one_sided: the prediction must be at or above the measurement (error <= 0) too.
        device: the calibrated device whose model error a check of its own records measures (the
            device name of its calibration), or "" for a check of another kind.
        latest: a case measured again in a later file (the same ``case_id``) is checked on its
            latest record alone, the earlier ones left out and counted: the engine changed between them.
    """

    key: str
    title: str
    files: tuple[str, ...]
    bound: Bound
    bounded: Optional[Callable[[dict], bool]] = None
    one_sided: bool = False
    device: str = ""
    latest: bool = False

    def bound_text(self) -> str:
        """The bound in words, as the page states it."""
        if not self.one_sided:
            return self.bound.text()
        return (f"every {'/'.join(RING_AND_VARLEN)} record within {100 * self.bound.worst:g}%, predicted at or above "
                "the measurement (error between "
                f"-{100 * self.bound.worst:g}% and 0)")


CHECK_A = RecordCheck(
    "a", "ringbench's own records on one H200",
    # Measured on the machine and in the lease of the shipped calibration (ringbench/model/calibrations/h200.json),
    # in runs of their own after it.
    (f"{REFERENCE}/2026-12-06-h200/call2/runs.jsonl", f"{REFERENCE}/2026-12-06-h200/call3/runs.jsonl",
     f"{REFERENCE}/2026-12-06-h200/call4/runs.jsonl"),
    Bound(0.08, median=MEDIAN_BOUND, min_records=30), device="NVIDIA H200")
#: Check (a) again on one H100: the only card lent on 2026-12-07, with the calibration it measured first in the
#: same lease (shipped as ringbench/model/calibrations/h100.json) and these records after it; a case measured
#: again by a later engine (the masks' joined slices, then their window calls folded in one launch, then the
#: lease of 2026-12-08 with the median rank's reference) is checked on its latest record.
CHECK_A_H100 = RecordCheck(
    "a, H100", "ringbench's own records on one H100",
    (f"{REFERENCE}/2026-12-07/h100/runs.jsonl", f"{REFERENCE}/2026-12-07-s4/h100/runs.jsonl",
     f"{REFERENCE}/2026-12-07-s4/h100/ab_fa4_new.jsonl", f"{REFERENCE}/2026-12-08-h100/call4/runs.jsonl"),
    Bound(0.08, median=MEDIAN_BOUND, min_records=30), device="NVIDIA H100 80GB HBM3", latest=True)
CHECK_B = RecordCheck(
    "b", "the real two-GPU records of 2026-11-30 (2 x H200, NCCL over NVLink)",
    (f"{REFERENCE}/2026-11-30-h200x2/llama3-8b.jsonl", f"{REFERENCE}/2026-11-30-h200x2/varlen.jsonl",
     f"{REFERENCE}/2026-11-30-h200x2/peers.jsonl", f"{REFERENCE}/2026-11-30-h200x2/efficient.runs.jsonl"),
    Bound(0.10), bounded=lambda row: row["variant"] in RING_AND_VARLEN, one_sided=True)
#: Check (c): the published table and the bounds on its rows (fwd_bwd, as the issue states them):
#: variant -> (lowest, highest) efficiency.
PUBLISHED = f"{REFERENCE}/published-ring-flash-attn-8xh800/table.toml"
PUBLISHED_BOUNDS = {"ring": (0.539 - 0.05, 0.539 + 0.05), "stripe": (0.829 - 0.05, 0.829 + 0.05),
                    "zigzag": (0.85, 1.00)}


# --------------------------------------------------------------------------- running the checks

def run_records(check: RecordCheck, root: Path = ROOT, target_of: Optional[Callable] = None) -> dict:
    """Check ``check`` on its files: ``rows`` (``model.against.compare``'s, each with ``file``,
    ``bounded`` and ``within``), ``left_out`` (text or None), ``summary`` (``against.summary``'s over
    the rows it bounds), ``passed`` and ``failures``. ``target_of``: as ``against.compare``'s
    (default: each record's own GPU, priced by the shipped calibrations)."""
    from ringbench.model import against

    measured = against.measured_records([root / f for f in check.files])
    if check.latest:
        measured = against.latest(measured)
    rows = labelled(measured.records, against.compare(measured.records, target_of=target_of or against.record_target))
    for row in rows:
        row["file"] = str(Path(row["source"]).relative_to(root))
        row["bounded"] = not row.get("refused") and (check.bounded is None or check.bounded(row))
        if row["bounded"]:
            error = row["error"]
            row["within"] = abs(error) <= check.bound.worst and (error <= 0 or not check.one_sided)
    summary = against.summary([r for r in rows if r["bounded"] or r.get("refused")], check.bound)
    failures = summary["failures"] if not check.one_sided else _one_sided_failures(check, rows)
    return {"rows": rows, "left_out": measured.left_out_text(), "summary": summary, "passed": not failures,
            "failures": failures}


def _one_sided_failures(check: RecordCheck, rows: list[dict]) -> list[str]:
    """What misses a one-sided band: rows off by more than its width, rows predicted slower than measured."""
    bounded = [r for r in rows if r["bounded"]]
    if not bounded:
        return ["no record could be predicted"]
    failures = []
    outside = [r for r in bounded if abs(r["error"]) > check.bound.worst]
    if outside:
        failures.append(f"{plural(len(outside), 'record')} off by more than {100 * check.bound.worst:g}%")
    above = [r for r in bounded if r["error"] > 0]
    if above:
        failures.append(f"{plural(len(above), 'record')} predicted slower than measured")
    return failures


def _build(fields: dict, world_size: int):
    """A case of ``fields`` at ``world_size`` on CUDA, built as ``run`` builds it."""
    from ringbench.sweep import build

    cases, _ = build.build_cases("run", None, {**fields, "world_size": [world_size], "device": "cuda"},
                                 machine=("cuda", world_size), resolve_kernels=False)
    return cases[0]


def run_published(root: Path = ROOT) -> dict:
    """Check (c): ``table`` (the published file), ``target`` (its GPU's), ``rows`` (``model.published.predict``'s,
    each with ``bound`` and ``within`` where one holds), ``passed`` and ``failures``."""
    from ringbench.model import published
    from ringbench.model.target import target

    table = published.load(root / PUBLISHED)
    # Derived from the H200's calibration, as the check states (the H100's, of the same peak, would tie).
    tgt = target(gpu=table["gpu"], calibrations=[H200_CALIBRATION], cluster_file=None, gpus_per_node=table["world_size"], nodes=1,
                 fabric=table["fabric"], dtype=table["shape"]["dtype"])
    rows = published.predict(table, build=_build, tgt=tgt)
    failures = []
    for row in rows:
        band = PUBLISHED_BOUNDS.get(row["variant"]) if row["api"] == "batch" and row["mode"] == "fwd_bwd" else None
        row["bound"] = band
        if band:
            row["within"] = band[0] - 1e-9 <= row["predicted"] <= band[1] + 1e-9
            if not row["within"]:
                failures.append(f"{row['variant']} at {100 * row['predicted']:.1f}%, outside "
                                f"{100 * band[0]:.1f}-{100 * band[1]:.1f}%")
    return {"table": table, "target": tgt, "rows": rows, "passed": not failures, "failures": failures}


# --------------------------------------------------------------------------- the page

def _pct(x: Optional[float], signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def _ms(x: float) -> str:
    return f"{x:.4g}"


def _path(path: Optional[dict]) -> str:
    return "-" if not path else "/".join(f"{100 * path[k]:.0f}" for k in ("compute", "overhead", "comm", "wait"))


def _verdict(passed: bool, failures: list[str]) -> str:
    return "**pass**" if passed else "**fail**: " + "; ".join(failures)


def _command(check: RecordCheck) -> str:
    args = " ".join(f"--against {f}" for f in check.files)
    b = check.bound
    extra = (f" --median-bound {100 * b.median:g}%" if b.median is not None else "") + (
        f" --min-records {b.min_records}" if b.min_records is not None else "")
    return f"ringbench predict {args}{' --latest' if check.latest else ''} --bound {100 * b.worst:g}%{extra}"


def _records_section(check: RecordCheck, result: dict) -> list[str]:
    rows, s = result["rows"], result["summary"]
    lines = [f"### ({check.key}) {check.title}", "", f"Bound: {check.bound_text()}. Result: "
             f"{_verdict(result['passed'], result['failures'])}.", "", "```bash", _command(check), "```", ""]
    if check.one_sided:
        lines += ["(The command checks the band on both sides, over every record; the page bounds the "
                  f"{'/'.join(RING_AND_VARLEN)} records, one-sided.)", ""]
    lines += [f"<details><summary>The {plural(len(rows), 'record')}, one by one</summary>", "",
              "| file | case | measured ms | predicted ms | error | path % c/o/x/w | bounded |",
              "|---|---|--:|--:|--:|--:|---|"]
    reasons = list(dict.fromkeys(r["reason"] for r in rows if r.get("refused")))
    for r in rows:
        label = r["label"] + (" (emulated)" if r["emulated"] else "")
        if r.get("refused"):
            lines.append(f"| {Path(r['file']).parent.name}/{Path(r['file']).name} | {label} | {_ms(r['measured_ms'])} "
                         f"| - | not predicted [{reasons.index(r['reason']) + 1}] | - | - |")
            continue
        bounded = ("within" if r["within"] else "**outside**") if r["bounded"] else "reported"
        lines.append(f"| {Path(r['file']).parent.name}/{Path(r['file']).name} | {label} | {_ms(r['measured_ms'])} "
                     f"| {_ms(r['predicted_ms'])} | {_pct(r['error'], True)} | {_path(r.get('path'))} | {bounded} |")
    lines += ["", "</details>", ""]
    everything = [abs(r["error"]) for r in rows if not r.get("refused")]
    if everything:
        lines.append(f"Over the {plural(s['count'], 'record')} bounded: median error {_pct(s['median'])}, worst "
                     f"{_pct(s['worst'])}; over all {plural(len(everything), 'record')} predicted: median "
                     f"{_pct(statistics.median(everything))}, worst {_pct(max(everything))}.")
        lines.append("")
    for i, reason in enumerate(reasons, 1):
        n = sum(1 for r in rows if r.get("reason") == reason)
        lines.append(f"- not predicted [{i}] ({plural(n, 'record')}): {reason}")
    if result["left_out"]:
        lines.append(f"- {result['left_out']}")
    lines.append("")
    return lines


def _published_section(result: dict) -> list[str]:
    table, tgt = result["table"], result["target"]
    shape = table["shape"]
    W = table["world_size"]
    lines = ["### (c) ring-flash-attn's published table, 8 x H800", "",
             "Bound: " + ", ".join(f"{v} between {100 * lo:.1f}% and {100 * hi:.1f}%"
                                   for v, (lo, hi) in PUBLISHED_BOUNDS.items())
             + " (forward and backward, batch); the other rows are reported. Result: "
             + _verdict(result["passed"], result["failures"]) + ".", "",
             f"Inputs: the figures of [ring-flash-attn's README]({table['source']}) "
             f"(`{PUBLISHED}`); {shape['heads']}/{shape['kv_heads']} heads x {shape['head_dim']}, "
             f"{shape['dtype']}, {'causal' if shape['causal'] else 'not causal'}, batch {shape['batch']}, "
             f"{shape['tokens_per_gpu']} tokens per GPU ({shape['tokens_per_gpu'] * W} in all) at world size {W} "
             f"on one node; GPU {tgt.gpu_name}: {tgt.calibration.provenance().split(' (')[0]}; fabric "
             f"`{tgt.intra.name}` ({tgt.intra.source}); kernel `{table['kernel']}`. Varlen rows: the four sets of "
             "documents of its benchmark script, per GPU "
             + ", ".join("[" + ",".join(map(str, d)) + "]" for d in table["varlen"]["documents_per_gpu"])
             + f", so {W} times these in all, summed over the four"
             + "; llama3_varlen with heads_k_stride "
             + str(next((r.get("heads_k_stride") for r in table["varlen"]["rows"] if r.get("heads_k_stride")), "-"))
             + f". The reading is the README's: {W} x the kernel alone on one GPU's tokens, over the variant's time.",
             "",
             "| api | mode | ring-flash-attn | ringbench | published | predicted | bound | path % c/o/x/w |",
             "|---|---|---|---|--:|--:|---|--:|"]
    for r in result["rows"]:
        band = r["bound"]
        bound = "reported" if not band else (f"{100 * band[0]:.1f}-{100 * band[1]:.1f}% "
                                             f"{'within' if r['within'] else '**outside**'}")
        lines.append(f"| {r['api']} | {r['mode']} | `{r['function']}` | {r['variant']} | {_pct(r['published'])} "
                     f"| {_pct(r['predicted'])} | {bound} | {_path(r['path'])} |")
    lines.append("")
    return lines


def run_all(root: Path = ROOT) -> tuple[dict, dict, dict, dict]:
    """Checks (a), (a) on the H100, (b) and (c) on the committed files: ``run_records``' and
    ``run_published``'s results."""
    return (run_records(CHECK_A, root), run_records(CHECK_A_H100, root), run_records(CHECK_B, root),
            run_published(root))


def validated(*checks: tuple) -> str:
    """``validated.json``'s text: for each ``(RecordCheck, its result)`` of a device's own records, the
    measured median and worst error, which ``predict.model_error`` and ``predict.validated_error``
    read for a calibration of that device (advise widens its intervals by the median)."""
    out = []
    for check, result in checks:
        s = result["summary"]
        out.append({"device": check.device, "check": check.key, "records": s["count"], "median_error": s["median"],
                    "worst_error": s["worst"], "median_bound": s["median_bound"], "worst_bound": s["worst_bound"],
                    "passed": result["passed"]})
    return json.dumps({"checks": out, "written_by": REGENERATE}, indent=1) + "\n"


def generate(root: Path = ROOT, results: Optional[tuple] = None) -> str:
    """The page's generated block: the calibration used, the summary of the three checks, then each
    check's table (module docstring). ``results``: :func:`run_all`'s, computed when not given."""
    from ringbench.model import calibration as cal_mod

    cals = cal_mod.shipped()
    a, a100, b, c = results or run_all(root)
    # shipped() puts measured files first; a later one of the same device is shadowed, so never used.
    used = [cal for i, cal in enumerate(cals) if all(c.device != cal.device for c in cals[:i])]
    lines = ["Calibrations used (shipped with ringbench, `ringbench/model/calibrations/`; a provisional file of a "
             "device that has a measured one is not used): "
             + "; ".join(f"{cal.device}: {cal.provenance()}" for cal in used) + ".", "",
             "| check | records | bound | result |", "|---|---|---|---|"]
    for check, result in ((CHECK_A, a), (CHECK_A_H100, a100), (CHECK_B, b)):
        s = result["summary"]
        refused = sum(1 for r in result["rows"] if r.get("refused"))
        lines.append(f"| ({check.key}) {check.title} | {plural(len(result['rows']), 'record')}, "
                     f"{s['count']} bounded, {refused} not predicted | {check.bound_text()} | "
                     f"{_verdict(result['passed'], result['failures'])} |")
    bounded = sum(1 for r in c["rows"] if r["bound"])
    lines.append(f"| (c) ring-flash-attn's published table, 8 x H800 | {plural(len(c['rows']), 'row')}, {bounded} "
                 f"bounded | ring, stripe within 5 points; zigzag 85-100% | {_verdict(c['passed'], c['failures'])} |")
    lines.append("")
    lines += (_records_section(CHECK_A, a) + _records_section(CHECK_A_H100, a100) + _records_section(CHECK_B, b)
              + _published_section(c))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the generated block of the validation page (``argv[0]``, default :data:`PAGE`) and, with
    the default page, ``ringbench/model/validated.json``; says what it rewrote, or that both are up to
    date; returns 0."""
    from ringbench.present.doc_tables import refresh

    args = sys.argv[1:] if argv is None else argv
    page = Path(args[0]) if args else PAGE
    text = page.read_text(encoding="utf-8")
    results = run_all()
    new = refresh(text, MARKER, generate(results=results) + "\n")
    if new != text:
        page.write_text(new, encoding="utf-8")
        print(f"rewrote the validation tables of {page}")
    found = VALIDATED.read_text(encoding="utf-8") if VALIDATED.exists() else None
    written = validated((CHECK_A, results[0]), (CHECK_A_H100, results[1]))
    if not args and found != written:
        VALIDATED.write_text(written, encoding="utf-8")
        print(f"rewrote {VALIDATED}")
    if new == text and (args or found == written):  # a silent run read as a failure to run at all
        print(f"{page} is up to date: its validation tables are what the checks give now"
              + ("" if args else f", and so is {VALIDATED.name}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
