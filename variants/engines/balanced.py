"""The ``balanced`` layout of packed documents: every document cut head-tail, any lengths.

A contiguous cut of a packed row gives the ranks unequal causal work: the rank holding the end
of a long document attends its whole prefix (max/mean 1.28 at W=2 and about 2.5 at W=8 on 12
lognormal documents at 64k). Here every document of length L is cut into 2W chunks, and rank r
holds chunks r and 2W-1-r of every document (zigzag, document by document), so each rank gets
an equal share of every document's causal area. Lengths need not divide by 2W: chunks are
``L // (2W)`` tokens, and the ``L % (2W)`` tokens left over go one each to the ranks in turn,
round-robin across the documents (a rank's first extra token of a document to its head chunk,
a second to its tail chunk), so every rank holds exactly S/W tokens whenever W divides S.
Empty and one-token documents are fine.

A rank's rows are its pieces in document order, head chunk before tail chunk. Pure Python (no
torch), so the harness predicts the work per rank from it too.

Source: the head-tail (zigzag) load balancing of ring-flash-attn's zigzag varlen functions and
PyTorch's per-document load balancer, applied to all-gather attention over packed documents
(ring-flash-attn#52: llama3 is unbalanced on packed documents).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

#: The layout's name, as ``--layout`` takes it.
NAME = "balanced"


class Piece(NamedTuple):
    """Positions ``[start, end)`` of document ``doc`` (within it), at global row ``offset + start``."""

    doc: int
    start: int
    end: int
    offset: int


def pieces(offsets: Sequence[int], world_size: int) -> list[list[Piece]]:
    """Every rank's pieces, in its local order, for documents with global offsets ``offsets``.

    Raises:
        ValueError: a token count that is not a multiple of ``world_size``.
    """
    offsets = [int(c) for c in offsets]
    total = offsets[-1] - offsets[0]
    if total % world_size:
        raise ValueError(f"seqlen {total} is not a multiple of world_size = {world_size}, which the balanced "
                         "layout needs to give every rank the same tokens")
    n = 2 * world_size
    out: list[list[Piece]] = [[] for _ in range(world_size)]
    turn = 0  # the rank that gets the next left-over token
    for d, (a, b) in enumerate(zip(offsets, offsets[1:])):
        base, extra = divmod(b - a, n)
        sizes = [base] * n
        for e in range(extra):
            r = (turn + e) % world_size
            sizes[r if e < world_size else n - 1 - r] += 1
        turn = (turn + extra) % world_size
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)
        for r in range(world_size):
            for c in (r, n - 1 - r):
                if sizes[c]:
                    out[r].append(Piece(d, starts[c], starts[c + 1], a))
    return out


def token_index(offsets: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The global positions ``rank`` holds, in local order."""
    return [p.offset + x for p in pieces(offsets, world_size)[rank] for x in range(p.start, p.end)]


def piece_lengths(offsets: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The lengths of ``rank``'s local pieces, in order (its local documents, as a kernel sees them alone)."""
    return [p.end - p.start for p in pieces(offsets, world_size)[rank]]
