"""The FlashAttention-4 kernel (``flash-attn-4``): the flash-attention project's CuTe DSL kernels.

They run on Hopper (sm90) and Blackwell GPUs, take GQA natively (no K/V expansion, no dK/dV
reduction), a value head dim apart from the query/key one (``head_dim_v``, MLA shapes such as
192/128) and packed documents. ringbench calls the package's internal forward and backward
(``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd``), the pair that gives back
the lse a ring step needs and takes it again in the backward; the public ``flash_attn_func``
hides the lse behind autograd.

Both follow the conventions of :mod:`kernels` already: lse float32 ``[B, Hq, S]`` (packed:
``[Hq, total]``), ``-inf`` for a row that sees no key, and the bottom-right causal alignment of
a rectangular document. Installed with ``pip install -e '.[fa4]'`` in the checkout (package
``flash-attn-4``); its kernels compile on first use (JIT), so the first call of a shape is slow.

Source: Dao et al., FlashAttention (arXiv 2205.14135) and its successors; the package
``flash-attn-4`` (https://github.com/Dao-AILab/flash-attention, ``flash_attn/cute``).
"""

from __future__ import annotations

import functools
import math

import torch
from ringbench.errors import install_hint

from .common import expand_kv, reduce_kv

Tensor = torch.Tensor

#: The distribution that provides ``flash_attn.cute``.
DISTRIBUTION = "flash-attn-4"


@functools.lru_cache(maxsize=None)
def _interface():
    import flash_attn.cute.interface as fa4  # optional dependency: ringbench[fa4]

    return fa4


def version() -> str | None:
    """The installed ``flash-attn-4`` version, or ``None`` where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def unavailable() -> str | None:
    """Why FlashAttention-4 cannot run here (no CUDA, no package), or ``None``; a GPU older than sm90 is
    refused by the kernel's declared architecture (``Kernel.min_sm``)."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    try:
        _interface()
    except Exception as exc:  # an import failure is a reason, never a crash
        return (f"flash_attn.cute does not import ({type(exc).__name__}: {exc}); "
                f"install it with {install_hint('fa4')}")
    return None


def _neg_inf_rows(lse: Tensor) -> Tensor:
    # Guard the contract: whatever mark the package gives a row with no visible key becomes -inf.
    return lse.masked_fill(lse == math.inf, -math.inf)


@functools.lru_cache(maxsize=None)
def _alibi_mods():
    """ALiBi as the package's score mods (CuTe DSL, compiled with the kernel on first use): the forward
    adds ``-slope[h] * |q_pos[i] - k_pos[j]|`` to the scaled score, reading the call's slopes and global
    positions from its aux tensors (so any layout's rows, strided or not, get their own distances); the
    bias is additive, so the score's gradient passes through unchanged.

    Source: Press et al., ALiBi (arXiv 2108.12409); the score mod contract of ``flash_attn/cute/softmax.py``.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import math as mlir_math

    def gather(table, index, dtype):
        # A 1-element register copy of table[index]: aux tensors are read one score at a time (vec_size 1).
        at = cute.make_rmem_tensor(1, cutlass.Int32)
        at.store(index)
        got = cute.make_rmem_tensor(1, dtype)
        got[0] = table[at[0]]
        return got.load()

    @cute.jit
    def score_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slopes, q_pos, k_pos = aux_tensors
        slope = gather(slopes, h_idx, cutlass.Float32)
        diff = gather(q_pos, q_idx, cutlass.Int32) - gather(k_pos, kv_idx, cutlass.Int32)
        dist = cute.TensorSSA(mlir_math.absi(diff), diff.shape, diff.dtype).to(cutlass.Float32)
        return score - slope * dist

    @cute.jit
    def score_mod_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return score_mod, score_mod_bwd


def _bias_kw(bias, q: Tensor, backward: bool = False) -> dict:
    """The package's keywords for a call's bias block (``common.PositionBias``; ``None``: none): ALiBi
    only, since its backward gives no gradient for a bias tensor (a learnable bias needs one).

    Raises:
        ValueError: for a bias other than ALiBi.
    """
    if bias is None:
        return {}
    if bias.bias.kind != "alibi":
        raise ValueError(f"the flash-attn-4 kernel cannot take bias {bias.bias.kind}: {NO_BIAS}")
    slopes = bias.bias.values if bias.heads is None else bias.bias.values[bias.heads]
    aux = [slopes.to(q.device, torch.float32).contiguous(),
           *(pos.to(q.device, torch.int32).contiguous() for pos in (bias.q_pos, bias.k_pos))]
    score_mod, score_mod_bwd = _alibi_mods()
    return {"score_mod": score_mod, "aux_tensors": aux, **({"score_mod_bwd": score_mod_bwd} if backward else {})}


#: Why a bias tensor does not run on this kernel (``Kernel.no_bias``).
NO_BIAS = ("its backward gives no gradient for a bias tensor, so only ALiBi's fixed slopes (--bias alibi) run on "
           "it, as a score mod")


def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, bias=None,
            **window) -> tuple[Tensor, Tensor]:
    """``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` (fp16/bf16) →
    ``out [B, Sq, Hq, Dv]`` in q's dtype and ``lse`` float32 ``[B, Hq, Sq]``; ``window``: the
    package's ``window_size_left`` and ``window_size_right`` (None: unbounded; -1 would be a width), when given;
    ``bias``: an ALiBi ``common.PositionBias`` of the call, applied by :func:`_alibi_mods`, or ``None``."""
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                return_lse=True, **window, **_bias_kw(bias, q))
    return out, _neg_inf_rows(lse)


#: What records should say about how this process's calls ran (:func:`notes`).
_NOTES: set[str] = set()


def notes() -> list[str]:
    """Notes for the records of the calls this process made (K/V expanded, and why)."""
    return sorted(_NOTES)


def _expanded_backward(call, q: Tensor, k: Tensor, v: Tensor, scored: bool = False):
    """``call(k, v)`` natively; on Hopper, whose FlashAttention-4 backward takes GQA only with one
    head dim for q, k and v (``flash_bwd_sm90.py``) and gives a wrong dq under GQA with a score mod
    (4.0.0b36 on an H100: dq off by 40, NaN with zero slopes; ``results/reference/2026-12-07-s5``),
    with K/V expanded to the query heads where ``head_dim_v`` differs or ``scored``, the dK/dV summed
    back over each group."""
    groups = q.shape[-2] // k.shape[-2]
    hopper = torch.cuda.get_device_capability(q.device)[0] == 9
    if groups == 1 or not hopper or (v.shape[-1] == q.shape[-1] and not scored):
        return call(k, v)
    _NOTES.add("flash-attn-4 backward: K/V expanded to the query heads, since its Hopper backward takes GQA "
               "only where head_dim_v equals head_dim and no score mod is passed")
    dq, dk, dv = call(expand_kv(k, groups), expand_kv(v, groups))
    return dq, reduce_kv(dk, groups).to(k.dtype), reduce_kv(dv, groups).to(v.dtype)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
             softmax_scale: float, bias=None, **window) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` in the input dtype, shaped like q, k and v (GQA native); ``bias`` as in
    :func:`forward`."""
    extra = _bias_kw(bias, q, backward=True)

    def call(kk, vv):
        return _interface()._flash_attn_bwd(q, kk, vv, out, dout.contiguous(), lse.contiguous(),
                                            softmax_scale=softmax_scale, causal=causal, **window, **extra)[:3]

    return _expanded_backward(call, q, k, v, scored=bias is not None)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, **window):
    """The packed form: ``q [1, Sq, Hq, D]`` and k, v ``[1, Sk, Hkv, ...]`` with int32 offsets
    (:mod:`kernels` docstring) → ``out [1, Sq, Hq, Dv]``, ``lse`` float32 ``[1, Hq, Sq]``."""
    out, lse, *_ = _interface()._flash_attn_fwd(
        q[0], k[0], v[0], cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal, return_lse=True, **window)
    return out.unsqueeze(0), _neg_inf_rows(lse).unsqueeze(0)


def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, **window):
    """Gradients of :func:`forward_varlen`, ``[1, S, H, ...]`` like q, k and v."""
    def call(kk, vv):
        return _interface()._flash_attn_bwd(
            q[0], kk, vv, out[0], dout[0].contiguous(), lse[0].contiguous(), softmax_scale=softmax_scale,
            causal=causal, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, **window)[:3]

    dq, dk, dv = _expanded_backward(call, q[0], k[0], v[0])
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)
