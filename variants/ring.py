"""Ring attention: K/V travel around the ring while each rank keeps its queries.

The engine here serves every ring-shaped variant; a variant only says, through its *plan*,
which part of its queries meets which part of the visiting K/V block at each step, and with
what mask. ``ring`` is the plain contiguous layout.

Source: Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
Context" (2023).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .comm import RingComm
from .kernels import Kernel, get_kernel
from .merge import merge_

Tensor = torch.Tensor


class Block(NamedTuple):
    """Which local queries meet which rows of the visiting K/V, and whether the mask is causal."""

    q: slice
    kv: slice
    causal: bool


#: ``plan(step, source_rank, rank, world_size, seqlen_local, causal) -> Block | None``;
#: ``None`` means this step contributes nothing (the K/V block is entirely in the future).
Plan = Callable[[int, int, int, int, int, bool], "Block | None"]

_ALL = slice(None)


def contiguous_plan(step: int, source: int, rank: int, world_size: int, seqlen_local: int,
                    causal: bool) -> Block | None:
    """The plan of the plain ring: the diagonal block is causal, later ranks' blocks are skipped."""
    if not causal:
        return Block(_ALL, _ALL, False)
    if step == 0:
        return Block(_ALL, _ALL, True)
    return Block(_ALL, _ALL, False) if source < rank else None


def _dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    # Accumulators are updated in place and sent as they are: contiguous, in the accumulation dtype.
    return t.to(dtype).contiguous()


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  group, kernel: Kernel, plan: Plan) -> tuple[Tensor, Tensor]:
    comm = RingComm(group)
    rank, world_size = comm.rank, comm.world_size
    B, S, H, D = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = lse = None
    spare = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, world_size - 1))]
    kv = (k, v)
    for step in range(world_size):
        if step + 1 < world_size:
            nxt = spare[step % 2]
            comm.send_recv(kv[0], nxt[0])
            comm.send_recv(kv[1], nxt[1])
            comm.commit()
        block = plan(step, (rank - step) % world_size, rank, world_size, S, causal)
        if block is not None:
            b_out, b_lse = kernel.forward(q[:, block.q], kv[0][:, block.kv], kv[1][:, block.kv],
                                          block.causal, scale)
            if out is None and block.q == _ALL:
                # The first block that covers every query is the accumulator: no merge needed.
                out, lse = _dense(b_out, acc), _dense(b_lse, acc)
            else:
                if out is None:
                    out = torch.zeros(B, S, H, D, dtype=acc, device=q.device)
                    lse = torch.full((B, H, S), float("-inf"), dtype=acc, device=q.device)
                merge_(out[:, block.q], lse[:, :, block.q], b_out, b_lse)
        if step + 1 < world_size:
            comm.wait()
            kv = nxt
    if out is None:  # no block at all: every query sees no key
        out = torch.zeros(B, S, H, D, dtype=acc, device=q.device)
        lse = torch.full((B, H, S), float("-inf"), dtype=acc, device=q.device)
    return out.to(q.dtype), lse


def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   causal: bool, scale: float, group, kernel: Kernel,
                   plan: Plan) -> tuple[Tensor, Tensor, Tensor]:
    kv_comm, dkv_comm = RingComm(group), RingComm(group)
    rank, world_size = kv_comm.rank, kv_comm.world_size
    S = q.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = None
    spare = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, world_size - 1))]
    kv = (k, v)
    cur = in_flight = None
    for step in range(world_size):
        last = step == world_size - 1
        if not last:
            nxt = spare[step % 2]
            kv_comm.send_recv(kv[0], nxt[0])
            kv_comm.send_recv(kv[1], nxt[1])
            kv_comm.commit()
        block = plan(step, (rank - step) % world_size, rank, world_size, S, causal)
        grads = None
        if block is not None:
            grads = kernel.backward(dout[:, block.q], q[:, block.q], kv[0][:, block.kv],
                                    kv[1][:, block.kv], out[:, block.q], lse[:, :, block.q],
                                    block.causal, scale)
            if dq is None and block.q == _ALL:
                dq = _dense(grads[0], acc)
            else:
                if dq is None:
                    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
                dq[:, block.q] += grads[0]
        # dK/dV of the visiting block travel with it, in float32, and reach their owner after
        # W hops; the buffer arriving now holds the earlier ranks' share for this block.
        if step == 0:
            if grads is not None and block.kv == _ALL:
                cur = (_dense(grads[1], acc), _dense(grads[2], acc))
            else:
                cur = (torch.zeros(k.shape, dtype=acc, device=k.device),
                       torch.zeros(v.shape, dtype=acc, device=v.device))
                if grads is not None:
                    cur[0][:, block.kv] += grads[1]
                    cur[1][:, block.kv] += grads[2]
        else:
            dkv_comm.wait()
            cur, in_flight = in_flight[1], None
            if grads is not None:
                cur[0][:, block.kv] += grads[1]
                cur[1][:, block.kv] += grads[2]
        if world_size > 1:
            if last:
                # The sum is complete: the owner only casts it, so it can travel in the input
                # dtype (same rounding, half the bytes of the hop nothing overlaps).
                send = (cur[0].to(k.dtype), cur[1].to(v.dtype))
                landing = (torch.empty_like(k), torch.empty_like(v))
            else:
                send = cur
                landing = (torch.empty_like(cur[0]), torch.empty_like(cur[1]))
            dkv_comm.send_recv(send[0], landing[0])
            dkv_comm.send_recv(send[1], landing[1])
            dkv_comm.commit()
            in_flight = (send, landing)  # keep both alive until the transfer is waited on
        if not last:
            kv_comm.wait()
            kv = nxt
    if dq is None:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    if world_size > 1:
        dkv_comm.wait()
        dk, dv = in_flight[1]
    else:
        dk, dv = cur
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd wrapper around the ring engine; see :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, kernel, plan):
        out, lse = _ring_forward(q, k, v, causal, scale, group, kernel, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, group, kernel, plan)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def run_ring(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None,
             group: dist.ProcessGroup | None, kernel: Kernel | str, plan: Plan) -> tuple[Tensor, Tensor]:
    """Run the ring engine with ``plan``; shared by the ring-shaped variants."""
    if isinstance(kernel, str):
        kernel = get_kernel(kernel)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return RingAttention.apply(q, k, v, causal, scale, group, kernel, plan)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                   softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                   kernel: Kernel | str = "math", cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence, each rank holding one contiguous chunk of it.

    Args:
        q: ``[B, S/W, Hq, D]``, this rank's queries (chunk ``rank`` of the contiguous layout).
        k, v: ``[B, S/W, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA), same dtype as q.
        causal: mask key positions after the query's, globally.
        softmax_scale: defaults to ``D ** -0.5``.
        group: the context-parallel process group (default: the world).
        kernel: a :class:`Kernel` or its name.
        cu_seqlens: not taken by this batch form; must be ``None``.

    Returns:
        ``out`` ``[B, S/W, Hq, D]`` in q's dtype, differentiable; ``lse`` float32
        ``[B, Hq, S/W]`` (float64 for float64 inputs), not differentiable.

    Raises:
        ValueError: ``cu_seqlens`` given, or shapes the kernel refuses.
    """
    if cu_seqlens is not None:
        raise ValueError("ring is the batch form and takes no cu_seqlens; use ring_varlen")
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=contiguous_plan)
