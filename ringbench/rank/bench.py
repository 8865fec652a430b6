"""The timing protocol, the FLOP count and the memory figures of one case (the rules in docs/methodology.md)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ringbench.case.work import attention_flops
from ringbench.rank.setup import CaseSetup, case_setup, sink_logits
from ringbench.rank.peaks import Peak, case_peak
from ringbench.case.spec import CaseSpec, spec_docs
from ringbench.variants.engines import layouts, varlen
from ringbench.variants import instruments

GIB = 1024 ** 3

# The dense peak of each device and dtype, and the measured one where the table has none:
# ringbench/rank/peaks.py. A result above it is an error, not a result (refusal).


def time_iterations(fn: Callable[[], None], *, iters: int, warmup: int, device: torch.device,
                    group=None) -> list[float]:
    """Time ``fn`` ``iters`` times after ``warmup`` untimed calls; per-iteration times in ms.

    Every timed iteration starts after a barrier, so all ranks time the same ring step. CUDA
    events time the device; on CPU ``time.perf_counter`` runs after the call has returned.
    """
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        if group is not None or dist.is_initialized():
            dist.barrier(group=group)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _random(shape, dtype, device, gen) -> torch.Tensor:
    # Never zeros: zeros hide unwritten outputs and can run faster than real data.
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=device).to(dtype)


def rank_inputs(spec: CaseSpec, rank: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s shards of a ``run`` case, drawn from ``(seed, rank)``: the same on any process.

    Returns:
        ``(q, k, v, dout)``: q ``[B, S/W, Hq, D]``, k ``[B, S/W, Hkv, D]``, v ``[B, S/W, Hkv, Dv]``
        and dout ``[B, S/W, Hq, Dv]`` (Dv: ``spec.value_head_dim()``), in ``dtype``
        on ``device`` (an emulated run, ``ringbench/rank/emulation.py``, draws every rank's this way).
    """
    B, H, Hkv, D, Dv = spec.batch, spec.heads, spec.kv_heads, spec.head_dim, spec.value_head_dim()
    local = spec.seqlen // spec.world_size
    gen = torch.Generator(device=device).manual_seed((spec.seed * 100003 + rank) % 2 ** 63)
    q = _random((B, local, H, D), dtype, device, gen)
    k = _random((B, local, Hkv, D), dtype, device, gen)
    v = _random((B, local, Hkv, Dv), dtype, device, gen)
    dout = _random((B, local, H, Dv), dtype, device, gen)
    return q, k, v, dout


def iteration(attention: Callable, q, k, v, dout, *, backward: bool, **call) -> Callable[[], None]:
    """One timed iteration of the variant: forward (under no_grad), or forward and backward with
    the grads set to None first; ``call`` holds the variant's keywords (causal, group, kernel...)."""

    def step() -> None:
        if not backward:
            with torch.no_grad():
                attention(q, k, v, **call)
            return
        for t in (q, k, v):
            t.requires_grad_(True)
            t.grad = None
        if call.get("sink") is not None:
            call["sink"].grad = None  # a learnable sink's
        out, _ = attention(q, k, v, **call)
        out.backward(dout)

    return step


def bench_case(spec: CaseSpec, *, device: torch.device, group=None) -> dict:
    """Measure one ``run`` case on this rank and return the record fields rank 0 will write.

    Each rank draws its own shard from ``(seed, rank)``; the whole sequence is never built.
    The reference is the same kernel, same mode, on one rank's share (``S / W`` tokens).

    With packed documents the variant gets the global ``cu_seqlens`` prepared once
    (``variants.varlen.prepare``: checked across ranks before the warm-up, its schedules built
    by the first call and shared by the rest), the FLOPs are the sum
    over the documents, and the reference is the kernel's varlen call on this rank's local
    document pieces (``layouts.varlen_local_cu_seqlens``). Those pieces are the same on every
    rank when documents are sharded by document; by row (llama3_varlen) they differ, and
    ``ref_tflops`` is that of the rank whose reference took longest (its FLOPs over its time),
    which is the batch formula when the shares are equal.

    With ``spec.profile``, a second pass of ``iters`` iterations records the spans
    (``ringbench/rank/profile.py``) after the timed ones, so the timing itself carries no marks.

    Args:
        spec: the case, its kernel resolved.
        device: this rank's device.
        group: the context-parallel group (default: the world).

    Returns:
        The run fields of the record (docs/contracts.md), identical on every rank.

    Raises:
        RuntimeError: a TFLOP/s above the device's peak, or a multi-rank run that sent nothing.
    """
    case = case_setup(spec, group)
    q, k, v, dout = rank_inputs(spec, case.rank, case.dtype, device)
    step, reference, ref_docs = rank_calls(case, (q, k, v, dout), device=device, group=group)
    mine = measure_rank(spec, step, reference, inputs=(q, k, v), device=device, group=group, ref_docs=ref_docs,
                        local=spec.seqlen // case.world_size)
    gathered: list[RankMeasure] = [None] * case.world_size
    dist.all_gather_object(gathered, mine, group=group)
    return run_fields(spec, case.variant, gathered, device=device, group=group)


def rank_calls(case: CaseSetup, inputs: tuple[torch.Tensor, ...], *, device: torch.device,
               group=None) -> tuple[Callable[[], None], Callable[[], None], list[int] | None]:
    """This rank's timed iteration of the variant and its reference, for :func:`measure_rank`.

    With packed documents the variant gets the global ``cu_seqlens`` prepared here, once
    (``varlen.prepare``: checked across the ranks of ``group``), and the reference is the
    kernel's varlen call on this rank's local document pieces (:func:`bench_case`).

    Args:
        case: the case as this rank runs it (``setup.case_setup``).
        inputs: this rank's ``(q, k, v, dout)`` (:func:`rank_inputs`).
        device: this rank's device.
        group: the context-parallel group (default: the world; an emulated one under an emulation).

    Returns:
        ``(step, reference, ref_docs)``: the iteration, the reference (the same kernel, same
        mode, on this rank's share) and the local document lengths the reference attends, or
        ``None`` (batch form).
    """
    spec, variant, kernel, rank, world_size = case.spec, case.variant, case.kernel, case.rank, case.world_size
    q, k, v, dout = inputs
    local = spec.seqlen // world_size
    causal, scale, backward = case.causal, case.scale, spec.mode == "fwd_bwd"
    attention, options, docs = variant.attention, case.options, case.docs
    # The reference attends the rank's share under the same window (the band alone, not causal).
    ref_kw, ref_causal = ({"window": case.band}, False) if case.band else ({}, causal)
    ref_docs = None
    if docs is not None:
        cu_seqlens = layouts.cu_seqlens_from_docs(docs, device=device)
        # Checked once, here, outside the timing; every call then shares its schedules and
        # reads nothing back from the device (varlen.prepare). A peer takes the plain offsets.
        options = {**options, "cu_seqlens": cu_seqlens if variant.peer else varlen.prepare(cu_seqlens, local, group)}
        local_cu = layouts.varlen_local_cu_seqlens(cu_seqlens, case.layout, rank, world_size,
                                                   by_document=variant.shard_by_document, device=device,
                                                   ulysses_degree=case.ulysses_degree)
        ref_offsets = local_cu.tolist()
        ref_docs = [b - a for a, b in zip(ref_offsets, ref_offsets[1:])]
        ref_max = max(ref_docs)
    sink = sink_logits(spec, case.dtype, device)
    if sink is not None:
        options = {**options, "sink": sink}

    step = iteration(attention, q, k, v, dout, backward=backward, causal=causal, softmax_scale=scale, group=group,
                     kernel=kernel, **options)

    def reference() -> None:
        with torch.no_grad():
            if ref_docs is not None:
                out, lse = kernel.forward_varlen(q, k, v, local_cu, local_cu, ref_max, ref_max, ref_causal, scale,
                                                 **ref_kw)
                if backward:
                    kernel.backward_varlen(dout, q, k, v, out, lse, local_cu, local_cu, ref_max, ref_max, ref_causal,
                                           scale, **ref_kw)
                return
            out, lse = kernel.forward(q, k, v, ref_causal, scale, **ref_kw)
            if backward:
                kernel.backward(dout, q, k, v, out, lse, ref_causal, scale, **ref_kw)

    return step, reference, ref_docs


@dataclass(frozen=True)
class RankMeasure:
    """One rank's figures of a ``run`` case (:func:`measure_rank`); :func:`run_fields` takes one
    per rank, gathered in rank order (they travel by pickle, so they hold plain numbers and dicts).

    Attributes:
        time_ms: the median of the variant's timed iterations, in ms.
        ref_time_ms: the median of the reference's (the same kernel on the rank's share), in ms.
        bytes_sent, bytes_received: bytes this rank's counted transfers moved per iteration.
        peak_allocated_gib, peak_reserved_gib: the device's peak memory over the timed
            iterations, in GiB; ``None`` off CUDA.
        ref_flops: the FLOPs of one reference iteration.
        profile: the rank's ``profile.measure`` breakdown, or ``None`` (``spec.profile`` off).
    """

    time_ms: float
    ref_time_ms: float
    bytes_sent: float
    bytes_received: float
    peak_allocated_gib: float | None
    peak_reserved_gib: float | None
    ref_flops: float
    profile: dict | None


def measure_rank(spec: CaseSpec, step: Callable[[], None], reference: Callable[[], None], *, inputs: tuple,
                 device: torch.device, group, ref_docs: list[int] | None, local: int) -> RankMeasure:
    """Time one rank's iterations, its reference and (``spec.profile``) its spans.

    ``inputs`` (q, k, v) lose their grads before the reference runs.

    Returns:
        This rank's :class:`RankMeasure`.
    """
    from ringbench.rank import profile

    iters, warmup = spec.iters, spec.warmup
    cuda = device.type == "cuda"
    # Warm up before opening the counters, so allocator growth and traffic of the warm-up
    # stay out of the figures.
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with instruments.open(traffic=True) as inst:
        times = time_iterations(step, iters=iters, warmup=0, device=device, group=group)
    sent, received = inst.traffic.bytes_sent / iters, inst.traffic.bytes_received / iters
    peak_alloc = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    peak_reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else None
    spans = profile.measure(step, iters=iters, device=device, group=group) if spec.profile else None
    for t in inputs:
        t.grad = None
        t.requires_grad_(False)
    ref_times = time_iterations(reference, iters=iters, warmup=warmup, device=device, group=group)
    ref_flops = attention_flops(batch=spec.batch, seqlen=local, heads=spec.heads, head_dim=spec.head_dim,
                                causal=spec.causal, mode=spec.mode, docs=ref_docs, head_dim_v=spec.value_head_dim(),
                                window=spec.window or None)
    return RankMeasure(time_ms=statistics.median(times), ref_time_ms=statistics.median(ref_times),
                       bytes_sent=sent, bytes_received=received, peak_allocated_gib=peak_alloc,
                       peak_reserved_gib=peak_reserved, ref_flops=ref_flops, profile=spans)


def run_fields(spec: CaseSpec, variant, gathered: list[RankMeasure], *, device: torch.device, group=None,
               emulated: bool = False) -> dict:
    """The run fields of a record from every rank's :class:`RankMeasure` (rank order).

    ``emulated``: the ranks ran in turn in one process (``ringbench/rank/emulation.py``); no byte
    crossed a link, so ``bus_gib_s`` is null.

    Raises:
        RuntimeError: a TFLOP/s above the device's peak, or a multi-rank run that sent nothing.
    """
    from ringbench.rank import profile

    world_size, cuda = spec.world_size, device.type == "cuda"
    per_rank = [g.time_ms for g in gathered]
    time_ms = max(per_rank)
    slowest_ref = max(gathered, key=lambda g: g.ref_time_ms)
    ref_ms, ref_flops = slowest_ref.ref_time_ms, slowest_ref.ref_flops
    real = spec_docs(spec) if variant.varlen else None  # real lengths: padding is not counted
    flops_per_gpu = attention_flops(batch=spec.batch, seqlen=sum(real) if real else spec.seqlen, heads=spec.heads,
                                    head_dim=spec.head_dim, causal=spec.causal, mode=spec.mode, docs=real,
                                    head_dim_v=spec.value_head_dim(), window=spec.window or None) / world_size
    tflops = flops_per_gpu / (time_ms * 1e-3) / 1e12
    ref_tflops = ref_flops / (ref_ms * 1e-3) / 1e12
    # None: the variant's bytes go where the counters cannot see them (Variant.traffic_counted).
    max_sent = max(g.bytes_sent for g in gathered) if variant.traffic_counted else None
    fields = {
        "time_ms": time_ms,
        "per_rank_time_ms": per_rank,
        "imbalance": time_ms / min(per_rank) if min(per_rank) > 0 else None,
        "flops_convention": "flash-attn",
        "flops_per_gpu": flops_per_gpu,
        "tflops_per_gpu": tflops,
        "ref_time_ms": ref_ms,
        "ref_tflops": ref_tflops,
        "efficiency": tflops / ref_tflops if ref_tflops > 0 else None,
        "peak_allocated_gib": max(g.peak_allocated_gib for g in gathered) if cuda else None,
        "peak_reserved_gib": max(g.peak_reserved_gib for g in gathered) if cuda else None,
        "bytes_sent": int(max_sent) if max_sent is not None else None,
        "bytes_received": int(max(g.bytes_received for g in gathered)) if max_sent is not None else None,
        "bus_gib_s": max_sent / GIB / (time_ms * 1e-3) if world_size > 1 and max_sent is not None and not emulated
        else None,
        # False: bytes_sent is null because it is not counted, not because nothing was sent.
        "bytes_counted": variant.traffic_counted,
        **profile.record_fields([g.profile for g in gathered]),
    }
    # The datasheet's peak, else one measured in this launch (again before it refuses a result).
    peak = case_peak(device, spec.dtype, group=group, tflops=tflops)
    fields["peak_tflops"] = peak.tflops if peak is not None else None
    fields["peak_source"] = peak.source if peak is not None else None
    reason = refusal(tflops=tflops, peak=peak, bytes_sent=max_sent, world_size=world_size, variant=spec.variant)
    if reason:
        raise RuntimeError(reason)
    return fields


def refusal(*, tflops: float, peak: Peak | float | None, bytes_sent: float | None, world_size: int,
            variant: str) -> str | None:
    """Why a measured result cannot be true, or ``None`` when it may be.

    Args:
        tflops: the measured TFLOP/s per GPU.
        peak: the device's peak for the run's dtype (``peaks.case_peak``: the datasheet's, or a
            measured one with its allowance); a bare number is a datasheet figure; None: no check.
        bytes_sent: bytes the busiest rank sent per iteration; ``None`` where the variant's
            traffic cannot be counted (``Variant.traffic_counted``), which no byte rule refuses.
        world_size: ranks in the run.
        variant: its name, for the sentence.

    Returns:
        A TFLOP/s above the peak, or a multi-rank run that sent no bytes (the variant never
        communicated): one sentence saying so; else None.
    """
    if isinstance(peak, (int, float)):
        peak = Peak(tflops=float(peak), source="table")
    above = peak.refusal(tflops) if peak is not None else None
    if above:
        return above
    if world_size > 1 and bytes_sent is not None and bytes_sent == 0:
        return (f"the {variant} variant sent no bytes at world size {world_size}; context parallelism was not "
                "active, so the timing is refused")
    return None
