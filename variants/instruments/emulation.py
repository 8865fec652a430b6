"""One process playing one rank of a group of any size, every transfer a device copy (``run --emulate``).

While an instrument context with an emulation is open (``instruments.open(emulation=...)``,
``context.py``), the engines ask :func:`rank_and_size` for their rank and group size, and
ringbench's communicators (``engines/comm.py``: the ring's :class:`RingComm`, the all-gather,
reduce-scatter, all-reduce and all-to-all helpers, the process groups of the Ulysses-ring grid)
hand their work to the :class:`Emulation` instead of ``torch.distributed``. No process group is
needed: the emulated rank runs its own code alone, the engines' code as it runs for real, and
what it would receive is copied on its device from the tensors every rank starts with, which
the caller draws from the same seeds as a real run does.

The code is the same on every rank (SPMD), so what rank p holds at a point of it is known
wherever it depends on the starting tensors alone. The emulation tracks such tensors as
*families*: one tensor per rank, each rank's computable on demand. A family is

- a starting tensor (``shards[p][i]``, such as rank p's k),
- a strided view of a family member (the same view of every rank's: ``k[:, :, heads]``),
- the result of an emulated all-to-all of views of families (the Ulysses exchange: rank p's
  result is what the members of p's group send p, concatenated), or
- a ring receive buffer, which holds the family member of the rank the block started on.

A tensor is known by its storage (the data pointer of its base) and the base's version
counter, so a buffer written after it was filled is no longer taken for what it held.

What lands where:

- **Exact** (the values a real run has): the ring's K/V blocks (the ring is the same on every
  rank shifted by one, so the block rank ``p = rank + offset`` sends is the family member of the
  rank one further on); an all-gather of a view of a family (every rank's view, in group order:
  llama3's K/V); an all-to-all of views of families (Ulysses' q/k/v, and dout where autograd
  hands the backward the starting tensor); the ring over an all-to-all's result (usp); the
  varlen ``cu_seqlens`` check's all-gather, since every emulated rank is given the same offsets.
- **Same-size copies** (the bytes and the copy, not the values): anything that depends on work
  of ranks that have not run. The ring's dK/dV partial sums get what this rank sends; a
  reduce-scatter (llama3's dK/dV) this rank's own part of its input; an all-to-all of computed
  tensors (Ulysses' output, lse and gradients) what this rank sends, in the shape it would
  receive; an all-reduce (a learnable sink's gradient) leaves this rank's own term.

So every kernel call of the forward sees the real run's inputs. The ring's and the all-gather
engines' outputs (and dq) are the real run's; Ulysses and USP compute their head-sharded
result exactly, but the all-to-all back copies, so emulated rank g's head block j holds what
real rank j's head block g does (``tests/test_emulation.py`` puts them back). Gradients summed
across ranks (dK/dV, d sink) are not the real run's: an emulated run measures compute and is
never checked.

Bytes are counted as a real run counts them (``traffic.py``'s rules, with the emulated group's
size), and each emulated transfer is one ``comm`` span in ``--profile``. On CUDA the ring's copies run
on a side stream and overlap the compute issued before the communicator waits, as NCCL's transfers
do (:meth:`Emulation.transfer`), so its ``comm`` spans are the exposed waits; the collectives' copies
are made in line and each is the span of its copies.

Source: issue 15, item 8 (the ring); issue 25, item 3 (the collectives, every engine).
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from . import context, timeline

Tensor = torch.Tensor


class Group:
    """An emulated process group: ``ranks``, its members' global ranks in group order, and
    ``of[r]``, the group of global rank r among every group of the split it was made in."""

    __slots__ = ("ranks", "of")

    def __init__(self, ranks: tuple[int, ...], of: dict[int, "Group"]):
        self.ranks, self.of = ranks, of

    def __repr__(self) -> str:
        return f"emulation.Group{self.ranks}"


class Done:
    """The handle of an emulated ``async_op=True`` collective: its copies are made, so ``wait`` has nothing to do."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Copied:
    """The handle of emulated ring transfers copied on the emulation's side stream: ``wait`` makes
    the current stream wait for them, as a real NCCL request's does. It holds the transfers'
    tensors until then, so the caching allocator cannot hand their memory out while the copies
    may still read or write it."""

    def __init__(self, done, tensors: list[Tensor]):
        self.done, self.tensors = done, tensors

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self.done)
        self.tensors = []
        return True


# --------------------------------------------------------------------------- families

class _Family:
    """One tensor per rank at one point of the code; :meth:`version` is rank p's."""

    def version(self, p: int) -> Tensor:
        raise NotImplementedError

    def fill(self, p: int, out: Tensor) -> None:
        """Write rank p's tensor into ``out`` (its shape)."""
        out.copy_(self.version(p))


class _Start(_Family):
    """Position ``i`` of every rank's starting tensors."""

    def __init__(self, shards: list[tuple[Tensor, ...]], i: int):
        self.shards, self.i = shards, i

    def version(self, p: int) -> Tensor:
        return self.shards[p][self.i]


class _View(_Family):
    """The same strided view of every rank's member of ``base`` (storage offsets relative to it)."""

    def __init__(self, base: _Family, size, stride, offset: int, like: Tensor):
        self.base, self.size, self.stride, self.offset = base, tuple(size), tuple(stride), offset
        self.like = (tuple(like.shape), like.stride())

    def version(self, p: int) -> Tensor:
        whole = self.base.version(p)
        if (tuple(whole.shape), whole.stride()) != self.like:
            raise RuntimeError(f"rank {p}'s tensor {tuple(whole.shape)} {whole.stride()} is not laid out as this "
                               f"rank's {self.like[0]} {self.like[1]}; an emulation needs every rank's alike")
        return whole.as_strided(self.size, self.stride, whole.storage_offset() + self.offset)


class _Exchanged(_Family):
    """The result of an all-to-all in which every rank sent ``parts[u]`` (a family each) to
    rank u of its group, concatenated along ``dim`` in group order."""

    def __init__(self, parts: list[_Family], dim: int, group: Group):
        self.parts, self.dim, self.group = parts, dim, group

    def _pieces(self, p: int) -> list[Tensor]:
        members = self.group.of[p].ranks
        u = members.index(p)
        return [self.parts[u].version(m) for m in members]

    def version(self, p: int) -> Tensor:
        return torch.cat(self._pieces(p), self.dim)

    def fill(self, p: int, out: Tensor) -> None:
        torch.cat(self._pieces(p), self.dim, out=out)


def _span(t: Tensor) -> int:
    """Elements of storage from ``t``'s first to its last, inclusive."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


# --------------------------------------------------------------------------- the emulation

class Emulation:
    """Rank ``rank`` of an emulated context-parallel group of ``world_size`` ranks.

    Args:
        rank, world_size: the rank played and the group's size.
        shards: per rank p, the tensors it starts with, in the same order on every rank (the
            harness gives ``(q, k, v, dout)``, ``ringbench/rank/bench.py``'s ``rank_inputs``; the
            ring needs ``(k, v)`` at least); ``shards[rank]`` must be the very tensors the
            variant is called with, every rank's of the same shape and strides.

    Raises:
        ValueError: ``shards`` not one entry per rank, or ``rank`` outside the group.
    """

    def __init__(self, rank: int, world_size: int, shards: Sequence[Sequence[Tensor]]):
        if len(shards) != world_size or not 0 <= rank < world_size:
            raise ValueError(f"an emulated group of {world_size} ranks needs one shard tuple per rank (got "
                             f"{len(shards)}) and a rank below {world_size} (got {rank})")
        self.rank, self.world_size = rank, world_size
        self.shards = [tuple(s) for s in shards]
        self._splits: dict[tuple, dict[int, Group]] = {}
        self._streams: dict[torch.device, object] = {}  # per CUDA device: the side stream of the ring's copies
        self.world = self.group([range(world_size)], rank)
        # storage data pointer -> [(weakref to a base tensor, its version, family, holder)]
        self._held: dict[int, list[tuple[weakref.ref, int, _Family, int]]] = {}
        for p, shard in enumerate(self.shards):
            for i, t in enumerate(shard):
                self._remember(t, _Start(self.shards, i), p)

    # ------------------------------------------------------------------ groups

    def group(self, split: Sequence[Sequence[int]], member: int) -> Group:
        """The group of global rank ``member`` in ``split`` (every group of one split, as global
        ranks); the same object every time for the same split."""
        key = tuple(tuple(part) for part in split)
        of = self._splits.get(key)
        if of is None:
            of = self._splits[key] = {}
            for part in key:
                g = Group(part, of)
                for r in part:
                    of[r] = g
        return of[member]

    def members(self, group) -> Group:
        """``group`` as an emulated group: ``None`` is the whole emulated world.

        Raises:
            RuntimeError: a group this emulation did not make (a real process group).
        """
        if group is None:
            return self.world
        if isinstance(group, Group):
            return group
        raise RuntimeError(f"an emulated rank runs over group None (its world) or the groups its emulation made "
                           f"(comm.new_group), not {group!r}; pass group=None under an emulation")

    # ------------------------------------------------------------------ what a tensor holds

    def _remember(self, t: Tensor, family: _Family, holder: int) -> None:
        """``t`` (whole) holds ``family``'s member of rank ``holder``, as of now."""
        ptr = t.untyped_storage().data_ptr()
        entries = self._held.setdefault(ptr, [])
        entries[:] = [e for e in entries if e[0]() is not None and e[0]() is not t]

        def forget(ref, ptr=ptr, owner=weakref.ref(self)):  # the base is gone: so is what it held
            emulation = owner()
            table = emulation._held if emulation is not None else {}
            if ptr in table:
                table[ptr] = [e for e in table[ptr] if e[0] is not ref]
                if not table[ptr]:
                    del table[ptr]

        entries.append((weakref.ref(t, forget), t._version, family, holder))

    def holding(self, t: Tensor) -> tuple[_Family, int] | None:
        """``(family, holder)``: ``t`` holds the member of rank ``holder`` of ``family`` (a view of
        a tensor that does), or ``None`` when the emulation does not know what ``t`` holds."""
        for ref, version, family, holder in self._held.get(t.untyped_storage().data_ptr(), ()):
            base = ref()
            if base is None or base._version != version or base.dtype != t.dtype or base.device != t.device:
                continue
            first = t.storage_offset() - base.storage_offset()
            if first < 0 or first + _span(t) > _span(base):
                continue
            if t.shape == base.shape and t.stride() == base.stride() and first == 0:
                return family, holder
            return _View(family, t.shape, t.stride(), first, base), holder
        return None

    def _own(self, t: Tensor) -> _Family | None:
        """The family of which ``t`` is this rank's own member, or ``None``."""
        held = self.holding(t)
        return held[0] if held is not None and held[1] == self.rank else None

    # ------------------------------------------------------------------ the transfers

    @timeline.timed("comm")
    @torch.no_grad()
    def transfer(self, pairs: Sequence[tuple[Tensor, Tensor]], offset: int, group=None) -> list:
        """Fill every receive buffer of ``pairs`` ``(send, recv)`` as the ring would (module docstring).

        On CUDA the copies run on a side stream of this emulation, after the work queued so far
        on the current stream, and the returned handle's ``wait`` joins them back: compute issued
        between the communicator's commit and wait overlaps them, as it overlaps NCCL's transfers
        in a real run (the copies still share the device's memory bandwidth and SMs with it).
        On CPU they are made at once.

        Args:
            pairs: the batch's sends and the buffers their receives fill, matching shapes and dtypes.
            offset: the rank received from, minus this rank, in group ranks (-1 for the forward ring).
            group: the ring's group (``None``: the world).

        Returns:
            The handles the communicator waits on: ``[]`` on CPU, one on CUDA.
        """
        ranks = self.members(group).ranks
        if not pairs or pairs[0][1].device.type != "cuda":
            self._fill(pairs, offset, ranks)
            return []
        side = self._side_stream(pairs[0][1].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._fill(pairs, offset, ranks)
            done = torch.cuda.Event()
            done.record(side)
        return [_Copied(done, [t for pair in pairs for t in pair])]

    def _fill(self, pairs, offset: int, ranks: tuple[int, ...]) -> None:
        for send, recv in pairs:
            held = self.holding(send)
            if held is None or held[1] not in ranks:
                recv.copy_(send)
                continue
            family, holder = held
            source = ranks[(ranks.index(holder) + offset) % len(ranks)]
            family.fill(source, recv)
            self._remember(recv, family, source)

    def _side_stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    @timeline.timed("comm")
    @torch.no_grad()
    def all_gather_into_tensor(self, output: Tensor, input: Tensor, group=None, async_op: bool = False):
        """``output`` (``[n * B, ...]``, the group's n shards along dim 0) gets every member's
        ``input``: exact for a view of a family, else n copies of ``input``."""
        ranks = self.members(group).ranks
        family, chunks = self._own(input), output.view(len(ranks), *input.shape)
        for chunk, p in zip(chunks, ranks):
            if family is None:
                chunk.copy_(input)
            else:
                family.fill(p, chunk)
        return Done()

    @timeline.timed("comm")
    @torch.no_grad()
    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor, group=None, async_op: bool = False):
        """``tensor_list[i]`` gets member i's ``tensor``: exact for a view of a family, else a copy
        of ``tensor`` (exact where every rank holds the same values, as the ``cu_seqlens`` check)."""
        family = self._own(tensor)
        for part, p in zip(tensor_list, self.members(group).ranks):
            if family is None:
                part.copy_(tensor)
            else:
                family.fill(p, part)
        return Done()

    @timeline.timed("comm")
    @torch.no_grad()
    def reduce_scatter_tensor(self, output: Tensor, input: Tensor, group=None, async_op: bool = False):
        """``output`` gets this rank's own part of ``input`` (the group's n parts along dim 0):
        the same size as the sum over the group, not its value."""
        g = self.members(group)
        output.copy_(input.reshape(len(g.ranks), *output.shape)[g.ranks.index(self.rank)])
        return Done()

    @timeline.timed("comm")
    @torch.no_grad()
    def all_reduce(self, tensor: Tensor, group=None, async_op: bool = False):
        """``tensor`` keeps this rank's own term, standing for the sum over the group."""
        self.members(group)
        return Done()

    @timeline.timed("comm")
    @torch.no_grad()
    def all_to_all(self, parts: Sequence[Tensor], dim: int, group=None) -> Tensor:
        """What the group's ranks send this one when each sends its ``parts[u]`` to rank u,
        concatenated along ``dim`` in group order (``comm.all_to_all``).

        Exact when every part is a view of a family of this rank's (the result is then known on
        every rank, and tracked); else ``torch.cat(parts, dim)``: what this rank sends, in the
        shape it would receive.
        """
        g = self.members(group)
        families = [self._own(p) for p in parts]
        if any(f is None for f in families):
            return torch.cat(list(parts), dim)
        family = _Exchanged(families, dim, g)
        out = family.version(self.rank)
        self._remember(out, family, self.rank)
        return out


def current() -> Emulation | None:
    """The emulation open for the code running now, or ``None`` (a real distributed run)."""
    return context.current().emulation


def rank_and_size(group=None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size: the emulated ones while an emulation
    is open (``group`` ``None`` or one it made), else ``torch.distributed``'s."""
    emulated = context.current().emulation
    if emulated is not None:
        ranks = emulated.members(group).ranks
        return ranks.index(emulated.rank), len(ranks)
    return dist.get_rank(group), dist.get_world_size(group)
