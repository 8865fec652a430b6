"""Ring and zigzag attention over packed documents (varlen), document by document.

Every document is sharded in the variant's layout on its own (``layouts``, "by document"):
``ring_varlen`` gives rank r chunk r of every document, ``zigzag_varlen`` chunks r and 2W-1-r
of every document. Each rank then holds ``L / W`` tokens of every document of length L, in
document order, so the visiting K/V block has the same local documents as the local queries,
and each step of the ring is the batch variant's step applied to every document at once:
one varlen kernel call over the documents' pieces (``ring.VarlenSteps``). Causal work stays
as balanced as in the batch form: zigzag gives every rank the same work at every step.

Rules: every document's length must be a multiple of W (``ring_varlen``) or 2W
(``zigzag_varlen``); ``llama3_varlen`` takes any lengths.

Source: ring-flash-attn's ``ring_flash_attn_varlen_func`` and
``zigzag_ring_flash_attn_varlen_func`` (zhuzilin/ring-flash-attention), which shard each
document the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..instruments import emulation
from ..rules import document_rule
from ..kernels import Kernel
from .ring import Plan, VarlenSteps, contiguous_plan, run_ring
from .varlen import Documents, prepare
from .zigzag import zigzag_plan

Tensor = torch.Tensor


def _run(name: str, layout: str, plan: Plan, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
         softmax_scale: float | None, group, kernel, cu_seqlens: Tensor | None,
         sink: Tensor | None, window: int | None = None, mask: "str | None" = None) -> tuple[Tensor, Tensor]:
    rank, world_size = emulation.rank_and_size(group)
    prefix = f"[rank {rank}/{world_size}]"
    if cu_seqlens is None:
        raise ValueError(f"{prefix} {name} takes packed documents and needs cu_seqlens, the global int32 "
                         f"document offsets; pass cu_seqlens, or use the batch variant {name[:-len('_varlen')]}")
    if q.shape[0] != 1:
        raise ValueError(f"{prefix} q has batch {q.shape[0]}, but {name} packs documents into one row; "
                         "pass [1, S/W, H, D] shards and the documents' cu_seqlens")
    documents = prepare(cu_seqlens, q.shape[1], group)
    docs = documents.lengths
    reason = document_rule(docs, world_size, layout, name)
    if reason:
        raise ValueError(f"{prefix} {reason}")
    lengths = [d // world_size for d in docs]
    if mask:  # per document over the packed row; its steps are masked.ring_steps', kept there
        return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel, plan=plan,
                        doc_lengths=lengths, sink=sink, window=window, layout=layout, mask=mask)
    steps = None if window is not None else documents.schedule(  # a window builds its own steps
        (name, rank, world_size, causal, str(q.device)),
        lambda: VarlenSteps(plan, lengths, rank, world_size, causal, q.device))
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=plan, doc_lengths=lengths, steps=steps, sink=sink, window=window, layout=layout)


def ring_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                          softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                          kernel: Kernel | str = "auto", cu_seqlens: "Tensor | Documents | None" = None,
                          sink: Tensor | None = None, window: int | None = None,
                          mask: str | None = None) -> tuple[Tensor, Tensor]:
    """Attention inside each packed document, each rank holding chunk ``rank`` of every document.

    Args:
        q: ``[1, S/W, Hq, D]``: this rank's chunk of every document, in document order
            (``layouts.shard_varlen(x, cu_seqlens, "contiguous", rank, W, by_document=True)``).
        k, v: ``[1, S/W, Hkv, D]`` in the same layout, ``Hq % Hkv == 0``.
        causal, softmax_scale, group, kernel: as in :func:`llama3_varlen.llama3_varlen_attention`.
        cu_seqlens: as there, but every document length a multiple of W.
        sink: ``[Hq]`` sink logits, or ``None``, as in :func:`ring.ring_attention`.
        window: a causal sliding window of this many keys within each document, as in
            :func:`ring.ring_attention`.
        mask: any mask of ``masks.py`` (``prefix:512``, ``chunked:8k``...), applied inside each
            document, its positions re-based to 0 (``masks.documents``; a ``slices:`` text is
            absolute over the packed row, cut at the document boundaries); blocks it leaves empty,
            every cross-document one among them, make no kernel call; ``causal`` is then ignored.

    Returns:
        ``out`` ``[1, S/W, Hq, D]`` in q's dtype and layout, differentiable; ``lse`` float32
        ``[1, Hq, S/W]`` (float64 for float64 inputs), not differentiable.

    Raises:
        ValueError: (starting ``[rank r/W]``) no or an invalid cu_seqlens (see
            ``varlen.check_cu_seqlens``, run by ``varlen.prepare``), batch > 1, a document length that is not a multiple of
            W (the message names the first), or a kernel without a varlen form.
    """
    return _run("ring_varlen", "contiguous", contiguous_plan, q, k, v, causal=causal, softmax_scale=softmax_scale,
                group=group, kernel=kernel, cu_seqlens=cu_seqlens, sink=sink, window=window, mask=mask)


def zigzag_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                            softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                            kernel: Kernel | str = "auto", cu_seqlens: "Tensor | Documents | None" = None,
                            sink: Tensor | None = None, window: int | None = None,
                          mask: str | None = None) -> tuple[Tensor, Tensor]:
    """Attention inside each packed document, each document in the zigzag layout.

    Args:
        q: ``[1, S/W, Hq, D]``: for every document in order, its chunk ``rank`` then its chunk
            ``2W-1-rank`` of 2W (``layouts.shard_varlen(x, cu_seqlens, "zigzag", rank, W,
            by_document=True)``).
        k, v: ``[1, S/W, Hkv, D]`` in the same layout, ``Hq % Hkv == 0``.
        causal, softmax_scale, group, kernel: as in :func:`ring_varlen_attention`.
        cu_seqlens: int32 ``[N + 1]``, the GLOBAL document offsets, identical on every rank;
            every document length a multiple of 2W.
        sink, window, mask: as in :func:`ring_varlen_attention`.

    Returns:
        ``out`` ``[1, S/W, Hq, D]`` in q's dtype and layout; ``lse`` float32 ``[1, Hq, S/W]``.

    Raises:
        ValueError: as :func:`ring_varlen_attention`, with 2W in the document rule.
    """
    return _run("zigzag_varlen", "zigzag", zigzag_plan, q, k, v, causal=causal, softmax_scale=softmax_scale,
                group=group, kernel=kernel, cu_seqlens=cu_seqlens, sink=sink, window=window, mask=mask)
