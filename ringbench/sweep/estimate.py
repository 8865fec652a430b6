"""Before a sweep starts: how long it will take, and whether this machine can hold its ranks.

A case's time is its FLOPs (``bench.attention_flops``, the flash-attn convention) over the
device's rate, plus a little per case and a start-up per launch:

- ``run``: (iters + warmup) times the whole sequence's FLOPs, plus the reference (the same
  kernel on one rank's share, ``1 / world_size`` of that), at the rate of the whole machine
  (on CPU the ranks share its cores), and, under ``--min-time-ms``, that budget twice more (the
  variant's loop and the reference's each run until it is spent), per emulated rank in turn;
- ``verify``: the variant and the context-parallel check (twice the FLOPs, spread over the
  ranks), then rank 0 alone runs the single-device kernel and the float64 reference over the
  whole sequence (three times the FLOPs, float64 counted double) on its share of the cores;
- a model check (``verify --model``): 30 s plus its three passes at a tenth of the rate;
- under a mask (the math kernel), the FLOPs of the whole S x S square, not of the mask's area
  (:func:`_dense`), plus the building of its dense masks (:func:`mask_seconds`); the math kernel's
  rate on CPU is the cpu kernel's over :data:`CPU_MATH_SLOWDOWN`.

The rate: on CPU, a float32 matmul measured here under the current load (about 0.2 s; see
:func:`cpu_matmul_rate`; measured again before each launch) times :data:`CPU_ATTENTION_EFFICIENCY`; on CUDA an assumed
:data:`CUDA_RATE` (no GPU is touched before the launch, so the ranks get every byte of theirs).

Refusals (each overridden by ``--yes``), on CPU only, where a sweep is never what the machine
is for: a sweep estimated over :data:`CPU_LIMIT_S`; a launch with more ranks than
:data:`RANKS_PER_CORE` per usable core; a launch whose ranks need more memory than is
available (:func:`launch_bytes`, against ``MemAvailable`` and the cgroup's limit).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Optional

from ringbench.case.spec import launch_world_size
from ringbench.case.types import MAX_TIMEOUT_S
from ringbench.errors import SpecError
from ringbench.variants import plural
from ringbench.variants.rules import BIAS_SHAPES

#: A sweep on CPU estimated above this many seconds is refused without --yes.
CPU_LIMIT_S = 30 * 60
#: More ranks than this per usable core is refused on CPU without --yes.
RANKS_PER_CORE = 4
#: Resident memory of one CPU rank before its tensors: Python, torch, gloo (measured about
#: 300 MiB on torch 2.13; rounded up).
RANK_BASE_BYTES = 400 * 2 ** 20
#: Attention's rate in the flash-attn FLOP convention against the best float32 matmul's on
#: CPU: the CPU kernel computes a causal block whole, which the convention counts as half, and
#: softmax, gloo and shared cores take their share. Calibrated on two cores (torch 2.13, a
#: 422 GFLOP/s matmul): ring and zigzag at 6k-16k ran at 0.11-0.26 of it, depending on the load.
CPU_ATTENTION_EFFICIENCY = 0.2
#: How many times slower the math kernel is than the cpu kernel on CPU for the same FLOPs: verify of
#: zigzag at 8k, full, W=2 on two cores ran 53.7 s on math and 28.9 s on cpu (torch 2.13).
CPU_MATH_SLOWDOWN = 1.9
#: The cost of building a dense mask on CPU, per slice and per (query, key) pair of the square, in
#: FLOPs of the measured float32 matmul's rate: ``Mask.allows`` tests every slice on every pair
#: (6-9 ns per slice and pair beside a 200 GFLOP/s matmul on two cores).
MASK_FLOPS_PER_SLICE_PAIR = 1600
#: How many whole-square dense masks a masked CPU case builds: verify's float64 reference and its
#: single-device kernel (the ring's blocks test only the slices that meet them, a small share); a
#: run's reference on one rank's share, about one with the blocks. Verify of zigzag at W=2 on two
#: cores: chunked:64 at 4k estimated 29 s, ran 26-34 s; prefix:2048 at 8k estimated 52 s, ran 48 s.
MASK_BUILDS = {"verify": 2, "run": 1}
#: Assumed per-GPU rate on CUDA, FLOP/s: 16-bit inputs, then the others.
CUDA_RATE = {"bf16": 150e12, "fp16": 150e12, "fp32": 30e12, "fp64": 20e12}
#: Seconds a case costs beyond its FLOPs (set-up, the gathers of the figures).
CASE_OVERHEAD_S = 0.2
#: The watchdog's default limit of one case is its estimate times this margin, plus a floor:
#: wide, because the estimate's rate is measured in a moment and shared cores slow a case far
#: more than that (issue 27: a sweep on two cores beside ten other processes ran about 14x its estimate).
CASE_LIMIT_MARGIN = 10.0
#: Seconds of the watchdog's default limit of one case on top of the margin, by device: time
#: for a start-up (importing torch on busy cores) and the gathers of a case that does little.
CASE_LIMIT_FLOOR_S = {"cpu": 300.0, "cuda": 120.0}
#: The longest default limit of one case, in seconds: --timeout's own bound.
MAX_CASE_LIMIT_S = MAX_TIMEOUT_S
#: The kernels' query rows per chunk (variants/kernels/reference.py), for their score workspace.
_CHUNK = 1024
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


#: The CPU rate measured last (:func:`cpu_matmul_rate`), FLOP/s; None until measured.
_measured_rate: Optional[float] = None


def cpu_matmul_rate() -> float:
    """FLOP/s of float32 matmuls on every usable core here, under the load of the moment.

    One thread runs 256 x 256 matmuls for about 0.2 s of wall clock, and the rate is the work it
    got done over that wall time, times the cores: a thread that shares its core with other
    processes gets less done, so a loaded machine measures slower (issue 27: the best single
    matmul, measured before, read the same on an idle machine and beside eight busy processes).
    Kept for the command; :func:`remeasure` forgets it before each launch.
    """
    global _measured_rate
    if _measured_rate is not None:
        return _measured_rate
    import torch

    n, threads = 256, torch.get_num_threads()
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.set_num_threads(1)
    try:
        a @ b
        done, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < 0.2:
            a @ b
            done += 1
    finally:
        torch.set_num_threads(threads)
    _measured_rate = 2.0 * n ** 3 * done / elapsed * usable_cores()
    return _measured_rate


def remeasure() -> None:
    """Forget the measured CPU rate, so the next estimate measures the load of the moment."""
    global _measured_rate
    _measured_rate = None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def available_bytes() -> Optional[int]:
    """Memory a new process can take here: ``MemAvailable``, lowered to the cgroup's room when
    the command runs under a memory limit; None where neither can be read."""
    room = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                cgroup_room = int(limit) - int(f.read().strip())
            room = cgroup_room if room is None else min(room, cgroup_room)
    except (OSError, ValueError):
        pass
    return room


def _flops(case) -> float:
    """The FLOPs a case's kernels compute, which under a mask are not the mask's: see :func:`_dense`."""
    from ringbench.case.work import attention_flops
    from ringbench.case.spec import spec_docs

    if _dense(case):
        return attention_flops(batch=case.batch, seqlen=case.seqlen, heads=case.heads, head_dim=case.head_dim,
                               causal=False, mode=case.mode, head_dim_v=case.head_dim_v)
    docs = spec_docs(case) if case.docs else None  # real lengths: padding is not counted
    return attention_flops(batch=case.batch, seqlen=sum(docs) if docs else case.seqlen, heads=case.heads,
                           head_dim=case.head_dim, causal=case.causal, mode=case.mode, docs=docs,
                           head_dim_v=case.head_dim_v, window=getattr(case, "window", 0) or None,
                           mask=getattr(case, "mask", ""))


def _dense(case) -> bool:
    """Whether the case runs a mask (not one of the plain ones, which ``resolve_mask`` wrote away): its
    math kernel computes every pair of each block it runs and applies the mask after, and verify's
    single-device kernel and float64 reference take the whole S x S square under the dense mask, so the
    work is the square's, not the mask's area (verify of zigzag under prefix:2048 at 8k on two cores was
    estimated at 18 s from half the square and ran 54 s). The ring skips its empty blocks, so for the
    variant's share this is an upper bound."""
    return bool(getattr(case, "mask", ""))


def _math(case) -> bool:
    """Whether the case runs the math kernel: named, or the one a mask resolves to."""
    return case.kernel == "math" or _dense(case)


def rate(case) -> float:
    """The FLOP/s a case's launch gets: the whole machine on CPU (the math kernel's share of it, which
    is :data:`CPU_MATH_SLOWDOWN` times slower than the cpu kernel's), one GPU on CUDA."""
    if case.device == "cuda":
        return CUDA_RATE.get(case.dtype, 30e12)
    return cpu_matmul_rate() * CPU_ATTENTION_EFFICIENCY / (CPU_MATH_SLOWDOWN if _math(case) else 1.0)


def mask_seconds(case) -> float:
    """Seconds a masked CPU case spends building its dense masks (:data:`MASK_BUILDS` squares of
    S x S, each pair tested against every slice); 0 without a mask or on CUDA."""
    if case.device == "cuda" or not _dense(case):
        return 0.0
    from ringbench.variants.engines import masks

    # With documents the mask applies per document (masks.documents), whose rule the whole row's need not meet.
    if case.docs:
        from ringbench.case.fields import parse_docs

        built = masks.documents(case.mask, tuple(parse_docs(case.docs)))
    else:
        built = masks.build(case.mask, case.seqlen)
    slices = len(built.slices)
    builds = MASK_BUILDS.get(case.task, 1)
    return builds * slices * float(case.seqlen) ** 2 * case.batch * MASK_FLOPS_PER_SLICE_PAIR / cpu_matmul_rate()


def _budget_s(case) -> float:
    """Seconds ``--min-time-ms`` may add to a run case: its budget, for the variant and the reference."""
    return 2 * getattr(case, "min_time_ms", 0) / 1e3


def case_seconds(case) -> float:
    """The estimated wall-clock seconds of one case (the module docstring says how)."""
    r = rate(case)
    flops = _flops(case)
    w = case.world_size
    if case.device == "cuda":
        per_gpu = flops / w  # every rank on its own GPU
        if case.task == "run":
            turns = w // launch_world_size(case)  # emulated: one GPU runs every rank in turn
            return (CASE_OVERHEAD_S + (case.iters + case.warmup) * turns * (per_gpu + flops / w ** 2) / r
                    + _budget_s(case) * turns)
        seconds = CASE_OVERHEAD_S + 2 * per_gpu / r + 3 * flops / r * (2 if case.dtype == "fp64" else 1)
    elif case.task == "run":
        seconds = CASE_OVERHEAD_S + (case.iters + case.warmup) * flops * (1 + 1 / w) / r + _budget_s(case)
    else:
        share = max(1, usable_cores() // w) / usable_cores()  # rank 0's threads of the machine
        seconds = CASE_OVERHEAD_S + 2 * flops / r + 3 * flops / (r * share)
    seconds += mask_seconds(case)
    if case.hf_model:
        from ringbench.case.models import estimated_check_flops

        seconds += 30 + estimated_check_flops(case) / (r / 10)
    return seconds


def case_limit_s(case) -> float:
    """The watchdog's default limit of one case, in seconds (``--timeout`` unset).

    ``CASE_LIMIT_FLOOR_S[device] + CASE_LIMIT_MARGIN * case_seconds(case)``, at most
    ``MAX_CASE_LIMIT_S``. The clock of a case starts at its own start mark, so the time of the
    cases before it in the launch never counts (``ringbench.sweep.launch``).

    Source: issue 27 (the watchdog killed innocent cases under load).
    """
    return min(MAX_CASE_LIMIT_S, CASE_LIMIT_FLOOR_S.get(case.device, 300.0) + CASE_LIMIT_MARGIN * case_seconds(case))


def launch_seconds(world_size: int, device: str) -> float:
    """Start-up of one launch: torchrun, then every rank importing torch on the shared cores."""
    if device == "cuda":
        return 20.0 + 0.5 * world_size
    return 3.0 + 1.5 * world_size / usable_cores()


def _qkv_dims(case) -> int:
    """Head dims summed over q, k, v and the output: queries and keys of ``head_dim``, values
    and outputs (and their gradients) of the value head dim Dv (``--head-dim-v``)."""
    dv = case.head_dim_v or case.head_dim
    return case.heads * (case.head_dim + dv) + case.kv_heads * (case.head_dim + dv)


def shard_bytes(case) -> int:
    """The tensors of one rank's shard: inputs, outputs, gradients and K/V in flight (about three
    copies of q, k, v and the output, values and outputs at Dv) and the kernel's float32 scores
    of a chunk of queries against a block of the shard's size, two buffers (an all-gather
    variant's block is the whole sequence, which this leaves out)."""
    local = case.seqlen // case.world_size
    tensors = 3 * case.batch * local * _qkv_dims(case) * _BYTES.get(case.dtype, 4)
    scores = 2 * case.batch * case.heads * min(_CHUNK, local) * local * 4
    return tensors + scores


def bias_bytes(case) -> int:
    """A learnable bias (``--bias`` of a shape such as ``1hss``, docs/masks.md): every rank holds the whole
    ``[b|1, h|1, s|1, s]`` tensor and its gradient, float32 (float64 for fp64 inputs); 0 for none and for
    ALiBi, which holds only its slopes."""
    if case.bias not in BIAS_SHAPES:
        return 0
    sizes = {"b": case.batch, "h": case.heads, "s": case.seqlen, "1": 1}
    return 2 * math.prod(sizes[c] for c in case.bias) * (8 if case.dtype == "fp64" else 4)


def rank_bytes(case) -> int:
    """Resident memory one CPU rank of the case needs: :data:`RANK_BASE_BYTES`, its
    :func:`shard_bytes` and a learnable bias (:func:`bias_bytes`). verify adds, on rank 0, the whole
    sequence in float64 and its scores: see :func:`verify_extra_bytes`."""
    return RANK_BASE_BYTES + shard_bytes(case) + bias_bytes(case)


def launch_bytes(case) -> int:
    """Memory the case's launch needs in all: every process's :func:`rank_bytes` and rank 0's
    :func:`verify_extra_bytes`; an emulated run (``--emulate``) is one process holding every
    rank's shards, so one :data:`RANK_BASE_BYTES` and ``world_size`` shards."""
    if launch_world_size(case) == 1 and case.world_size > 1:
        return RANK_BASE_BYTES + case.world_size * shard_bytes(case) + verify_extra_bytes(case)
    return case.world_size * rank_bytes(case) + verify_extra_bytes(case)


def verify_extra_bytes(case) -> int:
    """What rank 0 of a verify case holds beyond :func:`rank_bytes`: the whole sequence's inputs
    and results in float64 (values, outputs and their gradients at Dv), the reference's
    float64 scores, and a learnable bias's float64 copy with its gradient."""
    if case.task != "verify":
        return 0
    whole = 5 * case.batch * case.seqlen * _qkv_dims(case) * 8
    scores = 2 * case.batch * case.heads * min(_CHUNK, case.seqlen) * case.seqlen * 8
    bias = bias_bytes(case) * (8 // (8 if case.dtype == "fp64" else 4))
    return whole + scores + bias


@dataclass
class Estimate:
    """Seconds per case (in the order given), per launch (world_size, device), and in all."""

    case_s: list[float]
    launch_s: dict[tuple[int, str], float]

    @property
    def total_s(self) -> float:
        return sum(self.case_s) + sum(self.launch_s.values())


def estimate(cases: list) -> Estimate:
    launches: dict[tuple[int, str], float] = {}
    for case in cases:
        launches.setdefault((case.world_size, case.device), launch_seconds(case.world_size, case.device))
    return Estimate([case_seconds(c) for c in cases], launches)


def duration(seconds: float) -> str:
    """``40 s``, ``12 min``, ``3 h 10 min``."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _rate_text(cases: list) -> str:
    parts = []
    if any(c.device == "cpu" for c in cases):
        cpu = cpu_matmul_rate() * CPU_ATTENTION_EFFICIENCY
        math = ""
        if any(c.device == "cpu" and _math(c) for c in cases):
            dense = (", a mask's work counted over the whole square and its dense masks built" if any(
                c.device == "cpu" and _dense(c) for c in cases) else "")
            math = f" (the math kernel at about {cpu / CPU_MATH_SLOWDOWN / 1e9:.0f}{dense})"
        parts.append(f"attention at about {cpu / 1e9:.0f} GFLOP/s on cpu{math}, from a {cpu_matmul_rate() / 1e9:.0f} "
                     "GFLOP/s float32 matmul measured here")
    if any(c.device == "cuda" for c in cases):
        parts.append("cuda at an assumed " + ", ".join(f"{CUDA_RATE[d] / 1e12:.0f} TFLOP/s {d}" for d in sorted(
            {c.dtype for c in cases if c.device == "cuda"} & CUDA_RATE.keys())) + " per GPU")
    return "; ".join(parts)


def _label(case) -> str:
    from ringbench.case.fields import format_size

    return f"{case.variant} S={format_size(case.seqlen)} W={case.world_size}"


def summary(cases: list, est: Estimate) -> str:
    """One line: ``estimate: about 2 min for 16 cases in 1 launch (cpu at ...); the longest ...``."""
    longest = max(range(len(cases)), key=lambda i: est.case_s[i])
    text = (f"estimate: about {duration(est.total_s)} for {plural(len(cases), 'case')} in "
            f"{plural(len(est.launch_s), 'launch', 'launches')} ({_rate_text(cases)})")
    if len(cases) > 1:
        text += f"; the longest, {_label(cases[longest])}, about {duration(est.case_s[longest])}"
    return text


#: The fields whose size the memory grows with, and the fix that shrinks each: the one furthest
#: above its CPU default is named (``--heads 100000``: fewer heads; ``--batch 100000``: a smaller batch).
_MEMORY_FIELDS = (("batch", "a smaller --batch"), ("heads", "fewer --heads"), ("seqlen", "a shorter --seqlen"),
                  ("head_dim_v", "a smaller --head-dim-v"), ("head_dim", "a smaller --head-dim"))


def _fitting_value(case, name: str, room: int) -> Optional[int]:
    """The largest value of field ``name`` below the case's at which its launch fits in ``room``
    bytes and runs within :data:`CPU_LIMIT_S`, each with a fifth to spare (so the fix is not refused
    next), and the case is still valid, or None."""
    from dataclasses import replace

    from ringbench.case.spec import validate

    current = getattr(case, name)

    def fits(v: int) -> bool:
        smaller = replace(case, **{name: v})
        # A fifth to spare on each: the next command measures the free memory and the matmul rate again (free
        # memory moved by a few hundred MB between commands, the rate by about 15%).
        return launch_bytes(smaller) <= 0.8 * room and estimate([smaller]).total_s <= 0.8 * CPU_LIMIT_S

    low, high = 1, current - 1  # the largest fitting value, by bisection (memory grows with each field)
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    # Round down to a multiple the variant may need (of kv_heads, of 2 * world_size ...), keeping a valid one.
    for value in sorted({low - low % m for m in [*range(1, 65), *(2 ** k for k in range(7, 24))]} - {0},
                        reverse=True):
        try:
            validate(replace(case, **{name: value}), visible_gpus=0)
        except SpecError:
            continue
        return value
    return None


def _memory_fix(case, room: int) -> str:
    """What shrinks a cpu launch that needs more than ``room`` bytes: a smaller --world-size where
    the ranks' base memory is most of it, else the field furthest above its default, with a value."""
    from ringbench.case.fields import BY_NAME

    base = RANK_BASE_BYTES * launch_world_size(case)
    if base >= launch_bytes(case) - base:
        return "a smaller --world-size"
    given = [(getattr(case, name) / max(1, BY_NAME[name].cpu or (case.head_dim if name == "head_dim_v" else 1)),
              name, fix) for name, fix in _MEMORY_FIELDS if getattr(case, name)]
    _, name, fix = max(given)
    value = _fitting_value(case, name, room)
    return f"{fix}, such as {BY_NAME[name].option} {value}" if value else fix


def _gib(nbytes: float) -> str:
    """Bytes in GiB (2^30), one decimal: ``1.5 GiB``."""
    return f"{nbytes / 2 ** 30:.1f} GiB"


def _mib(nbytes: float) -> str:
    """Bytes in MiB (2^20), whole: ``431 MiB``."""
    return f"{nbytes / 2 ** 20:.0f} MiB"


def check(cases: list, est: Estimate, *, yes: bool) -> None:
    """Refuse, unless ``yes``, what this machine should not start without asking (CPU only).

    Raises:
        SpecError: one sentence with the estimate or the need, the limit, and the flag that
            overrides it (``--yes``).
    """
    if yes:
        return
    cpu = [i for i, c in enumerate(cases) if c.device == "cpu"]
    if not cpu:
        return
    cores = usable_cores()
    room = available_bytes()
    for world_size in sorted({cases[i].world_size for i in cpu}, reverse=True):
        group = [cases[i] for i in cpu if cases[i].world_size == world_size]
        why = []
        if max(launch_world_size(c) for c in group) > RANKS_PER_CORE * cores:
            why.append(f"{world_size} ranks on {plural(cores, 'core')} are more than the {RANKS_PER_CORE * cores} "
                       f"({RANKS_PER_CORE} per core) that ringbench starts without asking")
        biggest = max(group, key=launch_bytes)
        need = launch_bytes(biggest)
        if room is not None and need > room:
            held = (f"one emulating process holding {world_size} shards of about {_mib(shard_bytes(biggest))}"
                    if launch_world_size(biggest) == 1 else f"{world_size} of about {_mib(rank_bytes(biggest))}")
            why.append(f"its ranks need about {_gib(need)} of memory ({held}) but {_gib(room)} is available here")
        if why:
            fix = "a smaller --world-size"
            if room is not None and need > room and len(why) == 1:
                fix = _memory_fix(biggest, room)
            raise SpecError(f"world_size {world_size} on cpu does not fit this machine: {' and '.join(why)}; pass "
                            f"{fix}, or --yes to start it anyway")
    cpu_s = sum(est.case_s[i] for i in cpu) + sum(s for (w, d), s in est.launch_s.items() if d == "cpu")
    if cpu_s > CPU_LIMIT_S:
        longest = max(cpu, key=lambda i: est.case_s[i])
        which = (f"{_label(cases[longest])}" if len(cpu) == 1 else
                 f"{plural(len(cpu), 'case')}, {_label(cases[longest])} alone about {duration(est.case_s[longest])}")
        raise SpecError(f"this sweep would take about {duration(cpu_s)} on cpu ({which}; "
                        f"{_rate_text([cases[i] for i in cpu])}), over the {duration(CPU_LIMIT_S)} that "
                        f"ringbench runs on cpu without asking; pass --yes to run it anyway, or a smaller "
                        f"--seqlen{', fewer --iters' if cases[longest].task == 'run' else ''} or fewer cases")
