"""``ringbench predict --against FILE.jsonl``: every measured record predicted, and how far off each one is.

Each ``run`` record with status ok and a time, of ringbench's own variants, is predicted on its
own case: its world size on one node (``env.gpu_count`` GPUs per node, or the world size), its
kernel, its GPU (``env.gpu_name``, unless ``--gpu`` names another), replayed as a CUDA graph or
eager as its ``cuda_graph`` says. An emulated record (``run
--emulate``, every rank played alone on one device) is compared with the slowest rank's compute
and overhead, which is what it measured; a real one with the predicted time. The error is
``predicted / measured - 1``; the summary gives the median and the worst of its absolute values
against a :class:`Bound`.

Every other line of the files is counted by why it is left out (a verify record, a status other
than ok, a predicted record, a damaged line...), and a record the model cannot predict (a peer,
a kernel the calibration lacks, a GPU it cannot price) is listed with the reason.

Source: issue 24, item 4.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ringbench.errors import SpecError, unreadable
from ringbench.variants import plural


@dataclass(frozen=True)
class Bound:
    """What ``--against`` passes: the worst absolute error at most ``worst``, the median at most
    ``median`` (None: not bounded), and at least ``min_records`` records predicted (None: any, but one)."""

    worst: float
    median: Optional[float] = None
    min_records: Optional[int] = None

    def text(self) -> str:
        """``worst <= 8%, median <= 3%, at least 30 records``."""
        parts = [f"worst <= {100 * self.worst:g}%"]
        if self.median is not None:
            parts.append(f"median <= {100 * self.median:g}%")
        if self.min_records is not None:
            parts.append(f"at least {plural(self.min_records, 'record')}")
        return ", ".join(parts)


@dataclass
class Measured:
    """The records ``--against`` checks, and what it left out.

    Attributes:
        records: the ok run records with a time, each with ``_source`` (its file) added.
        left_out: why lines were left out, as said of one line and of several
            (``("verify record", "verify records")``) -> how many.
    """

    records: list[dict]
    left_out: dict[tuple[str, str], int]

    def left_out_text(self) -> Optional[str]:
        """``left out 40 lines: 33 verify records, 6 with status skipped, 1 damaged line``, or None."""
        total = sum(self.left_out.values())
        if not total:
            return None
        return f"left out {plural(total, 'line')}: " + ", ".join(plural(n, *why) for why, n in self.left_out.items())



def side_merges(rec: dict) -> bool:
    """Whether a record's ring merged on a side stream (``variants/engines/overlap.py``): a CUDA run
    whose environment has ``side_merge`` (ringbench since that engine) not set to ``"0"``; records
    from before it merged in line."""
    env = rec.get("env") or {}
    return rec["spec"].get("device") == "cuda" and "side_merge" in env and env["side_merge"] != "0"

def _same(phrase: str) -> tuple[str, str]:
    return phrase, phrase


def _why_left_out(rec: Any) -> Optional[tuple[str, str]]:
    """Why a parsed line is not a record ``--against`` checks (said of one and of several), or None."""
    if not isinstance(rec, dict):
        return "line that is not a record", "lines that are not records"
    if rec.get("predicted"):
        return "predicted record", "predicted records"
    spec = rec.get("spec")
    if not isinstance(spec, dict):
        return "record without a spec", "records without a spec"
    task = rec.get("task") or spec.get("task")
    if task != "run":
        return f"{task} record", f"{task} records"
    if rec.get("status") != "ok":
        return _same(f"with status {rec.get('status')}")
    time_ms = rec.get("time_ms")
    if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)) or not 0 < time_ms < math.inf:
        return "ok record without a time", "ok records without a time"  # none, 0, negative, infinite or text
    if not isinstance(rec.get("env", {}), dict):
        return "record with a damaged env", "records with a damaged env"
    return None


def measured_records(paths: Sequence[Path]) -> Measured:
    """The ok ``run`` records of ``paths`` that have a time and are not predictions, and a count
    of every other line by why it is left out.

    Raises:
        SpecError: an unreadable file, or files without a single such record (the message says
            what they hold instead).
    """
    records, left_out = [], {}
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
                raise SpecError(f"against {str(path)!r} cannot be read ({unreadable(exc)}); pass "
                            "--against with a .jsonl file of run records") from None
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                why = ("damaged line", "damaged lines")
            else:
                why = _why_left_out(rec)
            if why is None:
                records.append({**rec, "_source": str(path)})
            else:
                left_out[why] = left_out.get(why, 0) + 1
    found = Measured(records, left_out)
    if not records:
        names = " and ".join(repr(str(p)) for p in paths)
        held = f" ({found.left_out_text()})" if left_out else " (it is empty)"
        raise SpecError(f"against {names} {plural(len(paths), 'holds', 'hold', bare=True)} no ok run record with a "
                        f"time to check{held}; pass the records ringbench run wrote")
    return found


def latest(measured: Measured) -> Measured:
    """``measured`` with each case (``case_id``) on its last record alone (files in the order given, lines
    in file order): a case measured again, after the engine changed, is checked on what it does now.
    The earlier records are counted as left out."""
    last = {rec.get("case_id"): i for i, rec in enumerate(measured.records)}
    kept = [rec for i, rec in enumerate(measured.records) if last[rec.get("case_id")] == i]
    left_out = dict(measured.left_out)
    if len(kept) < len(measured.records):
        left_out[("record measured again later", "records measured again later")] = len(measured.records) - len(kept)
    return Measured(kept, left_out)


def record_gpu(rec: dict) -> str | None:
    """The GPU a record was measured on (``env.gpu_name``), or None."""
    return (rec.get("env") or {}).get("gpu_name")


def record_gpus_per_node(rec: dict) -> int | None:
    """GPUs per node of a record's machine: its GPU count, at least its world size on one node."""
    count = (rec.get("env") or {}).get("gpu_count") or 0
    world = rec["spec"].get("world_size", 1)
    return max(count, world) if not rec["spec"].get("emulate") else world


def record_target(rec: dict, *, gpu: Optional[str] = None, calibrations: Sequence[Path] = (),
                  cluster_file: Optional[Path] = None, gpus_per_node: Optional[int] = None, nodes: Optional[int] = None,
                  fabric: Optional[str] = None):
    """The ``model.target.Target`` a record is predicted on: its own GPU and GPUs per node (module
    docstring), unless the options given name others.

    Raises:
        SpecError: as ``target.target``; a record without a GPU and no ``gpu`` given, for one.
    """
    from ringbench.model.target import target

    kernel = rec.get("kernel") or rec["spec"].get("kernel")
    if not (gpu or record_gpu(rec) or calibrations):  # a cpu run names no GPU, and no cpu calibration ships
        raise SpecError(f"it ran on {rec['spec'].get('device') or 'a machine of no GPU'} with kernel {kernel!r}, which "
                        "no shipped calibration holds, so it cannot be checked against one; calibrate it on that "
                        f"machine with ringbench calibrate --kernel {kernel} and pass the file with --calibration")
    return target(gpu=gpu or record_gpu(rec), calibrations=list(calibrations), cluster_file=cluster_file,
                  gpus_per_node=gpus_per_node or record_gpus_per_node(rec), nodes=nodes, fabric=fabric,
                  dtype=rec["spec"].get("dtype") or "bf16")


def compare(records: list[dict], *, target_of: Callable[[dict], Any] = record_target) -> list[dict]:
    """One row per record, in the records' order: ``source``, ``variant``, ``case_id``, ``measured_ms``,
    ``emulated``, then ``predicted_ms``, ``error``, ``path`` (the prediction's shares of its time
    in compute, overhead, exposed communication and waiting) and ``calibration``, or ``refused:
    true`` and ``reason`` (one sentence) for a record the model cannot predict. ``target_of(rec)``
    gives the target of a record (default :func:`record_target`). A presenter names each row's case
    (``present.predict.labelled``)."""
    from ringbench.case.fields import CaseSpec
    from ringbench.model import schedule
    from ringbench.model.predict import predict_case

    rows, targets = [], {}
    for rec in records:
        row = {"source": rec.get("_source"), "variant": rec["spec"].get("variant"),
               "case_id": rec.get("case_id"), "measured_ms": rec["time_ms"], "emulated": bool(rec.get("emulated"))}
        try:
            try:
                spec = CaseSpec.from_dict(rec["spec"]).replace(kernel=rec.get("kernel") or rec["spec"]["kernel"])
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, SpecError):
                    raise
                raise SpecError(f"its spec cannot be read by this ringbench ({type(exc).__name__}: {exc})") from None
            reason = schedule.refusal(spec)
            if reason:
                raise SpecError(reason)
            key = (record_gpu(rec), record_gpus_per_node(rec))
            if key not in targets:
                targets[key] = target_of(rec)
            tgt = targets[key]
            # Priced as it ran: replayed as a CUDA graph, or eager; merges beside the kernels or in line.
            fields = predict_case(spec, calibration=tgt.calibration, kernel=_kernel(spec.kernel, tgt),
                                  cluster=tgt.cluster(spec.world_size), graph=bool(rec.get("cuda_graph")),
                                  side=side_merges(rec))
        except (SpecError, schedule.Unpredictable) as exc:
            rows.append({**row, "refused": True, "reason": str(exc)})
            continue
        # Emulation plays each rank alone: what it measures is the slowest rank's compute and overhead.
        predicted = fields["prediction"]["compute_only_ms"] if rec.get("emulated") else fields["time_ms"]
        path = fields["prediction"]["critical_path_ms"]
        rows.append({**row, "predicted_ms": predicted, "error": predicted / rec["time_ms"] - 1,
                     "path": {part: ms / fields["time_ms"] for part, ms in path.items()},
                     "calibration": fields["prediction"]["calibration"], **_priced_as(rec, tgt)})
    return rows


def _priced_as(rec: dict, tgt) -> dict:
    """``{"priced_as": GPU}`` where ``--gpu`` prices a record as another GPU than the one it ran on
    (both known to the peaks table), else ``{}``."""
    from ringbench.rank.peaks import match_datasheet

    ran, priced = match_datasheet(record_gpu(rec)), getattr(tgt, "gpu", None)
    return {"priced_as": priced.name} if ran and priced and ran.name != priced.name else {}


def other_gpu_note(rows: list[dict]) -> Optional[str]:
    """One sentence where some rows were priced as another GPU than they ran on, else None."""
    other = [r for r in rows if r.get("priced_as")]
    if not other:
        return None
    one = len(other) == 1
    return (f"{plural(len(other), 'record')} ran on another GPU than {other[0]['priced_as']}, which --gpu (or the "
            f"cluster file) prices {'it' if one else 'them'} as: {'its error compares' if one else 'their errors compare'}"
            " two GPUs, not the model with a run; drop --gpu to price each record on its own GPU")


def _kernel(name: str, tgt) -> str:
    """The calibrated kernel a record is priced with: its own (``Target.kernel``).

    Raises:
        SpecError: a kernel the calibration lacks, with how to calibrate it (``--against`` takes no
            --kernel, so the calibration's own fix would not do).
    """
    cal = tgt.calibration
    why = tgt.kernel_refusal(name) if name != "auto" else None
    if why:  # --against takes no --kernel: the record ran this one
        raise SpecError(f"{why}, and the record ran it; drop --gpu to price each record on the GPU it ran on")
    if name != "auto" and name not in cal.kernels:
        raise SpecError(f"kernel {name!r} is not in the calibration of {cal.device}, which holds "
                        f"{', '.join(tgt.kernels() or cal.kernels)}, so its records cannot be checked against it; calibrate it on the "
                        f"machine they ran on with ringbench calibrate --kernel {name} and pass the file with "
                        "--calibration")
    return tgt.kernel(name)


def none_predicted(rows: list[dict], paths: Sequence[Path]) -> Optional[str]:
    """Why ``--against`` has nothing to check when the model refuses every record of ``rows`` (the
    rows of :func:`compare`), in one sentence naming the files, the first record and its reason, or None.
    It is the input's fault, not the model's error, so the CLI exits 2 on it, not 1."""
    if not rows or not all(r.get("refused") for r in rows):
        return None
    names = " and ".join(repr(str(p)) for p in paths)
    first = rows[0]
    reason = first["reason"].rstrip(".").replace("; ", ", ")
    return (f"against {names}: the model can predict none of its {plural(len(rows), 'ok run record')}; the first, "
            f"{first['label']}, because {reason}; pass run records of ringbench's own variants on a GPU the model "
            "prices")


def summary(rows: list[dict], bound: Bound) -> dict:
    """``count`` (records predicted), ``refused``, ``median`` and ``worst`` absolute error, ``bound``
    (its text) and its parts (``worst_bound``, ``median_bound``, ``min_records``), ``passed``, and
    ``failures``: one phrase per part of the bound that was missed."""
    errors = [abs(r["error"]) for r in rows if not r.get("refused")]
    refused = sum(1 for r in rows if r.get("refused"))
    median = statistics.median(errors) if errors else None
    worst = max(errors) if errors else None
    failures = []
    if not errors:
        failures.append("no record could be predicted")
    else:
        if worst > bound.worst:
            failures.append(f"the worst error, {100 * worst:.1f}%, is past {100 * bound.worst:g}%")
        if bound.median is not None and median > bound.median:
            failures.append(f"the median error, {100 * median:.1f}%, is past {100 * bound.median:g}%")
        if bound.min_records is not None and len(errors) < bound.min_records:
            failures.append(f"{plural(len(errors), 'record')} predicted, fewer than {bound.min_records}")
    return {"count": len(errors), "refused": refused, "median": median, "worst": worst, "bound": bound.text(),
            "worst_bound": bound.worst, "median_bound": bound.median, "min_records": bound.min_records,
            "passed": not failures, "failures": failures}
