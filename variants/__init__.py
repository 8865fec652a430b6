"""ringbench.variants: the context-parallel attention algorithms under test, and their registry.

The registry is plain data and imports no torch, so the harness can refuse a bad spec
before any process starts. A variant's code is imported only when its ``attention`` is used.

Every variant's ``attention(q, k, v, *, causal, softmax_scale, group, kernel, cu_seqlens=None)``
takes this rank's shards ``[B, S/W, H, D]`` in the variant's layout and returns
``(out, lse)``: out in q's dtype and layout, differentiable; lse float32 ``[B, Hq, S/W]``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

#: Chunks per rank of each layout: the global seqlen must be a multiple of this times W.
LAYOUT_CHUNKS = {"contiguous": 1, "zigzag": 2}


@dataclass(frozen=True)
class Variant:
    """A registered context-parallel attention variant.

    Attributes:
        name: what users pass to ``--variant``.
        layout: how the global sequence maps to ranks (``contiguous`` or ``zigzag``).
        target: ``"module:function"`` of its attention function, relative to this package.
        summary: one line for listings.
        causal, non_causal, gqa, varlen: what it supports.
        hidden: test-only variants, left out of user-facing lists.
    """

    name: str
    layout: str
    target: str
    summary: str
    causal: bool = True
    non_causal: bool = True
    gqa: bool = True
    varlen: bool = False
    hidden: bool = False

    def seqlen_multiple(self, world_size: int) -> int:
        """The number the global seqlen must be a multiple of at ``world_size``."""
        return LAYOUT_CHUNKS[self.layout] * world_size

    def check(self, *, seqlen: int, world_size: int, causal: bool) -> str | None:
        """Return the one-sentence reason this variant refuses the shape, or ``None``."""
        if causal and not self.causal:
            return f"{self.name} does not support causal attention; pass --no-causal"
        if not causal and not self.non_causal:
            return f"{self.name} does not support non-causal attention; pass --causal"
        n = self.seqlen_multiple(world_size)
        if seqlen % n:
            rule = f"2 * world_size = {n}" if LAYOUT_CHUNKS[self.layout] == 2 else f"world_size = {n}"
            up = (seqlen // n + 1) * n
            return (f"seqlen {seqlen} is not a multiple of {rule}, which {self.name} needs; "
                    f"use {up}")
        return None

    @property
    def attention(self) -> Callable:
        """The variant's attention function (imports its module, and so torch)."""
        module, func = self.target.split(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), func)


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("ring", "contiguous", "ring:ring_attention",
                "basic ring: contiguous chunks, K/V passed around the ring"),
        Variant("zigzag", "zigzag", "zigzag:zigzag_attention",
                "ring over the zigzag layout, balanced under a causal mask"),
        Variant("broken_merge", "contiguous", "testing:broken_merge_attention",
                "test only: a ring whose merge drops the last block", hidden=True),
    )
}


def get_variant(name: str) -> Variant:
    """Return the variant registered as ``name``.

    Raises:
        ValueError: when none is; the message lists the user-facing variants.
    """
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"variant {name!r} is unknown; choose one of "
                         f"{', '.join(list_variants())}") from None


def list_variants(include_hidden: bool = False) -> list[str]:
    """Names of the registered variants, test-only ones left out unless asked for."""
    return [n for n, v in VARIANTS.items() if include_hidden or not v.hidden]
