"""Ulysses attention: an all-to-all swaps sequence sharding for head sharding, and back.

Every rank of a Ulysses group of U ranks holds ``S_g / U`` tokens of the group's rows for all
heads. The all-to-all gives it all ``S_g`` rows for ``H / U`` heads; attention runs there, and
a second all-to-all swaps the output back to sequence sharding. Backward is the mirror image:
dout goes to head sharding, the kernel's (or the ring's) backward runs, and dq, dk, dv go back.

One engine serves ``ulysses`` and the hybrid ``usp`` (``usp.py``): between the all-to-alls it
runs ringbench's ring engine over the ring group (``grid.process_grid``), with one rank in it
for ``ulysses`` (U = W: a single kernel call over the whole sequence, no transfer) and W / U
ranks for ``usp``. Packed documents need nothing more: after the all-to-all the ring shard's
rows are whole, so the kernel (or the ring's varlen steps) takes its documents' offsets.

GQA: the degree must divide the query heads. K/V heads are split the same way when the degree
divides them; when it exceeds them (and is a multiple of them), each K/V head is replicated
``U / Hkv`` times, as DeepSpeed does: the all-to-all sends the head itself to ``U / Hkv`` ranks
(no repeated copy is made first), and the replicas' gradients are summed in float32 on the
way back (``variants.ulysses_rule``). Where a ring of several ranks summed each replica's
gradient, it crosses the all-to-all in float32, unrounded, so the replicas' sum is rounded
once (rounding each replica to bf16 first loses what the block-decomposition check measures,
where replicas nearly cancel).

Bytes go through ``comm.all_to_all`` (and the ring's ``RingComm``), counted there; every part
an all-to-all sends is a view of the tensor it swaps, which is also what lets one process
emulate the exchange exactly (``run --emulate``, ``instruments/emulation.py``).
While an observation is open (verify), the ring's kernel calls are reported to verify's
block-decomposition reference through ``observe.regrid``, which turns their head-sharded rows
into the ranks, rows and heads of the variant's own shards; otherwise nothing is reported.

Source: Jacobs et al., "DeepSpeed Ulysses" (arXiv 2309.14509).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import instruments
from ..instruments import emulation, observe
from ..rules import ulysses_rule
from .comm import all_reduce, all_reduce_max, all_to_all
from .grid import Grid, process_grid
from ..kernels.common import accumulation_dtype
from ..kernels import Kernel, as_kernel
from ..kernels.max_logit import MaxLogit, with_max_logit
from . import masked, masks, window as _window
from ..kernels.common import Bias
from .ring import (Plan, VarlenSteps, _ring_backward, _ring_forward, _window_steps, batch_steps, bias_grad, check_bias_of,
                   check_max_logit,
                   contiguous_plan, ring_bias)
from .sinks import check_sink, sink_grad
from .varlen import prepare

Tensor = torch.Tensor


def seq_to_heads(x: Tensor, group, degree: int, replicas: int = 1) -> Tensor:
    """``[B, s, H, D]`` sequence-sharded over ``degree`` ranks to ``[B, degree * s, H * replicas / degree, D]``.

    Part j of the rows comes from Ulysses rank j, so the rows are in the group's order. With
    ``replicas`` above 1 (the degree exceeds the K/V heads), each head goes to ``replicas``
    ranks, one head each: rank u gets head ``u // replicas``, as if the heads were repeated
    (``repeat_interleave``) first. Every part sent is a view of ``x``.
    """
    if degree == 1:
        return x
    h = x.shape[2] * replicas // degree
    heads = [slice(u * h, (u + 1) * h) if replicas == 1 else slice(u // replicas, u // replicas + 1)
             for u in range(degree)]
    return all_to_all([x[:, :, hs] for hs in heads], 1, group)


def heads_to_seq(x: Tensor, group, degree: int) -> Tensor:
    """``[B, S, h, D]`` head-sharded to ``[B, S / degree, degree * h, D]``: the inverse of :func:`seq_to_heads`."""
    if degree == 1:
        return x
    s = x.shape[1] // degree
    return all_to_all([x[:, u * s:(u + 1) * s] for u in range(degree)], 2, group)


def lse_heads_to_seq(lse: Tensor, group, degree: int) -> Tensor:
    """lse ``[B, h, S]`` head-sharded to ``[B, degree * h, S / degree]``."""
    if degree == 1:
        return lse
    s = lse.shape[2] // degree
    return all_to_all([lse[:, :, u * s:(u + 1) * s] for u in range(degree)], 1, group)


class UlyssesRing(torch.autograd.Function):
    """All-to-all, the ring engine over the ring group, all-to-all back; see :func:`run_ulysses`."""

    @staticmethod
    def forward(ctx, q, k, v, sink, bias_values, causal, scale, grid: Grid, kernel, steps, lossy, bias=None):
        instruments.carry(ctx)  # the backward reports to these, on whichever thread autograd runs it
        heads = q.shape[2] // grid.ulysses_degree
        mine = slice(grid.ulysses_rank * heads, (grid.ulysses_rank + 1) * heads)  # this rank's heads after the a2a
        sink_h = sink[mine] if sink is not None else None
        replicas = max(1, grid.ulysses_degree // k.shape[2])  # degree above the K/V heads: replicated (DeepSpeed)
        # This rank's K/V heads after the a2a, as heads of k (a replica: the head it copies).
        kv_heads = k.shape[2] * replicas // grid.ulysses_degree
        first = grid.ulysses_rank * kv_heads // replicas
        kv_mine = slice(first, first + max(1, kv_heads // replicas))
        qh = seq_to_heads(q, grid.ulysses, grid.ulysses_degree)
        kh, vh = (seq_to_heads(t, grid.ulysses, grid.ulysses_degree, replicas) for t in (k, v))
        regrid = dict(ulysses_degree=grid.ulysses_degree, ring_rank=grid.ring_rank, rows_per_rank=q.shape[1],
                      q_heads=mine, kv_heads=kv_mine)
        with observe.regrid(**regrid):
            out_h, lse_h, kv_last = _ring_forward(qh, kh, vh, causal, scale, grid.ring, kernel, steps, lossy,
                                                  sink=sink_h, bias=bias)
        ctx.save_for_backward(qh, kh, vh, out_h, lse_h, sink)
        # Where the ring engine's backward starts (ring.RingAttention keeps the same).
        ctx.kv_last = kv_last if kv_last is not None and kv_last[0] is not kh else None
        ctx.args = (causal, scale, grid, kernel, steps, lossy, replicas, mine, regrid)
        ctx.bias = bias
        out = heads_to_seq(out_h, grid.ulysses, grid.ulysses_degree)
        lse = lse_heads_to_seq(lse_h, grid.ulysses, grid.ulysses_degree)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @instruments.carried
    def backward(ctx, dout, _dlse):
        qh, kh, vh, out_h, lse_h, sink = ctx.saved_tensors
        causal, scale, grid, kernel, steps, lossy, replicas, mine, regrid = ctx.args
        dout_h = seq_to_heads(dout.contiguous(), grid.ulysses, grid.ulysses_degree)
        kv_last, ctx.kv_last = ctx.kv_last, None
        # K/V replicas come back unrounded (float32 through the all-to-all), so their sum is rounded
        # once, not each replica's and then the sum: a replica's dK/dV may be a sum itself (a ring of
        # several ranks, or a mask's window calls, one per slice).
        acc = accumulation_dtype(kh.dtype)
        dkv_dtype = acc if replicas > 1 else None
        learn = ctx.bias is not None and ctx.needs_input_grad[4]
        if learn:
            ctx.bias.bias.open_grad(acc)
        with observe.regrid(**regrid):
            dqh, dkh, dvh = _ring_backward(dout_h, qh, kh, vh, out_h, lse_h, kv_last, causal, scale, grid.ring,
                                           kernel, steps, lossy, dkv_dtype, bias=ctx.bias)
        # This rank's heads and ring rows: summed over the ring group, then over the Ulysses group.
        dbias = bias_grad(ctx.bias.bias, grid.ring, grid.ulysses) if learn else None
        dq, dk, dv = (heads_to_seq(t, grid.ulysses, grid.ulysses_degree) for t in (dqh, dkh, dvh))
        if replicas > 1:  # the replicas' gradients summed in float32 (float64), then rounded once
            dk, dv = (t.unflatten(2, (-1, replicas)).to(acc).sum(3).to(kh.dtype) for t in (dk, dv))
        dsink = None
        if ctx.needs_input_grad[3]:
            # This rank's heads over the whole sequence: summed over the ring group (the ranks
            # with the same heads), then every head's share gathered over the Ulysses group.
            full = torch.zeros(sink.shape, dtype=accumulation_dtype(lse_h.dtype), device=sink.device)
            full[mine] = sink_grad(dout_h, out_h, lse_h, sink[mine], grid.ring).to(full.dtype)
            if grid.ulysses_degree > 1:
                all_reduce(full, group=grid.ulysses)
            dsink = full.to(sink.dtype)
        return dq, dk, dv, dsink, dbias, None, None, None, None, None, None, None


def run_ulysses(name: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None,
                group, kernel: Kernel | str, ulysses_degree: int, plan: Plan,
                cu_seqlens: Tensor | None = None, ring_document_rule=None,
                sink: Tensor | None = None, window: int | None = None,
                lossy: tuple[str, ...] = (), mask: str | None = None,
                bias: Bias | None = None, max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Run the Ulysses engine: shared by ``ulysses``, ``ulysses_varlen``, ``usp`` and ``usp_varlen``.

    Args:
        name: the variant, for messages.
        q, k, v: this rank's shards ``[B, S/W, H, D]`` in the composed layout of ``layouts``
            with ``ulysses_degree`` (contiguous for U = W); varlen: B = 1.
        ulysses_degree: U, dividing W; the ring runs over W / U ranks with ``plan``.
        cu_seqlens: the GLOBAL int32 offsets (varlen), or ``None``.
        ring_document_rule: varlen over a ring of more than one rank: ``(docs, ring_degree) ->
            reason or None``, the per-document rule of the ring's layout.
        sink: ``[Hq]`` sink logits (``sinks.py``), or ``None``: each rank's heads' slice joins its
            rows after the ring's last merge; d sink is summed over the ring group, then gathered
            over the Ulysses group, the same ``[Hq]`` on every rank.
        window: a causal sliding window of this many keys (query p sees keys p - window + 1 .. p),
            taken by the ring over the ring group as in ``ring.run_ring`` (the ring's layout:
            contiguous for ulysses, zigzag for usp); ``None``: none.
        lossy: for test fixtures only, never correct: the ring's accumulators to round to the
            input dtype after every update (``ring.run_ring``'s ``lossy``).
        mask: any mask over the global sequence (``masks.py``), or ``None``: taken by the ring over
            the ring group as in ``ring.run_ring``, over the ring shards' global positions (for
            ulysses one kernel call over the whole sequence with its mask); with ``cu_seqlens``,
            applied inside each document over the packed row (``masks.documents``), the ring's
            blocks cut per document, cross-document ones empty.
        bias: an attention bias over the global sequence (``kernels.common.Bias``), or ``None``:
            every ring call takes its block at the ring shards' global positions, for this rank's
            query heads (the bias's heads sliced as the all-to-all slices q's); a learnable bias's
            gradient is summed over the ring group, then over the Ulysses group; batch form only.
        max_logit: a ``kernels.max_logit.MaxLogit`` of ``[Hq]``, or ``None``: the ring's calls raise
            the heads this rank holds after the all-to-all, the others stay ``-inf``, and a MAX over
            the whole group fills every head on every rank; batch form only.

    Raises:
        ValueError: (starting ``[rank r/W]``) heads the degree cannot split
            (``variants.ulysses_rule``), a degree not dividing W, an odd ring shard for the zigzag
            ring, an invalid cu_seqlens, documents the ring cannot cut, batch above 1 with
            documents, or a kernel that cannot take the call.
    """
    rank, world_size = emulation.rank_and_size(group)
    prefix = f"[rank {rank}/{world_size}]"
    reason = ulysses_rule(q.shape[2], k.shape[2], ulysses_degree, name)
    if reason:
        raise ValueError(f"{prefix} {reason}")
    _window.check_window(window, causal, f"{prefix} ")
    documents = None
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"{prefix} q has batch {q.shape[0]}, but {name} packs documents into one row; "
                             "pass [1, S/W, H, D] shards and the documents' cu_seqlens")
        documents = prepare(cu_seqlens, q.shape[1], group)
    mask = masked.as_mask(mask, q.shape[1] * world_size, window=window, prefix=f"{prefix} ",
                          docs=None if documents is None else documents.lengths)
    grid = process_grid(group, ulysses_degree)
    ring_len = q.shape[1] * ulysses_degree
    ring_layout = "contiguous" if plan is contiguous_plan else "zigzag"
    try:
        kernel = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                           varlen=cu_seqlens is not None, window=window is not None,
                           mask=masks.label(mask.text) if mask is not None else "",
                           bias=bias.kind if bias is not None else "", max_logit=max_logit is not None)
        check_max_logit(max_logit, q, cu_seqlens is not None)
    except ValueError as exc:
        raise ValueError(f"{prefix} {exc}") from None
    ring = None
    if bias is not None:
        check_bias_of(bias, q, world_size, cu_seqlens is not None, f"{prefix} ")
        heads = q.shape[2] // grid.ulysses_degree
        ring = ring_bias(bias, ring_layout, ring_len * grid.ring_degree, grid.ring_degree, q.device,
                         heads=slice(grid.ulysses_rank * heads, (grid.ulysses_rank + 1) * heads))
    if cu_seqlens is None:
        if plan is not contiguous_plan and grid.ring_degree > 1 and ring_len % 2:
            raise ValueError(f"{prefix} the ring shard of {ring_len} tokens is odd, but {name}'s zigzag ring gives "
                             "each ring rank two equal chunks; make seqlen a multiple of 2 * world_size")
        if mask is not None:
            steps = masked.ring_steps(mask, ring_layout, ring_len, grid.ring_rank, grid.ring_degree, q.device,
                                      by_slices=kernel.by_slices)
        elif window is not None:
            steps = _window_steps(ring_layout, ring_len, None, grid.ring_rank, grid.ring_degree, window)
        else:
            steps = batch_steps(plan, grid.ring_rank, grid.ring_degree, ring_len, causal)
    else:
        docs = documents.lengths
        if grid.ring_degree > 1:
            reason = ring_document_rule(docs, grid.ring_degree)
            if reason:
                raise ValueError(f"{prefix} {reason}")
        ring_docs = [d // grid.ring_degree for d in docs]
        if mask is not None:  # per document: every document cut in the ring's layout on its own
            steps = masked.ring_steps(mask, ring_layout, ring_len, grid.ring_rank, grid.ring_degree, q.device,
                                      by_slices=kernel.by_slices)
        else:
            steps = documents.schedule(
                (name, grid.ring_rank, grid.ring_degree, grid.ulysses_degree, causal, str(q.device), window),
                lambda: VarlenSteps(plan, ring_docs, grid.ring_rank, grid.ring_degree, causal, q.device)
                if window is None else _window_steps(ring_layout, ring_len, ring_docs, grid.ring_rank,
                                                     grid.ring_degree, window))
    if sink is not None:
        check_sink(sink, q.shape[2], f"{prefix} ")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    values = bias.values if bias is not None and bias.learnable else None
    if max_logit is not None:  # the ring's calls hold this rank's heads after the all-to-all
        heads = q.shape[2] // grid.ulysses_degree
        kernel = with_max_logit(kernel, max_logit.heads(slice(grid.ulysses_rank * heads,
                                                              (grid.ulysses_rank + 1) * heads)))
    out, lse = UlyssesRing.apply(q, k, v, sink, values, causal, scale, grid, kernel, steps, frozenset(lossy), ring)
    if max_logit is not None:
        all_reduce_max(max_logit.values, group=group)
    return out, lse


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                      softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                      kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                      sink: Tensor | None = None, window: int | None = None,
                      mask: str | None = None, bias: Bias | None = None,
                      max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence by DeepSpeed-Ulysses, each rank holding one contiguous chunk.

    Args:
        q: ``[B, S/W, Hq, D]``, chunk ``rank`` of the contiguous layout; W divides Hq.
        k, v: ``[B, S/W, Hkv, D]``, same rows; W divides Hkv, or Hkv divides W (K/V heads
            replicated W / Hkv times).
        causal, softmax_scale, group, kernel: as in :func:`ring.ring_attention`.
        cu_seqlens: not taken by this batch form; must be ``None``.
        sink: ``[Hq]`` float32 sink logits (``sinks.py``), or ``None``; differentiable.
        window: a causal sliding window of this many keys, or ``None`` (:func:`run_ulysses`).
        mask: any mask over the global sequence (``masks.py``), or ``None`` (:func:`run_ulysses`).
        bias: an attention bias (``kernels.common.Bias``), or ``None`` (:func:`run_ulysses`).
        max_logit: a ``kernels.max_logit.MaxLogit`` of ``[Hq]``, or ``None`` (:func:`run_ulysses`).

    Returns:
        ``out`` ``[B, S/W, Hq, D]`` in q's dtype, differentiable; ``lse`` float32 ``[B, Hq, S/W]``
        (with a sink, the lse with the sink, ``L``).

    Raises:
        ValueError: ``cu_seqlens`` given, heads W cannot split, or a kernel that cannot take it.
    """
    if cu_seqlens is not None:
        raise ValueError("ulysses is the batch form and takes no cu_seqlens; use ulysses_varlen")
    return run_ulysses("ulysses", q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                       ulysses_degree=emulation.rank_and_size(group)[1], plan=contiguous_plan, sink=sink,
                       window=window, mask=mask, bias=bias, max_logit=max_logit)


def ulysses_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                             softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                             kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                             sink: Tensor | None = None, window: int | None = None,
                             mask: str | None = None) -> tuple[Tensor, Tensor]:
    """Attention inside each packed document by Ulysses, the row cut contiguously.

    After the all-to-all every rank holds the whole row for ``Hq / W`` heads, so one varlen
    kernel call with the global ``cu_seqlens`` covers every document, whatever its boundaries.

    Args:
        q: ``[1, S/W, Hq, D]``: rows ``[rank*S/W, (rank+1)*S/W)`` of the packed row.
        k, v: ``[1, S/W, Hkv, D]``, the same rows; heads as in :func:`ulysses_attention`.
        causal, softmax_scale, group, kernel: as in :func:`ulysses_attention`; the kernel needs a
            varlen form.
        cu_seqlens: int32 ``[N + 1]``, the GLOBAL document offsets, identical on every rank; any
            boundaries (documents may straddle ranks, be empty or one token).
        sink, window: as in :func:`ulysses_attention`.
        mask: any mask of ``masks.py``, applied inside each document (``masks.documents``): the
            kernel calls over the whole row are one per document block the mask leaves anything in.

    Returns:
        ``out`` ``[1, S/W, Hq, D]`` in q's dtype; ``lse`` float32 ``[1, Hq, S/W]``.

    Raises:
        ValueError: (starting ``[rank r/W]``) no or an invalid cu_seqlens, batch above 1, heads W
            cannot split, or a kernel without a varlen form.
    """
    if cu_seqlens is None:
        raise ValueError("ulysses_varlen takes packed documents and needs cu_seqlens, the global int32 document "
                         "offsets; pass cu_seqlens, or use the batch variant ulysses")
    return run_ulysses("ulysses_varlen", q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                       kernel=kernel, ulysses_degree=emulation.rank_and_size(group)[1], plan=contiguous_plan,
                       cu_seqlens=cu_seqlens, sink=sink, window=window, mask=mask)
