"""Striped ring attention: the ring engine over the stripe layout (token t on rank t mod W).

Local token i of rank r is global token ``i*W + r``. Against K/V from a rank s <= r, query i
sees keys j <= i (the usual causal mask); against K/V from a rank s > r it sees only j < i,
the causal mask shifted by one, which is the causal block of queries ``1:`` over keys ``:-1``.
Every rank does nearly the same work at every step.

Source: Brandon et al., "Striped Attention: Faster Ring Attention for Causal Transformers"
(2023).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import Kernel
from ..kernels.max_logit import MaxLogit
from ..kernels.common import Bias
from .ring import Block, run_ring

Tensor = torch.Tensor

_ALL = slice(None)


def stripe_plan(step: int, source: int, rank: int, world_size: int, seqlen_local: int,
                causal: bool) -> Block | None:
    """The stripe plan: causal against ranks at or below this one, shifted causal above."""
    if not causal:
        return Block(_ALL, _ALL, False)
    if source <= rank:
        return Block(_ALL, _ALL, True)
    if seqlen_local < 2:
        return None  # the one local query precedes every key of a higher rank
    return Block(slice(1, None), slice(0, seqlen_local - 1), True)


def stripe_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                     softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                     kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                     sink: Tensor | None = None, window: int | None = None,
                     mask: str | None = None, bias: Bias | None = None,
                     max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence, each rank holding every W-th token.

    Takes and returns what :func:`zigzag.zigzag_attention` does, in the stripe layout: q, k and
    v hold tokens ``rank, rank + W, rank + 2W, ...`` (``layouts.shard(x, "stripe", rank, W)``),
    so ``S % W == 0``, and out comes back in it; ``mask`` positions are global token positions, as
    in :func:`ring.ring_attention`.

    Raises:
        ValueError: ``cu_seqlens`` given, or shapes the kernel refuses.
    """
    if cu_seqlens is not None:
        raise ValueError("stripe is the batch form and takes no cu_seqlens")
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=stripe_plan, sink=sink, window=window, layout="stripe", mask=mask,
                    bias=bias, max_logit=max_logit)
