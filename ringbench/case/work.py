"""The attention work per rank, predicted from the mask alone: layout, documents, window, causal, mask.

Every query row is computed on the rank that holds it, in every ringbench variant (the ring
brings it keys, the all-gather variants gather them), so a rank's work is the number of
(query, key) pairs its own queries attend: with causal masking a query at position p of its
sequence or document sees ``min(window, p + 1)`` keys (``p + 1`` without a window), without it
every key of its document. Counted exactly, per rank and times the batch, with no kernel and no
process: the records carry it for every case and status, on CPU too (issue 15, item 7), and
``max / mean`` says how far the slowest rank's share is above the ideal.

The rows of each rank come from ``variants.bands`` (contiguous, zigzag, stripe; by document for
ring_varlen and zigzag_varlen), the contiguous row cut (llama3_varlen) or ``variants.balanced``.
A layout it does not know gives ``None``. Padded documents (``doc_pad``) are laid out padded and
count their real tokens' pairs. ulysses and ulysses_varlen split heads, not rows, over the
whole group: every rank gets the total over W. Under a mask (``spec.mask``) a rank's pairs are
the mask's own count over its rows' runs (``variants.engines.masks``), and usp's are its ring
rank's over the Ulysses degree (every rank of a Ulysses group computes ``heads / U`` of the ring
shard's rows). A case with a mask also carries :data:`BY_LAYOUT`: max/mean of the work per
rank at its world size in each layout of :data:`COMPARED`, the mask planner's
(``variants.engines.mask_balance``) as ``balanced``, to show what a layout that follows the mask
would gain. Pure Python, no torch.
"""

from __future__ import annotations

import functools
from typing import Any

from ringbench.variants import VARIANTS
from ringbench.variants.engines import balanced, bands, mask_balance, masks

#: The record fields this module fills.
FIELDS = ("predicted_pairs_per_rank", "predicted_max_over_mean")
#: The record field of a case with a mask: max/mean of each layout's work at the case's world size.
BY_LAYOUT = "predicted_max_over_mean_by_layout"
#: The layouts it compares, the mask planner's (``mask_balance``) under ``balanced``.
COMPARED = ("contiguous", "zigzag", "stripe", "balanced", "ptrr")


def _run_pairs(run: bands.Run, length: int, causal: bool, window: int | None) -> int:
    """Pairs the queries of ``run`` attend in a sequence or document of ``length`` tokens."""
    if not causal:
        return run.count * length
    if window is None:
        window = length
    # Query i at p = start + stride * i sees min(window, p + 1) keys: p + 1 while p < window.
    below = 0 if run.start >= window else min(run.count, (window - 1 - run.start) // run.stride + 1)
    first = run.start + 1
    return below * first + run.stride * below * (below - 1) // 2 + (run.count - below) * window


def _row_runs(docs: list[int], rank: int, world_size: int) -> list[bands.Run]:
    """The runs of the packed row cut contiguously (llama3_varlen): each document's piece on the rank."""
    local = sum(docs) // world_size
    start, end = rank * local, (rank + 1) * local
    runs, a = [], 0
    for d, n in enumerate(docs):
        lo, hi = max(a, start), min(a + n, end)
        if hi > lo:
            runs.append(bands.Run(lo - start, lo - a, 1, hi - lo, d))
        a += n
    return runs


def _balanced_runs(docs: list[int], rank: int, world_size: int) -> list[bands.Run]:
    offsets = [0]
    for n in docs:
        offsets.append(offsets[-1] + n)
    runs, local = [], 0
    for p in balanced.pieces(offsets, world_size)[rank]:
        runs.append(bands.Run(local, p.start, 1, p.end - p.start, p.doc))
        local += p.end - p.start
    return runs


def rank_runs(variant_name: str, layout: str, seqlen: int, world_size: int,
              docs: list[int] | None) -> list[list[bands.Run]] | None:
    """Every rank's query rows as runs of positions within their sequence (doc 0) or document,
    or ``None`` for a layout this module does not know."""
    variant = VARIANTS.get(variant_name)
    if variant is None:
        return None
    try:
        if docs is None:
            return [bands.layout_runs(layout, seqlen, r, world_size) for r in range(world_size)]
        if layout == balanced.NAME:
            return [_balanced_runs(docs, r, world_size) for r in range(world_size)]
        if variant.shard_by_document:
            return [bands.document_runs(docs, layout, r, world_size) for r in range(world_size)]
        if layout == "contiguous":
            return [_row_runs(docs, r, world_size) for r in range(world_size)]
    except ValueError:
        return None
    return None


def _real(run: bands.Run, real: int) -> bands.Run:
    """``run`` cut to its queries at positions below ``real`` (a padded document's real tokens)."""
    if run.start >= real:
        return run._replace(count=0)
    return run._replace(count=min(run.count, (real - 1 - run.start) // run.stride + 1))


def pairs_per_rank(spec) -> list[int] | None:
    """Attention pairs of each rank's queries for a case (``CaseSpec``), times the batch; ``None``
    when its layout is not known here or its documents cannot be read.

    With ``doc_pad`` the rows are laid out over the padded documents and only real tokens'
    pairs count: a real query's keys (causal, ``doc_pad`` needs it) are all real, and a pad
    token's work is not the case's. A variant with Ulysses over the whole group (``ulysses``,
    ``ulysses_varlen``) shards heads, not rows: every rank computes ``heads / W`` heads of every
    row, so each gets the total over W (a whole number when W divides the total, else a float).
    """
    from ringbench.case.spec import layout_of, padded_docs, spec_docs

    variant = VARIANTS.get(spec.variant)
    if variant is None:
        return None
    try:
        real = spec_docs(spec) if variant.varlen else None
        docs = padded_docs(spec) if variant.varlen else None
    except ValueError:
        return None
    if variant.varlen and docs is None:
        return None
    if getattr(spec, "mask", ""):
        if docs is not None:
            return _document_masked_pairs(spec, variant, layout_of(spec, variant), docs)
        return _masked_pairs(spec, variant, layout_of(spec, variant))
    runs = rank_runs(spec.variant, layout_of(spec, variant), spec.seqlen, spec.world_size, docs)
    if runs is None:
        return None
    lengths = real or [spec.seqlen]
    window = spec.window or None
    pairs = [spec.batch * sum(_run_pairs(_real(run, lengths[run.doc]), lengths[run.doc], spec.causal, window)
                              for run in mine) for mine in runs]
    if variant.ulysses == "world":
        total = sum(pairs)
        share = total // spec.world_size if total % spec.world_size == 0 else total / spec.world_size
        return [share] * spec.world_size
    return pairs


def _share(total: int, parts: int):
    """``total / parts``, whole where it divides."""
    return total // parts if total % parts == 0 else total / parts


def _masked_pairs(spec, variant, layout: str) -> list | None:
    """Pairs of each rank's queries under ``spec.mask`` (batch variants), times the batch."""
    W, S = spec.world_size, spec.seqlen
    mask = masks.build(spec.mask, S)
    keys = bands.Run(0, 0, 1, S)
    if variant.ulysses == "world":
        return [_share(spec.batch * mask.area(), W)] * W
    degree = spec.ulysses_degree if variant.ulysses == "option" and spec.ulysses_degree > 0 else 1
    try:
        if layout in mask_balance.PLANNED:  # the mask planner's chunks (ring --layout balanced or ptrr)
            found = mask_balance.layout_plan(mask, layout, W // degree)
            ring = [found.runs(r) for r in range(W // degree)]
        else:
            ring = [bands.layout_runs(layout, S, r, W // degree) for r in range(W // degree)]
    except ValueError:
        return None
    return [_share(spec.batch * sum(mask.pairs(run, keys) for run in ring[g // degree]), degree) for g in range(W)]


def _document_masked_pairs(spec, variant, layout: str, docs: list[int]) -> list | None:
    """Pairs of each rank's queries under ``spec.mask`` applied inside each of the packed documents
    ``docs`` (``masks.documents``): each rank's runs of positions within their documents
    (:func:`rank_runs`; usp_varlen's over its ring, shared by the Ulysses degree), moved to their
    place in the packed row, against every key."""
    W, S = spec.world_size, sum(docs)
    try:
        mask = masks.documents(spec.mask, tuple(docs))
    except ValueError:
        return None
    if variant.ulysses == "world":
        return [_share(mask.area(), W)] * W
    degree = spec.ulysses_degree if variant.ulysses == "option" and spec.ulysses_degree > 0 else 1
    runs = rank_runs(spec.variant, layout, S, W // degree, docs)
    if runs is None:
        return None
    at = [0]
    for n in docs:
        at.append(at[-1] + n)
    keys = bands.Run(0, 0, 1, S)
    per_doc = masks.by_document(mask)
    ring = [sum(per_doc[run.doc].pairs(run._replace(start=run.start + at[run.doc]), keys) for run in mine)
            for mine in runs]
    return [_share(ring[g // degree], degree) for g in range(W)]


def predicted_fields(spec) -> dict[str, Any]:
    """The record's ``predicted_pairs_per_rank`` and ``predicted_max_over_mean`` (``None`` both when
    :func:`pairs_per_rank` has none, and the ratio ``None`` when no rank has work); with a mask,
    :data:`BY_LAYOUT` too (:func:`max_over_mean_by_layout`), absent from the other cases; with a
    mask over packed documents (a varlen variant) each layout's value is ``None``: the layouts it
    compares cut one batch row, not documents."""
    pairs = pairs_per_rank(spec)
    extra = {}
    if getattr(spec, "mask", ""):
        variant = VARIANTS.get(spec.variant)
        extra = {BY_LAYOUT: dict.fromkeys(COMPARED) if variant is not None and variant.varlen
                 else max_over_mean_by_layout(spec.mask, spec.seqlen, spec.world_size)}
    if pairs is None:
        return {**dict.fromkeys(FIELDS), **extra}
    return {"predicted_pairs_per_rank": pairs, "predicted_max_over_mean": _ratio(pairs), **extra}


def _ratio(work) -> float | None:
    mean = sum(work) / len(work)
    return max(work) / mean if mean else None


def max_over_mean_by_layout(mask: str, seqlen: int, world_size: int) -> dict[str, float | None]:
    """For ``mask`` (its text) over ``seqlen`` tokens on ``world_size`` ranks, max/mean of the work per
    rank (each rank's rows against every key) in each layout of :data:`COMPARED`: ``balanced`` is
    the mask planner at its default chunk (``mask_balance.plan``), ``ptrr`` PyTorch's processing-time
    round robin (``mask_balance.ptrr_plan``); ``None`` for a layout that
    cannot cut the seqlen (zigzag and balanced need a multiple of 2W), or a mask that cannot be built.
    The same for every variant: the layouts' own comparison, whatever the case's variant runs."""
    return dict(zip(COMPARED, _by_layout(mask, seqlen, world_size)))


@functools.lru_cache(maxsize=64)  # every record of a sweep's case asks again
def _by_layout(mask: str, seqlen: int, world_size: int) -> tuple:
    try:
        built = masks.build(mask, seqlen)
    except ValueError:
        return (None,) * len(COMPARED)
    keys = bands.Run(0, 0, 1, seqlen)
    out: dict[str, float | None] = {}
    for layout in COMPARED:
        try:
            if layout == "balanced":
                out[layout] = mask_balance.plan(built, world_size).max_over_mean()
            elif layout == mask_balance.PTRR:
                out[layout] = mask_balance.ptrr_plan(built, world_size).max_over_mean()
            else:
                rows = [bands.layout_runs(layout, seqlen, r, world_size) for r in range(world_size)]
                out[layout] = _ratio([sum(built.pairs(run, keys) for run in mine) for mine in rows])
        except ValueError:
            out[layout] = None
    return tuple(out[layout] for layout in COMPARED)


def attention_flops(*, batch: int, seqlen: int, heads: int, head_dim: int, causal: bool,
                    mode: str, docs: list[int] | None = None, head_dim_v: int = 0,
                    window: int | None = None, mask: str = "", pairs: int | None = None) -> float:
    """FLOPs of one attention over the whole sequence, in the flash-attn convention.

    Forward is ``4 * B * S^2 * Hq * D``, halved when causal; forward + backward is 3.5 times
    forward. With packed documents (``docs``, their lengths), it is the sum of each document's
    own figure, ``4 * L^2 * Hq * D`` (so ``2 * L^2 * Hq * D`` causal), times B. GQA and the
    layout change nothing. Divide by the world size for per-GPU figures. A value head dim
    ``head_dim_v`` apart from D (0: the same) makes ``D`` the mean of the two: ``Q K^T`` costs
    ``2 S^2 D`` and ``P V`` ``2 S^2 Dv``. Padded documents (``doc_pad``) count their real
    lengths only: pass those and their sum as ``seqlen``.

    A sliding window of ``w`` keys (causal) counts only the pairs inside it: a sequence or
    document of length L gives ``4 * (L * w' - w'^2 / 2) * Hq * D`` with ``w' = min(w, L)``,
    which is the causal figure when ``w >= L``.

    Under a ``mask`` (its text, ``engines/masks.py``) only its unmasked pairs count:
    ``4 * B * area * Hq * D``, with ``docs`` the area of the mask inside each document
    (``masks.documents``); ``pairs`` gives the pairs directly instead (a block's, such as one
    rank's share under the mask), overriding the mask, the window and ``causal``.

    Raises:
        ValueError: an unknown mode, or ``docs`` that do not sum to ``seqlen``.
    """
    head_dim = (head_dim + (head_dim_v or head_dim)) / 2
    if pairs is None and mask:
        pairs = masks.over(mask, seqlen, docs).area()
    if pairs is not None:
        fwd = 4.0 * batch * pairs * heads * head_dim
        return _by_mode(fwd, mode)
    if docs is None:
        fwd = 4.0 * batch * seqlen * seqlen * heads * head_dim
    else:
        if sum(docs) != seqlen:
            raise ValueError(f"documents sum to {sum(docs)} but seqlen is {seqlen}; pass documents that fill "
                             "the sequence")
        fwd = 4.0 * batch * sum(float(L) * L for L in docs) * heads * head_dim
    if window:
        pairs = sum(float(L) * min(window, L) - min(window, L) ** 2 / 2 for L in (docs or [seqlen]))
        fwd = 4.0 * batch * pairs * heads * head_dim
    elif causal:
        fwd /= 2
    return _by_mode(fwd, mode)


def _by_mode(fwd: float, mode: str) -> float:
    """A forward pass's FLOPs as ``mode`` times them: fwd, or fwd_bwd (3.5 times forward)."""
    if mode == "fwd":
        return fwd
    if mode == "fwd_bwd":
        return 3.5 * fwd
    raise ValueError(f"mode {mode!r} is unknown; choose fwd or fwd_bwd")
