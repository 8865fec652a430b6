"""All-gather context parallelism over packed documents, in the style of Llama 3.

The packed row is cut contiguously (rank r holds tokens ``[r*S/W, (r+1)*S/W)``), so documents
may straddle ranks, be empty, or be one token long: there is no rule on their lengths. Each
rank gathers every rank's K/V (a group of K/V heads at a time, the next group's gather in
flight), then makes ONE varlen kernel call per head group: its local queries, cut into the
pieces of the documents they belong to (``cu_seqlens_q``), against each document's keys from
the document's start up to the end of the local piece (causal) or to the document's end (not
causal), given as ``cu_seqlens_k``. The kernel's causal mask is aligned bottom-right document
by document, so a piece whose document started on an earlier rank sees all of that
document's earlier keys. Those key ranges are consecutive, so the keys are one slice of the
gathered K/V. No merge is needed, so there is no merge rounding at all. Backward reuses the
gathered K/V, computes dq locally and reduce-scatters float32 dK/dV to their owners.

The price: the causal work is unbalanced (later ranks see longer prefixes), as in ``llama3``
over the contiguous layout.

Source: "The Llama 3 Herd of Models" (Meta, 2024), its context-parallelism part, which
all-gathers K/V so that documents of any length can be packed across ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import observe
from .kernels import Kernel, accumulation_dtype, as_kernel
from .llama3 import GatheredAttention, _gathered_kv, _head_groups, head_group_stride, reduce_scatter_shards
from .sinks import check_sink
from .varlen import check_cu_seqlens

Tensor = torch.Tensor


class Pieces(NamedTuple):
    """This rank's kernel call: its local document pieces and the keys they attend.

    ``cu_q``: int32 offsets of the pieces within the local rows; ``keys``: the slice of the
    gathered row holding their keys; ``cu_k``: int32 offsets of each piece's keys within it.
    """

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    keys: slice


def local_pieces(offsets: list[int], rank: int, seqlen_local: int, causal: bool, device=None) -> Pieces:
    """The pieces of the documents that intersect rank's rows, and each piece's keys.

    A piece of document ``[a, b)`` on rows ``[s, e)`` is ``[max(a, s), min(b, e))``; its keys
    are ``[a, min(b, e))`` when causal (the document up to the piece's last token) and
    ``[a, b)`` otherwise. Empty pieces are dropped.

    Args:
        offsets: the global document offsets, ending at ``seqlen_local * W``.
        rank, seqlen_local: this rank and its row count.
        causal: the mask.
        device: where the offset tensors live.
    """
    start, end = rank * seqlen_local, (rank + 1) * seqlen_local
    q_lens, k_lens, first = [], [], None
    for a, b in zip(offsets, offsets[1:]):
        lo, hi = max(a, start), min(b, end)
        if hi <= lo:
            continue
        first = a if first is None else first
        q_lens.append(hi - lo)
        k_lens.append((hi if causal else b) - a)
    cu_q, cu_k = [0], [0]
    for lq, lk in zip(q_lens, k_lens):
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    return Pieces(torch.tensor(cu_q, dtype=torch.int32, device=device),
                  torch.tensor(cu_k, dtype=torch.int32, device=device),
                  max(q_lens), max(k_lens), slice(first, first + cu_k[-1]))


def _forward(q, k, v, causal, scale, group, kernel, stride, pieces: Pieces):
    world_size = dist.get_world_size(group)
    G = q.shape[2] // k.shape[2]
    out = q.new_empty(*q.shape[:3], v.shape[3])  # v's head dim (head_dim_v)
    lse = torch.empty(1, q.shape[2], q.shape[1], dtype=accumulation_dtype(q.dtype),
                      device=q.device)
    seen = observe.current()
    saved = []
    for hs, kg, vg in _gathered_kv(k, v, group, world_size, stride, "contiguous"):
        qh = slice(hs.start * G, hs.stop * G)
        b_out, b_lse = kernel.forward_varlen(q[:, :, qh], kg[:, pieces.keys], vg[:, pieces.keys], pieces.cu_q,
                                             pieces.cu_k, pieces.max_q, pieces.max_k, causal, scale)
        if seen is not None:
            seen.forward_block(slice(None), qh, b_out, b_lse)
        out[:, :, qh] = b_out
        lse[:, qh] = b_lse
        saved.append((kg, vg))
    return out, lse, saved


def _backward(dout, q, k, v, out, lse, saved, causal, scale, group, kernel, stride, pieces: Pieces):
    G = q.shape[2] // k.shape[2]
    acc = accumulation_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    seen = observe.current()
    for hs, (kg, vg) in zip(_head_groups(k.shape[2], stride), saved):
        qh = slice(hs.start * G, hs.stop * G)
        g = kernel.backward_varlen(dout[:, :, qh], q[:, :, qh], kg[:, pieces.keys], vg[:, pieces.keys],
                                   out[:, :, qh], lse[:, qh], pieces.cu_q, pieces.cu_k, pieces.max_q,
                                   pieces.max_k, causal, scale)
        if seen is not None:
            seen.dq_block(slice(None), qh, g[0])
            seen.gathered_dkv("contiguous", pieces.keys, hs, g[1], g[2], kg.shape[1], dist.get_world_size(group))
        dq[:, :, qh] = g[0]
        for grad, local in ((g[1], dk), (g[2], dv)):
            # Reduce-scatter in float32: every rank's share of the key gradients to its owner.
            full = torch.zeros((1, kg.shape[1], *grad.shape[2:]), dtype=acc, device=k.device)
            full[:, pieces.keys] = grad
            local[:, :, hs] = reduce_scatter_shards(full, "contiguous", group)
    return dq, dk, dv


def llama3_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                            softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                            kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                            heads_k_stride: int | None = None, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention inside each packed document by gathering K/V, the row cut contiguously.

    Args:
        q: ``[1, S/W, Hq, D]``: rows ``[rank*S/W, (rank+1)*S/W)`` of the packed row
            (``layouts.shard_varlen(x, cu_seqlens, "contiguous", rank, W, by_document=False)``).
        k, v: ``[1, S/W, Hkv, D]``, the same rows, ``Hq % Hkv == 0``.
        causal: mask keys after the query's position within its document.
        softmax_scale: defaults to ``D ** -0.5``.
        group: the context-parallel process group (default: the world).
        kernel: a :class:`Kernel` with a varlen form (math, cpu, torch-flash) or its name; ``auto``
            (default) picks the first available one with a varlen form.
        cu_seqlens: int32 ``[N + 1]``, the GLOBAL document offsets (0, ..., S), identical on
            every rank; any boundaries: documents may straddle ranks, be empty or one token.
        heads_k_stride: K/V heads gathered at a time (default: all of them in one gather).
        sink: ``[Hq]`` sink logits, or ``None``, as in :func:`ring.ring_attention`.

    Returns:
        ``out`` ``[1, S/W, Hq, D]`` in q's dtype; ``lse`` float32 ``[1, Hq, S/W]`` (float64 for
        float64 inputs), not differentiable.

    Raises:
        ValueError: (starting ``[rank r/W]``) no or an invalid cu_seqlens (see
            ``varlen.check_cu_seqlens``), batch > 1, a kernel without a varlen form, or a
            ``heads_k_stride`` outside 1..Hkv.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    prefix = f"[rank {rank}/{world_size}]"
    if cu_seqlens is None:
        raise ValueError(f"{prefix} llama3_varlen takes packed documents and needs cu_seqlens, the global int32 "
                         "document offsets; pass cu_seqlens, or use the batch variant llama3")
    if q.shape[0] != 1:
        raise ValueError(f"{prefix} q has batch {q.shape[0]}, but llama3_varlen packs documents into one row; "
                         "pass [1, S/W, H, D] shards and the documents' cu_seqlens")
    stride = head_group_stride(heads_k_stride, k.shape[2], prefix=f"{prefix} ")
    try:
        kernel = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                           varlen=True)
    except ValueError as exc:
        raise ValueError(f"{prefix} {exc}") from None
    offsets = check_cu_seqlens(cu_seqlens, q.shape[1], group)
    pieces = local_pieces(offsets, rank, q.shape[1], causal, device=q.device)
    if sink is not None:
        check_sink(sink, q.shape[2], f"{prefix} ")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return GatheredAttention.apply(q, k, v, sink, _forward, _backward, causal, scale, group, kernel, stride,
                                   pieces)
