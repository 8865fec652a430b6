"""The timing protocol, the FLOP count and the memory figures of one case (the rules in docs/methodology.md)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ringbench.case.work import attention_flops
from ringbench.rank.setup import CaseSetup, bias_of, case_setup, sink_logits
from ringbench.rank import graphs
from ringbench.rank.peaks import Peak, case_peak
from ringbench.case.spec import CaseSpec, spec_docs
from ringbench.variants.engines import layouts, masked, masks, varlen
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import PositionMask, bias_learns
from ringbench.variants import instruments

GIB = 1024 ** 3

# The dense peak of each device and dtype, and the measured one where the table has none:
# ringbench/rank/peaks.py. A result above it is an error, not a result (refusal).


#: The quantiles a record keeps of each rank's iteration times: p20, p50 (the median) and p80,
#: as triton.testing.do_bench and MagiAttention report them (docs/methodology.md, Timing).
QUANTILES = (0.2, 0.5, 0.8)
#: The least buffer ``--flush-l2`` writes, in bytes, whatever L2 size the device reports.
MIN_FLUSH_BYTES = 64 * 1024 ** 2
#: The caching allocator's block of large allocations: a flush buffer of whole blocks is
#: exactly the bytes it adds to ``max_memory_allocated``.
_ALLOCATOR_BLOCK = 2 * 1024 ** 2


def quantiles(times: list[float]) -> tuple[float, float, float]:
    """The p20, p50 and p80 of ``times`` (:data:`QUANTILES`), by ``torch.quantile``'s linear
    interpolation between order statistics (p50 is then the median, the mean of the middle two
    of an even count; one time is all three).

    Args:
        times: per-iteration times in ms, at least one.

    Returns:
        ``(p20, p50, p80)`` in ms.
    """
    found = torch.quantile(torch.tensor(times, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64))
    p20, p50, p80 = found.tolist()
    return p20, p50, p80


def l2_flush(device: torch.device) -> tuple[Callable[[], None], int]:
    """The flush of ``--flush-l2``: a callable that writes a buffer of twice the L2 cache of
    ``device`` (at least :data:`MIN_FLUSH_BYTES`, in whole allocator blocks), so the next
    iteration finds none of its data in L2, and the buffer's size in bytes.

    The buffer is allocated here, once, and lives as long as the callable. It is written, not
    read, as a write-back L2 takes in every line written, evicting the lines held before.

    Raises:
        ValueError: ``device`` is not a CUDA device (``spec.validate`` refuses ``flush_l2``
            on cpu before any process starts).
    """
    if device.type != "cuda":
        raise ValueError(f"flush_l2 needs a cuda device, not {device}; drop --flush-l2 on cpu")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    nbytes = -(-max(2 * l2, MIN_FLUSH_BYTES) // _ALLOCATOR_BLOCK) * _ALLOCATOR_BLOCK
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer.zero_, nbytes


def time_iterations(fn: Callable[[], None], *, iters: int, warmup: int, device: torch.device, group=None,
                    min_time_ms: float = 0, flush: Callable[[], None] | None = None) -> list[float]:
    """Time ``fn`` at least ``iters`` times after ``warmup`` untimed calls; per-iteration times in ms.

    Every timed iteration starts after a barrier, so all ranks time the same ring step. CUDA
    events time the device; on CPU ``time.perf_counter`` runs after the call has returned.

    With ``min_time_ms``, the loop goes on past ``iters`` until this rank's times add up to
    ``min_time_ms``, in rounds: each rank works out how many more iterations its mean so far
    says it needs, the ranks gather those counts (an object collective, which the traffic
    counters do not see) and every rank runs the largest, until none needs more. So every rank
    runs the same count, and the same collectives, whatever its own speed.

    Args:
        fn: one iteration.
        iters: the fewest timed iterations, at least 1.
        warmup: untimed calls first.
        device: where ``fn`` runs.
        group: the process group whose ranks time together (default: the world, when one is
            initialised; none: this process alone).
        min_time_ms: the time budget in ms; 0: ``iters`` exactly.
        flush: called before each timed iteration's barrier, outside the timing (``l2_flush``).

    Returns:
        The times of the timed iterations, in ms, in order; the same count on every rank.

    Source: the time budget of ``triton.testing.do_bench`` (its ``rep``), issue 25.
    """
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    together = group is not None or dist.is_initialized()
    times: list[float] = []
    more = iters
    while more:
        for _ in range(more):
            if flush is not None:
                flush()
            if together:
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
        more = _more_iterations(times, min_time_ms, group if together else False)
    return times


def _more_iterations(times: list[float], min_time_ms: float, group) -> int:
    """How many more iterations every rank runs so that each rank's ``times`` add up to
    ``min_time_ms``: the most any rank needs by its mean so far (``group`` False: this
    process alone)."""
    if not min_time_ms:
        return 0
    spent = sum(times)
    need = 0 if spent >= min_time_ms else math.ceil((min_time_ms - spent) / max(spent / len(times), 1e-6))
    if group is False:
        return need
    needs: list[int] = [0] * dist.get_world_size(group)
    dist.all_gather_object(needs, need, group=group)
    return max(needs)


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


def iteration(attention: Callable, q, k, v, dout, *, backward: bool, **call) -> Callable[[], tuple]:
    """One timed iteration of the variant: forward (under no_grad), or forward and backward with
    the grads set to None first; ``call`` holds the variant's keywords (causal, group, kernel...).

    The step returns what it produced: ``(out,)``, or ``(out, dq, dk, dv)`` and a learnable
    sink's gradient, so that a CUDA graph's replay can be checked against it (``graphs.py``).
    """
    sink = call.get("sink")
    learnable = sink is not None and sink.requires_grad
    bias = call.get("bias")
    bias_values = bias.values if bias is not None and bias.learnable else None

    def step() -> tuple:
        if not backward:
            with torch.no_grad():
                return (attention(q, k, v, **call)[0],)
        for t in (q, k, v):
            t.requires_grad_(True)
            t.grad = None
        if learnable:
            sink.grad = None
        if bias_values is not None:
            bias_values.grad = None
        out, _ = attention(q, k, v, **call)
        out.backward(dout)
        return (out, q.grad, k.grad, v.grad, *((sink.grad,) if learnable else ()))

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
    # The reference attends the rank's share under the same window (the band alone, not causal), or
    # under the mask between the rank's own positions.
    ref_kw, ref_causal = ({"window": case.band}, False) if case.band else ({}, causal)
    ref_kernel = kernel
    if spec.mask:
        ref_kw, ref_causal = {"mask": reference_mask(case, device)}, False
        if kernel.by_slices:  # the share's own window calls, one per slice, as the engines cut blocks
            runs = masked.runs_of(ref_kw["mask"].q_pos.tolist())
            ref_kernel, ref_kw = masked.Sliced(kernel, masks.over(spec.mask, spec.seqlen, case.docs), runs, runs), {}
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
    bias = bias_of(spec, case.dtype, device)
    if bias is not None:
        options = {**options, "bias": bias}
        # The one-rank reference adds the bias too, over its first S/W positions (batch form only).
        share = torch.arange(q.shape[1], device=device)
        ref_kw = {**ref_kw, "bias": bias.at(share, share)}

    step = iteration(attention, q, k, v, dout, backward=backward, causal=causal, softmax_scale=scale, group=group,
                     kernel=kernel, **options)

    def reference() -> tuple:
        with torch.no_grad():
            if ref_docs is not None and not spec.mask:  # a mask holds the documents: the batch form
                out, lse = kernel.forward_varlen(q, k, v, local_cu, local_cu, ref_max, ref_max, ref_causal, scale,
                                                 **ref_kw)
                if backward:
                    return (out, *kernel.backward_varlen(dout, q, k, v, out, lse, local_cu, local_cu, ref_max,
                                                         ref_max, ref_causal, scale, **ref_kw))
                return (out,)
            out, lse = ref_kernel.forward(q, k, v, ref_causal, scale, **ref_kw)
            if backward:
                return (out, *ref_kernel.backward(dout, q, k, v, out, lse, ref_causal, scale, **ref_kw))
            return (out,)

    return step, reference, ref_docs


def reference_mask(case: CaseSetup, device) -> PositionMask:
    """The mask of a case's reference: ``spec.mask`` between the positions this rank holds (its share
    of the sequence against itself, the same kernel call the variant's blocks are made of); with
    packed documents, the mask inside each of them over the packed row (``masks.documents``)."""
    spec = case.spec
    if case.docs is not None:
        held = layouts.varlen_token_index(layouts.cu_seqlens_from_docs(case.docs).tolist(), case.layout, case.rank,
                                          case.world_size, by_document=case.variant.shard_by_document, device=device,
                                          ulysses_degree=case.ulysses_degree)
    else:
        held = layouts.token_index(case.layout, spec.seqlen, case.rank, case.world_size, device=device,
                                   ulysses_degree=case.ulysses_degree, mask=spec.mask)
    return PositionMask(held, held, masks.over(spec.mask, spec.seqlen, case.docs).allows, spec.mask)


@dataclass(frozen=True)
class RankMeasure:
    """One rank's figures of a ``run`` case (:func:`measure_rank`); :func:`run_fields` takes one
    per rank, gathered in rank order (they travel by pickle, so they hold plain numbers and dicts).

    Attributes:
        time_ms, time_ms_p20, time_ms_p80: the p50 (median), p20 and p80 of the variant's
            timed iterations (:func:`quantiles`), in ms.
        ref_time_ms, ref_time_ms_p20, ref_time_ms_p80: the same of the reference's (the same
            kernel on the rank's share), in ms.
        timed_iters, ref_timed_iters: the iterations timed, of the variant and of the
            reference (``spec.iters``, or more under ``spec.min_time_ms``).
        bytes_sent, bytes_received: bytes this rank's counted transfers moved per iteration.
        peak_allocated_gib, peak_reserved_gib: the device's peak memory over the timed
            iterations, in GiB, the flush buffer left out of the allocated figure;
            ``None`` off CUDA.
        l2_flush_bytes: the bytes of the ``--flush-l2`` buffer, or ``None`` without it.
        ref_flops: the FLOPs of one reference iteration.
        profile: the rank's ``profile.measure`` breakdown, or ``None`` (``spec.profile`` off).
        cuda_graph: the timed iterations replayed a CUDA graph (``graphs.for_case``).
        cuda_graph_note: how the replay matched eager (``graphs.compare``'s note, then the
            reference's), or why the rank ran eagerly.
        cuda_graph_ratio: the worst ratio of the loop's replay check (``graphs.Check``), or None.
    """

    time_ms: float
    time_ms_p20: float
    time_ms_p80: float
    ref_time_ms: float
    ref_time_ms_p20: float
    ref_time_ms_p80: float
    timed_iters: int
    ref_timed_iters: int
    bytes_sent: float
    bytes_received: float
    peak_allocated_gib: float | None
    peak_reserved_gib: float | None
    l2_flush_bytes: int | None
    ref_flops: float
    profile: dict | None
    cuda_graph: bool = False
    cuda_graph_note: str | None = None
    cuda_graph_ratio: float | None = None


def measure_rank(spec: CaseSpec, step: Callable[[], None], reference: Callable[[], None], *, inputs: tuple,
                 device: torch.device, group, ref_docs: list[int] | None, local: int) -> RankMeasure:
    """Time one rank's iterations, its reference and (``spec.profile``) its spans.

    Both timed loops follow ``spec.iters`` and ``spec.min_time_ms`` (:func:`time_iterations`)
    and, with ``spec.flush_l2``, flush L2 before every iteration; the profile pass runs
    ``spec.iters`` iterations, unflushed. ``inputs`` (q, k, v) lose their grads before the
    reference runs.

    Returns:
        This rank's :class:`RankMeasure`.
    """
    from ringbench.rank import profile

    iters, warmup, budget = spec.iters, spec.warmup, spec.min_time_ms
    cuda = device.type == "cuda"
    # Warm up before opening the counters, so allocator growth and traffic of the warm-up
    # stay out of the figures.
    for _ in range(warmup):
        step()
    # The bytes of one iteration, counted on an eager call: a graph's replay runs no Python.
    with instruments.open(traffic=True) as inst:
        step()
    sent, received = inst.traffic.bytes_sent, inst.traffic.bytes_received
    # A learnable bias's dbias is summed over the ranks from Python in the backward; a replay would not redo it.
    # A backward with atomic adds may reorder them in a replay where eager calls happened to agree.
    atomics = bool(getattr(KERNELS.get(spec.kernel), "nondeterministic_backward", "")) and spec.mode == "fwd_bwd"
    graph = graphs.for_case(spec.cuda_graph, step, device=device, world_size=spec.world_size,
                            emulated=spec.emulate, group=group, nondeterministic=atomics,
                            eager_reason="a learnable bias's gradient is summed over the ranks from Python, which a "
                                         "replay would skip" if bias_learns(spec.bias) else None,
                            median_ms=lambda fn: quantiles(time_iterations(fn, iters=5, warmup=0, device=device,
                                                                           group=group))[1])
    # Allocated before the peak counters are reset, so it is in every figure of the window,
    # and exactly its bytes come off the allocated one.
    flush, flush_bytes = l2_flush(device) if spec.flush_l2 else (None, None)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = time_iterations(graph.replay or step, iters=iters, warmup=0, device=device, group=group,
                            min_time_ms=budget, flush=flush)
    peak_alloc = (torch.cuda.max_memory_allocated(device) - (flush_bytes or 0)) / GIB if cuda else None
    peak_reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else None
    spans = profile.measure(step, iters=iters, device=device, group=group) if spec.profile else None
    for t in inputs:
        t.grad = None
        t.requires_grad_(False)
    # A replayed loop is held against a replayed reference: an eager one would pay the launches
    # the graph saved, and the efficiency would credit the ring with them.
    note = graph.check or graph.reason
    if graph.replay is not None:
        ref_graph = graphs.capture(reference, device=device, nondeterministic=atomics)
        if ref_graph.replay is not None:
            reference = ref_graph.replay
            note += f"; the reference: {ref_graph.check}"
        else:
            note += f"; the reference ran eagerly ({ref_graph.reason})"
    ref_times = time_iterations(reference, iters=iters, warmup=warmup, device=device, group=group,
                                min_time_ms=budget, flush=flush)
    ref_pairs = int(reference_mask(case_setup(spec, group), device).dense().sum()) if spec.mask else None
    ref_flops = attention_flops(batch=spec.batch, seqlen=local, heads=spec.heads, head_dim=spec.head_dim,
                                causal=spec.causal, mode=spec.mode, docs=ref_docs, head_dim_v=spec.value_head_dim(),
                                window=spec.window or None, pairs=ref_pairs)
    p20, p50, p80 = quantiles(times)
    ref_p20, ref_p50, ref_p80 = quantiles(ref_times)
    return RankMeasure(time_ms=p50, time_ms_p20=p20, time_ms_p80=p80, ref_time_ms=ref_p50, ref_time_ms_p20=ref_p20,
                       ref_time_ms_p80=ref_p80, timed_iters=len(times), ref_timed_iters=len(ref_times),
                       bytes_sent=sent, bytes_received=received, peak_allocated_gib=peak_alloc,
                       peak_reserved_gib=peak_reserved, l2_flush_bytes=flush_bytes, ref_flops=ref_flops,
                       profile=spans, cuda_graph=graph.replay is not None,
                       cuda_graph_note=note, cuda_graph_ratio=graph.worst_ratio)


def graph_note(gathered: list[RankMeasure]) -> str | None:
    """The ``cuda_graph_note`` of a record: that of the first rank that ran eagerly, else of the
    rank closest to failing its replay check, named when the ranks' notes differ (emulated ranks
    each capture their own)."""
    eager = [r for r, g in enumerate(gathered) if not g.cuda_graph]
    rank = eager[0] if eager else max(range(len(gathered)), key=lambda r: gathered[r].cuda_graph_ratio or 0.0)
    note = gathered[rank].cuda_graph_note
    return note if len({g.cuda_graph_note for g in gathered}) == 1 else f"rank {rank}: {note}"


def reference_rank(gathered: list[RankMeasure]) -> RankMeasure:
    """The rank whose reference stands for the kernel on one rank's share: the one at the median of
    the ranks' reference TFLOP/s (``ref_flops / ref_time_ms``), the faster of the two middle ones
    for an even count. Every rank times the same kernel on a share of the same size; one slow
    reference (a host hiccup, a capture that fell back to eager) taken as the figure would raise
    the efficiency of the whole record, as the slowest one did (an emulated W=8 bound of 2.3 at
    2k tokens per rank on the H200, 2026-12-06)."""
    by_rate = sorted(gathered, key=lambda g: g.ref_flops / g.ref_time_ms if g.ref_time_ms > 0 else float("inf"))
    return by_rate[len(by_rate) // 2]


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
    per_rank_p20, per_rank_p80 = [g.time_ms_p20 for g in gathered], [g.time_ms_p80 for g in gathered]
    # Each quantile of the slowest rank at it: a ring is only as fast as its straggler.
    time_ms = max(per_rank)
    ref = reference_rank(gathered)
    ref_ms, ref_flops = ref.ref_time_ms, ref.ref_flops
    real = spec_docs(spec) if variant.varlen else None  # real lengths: padding is not counted
    flops_per_gpu = attention_flops(batch=spec.batch, seqlen=sum(real) if real else spec.seqlen, heads=spec.heads,
                                    head_dim=spec.head_dim, causal=spec.causal, mode=spec.mode, docs=real,
                                    head_dim_v=spec.value_head_dim(), window=spec.window or None,
                                    mask=spec.mask) / world_size
    tflops = flops_per_gpu / (time_ms * 1e-3) / 1e12
    ref_tflops = ref_flops / (ref_ms * 1e-3) / 1e12
    # None: the variant's bytes go where the counters cannot see them (Variant.traffic_counted).
    max_sent = max(g.bytes_sent for g in gathered) if variant.traffic_counted else None
    fields = {
        "time_ms": time_ms,
        "time_ms_p20": max(per_rank_p20),
        "time_ms_p80": max(per_rank_p80),
        "per_rank_time_ms": per_rank,
        "per_rank_time_ms_p20": per_rank_p20,
        "per_rank_time_ms_p80": per_rank_p80,
        # The same on every rank of a real run; emulated ranks each run their own loop.
        "timed_iters": min(g.timed_iters for g in gathered),
        "imbalance": time_ms / min(per_rank) if min(per_rank) > 0 else None,
        "flops_convention": "flash-attn",
        "flops_per_gpu": flops_per_gpu,
        "tflops_per_gpu": tflops,
        "ref_time_ms": ref_ms,
        "ref_time_ms_p20": ref.ref_time_ms_p20,
        "ref_time_ms_p80": ref.ref_time_ms_p80,
        "per_rank_ref_time_ms": [g.ref_time_ms for g in gathered],
        "ref_timed_iters": min(g.ref_timed_iters for g in gathered),
        "ref_tflops": ref_tflops,
        "efficiency": tflops / ref_tflops if ref_tflops > 0 else None,
        "peak_allocated_gib": max(g.peak_allocated_gib for g in gathered) if cuda else None,
        "peak_reserved_gib": max(g.peak_reserved_gib for g in gathered) if cuda else None,
        "l2_flush_bytes": gathered[0].l2_flush_bytes,
        "bytes_sent": int(max_sent) if max_sent is not None else None,
        "bytes_received": int(max(g.bytes_received for g in gathered)) if max_sent is not None else None,
        "bus_gib_s": max_sent / GIB / (time_ms * 1e-3) if world_size > 1 and max_sent is not None and not emulated
        else None,
        # False: bytes_sent is null because it is not counted, not because nothing was sent.
        "bytes_counted": variant.traffic_counted,
        # True when every rank replayed: real ranks agree (graphs.for_case), emulated ones each decide.
        "cuda_graph": all(g.cuda_graph for g in gathered),
        "cuda_graph_note": graph_note(gathered),
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
