"""Which local query rows meet which key rows under a sliding window, from global positions alone.

A sliding window of ``L`` keys (``--window L``) is causal: the query at position p sees the keys
at positions ``p - L + 1 .. p`` of its own document, itself included. A rank's rows are a few
*runs*: arithmetic progressions of positions (``contiguous``: one run of stride 1; ``zigzag``:
two; ``stripe``: one of stride W; packed documents cut by document: those of every document).
Between a query run and a key run of the same stride the visible pairs form a band in local
coordinates, query i seeing keys j with ``i + lo <= j <= i + hi``; this module trims the band
to its bounding box (the rows that see some key, the keys that some row sees), where it is
always a flash-attn window ``(left, right)`` with both sides 0 or more (module docstring of
``kernels``), and gives it as a :class:`Part`. Pure Python (no torch): the harness uses it
too, to predict the work per rank and to find ranks that share keys.

Source: the band algebra is ringbench's own; the window semantics are flash-attn's
``window_size`` (Dao, FlashAttention-2, 2023) and Mistral's sliding window attention.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Run(NamedTuple):
    """``count`` local rows from row ``local`` on, at positions ``start, start + stride, ...`` of document ``doc``."""

    local: int
    start: int
    stride: int
    count: int
    doc: int = 0


class Part(NamedTuple):
    """One kernel call of a windowed block: local query rows ``q`` and key rows ``kv`` (``(first, end)``),
    and its flash-attn window ``(left, right)``; ``window`` None: every key of the part is seen."""

    q: tuple[int, int]
    kv: tuple[int, int]
    window: tuple[int | None, int | None] | None

    def keywords(self) -> dict:
        """The kernel keywords of its call: its window (``kernels``' contract)."""
        return {"window": self.window}


def layout_runs(layout: str, seqlen: int, rank: int, world_size: int, doc: int = 0, local: int = 0) -> list[Run]:
    """The runs of ``rank``'s rows of a sequence of ``seqlen`` tokens in ``layout`` (contiguous,
    zigzag or stripe), its first local row at ``local``; empty runs are left out.

    Raises:
        ValueError: an unknown layout, or a seqlen the layout cannot cut evenly.
    """
    chunks = {"contiguous": 1, "zigzag": 2, "stripe": 1}.get(layout)
    if chunks is None:
        raise ValueError(f"layout {layout!r} has no runs; use contiguous, zigzag or stripe")
    if seqlen % (chunks * world_size):
        raise ValueError(f"seqlen {seqlen} is not a multiple of {chunks * world_size}, which the {layout} layout "
                         f"needs at world_size {world_size}")
    if layout == "stripe":
        runs = [Run(local, rank, world_size, seqlen // world_size, doc)]
    else:
        c = seqlen // (chunks * world_size)
        ids = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
        runs = [Run(local + i * c, cid * c, 1, c, doc) for i, cid in enumerate(ids)]
    return _joined([r for r in runs if r.count])


def _joined(runs: list[Run]) -> list[Run]:
    # Runs that continue each other (zigzag's two chunks on rank W-1, or at W=1) make one run, so one call.
    out: list[Run] = []
    for r in runs:
        last = out[-1] if out else None
        if (last is not None and last.doc == r.doc and last.stride == r.stride
                and r.local == last.local + last.count and r.start == last.start + last.stride * last.count):
            out[-1] = last._replace(count=last.count + r.count)
        else:
            out.append(r)
    return out


def document_runs(docs: Sequence[int], layout: str, rank: int, world_size: int) -> list[Run]:
    """The runs of ``rank``'s rows when every document (lengths ``docs``) is cut in ``layout`` on its
    own (ring_varlen, zigzag_varlen); positions are within each document."""
    runs, local = [], 0
    for d, length in enumerate(docs):
        runs += layout_runs(layout, length, rank, world_size, doc=d, local=local)
        local += length // world_size
    return runs


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def band_part(q: Run, k: Run, window: int | None) -> Part | None:
    """The part of query run ``q`` against key run ``k`` under a causal window of ``window`` keys
    (``None``: causal, unbounded), or ``None`` when no query of ``q`` sees a key of ``k``.

    Raises:
        ValueError: runs of different strides (no layout gives them).
    """
    if q.doc != k.doc:
        return None
    if q.stride != k.stride:
        raise ValueError(f"a query run of stride {q.stride} and a key run of stride {k.stride} make no band")
    s, m, n = q.stride, q.count, k.count
    gap = q.start - k.start
    hi = gap // s  # key j <= query i + hi: not in the future
    lo = None if window is None else _ceil_div(gap - window + 1, s)  # not past the window
    return box_part(q, k, (0, m), (0, n), lo, hi)


def box_part(q: Run, k: Run, rows: tuple[int, int], keys: tuple[int, int], lo: int | None,
             hi: int | None) -> Part | None:
    """The part of the band ``lo <= j - i <= hi`` (``None``: unbounded on that side) between rows
    ``i`` in ``[rows[0], rows[1])`` of query run ``q`` and keys ``j`` in ``[keys[0], keys[1])`` of key
    run ``k`` (indices into the runs), trimmed to the rows that see some key and the keys some row
    sees, where it is a flash-attn window with both sides 0 or more; ``None`` when no pair is left.
    The one conversion from a band to a kernel call, for windows (:func:`band_part`) and for the
    slices of any mask (``masked.slice_parts``)."""
    i0, i1, j0, j1 = rows[0], rows[1] - 1, keys[0], keys[1] - 1
    if hi is not None:
        i0 = max(i0, j0 - hi)
    if lo is not None:
        i1 = min(i1, j1 - lo)
    if i0 > i1 or (lo is not None and hi is not None and lo > hi):  # a window narrower than the stride can miss a run
        return None
    j0, j1 = j0 if lo is None else max(j0, lo + i0), j1 if hi is None else min(j1, hi + i1)
    if j0 > j1:  # no key of the run inside the slice (a one-token document another rank holds)
        return None
    mq, nk = i1 - i0 + 1, j1 - j0 + 1
    hi, lo = None if hi is None else hi + i0 - j0, None if lo is None else lo + i0 - j0
    right = None if hi is None or hi >= nk - 1 else hi - (nk - mq)
    left = None if lo is None or mq - 1 + lo <= 0 else (nk - mq) - lo
    band = None if left is None and right is None else (left, right)
    return Part((q.local + i0, q.local + i1 + 1), (k.local + j0, k.local + j1 + 1), band)


def block_parts(q_runs: Sequence[Run], k_runs: Sequence[Run], window: int | None) -> tuple[Part, ...]:
    """Every non-empty :func:`band_part` of the query runs against the key runs, in order."""
    parts = (band_part(q, k, window) for q in q_runs for k in k_runs)
    return tuple(p for p in parts if p is not None)


def part_pairs(part: Part) -> int:
    """How many (query, key) pairs a part attends."""
    m, n = part.q[1] - part.q[0], part.kv[1] - part.kv[0]
    if part.window is None:
        return m * n
    left, right = part.window
    total = 0
    for i in range(m):
        a = 0 if left is None else max(0, i + n - m - left)
        b = n - 1 if right is None else min(n - 1, i + n - m + right)
        total += max(0, b - a + 1)
    return total
