"""USP (Unified Sequence Parallelism): Ulysses inside groups of U ranks, a zigzag ring across them.

The W ranks form R = W / U ring groups on a 2-D grid (``grid.process_grid``). The sequence is
in the composed layout of ``layouts`` (``ulysses_degree=U``): zigzag over the R ring ranks,
each ring shard cut into U contiguous parts. The Ulysses all-to-all gives every rank its ring
shard whole for ``H / U`` heads; the zigzag ring (``zigzag.zigzag_plan`` through the ring
engine) runs over the ring group of the ranks holding the same heads; the second all-to-all
swaps back (``ulysses.run_ulysses``). U = W is Ulysses, U = 1 the zigzag ring.

Packed documents (``usp_varlen``): every document in the zigzag layout over the ring ranks on
its own, then the ring shard cut into U parts; the ring runs the zigzag varlen steps.

Source: Fang and Zhao, "USP: A Unified Sequence Parallelism Approach for Long Context
Generative AI" (arXiv 2405.07719), and its library yunchang, whose layout this is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..instruments import emulation
from ..rules import document_rule, resolve_ulysses_degree
from ..kernels.max_logit import MaxLogit
from ..kernels import Kernel
from ..kernels.common import Bias
from .ulysses import run_ulysses
from .zigzag import zigzag_plan

Tensor = torch.Tensor


def _degree(ulysses_degree: int | None, q: Tensor, k: Tensor, group) -> int:
    # The harness passes the degree it resolved; a direct caller may leave it to the default.
    return resolve_ulysses_degree(ulysses_degree, emulation.rank_and_size(group)[1], q.shape[2], k.shape[2])


def usp_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, softmax_scale: float | None = None,
                  group: dist.ProcessGroup | None = None, kernel: Kernel | str = "auto",
                  cu_seqlens: Tensor | None = None, ulysses_degree: int | None = None,
                  sink: Tensor | None = None, window: int | None = None,
                  mask: str | None = None, bias: Bias | None = None,
                  max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence by USP: Ulysses of degree U inside, a zigzag ring of W / U outside.

    Args:
        q: ``[B, S/W, Hq, D]`` in the composed layout
            (``layouts.shard(x, "zigzag", rank, W, ulysses_degree=U)``), ``S % (2W / U) == 0``
            and ``S % W == 0``; U divides Hq.
        k, v: ``[B, S/W, Hkv, D]`` in the same layout; U divides Hkv, or Hkv divides U (K/V
            heads replicated).
        causal, softmax_scale, group, kernel: as in :func:`ring.ring_attention`.
        cu_seqlens: not taken by this batch form; must be ``None``.
        ulysses_degree: U, a divisor of W (default: the largest the heads allow,
            ``variants.resolve_ulysses_degree``). The first call for a degree creates its
            process groups on every rank of ``group`` (``grid.process_grid``).
        sink: ``[Hq]`` float32 sink logits (``sinks.py``), or ``None``; differentiable.
        window: a causal sliding window of this many keys, taken by the zigzag ring
            (``ulysses.run_ulysses``); ``None``: none.
        mask: any mask over the global sequence (``masks.py``), taken by the zigzag ring over the
            ring shards' global positions (``ulysses.run_ulysses``); ``None``: none.
        bias: an attention bias (``kernels.common.Bias``), taken by the zigzag ring for this rank's
            heads (``ulysses.run_ulysses``); ``None``: none.
        max_logit: a ``kernels.max_logit.MaxLogit`` of ``[Hq]``, raised by the zigzag ring's calls
            for this rank's heads, then reduced (MAX) over the group (``ulysses.run_ulysses``); ``None``: none.

    Returns:
        ``out`` ``[B, S/W, Hq, D]`` in q's dtype and layout; ``lse`` float32 ``[B, Hq, S/W]``.

    Raises:
        ValueError: ``cu_seqlens`` given, or as ``ulysses.run_ulysses``.
    """
    if cu_seqlens is not None:
        raise ValueError("usp is the batch form and takes no cu_seqlens; use usp_varlen")
    return run_ulysses("usp", q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                       ulysses_degree=_degree(ulysses_degree, q, k, group), plan=zigzag_plan, sink=sink,
                       window=window, mask=mask, bias=bias, max_logit=max_logit)


def usp_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                         softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                         kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                         ulysses_degree: int | None = None, sink: Tensor | None = None,
                         window: int | None = None, mask: str | None = None) -> tuple[Tensor, Tensor]:
    """Attention inside each packed document by USP, each document zigzag over the ring ranks.

    Args:
        q: ``[1, S/W, Hq, D]`` (``layouts.shard_varlen(x, cu_seqlens, "zigzag", rank, W,
            by_document=True, ulysses_degree=U)``).
        k, v: ``[1, S/W, Hkv, D]`` in the same layout; heads as in :func:`usp_attention`.
        causal, softmax_scale, group, kernel, ulysses_degree, window: as in :func:`usp_attention`;
            the kernel needs a varlen form.
        mask: any mask of ``masks.py``, applied inside each document (``masks.documents``), as in
            ``ring_varlen.ring_varlen_attention``.
        cu_seqlens: int32 ``[N + 1]``, the GLOBAL document offsets, identical on every rank;
            every document a multiple of 2 * W / U (the harness asks 2 * W, as zigzag_varlen).

    Returns:
        ``out`` ``[1, S/W, Hq, D]`` in q's dtype and layout; ``lse`` float32 ``[1, Hq, S/W]``.

    Raises:
        ValueError: (starting ``[rank r/W]``) no or an invalid cu_seqlens, a document the ring
            cannot cut, or as ``ulysses.run_ulysses``.
    """
    if cu_seqlens is None:
        raise ValueError("usp_varlen takes packed documents and needs cu_seqlens, the global int32 document "
                         "offsets; pass cu_seqlens, or use the batch variant usp")
    return run_ulysses("usp_varlen", q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                       kernel=kernel, ulysses_degree=_degree(ulysses_degree, q, k, group), plan=zigzag_plan,
                       cu_seqlens=cu_seqlens, sink=sink, window=window, mask=mask,
                       ring_document_rule=lambda docs, ring: document_rule(docs, ring, "zigzag",
                                                                           "usp_varlen's ring"))
