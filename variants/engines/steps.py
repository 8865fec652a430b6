"""A ring step made concrete for one kernel call (:class:`Step`), what every engine's plan gives,
and the steps of a ring cut into parts (a window's, a mask's: :func:`part_steps`)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .window import RingParts

Tensor = torch.Tensor

_ALL = slice(None)


class Step(NamedTuple):
    """A plan's block made concrete for one kernel call.

    ``q`` and ``kv`` are local rows: a slice, or (varlen) int64 row indices. For packed
    documents, ``cu_q`` and ``cu_k`` are the int32 offsets of the documents within the taken
    rows, and ``max_q`` and ``max_k`` their longest lengths; ``None`` and 0 in the batch form.
    Under a sliding window or a mask, ``parts`` are its kernel calls (``window.py``, ``masked.py``),
    q and kv all rows.
    ``q_inv`` and ``kv_inv`` are the row maps of index selections, int32 ``[S/W]`` on the
    device: the block row of every local row, -1 where the block has none (the fused merge
    reads them); ``None`` for slices.
    """

    q: "slice | Tensor"
    kv: "slice | Tensor"
    causal: bool
    cu_q: Tensor | None = None
    cu_k: Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    parts: tuple = ()
    q_inv: Tensor | None = None
    kv_inv: Tensor | None = None


#: ``steps(step, source_rank) -> Step | None``: what this rank computes at each ring step.
Steps = Callable[[int, int], "Step | None"]


def part_steps(parts_of: RingParts) -> Steps:
    """The steps of a ring cut into parts (a window's, a mask's): each step's parts, q and kv all
    rows, ``None`` where a step has none; its ``n_steps`` is ``parts_of``'s."""

    def steps(step: int, source: int) -> Step | None:
        parts = parts_of(step, source)
        return None if parts is None else Step(_ALL, _ALL, False, parts=parts)

    steps.n_steps = parts_of.n_steps
    return steps
