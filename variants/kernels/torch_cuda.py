"""PyTorch's own CUDA attention ops behind the contract of :mod:`kernels`: ``torch-flash``
(PyTorch's FlashAttention-2, batch and varlen, with the conversion of its varlen lse to
ringbench's packed layout and back), ``cudnn`` and ``torch-efficient`` (batch only), and why each
cannot run here.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from .common import (Window, _check_shapes, _check_varlen, _cuda_unavailable, _empty_rows_to_neg_inf,
                     _packed_positions, band_of, expand_kv, reduce_kv)

Tensor = torch.Tensor


# --------------------------------------------------------------------------- torch-flash

def _fa_window(band: Window | None) -> dict:
    # flash-attn 2's and torch-flash's window sizes: -1 is unbounded.
    if band is None:
        return {}
    return {"window_size_left": -1 if band[0] is None else band[0],
            "window_size_right": -1 if band[1] is None else band[1]}


def _torch_flash_forward(q, k, v, causal, softmax_scale, *, window=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal and band is None, False, scale=softmax_scale,
        **_fa_window(band))
    return out, _empty_rows_to_neg_inf(lse)


@functools.lru_cache(maxsize=None)
def _unused_rng_state(device: torch.device) -> tuple[Tensor, Tensor]:
    # dropout is 0, so the philox state is never read; the op still wants tensors.
    return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _torch_flash_backward(dout, q, k, v, out, lse, causal, softmax_scale, *, window=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    seed, offset = _unused_rng_state(q.device)
    if band is not None:  # FlashAttention's mark of a row that sees no key is +inf
        lse = lse.masked_fill(lse == -math.inf, math.inf)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal and band is None,
        seed, offset, scale=softmax_scale, **_fa_window(band))
    return dq, dk, dv


def _torch_flash_unavailable() -> str | None:
    # The GPU's architecture is the registry's rule (Kernel.min_sm), checked before this.
    return _cuda_unavailable()


#: Whether this build's FlashAttention-2 varlen lse is padded ``[N, H, max_seqlen_q]`` (older
#: builds) rather than packed ``[H, total_q]``; set by the first varlen forward.
_FA_LSE_PADDED: dict[str, bool] = {}


def _fa_lse_to_packed(lse: Tensor, cu_seqlens_q: Tensor, total: int) -> Tensor:
    if lse.dim() == 2:  # [H, total]
        _FA_LSE_PADDED["torch-flash"] = False
        return lse.unsqueeze(0)
    _FA_LSE_PADDED["torch-flash"] = True  # [N, H, max_seqlen_q]
    doc, pos = _packed_positions(cu_seqlens_q, total)
    return lse[doc, :, pos].transpose(0, 1).unsqueeze(0)


def _fa_lse_from_packed(lse: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int) -> Tensor:
    # FlashAttention's own mark of a row with no visible key is +inf, which its backward reads
    # as "contributes nothing"; -inf there would give exp(+inf).
    lse = lse.float().masked_fill(lse == -math.inf, math.inf)[0]
    if not _FA_LSE_PADDED.get("torch-flash", False):
        return lse.contiguous()
    doc, pos = _packed_positions(cu_seqlens_q, lse.shape[1])
    padded = torch.full((cu_seqlens_q.numel() - 1, lse.shape[0], max_seqlen_q), math.inf,
                        dtype=lse.dtype, device=lse.device)
    padded[doc, :, pos] = lse.transpose(0, 1)
    return padded


def _torch_flash_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    cu_q, cu_k = cu_seqlens_q.to(q.device), cu_seqlens_k.to(q.device)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q[0], k[0], v[0], cu_q, cu_k, max_seqlen_q, max_seqlen_k, 0.0, causal and band is None, False,
        scale=softmax_scale, **_fa_window(band))
    return out.unsqueeze(0), _empty_rows_to_neg_inf(_fa_lse_to_packed(lse, cu_q, q.shape[1]))


def _torch_flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, causal, softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    cu_q, cu_k = cu_seqlens_q.to(q.device), cu_seqlens_k.to(q.device)
    seed, offset = _unused_rng_state(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout[0].contiguous(), q[0], k[0], v[0], out[0], _fa_lse_from_packed(lse, cu_q, max_seqlen_q), cu_q, cu_k,
        max_seqlen_q, max_seqlen_k, 0.0, causal and band is None, seed, offset, scale=softmax_scale,
        **_fa_window(band))
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)


# --------------------------------------------------------------------------- cudnn

#: Why PyTorch's cuDNN op refused native GQA (Hkv < Hq) in this process, by pass ("forward",
#: "backward"); such calls then go through expanded K/V, and the records say so (``_cudnn_notes``).
_CUDNN_GQA_REFUSED: dict[str, str] = {}


def _cudnn_gqa(pass_: str, groups: int, native: Callable, expanded: Callable):
    """Run ``native()`` (K/V as they are) unless the op refused it once; else ``expanded()``."""
    if groups == 1 or pass_ in _CUDNN_GQA_REFUSED:
        return expanded() if groups > 1 else native()
    try:
        return native()
    except RuntimeError as exc:  # this PyTorch/cuDNN pair has no native GQA: expand from now on
        _CUDNN_GQA_REFUSED[pass_] = str(exc).splitlines()[0][:200]
        return expanded()


def _cudnn_notes() -> list[str]:
    return [f"cudnn {p}: K/V expanded to the query heads, since PyTorch's cuDNN op refused GQA ({why})"
            for p, why in _CUDNN_GQA_REFUSED.items()]


def _cudnn_forward(q, k, v, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    groups = q.shape[2] // k.shape[2]

    def call(kk, vv):
        # cuDNN's SDPA op takes [B, H, S, D] views; GQA natively where the op accepts Hkv < Hq.
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), None, True, 0.0, causal, False,
            scale=softmax_scale)

    res = _cudnn_gqa("forward", groups, lambda: call(k, v),
                     lambda: call(expand_kv(k, groups), expand_kv(v, groups)))
    out, lse = res[0], res[1]
    B, Sq, Hq, _ = q.shape
    return out.transpose(1, 2), _empty_rows_to_neg_inf(lse.reshape(B, Hq, Sq).float())


def _cudnn_backward(dout, q, k, v, out, lse, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    groups = q.shape[2] // k.shape[2]
    B, Sq, Hq, D = q.shape
    seed, offset = _unused_rng_state(q.device)
    # cuDNN wants dout laid out like out.
    dout = dout.contiguous() if dout.stride() != out.stride() else dout

    def call(kk, vv):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
            out.transpose(1, 2), lse.reshape(B, Hq, Sq, 1).contiguous(), seed, offset, None, None, None,
            Sq, k.shape[1], 0.0, causal, scale=softmax_scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

    def expanded():
        dq, dk, dv = call(expand_kv(k, groups), expand_kv(v, groups))
        return dq, reduce_kv(dk, groups), reduce_kv(dv, groups)

    return _cudnn_gqa("backward", groups, lambda: call(k, v), expanded)


def _cudnn_unavailable() -> str | None:
    reason = _cuda_unavailable()
    if reason is None and not torch.backends.cudnn.is_available():
        return "PyTorch was built without cuDNN"
    return reason  # the GPU's architecture is the registry's rule (Kernel.min_sm)


# --------------------------------------------------------------------------- torch-efficient

def _efficient_forward(q, k, v, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    # The op misreads head-group views that are not contiguous (llama3 with heads_k_stride): dq and dk
    # came out 170x over the allowance on an H200 (tests/test_kernels_gpu.py, head slices).
    q, k, v = (t.contiguous() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    # The memory-efficient SDPA op takes [B, H, S, D] views and no GQA: K/V go in expanded.
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), expand_kv(k, groups).transpose(1, 2), expand_kv(v, groups).transpose(1, 2),
        None, True, 0.0, causal, scale=softmax_scale)
    # Its lse is padded along the sequence (to a multiple of 32); keep the rows that exist.
    return out.transpose(1, 2), _empty_rows_to_neg_inf(lse[..., :q.shape[1]].float())


def _efficient_backward(dout, q, k, v, out, lse, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    dout, q, k, v, out = (t.contiguous() for t in (dout, q, k, v, out))
    groups = q.shape[2] // k.shape[2]
    B, Sq, Hq, _ = q.shape
    seed, offset = _unused_rng_state(q.device)
    padded = lse.new_zeros(B, Hq, -(-Sq // 32) * 32)
    padded[..., :Sq] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), expand_kv(k, groups).transpose(1, 2),
        expand_kv(v, groups).transpose(1, 2), None, out.transpose(1, 2), padded, seed, offset, 0.0,
        [True, True, True, False], causal, scale=softmax_scale)
    return dq.transpose(1, 2), reduce_kv(dk.transpose(1, 2), groups), reduce_kv(dv.transpose(1, 2), groups)
