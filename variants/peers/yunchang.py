"""Peers: yunchang's Ulysses, ring and USP attention, run through ringbench's contract.

``yc_ulysses``, ``yc_ring`` and ``yc_usp`` run yunchang's (``pip install -e '.[peers]'`` in the checkout, pure
Python) ``LongContextAttention`` path: its all-to-all (``comm.all_to_all.SeqAllToAll4D``) over
a Ulysses group, its ring function over a ring group (``zigzag_ring_flash_attn_func`` under a
causal mask, ``ring_flash_attn_func`` without one, which attends every key whatever the
layout), and its all-to-all back. Ulysses degree: W (yc_ulysses), 1 (yc_ring), or
``ulysses_degree`` (yc_usp). ``LongContextAttention.forward`` itself drops the ring's lse, so
the same steps are made here in its order and the lse the ring returns is swapped back to
sequence sharding by ringbench's ``ulysses.lse_heads_to_seq`` (not differentiable, forward
only); out and the gradients are all yunchang's.

Groups: yunchang reads them from ``yunchang.globals.PROCESS_GROUP``; ringbench's
``grid.process_grid`` builds the same grid as yunchang's ``set_seq_parallel_pg`` (Ulysses
groups of consecutive ranks) and sets them there, and the layout is yunchang's own
(``zigzag_extract_local``: ``layouts``' composed zigzag).

Kernel: yunchang's flash-attn path (``AttnType.FA``): its PyTorch attention types have no
backward in 0.6.4 (``pytorch_attn_backward`` raises), so they cannot be verified. Where the
flash-attn package is installed it serves the calls (kernel ``flash-attn``, CUDA); where it is
not, ringbench's kernel (``torch-flash`` on CUDA, ``cpu`` or ``math`` on CPU) does, through the
flash-attn 2.7 forms of ``rfa_standin.interface`` (and a ``flash_attn_func`` over the kernel), set as the globals yunchang's
``kernels.attention`` module reads (``_flash_attn_forward``, ``_flash_attn_backward``,
``flash_attn.__version__``, ``HAS_FLASH_ATTN``) for the duration of each forward and backward
(:class:`_Served`), so no other code sees them. GQA is native; a Ulysses degree above the K/V
heads replicates them first, as ringbench's usp does.

Bytes: yunchang calls ``dist.all_to_all_single``, ``dist.P2POp`` and
``dist.batch_isend_irecv`` through the module, so the session (``comm.dist_session``) counts
them; the lse swap goes through ringbench's counted helper.
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch
import torch.distributed as dist

from ..rules import resolve_ulysses_degree, ulysses_rule
from . import rfa_standin
from .. import kernels as _kernels
from ..engines.grid import process_grid
from ..engines.ulysses import lse_heads_to_seq
from ringbench.errors import install_hint

Tensor = torch.Tensor


def unavailable_reason() -> str | None:
    """Why yunchang cannot run here, or ``None``."""
    try:
        importlib.import_module("yunchang")
    except Exception as exc:  # a missing package or one that fails at import
        return f"yunchang is not importable ({type(exc).__name__}: {exc}); {install_hint('peers')}"
    return None


@contextlib.contextmanager
def _serving(kernel):
    """yunchang's flash-attn globals served by ringbench's ``kernel`` while held (nothing where
    flash-attn is installed)."""
    if kernel is None:
        yield
        return
    import yunchang.kernels.attention as attention

    import yunchang.kernels as kernels_module

    interface = rfa_standin.interface(kernel)
    patches = ((attention, {"_flash_attn_forward": interface._flash_attn_forward,
                            "_flash_attn_backward": interface._flash_attn_backward,
                            "flash_attn": types.SimpleNamespace(__version__="2.7.0"), "HAS_FLASH_ATTN": True}),
               (kernels_module, {"flash_attn_func": _flash_attn_func(kernel), "HAS_FLASH_ATTN": True}))
    saved = [(module, {n: module.__dict__.get(n, _MISSING) for n in values}) for module, values in patches]
    for module, values in patches:
        for n, value in values.items():
            setattr(module, n, value)
    try:
        yield
    finally:
        for module, values in saved:
            for n, value in values.items():
                if value is _MISSING:
                    module.__dict__.pop(n, None)
                else:
                    setattr(module, n, value)


_MISSING = object()


class _Served(torch.autograd.Function):
    """Identity on (q, k, v) whose backward ends the serving; :class:`_Serve` starts it. Together
    they hold :func:`_serving` around yunchang's own backward, which autograd runs between them."""

    @staticmethod
    def forward(ctx, holder, q, k, v):
        ctx.holder = holder
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.holder.pop().__exit__(None, None, None)
        return None, dq, dk, dv


class _Serve(torch.autograd.Function):
    """Identity on out whose backward starts the serving for yunchang's backward."""

    @staticmethod
    def forward(ctx, holder, kernel, out):
        ctx.holder, ctx.kernel = holder, kernel
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        context = _serving(ctx.kernel)
        context.__enter__()
        ctx.holder.append(context)
        return None, None, dout


class _KernelCall(torch.autograd.Function):
    """One ringbench kernel call with its backward: ``flash_attn_func``'s stand-in."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, causal, scale):
        out, lse = kernel.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, causal, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale = ctx.args
        return (*kernel.backward(dout.contiguous(), q, k, v, out, lse, causal, scale), None, None, None)


def _flash_attn_func(kernel):
    """``flash_attn.flash_attn_func`` (the flash-attn 2 form yunchang calls) served by ``kernel``."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
            raise ValueError("yunchang asked flash_attn_func for dropout, a window, softcap or alibi slopes, which "
                             f"ringbench's {kernel.name} kernel, serving its flash-attn calls, does not take")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out, lse = _KernelCall.apply(q, k, v, kernel, causal, scale)
        return (out, lse, None) if return_attn_probs else out

    return flash_attn_func


def _standin_kernel(kernel, q: Tensor):
    """The ringbench kernel that serves yunchang's flash-attn calls, or ``None`` where the flash-attn
    package is installed and serves them (``rfa.serving``'s rule)."""
    from .rfa import FLASH_ATTN, serving

    name = serving(kernel, q, varlen=False)
    return None if name == FLASH_ATTN else _kernels.get_kernel(name)


def _run(name: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None, group,
         kernel, cu_seqlens: Tensor | None, degree: int) -> tuple[Tensor, Tensor]:
    from yunchang.comm.all_to_all import SeqAllToAll4D
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType, select_flash_attn_impl
    from yunchang.ring import ring_flash_attn_func, zigzag_ring_flash_attn_func

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    prefix = f"[rank {rank}/{world_size}]"
    if cu_seqlens is not None:
        raise ValueError(f"{prefix} {name} is a batch variant and takes no cu_seqlens")
    reason = ulysses_rule(q.shape[2], k.shape[2], degree, name)
    if reason:
        raise ValueError(f"{prefix} {reason}")
    try:
        standin = _standin_kernel(kernel, q)
    except ValueError as exc:
        raise ValueError(f"{prefix} {exc}") from None
    if degree > k.shape[2]:  # replicate K/V heads up to the degree, as DeepSpeed-Ulysses does
        k, v = k.repeat_interleave(degree // k.shape[2], dim=2), v.repeat_interleave(degree // k.shape[2], dim=2)
    grid = process_grid(group, degree)
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = grid.ulysses, grid.ring
    ring = zigzag_ring_flash_attn_func if causal else ring_flash_attn_func
    holder: list = []
    qh, kh, vh = (SeqAllToAll4D.apply(grid.ulysses, t, 2, 1, False) for t in (q, k, v))
    qh, kh, vh = _Served.apply(holder, qh, kh, vh)
    with _serving(standin):
        if grid.ring_degree == 1:  # UlyssesAttention's own call: its ring would send to itself, which gloo refuses
            attn = select_flash_attn_impl(AttnType.FA, stage="fwd-bwd")
            out_h, lse_h, _ = attn(qh, kh, vh, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True)
        else:
            out_h, lse_h, _ = ring(qh, kh, vh, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True,
                                   group=grid.ring, attn_type=AttnType.FA)
    out_h = _Serve.apply(holder, standin, out_h)
    out = SeqAllToAll4D.apply(grid.ulysses, out_h, 1, 2, False)
    lse = lse_heads_to_seq(lse_h.detach().float().contiguous(), grid.ulysses, degree)
    return out, lse


def yc_ulysses_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto", cu_seqlens=None):
    """yunchang's Ulysses over the whole group: shards ``[B, S/W, H, D]``, contiguous; W divides Hq.

    Returns ``(out [B, S/W, Hq, D], lse float32 [B, Hq, S/W])``. Raises ValueError: heads W cannot
    split, or ``cu_seqlens`` given.
    """
    return _run("yc_ulysses", q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                cu_seqlens=cu_seqlens, degree=dist.get_world_size(group))


def yc_ring_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto", cu_seqlens=None):
    """yunchang's zigzag ring (basic ring without a causal mask): shards in the zigzag layout.

    Returns and raises as :func:`yc_ulysses_attention`.
    """
    return _run("yc_ring", q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                cu_seqlens=cu_seqlens, degree=1)


def yc_usp_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto", cu_seqlens=None,
                     ulysses_degree=None):
    """yunchang's USP: Ulysses of degree U inside, its ring of W / U outside; shards in the
    composed zigzag layout (``layouts.shard(x, "zigzag", rank, W, ulysses_degree=U)``).

    Returns and raises as :func:`yc_ulysses_attention`; U defaults as usp's.
    """
    degree = resolve_ulysses_degree(ulysses_degree, dist.get_world_size(group), q.shape[2], k.shape[2])
    return _run("yc_usp", q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                cu_seqlens=cu_seqlens, degree=degree)
