"""All-gather context parallelism in the style of Llama 3: gather K/V, keep queries local.

Each rank gathers every rank's K/V (a group of K/V heads at a time, the next group's gather
in flight while the current one computes), then attends its local queries to all keys with
the right causal offsets. Backward recomputes nothing: it reuses the gathered K/V, computes
dq locally and reduce-scatters the float32 dK/dV to their owners. There are fewer merges
than in a ring (two per local chunk), so less rounding; the price is a gather that is only
overlapped across head groups, and gathered K/V held in memory.

Causal runs default to the zigzag layout, which gives every rank the same causal work; the
contiguous layout is there to measure what that balance is worth.

Source: "The Llama 3 Herd of Models" (Meta, 2024), its context-parallelism part.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import layouts, masked, masks
from . import comm
from .. import instruments
from ..instruments import emulation, observe, timeline
from ..kernels.common import Bias, accumulation_dtype, running_lse_dtype, window_band
from ..kernels import Kernel, as_kernel
from .merge import add_steps, merge_step
from .ring import RingBias, bias_grad, check_bias_of, check_max_logit, ring_bias
from .comm import all_reduce_max
from ..kernels.max_logit import MaxLogit
from .sinks import apply_sink, check_sink, sink_grad
from .window import check_window

Tensor = torch.Tensor

#: The layouts llama3 takes; the first is the default.
LAYOUTS = ("zigzag", "contiguous")


def _chunks(layout: str, rank: int, world_size: int, seqlen_local: int) -> list[tuple[slice, int, int]]:
    """Local query chunks as (local rows, first global token, chunk length)."""
    ids = layouts.chunk_ids(layout, rank, world_size)
    c = seqlen_local // len(ids)
    return [(slice(i * c, (i + 1) * c), cid * c, c) for i, cid in enumerate(ids)]


def _gather_global(x: Tensor, group, world_size: int) -> tuple[Tensor, dist.Work | None]:
    """Start gathering every rank's shard of ``x`` [B, S/W, H, D] (a view: a head group of the
    shard, which ``comm`` makes contiguous for the call); returns the [W, ...] buffer."""
    # Concatenated along dim 0, the shape every backend takes; viewed as [W, ...] after.
    buf = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = comm.all_gather_into_tensor(buf, x, group=group, async_op=True)
    return buf, work


class Rows(NamedTuple):
    """Where every rank's rows lie when no named layout says it (llama3_varlen's balanced layout under
    a mask): the engine's ``layout`` argument in place of a layout's name.

    Attributes:
        tokens: every rank's global positions, int64 ``[S/W]`` each in local order (rank order).
        order: int64 ``[S]``: the rank-major index of every global position (the gathered row's).
        calls: this rank's kernel calls ``(local rows, key range, causal, kernel keywords)`` over
            the gathered row in global order (``masked.gathered_blocks``).
    """

    tokens: tuple
    order: Tensor
    calls: tuple


def _to_global(buf: Tensor, layout: "str | Rows") -> Tensor:
    """[W, B, S/W, H, D] rank-ordered shards → [B, S, H, D] in global token order."""
    if isinstance(layout, Rows):
        return buf.transpose(0, 1).flatten(1, 2).index_select(1, layout.order)
    return layouts.unshard(list(buf.unbind(0)), layout, dim=1)


def reduce_scatter_shards(full: Tensor, layout: str, group) -> Tensor:
    """Sum ``full`` [B, S, h, D] over the ranks and return this rank's shard of it in ``layout``.

    Used for the float32 key gradients, which every rank holds for the whole sequence.
    """
    world_size = emulation.rank_and_size(group)[1]
    if isinstance(layout, Rows):  # rank-major: every rank's positions in its local order
        shards = torch.cat([full.index_select(1, t) for t in layout.tokens])
    else:
        shards = torch.cat([layouts.shard(full, layout, r, world_size) for r in range(world_size)])
    part = torch.empty_like(shards[: shards.shape[0] // world_size])
    with timeline.span("comm"):
        comm.reduce_scatter_tensor(part, shards, group=group)
    return part


def head_group_stride(heads_k_stride: int | None, kv_heads: int, prefix: str = "") -> int:
    """K/V heads gathered at a time: ``heads_k_stride``, or all of them when it is ``None``.

    Raises:
        ValueError: a stride outside 1..kv_heads (the message starts with ``prefix``).
    """
    stride = kv_heads if heads_k_stride is None else heads_k_stride
    if not 1 <= stride <= kv_heads:
        raise ValueError(f"{prefix}heads_k_stride {stride} must be between 1 and kv_heads = {kv_heads}")
    return stride


def _head_groups(kv_heads: int, stride: int) -> list[slice]:
    return [slice(h, min(h + stride, kv_heads)) for h in range(0, kv_heads, stride)]


def _gathered_kv(k: Tensor, v: Tensor, group, world_size: int, stride: int, layout: str):
    """Yield (kv head slice, global K, global V) per head group, prefetching the next group."""
    groups = _head_groups(k.shape[2], stride)

    def start(hs):
        return _gather_global(k[:, :, hs], group, world_size), _gather_global(v[:, :, hs], group, world_size)

    pending = start(groups[0])
    for i, hs in enumerate(groups):
        (kb, kw), (vb, vw) = pending
        if i + 1 < len(groups):
            pending = start(groups[i + 1])  # overlaps this group's compute
        with timeline.span("comm"):
            kw.wait()
            vw.wait()
        yield (hs, _to_global(kb.unflatten(0, (world_size, -1)), layout),
               _to_global(vb.unflatten(0, (world_size, -1)), layout))


@functools.lru_cache(maxsize=32)
def _masked_blocks(mask, layout: str, rank: int, world_size: int, seqlen_local: int, device, by_slices: bool):
    chunks = _chunks(layout, rank, world_size, seqlen_local)
    return masked.gathered_blocks(mask, chunks, seqlen_local // len(chunks), seqlen_local * world_size, device,
                                  by_slices)


def _blocks(layout: str, causal: bool, rank: int, world_size: int, seqlen_local: int, seqlen: int,
            window: int | None = None, mask=None, device=None, by_slices: bool = False):
    """(local query rows, key range, causal, kernel keywords) of every kernel call this rank makes.

    Under a sliding window each local chunk makes one call: its keys from ``window - 1`` before
    its first token to its last, with the flash-attn window ``(window - 1, 0)``. Under a mask
    (a ``masks.Mask``) each local chunk meets the gathered keys cut in the layout's chunks, the
    empty ones skipped, each run of neighbouring ones in one call (``masked.gathered_blocks``,
    built once per rank and shape and kept; ``by_slices``: partial ones as window calls, for a
    kernel that takes no mask).
    """
    if isinstance(layout, Rows):
        return layout.calls
    if mask is not None:
        return _masked_blocks(mask, layout, rank, world_size, seqlen_local, torch.device(device or "cpu"), by_slices)
    if not causal:
        return [(slice(None), slice(0, seqlen), False, {})]
    out = []
    for rows, start, length in _chunks(layout, rank, world_size, seqlen_local):
        if window is not None:
            out.append((rows, slice(max(0, start - window + 1), start + length), False, {"window": window_band(window)}))
            continue
        if start > 0:
            out.append((rows, slice(0, start), False, {}))
        out.append((rows, slice(start, start + length), True, {}))
    return out


def _bias_kw(bias: RingBias | None, rank: int, rows: slice, keys: slice, qh: slice, kw: dict) -> dict:
    # A call's kernel keywords with its bias block: this rank's rows against the gathered keys (global order).
    if bias is None:
        return kw
    every = bias.positions[rank]
    k_pos = torch.arange(keys.start, keys.stop, device=every.device)
    return {**kw, "bias": bias.bias.at(every[rows], k_pos, qh)}


def _forward(q, k, v, causal, scale, group, kernel, stride, layout, window=None, mask=None, bias=None,
             max_logit=None):
    rank, world_size = emulation.rank_and_size(group)
    B, S_local, H = q.shape[:3]
    G = H // k.shape[2]
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(B, S_local, H, v.shape[3], dtype=acc, device=q.device)  # v's head dim (head_dim_v)
    # float64 for float32 inputs, rounded once below: a row's lse may take many merges (running_lse_dtype).
    lse = torch.full((B, H, S_local), float("-inf"), dtype=running_lse_dtype(q.dtype), device=q.device)
    seen = observe.current()
    saved = []
    timeline.step("fwd", 0)  # a step is a head group: its gather's wait, kernel calls and merges
    for i, (hs, kg, vg) in enumerate(_gathered_kv(k, v, group, world_size, stride, layout)):
        qh = slice(hs.start * G, hs.stop * G)
        for rows, keys, c, kw in _blocks(layout, causal, rank, world_size, S_local, kg.shape[1], window, mask,
                                         q.device, kernel.by_slices):
            with timeline.span("kernel"):
                b_out, b_lse = kernel.forward(q[:, rows, qh], kg[:, keys], vg[:, keys], c, scale,
                                              **_bias_kw(bias, rank, rows, keys, qh, kw),
                                              **({} if max_logit is None else {"max_logit": max_logit.heads(qh)}))
            if seen is not None:
                seen.forward_block(rows, qh, b_out, b_lse)
            with timeline.span("merge"):  # in place: out is already float32
                merge_step(out[:, :, qh], lse[:, qh], rows, b_out, b_lse, into=acc)
        saved.append((kg, vg))
        timeline.step("fwd", i + 1)
    return out, lse.to(acc), saved


def _backward(dout, q, k, v, out, lse, saved, causal, scale, group, kernel, stride, layout, window=None,
              mask=None, bias=None, max_logit=None):
    rank, world_size = emulation.rank_and_size(group)
    S_local, G = q.shape[1], q.shape[2] // k.shape[2]
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=k.device)
    dv = torch.empty(v.shape, dtype=acc, device=v.device)
    seen = observe.current()
    for i, (hs, (kg, vg)) in enumerate(zip(_head_groups(k.shape[2], stride), saved)):
        timeline.step("bwd", i)
        qh = slice(hs.start * G, hs.stop * G)
        dkg = torch.zeros(kg.shape, dtype=acc, device=k.device)
        dvg = torch.zeros(vg.shape, dtype=acc, device=v.device)
        for rows, keys, c, kw in _blocks(layout, causal, rank, world_size, S_local, kg.shape[1], window, mask,
                                         q.device, kernel.by_slices):
            with timeline.span("kernel"):
                g = kernel.backward(dout[:, rows, qh], q[:, rows, qh], kg[:, keys], vg[:, keys],
                                    out[:, rows, qh], lse[:, qh, rows], c, scale,
                                    **_bias_kw(bias, rank, rows, keys, qh, kw))
            if seen is not None:
                seen.dq_block(rows, qh, g[0])
                tokens = list(layout.tokens) if isinstance(layout, Rows) else \
                    layouts.every_rank_tokens(layout, kg.shape[1], world_size, k.device)
                seen.gathered_dkv(tokens, keys, hs,
                                  g[1], g[2])
            with timeline.span("merge"):  # one launch on CUDA, in place into the float32 sums
                add_steps([(dq[:, :, qh], rows, g[0], acc, None, None), (dkg, keys, g[1], acc, None, None),
                           (dvg, keys, g[2], acc, None, None)])
        for full, local in ((dkg, dk), (dvg, dv)):
            local[:, :, hs] = reduce_scatter_shards(full, layout, group)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class GatheredAttention(torch.autograd.Function):
    """Autograd wrapper shared by the all-gather variants.

    ``forward_fn(q, k, v, *args) -> (out, lse, gathered K/V)`` and
    ``backward_fn(dout, q, k, v, out, lse, gathered K/V, *args) -> (dq, dk, dv)``; the gathered
    K/V are kept from forward to backward instead of being gathered again. ``args`` start with
    ``(causal, scale, group)``. ``forward_fn``'s out may be in the accumulation dtype: it is cast
    to q's dtype here, after the ``sink`` (``[Hq]`` or ``None``, ``sinks.py``) joins each row once.
    ``bias`` (a ``ring.RingBias`` that ``args`` pass the functions too, or ``None``): a learnable
    bias's ``values`` (``bias_values``) get the gradient its kernel calls add, summed over the group.
    """

    @staticmethod
    def forward(ctx, q, k, v, sink, bias_values, bias, forward_fn, backward_fn, *args):
        instruments.carry(ctx)  # the backward reports to these, on whichever thread autograd runs it
        out, lse, saved = forward_fn(q, k, v, *args)
        if sink is not None:
            out, lse = apply_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.saved_kv = saved
        ctx.backward_fn, ctx.args, ctx.bias = backward_fn, args, bias
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @instruments.carried
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        learn = ctx.bias is not None and ctx.needs_input_grad[4]
        if learn:
            ctx.bias.bias.open_grad(accumulation_dtype(q.dtype))
        grads = ctx.backward_fn(dout, q, k, v, out, lse, ctx.saved_kv, *ctx.args)
        ctx.saved_kv = None
        dsink = sink_grad(dout, out, lse, sink, ctx.args[2]) if ctx.needs_input_grad[3] else None
        dbias = bias_grad(ctx.bias.bias, ctx.args[2]) if learn else None
        return (*grads, dsink, dbias, None, None, None, *(None for _ in ctx.args))


def llama3_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                     softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                     kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                     heads_k_stride: int | None = None, layout: str = "zigzag",
                     sink: Tensor | None = None, window: int | None = None,
                     mask: str | None = None, bias: Bias | None = None,
                     max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence by gathering K/V, each rank holding its shard.

    Args:
        q: ``[B, S/W, Hq, D]`` in ``layout`` (``layouts.shard(x, layout, rank, W)``): zigzag
            needs ``S % (2W) == 0``, contiguous ``S % W == 0``.
        k, v: ``[B, S/W, Hkv, D]`` in the same layout, ``Hq % Hkv == 0``; v may have its own
            head dim Dv (``head_dim_v``) where the kernel takes it.
        causal, softmax_scale, group, kernel: as in :func:`ring.ring_attention`.
        cu_seqlens: not taken by this batch form; must be ``None``.
        heads_k_stride: K/V heads gathered at a time (default: all of them in one gather);
            while one group computes, the next group's gather is in flight.
        layout: ``zigzag`` (default, balanced under a causal mask) or ``contiguous``.
        sink: ``[Hq]`` sink logits, or ``None``, as in :func:`ring.ring_attention`.
        window: a causal sliding window of this many keys (query p sees keys p - window + 1 ..
            p); each local chunk then attends only the gathered keys its window reaches.
        mask: any mask over the global sequence (``masks.py``: ``prefix:512``, ``slices:...``), or
            ``None``; each local chunk attends the gathered key chunks the mask leaves, partial
            ones on a kernel that takes a mask, and ``causal`` is ignored.
        bias: an attention bias over the global sequence (``kernels.common.Bias``), or ``None``:
            every call takes its block at its rows' and the gathered keys' global positions, on a
            kernel that takes a bias; a learnable bias's gradient is summed over the group.
        max_logit: a ``kernels.max_logit.MaxLogit`` of ``[Hq]``, or ``None``: every forward call
            raises the heads of its head group, then a MAX over the group, as in :func:`ring.ring_attention`.

    Returns:
        ``out`` ``[B, S/W, Hq, Dv]`` in q's dtype; ``lse`` float32 ``[B, Hq, S/W]``.

    Raises:
        ValueError: ``cu_seqlens`` given, an unknown layout, an odd local length under zigzag,
            or a ``heads_k_stride`` outside 1..Hkv; a window that is not positive, without
            ``causal``, or on a kernel that takes none; a mask that is malformed, does not fit
            the sequence, comes with a window, or on a kernel that takes none.
    """
    if cu_seqlens is not None:
        raise ValueError("llama3 is the batch form and takes no cu_seqlens; use llama3_varlen")
    check_window(window, causal)
    mask = masked.as_mask(mask, q.shape[1] * emulation.rank_and_size(group)[1], window=window)
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one llama3 takes; choose one of {', '.join(LAYOUTS)}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"local seqlen {q.shape[1]} is odd; the zigzag layout gives every rank two "
                         "equal chunks, so seqlen must be a multiple of 2 * world_size")
    stride = head_group_stride(heads_k_stride, k.shape[2])
    kernel = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                       window=window is not None, mask=masks.label(mask.text) if mask is not None else "",
                       bias=bias.kind if bias is not None else "", max_logit=max_logit is not None)
    check_max_logit(max_logit, q, False)
    if sink is not None:
        check_sink(sink, q.shape[2])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    world_size = emulation.rank_and_size(group)[1]
    ring = None
    if bias is not None:
        check_bias_of(bias, q, world_size, False)
        ring = ring_bias(bias, layout, q.shape[1] * world_size, world_size, q.device)
    values = bias.values if bias is not None and bias.learnable else None
    out, lse = GatheredAttention.apply(q, k, v, sink, values, ring, _forward, _backward, causal, scale, group,
                                       kernel, stride, layout, window, mask, ring, max_logit)
    if max_logit is not None:
        all_reduce_max(max_logit.values, group=group)
    return out, lse


def schedule(layout: str, causal: bool, rank: int, world_size: int, seqlen_local: int, kv_heads: int,
             stride: int, window: int | None = None, mask=None) -> list[tuple[slice, list]]:
    """This rank's work, as :func:`llama3_attention` runs it: per head group (K/V heads gathered
    together) its kernel calls ``(local query rows, key range, causal, kernel keywords)``; under
    ``mask`` (a ``masks.Mask``) as a kernel that takes a window but no mask runs it (partial blocks
    as window calls, one per slice). Public so that ``ringbench predict`` walks the schedule that
    runs (issue 24)."""
    blocks = _blocks(layout, causal, rank, world_size, seqlen_local, seqlen_local * world_size, window, mask,
                     by_slices=mask is not None)
    return [(hs, blocks) for hs in _head_groups(kv_heads, stride)]
