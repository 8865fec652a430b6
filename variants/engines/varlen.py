"""Checks shared by the packed-documents (varlen) variants.

A ``cu_seqlens`` that does not end at the token count makes flash-attn's varlen kernels read
and write past the row instead of raising, and one that differs between
ranks makes the ranks disagree on the ring's steps, which hangs or silently mixes documents.
So every varlen variant checks it, on every rank, before any transfer.

That check reads the offsets on the host and compares them across ranks, which a timed call
must not do once per layer: :func:`prepare` does it once per batch and returns
:class:`Documents`, which every layer and both passes share, with the per-step schedules
built for them.
"""

from __future__ import annotations

import collections
import weakref

import torch

from . import comm
from ..instruments import emulation

Tensor = torch.Tensor

#: Moduli of the two polynomial fingerprints ranks compare (Mersenne primes, so every
#: intermediate product fits Python's ints and the result fits int64).
_MOD = (2**61 - 1, 2**31 - 1)
_BASE = (1_000_003, 65_537)


def _fingerprint(offsets: list[int]) -> list[int]:
    out = []
    for mod, base in zip(_MOD, _BASE):
        h = 0
        for c in offsets:
            h = (h * base + c + 1) % mod
        out.append(h)
    return out


def _local_problem(cu_seqlens, total: int) -> str | None:
    """Why ``cu_seqlens`` is not valid offsets of a row of ``total`` tokens on this rank, or ``None``."""
    if not isinstance(cu_seqlens, Tensor):
        return (f"cu_seqlens is a {type(cu_seqlens).__name__}, but it must be a 1-D int32 tensor of "
                "document offsets; pass torch.tensor(offsets, dtype=torch.int32)")
    if cu_seqlens.dtype != torch.int32:
        return (f"cu_seqlens has dtype {cu_seqlens.dtype}, but it must be int32, as the varlen kernels "
                "read it; pass cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        return (f"cu_seqlens has shape {tuple(cu_seqlens.shape)}, but it must be 1-D with at least 2 offsets "
                "(0 and the token count); pass [0, ..., seqlen]")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        return f"cu_seqlens starts at {offsets[0]}, but it must start at 0; put 0 first"
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        if b < a:
            return (f"cu_seqlens decreases from {a} to {b} at index {i + 1}, but offsets must be "
                    "non-decreasing (one per document boundary); sort them or fix the lengths")
    if offsets[-1] != total:
        return (f"cu_seqlens ends at {offsets[-1]} but the packed row holds {total} tokens; the last offset "
                "must equal the token count, or the kernels read past the row, so pass offsets ending at "
                f"{total}")
    return None


def check_cu_seqlens(cu_seqlens: Tensor, seqlen_local: int, group=None) -> list[int]:
    """Check the global ``cu_seqlens`` on every rank and return its offsets as host ints.

    Every rank gathers every rank's verdict and fingerprint first, so all ranks raise together
    (one rank raising alone would leave the others waiting in a collective).

    Args:
        cu_seqlens: int32 ``[N + 1]``, the global document offsets: 0 first, non-decreasing,
            ``seqlen_local * W`` last; the same on every rank. Any device.
        seqlen_local: this rank's tokens; every rank must hold the same number.
        group: the context-parallel process group (default: the world).

    Returns:
        The offsets, a list of N + 1 ints.

    Raises:
        ValueError: (on every rank, starting ``[rank r/W]``) a cu_seqlens of the wrong dtype or
            shape, not starting at 0, decreasing, not ending at the token count, or differing
            between ranks; or ranks holding different numbers of tokens.

    Source: the cu_seqlens contract of flash-attn's varlen functions, and ring-flash-attn's
    varlen variants, which take the global cu_seqlens on every rank.
    """
    rank, world_size = emulation.rank_and_size(group)
    total = seqlen_local * world_size
    problem = _local_problem(cu_seqlens, total)
    offsets = cu_seqlens.tolist() if problem is None else []
    mine = [0 if problem is None else 1, seqlen_local, len(offsets), *_fingerprint(offsets)]
    device = comm.collective_device(cu_seqlens.device if isinstance(cu_seqlens, Tensor) else torch.device("cpu"),
                                    group)
    parts = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(world_size)]
    comm.all_gather(parts, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    rows = [p.tolist() for p in parts]
    prefix = f"[rank {rank}/{world_size}]"
    if problem is not None:
        raise ValueError(f"{prefix} {problem}")
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        raise ValueError(f"{prefix} rank {bad[0]}'s cu_seqlens is invalid (its own error says why); every rank "
                         "must pass the same valid global cu_seqlens")
    sizes = {row[1] for row in rows}
    if len(sizes) > 1:
        raise ValueError(f"{prefix} ranks hold different numbers of tokens ({', '.join(str(r[1]) for r in rows)}); "
                         "every rank must hold seqlen / world_size tokens of the packed row")
    for r, row in enumerate(rows):
        if row[2:] != rows[0][2:]:
            raise ValueError(f"{prefix} cu_seqlens differs between ranks 0 and {r} ({rows[0][2]} and {row[2]} "
                             "offsets); pass the same global cu_seqlens on every rank")
    return offsets


# --------------------------------------------------------------------------- prepared once per batch

class Documents:
    """Packed documents checked once, with the schedules built for them: shared by every layer
    of a batch and by forward and backward.

    Made by :func:`prepare` (outside any timed region: it reads ``cu_seqlens`` on the host and
    compares it across ranks). A varlen variant takes it in place of ``cu_seqlens`` and asks
    it for its per-step schedule (:meth:`schedule`), built the first time and reused after, so
    a call reads nothing back from the device.

    Attributes:
        cu_seqlens: the global int32 offsets ``[N + 1]`` as given.
        offsets: the same offsets as host ints.
        seqlen_local: tokens each rank holds.
        fingerprint: the two polynomial hashes of the offsets that the ranks compared.
        builds: how many schedules were built for these documents (the tests read it).
    """

    def __init__(self, cu_seqlens: Tensor, offsets: list[int], seqlen_local: int):
        self.cu_seqlens = cu_seqlens
        self.offsets = tuple(offsets)
        self.seqlen_local = seqlen_local
        self.fingerprint = tuple(_fingerprint(offsets))
        self.builds = 0
        self._schedules: dict[tuple, object] = {}

    @property
    def lengths(self) -> list[int]:
        """Every document's length in tokens, in row order."""
        return [b - a for a, b in zip(self.offsets, self.offsets[1:])]

    def schedule(self, key: tuple, build):
        """The schedule stored under ``key``, made by ``build()`` the first time it is asked for.

        ``key`` names what the schedule depends on besides the documents (the variant, rank,
        world size, mask, device).
        """
        if key not in self._schedules:
            self._schedules[key] = build()
            self.builds += 1
        return self._schedules[key]


#: Documents by (fingerprint, seqlen_local, group): a new tensor with offsets seen before
#: reuses their schedules. Small: a training run packs a new batch every step.
_BY_FINGERPRINT: "collections.OrderedDict[tuple, Documents]" = collections.OrderedDict()
_FINGERPRINTS_KEPT = 8
#: Documents by tensor identity (id, its version), so a layer given the same tensor as the
#: layer before finds them without reading the tensor.
_BY_TENSOR: dict[int, tuple] = {}


def _group_key(group) -> tuple:
    return (id(group), *emulation.rank_and_size(group))


def prepare(cu_seqlens: "Tensor | Documents", seqlen_local: int, group=None) -> Documents:
    """Check packed documents once and return them prepared for every varlen call of the batch.

    The check (:func:`check_cu_seqlens`: host reads and one all_gather over the group) runs
    the first time a tensor is seen; the same tensor object again (unchanged: same version)
    returns the same :class:`Documents` at once, and a new tensor with the same offsets
    (the same fingerprint) returns the Documents made for them before, their schedules
    included. Call it outside a timed region and pass the result as ``cu_seqlens`` to every
    layer (``ringbench/rank/bench.py`` and the Hugging Face adapter do).

    Args:
        cu_seqlens: int32 ``[N + 1]`` global document offsets, or a :class:`Documents` (returned
            as it is once its row length is checked).
        seqlen_local: this rank's tokens.
        group: the context-parallel process group (default: the world).

    Returns:
        The :class:`Documents`.

    Raises:
        ValueError: as :func:`check_cu_seqlens` (on every rank); a :class:`Documents` prepared
            for another row length.

    Source: issue 15 (varlen schedules built once per batch).
    """
    if isinstance(cu_seqlens, Documents):
        if cu_seqlens.seqlen_local != seqlen_local:
            rank, world_size = emulation.rank_and_size(group)
            raise ValueError(f"[rank {rank}/{world_size}] the documents were prepared for {cu_seqlens.seqlen_local} "
                             f"tokens per rank but q holds {seqlen_local}; prepare them for this row")
        return cu_seqlens
    gkey = _group_key(group)
    if isinstance(cu_seqlens, Tensor):
        seen = _BY_TENSOR.get(id(cu_seqlens))
        if seen is not None:
            ref, version, key, docs = seen
            if ref() is cu_seqlens and version == cu_seqlens._version and key == (seqlen_local, gkey):
                return docs
    offsets = check_cu_seqlens(cu_seqlens, seqlen_local, group)
    fkey = (tuple(_fingerprint(offsets)), len(offsets), seqlen_local, gkey)
    docs = _BY_FINGERPRINT.get(fkey)
    if docs is None or list(docs.offsets) != offsets:
        docs = Documents(cu_seqlens, offsets, seqlen_local)
        _BY_FINGERPRINT[fkey] = docs
    _BY_FINGERPRINT.move_to_end(fkey)
    while len(_BY_FINGERPRINT) > _FINGERPRINTS_KEPT:
        _BY_FINGERPRINT.popitem(last=False)
    _BY_TENSOR.pop(id(cu_seqlens), None)
    _BY_TENSOR[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, (seqlen_local, gkey), docs)
    while len(_BY_TENSOR) > _FINGERPRINTS_KEPT:  # Documents hold their tensor, so bound this too
        del _BY_TENSOR[next(iter(_BY_TENSOR))]
    return docs
