"""The 2-D grid of process groups of the Ulysses-ring hybrids (usp), created once per group and degree.

The W ranks of a context-parallel group form R = W / U ring groups of U consecutive ranks:
rank g (its index in the group) is Ulysses rank ``g % U`` of Ulysses group ``g // U``, and
ring rank ``g // U`` of ring group ``g % U``. Ulysses groups of consecutive ranks keep the
all-to-all inside a node when ranks are numbered node by node (USP, arXiv 2405.07719;
yunchang's ``set_seq_parallel_pg`` with ``use_ulysses_low``). The layout that goes with it is
``layouts``' composed layout (``ulysses_degree``).

Group creation is collective: each rank creates its own two groups with
``use_local_synchronization`` (only their members take part), Ulysses group first, so every
rank of the context-parallel group must make its first call for a degree together, which a
variant's first forward does. The groups are cached for the life of the default process group.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from . import comm
from ..instruments import emulation


class Grid(NamedTuple):
    """This rank's two groups and its place in them."""

    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    ulysses_rank: int
    ring_rank: int
    ulysses_degree: int
    ring_degree: int


_GRIDS: dict[tuple, Grid] = {}


def process_grid(group: dist.ProcessGroup | None, ulysses_degree: int) -> Grid:
    """This rank's Ulysses and ring groups for ``ulysses_degree`` over ``group`` (default: the world).

    Under an emulation (``run --emulate``) the groups are the emulation's (``comm.new_group``),
    made again by each call and not cached here.

    Raises:
        ValueError: a degree that does not divide the group's size (the message starts ``[rank r/W]``).
    """
    ranks = comm.group_ranks(group)
    world_size, me = len(ranks), ranks.index(comm.global_rank())
    if ulysses_degree < 1 or world_size % ulysses_degree:
        raise ValueError(f"[rank {me}/{world_size}] ulysses_degree {ulysses_degree} does not divide the group's "
                         f"{world_size} ranks; pass a divisor of {world_size}")
    emulated = emulation.current() is not None
    key = (id(_c10d._get_default_group()), tuple(ranks), ulysses_degree) if not emulated else None
    grid = _GRIDS.get(key) if key else None
    if grid is None:
        u, r = me % ulysses_degree, me // ulysses_degree
        ring_degree = world_size // ulysses_degree
        ulysses_split = [[ranks[j * ulysses_degree + i] for i in range(ulysses_degree)] for j in range(ring_degree)]
        ring_split = [[ranks[j * ulysses_degree + i] for j in range(ring_degree)] for i in range(ulysses_degree)]
        # The Ulysses group first, on every rank alike (group creation is collective).
        ulysses = comm.new_group(ulysses_split, ranks[me])
        ring = comm.new_group(ring_split, ranks[me])
        grid = Grid(ulysses, ring, u, r, ulysses_degree, ring_degree)
        if key:
            _GRIDS[key] = grid
    return grid
