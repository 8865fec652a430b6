"""Observing a variant's own decomposition: every kernel call's result, with the rows it belongs to.

While an instrument context with an observation is open (``instruments.open(observe=True)``,
``context.py``), ringbench's engines (the ring engine of ``ring.py``, the all-gather engines
of ``llama3.py`` and ``llama3_varlen.py``, and through the ring engine the Ulysses engine of
``ulysses.py``) report each local kernel call:

- forward: the rank that owns the call's queries (by default the calling rank), the query
  rows in that owner's shard and the query heads of the call, and the block's out and lse
  exactly as the kernel returned them (out in the input dtype, lse float32);
- backward: the same query rows and heads with the block's dq; and the rank that owns the
  block's keys, the key rows in that owner's shard and the K/V heads, with the block's dk, dv.

The Ulysses engine runs the ring engine on head-sharded rows, whose rows are those of every
rank of its Ulysses group: :func:`regrid` translates the ring's reports into the ranks, rows
and heads of the variant's own shards, so the reference sees every variant in one coordinate
system.

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
    """One forward kernel call: ``out [B, rows, heads, D]`` (input dtype) and ``lse [B, heads, rows]``
    for the query rows ``rows`` of rank ``owner``'s shard (``None``: the reporting rank's)."""

    rows: "slice | Tensor"
    heads: slice
    out: Tensor
    lse: Tensor
    owner: int | None = None


class QueryGrad(NamedTuple):
    """One backward kernel call's dq, ``[B, rows, heads, D]`` for the query rows ``rows`` of rank
    ``owner``'s shard (``None``: the reporting rank's) and query heads ``heads``."""

    rows: "slice | Tensor"
    heads: slice
    dq: Tensor
    owner: int | None = None


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

    def forward_block(self, rows, heads: slice, out: Tensor, lse: Tensor, owner: int | None = None) -> None:
        """Report one forward call: its query rows (of rank ``owner``'s shard; ``None``: this
        rank's) and query heads, its out and lse."""
        self.forward.append(ForwardBlock(rows, heads, out.detach().clone(), lse.detach().clone(), owner))

    def dq_block(self, rows, heads: slice, dq: Tensor, owner: int | None = None) -> None:
        """Report one backward call's dq for query rows ``rows`` (of rank ``owner``'s shard;
        ``None``: this rank's) and query heads ``heads``."""
        self.dq.append(QueryGrad(rows, heads, dq.detach().clone(), owner))

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


def current() -> "Observation | Regridded | None":
    """The observation open for the code running now (seen through :func:`regrid` inside the
    Ulysses engine), or ``None`` (the engines then report nothing)."""
    return context.current().observation


def _within(outer: slice, inner: slice) -> slice:
    """The heads ``inner`` (a slice of the ``outer`` ones) as a slice of every head."""
    picked = range(outer.start, outer.stop)[inner]
    return slice(picked.start, picked.stop)


class Regridded:
    """An observation seen through an all-to-all: reports of the ring engine run over the ring
    group on head-sharded rows (``ulysses.py``), passed to ``outer`` in the ranks, rows and
    heads of the variant's own shards.

    The ring shard of ring rank rho is the concatenation of the shards of the U ranks
    ``rho * U + j`` (j = 0 .. U - 1) of its Ulysses group, ``rows_per_rank`` rows each
    (``grid.py``'s numbering; ``seq_to_heads`` puts part j first to last). A reported row i
    of it is row ``i % rows_per_rank`` of rank ``rho * U + i // rows_per_rank``; its heads are
    those of ``q_heads`` (queries) or ``kv_heads`` (K/V, the original heads where the engine
    replicated them).
    """

    def __init__(self, outer: Observation, *, ulysses_degree: int, ring_rank: int, rows_per_rank: int,
                 q_heads: slice, kv_heads: slice) -> None:
        self.outer, self.degree, self.ring_rank, self.rows = outer, ulysses_degree, ring_rank, rows_per_rank
        self.q_heads, self.kv_heads = q_heads, kv_heads

    def _parts(self, ring_rank: int, rows):
        """``(owner, rows of the owner's shard, positions in the block)`` for each rank the rows cover."""
        n = self.degree * self.rows
        idx = torch.arange(n)[rows] if isinstance(rows, slice) else rows.to("cpu", torch.int64)
        part = idx // self.rows
        for j in range(self.degree):
            at = (part == j).nonzero().flatten()
            if at.numel():
                yield ring_rank * self.degree + j, idx[at] - j * self.rows, at

    def forward_block(self, rows, heads: slice, out: Tensor, lse: Tensor, owner: int | None = None) -> None:
        ring_rank = self.ring_rank if owner is None else owner
        for who, local, at in self._parts(ring_rank, rows):
            at = at.to(out.device)
            self.outer.forward_block(local, _within(self.q_heads, heads), out.index_select(1, at),
                                     lse.index_select(2, at), who)

    def dq_block(self, rows, heads: slice, dq: Tensor, owner: int | None = None) -> None:
        ring_rank = self.ring_rank if owner is None else owner
        for who, local, at in self._parts(ring_rank, rows):
            self.outer.dq_block(local, _within(self.q_heads, heads), dq.index_select(1, at.to(dq.device)), who)

    def dkv_block(self, owner: int, rows, heads: slice, dk: Tensor, dv: Tensor) -> None:
        for who, local, at in self._parts(owner, rows):
            at = at.to(dk.device)
            self.outer.dkv_block(who, local, _within(self.kv_heads, heads), dk.index_select(1, at),
                                 dv.index_select(1, at))


def regrid(*, ulysses_degree: int, ring_rank: int, rows_per_rank: int, q_heads: slice,
           kv_heads: slice) -> contextlib.AbstractContextManager:
    """While the body runs, the engines report to the observation open now through
    :class:`Regridded` (its arguments), or to nothing where none is open.

    For the Ulysses engine, which runs the ring engine on the head-sharded rows of its ring
    group after an all-to-all: the ring's rows and heads are not the variant's own, so they are
    translated to the ranks, rows and heads of its shards before they reach the
    block-decomposition reference.
    """
    inst = context.current()
    if inst.observation is None:
        return contextlib.nullcontext()
    seen = Regridded(inst.observation, ulysses_degree=ulysses_degree, ring_rank=ring_rank,
                     rows_per_rank=rows_per_rank, q_heads=q_heads, kv_heads=kv_heads)
    return context.nested(replace(inst, observation=seen, inner=None))
