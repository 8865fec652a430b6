"""Peer: PyTorch's own context parallelism (``torch.distributed.tensor.experimental``).

``torch_cp`` runs PyTorch's ring attention as a user gets it: :func:`session` enters the public
``context_parallel`` context over the context-parallel group for a whole case, so forward and
backward both dispatch to PyTorch's ring (its DTensor handlers for the SDPA ops), and
:func:`torch_cp_attention` calls the SDPA op of the case's kernel on the local shards wrapped
as sequence-sharded DTensors, as PyTorch's patched ``scaled_dot_product_attention`` does.
Calling the op itself, not ``scaled_dot_product_attention``, also returns the merged lse,
so the harness checks lse as it does for every variant.

Layout: PyTorch's head-tail load balancer, which gives rank r chunks r and 2W-1-r of 2W,
the same as ringbench's zigzag; :func:`session` checks that on every case. PyTorch's backward
refuses load balancing without a causal mask, so the variant is causal only.
GQA: PyTorch's path has no native GQA, so K/V are expanded to the query heads before the
call (records say so), and its traffic grows by the same factor.

Rotation (``rotate``): ``allgather`` (PyTorch's default: K/V gathered once, then used block
by block) or ``alltoall`` (K/V passed one step at a time); dK/dV always travel by all-to-all
in float32.

Traffic: PyTorch moves these bytes through DTensor and functional collectives, which
ringbench's counters (``comm``) cannot see, so the registry declares the variant
``traffic_counted=False``: its records say ``bytes_sent: null``, and ``verify``'s cp_active
check, not a byte count, shows that context parallelism was active.

Checked on 2 x H200 (results/reference/2026-11-30-h200x2/NOTES.md): it passes verify with
torch-flash and cudnn; over torch-efficient, PyTorch's backward fails it in bf16 and raises at
local lengths whose halves are not multiples of 32.

Source: PyTorch's context parallel tutorial and ``torch.distributed.tensor.experimental``
(PyTorch 2.7+); the head-tail balancing follows Brandon et al. 2023 and Llama 3 (2024).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ..rules import ROTATE
from ..kernels import Kernel
from ..engines.layouts import token_index

Tensor = torch.Tensor

_mesh = None  # the DeviceMesh of the open session; None outside one


def unavailable_reason() -> str | None:
    """Why PyTorch's context parallel cannot run here, or ``None``."""
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        from torch.distributed.tensor.experimental._attention import set_rotate_method  # noqa: F401
    except ImportError as exc:
        return f"this PyTorch {torch.__version__} has no context_parallel ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is visible, and PyTorch's context parallel dispatches only CUDA SDPA backends"
    return None


@contextlib.contextmanager
def session(spec: dict, group, device: torch.device) -> Iterator[None]:
    """Hold PyTorch's ``context_parallel`` open over ``group`` for one case.

    The buffer PyTorch shards is the global position ids ``arange(seqlen)``; the shard it keeps
    must equal ringbench's zigzag positions of this rank, so both lay the sequence out alike.

    Raises:
        RuntimeError: PyTorch laid the sequence out differently from ringbench's zigzag.
    """
    global _mesh
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    group = group or dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device.type)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    positions = torch.arange(spec["seqlen"], device=device)
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
        expected = token_index("zigzag", spec["seqlen"], rank, world_size, device=device)
        if not torch.equal(positions, expected):
            raise RuntimeError(f"PyTorch's context parallel gave rank {rank} positions {positions[:4].tolist()}..., "
                               f"not ringbench's zigzag {expected[:4].tolist()}...; its load balancer changed")
        _mesh = mesh
        try:
            yield
        finally:
            _mesh = None


def _sdpa(kernel: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    aten = torch.ops.aten
    if kernel == "torch-flash":
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    elif kernel == "cudnn":
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                               scale=scale)
    elif kernel == "torch-efficient":
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        lse = lse[..., :q.shape[2]]  # padded along the sequence
    else:
        raise ValueError(f"torch_cp runs with kernel torch-flash, cudnn or torch-efficient, not {kernel!r}")
    return out, lse


def torch_cp_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float, group=None,
                       kernel: Kernel | str = "torch-flash", rotate: str = "allgather",
                       cu_seqlens=None) -> tuple[Tensor, Tensor]:
    """PyTorch's context-parallel SDPA on this rank's zigzag shards.

    Args:
        q: ``[B, S/W, Hq, D]``, bf16 or fp16 (fp32 too with torch-efficient).
        k, v: ``[B, S/W, Hkv, D]``; expanded to Hq heads when Hkv < Hq.
        causal: must be True (PyTorch's balanced backward needs it).
        softmax_scale: the softmax scale.
        group: the context-parallel group; must be the session's.
        kernel: ``torch-flash``, ``cudnn`` or ``torch-efficient``: the SDPA flash, cuDNN or
            memory-efficient backend.
        rotate: ``allgather`` or ``alltoall``.

    Returns:
        out ``[B, S/W, Hq, D]`` in q's dtype, differentiable; lse float32 ``[B, Hq, S/W]``.

    Raises:
        RuntimeError: called outside :func:`session`.
        ValueError: another kernel, a non-causal mask, an unknown rotate or packed documents.
    """
    from torch.distributed.tensor import DTensor, Shard
    # Where PyTorch's tutorial imports it from; not re-exported by the experimental package.
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    if cu_seqlens is not None:
        raise ValueError("torch_cp is a batch variant and takes no cu_seqlens")
    if not causal:
        raise ValueError("torch_cp needs causal=True: PyTorch's load-balanced backward refuses a non-causal mask")
    if rotate not in ROTATE:
        raise ValueError(f"rotate {rotate!r} is not one PyTorch takes; choose allgather or alltoall")
    if _mesh is None:
        raise RuntimeError("torch_cp_attention runs inside torch_cp.session(...), which keeps PyTorch's context "
                           "parallel dispatch on for forward and backward")
    kernel_name = kernel if isinstance(kernel, str) else kernel.name  # the SDPA backend to call
    set_rotate_method(rotate)
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)

    def shard(x: Tensor):
        return DTensor.from_local(x.transpose(1, 2), _mesh, [Shard(2)], run_check=False)

    out, lse = _sdpa(kernel_name, shard(q), shard(k), shard(v), causal, softmax_scale)
    B, S, H, _ = q.shape
    return out.to_local().transpose(1, 2), lse.to_local().reshape(B, H, S).float()
