"""The ``flex`` kernel: PyTorch's FlexAttention (``torch.nn.attention.flex_attention``) behind the
contract of :mod:`kernels`, batch form, with ringbench's masks and biases as its modifications.

A :class:`~.common.PositionMask` becomes a ``mask_mod`` over the call's positions
(``allows(q_pos[i], k_pos[j])``) and its ``BlockMask``, built once per mask object and kept beside
it (:func:`block_mask`), so forward and backward (and every call of a schedule that keeps the
object) share one; ``causal=True`` (``Sq == Sk``) is the mask ``j <= i``. A
:class:`~.common.PositionBias` becomes a ``score_mod`` adding its block (ALiBi's
``-slope_h * |q_pos - k_pos|``, or a learnable tensor's entries) to the scaled score. GQA is
flex's own (``enable_gqa``); lse is flex's, natural log (``AuxRequest(lse=True)``).

Backward. ringbench's backward gets the global (merged over every block) ``out`` and ``lse``, which
FlexAttention's backward does not take, so the block is recomputed under autograd (its own ``o_b``
and ``l_b``) and the merge's chain rule gives the block's upstream gradients: with
``w = exp(l_b - lse)`` per row and head, ``d o_b = w * dout`` and
``d l_b = w * (rowsum(dout * o_b) - rowsum(dout * out))``. Rows that see no key (``l_b = -inf``)
get ``w = 0`` and zero gradient. On CUDA the recomputation is flex itself, whose backward takes a
gradient of the returned lse (``grad_logsumexp``) and of the tensor a ``score_mod`` captures (the
bias block, from which ``d bias`` comes). This torch's flex refuses inputs that require grad on CPU
("FlexAttention does not support backward on CPU"), so on CPU the block is recomputed densely, by the
same ``score_mod`` and mask over index grids (what flex's own unfused fallback computes), and its
autograd takes the same upstream gradients.

On CUDA the fast path is ``torch.compile(flex_attention)``, compiled once per process and per block
shape on the first call (the warm-up iterations keep that out of the timed region); float64 runs
flex's unfused eager path there. On CPU flex runs its eager, unfused fallback (any float dtype,
float64 included), given float32 copies of bf16 and fp16 inputs, since that fallback rounds their
scores to the input dtype.

Source: Dong, Feng, Guessous, Liang and He, "Flex Attention: A Programming Model for Generating
Optimized Attention Kernels" (arXiv 2412.05496); the merge identity is the online-softmax
rescaling of :func:`~.common.merge_` differentiated.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref

import torch

from .common import PositionBias, PositionMask, _check_shapes, accumulation_dtype, check_bias, check_mask

Tensor = torch.Tensor

_NOTES: set[str] = set()
#: BlockMask per PositionMask object and device, dropped with the mask.
_BLOCK_MASKS: "weakref.WeakKeyDictionary[PositionMask, dict]" = weakref.WeakKeyDictionary()


def notes() -> list[str]:
    """What the records should say about how this process ran flex (compiled or eager, CPU backward)."""
    return sorted(_NOTES)


@functools.lru_cache(maxsize=None)
def _compiled():
    # One compiled flex per process; dynamo compiles again per new shape, on the first (warm-up) call.
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


def _flex(device: torch.device, dtype: torch.dtype):
    if device.type == "cuda" and dtype != torch.float64:
        _NOTES.add("flex: torch.compile(flex_attention), compiled on the first call of each block shape, "
                   "which the warm-up iterations keep out of the timed region")
        return _compiled()
    _NOTES.add("flex on cpu: FlexAttention's eager, unfused fallback (bf16 and fp16 inputs as float32 copies)"
               if device.type == "cpu" else
               f"flex on {device.type} ({str(dtype).removeprefix('torch.')}): FlexAttention's eager, unfused fallback")
    return _eager


def _eager(*args, **kwargs):
    # The eager fallback is chosen here and named in the record's notes; torch's warning that it runs
    # without torch.compile would only repeat that, in a dozen lines on every command's console.
    from torch.nn.attention.flex_attention import flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
        return flex_attention(*args, **kwargs)


def _causal_mod(b, h, i, j):
    return j <= i


def _position_mod(mask: PositionMask):
    q_pos, k_pos, allows = mask.q_pos, mask.k_pos, mask.allows
    if mask.slices is None:
        def mask_mod(b, h, i, j):
            return allows(q_pos[i], k_pos[j])
        return mask_mod
    # The slices as data: python constants in the predicate would make dynamo compile once per mask.
    far = 1 << 62  # an unbounded side of a band
    bounds = torch.tensor([(q0, q1, k0, k1, -far if lo is None else lo, far if hi is None else hi)
                           for q0, q1, k0, k1, lo, hi in mask.slices], dtype=torch.int64,
                          device=q_pos.device).reshape(-1, 6)
    count = bounds.shape[0]

    def sliced_mod(b, h, i, j):
        q, k = q_pos[i], k_pos[j]
        seen = q < 0  # no pair: positions are never negative
        for s in range(count):
            seen = seen | ((q >= bounds[s, 0]) & (q < bounds[s, 1]) & (k >= bounds[s, 2]) & (k < bounds[s, 3])
                           & (k - q >= bounds[s, 4]) & (k - q <= bounds[s, 5]))
        return seen
    return sliced_mod


def _create(mask_mod, sq: int, sk: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask
    # On CUDA the compiled builder never holds the dense [Sq, Sk] block.
    return create_block_mask(mask_mod, None, None, sq, sk, device=device, _compile=device.type == "cuda")


@functools.lru_cache(maxsize=64)
def _causal_block_mask(s: int, device: torch.device):
    return _create(_causal_mod, s, s, device)


def block_mask(mask: PositionMask, device: torch.device):
    """The ``BlockMask`` of ``mask`` on ``device``: built on the first call, kept while the mask lives."""
    held = _BLOCK_MASKS.setdefault(mask, {})
    if device not in held:
        held[device] = _create(_position_mod(mask), *mask.shape, device)
    return held[device]


def _bias_mod(bias: PositionBias, q: Tensor, k: Tensor, block: Tensor | None):
    """The ``score_mod`` adding ``bias``'s block to the scaled score: ALiBi by its slopes, a learnable
    bias by ``block`` (its ``[Bb, Hb, Sq|1, Sk]`` entries, a leaf whose gradient is ``d bias``). Its
    indices may be scalars (flex) or broadcasting grids (the dense recomputation)."""
    acc = accumulation_dtype(q.dtype)
    if bias.bias.kind == "alibi":
        slopes = bias.bias.values if bias.heads is None else bias.bias.values[bias.heads]
        # Copies: the mask_mod may capture these same position tensors, and dynamo's guards fail on a
        # tensor captured twice under two names (IndexError in its aliasing guard, torch 2.13).
        slopes, q_pos, k_pos = slopes.to(q.device, acc), bias.q_pos.to(q.device).clone(), bias.k_pos.to(q.device).clone()

        # No cast back to score's dtype: flex traces score_mod with a score of q's dtype (bf16), and a
        # cast in the graph would round the bias to bf16 inside the kernel, whose scores are float32.
        def alibi(score, b, h, i, j):
            return score - slopes[h] * (q_pos[i] - k_pos[j]).abs().to(acc)
        return alibi
    nb, nh, nq = block.shape[:3]

    def learnable(score, b, h, i, j):
        return score + block[b if nb > 1 else 0, h if nh > 1 else 0, i if nq > 1 else 0, j]
    return learnable


def _bias_block(bias: PositionBias, q: Tensor, k: Tensor) -> Tensor:
    # The learnable bias's block [Bb, Hb, Sq|1, Sk] in the accumulation dtype, as the math kernel builds it.
    check_bias(bias, q, k)
    block = bias.dense(accumulation_dtype(q.dtype)).to(q.device)
    if block.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"the bias has batch {block.shape[0]}, but the call has {q.shape[0]}; pass a bias of "
                         "batch 1 or the call's")
    return block


def _mods(q, k, v, causal, mask, bias, window, learn: bool = False):
    """(block mask or None, score_mod or None, the bias block or None) of one call, checked."""
    if window is not None:
        raise ValueError(f"the flex kernel takes no window call ({window}); a one-sided window runs on a kernel that "
                         "takes window calls (flash-attn-4, torch-flash, cpu, math)")
    if mask is not None:
        _check_shapes(q, k, v, False)
        check_mask(mask, q, k, causal, None)
        masked = block_mask(mask, q.device)
    else:
        _check_shapes(q, k, v, causal)
        masked = _causal_block_mask(q.shape[1], q.device) if causal else None
    block = None
    if bias is not None:
        if bias.bias.kind == "alibi":
            check_bias(bias, q, k)
        else:
            block = _bias_block(bias, q, k).detach().requires_grad_(learn)
    return masked, None if bias is None else _bias_mod(bias, q, k, block), block


def _run(q, k, v, scale, masked, score_mod):
    """flex over ``[B, H, S, D]`` views: out ``[B, Hq, Sq, Dv]`` and natural-log lse ``[B, Hq, Sq]``."""
    from torch.nn.attention.flex_attention import AuxRequest
    out, aux = _flex(q.device, q.dtype)(q, k, v, score_mod=score_mod, block_mask=masked, scale=scale,
                                        enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _dense(q, k, v, scale, mask, causal, score_mod):
    """The block as flex computes it, densely and differentiably (the CPU backward's recomputation):
    out ``[B, Hq, Sq, Dv]`` and lse ``[B, Hq, Sq]`` (``-inf`` for a row that sees no key), both in the
    accumulation dtype, so the backward's ``rowsum(dout * o_b)`` is the out autograd differentiates."""
    B, Hq, Sq, _ = q.shape
    acc, groups, Sk = accumulation_dtype(q.dtype), Hq // k.shape[1], k.shape[2]
    kf, vf = (x.to(acc).repeat_interleave(groups, 1) for x in (k, v))
    scores = (q.to(acc) @ kf.transpose(-1, -2)) * scale
    grid = [torch.arange(n, device=q.device).view([-1 if d == a else 1 for d in range(4)])
            for a, n in enumerate((B, Hq, Sq, Sk))]
    if score_mod is not None:
        scores = score_mod(scores, *grid)
    seen = mask.dense().to(q.device) if mask is not None else _causal_mod(*grid) if causal else None
    if seen is None:
        lse = torch.logsumexp(scores, -1)
        return torch.exp(scores - lse[..., None]) @ vf, lse
    scores = scores.masked_fill(~seen, -math.inf)
    empty = ~seen.any(-1).expand(B, Hq, Sq)
    # Empty rows: their logsumexp taken over zeros, then masked, so no NaN reaches any gradient.
    lse = torch.logsumexp(scores.masked_fill(empty[..., None], 0), -1)
    p = torch.exp(scores - lse[..., None])
    return p @ vf, lse.masked_fill(empty, -math.inf)


def _flex_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, *, window=None,
                  mask: PositionMask | None = None, bias: PositionBias | None = None) -> tuple[Tensor, Tensor]:
    """out ``[B, Sq, Hq, Dv]`` in q's dtype and lse float32 ``[B, Hq, Sq]`` (float64 for float64 inputs).

    Raises:
        ValueError: shapes the contract refuses, a mask with causal, a mask or bias of other positions,
            or a window (flex takes a window as a mask).
    """
    # CPU: flex's eager fallback multiplies q by k in their own dtype, rounding bf16 and fp16 scores to it,
    # so it gets float32 copies (the fused CUDA kernel accumulates in float32 itself).
    work = accumulation_dtype(q.dtype) if q.device.type == "cpu" else q.dtype
    with torch.no_grad():  # and detached: flex refuses inputs that require grad on CPU, even under no_grad
        masked, score_mod, _ = _mods(q, k, v, causal, mask, bias, window)
        out, lse = _run(*(x.detach().transpose(1, 2).to(work) for x in (q, k, v)), softmax_scale, masked, score_mod)
    lse = lse.to(accumulation_dtype(q.dtype))
    return out.transpose(1, 2).to(q.dtype), lse.masked_fill(lse == math.inf, -math.inf)


def _flex_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                   softmax_scale: float, *, window=None, mask: PositionMask | None = None,
                   bias: PositionBias | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv in the inputs' dtypes of one block, ``out`` ``[B, Sq, Hq, Dv]`` and ``lse`` ``[B, Hq, Sq]``
    the global (merged) ones of its rows; a learnable ``bias`` with an open gradient gets the block's
    ``d bias`` added (``PositionBias.add_grad``).

    Raises:
        ValueError: as :func:`_flex_forward`.
    """
    learn = bias is not None and bias.bias.learnable and bias.bias.grad is not None
    acc = accumulation_dtype(q.dtype)
    with torch.enable_grad():  # engines call backward inside an autograd Function's backward (grad off)
        qd, kd, vd = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
        masked, score_mod, block = _mods(q, k, v, causal, mask, bias, window, learn)
        if q.device.type == "cpu":
            _NOTES.add("flex backward on cpu: the block recomputed densely by the same score_mod and mask, since "
                       "this torch's FlexAttention has no CPU backward")
            o_b, l_b = _dense(qd, kd, vd, softmax_scale, mask, causal, score_mod)
        else:
            o_b, l_b = _run(qd, kd, vd, softmax_scale, masked, score_mod)
        l_now = l_b.detach().to(acc)
        weight = torch.where(l_now == -math.inf, 0, torch.exp(l_now - lse.to(acc)))
        do = dout.transpose(1, 2).to(acc)
        d_o = weight[..., None] * do
        d_l = weight * ((do * o_b.detach().to(acc)).sum(-1) - (do * out.transpose(1, 2).to(acc)).sum(-1))
        inputs = (qd, kd, vd) + ((block,) if learn else ())
        grads = torch.autograd.grad((o_b, l_b), inputs, (d_o.to(o_b.dtype), d_l.to(l_b.dtype)))
    if learn:
        bias.add_grad(grads[3])
    return tuple(g.transpose(1, 2).to(x.dtype) for g, x in zip(grads[:3], (q, k, v)))


def _flex_unavailable() -> str | None:
    try:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: F401
    except ImportError as exc:
        return f"this torch ({torch.__version__}) has no FlexAttention with AuxRequest ({exc})"
    return None
