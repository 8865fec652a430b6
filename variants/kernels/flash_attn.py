"""The flash-attn packages behind the contract of :mod:`kernels`: ``flash-attn`` (FlashAttention-2,
the optional ``flash-attn`` package) and ``flash-attn-4`` (the window and shape checks around
:mod:`fa4`), batch and varlen, with why each cannot run here and what version serves it.
"""

from __future__ import annotations

import math

import torch

from . import fa4
from .common import Window, _check_shapes, _check_varlen, _cuda_unavailable, _empty_rows_to_neg_inf, band_of, check_bias


# --------------------------------------------------------------------------- flash-attn

def _flash_attn_module():
    import flash_attn.flash_attn_interface as fai  # optional dependency

    return fai


def _flash_attn_unavailable() -> str | None:
    reason = _cuda_unavailable()
    if reason:
        return reason
    try:
        _flash_attn_module()
    except Exception as exc:  # an import failure is a reason, never a crash
        return f"the flash-attn package does not import ({type(exc).__name__}: {exc})"
    return None


def _flash_attn_window(band: Window | None) -> tuple[int, int]:
    return (-1, -1) if band is None else tuple(-1 if s is None else s for s in band)


def _flash_attn_forward(q, k, v, causal, softmax_scale, *, window=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    # The public function's signature has been stable across flash-attn 2.x releases (window_size since 2.3).
    out, lse, _ = _flash_attn_module().flash_attn_func(q, k, v, softmax_scale=softmax_scale,
                                                       causal=causal and band is None,
                                                       window_size=_flash_attn_window(band), return_attn_probs=True)
    return out, _empty_rows_to_neg_inf(lse.float())


def _flash_attn_backward(dout, q, k, v, out, lse, causal, softmax_scale, *, window=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    fai = _flash_attn_module()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if band is not None:
        lse = lse.masked_fill(lse == -math.inf, math.inf)
    # flash-attn >= 2.6 signature; older releases take a window_size tuple instead.
    fai._flash_attn_backward(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, 0.0, softmax_scale,
                             causal and band is None, *_flash_attn_window(band), 0.0, None, False)
    return dq, dk, dv


def _flash_attn_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    out, lse, _ = _flash_attn_module().flash_attn_varlen_func(
        q[0], k[0], v[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
        causal=causal and band is None, window_size=_flash_attn_window(band), return_attn_probs=True)
    # flash-attn 2.x gives the packed lse [Hq, total_q] (>= 2.4); older builds padded it.
    return out.unsqueeze(0), _empty_rows_to_neg_inf(lse.float()).unsqueeze(0)


def _flash_attn_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal, softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    fai = _flash_attn_module()
    dq, dk, dv = torch.empty_like(q[0]), torch.empty_like(k[0]), torch.empty_like(v[0])
    # Its backward reads +inf, not -inf, as "this row saw no key" (as torch-flash's does).
    lse = lse[0].float().masked_fill(lse[0] == -math.inf, math.inf).contiguous()
    # flash-attn >= 2.6 signature, as the batch backward above.
    fai._flash_attn_varlen_backward(dout[0].contiguous(), q[0], k[0], v[0], out[0], lse, dq, dk, dv,
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale,
                                    causal and band is None, *_flash_attn_window(band), 0.0, None, False)
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)


def _flash_attn_version() -> str | None:
    try:
        import flash_attn

        return f"flash-attn {flash_attn.__version__}"
    except Exception:  # absent or broken
        return None


# --------------------------------------------------------------------------- flash-attn-4

def _fa4_window(band: Window | None) -> dict:
    # FlashAttention-4 takes None as unbounded and reads -1 as a width (flash_attn/cute/mask.py), which
    # failed tests/test_window_gpu.py on an H200 for (left, right) = (None, 40): out 3.3 against 0.047.
    return {} if band is None else {"window_size_left": band[0], "window_size_right": band[1]}


def _fa4_forward(q, k, v, causal, softmax_scale, *, window=None, bias=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    if bias is not None:
        check_bias(bias, q, k)
    return fa4.forward(q, k, v, causal and band is None, softmax_scale, bias, **_fa4_window(band))


def _fa4_backward(dout, q, k, v, out, lse, causal, softmax_scale, *, window=None, bias=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    if bias is not None:
        check_bias(bias, q, k)
    return fa4.backward(dout, q, k, v, out, lse, causal and band is None, softmax_scale, bias,
                        **_fa4_window(band))


def _fa4_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, *,
                        window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    return fa4.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal and band is None,
                              softmax_scale, **_fa4_window(band))


def _fa4_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    return fa4.backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal and band is None, softmax_scale, **_fa4_window(band))


def _fa4_version() -> str | None:
    found = fa4.version()
    return f"flash-attn-4 {found}" if found else None
