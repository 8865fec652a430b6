"""The dense peak of a device for a dtype, in TFLOP/s: from the vendors' datasheets, or measured.

``run`` refuses a result above the peak of the device it ran on (``bench.refusal``). The peak
comes from :data:`DATASHEETS` when the GPU's name (``torch.cuda.get_device_name()``) matches an
entry that has a figure for the case's dtype (``peak_source: "table"``). Otherwise (an unknown
GPU, a dtype the entry lacks, and every CPU) it is measured in the same launch, once per process
and dtype: the best rate of a square matmul on that device (``peak_source: "measured"``), and the
result is refused only above :data:`MEASURED_ALLOWANCE` times that rate. Attention's inner loops
are matmuls, so it cannot beat the machine's own matmul by much; the allowance covers a
measurement that caught the device busier than the timed run did.

The figures, all dense (the datasheets' "with sparsity" figures halved), at the rated boost
clock, per GPU:

- ``bf16``, ``fp16``: tensor-core peaks. Where fp16 with fp16 accumulation runs faster than
  with fp32 accumulation (GeForce RTX 4090, L40), the fp16 figure is the faster one, so that no
  kernel's true result is refused.
- ``fp32``: the TF32 tensor-core peak where the GPU has TF32, else the plain FP32 (vector or
  matrix) peak. A fp32 case may run on tensor cores (matmuls with TF32 allowed, the
  memory-efficient kernel's fast-fp32 path), so the TF32 figure is the bound that never refuses
  a true fp32 result; both figures are kept (``tf32``, ``fp32``).
- ``fp64``: the FP64 tensor-core (matrix) peak where there is one, else the FP64 vector peak;
  absent (so measured) where the datasheet gives none.

Torch is imported inside the functions, so the table and the matcher load without it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Optional

#: How far above a measured matmul rate a result may go before it is refused, by device type.
MEASURED_ALLOWANCE = {"cuda": 2.0, "cpu": 3.0}
#: The case dtypes a peak is looked up for.
DTYPES = ("bf16", "fp16", "fp32", "fp64")


@dataclass(frozen=True)
class Datasheet:
    """One GPU model's dense peaks, TFLOP/s, from its vendor's datasheet.

    Attributes:
        name: the model as the datasheet names it (``H100 SXM``).
        pattern: a case-insensitive regular expression searched in the device name.
        bf16, fp16, tf32, fp32, fp64: the dense peaks (see the module docstring); None where
            the datasheet gives none.
        source: the document the figures come from.
        arch: the GPU's architecture, as the kernels' requirements name it (:data:`ARCH_SOURCE`):
            ``sm<major><minor>``, its CUDA compute capability (``sm90`` is 9.0, Hopper), or an AMD
            GPU's LLVM target (``gfx942``).
    """

    name: str
    pattern: str
    bf16: Optional[float]
    fp16: Optional[float]
    tf32: Optional[float]
    fp32: Optional[float]
    fp64: Optional[float]
    source: str
    arch: str

    def peak(self, dtype: str) -> Optional[float]:
        """The bound for a case in ``dtype``: fp32 takes the TF32 figure where there is one."""
        if dtype == "fp32":
            return self.tf32 if self.tf32 is not None else self.fp32
        return getattr(self, dtype)


#: Where each entry's ``arch`` comes from.
ARCH_SOURCE = ("NVIDIA's CUDA GPUs list (developer.nvidia.com/cuda-gpus) and the CUDA C++ Programming Guide's "
               "compute capabilities; AMD's ROCm GPU hardware specifications (LLVM target)")

_NV = "NVIDIA datasheet"
_AMD = "AMD Instinct datasheet"

#: The GPUs ringbench knows, in matching order: the first entry whose pattern the device name
#: holds is the device (so ``H100 NVL`` and ``H100 PCIe`` come before the plain ``H100``, which
#: takes the SXM figures, the highest of the family).
DATASHEETS: tuple[Datasheet, ...] = (
    # Blackwell: per-GPU figures of the HGX B200 and GB200 NVL72 datasheets.
    Datasheet("GB200", r"\bGB200\b", 2500, 2500, 1250, 80, 45, "NVIDIA GB200 NVL72 datasheet, per GPU", "sm100"),
    Datasheet("B200", r"\bB200\b", 2250, 2250, 1100, 80, 40, "NVIDIA HGX B200 datasheet, per GPU", "sm100"),
    # Hopper.
    Datasheet("GH200", r"\bGH200\b", 989.4, 989.4, 494.7, 67, 67, f"{_NV} (GH200 Grace Hopper)", "sm90"),
    Datasheet("H200 NVL", r"\bH200\b.*\bNVL\b", 835.5, 835.5, 417.5, 60, 60, f"{_NV} (H200 NVL)", "sm90"),
    Datasheet("H200 SXM", r"\bH200\b", 989.4, 989.4, 494.7, 67, 67, f"{_NV} (H200 SXM)", "sm90"),
    Datasheet("H100 NVL", r"\bH100\b.*\bNVL\b", 835.5, 835.5, 417.5, 60, 60, f"{_NV} (H100 NVL)", "sm90"),
    Datasheet("H100 PCIe", r"\bH100\b.*\bPCIe\b", 756.5, 756.5, 378, 51.2, 51.2, f"{_NV} (H100 PCIe)", "sm90"),
    Datasheet("H100 SXM", r"\bH100\b", 989.4, 989.4, 494.7, 66.9, 66.9, f"{_NV} (H100 SXM)", "sm90"),
    Datasheet("H800 PCIe", r"\bH800\b.*\bPCIe\b", 756.5, 756.5, 378, 51.2, 0.8, f"{_NV} (H800 PCIe)", "sm90"),
    Datasheet("H800 SXM", r"\bH800\b", 989.4, 989.4, 494.7, 66.9, 1, f"{_NV} (H800 SXM)", "sm90"),
    Datasheet("H20", r"\bH20\b", 148, 148, 74, 44, 1, f"{_NV} (H20)", "sm90"),
    # Ampere: the PCIe and SXM boards, 40 and 80 GB, share their peaks.
    Datasheet("A100", r"\bA100\b", 312, 312, 156, 19.5, 19.5, f"{_NV} (A100, SXM and PCIe, 40 and 80 GB)", "sm80"),
    Datasheet("A800", r"\bA800\b", 312, 312, 156, 19.5, 19.5, f"{_NV} (A800, SXM and PCIe, 40 and 80 GB)", "sm80"),
    Datasheet("RTX A6000", r"\bRTX A6000\b", 154.8, 154.8, 77.4, 38.7, None, f"{_NV} (RTX A6000)", "sm86"),
    # Ada Lovelace. The L40's fp32-accumulate rate is half its fp16-accumulate rate; the L40S's is not.
    Datasheet("L40S", r"\bL40S\b", 366, 366, 183, 91.6, None, f"{_NV} (L40S)", "sm89"),
    Datasheet("L40", r"\bL40\b", 181.05, 362.1, 90.5, 90.5, None, f"{_NV} (L40)", "sm89"),
    Datasheet("L4", r"\bL4\b", 121, 121, 60, 30.3, None, f"{_NV} (L4)", "sm89"),
    Datasheet("RTX 6000 Ada", r"\bRTX 6000 Ada\b", 364.2, 364.2, 182.1, 91.1, None,
              "NVIDIA Ada Lovelace architecture whitepaper (RTX 6000 Ada)", "sm89"),
    Datasheet("GeForce RTX 4090", r"\bRTX 4090\b", 165.2, 330.3, 82.6, 82.6, None,
              "NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090)", "sm89"),
    # Volta and Turing: no bf16 tensor cores, so bf16 is measured.
    Datasheet("V100S", r"\bV100S\b", None, 130, None, 16.4, 8.2, f"{_NV} (V100S PCIe)", "sm70"),
    Datasheet("V100", r"\bV100\b", None, 125, None, 15.7, 7.8, f"{_NV} (V100 SXM2)", "sm70"),
    Datasheet("T4", r"\bT4\b", None, 65, None, 8.1, None, f"{_NV} (T4)", "sm75"),
    # AMD Instinct, as ROCm's torch names them ("AMD Instinct MI300X"); fp32 and fp64 are the
    # matrix peaks. ROCm may name an MI250X "AMD Instinct MI250X / MI250": the MI250X wins.
    Datasheet("MI325X", r"\bMI325X\b", 1307.4, 1307.4, 653.7, 163.4, 163.4, f"{_AMD} (MI325X)", "gfx942"),
    Datasheet("MI300X", r"\bMI300X\b", 1307.4, 1307.4, 653.7, 163.4, 163.4, f"{_AMD} (MI300X)", "gfx942"),
    Datasheet("MI300A", r"\bMI300A\b", 980.6, 980.6, 490.3, 122.6, 122.6, f"{_AMD} (MI300A)", "gfx942"),
    Datasheet("MI250X", r"\bMI250X\b", 383, 383, None, 95.7, 95.7, f"{_AMD} (MI250X)", "gfx90a"),
    Datasheet("MI250", r"\bMI250\b", 362.1, 362.1, None, 90.5, 90.5, f"{_AMD} (MI250)", "gfx90a"),
    Datasheet("MI210", r"\bMI210\b", 181, 181, None, 45.3, 45.3, f"{_AMD} (MI210)", "gfx90a"),
)


def match_datasheet(device_name: Optional[str]) -> Optional[Datasheet]:
    """The entry of :data:`DATASHEETS` for a device name, such as ``NVIDIA H100 80GB HBM3``, or None."""
    if not device_name:
        return None
    return next((d for d in DATASHEETS if re.search(d.pattern, device_name, re.IGNORECASE)), None)


def _figure(tflops: float) -> str:
    """A TFLOP/s figure for a sentence: whole above 100 (``989``), else three significant digits."""
    return f"{tflops:.0f}" if abs(tflops) >= 100 else f"{tflops:.3g}"


@dataclass(frozen=True)
class Peak:
    """The peak a result is checked against.

    Attributes:
        tflops: the device's dense peak for the dtype (the datasheet figure), or the rate a
            matmul reached on it (measured).
        source: ``"table"`` (:data:`DATASHEETS`) or ``"measured"``.
        dtype: the case's dtype (``bf16``...); None when not given.
        device: the device's name (``NVIDIA H200``, ``cpu``); None when not given.
        device_type: ``cuda`` or ``cpu``, for the unit of the sentence (per GPU, per rank).
        datasheet: the matched entry's name (table), or the matmul that was timed (measured:
            ``fp32 matmul``).
        allowance: the factor over ``tflops`` a result may reach (1 for the table).
    """

    tflops: float
    source: str
    dtype: Optional[str] = None
    device: Optional[str] = None
    device_type: str = "cuda"
    datasheet: Optional[str] = None
    allowance: float = 1.0

    @property
    def limit(self) -> float:
        """The highest TFLOP/s a true result can show: ``tflops * allowance``."""
        return self.tflops * self.allowance

    def refusal(self, measured: float) -> Optional[str]:
        """The one sentence that refuses ``measured`` TFLOP/s, or None when it is within the limit."""
        if not measured > self.limit:
            return None
        unit = "GPU" if self.device_type == "cuda" else "rank"
        dtype = f" {self.dtype}" if self.dtype else ""
        tf32 = " (TF32 tensor cores)" if self.dtype == "fp32" and self.source == "table" else ""
        if self.source == "table":
            where = (f"that the {self.datasheet} datasheet gives for the {self.device}" if self.datasheet
                     else "from ringbench's datasheet table")
            what = f"the dense{dtype} peak{tf32} of {_figure(self.tflops)} TFLOP/s {where}"
        else:
            what = (f"{self.allowance:g} times the {_figure(self.tflops)} TFLOP/s that a {self.datasheet or 'matmul'} "
                    f"reached on this {self.device or 'device'} in the same launch (the peak was measured, as "
                    f"ringbench's datasheet table has no{dtype} figure for it)")
        return f"measured {_figure(measured)} TFLOP/s per {unit} exceeds {what}; the result cannot be true, so it is refused"


def table_peak(device_name: Optional[str], dtype: str) -> Optional[Peak]:
    """The datasheet peak of the named GPU for ``dtype``, or None when the table has no figure."""
    entry = match_datasheet(device_name)
    figure = entry.peak(dtype) if entry is not None else None
    if figure is None:
        return None
    return Peak(tflops=float(figure), source="table", dtype=dtype, device=device_name, device_type="cuda",
                datasheet=entry.name)


# --------------------------------------------------------------------------- measuring

#: How many times a measured peak is measured again before a result above it is refused: a
#: busy moment (other processes on shared cores) can slow one measurement far more than the
#: allowance covers, and a refusal must not come from that.
REMEASURE = 2

_MEASURED: dict[tuple[str, str], Optional[Peak]] = {}


def matmul_tflops(device, dtype: str) -> float:
    """The best rate, TFLOP/s, of a square ``torch.mm`` in ``dtype`` on ``device``.

    The size doubles from 256 until one product takes a few milliseconds (or reaches 8192 on
    a GPU, 2048 on a CPU); the best of three timed products at that size counts, each after an
    untimed one at the same size. On CUDA a fp32 product runs with TF32 allowed, as a fp32
    case's kernels may.

    Raises:
        RuntimeError: the device could not run it (out of memory, say).
    """
    import torch

    from ringbench.case.fields import DTYPES as TORCH_NAMES

    torch_dtype = getattr(torch, TORCH_NAMES[dtype])
    cuda = device.type == "cuda"
    largest, enough_s = (8192, 0.004) if cuda else (2048, 0.02)

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cuda and dtype == "fp32"
    try:
        n = 256
        while True:
            a = torch.randn(n, n, device=device).to(torch_dtype)
            b = torch.randn(n, n, device=device).to(torch_dtype)
            out = torch.empty(n, n, device=device, dtype=torch_dtype)
            torch.mm(a, b, out=out)  # untimed: the first product at a size pays for its set-up
            samples = [timed(lambda: torch.mm(a, b, out=out))]
            if samples[0] >= enough_s or n >= largest:
                break
            n *= 2
        samples += [timed(lambda: torch.mm(a, b, out=out)) for _ in range(2)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2.0 * n ** 3 / min(samples) / 1e12


def measured_peak(device, dtype: str, *, again: bool = False) -> Optional[Peak]:
    """The measured peak of ``device`` for ``dtype`` (see the module docstring).

    Measured once per process and dtype, and kept; ``again=True`` measures once more and keeps
    the faster of the two. On a CPU both the case's dtype and fp32 are timed and the faster
    counts, as the CPU kernels compute reduced precisions in fp32. None when no matmul could run.
    """
    import torch

    key = (str(device), dtype)
    if key in _MEASURED and not again:
        return _MEASURED[key]
    cuda = device.type == "cuda"
    rates = {}
    for d in [dtype] if cuda or dtype == "fp32" else [dtype, "fp32"]:
        try:
            rates[d] = matmul_tflops(device, d)
        except RuntimeError:  # out of memory, or a dtype the device cannot multiply: no peak from it
            continue
    kept = _MEASURED.get(key)
    if rates:
        fastest = max(rates, key=rates.get)
        if kept is None or rates[fastest] > kept.tflops:
            what = f"{fastest} matmul" + (" with TF32 allowed" if cuda and fastest == "fp32" else "")
            kept = Peak(tflops=rates[fastest], source="measured", dtype=dtype,
                        device=torch.cuda.get_device_name(device) if cuda else "cpu", device_type=device.type,
                        datasheet=what, allowance=MEASURED_ALLOWANCE.get(device.type, MEASURED_ALLOWANCE["cpu"]))
    _MEASURED[key] = kept
    return kept


def device_peak(device, dtype: str, *, again: bool = False) -> Optional[Peak]:
    """This process's peak for ``dtype`` on ``device``: the datasheet's, else a measured one
    (``again``: measured once more, see :func:`measured_peak`)."""
    if device.type == "cuda":
        import torch

        found = table_peak(torch.cuda.get_device_name(device), dtype)
        if found is not None:
            return found
    return measured_peak(device, dtype, again=again)


def case_peak(device, dtype: str, *, group=None, tflops: Optional[float] = None) -> Optional[Peak]:
    """The peak every rank of ``group`` checks a case against: the most generous rank's.

    Each rank finds its own (:func:`device_peak`), then they are all-gathered, so all ranks
    refuse or keep the same result (and a rank on another GPU model cannot make a true result
    look impossible). When ``tflops`` (the case's result) is above a measured peak's limit, the
    peak is measured again, up to :data:`REMEASURE` times, before the caller refuses it; every
    rank takes the same steps, as they all see the same gathered peak. Without a process
    group, this process's own.
    """
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()

    def gathered(mine: Optional[Peak]) -> Optional[Peak]:
        if not grouped:
            return mine
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        known = [p for p in everyone if p is not None]
        return max(known, key=lambda p: p.limit) if known else None

    peak = gathered(device_peak(device, dtype))
    for _ in range(REMEASURE):
        if peak is None or peak.source != "measured" or tflops is None or not tflops > peak.limit:
            break
        peak = gathered(device_peak(device, dtype, again=True))
    return peak
