"""The per-head maximum logit (``--max-logit``): the largest scaled, masked (and biased) score
``q_i . k_j * softmax_scale (+ bias)`` of each query head over the batch and every pair a mask
leaves, the quantity QK-clip (MuonClip) reads to rescale a head's query and key projections;
TransformerEngine's ``return_max_logit``.

A :class:`MaxLogit` is a running maximum that a kernel call raises (``forward(...,
max_logit=...)``, on the kernels with ``Kernel.takes_max_logit``: math). It is computed from the
very scores the call's softmax uses, after its mask, window and bias, so there is no second copy
of the attention. An engine hands its kernel calls the accumulator of the heads they hold
(:meth:`MaxLogit.heads`) and, after its forward, reduces it with a MAX over its group
(``engines.comm.all_reduce_max``), so every rank ends with the whole sequence's ``[Hq]``.

Source: issue 26 item 2; Kimi K2's MuonClip (arXiv 2507.20534) reads this per-head maximum.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

Tensor = torch.Tensor


class MaxLogit:
    """A running per-head maximum of the scores a kernel's calls meet.

    Attributes:
        values: ``[H]`` float32 (float64 for float64 inputs), ``-inf`` for a head that met no
            unmasked pair yet; updated in place, so a view of another accumulator's heads
            (:meth:`heads`) raises that one's.
    """

    def __init__(self, values: Tensor):
        if values.dim() != 1:
            raise ValueError(f"max logit values of shape {tuple(values.shape)} must be one per head, [H]; "
                             "build them with MaxLogit.empty(heads, dtype, device)")
        self.values = values

    @classmethod
    def empty(cls, heads: int, dtype: torch.dtype, device) -> "MaxLogit":
        """An accumulator of ``heads`` heads that has met nothing: ``-inf`` each, of ``dtype``."""
        return cls(torch.full((heads,), float("-inf"), dtype=dtype, device=device))

    def heads(self, sel: slice) -> "MaxLogit":
        """The accumulator of heads ``sel`` alone, sharing this one's storage."""
        return MaxLogit(self.values[sel])

    def meet(self, scores: Tensor) -> None:
        """Raise each head's maximum to that of a tile of scores.

        Args:
            scores: ``[B, H, ..., Sq, Sk]`` (the math kernel's ``[B, Hkv, G, Sq, Sk]``, heads
                ``kv * G + g``), masked pairs ``-inf``; an empty tile changes nothing.

        Raises:
            ValueError: the tile holds another number of heads than the accumulator.
        """
        if scores.numel() == 0:
            return
        per_head = scores.amax(dim=(0, -2, -1)).flatten()
        if per_head.numel() != self.values.numel():
            raise ValueError(f"a tile of scores holds {per_head.numel()} heads, but the max logit accumulator "
                             f"holds {self.values.numel()}; pass the accumulator of the call's heads "
                             "(MaxLogit.heads)")
        self.values.copy_(torch.maximum(self.values, per_head.to(self.values.dtype)))


def with_max_logit(kernel, max_logit: MaxLogit | None):
    """``kernel`` (a ``kernels.Kernel``) whose batch forward raises ``max_logit`` at every call; the
    kernel itself where ``max_logit`` is ``None``.

    Raises:
        ValueError: a kernel that cannot return the max logit (``Kernel.takes_max_logit``).
    """
    if max_logit is None:
        return kernel
    if not kernel.takes_max_logit:
        raise ValueError(f"the {kernel.name} kernel cannot return the per-head max logit ({kernel.no_max_logit}); "
                         "pass --kernel math")
    return dataclasses.replace(kernel, forward=functools.partial(kernel.forward, max_logit=max_logit))
