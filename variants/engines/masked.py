"""Any mask (``masks.py``) in the engines: every block cut into the kernel calls its mask leaves.

A block is a rank's query rows against a visiting (ring) or gathered (llama3) set of key rows.
Its global positions come from the layout, as runs (``bands.layout_runs``: one contiguous run,
zigzag's two chunks, a stripe of stride W), and the mask classifies each (query run, key run)
pair of the block from the runs alone (``masks.Mask.classify``, no torch):

- empty: no kernel call;
- full: a plain kernel call (``causal=False``, no mask), which any kernel takes;
- partial: on a kernel that takes a mask (``Kernel.takes_mask``: math, whose dense block is built
  on the first call and kept; flex, whose ``BlockMask`` is), one call with a
  :class:`~..kernels.common.PositionMask` (the rows' global positions and the mask's predicate
  restricted to the slices that meet the block); on a kernel that takes only windows (``by_slices``:
  flash-attn-4, flash-attn, torch-flash, cpu), one call per slice that meets the block (:func:`slice_parts`): the mask's
  slices share no pair, and each slice is a band ``lo <= k - q <= hi`` inside a rectangle, so
  its pairs in the block are a flash-attn window over a sub-block (``bands.box_part``), and the
  calls' results merge by lse like a ring's steps. This is the slice form of MagiAttention's
  masks (Zewei Tao et al., 2025), run on the kernels' own windows.

With packed documents the mask is ``masks.documents``' (``Mask.docs`` set, no slice crossing a
document), and every rank's rows are each document's runs in the layout, moved to the document's
place in the packed row (:func:`layout_runs`): a block of two documents is empty, skipped before
it is classified.

In the ring engine each step's parts go through ``window.attend`` as a window's do, and the
forward ring ends after the last step some rank needs (``window.RingParts.n_steps``), so K/V
that every remaining step would mask are neither sent nor waited on. The steps of a case are
built once per (mask, layout, shard length, rank, world size, device) and kept
(:func:`ring_steps`), so the timed iterations build nothing and forward and backward share one
dense block per part.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import torch

from . import bands, mask_balance, masks
from ..kernels.common import PositionMask
from .steps import part_steps
from .window import RingParts, attend, attend_backward, ring_reach

Tensor = torch.Tensor


def as_mask(mask: "str | masks.Mask | None", seqlen: int, *, window: int | None = None,
            docs: "Sequence[int] | None" = None, prefix: str = "") -> "masks.Mask | None":
    """A variant's ``mask`` keyword as the ``masks.Mask`` over ``seqlen`` global tokens (text is
    built, and kept, by ``masks.build``; with packed documents, ``docs`` their global lengths, by
    ``masks.documents``: per document over the packed row), or ``None`` for none.

    Raises:
        ValueError: (starting with ``prefix``) a malformed mask, one for another seqlen or other
            documents, one the seqlen or the documents cannot take, or a mask with a window
            (``--window`` is the short form of ``window:L``).
    """
    if mask is None or mask == "":
        return None
    docs = None if docs is None else tuple(int(n) for n in docs)
    try:
        if isinstance(mask, str):
            mask = masks.build(mask, seqlen) if docs is None else masks.documents(mask, docs)
    except ValueError as exc:
        raise ValueError(f"{prefix}{exc}") from None
    if mask.seqlen != seqlen:
        raise ValueError(f"{prefix}mask {mask.text} was built over {mask.seqlen} tokens, but the sequence has "
                         f"{seqlen}; build it over the global sequence")
    if window is not None:
        raise ValueError(f"{prefix}a mask and a window do not go together (window={window} is the mask "
                         f"window:{window}); pass one of them")
    if docs is not None and docs != mask.docs:  # a built mask given alone is taken as built
        given = f"documents {','.join(map(str, docs))}" if docs else "no documents"
        built = f"documents {','.join(map(str, mask.docs))}" if mask.docs else "one batch row"
        raise ValueError(f"{prefix}mask {masks.label(mask.text)} was built over {built}, but the call has {given}; "
                         "pass its text, or build it with masks.documents over the call's documents")
    return mask


class MaskPart(NamedTuple):
    """One kernel call of a masked block: local query rows ``q`` and key rows ``kv`` (``(first, end)``),
    and its mask (``None``: every pair of the part is seen)."""

    q: tuple[int, int]
    kv: tuple[int, int]
    mask: PositionMask | None

    def keywords(self) -> dict:
        """The kernel keywords of its call: its mask, where it has one."""
        return {} if self.mask is None else {"mask": self.mask}


def positions(run: bands.Run, device=None) -> Tensor:
    """The global positions of ``run``, int64 ``[count]``."""
    return run.start + run.stride * torch.arange(run.count, dtype=torch.int64, device=device)


def _last(run: bands.Run) -> int:
    return run.start + run.stride * (run.count - 1)


def position_mask(mask: masks.Mask, q: bands.Run, k: bands.Run, device=None) -> PositionMask:
    """The :class:`PositionMask` of query run ``q`` against key run ``k``: their positions and the
    mask's predicate over only the slices that meet them."""
    near = mask.within(q.start, _last(q) + 1, k.start, _last(k) + 1)
    return PositionMask(positions(q, device), positions(k, device), near.allows, mask.text,
                        slices=tuple((s.q0, s.q1, s.k0, s.k1, s.lo, s.hi) for s in near.slices))


def dense_mask(mask: masks.Mask, device=None) -> Tensor:
    """bool ``[S, S]``: which key each query of the whole sequence sees, ``mask.allows`` over every
    position, built slice by slice inside each slice's rectangle (so a mask over many packed
    documents costs about its documents' squares, not ``S^2`` per slice)."""
    seen = torch.zeros(mask.seqlen, mask.seqlen, dtype=torch.bool, device=device)
    for s in mask.slices:
        if s.q0 >= s.q1 or s.k0 >= s.k1:
            continue
        q = torch.arange(s.q0, s.q1, device=device)[:, None]
        k = torch.arange(s.k0, s.k1, device=device)[None, :]
        seen[s.q0:s.q1, s.k0:s.k1] |= s.allows(q, k)
    return seen


def slice_parts(mask: masks.Mask, q: bands.Run, k: bands.Run) -> tuple[bands.Part, ...]:
    """The window calls of query run ``q`` against key run ``k`` under ``mask``: one
    :class:`bands.Part` per slice with a pair there (its band trimmed by ``bands.box_part``).

    Raises:
        ValueError: runs of different strides, neither of one position (no layout gives them).
    """
    found = []
    for s in mask.within(q.start, _last(q) + 1, k.start, _last(k) + 1).slices:
        rows, keys, lo, hi = masks.local_band(q, k, s)
        part = bands.box_part(q, k, rows, keys, lo, hi)
        if part is not None:
            found.append(part)
    return tuple(found)


def runs_of(positions: Sequence[int]) -> list[bands.Run]:
    """Global positions held in local order (a rank's share, any layout) as few runs: each
    the longest arithmetic progression from where the last ended (zigzag's share: two runs of
    stride 1; stripe's: one of stride W)."""
    found, i, n = [], 0, len(positions)
    while i < n:
        stride = positions[i + 1] - positions[i] if i + 1 < n and positions[i + 1] > positions[i] else 1
        j = i + 1
        while j < n and positions[j] - positions[j - 1] == stride:
            j += 1
        found.append(bands.Run(i, positions[i], stride, j - i))
        i = j
    return found


class Sliced:
    """A kernel that takes windows but no mask (``Kernel.by_slices``), called on one block under a
    mask: the block cut into its window calls (:func:`pair_parts` by slices),
    merged by lse as a ring's steps are. What the harness calls for a single device's whole row
    and a rank's own share, so they run the kernel calls the engines make.

    Args:
        kernel: the window-taking kernel; mask: the ``masks.Mask``; q_runs, k_runs: the block's
            query and key rows as runs of global positions (:func:`runs_of`).
    """

    def __init__(self, kernel, mask: masks.Mask, q_runs: Sequence[bands.Run], k_runs: Sequence[bands.Run]):
        self.kernel, self.name = kernel, kernel.name
        self.parts = tuple(p for q in q_runs for k in k_runs
                           for p in pair_parts(mask, q, k, mask.classify(q, k), by_slices=True))

    def forward(self, q, k, v, causal, scale, bias=None):
        """out ``[B, Sq, Hq, Dv]`` in q's dtype and lse ``[B, Hq, Sq]`` (float32; float64 for float64
        inputs), as a kernel's; ``causal`` is ignored: the mask decides; ``bias``: the block's
        ``PositionBias`` or ``None``, each window call taking its part of it."""
        out, lse = attend(self.kernel, q, k, v, self.parts, scale, bias)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, bias=None):
        """dq, dk, dv in the inputs' dtypes, as a kernel's; ``bias`` as in :meth:`forward`."""
        grads = attend_backward(self.kernel, dout, q, k, v, out, lse, self.parts, scale, bias)
        return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


def pair_parts(mask: masks.Mask, q: bands.Run, k: bands.Run, kind: str, device=None, *,
               by_slices: bool = False) -> tuple:
    """The kernel calls of query run ``q`` against key run ``k`` of class ``kind``: none when empty,
    one plain call when full, else one call with its :class:`PositionMask` or, with ``by_slices``,
    its :func:`slice_parts` (windows)."""
    if kind == masks.EMPTY:
        return ()
    if kind == masks.FULL:
        return (MaskPart((q.local, q.local + q.count), (k.local, k.local + k.count), None),)
    if by_slices:
        return slice_parts(mask, q, k)
    return (MaskPart((q.local, q.local + q.count), (k.local, k.local + k.count), position_mask(mask, q, k, device)),)


def block_parts(mask: masks.Mask, q_runs: Sequence[bands.Run], k_runs: Sequence[bands.Run], device=None, *,
                build: bool = True, classify: Callable | None = None, by_slices: bool = False) -> tuple:
    """The parts of queries ``q_runs`` against keys ``k_runs`` under ``mask``: one per (query run, key
    run) pair with a pair left, full or with its :class:`PositionMask`, or with ``by_slices`` a
    partial pair's :func:`slice_parts` (windows); ``build`` False gives each part's class alone
    (``masks.FULL`` or ``masks.PARTIAL``), for another rank's steps. ``classify`` (default
    ``mask.classify``) is the fixtures' hook (``fixtures/broken.py``)."""
    found = []
    if mask.docs:  # no slice of a mask over documents crosses one: each query run meets its document's keys
        per_doc, keys_of = masks.by_document(mask), {}
        for k in k_runs:
            keys_of.setdefault(k.doc, []).append(k)
        pairs = [(q, k, per_doc[q.doc]) for q in q_runs for k in keys_of.get(q.doc, ())]
    else:
        pairs = [(q, k, mask) for q in q_runs for k in k_runs]
    for q, k, near in pairs:
        kind = classify(q, k) if classify else near.classify(q, k)
        if kind == masks.EMPTY:
            continue
        if not build:
            found.append(kind)
            continue
        found.extend(pair_parts(near, q, k, kind, device, by_slices=by_slices))
    return tuple(found)


#: ``(mask, q_runs, k_runs, device, build, rank, source, by_slices) -> parts``: how a block becomes parts
#: (:func:`block_parts` in every correct engine; the fixtures pass another).
Parts = Callable[..., tuple]


def _correct(mask, q_runs, k_runs, device, build, rank, source, by_slices=False) -> tuple:
    return block_parts(mask, q_runs, k_runs, device, build=build, by_slices=by_slices)


def layout_runs(mask: "masks.Mask | None", layout: str, seqlen: int, world_size: int) -> list[list[bands.Run]]:
    """Every rank's rows as runs of global positions: ``layout``'s (``bands.layout_runs``), for
    ``balanced`` (and ``ptrr``) the chunks the mask planner gives each rank (``mask_balance.layout_plan``), and
    for a mask over packed documents (``mask.docs``) every document cut in ``layout`` on its own
    (``bands.document_runs``), its runs moved to the document's place in the packed row.

    Raises:
        ValueError: a layout that cannot cut ``seqlen`` tokens over ``world_size`` ranks.
    """
    if mask is not None and mask.docs:
        at = [0]
        for n in mask.docs:
            at.append(at[-1] + n)
        return [[run._replace(start=run.start + at[run.doc])
                 for run in bands.document_runs(mask.docs, layout, r, world_size)] for r in range(world_size)]
    if layout in mask_balance.PLANNED:
        found = mask_balance.layout_plan(mask, layout, world_size)
        return [found.runs(r) for r in range(world_size)]
    return [bands.layout_runs(layout, seqlen, r, world_size) for r in range(world_size)]


@functools.lru_cache(maxsize=32)
def ring_steps(mask: masks.Mask, layout: str, seqlen_local: int, rank: int, world_size: int, device,
               parts: Parts = _correct, by_slices: bool = False):
    """The ring engine's steps of ``rank`` under ``mask`` (``ring.Step`` with its parts, ``None``
    where the block is empty), over ``layout``'s positions (:func:`layout_runs`), with an
    ``n_steps`` attribute: the forward ring's length; ``by_slices``: partial blocks as window
    calls (:func:`block_parts`), for a kernel that takes no mask. Built once per argument set and kept.

    Raises:
        ValueError: a layout that cannot cut ``seqlen_local * world_size`` tokens.
    """
    runs = layout_runs(mask, layout, seqlen_local * world_size, world_size)
    return part_steps(RingParts(rank, world_size, lambda r, source, mine: parts(mask, runs[r], runs[source], device,
                                                                                 mine, r, source, by_slices),
                                reach=_reach(mask, layout, seqlen_local, world_size, device, parts, by_slices)))


@functools.lru_cache(maxsize=16)
def _reach(mask: masks.Mask, layout: str, seqlen_local: int, world_size: int, device, parts: Parts,
           by_slices: bool) -> int:
    # The ring's length is the same for every rank: worked out once per case, not once per rank.
    runs = layout_runs(mask, layout, seqlen_local * world_size, world_size)
    return ring_reach(world_size, lambda r, source: bool(parts(mask, runs[r], runs[source], device, False, r, source,
                                                               by_slices)))


def gathered_blocks(mask: masks.Mask, chunks: list[tuple[slice, int, int]], chunk: int, seqlen: int,
                    device=None, by_slices: bool = False) -> list[tuple[slice, slice, bool, dict]]:
    """The kernel calls of an all-gather engine (llama3) under ``mask``: for every local query chunk
    (``(local rows, first global position, length)``) against the gathered keys in global order,
    cut in key chunks of ``chunk`` tokens, each run of neighbouring non-empty chunks one call
    ``(local rows, key range, causal=False, kernel keywords)``, with the run's mask where some chunk
    of it is partial (with ``by_slices``, that run's :func:`slice_parts` instead, windows); empty
    chunks none. Few calls, as llama3 wants: each row's result is merged from fewer blocks."""
    calls = []
    for rows, start, length in chunks:
        q = bands.Run(rows.start, start, 1, length)
        runs: list[list] = []  # [first key, end, every chunk full]
        for k0 in range(0, seqlen, chunk):
            k = bands.Run(k0, k0, 1, min(chunk, seqlen - k0))
            kind = mask.classify(q, k)
            if kind == masks.EMPTY:
                continue
            if runs and runs[-1][1] == k0:
                runs[-1][1], runs[-1][2] = k0 + k.count, runs[-1][2] and kind == masks.FULL
            else:
                runs.append([k0, k0 + k.count, kind == masks.FULL])
        for k0, k1, full in runs:
            k = bands.Run(k0, k0, 1, k1 - k0)
            if full or not by_slices:
                calls.append((rows, slice(k0, k1), False, {} if full else {"mask": position_mask(mask, q, k, device)}))
                continue
            # q.local is rows.start, so a part's local rows are the call's rows as they are.
            calls += [(slice(*p.q), slice(*p.kv), False, p.keywords()) for p in slice_parts(mask, q, k)]
    return calls
