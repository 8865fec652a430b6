"""Local attention backends behind one contract.

Every backend takes q ``[B, Sq, Hq, D]`` and k, v ``[B, Sk, Hkv, D]`` (``Hq % Hkv == 0``) and
returns ``out`` with q's shape and dtype and ``lse`` as float32 ``[B, Hq, Sq]`` (float64 for
float64 inputs, which only the math and cpu kernels take): the natural
log-sum-exp of each query row's scaled scores, ``-inf`` for a row that sees no key.
Backends differ in their own lse layout and in how they mark empty rows; the conversion
happens here, at the boundary, so variants only ever see ringbench's layout.

A causal call requires ``Sq == Sk`` (the mask is ``key <= query``); backends disagree on how
to align a causal mask of a rectangular block, so ringbench never asks for one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

Tensor = torch.Tensor

#: Order in which ``auto`` picks a kernel on each device type.
AUTO_ORDER = {"cuda": ("flash-attn", "torch-flash", "cudnn", "math"), "cpu": ("cpu", "math")}


@dataclass(frozen=True)
class Kernel:
    """One local attention backend.

    Attributes:
        name: the name users pass to ``--kernel``.
        device_type: ``"cuda"`` or ``"cpu"``; ``"any"`` for the math kernel.
        dtypes: input dtypes the backend accepts.
        max_head_dim: the largest head dim the backend takes (``None``: no limit).
        head_dim_multiple: head dims must be a multiple of this.
        forward: ``(q, k, v, causal, softmax_scale) -> (out, lse)``.
        backward: ``(dout, q, k, v, out, lse, causal, softmax_scale) -> (dq, dk, dv)``;
            gradients in the input dtype (math: float32 or float64).
        unavailable: a function returning why the backend cannot run here, or ``None``.
    """

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int | None
    head_dim_multiple: int
    forward: Callable[..., tuple[Tensor, Tensor]] = field(repr=False)
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]] = field(repr=False)
    unavailable: Callable[[], str | None] = field(repr=False, default=lambda: None)

    def check_head_dim(self, head_dim: int) -> str | None:
        """Return why ``head_dim`` is refused by this kernel, or ``None`` when it is fine."""
        if head_dim <= 0:
            return f"head_dim {head_dim} must be positive"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"head_dim {head_dim} exceeds {self.max_head_dim}, the largest the {self.name} kernel takes"
        if head_dim % self.head_dim_multiple:
            return (f"head_dim {head_dim} is not a multiple of {self.head_dim_multiple}, "
                    f"which the {self.name} kernel needs")
        return None


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         "[B, S, H, D] with k and v alike")
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError("attention over an empty sequence is undefined; give at least one token")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads {q.shape[2]} is not a multiple of kv_heads {k.shape[2]}")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"a causal block needs Sq == Sk, got {q.shape[1]} and {k.shape[1]}")


def _empty_rows_to_neg_inf(lse: Tensor) -> Tensor:
    # FlashAttention marks a row with no visible key by lse = +inf; ringbench uses -inf.
    return lse.masked_fill(lse == math.inf, -math.inf)


# --------------------------------------------------------------------------- math

def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                  chunk: int = 1024) -> tuple[Tensor, Tensor]:
    _check_shapes(q, k, v, causal)
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # [B, Hkv, G, S, D]: GQA without repeating K/V.
    qg = q.to(acc).reshape(B, Sq, Hkv, G, D).permute(0, 2, 3, 1, 4)
    kf = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    vf = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    out = torch.empty(B, Hkv, G, Sq, D, dtype=acc, device=q.device)
    lse = torch.empty(B, Hkv, G, Sq, dtype=acc, device=q.device)
    keys = torch.arange(k.shape[1], device=q.device)
    for s in range(0, Sq, chunk):
        e = min(s + chunk, Sq)
        scores = (qg[:, :, :, s:e] @ kf.transpose(-1, -2)) * softmax_scale
        if causal:
            rows = torch.arange(s, e, device=q.device)
            scores = scores.masked_fill(keys[None, :] > rows[:, None], -math.inf)
        lse_c = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse_c.unsqueeze(-1).clamp_min(torch.finfo(acc).min))
        out[:, :, :, s:e] = p @ vf
        lse[:, :, :, s:e] = lse_c
    out = out.permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D).to(q.dtype)
    return out, lse.reshape(B, Hq, Sq)


def _math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   causal: bool, softmax_scale: float, chunk: int = 1024) -> tuple[Tensor, Tensor, Tensor]:
    _check_shapes(q, k, v, causal)
    B, Sq, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    def grouped(x: Tensor) -> Tensor:
        return x.to(acc).reshape(B, x.shape[1], Hkv, G, D).permute(0, 2, 3, 1, 4)

    qg, dog, og = grouped(q), grouped(dout), grouped(out)
    lseg = lse.to(acc).reshape(B, Hkv, G, Sq)
    kf = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    vf = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    delta = (dog * og).sum(-1)  # [B, Hkv, G, Sq]
    dq = torch.empty_like(qg)
    dk = torch.zeros(B, Hkv, k.shape[1], D, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    keys = torch.arange(k.shape[1], device=q.device)
    for s in range(0, Sq, chunk):
        e = min(s + chunk, Sq)
        scores = (qg[:, :, :, s:e] @ kf.transpose(-1, -2)) * softmax_scale
        if causal:
            rows = torch.arange(s, e, device=q.device)
            scores = scores.masked_fill(keys[None, :] > rows[:, None], -math.inf)
        lse_c = lseg[:, :, :, s:e].unsqueeze(-1)
        p = torch.exp(scores - lse_c.clamp_min(torch.finfo(acc).min))
        dp = dog[:, :, :, s:e] @ vf.transpose(-1, -2)
        ds = p * (dp - delta[:, :, :, s:e].unsqueeze(-1)) * softmax_scale
        dq[:, :, :, s:e] = ds @ kf
        dk += (ds.transpose(-1, -2) @ qg[:, :, :, s:e]).sum(2)
        dv += (p.transpose(-1, -2) @ dog[:, :, :, s:e]).sum(2)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D)
    return dq.to(q.dtype), dk.permute(0, 2, 1, 3).to(k.dtype), dv.permute(0, 2, 1, 3).to(v.dtype)


# --------------------------------------------------------------------------- cpu

def _cpu_forward(q, k, v, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=softmax_scale)
    return out.transpose(1, 2), lse if q.dtype == torch.float64 else lse.float()


def _cpu_backward(dout, q, k, v, out, lse, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), 0.0, causal, scale=softmax_scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --------------------------------------------------------------------------- torch-flash

def _torch_flash_forward(q, k, v, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=softmax_scale)
    return out, _empty_rows_to_neg_inf(lse)


@functools.lru_cache(maxsize=None)
def _unused_rng_state(device: torch.device) -> tuple[Tensor, Tensor]:
    # dropout is 0, so the philox state is never read; the op still wants tensors.
    return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _torch_flash_backward(dout, q, k, v, out, lse, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    seed, offset = _unused_rng_state(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal,
        seed, offset, scale=softmax_scale)
    return dq, dk, dv


def _cuda_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _torch_flash_unavailable() -> str | None:
    reason = _cuda_unavailable()
    if reason is None and torch.cuda.get_device_capability() < (8, 0):
        return "PyTorch's FlashAttention-2 needs compute capability 8.0 or newer"
    return reason


# --------------------------------------------------------------------------- cudnn

def _expand_kv(x: Tensor, groups: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _reduce_kv(dx: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return dx
    B, S, H, D = dx.shape
    return dx.view(B, S, H // groups, groups, D).sum(3)


def _cudnn_forward(q, k, v, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    groups = q.shape[2] // k.shape[2]
    # cuDNN's SDPA op takes [B, H, S, D] views; GQA goes through expanded K/V.
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), _expand_kv(k, groups).transpose(1, 2), _expand_kv(v, groups).transpose(1, 2),
        None, True, 0.0, causal, False, scale=softmax_scale)
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
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2),
        out.transpose(1, 2), lse.reshape(B, Hq, Sq, 1).contiguous(), seed, offset, None, None, None,
        Sq, k.shape[1], 0.0, causal, scale=softmax_scale)
    return dq.transpose(1, 2), _reduce_kv(dk.transpose(1, 2), groups), _reduce_kv(dv.transpose(1, 2), groups)


def _cudnn_unavailable() -> str | None:
    reason = _cuda_unavailable()
    if reason is None and not torch.backends.cudnn.is_available():
        return "PyTorch was built without cuDNN"
    if reason is None and torch.cuda.get_device_capability() < (8, 0):
        return "cuDNN attention needs compute capability 8.0 or newer"
    return reason


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


def _flash_attn_forward(q, k, v, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    # The public function's signature has been stable across flash-attn 2.x releases.
    out, lse, _ = _flash_attn_module().flash_attn_func(q, k, v, softmax_scale=softmax_scale,
                                                       causal=causal, return_attn_probs=True)
    return out, _empty_rows_to_neg_inf(lse.float())


def _flash_attn_backward(dout, q, k, v, out, lse, causal, softmax_scale):
    _check_shapes(q, k, v, causal)
    fai = _flash_attn_module()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # flash-attn >= 2.6 signature; older releases take a window_size tuple instead.
    fai._flash_attn_backward(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, 0.0, softmax_scale,
                             causal, -1, -1, 0.0, None, False)
    return dq, dk, dv


_HALF = (torch.float16, torch.bfloat16)

KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("flash-attn", "cuda", _HALF, 256, 8, _flash_attn_forward, _flash_attn_backward,
               _flash_attn_unavailable),
        Kernel("torch-flash", "cuda", _HALF, 256, 8, _torch_flash_forward, _torch_flash_backward,
               _torch_flash_unavailable),
        Kernel("cudnn", "cuda", _HALF, 128, 8, _cudnn_forward, _cudnn_backward, _cudnn_unavailable),
        Kernel("cpu", "cpu", (torch.float32, torch.float64, torch.bfloat16, torch.float16), None, 1,
               _cpu_forward, _cpu_backward),
        Kernel("math", "any", (torch.float64, torch.float32, torch.bfloat16, torch.float16), None, 1,
               _math_forward, _math_backward),
    )
}


def get_kernel(name: str) -> Kernel:
    """Return the kernel registered as ``name``.

    Raises:
        ValueError: when no kernel has that name; the message lists the valid ones.
    """
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"kernel {name!r} is unknown; choose one of {', '.join(KERNELS)} or auto") from None


def resolve_kernel(name: str, device_type: str) -> Kernel:
    """Turn ``auto`` (or a name) into a kernel that can run on ``device_type`` here.

    Raises:
        ValueError: unknown name, a kernel for another device type, or one unavailable here
            (the message gives the reason).
    """
    if name == "auto":
        for candidate in AUTO_ORDER[device_type]:
            kern = KERNELS[candidate]
            if kern.unavailable() is None:
                return kern
        raise ValueError(f"no attention kernel is available on {device_type}")
    kern = get_kernel(name)
    if kern.device_type not in (device_type, "any"):
        raise ValueError(f"kernel {name!r} runs on {kern.device_type}, not {device_type}; "
                         f"choose one of {', '.join(n for n, k in KERNELS.items() if k.device_type in (device_type, 'any'))}")
    reason = kern.unavailable()
    if reason:
        raise ValueError(f"kernel {name!r} is unavailable here: {reason}")
    return kern
