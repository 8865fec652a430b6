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
over the contiguous layout. ``layout="balanced"`` removes it: every document is cut head-tail
into 2W chunks of any length (``balanced.py``), each local piece attends its document's keys up
to its last token, and those key ranges (which overlap: a tail chunk's keys hold its head's)
are taken from the gathered row by index, their gradients summed back by index.

With a sliding window each piece attends only the keys its window reaches, with the flash-attn
window ``(window - 1, 0)``, still in one varlen call.

Source: "The Llama 3 Herd of Models" (Meta, 2024), its context-parallelism part, which
all-gathers K/V so that documents of any length can be packed across ranks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import balanced, layouts, masks
from ..instruments import emulation, observe, timeline
from ..kernels.common import accumulation_dtype, window_band
from ..kernels import Kernel, as_kernel
from .llama3 import GatheredAttention, _gathered_kv, _head_groups, head_group_stride, reduce_scatter_shards
from .sinks import check_sink
from .varlen import Documents, prepare
from .window import check_window

#: The layouts llama3_varlen takes; the first is the default.
LAYOUTS = ("contiguous", balanced.NAME)

Tensor = torch.Tensor


class Pieces(NamedTuple):
    """This rank's kernel call: its local document pieces and the keys they attend.

    ``cu_q``: int32 offsets of the pieces within the local rows; ``keys``: the slice of the
    gathered row (rank-major: rank 0's rows, then rank 1's...) holding their keys, or int64
    indices into it (balanced layout); ``cu_k``: int32 offsets of each piece's keys within them.
    ``window``: the kernel's keywords, ``{"window": (L - 1, 0)}`` under a sliding window.
    """

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    keys: "slice | Tensor"
    window: dict = {}


def _window_keywords(window: int | None) -> dict:
    return {} if window is None else {"window": window_band(window)}


def local_pieces(offsets: list[int], rank: int, seqlen_local: int, causal: bool, device=None,
                 window: int | None = None) -> Pieces:
    """The pieces of the documents that intersect rank's rows, and each piece's keys.

    A piece of document ``[a, b)`` on rows ``[s, e)`` is ``[max(a, s), min(b, e))``; its keys
    are ``[a, min(b, e))`` when causal (the document up to the piece's last token) and
    ``[a, b)`` otherwise; under a window they start at ``max(a, max(a, s) - window + 1)``.
    Empty pieces are dropped.

    Args:
        offsets: the global document offsets, ending at ``seqlen_local * W``.
        rank, seqlen_local: this rank and its row count.
        causal: the mask.
        device: where the offset tensors live.
        window: keys each query sees under a causal sliding window, or ``None``.
    """
    start, end = rank * seqlen_local, (rank + 1) * seqlen_local
    q_lens, k_lens, first = [], [], None
    for a, b in zip(offsets, offsets[1:]):
        lo, hi = max(a, start), min(b, end)
        if hi <= lo:
            continue
        k0 = a if window is None else max(a, lo - window + 1)  # only the first piece can start later
        first = k0 if first is None else first
        q_lens.append(hi - lo)
        k_lens.append((hi if causal else b) - k0)
    cu_q, cu_k = [0], [0]
    for lq, lk in zip(q_lens, k_lens):
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    return Pieces(torch.tensor(cu_q, dtype=torch.int32, device=device),
                  torch.tensor(cu_k, dtype=torch.int32, device=device),
                  max(q_lens), max(k_lens), slice(first, first + cu_k[-1]), _window_keywords(window))


def balanced_pieces(offsets: list[int], rank: int, world_size: int, causal: bool, device=None,
                    window: int | None = None) -> Pieces:
    """:func:`local_pieces` for the balanced layout: the keys of each head or tail chunk, as
    indices into the rank-major gathered row.

    A chunk ``[x0, x1)`` of document ``[a, b)`` attends ``[a, a + x1)`` when causal
    (``[a + max(0, x0 - window + 1), a + x1)`` under a window) and ``[a, b)`` otherwise.
    """
    held = torch.cat([layouts.varlen_token_index(offsets, balanced.NAME, r, world_size, by_document=False)
                      for r in range(world_size)])
    rank_major = torch.empty_like(held)
    rank_major[held] = torch.arange(held.numel())
    q_lens, ranges = [], []
    for p in balanced.pieces(offsets, world_size)[rank]:
        k0 = 0 if window is None or not causal else max(0, p.start - window + 1)
        k1 = p.end if causal else offsets[p.doc + 1] - p.offset
        q_lens.append(p.end - p.start)
        ranges.append(torch.arange(p.offset + k0, p.offset + k1))
    cu_q, cu_k = [0], [0]
    for lq, keys in zip(q_lens, ranges):
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + keys.numel())
    return Pieces(torch.tensor(cu_q, dtype=torch.int32, device=device),
                  torch.tensor(cu_k, dtype=torch.int32, device=device),
                  max(q_lens), max(r.numel() for r in ranges), rank_major[torch.cat(ranges)].to(device),
                  _window_keywords(window))


def pieces_for(offsets: list[int], layout: str, rank: int, world_size: int, seqlen_local: int, causal: bool,
               device=None, window: int | None = None) -> Pieces:
    """This rank's kernel call in ``layout``: :func:`local_pieces` (contiguous) or :func:`balanced_pieces`."""
    if layout == balanced.NAME:
        return balanced_pieces(offsets, rank, world_size, causal, device=device, window=window)
    return local_pieces(offsets, rank, seqlen_local, causal, device=device, window=window)


def schedule(offsets: list[int], layout: str, causal: bool, rank: int, world_size: int, seqlen_local: int,
             kv_heads: int, stride: int, window: int | None = None) -> tuple[list[slice], Pieces]:
    """This rank's work, as :func:`llama3_varlen_attention` runs it: the head groups (K/V heads
    gathered together, one varlen kernel call each) and the :class:`Pieces` every one of those
    calls takes; public so that ``ringbench predict`` walks the schedule that runs (issue 24)."""
    return _head_groups(kv_heads, stride), pieces_for(offsets, layout, rank, world_size, seqlen_local, causal,
                                                      window=window)


def _keys(x: Tensor, keys) -> Tensor:
    return x[:, keys] if isinstance(keys, slice) else x.index_select(1, keys)


def _observe_dkv(seen, pieces: Pieces, heads: slice, dk: Tensor, dv: Tensor, seqlen_local: int, world_size: int):
    if isinstance(pieces.keys, slice):
        seen.gathered_dkv(layouts.every_rank_tokens("contiguous", seqlen_local * world_size, world_size, dk.device),
                          pieces.keys, heads, dk, dv)
        return
    # A key that several pieces attend is reported once, its partials summed in float64.
    rows, inverse = torch.unique(pieces.keys, return_inverse=True)
    summed = [torch.zeros((1, rows.numel(), *g.shape[2:]), dtype=torch.float64, device=g.device)
              .index_add_(1, inverse, g.double()) for g in (dk, dv)]
    for owner in range(world_size):
        sel = ((rows // seqlen_local) == owner).nonzero().flatten()
        if sel.numel():
            seen.dkv_block(owner, rows[sel] % seqlen_local, heads, summed[0].index_select(1, sel),
                           summed[1].index_select(1, sel))


def _forward(q, k, v, causal, scale, group, kernel, stride, pieces: Pieces):
    world_size = emulation.rank_and_size(group)[1]
    G = q.shape[2] // k.shape[2]
    out = q.new_empty(*q.shape[:3], v.shape[3])  # v's head dim (head_dim_v)
    lse = torch.empty(1, q.shape[2], q.shape[1], dtype=accumulation_dtype(q.dtype),
                      device=q.device)
    seen = observe.current()
    saved = []
    timeline.step("fwd", 0)  # a step is a head group (see llama3._forward)
    for i, (hs, kg, vg) in enumerate(_gathered_kv(k, v, group, world_size, stride, "contiguous")):
        qh = slice(hs.start * G, hs.stop * G)
        with timeline.span("kernel"):
            b_out, b_lse = kernel.forward_varlen(q[:, :, qh], _keys(kg, pieces.keys), _keys(vg, pieces.keys),
                                                 pieces.cu_q, pieces.cu_k, pieces.max_q, pieces.max_k,
                                                 causal and not pieces.window, scale, **pieces.window)
        if seen is not None:
            seen.forward_block(slice(None), qh, b_out, b_lse)
        saved.append((kg, vg))
        if qh == slice(0, q.shape[2]):  # one head group: the kernel's result is the output
            return b_out, b_lse, saved
        out[:, :, qh] = b_out
        lse[:, qh] = b_lse
        timeline.step("fwd", i + 1)
    return out, lse, saved


def _backward(dout, q, k, v, out, lse, saved, causal, scale, group, kernel, stride, pieces: Pieces):
    world_size = emulation.rank_and_size(group)[1]
    G = q.shape[2] // k.shape[2]
    acc = accumulation_dtype(q.dtype)
    dq = torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    seen = observe.current()
    for i, (hs, (kg, vg)) in enumerate(zip(_head_groups(k.shape[2], stride), saved)):
        timeline.step("bwd", i)
        qh = slice(hs.start * G, hs.stop * G)
        with timeline.span("kernel"):
            g = kernel.backward_varlen(dout[:, :, qh], q[:, :, qh], _keys(kg, pieces.keys), _keys(vg, pieces.keys),
                                       out[:, :, qh], lse[:, qh], pieces.cu_q, pieces.cu_k, pieces.max_q,
                                       pieces.max_k, causal and not pieces.window, scale, **pieces.window)
        if seen is not None:
            seen.dq_block(slice(None), qh, g[0])
            _observe_dkv(seen, pieces, hs, g[1], g[2], q.shape[1], world_size)
        whole = world_size == 1 and isinstance(pieces.keys, slice) and pieces.keys == slice(0, k.shape[1])
        if whole and qh == slice(0, q.shape[2]):
            return g  # one head group on the only rank: the kernel's gradients are the result
        dq[:, :, qh] = g[0]
        if whole:
            # This rank owns every key and the kernel's gradient is the whole sum: nothing to scatter.
            dk[:, :, hs], dv[:, :, hs] = g[1], g[2]
            continue
        for grad, local in ((g[1], dk), (g[2], dv)):
            # Reduce-scatter in float32: every rank's share of the key gradients to its owner.
            full = torch.zeros((1, kg.shape[1], *grad.shape[2:]), dtype=acc, device=k.device)
            if isinstance(pieces.keys, slice):
                full[:, pieces.keys] = grad
            else:  # balanced: keys attended by several pieces add up
                full.index_add_(1, pieces.keys, grad.to(acc))
            local[:, :, hs] = reduce_scatter_shards(full, "contiguous", group)
    return dq, dk, dv


def llama3_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                            softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                            kernel: Kernel | str = "auto", cu_seqlens: "Tensor | Documents | None" = None,
                            heads_k_stride: int | None = None, sink: Tensor | None = None,
                            layout: str = "contiguous", window: int | None = None,
                            mask: str | None = None) -> tuple[Tensor, Tensor]:
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
            Or the ``varlen.Documents`` that ``varlen.prepare`` made of them once per batch:
            then nothing is checked or built again, and nothing is read back from the device.
        heads_k_stride: K/V heads gathered at a time (default: all of them in one gather).
        sink: ``[Hq]`` sink logits, or ``None``, as in :func:`ring.ring_attention`.
        layout: ``contiguous`` (default): rows ``[rank*S/W, (rank+1)*S/W)``; ``balanced``: every
            document cut head-tail into 2W chunks (``layouts.shard_varlen(x, cu_seqlens,
            "balanced", rank, W, by_document=False)``), equal causal work per rank.
        window: a causal sliding window of this many keys within each document (query p sees
            keys p - window + 1 .. p), or ``None``.
        mask: any mask of ``masks.py``, applied inside each document (``masks.documents``): the
            calls are then the batch ``llama3``'s under the mask over the packed row
            (``masked.gathered_blocks``: the gathered key chunks the mask leaves, cross-document
            ones empty), over either layout; ``causal`` is ignored.

    Returns:
        ``out`` ``[1, S/W, Hq, D]`` in q's dtype; ``lse`` float32 ``[1, Hq, S/W]`` (float64 for
        float64 inputs), not differentiable.

    Raises:
        ValueError: (starting ``[rank r/W]``) no or an invalid cu_seqlens (see
            ``varlen.check_cu_seqlens``, run by ``varlen.prepare``), batch > 1, a kernel without a
            varlen form, a ``heads_k_stride`` outside 1..Hkv, an unknown layout, or a window that
            is not positive, without ``causal``, or on a kernel that takes none.
    """
    rank, world_size = emulation.rank_and_size(group)
    prefix = f"[rank {rank}/{world_size}]"
    if cu_seqlens is None:
        raise ValueError(f"{prefix} llama3_varlen takes packed documents and needs cu_seqlens, the global int32 "
                         "document offsets; pass cu_seqlens, or use the batch variant llama3")
    if q.shape[0] != 1:
        raise ValueError(f"{prefix} q has batch {q.shape[0]}, but llama3_varlen packs documents into one row; "
                         "pass [1, S/W, H, D] shards and the documents' cu_seqlens")
    if layout not in LAYOUTS:
        raise ValueError(f"{prefix} layout {layout!r} is not one llama3_varlen takes; choose one of "
                         f"{', '.join(LAYOUTS)}")
    check_window(window, causal, f"{prefix} ")
    if mask:
        return _masked(q, k, v, softmax_scale=softmax_scale, group=group, kernel=kernel, cu_seqlens=cu_seqlens,
                       heads_k_stride=heads_k_stride, sink=sink, layout=layout, window=window, mask=mask,
                       prefix=prefix)
    stride = head_group_stride(heads_k_stride, k.shape[2], prefix=f"{prefix} ")
    try:
        kernel = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                           varlen=True, window=window is not None)
    except ValueError as exc:
        raise ValueError(f"{prefix} {exc}") from None
    documents = prepare(cu_seqlens, q.shape[1], group)
    offsets = list(documents.offsets)
    pieces = documents.schedule(("llama3_varlen", layout, rank, world_size, causal, window, str(q.device)),
                                lambda: pieces_for(offsets, layout, rank, world_size, q.shape[1], causal,
                                                   device=q.device, window=window))
    if sink is not None:
        check_sink(sink, q.shape[2], f"{prefix} ")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return GatheredAttention.apply(q, k, v, sink, None, None, _forward, _backward, causal, scale, group, kernel, stride,
                                   pieces)


def _masked(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale, group, kernel, cu_seqlens, heads_k_stride, sink,
            layout: str, window, mask: str, prefix: str) -> tuple[Tensor, Tensor]:
    """llama3_varlen under a mask applied per document over the packed row (``masks.documents``), by the
    batch engine's gathered calls: the contiguous row is the batch ``llama3``'s contiguous one; the
    balanced row's local chunks (each document's head-tail pieces) meet the gathered row reordered to
    global order (``llama3.Rows``), cut in key chunks the mask classifies (``masked.gathered_blocks``)."""
    from . import llama3, masked

    rank, world_size = emulation.rank_and_size(group)
    documents = prepare(cu_seqlens, q.shape[1], group)
    built = masked.as_mask(mask, q.shape[1] * world_size, window=window, docs=documents.lengths,
                           prefix=f"{prefix} ")
    if layout == "contiguous":
        return llama3.llama3_attention(q, k, v, causal=False, softmax_scale=softmax_scale, group=group,
                                       kernel=kernel, heads_k_stride=heads_k_stride, layout="contiguous", sink=sink,
                                       mask=built)
    stride = head_group_stride(heads_k_stride, k.shape[2], prefix=f"{prefix} ")
    try:
        kernel = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                           mask=masks.label(built.text))
    except ValueError as exc:
        raise ValueError(f"{prefix} {exc}") from None
    rows = documents.schedule(("llama3_varlen", layout, rank, world_size, built, str(q.device), kernel.by_slices),
                              lambda: balanced_rows(list(documents.offsets), rank, world_size, built, q.device,
                                                    kernel.by_slices))
    if sink is not None:
        check_sink(sink, q.shape[2], f"{prefix} ")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return GatheredAttention.apply(q, k, v, sink, None, None, llama3._forward, llama3._backward, False, scale, group,
                                   kernel, stride, rows, None, built)


def balanced_rows(offsets: list[int], rank: int, world_size: int, mask, device=None, by_slices: bool = False):
    """The balanced layout's rows for the batch engine under ``mask`` (``llama3.Rows``): every rank's
    positions (``layouts.varlen_token_index``), the gathered row's order, and this rank's calls: its
    local runs of consecutive positions against the gathered row in key chunks of ``S / 2W``."""
    from . import llama3, masked

    total = offsets[-1]
    tokens = tuple(layouts.varlen_token_index(offsets, balanced.NAME, r, world_size, by_document=False,
                                              device=device) for r in range(world_size))
    order = torch.empty(total, dtype=torch.int64, device=device)
    order[torch.cat(tokens)] = torch.arange(total, device=device)
    held = tokens[rank].tolist()
    chunks, at = [], 0
    for i in range(1, len(held) + 1):
        if i == len(held) or held[i] != held[i - 1] + 1:
            chunks.append((slice(at, i), held[at], i - at))
            at = i
    calls = masked.gathered_blocks(mask, chunks, max(1, total // (2 * world_size)), total, device, by_slices)
    return llama3.Rows(tokens, order, tuple(calls))
