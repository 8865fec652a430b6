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


def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float, **window) -> tuple[Tensor, Tensor]:
    """``q [B, Sq, Hq, D]``, ``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]`` (fp16/bf16) →
    ``out [B, Sq, Hq, Dv]`` in q's dtype and ``lse`` float32 ``[B, Hq, Sq]``; ``window``: the
    package's ``window_size_left`` and ``window_size_right`` (None: unbounded; -1 would be a width), when given."""
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                return_lse=True, **window)
    return out, _neg_inf_rows(lse)


#: What records should say about how this process's calls ran (:func:`notes`).
_NOTES: set[str] = set()


def notes() -> list[str]:
    """Notes for the records of the calls this process made (K/V expanded, and why)."""
    return sorted(_NOTES)


def _expanded_backward(call, q: Tensor, k: Tensor, v: Tensor):
    """``call(k, v)`` natively; on Hopper, whose FlashAttention-4 backward takes GQA only with one
    head dim for q, k and v (``flash_bwd_sm90.py``), with K/V expanded to the query heads where
    ``head_dim_v`` differs, the dK/dV summed back over each group."""
    groups = q.shape[-2] // k.shape[-2]
    if groups == 1 or v.shape[-1] == q.shape[-1] or torch.cuda.get_device_capability(q.device)[0] != 9:
        return call(k, v)
    _NOTES.add("flash-attn-4 backward: K/V expanded to the query heads, since its Hopper backward takes GQA "
               "only where head_dim_v equals head_dim")
    dq, dk, dv = call(expand_kv(k, groups), expand_kv(v, groups))
    return dq, reduce_kv(dk, groups).to(k.dtype), reduce_kv(dv, groups).to(v.dtype)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
             softmax_scale: float, **window) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` in the input dtype, shaped like q, k and v (GQA native)."""
    def call(kk, vv):
        return _interface()._flash_attn_bwd(q, kk, vv, out, dout.contiguous(), lse.contiguous(),
                                            softmax_scale=softmax_scale, causal=causal, **window)[:3]

    return _expanded_backward(call, q, k, v)


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
