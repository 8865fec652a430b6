"""The sliding window in the ring engine: each step's block as the parts its window leaves.

The parts of a step (:class:`RingParts`, :func:`attend`) serve any mask that cuts blocks into
kernel calls: the window's band parts (``bands.Part``) and a mask's parts (``masked.MaskPart``),
each part giving its own kernel keywords (``Part.keywords()``).

With ``window=L`` the ring engine (``ring.run_ring``) no longer asks the variant's plan which
rows meet: it takes the global positions of this rank's query rows and of the visiting block's
key rows (``bands``: contiguous, zigzag and stripe, batch or document by document) and keeps
the pairs inside the window. A step whose block lies wholly outside every query's window
makes no kernel call. One that is left is one or more :class:`bands.Part` (zigzag's two
chunks make up to four), each one kernel call with its own flash-attn window, merged here
into the step's result over all local rows; the engine then merges that as it merges any
block. Backward sums the parts' gradients the same way.

Transfers: in forward the ring stops after the last step some rank needs (:attr:`WindowParts.n_steps`;
contiguous ``ring`` with a window shorter than a rank's chunk needs step 1 only), so later K/V
are neither sent nor waited on. Backward keeps every step's transfer, because dK/dV must
travel the whole ring back to their owner; its steps outside the window make no kernel call.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from . import bands, merge
from ..kernels.common import accumulation_dtype
from ..kernels import Kernel

Tensor = torch.Tensor


def check_window(window, causal: bool, prefix: str = "") -> None:
    """Refuse a window a variant cannot take.

    Raises:
        ValueError: a window that is not a positive int, or one without the causal mask (the
            message starts with ``prefix``).
    """
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{prefix}window {window!r} must be a positive number of keys (each query sees the "
                         "window's most recent keys, itself included); pass window=4096, or None for none")
    if not causal:
        raise ValueError(f"{prefix}a sliding window is causal (query p sees keys p - window + 1 .. p), so it needs "
                         "causal=True; pass causal=True or window=None")


class RingParts:
    """``(step, source) -> parts | None`` of one rank's ring, from what every rank's blocks hold.

    Args:
        rank, world_size: this rank and the ring's size.
        parts_of: ``(r, source, mine) -> parts``: the parts of rank r's queries against the K/V
            block of rank ``source``, empty where none; ``mine`` is False for the other ranks, whose
            parts are only asked whether there are any (so they may be cheaper stand-ins).
        reach: the ring's length where the caller has it (:func:`ring_reach`, the same for every
            rank, so worked out once per case); None: worked out here from ``parts_of``.

    Attributes:
        n_steps: ring steps until the last one in which some rank has a part (at least 1).
    """

    def __init__(self, rank: int, world_size: int, parts_of: Callable[[int, int, bool], Sequence],
                 reach: int | None = None):
        self.parts = {}
        for step in range(world_size):
            parts = parts_of(rank, (rank - step) % world_size, True)
            if parts:
                self.parts[step] = parts
        if reach is None:
            reach = ring_reach(world_size, lambda r, source: bool(parts_of(r, source, False)))
        self.n_steps = max([reach, *(step + 1 for step in self.parts)])

    def __call__(self, step: int, source: int):
        return self.parts.get(step)


def ring_reach(world_size: int, any_parts: Callable[[int, int], bool]) -> int:
    """Ring steps until the last one in which some rank has a part (at least 1): every rank runs
    that many, so the ring's transfers pair up. ``any_parts(r, source)``: whether rank r's queries
    meet rank ``source``'s keys. Each rank is scanned from the last step down to the reach found so
    far, so a short ring (a narrow window) costs about ``world_size`` questions per rank."""
    reach = 1
    for r in range(world_size):
        for step in range(world_size - 1, reach - 1, -1):
            if any_parts(r, (r - step) % world_size):
                reach = step + 1
                break
    return reach


@functools.lru_cache(maxsize=16)
def _window_reach(runs: tuple, window: int) -> int:
    # Kept per case: every rank of one ring asks the same question.
    return ring_reach(len(runs), lambda r, source: bool(bands.block_parts(runs[r], runs[source], window)))


class WindowParts(RingParts):
    """:class:`RingParts` under a sliding window, from the runs of every rank.

    Args:
        runs_of: ``rank -> list[bands.Run]``, the positions every rank holds (the same on all ranks).
        rank, world_size: this rank and the ring's size.
        window: keys each query sees, itself included.
    """

    def __init__(self, runs_of: Callable[[int], Sequence[bands.Run]], rank: int, world_size: int, window: int):
        runs = tuple(tuple(runs_of(r)) for r in range(world_size))
        super().__init__(rank, world_size, lambda r, source, mine: bands.block_parts(runs[r], runs[source], window),
                         reach=_window_reach(runs, window))


def _whole(parts, q: Tensor, k: Tensor) -> bool:
    return len(parts) == 1 and parts[0].q == (0, q.shape[1]) and parts[0].kv == (0, k.shape[1])


def _with_bias(part, bias) -> dict:
    # A part's kernel keywords, with its block of the step's bias (a PositionBias over the step's rows).
    kw = part.keywords()
    if bias is not None:
        kw["bias"] = bias.sub(slice(*part.q), slice(*part.kv))
    return kw


def attend(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, parts, scale: float,
           bias=None) -> tuple[Tensor, Tensor]:
    """out ``[B, Sq, Hq, Dv]`` and lse ``[B, Hq, Sq]`` of one step cut into parts over all of q's rows: the
    parts' kernel calls merged (float32, or float64 for float64 inputs; a single part that covers
    the block is the kernel's own result) by ``merge.merge_step``, one launch a part on CUDA;
    rows no part covers get out 0 and lse ``-inf``. ``bias`` (a ``PositionBias`` of the step's
    rows and keys, or ``None``): each part takes its block of it."""
    if _whole(parts, q, k):
        return kernel.forward(q, k, v, False, scale, **_with_bias(parts[0], bias))
    acc = accumulation_dtype(q.dtype)
    B, S, H = q.shape[:3]
    out = torch.zeros(B, S, H, v.shape[3], dtype=acc, device=q.device)  # v's head dim (head_dim_v)
    lse = torch.full((B, H, S), float("-inf"), dtype=acc, device=q.device)
    for p in parts:
        rows, keys = slice(*p.q), slice(*p.kv)
        o, l = kernel.forward(q[:, rows], k[:, keys], v[:, keys], False, scale, **_with_bias(p, bias))
        out = merge.merge_step(out, lse, rows, o, l, into=acc)  # in place: out is already acc
    return out, lse


def attend_backward(kernel: Kernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    parts, scale: float, bias=None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one step cut into parts (``out`` and ``lse`` the final ones of q's rows): the
    parts' gradients summed (float32, or the kernel's own for a single part that covers the block),
    dq, dk and dv of a part in one ``merge.add_steps`` launch on CUDA; ``bias`` as in :func:`attend`."""
    if _whole(parts, q, k):
        return kernel.backward(dout, q, k, v, out, lse, False, scale, **_with_bias(parts[0], bias))
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for p in parts:
        rows, keys = slice(*p.q), slice(*p.kv)
        g = kernel.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
                            False, scale, **_with_bias(p, bias))
        dq, dk, dv = merge.add_steps([(dq, rows, g[0], acc, None, None), (dk, keys, g[1], acc, None, None),
                                      (dv, keys, g[2], acc, None, None)])  # in place: each is already acc
    return dq, dk, dv
