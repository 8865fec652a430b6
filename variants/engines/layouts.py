"""How a global sequence maps onto the ranks of a context-parallel group.

``contiguous``: rank r holds tokens ``[r*S/W, (r+1)*S/W)``.
``zigzag``: the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r,
so every rank has the same amount of causal work (also called head-tail).
``stripe``: token t lives on rank t mod W (Brandon et al., "Striped Attention", 2023).
``balanced`` of one sequence under a mask: the chunks the mask planner gives each rank, so
every rank's unmasked pairs come out nearly even (``mask_balance.py``; the functions take the
mask as ``mask=``).

Packed documents (varlen) are sharded one of two ways, given the global int32 ``cu_seqlens``:

- *by document*: every document is cut in the layout on its own, so rank r holds its share
  of each document, in document order (``ring_varlen``: chunk r of every document;
  ``zigzag_varlen``: chunks r and 2W-1-r of every document). Every document's length must be
  a multiple of ``required_multiple(layout, W)``, and every rank then holds the same local
  documents, each ``1/W`` of the global one.
- *by row*: the packed row is cut in the layout as if it were one sequence (``llama3_varlen``,
  contiguous), so documents may straddle ranks and may have any length, zero included.
- *balanced* (``llama3_varlen --layout balanced``): every document cut head-tail into 2W
  chunks of any length (``balanced.py``), which equalises the causal work per rank.

Composed with Ulysses (usp): every function takes ``ulysses_degree`` U (default 1, the plain
layout). The W ranks form R = W / U ring groups of U consecutive ranks; rank g is Ulysses rank
``g % U`` of ring rank ``g // U``. The layout is applied over the R ring ranks (rank g's ring
shard is ring rank ``g // U``'s share at world size R), and the ring shard is then cut into U
contiguous equal parts, part ``g % U`` on rank g. After the Ulysses all-to-all every rank of a
ring group holds its ring shard whole (for ``heads / U`` heads), which is what the ring engine
expects. With U = W this is the contiguous layout whatever the base layout. This is also
yunchang's layout (``zigzag_extract_local``).

Source: the document-wise sharding of ring-flash-attn's varlen functions
(zhuzilin/ring-flash-attention, ``ring_flash_attn_varlen`` and ``zigzag_ring_flash_attn_varlen``);
USP (arXiv 2405.07719) for the composed layout.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..rules import LAYOUT_CHUNKS, document_rule
from . import balanced, mask_balance, masks

Tensor = torch.Tensor

LAYOUTS = tuple(LAYOUT_CHUNKS)


def required_multiple(layout: str, world_size: int) -> int:
    """Return the number the global seqlen must be a multiple of for ``layout`` at ``world_size``."""
    return LAYOUT_CHUNKS[layout] * world_size


def chunk_ids(layout: str, rank: int, world_size: int) -> list[int]:
    """Return which of the ``required_multiple`` equal chunks ``rank`` holds, in local order."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    if layout == "stripe":
        raise ValueError("the stripe layout holds single tokens, not chunks; use token_index")
    if layout == balanced.NAME:
        raise ValueError("the balanced layout cuts packed documents, not one sequence; use varlen_token_index")
    raise ValueError(f"layout {layout!r} is unknown; choose one of {', '.join(LAYOUTS)}")


def _ulysses_part(idx: Tensor, rank: int, ulysses_degree: int) -> Tensor:
    """Part ``rank % U`` of U contiguous equal parts of a ring shard's positions ``idx``."""
    if idx.numel() % ulysses_degree:
        raise ValueError(f"a ring shard of {idx.numel()} tokens cannot be cut into ulysses_degree = "
                         f"{ulysses_degree} equal parts; make seqlen a multiple of the world size")
    return idx.chunk(ulysses_degree)[rank % ulysses_degree] if idx.numel() else idx


def _ring_coordinates(rank: int, world_size: int, ulysses_degree: int) -> tuple[int, int]:
    if ulysses_degree < 1 or world_size % ulysses_degree:
        raise ValueError(f"ulysses_degree {ulysses_degree} does not divide world_size {world_size}")
    return rank // ulysses_degree, world_size // ulysses_degree


def token_index(layout: str, seqlen: int, rank: int, world_size: int, device=None, *,
                ulysses_degree: int = 1, mask: "str | masks.Mask | None" = None) -> Tensor:
    """Return the global positions ``rank`` holds, int64 ``[seqlen / W]``, in local order.

    Useful for position ids and labels, which must be permuted as the tokens are. With
    ``ulysses_degree`` U above 1, the composed layout of the module docstring. ``balanced``
    takes the ``mask`` (its text or a ``masks.Mask`` over ``seqlen``) and gives the chunks its
    planner assigns the rank (``mask_balance.default_plan``), ascending.

    Raises:
        ValueError: when ``seqlen`` is not a multiple of ``required_multiple(layout, W)``, or U
            does not divide W; ``balanced`` without a mask, or with U above 1.
    """
    if layout in mask_balance.PLANNED and not mask:
        raise ValueError(f"the {layout} layout of one sequence follows a mask, and none was given; pass mask=, or "
                         "use varlen_token_index for packed documents")
    if layout in mask_balance.PLANNED:
        if ulysses_degree != 1:
            raise ValueError(f"the {layout} layout under a mask has no Ulysses form (ulysses_degree "
                             f"{ulysses_degree}); pass ulysses_degree 1")
        built = masks.build(mask, seqlen) if isinstance(mask, str) else mask
        found = mask_balance.layout_plan(built, layout, world_size)
        return torch.cat([torch.arange(a, b, device=device) for a, b in found.positions(rank)])
    if ulysses_degree != 1:
        ring_rank, ring_size = _ring_coordinates(rank, world_size, ulysses_degree)
        idx = token_index(layout, seqlen, ring_rank, ring_size, device=device)
        return _ulysses_part(idx, rank, ulysses_degree)
    n = required_multiple(layout, world_size)
    if seqlen % n:
        raise ValueError(f"seqlen {seqlen} is not a multiple of {n}, which the {layout} layout "
                         f"needs at world_size {world_size}")
    if layout == "stripe":
        return torch.arange(rank, seqlen, world_size, device=device)
    c = seqlen // n
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunk_ids(layout, rank, world_size)])


def every_rank_tokens(layout: str, seqlen: int, world_size: int, device=None, *,
                      mask: "str | masks.Mask | None" = None) -> list[Tensor]:
    """:func:`token_index` of every rank, in rank order: the global positions each one holds."""
    return [token_index(layout, seqlen, rank, world_size, device=device, mask=mask) for rank in range(world_size)]


def shard(x: Tensor, layout: str, rank: int, world_size: int, dim: int = 1, *, ulysses_degree: int = 1,
          mask: "str | masks.Mask | None" = None) -> Tensor:
    """Take ``rank``'s shard of the global tensor ``x`` along ``dim`` (a new contiguous tensor);
    ``mask``: the ``balanced`` layout's (:func:`token_index`).

    Raises:
        ValueError: as :func:`token_index`.
    """
    idx = token_index(layout, x.shape[dim], rank, world_size, device=x.device, ulysses_degree=ulysses_degree,
                      mask=mask)
    return x.index_select(dim, idx)


def unshard(shards: list[Tensor], layout: str, dim: int = 1, *, ulysses_degree: int = 1,
            mask: "str | masks.Mask | None" = None) -> Tensor:
    """Rebuild the global tensor from every rank's shard, ``shards[r]`` being rank r's."""
    world_size = len(shards)
    local = shards[0].shape[dim]
    seqlen = local * world_size
    out = torch.empty_like(torch.cat(shards, dim=dim))
    for rank, s in enumerate(shards):
        out.index_copy_(dim, token_index(layout, seqlen, rank, world_size, device=s.device,
                                         ulysses_degree=ulysses_degree, mask=mask), s)
    return out


# --------------------------------------------------------------------------- packed documents

def offsets_of(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    """The document offsets of ``cu_seqlens`` (a tensor or a sequence of ints) as a Python list."""
    return cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else [int(c) for c in cu_seqlens]


def cu_seqlens_from_docs(docs: Sequence[int], device=None) -> Tensor:
    """Return the int32 offsets ``[0, L0, L0+L1, ..., sum]`` of documents of lengths ``docs``."""
    offsets = [0]
    for length in docs:
        offsets.append(offsets[-1] + int(length))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def varlen_token_index(cu_seqlens: Tensor | Sequence[int], layout: str, rank: int, world_size: int, *,
                       by_document: bool, device=None, ulysses_degree: int = 1) -> Tensor:
    """Return the global positions ``rank`` holds of a packed row, int64 ``[S / W]``, in local order.

    Args:
        cu_seqlens: the global document offsets (int32 tensor or ints), ending at S.
        layout: ``contiguous``, ``zigzag`` or ``stripe``.
        by_document: cut every document in the layout (True) or the whole row (False); see the
            module docstring.
        ulysses_degree: U; above 1 the layout is applied over the W / U ring ranks and the ring
            shard cut into U contiguous parts (module docstring).

    Raises:
        ValueError: by document, a document whose length is not a multiple of
            ``required_multiple(layout, W)``; by row, S not a multiple of it.
    """
    offsets = offsets_of(cu_seqlens)
    if ulysses_degree != 1:
        ring_rank, ring_size = _ring_coordinates(rank, world_size, ulysses_degree)
        idx = varlen_token_index(offsets, layout, ring_rank, ring_size, by_document=by_document, device=device)
        return _ulysses_part(idx, rank, ulysses_degree)
    if layout == balanced.NAME:
        return torch.tensor(balanced.token_index(offsets, rank, world_size), dtype=torch.int64, device=device)
    if not by_document:
        return token_index(layout, offsets[-1], rank, world_size, device=device)
    reason = document_rule([b - a for a, b in zip(offsets, offsets[1:])], world_size, layout,
                           f"the {layout} layout, document by document,")
    if reason:
        raise ValueError(reason)
    parts = [token_index(layout, b - a, rank, world_size, device=device) + a for a, b in zip(offsets, offsets[1:])]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)


def varlen_local_cu_seqlens(cu_seqlens: Tensor | Sequence[int], layout: str, rank: int, world_size: int, *,
                            by_document: bool, device=None, ulysses_degree: int = 1) -> Tensor:
    """Return the int32 offsets of ``rank``'s local document pieces within its ``S / W`` rows.

    By document, every rank holds ``L / W`` tokens of every document of length ``L`` (empty
    documents included), the same offsets on every rank. By row (contiguous layout only), the
    pieces are the non-empty intersections of the documents with the rank's rows, so a
    document that straddles ranks gives a piece on each. Balanced: the rank's pieces, a head and
    a tail chunk of every document (``balanced.py``).

    With ``ulysses_degree`` U above 1, the pieces of the ring shard's documents that fall in
    this rank's contiguous part of it.

    Raises:
        ValueError: as :func:`varlen_token_index`; a by-row layout other than contiguous.
    """
    offsets = offsets_of(cu_seqlens)
    if ulysses_degree != 1:
        ring_rank, ring_size = _ring_coordinates(rank, world_size, ulysses_degree)
        ring = varlen_local_cu_seqlens(offsets, layout, ring_rank, ring_size, by_document=by_document).tolist()
        part = ring[-1] // ulysses_degree
        start, end = (rank % ulysses_degree) * part, (rank % ulysses_degree + 1) * part
        lengths = [min(b, end) - max(a, start) for a, b in zip(ring, ring[1:]) if min(b, end) > max(a, start)]
        return cu_seqlens_from_docs(lengths, device=device)
    if layout == balanced.NAME:
        lengths = balanced.piece_lengths(offsets, rank, world_size)
    elif by_document:
        varlen_token_index(offsets, layout, rank, world_size, by_document=True)  # the rule
        lengths = [(b - a) // world_size for a, b in zip(offsets, offsets[1:])]
    else:
        if layout != "contiguous":
            raise ValueError(f"layout {layout!r} cannot shard packed documents by row; use contiguous")
        seqlen_local = len(token_index(layout, offsets[-1], rank, world_size))
        start, end = rank * seqlen_local, (rank + 1) * seqlen_local
        lengths = [min(b, end) - max(a, start) for a, b in zip(offsets, offsets[1:]) if min(b, end) > max(a, start)]
    return cu_seqlens_from_docs(lengths, device=device)


def shard_varlen(x: Tensor, cu_seqlens: Tensor | Sequence[int], layout: str, rank: int, world_size: int, *,
                 by_document: bool, dim: int = 1, ulysses_degree: int = 1) -> Tensor:
    """Take ``rank``'s shard of the packed tensor ``x`` along ``dim`` (a new tensor).

    Raises:
        ValueError: as :func:`varlen_token_index`.
    """
    return x.index_select(dim, varlen_token_index(cu_seqlens, layout, rank, world_size, by_document=by_document,
                                                  device=x.device, ulysses_degree=ulysses_degree))


def unshard_varlen(shards: list[Tensor], cu_seqlens: Tensor | Sequence[int], layout: str, *, by_document: bool,
                   dim: int = 1, ulysses_degree: int = 1) -> Tensor:
    """Rebuild the packed tensor from every rank's shard, ``shards[r]`` being rank r's.

    Raises:
        ValueError: as :func:`varlen_token_index`.
    """
    world_size = len(shards)
    out = torch.empty_like(torch.cat(shards, dim=dim))
    for rank, s in enumerate(shards):
        out.index_copy_(dim, varlen_token_index(cu_seqlens, layout, rank, world_size, by_document=by_document,
                                                device=s.device, ulysses_degree=ulysses_degree), s)
    return out
