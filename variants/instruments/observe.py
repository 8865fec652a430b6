"""Observing a variant's own decomposition: every kernel call's result, with the rows it belongs to.

While an instrument context with an observation is open (``instruments.open(observe=True)``,
``context.py``), ringbench's engines (the ring engine of ``ring.py`` and the
all-gather engines of ``llama3.py`` and ``llama3_varlen.py``) report each local kernel call:

- forward: the local query rows and query heads of the call, and the block's out and lse
  exactly as the kernel returned them (out in the input dtype, lse float32);
- backward: the same query rows and heads with the block's dq; and the rank that owns the
  block's keys, the key rows in that owner's shard and the K/V heads, with the block's dk, dv.

That is enough to rebuild, on one device and in float64, what the variant computed from its
blocks (the harness's block-decomposition reference, ``ringbench/rank/check.py``): each block's
out and lse merged, dq partials summed, dK/dV partials summed at their owner. A correct
variant differs from that only by its float32 merge and one final rounding to the input dtype;
an accumulation in a lower precision stands out.

When no observation is open, :func:`current` is ``None`` and the engines report nothing: one
context-variable read per engine call, no copy, no extra work in a timed run. Peers (``torch_cp``,
``rfa_*``) run their own engines and report nothing, so an observation of one stays empty.
Observations do not nest.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import NamedTuple

import torch

from . import context

Tensor = torch.Tensor

class ForwardBlock(NamedTuple):
    """One forward kernel call: ``out [B, rows, heads, D]`` (input dtype) and ``lse [B, heads, rows]``."""

    rows: "slice | Tensor"
    heads: slice
    out: Tensor
    lse: Tensor


class QueryGrad(NamedTuple):
    """One backward kernel call's dq, ``[B, rows, heads, D]`` for local query rows and query heads."""

    rows: "slice | Tensor"
    heads: slice
    dq: Tensor


class KeyGrad(NamedTuple):
    """One backward kernel call's dk and dv ``[B, rows, heads, D]`` for the key rows ``rows`` of
    rank ``owner``'s shard and K/V heads ``heads``."""

    owner: int
    rows: "slice | Tensor"
    heads: slice
    dk: Tensor
    dv: Tensor


class Observation:
    """What the engines reported while its instrument context was open, in call order.

    Every tensor is a detached copy taken when it was reported, so later in-place updates of
    the engine's accumulators do not reach it.
    """

    def __init__(self) -> None:
        self.forward: list[ForwardBlock] = []
        self.dq: list[QueryGrad] = []
        self.dkv: list[KeyGrad] = []

    def __len__(self) -> int:
        return len(self.forward) + len(self.dq) + len(self.dkv)

    def forward_block(self, rows, heads: slice, out: Tensor, lse: Tensor) -> None:
        """Report one forward call: its local query rows and query heads, its out and lse."""
        self.forward.append(ForwardBlock(rows, heads, out.detach().clone(), lse.detach().clone()))

    def dq_block(self, rows, heads: slice, dq: Tensor) -> None:
        """Report one backward call's dq for local query rows ``rows`` and query heads ``heads``."""
        self.dq.append(QueryGrad(rows, heads, dq.detach().clone()))

    def dkv_block(self, owner: int, rows, heads: slice, dk: Tensor, dv: Tensor) -> None:
        """Report one backward call's dk and dv for rows ``rows`` of rank ``owner``'s K/V shard."""
        self.dkv.append(KeyGrad(owner, rows, heads, dk.detach().clone(), dv.detach().clone()))

    def gathered_dkv(self, owners_tokens: list[Tensor], keys: slice, heads: slice, dk: Tensor,
                     dv: Tensor) -> None:
        """Report dk and dv ``[B, keys, heads, D]`` computed against gathered K/V.

        ``keys`` is a range of global positions (in token order) of the gathered row, and
        ``owners_tokens[r]`` the global positions rank r holds, int64 ``[S/W]`` in its local order
        (``layouts.token_index``); the partials are split by the rank that owns each key and
        reported at its local rows.
        """
        for owner, tokens in enumerate(owners_tokens):
            local = ((tokens >= keys.start) & (tokens < keys.stop)).nonzero().flatten()
            if local.numel():
                picked = tokens[local] - keys.start
                self.dkv_block(owner, local, heads, dk.index_select(1, picked), dv.index_select(1, picked))


def current() -> Observation | None:
    """The observation open for the code running now, or ``None`` (the engines then report nothing)."""
    return context.current().observation


def hidden() -> contextlib.AbstractContextManager:
    """While the body runs, the observation open now is hidden, so the engines report nothing.

    For an engine that runs another engine on re-sharded tensors (ulysses and usp run the ring
    engine on head-sharded rows after an all-to-all): the inner engine's rows and heads are not
    the variant's own, so its reports would mislead the block-decomposition reference.
    """
    inst = context.current()
    if inst.observation is None:
        return contextlib.nullcontext()
    return context.nested(replace(inst, observation=None, inner=None))
