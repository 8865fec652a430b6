"""``ringbench predict --against FILE.jsonl``: every measured record predicted, and how far off each one is.

Each ``run`` record with status ok of ringbench's own variants is predicted on its own case: its
world size on one node (``env.gpu_count`` GPUs per node, or the world size), its kernel, its GPU
(``env.gpu_name``, unless ``--gpu`` names another). An emulated record (``run --emulate``, every
rank played alone on one device) is compared with the slowest rank's compute and overhead, which
is what it measured; a real one with the predicted time. The error is ``predicted / measured - 1``;
the summary gives the median and the worst of its absolute values against the bound.

Source: issue 24, item 4.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable

from ringbench.errors import SpecError


def measured_records(path: Path) -> list[dict]:
    """The ok ``run`` records of ``path`` that are not predictions.

    Raises:
        SpecError: an unreadable file, or one without such a record.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpecError(f"against {str(path)!r} cannot be read ({exc.strerror or type(exc).__name__}); pass "
                        "--against with a .jsonl file of run records") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise SpecError(f"against {str(path)!r} line {n} is not JSON; pass a .jsonl file of run records") from None
        if isinstance(rec, dict) and rec.get("task") == "run" and rec.get("status") == "ok" and not rec.get(
                "predicted") and isinstance(rec.get("spec"), dict) and rec.get("time_ms"):
            out.append(rec)
    if not out:
        raise SpecError(f"against {str(path)!r} holds no run record with status ok; pass a file ringbench run wrote")
    return out


def record_gpu(rec: dict) -> str | None:
    """The GPU a record was measured on (``env.gpu_name``), or None."""
    return (rec.get("env") or {}).get("gpu_name")


def record_gpus_per_node(rec: dict) -> int | None:
    """GPUs per node of a record's machine: its GPU count, at least its world size on one node."""
    count = (rec.get("env") or {}).get("gpu_count") or 0
    world = rec["spec"].get("world_size", 1)
    return max(count, world) if not rec["spec"].get("emulate") else world


def compare(records: list[dict], *, bound: float, target_of: Callable[[dict], Any]) -> list[dict]:
    """One row per record: ``label``, ``measured_ms``, ``predicted_ms``, ``error`` (or ``refused`` and ``reason``)."""
    from ringbench.case.fields import CaseSpec
    from ringbench.model import schedule
    from ringbench.model.predict import predict_case
    from ringbench.present.report import case_label

    rows, targets = [], {}
    for rec in records:
        row = {"label": case_label(rec), "case_id": rec.get("case_id"), "measured_ms": rec["time_ms"],
               "emulated": bool(rec.get("emulated"))}
        try:
            spec = CaseSpec.from_dict(rec["spec"]).replace(kernel=rec.get("kernel") or rec["spec"]["kernel"])
            reason = schedule.refusal(spec)
            if reason:
                raise SpecError(reason)
            key = (record_gpu(rec), record_gpus_per_node(rec))
            if key not in targets:
                targets[key] = target_of(rec)
            tgt = targets[key]
            fields = predict_case(spec, calibration=tgt.calibration, kernel=tgt.kernel(spec.kernel),
                                  cluster=tgt.cluster(spec.world_size))
        except (SpecError, schedule.Unpredictable) as exc:
            rows.append({**row, "refused": True, "reason": str(exc)})
            continue
        # Emulation plays each rank alone: what it measures is the slowest rank's compute and overhead.
        predicted = fields["prediction"]["compute_only_ms"] if rec.get("emulated") else fields["time_ms"]
        rows.append({**row, "predicted_ms": predicted, "error": predicted / rec["time_ms"] - 1,
                     "calibration": fields["prediction"]["calibration"]})
    return rows


def summary(rows: list[dict], bound: float) -> dict:
    """``count``, ``median`` and ``worst`` absolute error, ``bound`` and ``passed`` (worst within it)."""
    errors = [abs(r["error"]) for r in rows if not r.get("refused")]
    if not errors:
        return {"count": 0, "median": None, "worst": None, "bound": bound, "passed": False}
    worst = max(errors)
    return {"count": len(errors), "median": statistics.median(errors), "worst": worst, "bound": bound,
            "passed": worst <= bound}
