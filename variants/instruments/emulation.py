"""One process playing one rank of a ring of any size: transfers become device copies (``run --emulate``).

While an instrument context with an emulation is open (``instruments.open(emulation=...)``,
``context.py``), the ring engine asks :func:`rank_and_size` for its rank and
world size, and :class:`comm.RingComm` hands its transfers to :meth:`Emulation.transfer`
instead of ``torch.distributed``. No process group is needed: the emulated rank runs its own
schedule alone, and what it would receive is copied on its device from the shards of every
rank, which the caller builds from the same seeds as a real run does.

What lands in a receive buffer:

- K/V blocks are exact. The ring is the same on every rank shifted by one, so when this rank
  sends the block that started on rank j, the rank it receives from (``prev_rank``, an offset
  of -1; +1 for a ring run the other way) sends the block of rank ``j - 1``, and that block's
  shard is what is copied. A block is known by the shard it is (its data pointer) or by the
  receive buffer it was copied into (kept by identity).
- Anything else (the dK/dV partial sums travelling the backward ring) depends on other ranks'
  work that has not run; the buffer gets a copy of what this rank sends instead: the same bytes
  and the same copy, not the ring's values. Forward outputs and dq are the ring's; dk and dv
  of an emulated run are not, so an emulated run measures compute and is never checked.

Only the ring's point-to-point exchange is emulated; collectives (the all-gather variants,
the varlen ``cu_seqlens`` check) are not, and the registry says which variants can run this way
(``Variant.emulates``).

Source: issue 15, item 8.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from . import context, timeline

Tensor = torch.Tensor


class Emulation:
    """Rank ``rank`` of an emulated ring of ``world_size`` ranks.

    Args:
        rank, world_size: the rank played and the ring's size.
        shards: per rank j, the tensors it starts with and sends around the ring, ``(k_j, v_j)``
            ``[B, S/W, Hkv, D]``; ``shards[rank]`` must be the very tensors the variant is called with.

    Raises:
        ValueError: ``shards`` not one entry per rank, or ``rank`` outside the ring.
    """

    def __init__(self, rank: int, world_size: int, shards: Sequence[Sequence[Tensor]]):
        if len(shards) != world_size or not 0 <= rank < world_size:
            raise ValueError(f"an emulated ring of {world_size} ranks needs one shard tuple per rank (got "
                             f"{len(shards)}) and a rank below {world_size} (got {rank})")
        self.rank, self.world_size = rank, world_size
        self.shards = [tuple(s) for s in shards]
        self._filled: dict[int, tuple[weakref.ref, int, int]] = {}

    def _origin(self, t: Tensor) -> tuple[int, int] | None:
        """(rank j, position in its shard tuple) of the block ``t`` holds, or None when it is no block."""
        seen = self._filled.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1], seen[2]
        for j, shard in enumerate(self.shards):
            for i, s in enumerate(shard):
                if t.data_ptr() == s.data_ptr() and t.shape == s.shape and t.dtype == s.dtype:
                    return j, i
        return None

    @timeline.timed("comm")
    def transfer(self, pairs: Sequence[tuple[Tensor, Tensor]], offset: int) -> list:
        """Fill every receive buffer of ``pairs`` ``(send, recv)`` as the ring would (module docstring).

        Args:
            pairs: the batch's sends and the buffers their receives fill, matching shapes and dtypes.
            offset: the rank received from, minus this rank (-1 for the forward ring).

        Returns:
            ``[]``: nothing is in flight afterwards, so the communicator's wait has nothing to wait for.
        """
        for send, recv in pairs:
            origin = self._origin(send)
            if origin is None:
                recv.copy_(send)
                continue
            j = (origin[0] + offset) % self.world_size
            recv.copy_(self.shards[j][origin[1]])
            self._filled[id(recv)] = (weakref.ref(recv), j, origin[1])
        return []


def current() -> Emulation | None:
    """The emulation open for the code running now, or ``None`` (a real distributed run)."""
    return context.current().emulation


def rank_and_size(group=None) -> tuple[int, int]:
    """This rank and the ring's size: the emulated ones while an emulation is open, else ``group``'s."""
    emulated = context.current().emulation
    if emulated is not None:
        return emulated.rank, emulated.world_size
    return dist.get_rank(group), dist.get_world_size(group)
