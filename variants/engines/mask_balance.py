"""Balance any mask across ranks: cut the sequence into equal chunks and give each rank the same
number of them, so that every rank's unmasked pairs come out nearly even. Pure Python (no torch).

A rank computes every query row it holds against every key of the sequence (the ring brings the
keys, the all-gather variants gather them), so its work is the unmasked pairs of its query rows
against all S keys, and that work is a sum over its query chunks: a chunk's *area* is the pairs
of its rows against all keys (:meth:`masks.Mask.pairs`, exact, the cross-chunk pairs included).
The plan:

1. cut the S tokens into ``S / chunk`` chunks of ``chunk`` tokens (a multiple of W chunks);
2. take the chunks largest area first (ties: the earlier chunk first);
3. give each to the rank with the least work so far among those holding fewer than
   ``S / (chunk * W)`` chunks (a min-heap of ``(work, rank)``; ties: the lower rank), so every
   rank holds the same number of tokens.

This is the longest-processing-time-first rule of multiprocessor scheduling with a cardinality
bound. On a causal mask with two chunks per rank it gives zigzag's pairing exactly; on masks
whose area sits in a few rows (a bidirectional or shared prompt, a slices file) it follows the
area where zigzag's fixed pairing cannot.

**The chunk size.** Smaller chunks balance better, but a ring step of ``m`` query chunks against
``m`` key chunks may take up to ``m**2`` kernel calls, so the default (:func:`plan` with
``chunk=None``) is the *largest* chunk that gives every rank at least two chunks (``m`` = 2, 4,
8, ... up to :data:`MAX_CHUNKS_PER_RANK`) and reaches max/mean ``<=`` :data:`TARGET`; where none
does, the most even of them (the larger chunk on a tie); where S is a multiple of W but not of
2W, one chunk per rank. Every chunk size divides S, and the
kernels take any block length, so no other multiple is needed.

**PTRR** (``--layout ptrr``), processing-time round robin, is the same plan with another rule at
steps 1 to 3 (:func:`ptrr_plan`): chunks of :data:`PTRR_CHUNK` tokens (FlexAttention's block size;
``S / 2W`` where S is not a multiple of ``PTRR_CHUNK * W``), each chunk's *processing time* the
count of key chunks its rows see at least one pair of (the blocks a block-sparse kernel visits, not
the pairs), taken longest first (ties: the earlier chunk first) and dealt in rounds of W, round k to
ranks 0 .. W-1 for even k and W-1 .. 0 for odd k (a snake draft), with no look at the work so far.
The work it records is still the exact pairs, so its max/mean sits beside the planner's.

Source: the idea of MagiAttention's dispatch solver (Tao et al., arXiv 2505.13211: chunks of the
global sequence assigned to ranks by area with a min-heap, equal chunks per rank); PTRR is the
rule PyTorch's context parallel offers as its ``_PTRRLoadBalancer`` for FlexAttention block masks
(torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py); the code and the
default chunk rules are ringbench's own.
"""

from __future__ import annotations

import functools
import heapq
from typing import NamedTuple

from .bands import Run
from .masks import Mask, run_pairs

#: The layout's name, as ``--layout`` takes it for a batch variant under a mask (packed documents
#: have their own ``balanced``, ``balanced.py``).
NAME = "balanced"
#: The processing-time round-robin layout's name (:func:`ptrr_plan`).
PTRR = "ptrr"
#: The layouts a plan of this module gives, each a function of the mask and the world size (:func:`layout_plan`).
PLANNED = (NAME, PTRR)
#: PTRR's chunk in tokens where the sequence takes it: FlexAttention's default block size.
PTRR_CHUNK = 128
#: The max/mean the default chunk size aims at.
TARGET = 1.05
#: The most chunks per rank the default tries (a ring step may take up to its square of kernel calls).
MAX_CHUNKS_PER_RANK = 16


class Plan(NamedTuple):
    """Chunks of ``chunk`` tokens given to ranks: ``chunks[r]`` the chunk ids rank r holds, ascending
    (chunk i is global positions ``[i * chunk, (i + 1) * chunk)``), and ``work[r]`` its unmasked
    (query, key) pairs, its rows against every key (an int, pairs of one batch row and head)."""

    chunk: int
    chunks: tuple[tuple[int, ...], ...]
    work: tuple[int, ...]

    def positions(self, rank: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s chunks as global ranges ``(start, end)``, in local order."""
        return [(i * self.chunk, (i + 1) * self.chunk) for i in self.chunks[rank]]

    def runs(self, rank: int) -> list[Run]:
        """Rank ``rank``'s rows as ``bands.Run``s of stride 1 (neighbouring chunks joined), in local order."""
        out: list[Run] = []
        for start, end in self.positions(rank):
            last = out[-1] if out else None
            if last is not None and last.start + last.count == start:
                out[-1] = last._replace(count=last.count + end - start)
            else:
                out.append(Run(last.local + last.count if last else 0, start, 1, end - start))
        return out

    def max_over_mean(self) -> float | None:
        """The busiest rank's work over the mean (1.0: even), ``None`` when no rank has work."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else None


def chunk_areas(mask: Mask, chunk: int) -> list[int]:
    """The unmasked pairs of each chunk of ``chunk`` rows against all keys, in chunk order.

    Raises:
        ValueError: a chunk size that does not divide the mask's seqlen.
    """
    S = mask.seqlen
    if chunk < 1 or S % chunk:
        raise ValueError(f"chunk {chunk} does not divide seqlen {S}; pass a chunk size that divides it")
    keys = Run(0, 0, 1, S)
    areas = [0] * (S // chunk)
    for s in mask.slices:  # only the chunks a slice's rows meet: files hold up to 4096 slices
        for i in range(s.q0 // chunk, -(-s.q1 // chunk)):
            areas[i] += run_pairs(Run(0, i * chunk, 1, chunk), keys, s)
    return areas


def assign(areas: list[int], world_size: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Chunks of ``areas`` (one per chunk) given to ``world_size`` ranks, the same count each, largest
    area first to the least-loaded rank with room: ``(chunks per rank, ascending; work per rank)``.

    Raises:
        ValueError: a chunk count that is not a multiple of ``world_size``.
    """
    if world_size < 1 or len(areas) % world_size:
        raise ValueError(f"{len(areas)} chunks cannot go evenly to world_size {world_size}; pass a chunk count "
                         "that is a multiple of it")
    room = len(areas) // world_size
    held: list[list[int]] = [[] for _ in range(world_size)]
    work = [0] * world_size
    heap = [(0, r) for r in range(world_size)]
    for i in sorted(range(len(areas)), key=lambda i: (-areas[i], i)):
        load, r = heapq.heappop(heap)
        held[r].append(i)
        work[r] = load + areas[i]
        if len(held[r]) < room:  # a full rank leaves the heap: equal tokens per rank
            heapq.heappush(heap, (work[r], r))
    return tuple(tuple(sorted(h)) for h in held), tuple(work)


def chunk_sizes(seqlen: int, world_size: int) -> list[int]:
    """The chunk sizes the default tries, largest first: ``S / (m * W)`` for ``m`` = 2, 4, 8, ...
    up to :data:`MAX_CHUNKS_PER_RANK`, while it is a whole number of tokens; where ``S`` is a
    multiple of W but not of 2W, the one chunk per rank (``S / W``: a permutation of contiguous)."""
    out, m = [], 2
    while m <= MAX_CHUNKS_PER_RANK and seqlen % (m * world_size) == 0:
        out.append(seqlen // (m * world_size))
        m *= 2
    return out or ([seqlen // world_size] if world_size >= 1 and seqlen % world_size == 0 else [])


def plan(mask: Mask, world_size: int, chunk: int | None = None) -> Plan:
    """The chunks each of ``world_size`` ranks holds under ``mask`` (``masks.Mask`` over S tokens), and
    each rank's work (unmasked pairs of its rows against all keys), which sums to ``mask.area()``.

    ``chunk`` (tokens) must divide S into a multiple of W chunks; ``None`` picks the default of the
    module docstring.

    Raises:
        ValueError: a ``chunk`` that does not divide S into a multiple of ``world_size`` chunks, or, with
            ``chunk=None``, a seqlen that is not a multiple of ``world_size``.
    """
    S = mask.seqlen
    if chunk is not None:
        if chunk < 1 or S % chunk or (S // chunk) % world_size:
            raise ValueError(f"chunk {chunk} does not cut seqlen {S} into a multiple of world_size {world_size} "
                             f"chunks; pass a divisor of {S // world_size} such as {S // (2 * world_size) or 1}")
        return Plan(chunk, *assign(chunk_areas(mask, chunk), world_size))
    sizes = chunk_sizes(S, world_size)
    if not sizes:
        raise ValueError(f"seqlen {S} is not a multiple of world_size {world_size}, which the balanced layout needs "
                         "to give every rank the same tokens; pass a multiple of it")
    best = None
    for c in sizes:
        found = Plan(c, *assign(chunk_areas(mask, c), world_size))
        ratio = found.max_over_mean() or 1.0
        if ratio <= TARGET:
            return found
        if best is None or ratio < best[0]:
            best = (ratio, found)
    return best[1]


@functools.lru_cache(maxsize=32)
def default_plan(mask: Mask, world_size: int) -> Plan:
    """:func:`plan` at the default chunk, kept: the engines and the harness ask for it per rank and step.

    Raises:
        ValueError: as :func:`plan`.
    """
    return plan(mask, world_size)


def chunk_times(mask: Mask, chunk: int) -> list[int]:
    """Each chunk's processing time under ``mask``: how many chunks of keys (``chunk`` tokens each) its
    rows see at least one pair of (a block-sparse kernel's visits), in chunk order.

    Raises:
        ValueError: a chunk size that does not divide the mask's seqlen.
    """
    S = mask.seqlen
    if chunk < 1 or S % chunk:
        raise ValueError(f"chunk {chunk} does not divide seqlen {S}; pass a chunk size that divides it")
    n = S // chunk
    seen: list[set[int]] = [set() for _ in range(n)]
    for s in mask.slices:  # the key chunks each slice reaches from each of its query chunks
        for i in range(s.q0 // chunk, -(-s.q1 // chunk)):
            first, last = _keys_seen(s, max(s.q0, i * chunk), min(s.q1, (i + 1) * chunk))
            if first <= last:
                seen[i].update(range(first // chunk, last // chunk + 1))
    return [len(keys) for keys in seen]


def _keys_seen(s, a: int, b: int) -> tuple[int, int]:
    """The first and last key that query rows ``[a, b)`` see through slice ``s`` (first > last: none).
    Row q sees keys ``max(k0, q + lo) .. min(k1 - 1, q + hi)``, a window that moves one key a row, so
    the keys its seeing rows see are one run from the first such row's first to the last one's last."""
    lo = s.lo if s.lo is not None else -s.q1 - s.k1  # unbounded: below every k - q of the slice
    hi = s.hi if s.hi is not None else s.k1 + s.q1
    a, b = max(a, s.k0 - hi), min(b, s.k1 - lo)  # the rows whose window meets [k0, k1)
    if a >= b:
        return 1, 0
    return max(s.k0, a + lo), min(s.k1 - 1, b - 1 + hi)


def snake(times: list[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Chunks dealt to ``world_size`` ranks longest ``times`` first (ties: the earlier chunk first), in
    rounds of W: round k to ranks 0 .. W-1 when k is even, W-1 .. 0 when odd; each rank's chunks ascending.

    Raises:
        ValueError: a chunk count that is not a multiple of ``world_size``.
    """
    if world_size < 1 or len(times) % world_size:
        raise ValueError(f"{len(times)} chunks cannot go evenly to world_size {world_size}; pass a chunk count "
                         "that is a multiple of it")
    held: list[list[int]] = [[] for _ in range(world_size)]
    for at, i in enumerate(sorted(range(len(times)), key=lambda i: (-times[i], i))):
        k, r = divmod(at, world_size)
        held[r if k % 2 == 0 else world_size - 1 - r].append(i)
    return tuple(tuple(sorted(h)) for h in held)


def ptrr_chunk(seqlen: int, world_size: int) -> int:
    """PTRR's chunk: :data:`PTRR_CHUNK` where ``seqlen`` is a multiple of it times ``world_size``, else
    ``seqlen / 2W`` (two chunks a rank), else ``seqlen / W``.

    Raises:
        ValueError: a seqlen that is not a multiple of ``world_size``.
    """
    if seqlen % (PTRR_CHUNK * world_size) == 0:
        return PTRR_CHUNK
    sizes = chunk_sizes(seqlen, world_size)
    if not sizes:
        raise ValueError(f"seqlen {seqlen} is not a multiple of world_size {world_size}, which the {PTRR} layout "
                         "needs to give every rank the same tokens; pass a multiple of it")
    return sizes[0]


@functools.lru_cache(maxsize=32)
def ptrr_plan(mask: Mask, world_size: int) -> Plan:
    """PTRR's chunks for each of ``world_size`` ranks under ``mask`` (module docstring), each rank's
    work its exact unmasked pairs against all keys (summing to ``mask.area()``).

    Raises:
        ValueError: a seqlen that is not a multiple of ``world_size``.
    """
    chunk = ptrr_chunk(mask.seqlen, world_size)
    chunks = snake(chunk_times(mask, chunk), world_size)
    areas = chunk_areas(mask, chunk)
    return Plan(chunk, chunks, tuple(sum(areas[i] for i in mine) for mine in chunks))


def layout_plan(mask: Mask, layout: str, world_size: int) -> Plan:
    """The plan of ``layout`` (one of :data:`PLANNED`): the planner's default (:func:`default_plan`) or PTRR's.

    Raises:
        ValueError: a layout not in :data:`PLANNED`, or as the plan raises.
    """
    if layout == NAME:
        return default_plan(mask, world_size)
    if layout == PTRR:
        return ptrr_plan(mask, world_size)
    raise ValueError(f"layout {layout!r} has no plan here; choose one of {', '.join(PLANNED)}")
