"""The test-only variants (``TESTING_VARIANTS``): deliberately wrong ones that prove the checks
can fail, faults, and stand-ins for peers that prove how their traffic is counted."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .ring import Block, contiguous_plan, run_ring


def _drop_last_block(step, source, rank, world_size, seqlen_local, causal) -> Block | None:
    # The bug a verifier must catch: one K/V block never reaches the merge.
    if world_size > 1 and step == world_size - 1:
        return None
    return contiguous_plan(step, source, rank, world_size, seqlen_local, causal)


def broken_merge_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                           cu_seqlens=None):
    """A ring that silently drops the last visiting K/V block (test fixture, never correct)."""
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=_drop_last_block)


# --------------------------------------------------------------------------------------
# Low-precision accumulation: rings that round an accumulator to the input dtype after every
# update (the bug class of ring-flash-attn#42 and #22). Their max error against float64 looks
# like a correct ring's; verify's block-decomposition check must catch them. A row (or key)
# that meets at most two partial results is rounded once either way, so at world size 2 they
# compute what the correct ring computes.


def _lossy_ring(accumulator: str):
    def attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto", cu_seqlens=None):
        if cu_seqlens is not None:
            raise ValueError(f"drift_{accumulator} is a batch variant and takes no cu_seqlens")
        return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                        plan=contiguous_plan, lossy=(accumulator,))

    attention.__name__ = f"drift_{accumulator}_attention"
    attention.__doc__ = (f"The plain ring with its {accumulator} accumulator rounded to the input dtype after "
                         "every update (test fixture, never correct).")
    return attention


#: The running output rounded to the input dtype after every merge.
drift_out_attention = _lossy_ring("out")
#: dq accumulated in the input dtype.
drift_dq_attention = _lossy_ring("dq")
#: dK/dV accumulated in the input dtype while they travel the ring to their owner.
drift_dkv_attention = _lossy_ring("dkv")


# --------------------------------------------------------------------------------------
# Fault injection: variants that hang, raise, run out of memory or never communicate, so the
# harness's watchdog, crash report, OOM status and refusals can be provoked on CPU.


def _ring_or_fault(q, k, v, causal, softmax_scale, group, kernel):
    from .ring import ring_attention

    return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel)


def fault_hang_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                         cu_seqlens=None):
    """Rank W-1 sleeps forever before its first transfer; the others wait for it in the ring.

    Test fixture for the launch watchdog: only a wall-clock limit ends this case.
    """
    import time

    import torch.distributed as dist

    if dist.get_rank(group) == dist.get_world_size(group) - 1:
        while True:
            time.sleep(3600)
    return _ring_or_fault(q, k, v, causal, softmax_scale, group, kernel)


def fault_raise_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                          cu_seqlens=None):
    """Rank 1 raises ``RuntimeError("[rank 1/W] injected fault")``; the others wait for it in the ring.

    Test fixture for the crash report (a fault on one rank while the others are in a transfer).
    """
    import torch.distributed as dist

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if rank == 1 % world_size:
        raise RuntimeError(f"[rank {rank}/{world_size}] injected fault")
    return _ring_or_fault(q, k, v, causal, softmax_scale, group, kernel)


def fault_oom_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                        cu_seqlens=None):
    """Every rank runs out of memory at the same point (test fixture for status ``oom``).

    On CUDA it really asks the caching allocator for twice the free memory. On CPU there is
    no CUDA allocator, so it raises the exception class the harness catches,
    ``torch.cuda.OutOfMemoryError``, with CUDA's wording (requested and free memory), the
    free figure being the machine's available RAM.
    """
    import os

    import torch

    if q.is_cuda:
        free, _ = torch.cuda.mem_get_info(q.device)
        torch.empty(2 * free, dtype=torch.uint8, device=q.device)  # raises OutOfMemoryError
    gib = 1024 ** 3
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free = 0
    raise torch.cuda.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {2 * free / gib + 1:.2f} GiB. GPU 0 has a total capacity of "
        f"{free / gib:.2f} GiB of which {free / gib:.2f} GiB is free. (simulated on CPU by fault_oom)")


def fault_silent_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                           cu_seqlens=None):
    """Attend to this rank's own K/V only and never communicate (test fixture, never correct).

    Plain differentiable torch in float32: the never-communicated refusal of ``run`` and the
    cp_active check of ``verify`` must both catch it.
    """
    import torch

    _, seqlen_local, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    qt = q.transpose(1, 2).float()
    kt = k.transpose(1, 2).float().repeat_interleave(groups, dim=1)
    vt = v.transpose(1, 2).float().repeat_interleave(groups, dim=1)
    scores = qt @ kt.transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(seqlen_local, seqlen_local, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ vt).transpose(1, 2).to(q.dtype)
    return out, lse


def never_available() -> str:
    """The availability check of ``fault_unavailable``: a library that is never installed."""
    return "test only: its library is never installed"


# --------------------------------------------------------------------------------------
# Stand-ins for peers: traffic that ringbench's communicators never see.


def _plain_gather(x, group):
    """Every rank's shard of ``x`` [B, S/W, H, D] in rank order, through plain torch.distributed
    point-to-point calls (a ring of ``P2POp``s), as a peer library makes them."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    shards = [None] * world_size
    shards[rank] = cur = x.contiguous()
    for step in range(1, world_size):
        nxt = torch.empty_like(cur)
        ops = [dist.P2POp(dist.isend, cur, to_global((rank + 1) % world_size), group),
               dist.P2POp(dist.irecv, nxt, to_global((rank - 1) % world_size), group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        shards[(rank - step) % world_size] = cur = nxt
    return torch.cat(shards, dim=1)


class _Gathered(torch.autograd.Function):
    """Forward: :func:`_plain_gather`; backward: each shard's gradient summed to its owner with
    ``dist.reduce_scatter_tensor``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _plain_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        world_size = dist.get_world_size(ctx.group)
        shards = torch.cat(grad.chunk(world_size, dim=1), dim=0).contiguous()
        part = torch.empty((grad.shape[0], grad.shape[1] // world_size, *grad.shape[2:]), dtype=grad.dtype,
                           device=grad.device)
        dist.reduce_scatter_tensor(part, shards, group=ctx.group)
        return part, None


def plain_dist_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                         cu_seqlens=None):
    """Gather K/V with plain ``torch.distributed`` calls and attend in plain torch (test fixture).

    Like a peer library, it never calls ringbench's communicators: in forward a ring of
    ``dist.P2POp`` / ``dist.batch_isend_irecv`` gathers K/V (W - 1 steps of both shards), in
    backward ``dist.reduce_scatter_tensor`` returns each shard's gradient to its owner. Its
    bytes are counted only by its session (``comm.counting_dist``). Contiguous layout,
    differentiable, float32 inside; correct, but slow and memory-hungry.
    """
    if cu_seqlens is not None:
        raise ValueError("plain_dist_peer is a batch variant and takes no cu_seqlens")
    rank = dist.get_rank(group)
    _, seqlen_local, heads, head_dim = q.shape
    kg, vg = _Gathered.apply(k, group), _Gathered.apply(v, group)
    groups = heads // k.shape[2]
    scale = softmax_scale if softmax_scale is not None else head_dim ** -0.5
    qt = q.transpose(1, 2).float()
    kt = kg.transpose(1, 2).float().repeat_interleave(groups, dim=1)
    vt = vg.transpose(1, 2).float().repeat_interleave(groups, dim=1)
    scores = qt @ kt.transpose(-1, -2) * scale
    if causal:
        rows = torch.arange(seqlen_local, device=q.device) + rank * seqlen_local
        keys = torch.arange(kg.shape[1], device=q.device)
        scores = scores.masked_fill(keys[None, :] > rows[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.softmax(scores, dim=-1) @ vt).transpose(1, 2).to(q.dtype)
    return out, lse.detach()


# --------------------------------------------------------------------------------------
# Nondeterminism: a variant whose gradients are not bitwise repeatable, for verify --repeat.

#: Backward passes of ``jitter_ring`` so far in this process; every rank counts the same.
_JITTER_CALLS = [0]


class _JitterGrad(torch.autograd.Function):
    """Identity forward; backward moves the smallest-magnitude element of the gradient one or
    two units in the last place away from zero, one on odd calls and two on even ones, so two
    calls in a row never give the same bits (and the error is far below every tolerance)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _JITTER_CALLS[0] += 1
        grad = grad.contiguous().clone()
        flat = grad.view(-1)
        if flat.numel() and grad.is_floating_point():
            ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[grad.element_size()]
            i = int(flat.abs().argmin())
            # One step of the integer view is one unit in the last place, away from zero, either sign.
            flat.view(ints)[i] += 1 if _JITTER_CALLS[0] % 2 else 2
        return grad


def jitter_ring_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                          cu_seqlens=None):
    """The ring, whose dq moves by a rounding or two in one element at every backward, as an
    atomic-add backward's can (test fixture: within tolerance, never bitwise repeatable)."""
    from .ring import ring_attention

    return ring_attention(_JitterGrad.apply(q), k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                          kernel=kernel)


# --------------------------------------------------------------------------------------
# Attention sinks: the sink belongs to the row, not to a block.


def sink_every_block_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                               cu_seqlens=None, sink=None):
    """The plain ring whose kernel folds the sink into every block it returns, so a row that meets
    n blocks counts the sink n times (test fixture, never correct at world size 2 or more).

    Its sink gets no gradient; at world size 1 under a causal mask every row meets one block,
    so its out and lse are right there.
    """
    import dataclasses

    from .kernels import as_kernel
    from .ring import ring_attention
    from .sinks import apply_sink

    if cu_seqlens is not None:
        raise ValueError("sink_every_block is a batch variant and takes no cu_seqlens")
    if sink is None:
        return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel)
    base = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1])

    def forward(qb, kb, vb, block_causal, scale):
        out, lse = base.forward(qb, kb, vb, block_causal, scale)
        out, lse = apply_sink(out, lse, sink.detach())
        return out.to(qb.dtype), lse

    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group,
                    kernel=dataclasses.replace(base, forward=forward), plan=contiguous_plan)


class _RoundGrad(torch.autograd.Function):
    """Identity forward; backward rounds the gradient to ``dtype`` and back."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


def drift_dsink_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                          cu_seqlens=None, sink=None):
    """The ring whose d sink comes back rounded to the input dtype, as an engine that sums it
    in bf16 would (test fixture: out, lse, dq, dk, dv are exact; d sink is off by about one bf16
    rounding, 2**-9 relative, which a rule against the single device's error lets through)."""
    from .ring import ring_attention

    if cu_seqlens is not None:
        raise ValueError("drift_dsink is a batch variant and takes no cu_seqlens")
    if sink is not None:
        sink = _RoundGrad.apply(sink, q.dtype)
    return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                          sink=sink)
