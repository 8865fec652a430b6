"""Which GPU a prediction is for: its datasheet peaks, memory and usual links, and the calibration that prices it.

``--gpu`` names a GPU of the peaks table (``ringbench.rank.peaks.DATASHEETS``, matched by its
pattern: ``H100`` is the H100 SXM) or a calibration file. :func:`calibration_for` takes the
calibration of that GPU where one is given or shipped, and otherwise derives one from the nearest
calibrated GPU (by the ratio of their dense peaks for the case's dtype), saying so.

Torch-free. Source: issue 24.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ringbench.errors import SpecError
from ringbench.model import calibration as cal_mod
from ringbench.model.calibration import Calibration
from ringbench.rank.peaks import DATASHEETS, Datasheet, match_datasheet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class Gpu:
    """A GPU a prediction can be for.

    Attributes:
        name: the peaks table's name (``H100 SXM``).
        datasheet: its peaks entry.
        memory_gib, hbm_gb_s: memory and its bandwidth (``gpus.toml``); ``None`` where not known.
        intra, inter: the fabric rows a host of them usually has (``gpus.toml``), or ``None``.
    """

    name: str
    datasheet: Datasheet
    memory_gib: float | None
    hbm_gb_s: float | None
    intra: str | None
    inter: str | None


def _gpu_rows() -> dict:
    text = resources.files("ringbench.model").joinpath("gpus.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def find_gpu(name: str, where: str = "") -> Gpu:
    """The GPU ``name`` names in the peaks table; ``where``: the cluster file that names it, if one does.

    Raises:
        SpecError: no entry's pattern matches it (naming ``where`` and its ``gpu`` key, if given).
    """
    sheet = match_datasheet(name) or match_datasheet(f"NVIDIA {name}")
    if sheet is None:  # a part of one entry's name alone (A6000, 4090)
        part = [d for d in DATASHEETS if name.strip() and name.strip().lower() in d.name.lower()]
        sheet = part[0] if len(part) == 1 else None
    if sheet is None:
        names = ", ".join(d.name for d in DATASHEETS)
        if where:
            raise SpecError(f"{where}: gpu {name!r} is not in the peaks table; set its gpu to one of {names}, or a "
                            "calibration file (.json), or pass --gpu")
        raise SpecError(f"gpu {name!r} is not in the peaks table; pass --gpu with one of {names}, or a calibration "
                        "file (.json)")
    row = _gpu_rows().get(sheet.name, {})
    return Gpu(sheet.name, sheet, row.get("memory_gib"), row.get("hbm_gb_s"), row.get("intra"), row.get("inter"))


def _peak(sheet: Datasheet, dtype: str) -> float | None:
    return sheet.peak(dtype) or sheet.peak("bf16")


def calibration_for(gpu: str, calibrations: list[Calibration], dtype: str,
                    where: str = "") -> tuple[Calibration, Gpu | None]:
    """The calibration that prices ``gpu`` (a peaks-table name, or a calibration file), and the GPU;
    ``where``: the cluster file that names ``gpu``, if one does (its refusal names the file).

    Among ``calibrations`` (the ``--calibration`` files, then the shipped ones) the first whose
    device is that GPU is taken as it is; else the one whose GPU's dense peak for ``dtype`` is
    nearest (in ratio) is scaled to it by :func:`calibration.derive`.

    Raises:
        SpecError: an unknown GPU, no calibration at all, or a calibrated device whose peaks are unknown.
    """
    if gpu.endswith(".json") or Path(gpu).is_file():
        cal = cal_mod.load(Path(gpu), "--gpu")
        sheet = match_datasheet(cal.device)
        return cal, (find_gpu(sheet.name) if sheet else None)
    for cal in calibrations:  # a device named as its calibration names it (cpu, NVIDIA H200)
        if cal.device.lower() == gpu.lower():
            sheet = match_datasheet(cal.device)
            return cal, (find_gpu(sheet.name) if sheet else None)
    target = find_gpu(gpu, where)
    for cal in calibrations:
        sheet = match_datasheet(cal.device)
        if sheet is not None and sheet.name == target.name:
            return cal, target
    known = [(cal, match_datasheet(cal.device)) for cal in calibrations if cal.device_type == "cuda"]
    known = [(cal, sheet) for cal, sheet in known if sheet is not None and _peak(sheet, dtype)]
    if not known:
        raise SpecError(f"no GPU calibration is at hand to derive {target.name} from; run ringbench calibrate on a "
                        "GPU and pass the file with --calibration")
    want = _peak(target.datasheet, dtype)
    if not want:
        # Another dtype's peak helps only where a calibrated kernel runs on the GPU at all.
        none_runs = runs_none(gpu, target, [name for cal, _ in known for name in cal.kernels])
        if none_runs:
            raise SpecError(none_runs)
        raise SpecError(f"gpu {target.name} has no dense {dtype} peak in the peaks table (ringbench/rank/peaks.py), "
                        "so no calibration can be scaled to it; pass --dtype fp16, or a calibration file of it")
    import math

    cal, sheet = min(known, key=lambda cs: abs(math.log(_peak(cs[1], dtype) / want)))
    source = find_gpu(sheet.name)
    memory = (target.hbm_gb_s / source.hbm_gb_s) if target.hbm_gb_s and source.hbm_gb_s else 1.0
    derived = cal_mod.derive(cal, target.name, rate_scale=want / _peak(sheet, dtype), memory_scale=memory)
    return derived, target


def runs_none(name: str, gpu: Gpu, kernels: list[str]) -> str | None:
    """Why ``gpu`` (given as ``name``) runs none of the calibrated ``kernels`` (its architecture
    against each kernel's ``min_sm``), in one sentence with the fix, or ``None`` where it runs one
    (or its architecture, or every kernel's, is unknown). Imports torch (the kernels' registry)."""
    from ringbench.variants.kernels import KERNELS

    arch = gpu.datasheet.arch
    known = [KERNELS[k] for k in dict.fromkeys(kernels) if k in KERNELS]
    if arch is None or not known or any(k.check_arch(arch) is None for k in known):
        return None
    needs = ", ".join(f"{k.name} needs NVIDIA sm{k.min_sm} or newer" for k in known)
    return (f"gpu {name} ({arch}) runs none of the calibration's kernels ({needs}); pass --gpu with a GPU that runs "
            "one, or a calibration measured on it (ringbench calibrate there, then --calibration FILE)")
