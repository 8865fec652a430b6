"""Zigzag ring attention: the ring engine over the zigzag layout, balanced under a causal mask.

Rank r holds chunks r and 2W-1-r of 2W. Against a K/V block from an earlier rank, both local
query chunks see only the block's first chunk; against a block from a later rank, only the
second local query chunk sees it, whole. Every rank does the same work at every step.

Source: the zigzag layout of the ring-flash-attn package's zigzag ring attention, which
PyTorch's context parallel calls head-tail load balancing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.max_logit import MaxLogit
from ..kernels import Kernel
from ..kernels.common import Bias
from .ring import Block, run_ring

Tensor = torch.Tensor

_ALL = slice(None)


def zigzag_plan(step: int, source: int, rank: int, world_size: int, seqlen_local: int,
                causal: bool) -> Block | None:
    """The zigzag plan: diagonal causal, earlier ranks' first chunk, later ranks to the second half."""
    if not causal:
        return Block(_ALL, _ALL, False)
    if step == 0:
        return Block(_ALL, _ALL, True)
    half = seqlen_local // 2
    if source < rank:
        return Block(_ALL, slice(0, half), False)
    return Block(slice(half, None), _ALL, False)


def zigzag_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                     softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                     kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                     sink: Tensor | None = None, window: int | None = None,
                     mask: str | None = None, bias: Bias | None = None,
                     max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence, each rank holding its two zigzag chunks.

    Args:
        q: ``[B, S/W, Hq, D]``: chunk ``rank`` then chunk ``2W-1-rank`` of 2W equal chunks
            (``layouts.shard(x, "zigzag", rank, W)``), so ``S % (2W) == 0``.
        k, v: ``[B, S/W, Hkv, D]`` in the same layout, ``Hq % Hkv == 0``.
        causal, softmax_scale, group, kernel: as in :func:`ring.ring_attention`.
        cu_seqlens: not taken by this batch form; must be ``None``.
        sink: ``[Hq]`` sink logits, or ``None``, as in :func:`ring.ring_attention`.
        window: a causal sliding window of this many keys, as in :func:`ring.ring_attention`.
        mask: any mask over the global sequence (``masks.py``), as in :func:`ring.ring_attention`.
        bias: an attention bias (``kernels.common.Bias``), or ``None``, as in :func:`ring.ring_attention`.
        max_logit: a ``kernels.max_logit.MaxLogit`` of ``[Hq]``, or ``None``, as in :func:`ring.ring_attention`.

    Returns:
        ``out`` ``[B, S/W, Hq, D]`` in q's dtype, in the zigzag layout; ``lse`` float32
        ``[B, Hq, S/W]``, not differentiable.

    Raises:
        ValueError: an odd local length, ``cu_seqlens`` given, or shapes the kernel refuses.
    """
    if cu_seqlens is not None:
        raise ValueError("zigzag is the batch form and takes no cu_seqlens; use zigzag_varlen")
    if q.shape[1] % 2:
        raise ValueError(f"local seqlen {q.shape[1]} is odd; the zigzag layout gives every rank two "
                         "equal chunks, so seqlen must be a multiple of 2 * world_size")
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=zigzag_plan, sink=sink, window=window, layout="zigzag", mask=mask,
                    bias=bias, max_logit=max_logit)
