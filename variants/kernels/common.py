"""What the local attention backends share: the shape checks of a call (batch and packed
documents), the dtype they accumulate in, the sliding window's band (``band_of``, ``band_mask``),
a call's mask by global positions (:class:`PositionMask`), an attention bias and a call's block of it
(:class:`Bias`, :class:`PositionBias`),
ringbench's ``-inf`` mark of a row that sees no key, the rows of packed documents, and whether a
CUDA device is visible. The contract itself is in the docstring of :mod:`kernels`.
"""

from __future__ import annotations

import math

import torch

from ..rules import BIAS_KINDS, BIAS_SHAPES

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
        slices: the predicate as data where the caller has it: ``(q0, q1, k0, k1, lo, hi)`` per slice
            (``masks.Slice``; ``allows`` is their union), ``None`` on an unbounded side of the band. flex's
            compiled ``mask_mod`` reads them from a tensor, so it compiles once per slice count, not per
            mask; ``None``: it calls ``allows``.
    """

    def __init__(self, q_pos: Tensor, k_pos: Tensor, allows, name: str = "", dense: Tensor | None = None,
                 slices: tuple | None = None):
        self.q_pos, self.k_pos, self.allows, self.name, self.slices = q_pos, k_pos, allows, name, slices
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


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's per-head slopes: ``2 ** (-8 (h + 1) / H)`` for head h of H when H is a power of two;
    otherwise the slopes of the largest power of two n below H, then every other slope of 2n
    for the remaining H - n heads (the paper's interpolation).

    Source: Press, Smith and Lewis, "Train Short, Test Long: Attention with Linear Biases Enables
    Input Length Extrapolation" (ICLR 2022, arXiv 2108.12409), section 3.
    """
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    if heads < 1:
        raise ValueError(f"heads {heads} must be positive for ALiBi's slopes")
    n = 1 << (heads.bit_length() - 1)
    return geometric(n) if n == heads else geometric(n) + geometric(2 * n)[0::2][:heads - n]


def bias_tensor_shape(kind: str, batch: int, heads: int, seqlen: int) -> tuple[int, int, int, int]:
    """The ``[b, h, s_q, s_k]`` shape of a learnable bias of ``kind`` (one of :data:`BIAS_SHAPES`),
    a broadcast dimension 1.

    Raises:
        ValueError: a kind that is not a learnable shape.
    """
    if kind not in BIAS_SHAPES:
        raise ValueError(f"bias {kind!r} is not a learnable shape; choose one of {', '.join(BIAS_SHAPES)}")
    sizes = {"b": batch, "h": heads, "s": seqlen, "1": 1}
    return tuple(sizes[c] for c in kind)  # type: ignore[return-value]



def bias_learns(kind: str) -> bool:
    """Whether a ``--bias`` of ``kind`` is a learnable tensor with a gradient (every shape but ``alibi``)."""
    return bool(kind) and kind != "alibi"

class Bias:
    """An attention bias over the whole sequence, added to the scaled scores before the softmax.

    ``alibi``: ``-slope_h * |q_pos - k_pos|`` (the distance taken both ways, so a non-causal or
    bidirectional mask gets a bias too; under a causal mask it is the paper's
    ``-slope_h * (q_pos - k_pos)``), fixed. A learnable shape (:data:`BIAS_SHAPES`): ``values``
    of :func:`bias_tensor_shape`, indexed by the global positions; its gradient is the gradient
    of the scores, summed over the broadcast dimensions.

    An engine hands a kernel call a :class:`PositionBias` (:meth:`at`) of the call's rows; the
    kernels' backward adds each call's ``d bias`` into :attr:`grad` while an engine has opened one
    (:meth:`open_grad`), and the engine reduces it over its ranks.

    Args:
        kind: ``alibi`` or a shape of :data:`BIAS_SHAPES`.
        values: ALiBi's slopes ``[Hq]``; or the learnable tensor ``[b|1, h|1, s|1, s]`` (float).
    """

    def __init__(self, kind: str, values: Tensor):
        if kind not in BIAS_KINDS:
            raise ValueError(f"bias {kind!r} is not one ringbench takes; choose one of {', '.join(BIAS_KINDS)}")
        want = 1 if kind == "alibi" else 4  # dimensions
        if not isinstance(values, Tensor) or values.dim() != want or not values.is_floating_point():
            raise ValueError(f"bias {kind} takes a float tensor "
                             f"{'[Hq], the slopes' if kind == 'alibi' else '[b|1, h|1, s|1, s]'}, got "
                             f"{tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__}")
        self.kind, self.values = kind, values
        self.grad: Tensor | None = None

    @property
    def learnable(self) -> bool:
        return bias_learns(self.kind)

    @property
    def seqlen(self) -> int | None:
        """The sequence length the learnable tensor is over (``None`` for ALiBi, which takes any)."""
        return None if self.kind == "alibi" else self.values.shape[-1]

    def heads(self) -> int | None:
        """Query heads the bias is per (``None``: broadcast over the heads)."""
        if self.kind == "alibi":
            return self.values.shape[0]
        return self.values.shape[1] if self.kind[1] == "h" else None

    def with_values(self, values: Tensor) -> "Bias":
        """The same bias over other values (the references' float64 copy)."""
        return Bias(self.kind, values)

    def open_grad(self, dtype: torch.dtype) -> Tensor:
        """Start :attr:`grad`: zeros of ``values``' shape in ``dtype`` (learnable shapes only)."""
        self.grad = torch.zeros(self.values.shape, dtype=dtype, device=self.values.device)
        return self.grad

    def close_grad(self) -> Tensor | None:
        grad, self.grad = self.grad, None
        return grad

    def at(self, q_pos: Tensor, k_pos: Tensor, heads: slice | None = None) -> "PositionBias":
        """The :class:`PositionBias` of a call whose rows sit at ``q_pos`` and keys at ``k_pos``
        (int64), over query heads ``heads`` of the bias (``None``: all)."""
        return PositionBias(self, q_pos, k_pos, heads)

    def __repr__(self) -> str:
        return f"Bias({self.kind!r}, {tuple(self.values.shape)})"


class PositionBias:
    """A call's block of a :class:`Bias`, by global positions: the bias-taking kernels' ``bias=``
    (``Kernel.takes_bias``).

    Args:
        bias: the whole-sequence :class:`Bias`.
        q_pos: int64 ``[Sq]``, the call's query rows' global positions.
        k_pos: int64 ``[Sk]``, its keys'.
        heads: the bias's query heads this call's heads are (a slice; ``None``: all of them).
    """

    def __init__(self, bias: Bias, q_pos: Tensor, k_pos: Tensor, heads: slice | None = None):
        self.bias, self.q_pos, self.k_pos, self.heads = bias, q_pos, k_pos, heads

    @property
    def shape(self) -> tuple[int, int]:
        return self.q_pos.numel(), self.k_pos.numel()

    def sub(self, rows: slice, keys: slice) -> "PositionBias":
        """The block of a part of the call: query rows ``rows`` and keys ``keys`` of it."""
        return PositionBias(self.bias, self.q_pos[rows], self.k_pos[keys], self.heads)

    def dense(self, dtype: torch.dtype) -> Tensor:
        """The block ``[Bb, Hb, Sq or 1, Sk]`` in ``dtype``: ``Bb`` 1 or the batch, ``Hb`` 1 or the
        call's heads, one row where the bias has one (``111s``); differentiable in ``values``."""
        b = self.bias
        values = b.values
        if b.kind == "alibi":
            slopes = values if self.heads is None else values[self.heads]
            dist = (self.q_pos[:, None] - self.k_pos[None, :]).abs().to(dtype)
            return -slopes.to(dtype)[None, :, None, None] * dist[None, None]
        if values.shape[1] > 1 and self.heads is not None:
            values = values[:, self.heads]
        k_pos = self.k_pos.to(values.device)
        if values.shape[2] > 1:
            values = values.index_select(2, self.q_pos.to(values.device))
        return values.index_select(3, k_pos).to(dtype)

    def add_grad(self, grad: Tensor) -> None:
        """Add a call's ``d bias`` (``dense``'s shape) into the bias's open :attr:`Bias.grad` at the
        call's positions; nothing for a fixed bias or while no gradient is open."""
        b = self.bias
        if not b.learnable or b.grad is None:
            return
        target = b.grad if b.grad.shape[1] == 1 or self.heads is None else b.grad[:, self.heads]
        s = target.shape[-1]
        rows = self.q_pos if target.shape[2] > 1 else torch.zeros(1, dtype=torch.int64, device=target.device)
        flat = (rows.to(target.device)[:, None] * s + self.k_pos.to(target.device)[None, :]).reshape(-1)
        view = target.reshape(*target.shape[:2], -1) if target.is_contiguous() else None
        if view is not None:
            view.index_add_(2, flat, grad.reshape(*grad.shape[:2], -1).to(target.dtype))
        else:  # a head slice of the gradient: add through a copy, then put it back
            whole = target.reshape(*target.shape[:2], -1).clone()
            whole.index_add_(2, flat, grad.reshape(*grad.shape[:2], -1).to(target.dtype))
            target.copy_(whole.view(target.shape))

    def __repr__(self) -> str:
        return f"PositionBias({self.bias.kind!r}, {self.shape[0]}x{self.shape[1]}, heads={self.heads})"


def check_bias(bias: PositionBias, q: Tensor, k: Tensor) -> None:
    """Refuse a bias call the contract does not take: positions that do not match the call's rows,
    or per-head values for another number of heads."""
    if bias.shape != (q.shape[1], k.shape[1]):
        raise ValueError(f"the bias holds {bias.shape[0]} query and {bias.shape[1]} key positions, but the call has "
                         f"{q.shape[1]} query and {k.shape[1]} key rows; build it from the call's rows")
    heads = bias.bias.heads()
    if heads is not None:
        n = len(range(heads)[bias.heads]) if bias.heads is not None else heads
        if n != q.shape[2]:
            raise ValueError(f"the bias holds {n} query heads, but the call has {q.shape[2]}; pass the call's heads")


def check_mask(mask: PositionMask, q: Tensor, k: Tensor, causal: bool, window) -> None:
    """Refuse a mask call the contract does not take: a mask with ``causal`` or a window, or one whose
    positions do not match the call's rows."""
    if causal or window is not None:
        raise ValueError("a call with a mask takes neither causal=True nor a window: the mask alone says which keys "
                         "each query sees; pass causal=False and window=None")
    if mask.shape != (q.shape[1], k.shape[1]):
        raise ValueError(f"the mask holds {mask.shape[0]} query and {mask.shape[1]} key positions, but the call has "
                         f"{q.shape[1]} query and {k.shape[1]} key rows; build it from the call's rows")


def device_arch() -> str | None:
    """The visible GPU's architecture as ``Kernel.check_arch`` reads it: ``sm<major><minor>`` (``sm90``)
    on CUDA, its LLVM target (``gfx942``) on ROCm; ``None`` where no GPU is visible."""
    if not torch.cuda.is_available():
        return None
    if torch.version.hip:
        return torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


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
