"""What the local attention backends share: the shape checks of a call (batch and packed
documents), the dtype they accumulate in, the sliding window's band (``band_of``, ``band_mask``),
a call's mask by global positions (:class:`PositionMask`),
ringbench's ``-inf`` mark of a row that sees no key, the rows of packed documents, and whether a
CUDA device is visible. The contract itself is in the docstring of :mod:`kernels`.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are accumulated in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def running_lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an engine holds a row's running lse in while it merges block results over many
    steps: float64 for float32 and float64 inputs, float32 for bfloat16 and float16.

    A float32 running lse takes one float32 rounding per merge, W - 1 on a ring of W ranks, and the
    backward's probabilities ``exp(s - lse)`` carry that error into every gradient; held in float64
    and rounded once at the end (to :func:`accumulation_dtype`), it is as good as one kernel's
    lse. bf16 and fp16 inputs keep float32: their own rounding dominates, and the fused merge (CUDA)
    takes no float64.
    """
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def expand_kv(x: Tensor, groups: int) -> Tensor:
    """K or V ``[..., Hkv, D]`` with each head repeated ``groups`` times, ``[..., Hkv * groups, D]``,
    for a kernel call that takes no GQA (head j serves query heads j*groups .. j*groups + groups - 1)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-2)


def reduce_kv(dx: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`expand_kv`: ``[..., Hkv * groups, D]`` summed over each group to
    ``[..., Hkv, D]``, in ``dx``'s dtype."""
    return dx if groups == 1 else dx.unflatten(-2, (dx.shape[-2] // groups, groups)).sum(-2)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         "[B, S, H, D] with k and v alike but for v's head dim (head_dim_v)")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError("attention over an empty sequence is undefined; give at least one token")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads {q.shape[2]} is not a multiple of kv_heads {k.shape[2]}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"a causal block needs Sq == Sk, got {q.shape[1]} and {k.shape[1]}")


def _empty_rows_to_neg_inf(lse: Tensor) -> Tensor:
    # FlashAttention marks a row with no visible key by lse = +inf; ringbench uses -inf.
    return lse.masked_fill(lse == math.inf, -math.inf)


Window = tuple  # (left, right): ints >= 0 or None (unbounded on that side)


def window_band(window: int | None) -> Window | None:
    """The band of a causal sliding window of ``window`` keys, as the kernels take it:
    ``(window - 1, 0)``, each query seeing itself and the ``window - 1`` keys before it; ``None``
    for no window (0 or ``None``)."""
    return (window - 1, 0) if window else None


def band_of(window, causal: bool) -> Window | None:
    """The band a call attends, ``(left, right)``, or ``None`` for the plain mask of ``causal``.

    Raises:
        ValueError: a side that is negative (flash-attn's -1 is ``None`` here).
    """
    if window is None:
        return None
    left, right = window
    for side, value in (("left", left), ("right", right)):
        if value is not None and value < 0:
            raise ValueError(f"window {side} {value} is negative; pass a width of 0 or more, or None for unbounded")
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def band_mask(sq: int, sk: int, band: Window, device=None, row0: int = 0) -> Tensor:
    """bool ``[sq, sk]``: which keys each query row sees under ``band``; row i's diagonal key
    is ``i + row0`` (``sk - sq`` for a whole call, bottom-right aligned; more for a later chunk)."""
    rows = torch.arange(sq, device=device)[:, None] + row0
    keys = torch.arange(sk, device=device)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    left, right = band
    if left is not None:
        seen &= keys >= rows - left
    if right is not None:
        seen &= keys <= rows + right
    return seen


class PositionMask:
    """Which keys each query of one kernel call sees, by global position: the mask-taking kernels'
    ``mask=`` (``Kernel.takes_mask``).

    A call's query row i is at global position ``q_pos[i]`` and its key row j at ``k_pos[j]``;
    row i sees key j iff ``allows(q_pos[i], k_pos[j])``. That is what a FlexAttention ``mask_mod``
    is made of (``lambda b, h, i, j: allows(q_pos[i], k_pos[j])``); the math kernel reads
    :meth:`dense`, built on the first call and kept, so forward and backward (and every call of a
    schedule that keeps this object) share one.

    Args:
        q_pos: int64 ``[Sq]``, the queries' global positions, on the call's device.
        k_pos: int64 ``[Sk]``, the keys'.
        allows: ``(q, k) -> bool tensor``, elementwise over integer tensors that broadcast
            (``masks.Mask.allows``).
        name: the mask's text, for messages.
        dense: the bool ``[Sq, Sk]`` block itself where the caller has it (built cheaper than by
            ``allows`` over every pair, such as ``masked.dense_mask`` for a whole row), or ``None``.
    """

    def __init__(self, q_pos: Tensor, k_pos: Tensor, allows, name: str = "", dense: Tensor | None = None):
        self.q_pos, self.k_pos, self.allows, self.name = q_pos, k_pos, allows, name
        if dense is not None and tuple(dense.shape) != (q_pos.numel(), k_pos.numel()):
            raise ValueError(f"the dense mask is {tuple(dense.shape)}, but the positions are {q_pos.numel()} queries "
                             f"and {k_pos.numel()} keys; build it over the same positions")
        self._dense: Tensor | None = dense

    @property
    def shape(self) -> tuple[int, int]:
        return self.q_pos.numel(), self.k_pos.numel()

    def dense(self) -> Tensor:
        """bool ``[Sq, Sk]``: True where row i sees key j (built once, then kept)."""
        if self._dense is None:
            self._dense = self.allows(self.q_pos[:, None], self.k_pos[None, :])
        return self._dense

    def __repr__(self) -> str:
        return f"PositionMask({self.name!r}, {self.shape[0]}x{self.shape[1]})"


def check_mask(mask: PositionMask, q: Tensor, k: Tensor, causal: bool, window) -> None:
    """Refuse a mask call the contract does not take: a mask with ``causal`` or a window, or one whose
    positions do not match the call's rows."""
    if causal or window is not None:
        raise ValueError("a call with a mask takes neither causal=True nor a window: the mask alone says which keys "
                         "each query sees; pass causal=False and window=None")
    if mask.shape != (q.shape[1], k.shape[1]):
        raise ValueError(f"the mask holds {mask.shape[0]} query and {mask.shape[1]} key positions, but the call has "
                         f"{q.shape[1]} query and {k.shape[1]} key rows; build it from the call's rows")


def _cuda_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _check_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor) -> None:
    # Shapes and dtypes only: reading the offsets would synchronise a GPU.
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         "[1, S, H, D] packed rows with k and v alike but for v's head dim (head_dim_v)")
    if q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"packed documents come as one row, but q {tuple(q.shape)} and k {tuple(k.shape)} "
                         "have batch > 1; pack the sequences into one row and pass their cu_seqlens")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads {q.shape[2]} is not a multiple of kv_heads {k.shape[2]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} is {cu.dtype} of shape {tuple(cu.shape)}, but it must be a 1-D int32 "
                             "tensor of document offsets; pass cu_seqlens.to(torch.int32)")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} documents and cu_seqlens_k "
                         f"{cu_seqlens_k.numel() - 1}; both must describe the same documents")


def _packed_positions(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """(document, position within it) of every packed row, on cu_seqlens' device."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    doc = torch.searchsorted(cu_seqlens[1:].contiguous(), rows, right=True)
    return doc, rows.long() - cu_seqlens.long()[doc]


def merge_(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's partial attention into the running result, in place.

    The result is the attention over the union of both key sets. With
    ``w = sigmoid(block_lse - lse)`` it is ``out + w * (block_out - out)`` and
    ``logaddexp(lse, block_lse)``: no exponential of a positive number is ever taken, so a gap
    of any size between the two lse values neither overflows nor loses the larger term. An lse
    of ``-inf`` (a row that saw no key) contributes nothing, on either side.

    Args:
        out: float32 (or float64) ``[B, S, H, D]``, the running output; updated in place.
        lse: float32 or float64 (at least ``out``'s precision), ``[B, H, S]``, the running
            log-sum-exp; updated in place.
        block_out: ``[B, S, H, D]`` in any float dtype, the block's output.
        block_lse: ``[B, H, S]``, the block's log-sum-exp.

    Source: the online-softmax rescaling of Milakov and Gimelshein, "Online normalizer
    calculation for softmax" (2018), written in sigmoid/logaddexp form because the naive
    ``lse + log(1 + exp(block_lse - lse))`` overflows in float32 once the gap passes ~88, a
    failure users of ring attention have reported.
    """
    diff = block_lse - lse
    # Both -inf: nan; neither side has anything, so the block adds nothing.
    weight = torch.sigmoid(diff).nan_to_num_(nan=0.0)
    # lse may be held more precisely than out (a float64 running lse, running_lse_dtype).
    out.lerp_(block_out.to(out.dtype), weight.transpose(1, 2).unsqueeze(-1).to(out.dtype))
    torch.logaddexp(lse, block_lse, out=lse)
