"""How a global sequence maps onto the ranks of a context-parallel group.

``contiguous``: rank r holds tokens ``[r*S/W, (r+1)*S/W)``.
``zigzag``: the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r,
so every rank has the same amount of causal work (also called head-tail).
``stripe``: token t lives on rank t mod W (Brandon et al., "Striped Attention", 2023).
"""

from __future__ import annotations

import torch

from . import LAYOUT_CHUNKS

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
    raise ValueError(f"layout {layout!r} is unknown; choose one of {', '.join(LAYOUTS)}")


def token_index(layout: str, seqlen: int, rank: int, world_size: int, device=None) -> Tensor:
    """Return the global positions ``rank`` holds, int64 ``[seqlen / W]``, in local order.

    Useful for position ids and labels, which must be permuted as the tokens are.

    Raises:
        ValueError: when ``seqlen`` is not a multiple of ``required_multiple(layout, W)``.
    """
    n = required_multiple(layout, world_size)
    if seqlen % n:
        raise ValueError(f"seqlen {seqlen} is not a multiple of {n}, which the {layout} layout "
                         f"needs at world_size {world_size}")
    if layout == "stripe":
        return torch.arange(rank, seqlen, world_size, device=device)
    c = seqlen // n
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                      for i in chunk_ids(layout, rank, world_size)])


def shard(x: Tensor, layout: str, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Take ``rank``'s shard of the global tensor ``x`` along ``dim`` (a new contiguous tensor).

    Raises:
        ValueError: when ``x.shape[dim]`` is not a multiple of ``required_multiple(layout, W)``.
    """
    idx = token_index(layout, x.shape[dim], rank, world_size, device=x.device)
    return x.index_select(dim, idx)


def unshard(shards: list[Tensor], layout: str, dim: int = 1) -> Tensor:
    """Rebuild the global tensor from every rank's shard, ``shards[r]`` being rank r's."""
    world_size = len(shards)
    local = shards[0].shape[dim]
    seqlen = local * world_size
    out = torch.empty_like(torch.cat(shards, dim=dim))
    for rank, s in enumerate(shards):
        out.index_copy_(dim, token_index(layout, seqlen, rank, world_size, device=s.device), s)
    return out
