"""Ring attention: K/V travel around the ring while each rank keeps its queries.

The engine here serves every ring-shaped variant; a variant only says, through its *plan*,
which part of its queries meets which part of the visiting K/V block at each step, and with
what mask. ``ring`` is the plain contiguous layout.

While an observation is open (``instruments.open(observe=True)``, verify's variant run), the engine reports
every kernel call's block with its rows; otherwise it reports nothing.

The backward runs the ring the other way round (:func:`_ring_backward`): it starts from the
K/V block the forward used last and ends with each rank's own block, so the hop that brings
a block's dK/dV home overlaps its owner's last kernel call. Each step's merge (forward) and
gradient adds (backward) are one fused launch per step (``merge.merge_step``; ``merge.add_steps``
takes a backward step's dq, dk and dv adds together), which also write the input dtype on the
last one.

Packed documents (the varlen variants) use the same plans: every document is sharded in the
layout on its own, so the plan is applied to each document's local piece, and the pieces it
selects are gathered into one varlen kernel call per step (:class:`VarlenSteps`).

Source: Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
Context" (2023).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import bands, mask_balance, masked, masks, overlap, window as _window
from .. import instruments
from ..instruments import emulation, observe, timeline
from .comm import RingComm, all_reduce as comm_all_reduce, all_reduce_max
from ..kernels.common import Bias, PositionBias, accumulation_dtype, running_lse_dtype
from ..kernels import Kernel, as_kernel
from ..kernels.max_logit import MaxLogit, with_max_logit
from .merge import add_steps, merge_step
from .steps import _ALL, Step, Steps, part_steps
from .sinks import apply_sink, check_sink, sink_grad

Tensor = torch.Tensor


class Block(NamedTuple):
    """Which local queries meet which rows of the visiting K/V, and whether the mask is causal."""

    q: slice
    kv: slice
    causal: bool


#: ``plan(step, source_rank, rank, world_size, seqlen_local, causal) -> Block | None``;
#: ``None`` means this step contributes nothing (the K/V block is entirely in the future).
Plan = Callable[[int, int, int, int, int, bool], "Block | None"]

class RingBias(NamedTuple):
    """An attention bias in the ring engine: the whole-sequence :class:`~..kernels.common.Bias`, the
    global positions of every ring rank's local rows (int64 ``[S/W]`` each, on the device), and
    the bias's query heads this rank's heads are (``None``: all; the Ulysses engine's share)."""

    bias: Bias
    positions: list
    heads: slice | None = None

    def at(self, rank: int, source: int, block: "Step") -> PositionBias:
        """The bias block of ``block``: this rank's query rows against the rows of ``source``'s K/V."""
        return self.bias.at(_pick(self.positions[rank], block.q), _pick(self.positions[source], block.kv),
                            self.heads)


def _bias_at(bias: RingBias | None, rank: int, source: int, block: "Step", lossy: frozenset) -> PositionBias | None:
    # The fixtures' "bias" (never correct): a received K/V block's call takes no bias.
    if bias is None or ("bias" in lossy and source != rank):
        return None
    return bias.at(rank, source, block)


def _pick(positions: Tensor, sel) -> Tensor:
    return positions[sel] if isinstance(sel, slice) else positions.index_select(0, sel.to(positions.device))


def ring_bias(bias: Bias | None, layout: str, seqlen: int, world_size: int, device, *,
              mask: "masks.Mask | None" = None, heads: slice | None = None) -> RingBias | None:
    """The :class:`RingBias` of ``bias`` over ``layout``'s positions (``masked.layout_runs``: the
    balanced layout's from the mask's plan), or ``None`` without a bias."""
    if bias is None:
        return None
    runs = masked.layout_runs(mask, layout, seqlen, world_size)
    positions = []
    for rank_runs in runs:
        ordered = sorted(rank_runs, key=lambda r: r.local)
        positions.append(torch.cat([masked.positions(r, device) for r in ordered]))
    return RingBias(bias, positions, heads)


def batch_steps(plan: Plan, rank: int, world_size: int, seqlen_local: int, causal: bool) -> Steps:
    """The steps of the batch form: the plan's block, as it is."""

    def steps(step: int, source: int) -> Step | None:
        block = plan(step, source, rank, world_size, seqlen_local, causal)
        return None if block is None else Step(block.q, block.kv, block.causal)

    return steps


class VarlenSteps:
    """The steps of the varlen form: the plan applied to every local document piece.

    Every rank holds ``lengths[d]`` tokens of document d (document-wise sharding, so the same
    lengths on every rank and in every visiting K/V block). At each step the plan's block for
    each document, in that document's local coordinates, picks its query rows and key rows;
    the picked rows of all documents become one varlen call. Plans whose blocks cover every
    document whole become plain slices, so ``ring_varlen`` never copies rows. Every step is
    built when the object is made (once per distinct pattern), its offsets, lengths and row
    maps on the device, and reused by forward and backward; one object serves every layer
    of a batch through ``varlen.Documents.schedule``, so no call reads the device.

    Args:
        plan: the batch plan (``contiguous_plan``, ``zigzag_plan``, ...).
        lengths: local tokens of each document, host ints, summing to the local row length.
        rank, world_size, causal: as for the plan.
        device: where the index and offset tensors live.

    Raises:
        RuntimeError: a plan that gives different masks to different documents at one step.
    """

    def __init__(self, plan: Plan, lengths: list[int], rank: int, world_size: int, causal: bool, device):
        self.plan, self.lengths = plan, lengths
        self.rank, self.world_size, self.causal, self.device = rank, world_size, causal, device
        self._by_step: dict[tuple[int, int], Step | None] = {}
        self._by_pattern: dict[tuple, Step | None] = {}
        for step in range(world_size):
            self(step, (rank - step) % world_size)

    def __call__(self, step: int, source: int) -> Step | None:
        if (step, source) not in self._by_step:
            picks = []  # (document, query range, key range, mask) in local document coordinates
            for doc, n in enumerate(self.lengths):
                block = self.plan(step, source, self.rank, self.world_size, n, self.causal)
                if block is not None:
                    picks.append((doc, block.q.indices(n)[:2], block.kv.indices(n)[:2], block.causal))
            key = tuple(picks)
            if key not in self._by_pattern:
                self._by_pattern[key] = self._build(picks)
            self._by_step[(step, source)] = self._by_pattern[key]
        return self._by_step[(step, source)]

    def _build(self, picks) -> Step | None:
        masks = {p[3] for p in picks}
        if len(masks) > 1:
            raise RuntimeError("the plan gave documents different masks at one step; a varlen step makes one "
                               "kernel call, so every document must share the mask")
        starts = [0]
        for n in self.lengths:
            starts.append(starts[-1] + n)
        rows = {}
        for side, pos in (("q", 1), ("kv", 2)):
            covered = {p[0] for p in picks if p[pos] == (0, self.lengths[p[0]])}
            whole = all(d in covered for d, n in enumerate(self.lengths) if n)
            lens = [p[pos][1] - p[pos][0] for p in picks]
            if whole:
                sel, inv = _ALL, None
            else:
                idx = [torch.arange(starts[d] + a, starts[d] + b) for d, a, b in
                       ((p[0], *p[pos]) for p in picks)]
                sel = torch.cat(idx) if idx else torch.empty(0, dtype=torch.int64)
                inv = torch.full((starts[-1],), -1, dtype=torch.int32)
                inv[sel] = torch.arange(sel.numel(), dtype=torch.int32)
                sel, inv = sel.to(self.device), inv.to(self.device)
            rows[side] = (sel, inv, lens)
        (q_sel, q_inv, q_lens), (kv_sel, kv_inv, kv_lens) = rows["q"], rows["kv"]
        if sum(q_lens) == 0 or sum(kv_lens) == 0:
            return None
        # Documents empty on both sides add nothing; dropping them keeps the kernel's batch small.
        kept = [(a, b) for a, b in zip(q_lens, kv_lens) if a or b]
        return Step(q_sel, kv_sel, masks.pop(), _offsets([a for a, _ in kept], self.device),
                    _offsets([b for _, b in kept], self.device), max(a for a, _ in kept), max(b for _, b in kept),
                    q_inv=q_inv, kv_inv=kv_inv)


def _offsets(lengths: list[int], device) -> Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _is_all(sel) -> bool:
    return isinstance(sel, slice) and sel == _ALL


def _rows(x: Tensor, sel, dim: int = 1) -> Tensor:
    """Rows ``sel`` of ``x`` along ``dim`` (1 or 2): a view for a slice, a copy for indices."""
    if isinstance(sel, slice):
        return x[:, sel] if dim == 1 else x[:, :, sel]
    return x.index_select(dim, sel)


@timeline.timed("kernel")
def _attend(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, st: Step, scale: float,
            bias: PositionBias | None = None) -> tuple[Tensor, Tensor]:
    if st.parts:
        return _window.attend(kernel, q, k, v, st.parts, scale, bias)
    if st.cu_q is None:
        return kernel.forward(q, k, v, st.causal, scale, **({} if bias is None else {"bias": bias}))
    return kernel.forward_varlen(q, k, v, st.cu_q, st.cu_k, st.max_q, st.max_k, st.causal, scale)


@timeline.timed("kernel")
def _attend_backward(kernel: Kernel, dout, q, k, v, out, lse, st: Step, scale: float,
                     bias: PositionBias | None = None):
    if st.parts:
        return _window.attend_backward(kernel, dout, q, k, v, out, lse, st.parts, scale, bias)
    if st.cu_q is None:
        return kernel.backward(dout, q, k, v, out, lse, st.causal, scale, **({} if bias is None else {"bias": bias}))
    return kernel.backward_varlen(dout, q, k, v, out, lse, st.cu_q, st.cu_k, st.max_q, st.max_k, st.causal,
                                  scale)


def contiguous_plan(step: int, source: int, rank: int, world_size: int, seqlen_local: int,
                    causal: bool) -> Block | None:
    """The plan of the plain ring: the diagonal block is causal, later ranks' blocks are skipped."""
    if not causal:
        return Block(_ALL, _ALL, False)
    if step == 0:
        return Block(_ALL, _ALL, True)
    return Block(_ALL, _ALL, False) if source < rank else None


def _blocks_of(steps: Steps, rank: int, world_size: int, n_steps: int | None = None) -> int:
    """How many of this rank's first ``n_steps`` steps make a kernel call (each one more term of a row's sum)."""
    return sum(steps(s, (rank - s) % world_size) is not None for s in range(world_size if n_steps is None else n_steps))


def _empty_output(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    # Nothing seen yet: out 0 (v's head dim, head_dim_v) and lse -inf, in the running lse's dtype.
    B, S, H, _ = q.shape
    out = torch.zeros((B, S, H, v.shape[3]), dtype=q.dtype, device=q.device)
    return out, torch.full((B, H, S), float("-inf"), dtype=running_lse_dtype(q.dtype), device=q.device)


@timeline.timed("merge")
def _fold(out, lse, block: Step, b_out: Tensor, b_lse: Tensor, into: torch.dtype, q: Tensor, v: Tensor):
    """Merge one block into the running output (one fused launch on CUDA); see ``merge.merge_step``."""
    if out is None:
        if _is_all(block.q):
            # The first block that covers every query is the running output as it is: one term,
            # exact in the input dtype; the next merge reads it and writes float32. Its lse joins
            # the running lse's dtype (float64 for float32 inputs; no copy for bf16 and fp16).
            return b_out, b_lse.to(running_lse_dtype(q.dtype))
        out, lse = _empty_output(q, v)
    return merge_step(out, lse, block.q, b_out, b_lse, into=into, inv=block.q_inv), lse


@timeline.timed("merge")
def _accumulate(*jobs) -> list:
    """Add blocks' gradients into running sums, each job ``(acc, rows, grad, into, shape, inv)``
    as ``merge.add_step`` takes it: every add of a backward step in one fused launch on CUDA
    (``merge.add_steps``). A job's result is ``None`` when it has neither sum nor gradient."""
    found, todo = [None] * len(jobs), []
    for i, (acc, rows, grad, *_rest) in enumerate(jobs):
        if acc is None and grad is not None and _is_all(rows):
            # The first term, as the kernel returned it: exact in the input dtype; the next add
            # reads it and writes ``into``.
            found[i] = grad
        elif acc is not None or grad is not None:
            todo.append(i)
    for i, res in zip(todo, add_steps([jobs[i] for i in todo])):
        found[i] = res
    return found


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  group, kernel: Kernel, steps: Steps, lossy: frozenset = frozenset(),
                  sink: Tensor | None = None,
                  bias: RingBias | None = None) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """The forward ring: returns out (q's dtype), lse and the K/V block this rank used last.

    A row's running output stays in the input dtype while it holds one block's result, is
    float32 while more blocks follow, and the last merge writes the input dtype: the sum of
    an all-float32 accumulation, rounded once, without a separate cast. With a ``sink`` the
    last merge stays in float32, the sink joins, and the result is cast once. A ``bias`` gives
    each kernel call its block (:meth:`RingBias.at`). The running lse
    is float64 for float32 inputs (``running_lse_dtype``) and is rounded once at the end, to
    float32 for bf16, fp16 and fp32 inputs (float64 for float64).
    """
    comm = RingComm(group)
    rank, world_size = comm.rank, comm.world_size
    acc = accumulation_dtype(q.dtype)
    seen = observe.current()
    n_steps = getattr(steps, "n_steps", world_size)  # a window may end the ring early
    left = _blocks_of(steps, rank, world_size, n_steps)
    out = lse = None
    side = overlap.Side(q.device)
    spare = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, world_size - 1))]
    kv = (k, v)
    for step in range(n_steps):
        timeline.step("fwd", step)
        if step + 1 < n_steps:
            nxt = spare[step % 2]
            comm.send_recv(kv[0], nxt[0])
            comm.send_recv(kv[1], nxt[1])
            comm.commit()
        source = (rank - step) % world_size
        block = steps(step, source)
        if block is not None:
            b_out, b_lse = _attend(kernel, _rows(q, block.q), _rows(kv[0], block.kv), _rows(kv[1], block.kv),
                                   block, scale, _bias_at(bias, rank, source, block, lossy))
            if seen is not None:
                seen.forward_block(block.q, _ALL, b_out, b_lse)
            left -= 1
            into = q.dtype if (left == 0 and sink is None) or "out" in lossy else acc
            with side.work(out, lse, b_out, b_lse):  # beside the next step's kernel
                out, lse = _fold(out, lse, block, b_out, b_lse, into, q, v)
            side.made(out, lse)
        if step + 1 < n_steps:
            comm.wait()
            kv = nxt
    side.join()
    if out is None:  # no block at all: every query sees no key
        out, lse = _empty_output(q, v)
    if sink is not None:  # the row's sink joins after its last merge, once (sinks.py)
        out, lse = apply_sink(out, lse, sink)
    if out.dtype != q.dtype:  # a sink, or one block that came back in another dtype
        out = out.to(q.dtype)
    lse = lse.to(acc)  # the running lse rounded once; the backward reads this one, as on one device
    # rank + 1's block, where the backward starts; a window that ended the ring early has none.
    return out, lse, kv if n_steps == world_size else None


def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   kv_last: tuple[Tensor, Tensor], causal: bool, scale: float, group, kernel: Kernel,
                   steps: Steps, lossy: frozenset = frozenset(),
                   dkv_dtype: torch.dtype | None = None, bias: RingBias | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward ring, in reverse ring order, so no dK/dV transfer is left exposed.

    It starts from ``kv_last``, the K/V block of rank + 1 that the forward used last, and
    visits the blocks of ranks + 2, + 3, ... with K/V and their dK/dV passed to rank - 1;
    this rank's own block comes last, its kernel call overlapping the final hop that brings
    its dK/dV home. So W - 2 K/V transfers instead of W - 1, and the final hop's wait comes
    after the last compute. A hop's partial dK/dV holds at most i + 1 terms after visiting
    step i: the first hop travels in the input dtype (one term, exact), later ones in float32;
    the owner adds its own block's term and writes the input dtype, or ``dkv_dtype`` where
    given (the Ulysses engine's K/V replicas, summed after the ring before one rounding).
    A ``bias`` gives each kernel call its block, whose backward adds its ``d bias`` into the
    bias's open gradient (this rank's share; the caller reduces it over the ranks).
    """
    kv_comm, dkv_comm = RingComm(group, reverse=True), RingComm(group, reverse=True)
    rank, world_size = kv_comm.rank, kv_comm.world_size
    acc = accumulation_dtype(q.dtype)
    seen = observe.current()
    left = _blocks_of(steps, rank, world_size)
    windowed = hasattr(steps, "n_steps")
    dq = None
    side = overlap.Side(q.device)
    spare = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, max(0, world_size - 2)))]
    if world_size > 1 and kv_last is None:  # a window ended the forward early: fetch rank + 1's block
        kv_last = (torch.empty_like(k), torch.empty_like(v))
        kv_comm.send_recv(k, kv_last[0])
        kv_comm.send_recv(v, kv_last[1])
        kv_comm.commit()
        kv_comm.wait()
    kv = kv_last if world_size > 1 else (k, v)
    landing = None
    for i in range(world_size):
        timeline.step("bwd", i)
        own = i == world_size - 1
        source = (rank + 1 + i) % world_size  # the last step is this rank's own block
        if own:
            kv = (k, v)
        receive = i + 2 < world_size  # a K/V block for the next visiting step
        if receive:
            nxt = spare[i % 2]
            kv_comm.send_recv(kv[0], nxt[0])
            kv_comm.send_recv(kv[1], nxt[1])
            kv_comm.commit()
        block = steps((rank - source) % world_size, source)
        grads = None
        if block is not None:
            grads = _attend_backward(kernel, _rows(dout, block.q), _rows(q, block.q), _rows(kv[0], block.kv),
                                     _rows(kv[1], block.kv), _rows(out, block.q), _rows(lse, block.q, 2),
                                     block, scale, _bias_at(bias, rank, source, block, lossy))
            if seen is not None:
                seen.dq_block(block.q, _ALL, grads[0])
                seen.dkv_block(source, block.kv, _ALL, grads[1], grads[2])
            left -= 1
            into = q.dtype if left == 0 or "dq" in lossy else acc
        dq_job = [(dq, block.q, grads[0], into, q.shape, block.q_inv)] if block is not None else []
        if own:  # its dq joins the last dK/dV add, after the final hop
            break
        # The visiting block's dK/dV: this rank's term added to what ranks + 1, + 2, ... sent,
        # in the same launch as dq's add.
        incoming = (None, None)
        if i > 0:
            dkv_comm.wait()
            incoming = landing
        # A windowed step's gradient can be a sum of several kernel calls already (window.py).
        hop = k.dtype if (i == 0 and not windowed) or "dkv" in lossy else acc
        # The adds and the hop they feed go beside the next step's kernel.
        with side.work(dq, *incoming, *(grads or ())):
            sums = _accumulate(*dq_job, *(
                (incoming[j], block.kv if block is not None else _ALL, grads[1 + j] if grads is not None else None,
                 hop, like.shape, block.kv_inv if block is not None else None) for j, like in enumerate((k, v))))
            dq, partial = (sums[0] if dq_job else dq), sums[-2:]
            partial = tuple(p.to(hop).contiguous() if p is not None else torch.zeros(like.shape, dtype=hop,
                                                                                       device=like.device)
                            for p, like in zip(partial, (k, v)))
            landing = (torch.empty(k.shape, dtype=hop, device=k.device),
                       torch.empty(v.shape, dtype=hop, device=v.device))
            dkv_comm.send_recv(partial[0], landing[0])
            dkv_comm.send_recv(partial[1], landing[1])
            dkv_comm.commit()
        side.made(dq, *landing)
        if receive:
            kv_comm.wait()
            kv = nxt
    side.join()
    incoming = (None, None)
    if world_size > 1:
        dkv_comm.wait()
        incoming = landing
    rows = block.kv if block is not None else _ALL
    inv = block.kv_inv if block is not None else None
    home = [like.dtype if dkv_dtype is None else dkv_dtype for like in (k, v)]
    *dq_sum, dk, dv = _accumulate(*dq_job, *(
        (incoming[j], rows, grads[1 + j] if grads is not None else None, home[j], like.shape, inv)
        for j, like in enumerate((k, v))))
    dq = dq_sum[0] if dq_job else dq
    if dq is None:
        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    elif dq.dtype != q.dtype:  # only when this rank's last kernel call saw none of its queries
        dq = dq.to(q.dtype)
    dk = dk.to(home[0]) if dk is not None else torch.zeros_like(k, dtype=home[0])
    dv = dv.to(home[1]) if dv is not None else torch.zeros_like(v, dtype=home[1])
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Autograd wrapper around the ring engine; see :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, sink, bias_values, causal, scale, group, kernel, steps, lossy, bias=None):
        instruments.carry(ctx)  # the backward reports to these, on whichever thread autograd runs it
        out, lse, kv_last = _ring_forward(q, k, v, causal, scale, group, kernel, steps, lossy, sink, bias)
        # With a sink these are (out_f, L), with which the kernels' backward gives exact dq, dk, dv.
        ctx.save_for_backward(q, k, v, out, lse, sink)
        # The backward starts from the K/V block the forward used last (rank + 1's): kept, not
        # sent again. It costs one K/V shard of memory per call until the backward.
        ctx.kv_last = kv_last if kv_last is not None and kv_last[0] is not k else None
        ctx.args = (causal, scale, group, kernel, steps, lossy)
        ctx.bias = bias
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @instruments.carried
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        kv_last, ctx.kv_last = ctx.kv_last, None
        bias = ctx.bias
        learn = bias is not None and ctx.needs_input_grad[4]
        if learn:
            bias.bias.open_grad(accumulation_dtype(q.dtype))
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, kv_last, *ctx.args, bias=bias)
        dsink = sink_grad(dout, out, lse, sink, ctx.args[2]) if ctx.needs_input_grad[3] else None
        # The fixtures' "dbias" (never correct): this rank's share alone, not summed over the group.
        dbias = bias_grad(bias.bias, *(() if "dbias" in ctx.args[5] else (ctx.args[2],))) if learn else None
        return dq, dk, dv, dsink, dbias, None, None, None, None, None, None, None


def bias_grad(bias: Bias, *groups) -> Tensor:
    """``d bias``: this rank's share that the kernels added into the bias's open gradient, closed and
    summed over ``groups`` in turn (the ring's group; the Ulysses engine's ring and Ulysses groups),
    the same on every rank, in the bias values' dtype."""
    grad = bias.close_grad()
    for group in groups:
        if emulation.rank_and_size(group)[1] > 1:
            with timeline.span("comm"):  # a blocking all-reduce: exposed communication in --profile
                comm_all_reduce(grad, group=group)
    return grad.to(bias.values.dtype)


def run_ring(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None,
             group: dist.ProcessGroup | None, kernel: Kernel | str, plan: Plan,
             doc_lengths: list[int] | None = None, steps: "VarlenSteps | None" = None,
             lossy: tuple[str, ...] = (), sink: Tensor | None = None, window: int | None = None,
             layout: str = "contiguous", mask: "str | masks.Mask | None" = None,
             mask_parts: "masked.Parts | None" = None, bias: Bias | None = None,
             max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Run the ring engine with ``plan``; shared by the ring-shaped variants.

    ``sink`` (``[Hq]``, see ``sinks.py``) joins every row once, after its last merge; its
    gradient is summed over the group.

    With ``doc_lengths`` (the local tokens of every document, document-wise sharding), q, k
    and v are packed rows ``[1, S/W, H, D]`` and every step is one varlen kernel call over the
    documents' pieces (:class:`VarlenSteps`); ``steps``, a :class:`VarlenSteps` built once for
    the batch (``varlen.Documents.schedule``), is used as it is instead of building one.

    With ``window`` (keys each query sees, itself included; causal only), the steps come from
    the global positions of ``layout`` (the variant's: contiguous, zigzag or stripe, by document
    with ``doc_lengths``) instead of the plan: ``window.py``.

    With ``mask`` (``masks.py``: a mask's text such as ``prefix:512``, or a built ``masks.Mask``
    over the global sequence; with ``doc_lengths``, applied per document over the packed row,
    ``masks.documents``), the steps come from the same positions and the mask (``masked.py``):
    empty blocks (every cross-document block among them) make no kernel call, full ones a plain
    call, partial ones a call with the block's ``PositionMask``; ``causal`` is then ignored. ``mask_parts`` is for test
    fixtures only (``masked.ring_steps``' ``parts``).

    With ``bias`` (a ``kernels.common.Bias`` over the global sequence; batch form only), every
    kernel call takes the bias's block of its rows' and keys' global positions in ``layout``
    (:class:`RingBias`), on a kernel that takes a bias; a learnable bias's gradient is summed
    over the group (:func:`bias_grad`).

    With ``max_logit`` (a ``kernels.max_logit.MaxLogit`` of ``[Hq]``; batch form only), every
    forward kernel call raises it to its block's largest score per head (after the mask, window
    and bias), and after the forward it is reduced with a MAX over the group, the same on every rank.

    ``lossy`` is for test fixtures only (``testing.py``), never correct: the accumulators it
    names (``out``, the running output; ``dq``; ``dkv``, the dK/dV travelling the ring) are
    rounded to the input dtype after every update, the low-precision accumulation verify's
    block-decomposition check must catch; ``bias`` drops the bias from every call on a received
    K/V block, ``dbias`` leaves d bias unsummed over the group (each rank's share alone), and
    ``max_logit`` leaves the max logit unreduced (each rank's own blocks alone).

    Raises:
        ValueError: a kernel the call cannot run with (``kernels.as_kernel``): with
            ``doc_lengths`` one without a varlen form, with ``window`` one that takes none, with a
            mask one that takes no mask, the message starting ``[rank r/W]``; a window that is not
            positive, or without ``causal``; a mask that is malformed, does not fit the sequence or
            the documents, or comes with a window.
    """
    rank, world_size = emulation.rank_and_size(group)
    prefix = f"[rank {rank}/{world_size}] "
    _window.check_window(window, causal, prefix)
    mask = masked.as_mask(mask, q.shape[1] * world_size, window=window, prefix=prefix,
                          docs=None if doc_lengths is None else [n * world_size for n in doc_lengths])
    try:
        kernel = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                           varlen=doc_lengths is not None, window=window is not None,
                           mask=masks.label(mask.text) if mask is not None else "",
                           bias=bias.kind if bias is not None else "", max_logit=max_logit is not None)
        check_max_logit(max_logit, q, doc_lengths is not None)
    except ValueError as exc:
        if doc_lengths is None and window is None and mask is None and bias is None and max_logit is None:
            raise
        raise ValueError(f"{prefix}{exc}") from None
    if steps is None or window is not None or doc_lengths is None:  # a given steps serves varlen only
        steps = steps_for(plan, layout, q.shape[1], rank, world_size, causal, window=window,
                          doc_lengths=doc_lengths, device=q.device, mask=mask, mask_parts=mask_parts,
                          by_slices=kernel.by_slices)
    if sink is not None:
        check_sink(sink, q.shape[2], f"[rank {rank}/{world_size}] ")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    ring = None
    if bias is not None:
        check_bias_of(bias, q, world_size, doc_lengths is not None, prefix)
        ring = ring_bias(bias, layout, q.shape[1] * world_size, world_size, q.device, mask=mask)
    values = bias.values if bias is not None and bias.learnable else None
    out, lse = RingAttention.apply(q, k, v, sink, values, causal, scale, group, with_max_logit(kernel, max_logit),
                                   steps, frozenset(lossy), ring)
    if max_logit is not None and "max_logit" not in lossy:  # the fixtures' "max_logit" (never correct) keeps its own
        all_reduce_max(max_logit.values, group=group)
    return out, lse


def check_max_logit(max_logit: MaxLogit | None, q: Tensor, docs: bool) -> None:
    """Refuse a max logit accumulator an engine cannot fill: with packed documents, or not of q's heads.

    Raises:
        ValueError: one sentence naming the value and the rule.
    """
    if max_logit is None:
        return
    if not isinstance(max_logit, MaxLogit):
        raise ValueError(f"max_logit {max_logit!r} must be a kernels.max_logit.MaxLogit; build one with "
                         "MaxLogit.empty(heads, dtype, device)")
    if docs:
        raise ValueError("the max logit does not go with packed documents yet; use a batch variant")
    if max_logit.values.numel() != q.shape[2]:
        raise ValueError(f"the max logit accumulator holds {max_logit.values.numel()} heads, but q has {q.shape[2]}; "
                         "build it for the query heads")


def check_bias_of(bias: Bias, q: Tensor, world_size: int, docs: bool, prefix: str = "") -> None:
    """Refuse a bias a batch engine cannot take: with packed documents, over another sequence length,
    or per head for another number of heads.

    Raises:
        ValueError: one sentence starting with ``prefix``.
    """
    if not isinstance(bias, Bias):
        raise ValueError(f"{prefix}bias {bias!r} must be a kernels.common.Bias (ALiBi's slopes or a learnable "
                         "tensor); build one with Bias(kind, values)")
    if docs:
        raise ValueError(f"{prefix}bias {bias.kind} does not go with packed documents yet; use a batch variant")
    seqlen = q.shape[1] * world_size
    if bias.seqlen is not None and bias.seqlen != seqlen:
        raise ValueError(f"{prefix}bias {bias.kind} is over {bias.seqlen} tokens, but the sequence has {seqlen}; "
                         "build it over the global sequence")
    heads = bias.heads()
    if heads is not None and heads != q.shape[2]:
        raise ValueError(f"{prefix}bias {bias.kind} holds {heads} query heads, but q has {q.shape[2]}; build it "
                         "for the query heads")


def steps_for(plan: Plan, layout: str, seqlen_local: int, rank: int, world_size: int, causal: bool, *,
              window: int | None = None, doc_lengths: list[int] | None = None, device="cpu",
              mask: "masks.Mask | None" = None, mask_parts: "masked.Parts | None" = None,
              by_slices: bool = False) -> Steps:
    """What ``rank`` computes at every ring step: the steps :func:`run_ring` runs, public so that
    ``ringbench predict`` walks the very schedule that runs (issue 24).

    Under a ``window``, the window's parts over ``layout`` (with an ``n_steps`` attribute: the
    forward ring may end early); under a ``mask`` (a ``masks.Mask`` over the global sequence),
    its parts over ``layout`` the same way (``masked.ring_steps``, kept between calls; ``by_slices``:
    partial blocks as window calls, for a kernel that takes no mask); with
    ``doc_lengths``, :class:`VarlenSteps` (index tensors on ``device``); else :func:`batch_steps`.
    """
    if mask is not None:
        kw = {} if mask_parts is None else {"parts": mask_parts}
        return masked.ring_steps(mask, layout, seqlen_local, rank, world_size, torch.device(device), by_slices=by_slices,
                                 **kw)
    if window is not None:
        return _window_steps(layout, seqlen_local, doc_lengths, rank, world_size, window)
    if doc_lengths is None:
        return batch_steps(plan, rank, world_size, seqlen_local, causal)
    return VarlenSteps(plan, doc_lengths, rank, world_size, causal, device)


def _window_steps(layout: str, seqlen_local: int, doc_lengths: list[int] | None, rank: int, world_size: int,
                  window: int) -> Steps:
    """The steps of a windowed ring: each one's parts (``window.WindowParts``), q and kv all rows."""
    if doc_lengths is None:
        def runs_of(r):
            return bands.layout_runs(layout, seqlen_local * world_size, r, world_size)
    else:
        def runs_of(r):
            return bands.document_runs([n * world_size for n in doc_lengths], layout, r, world_size)
    return part_steps(_window.WindowParts(runs_of, rank, world_size, window))


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                   softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                   kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                   sink: Tensor | None = None, window: int | None = None,
                   mask: str | None = None, layout: str = "contiguous",
                   bias: Bias | None = None, max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence, each rank holding one contiguous chunk of it, or under a
    mask, with ``layout="balanced"``, the chunks the mask planner gives it (``mask_balance.py``).

    Args:
        q: ``[B, S/W, Hq, D]``, this rank's queries (chunk ``rank`` of the contiguous layout).
        k, v: ``[B, S/W, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA), same dtype as q.
        causal: mask key positions after the query's, globally.
        softmax_scale: defaults to ``D ** -0.5``.
        group: the context-parallel process group (default: the world).
        kernel: a :class:`Kernel` or its name; ``auto`` (default) takes the best one available
            for the tensors' device and dtype.
        cu_seqlens: not taken by this batch form; must be ``None``.
        sink: ``[Hq]`` float32 sink logits (``sinks.py``), or ``None``; differentiable.
        window: a causal sliding window of this many keys (query p sees keys p - window + 1 .. p);
            ``None``: none. Steps outside it make no kernel call, and the forward ring stops
            after the last step any rank needs (``window.py``).
        mask: any mask (``masks.py``: ``prefix:512``, ``chunked:8k``, ``slices:...``) over the global
            sequence, or ``None``; blocks it leaves empty make no kernel call (and K/V that every
            remaining step masks are not sent), partial ones go to a kernel that takes a mask, and
            ``causal`` is ignored (``run_ring``).
        bias: an attention bias over the global sequence (``kernels.common.Bias``: ALiBi, or a
            learnable tensor whose ``values`` get their gradient, summed over the group), added to
            every kernel call's scaled scores at its rows' global positions; ``None``: none.
        max_logit: a ``kernels.max_logit.MaxLogit`` of ``[Hq]`` (float32; float64 for float64
            inputs), raised in place to each head's largest scaled, masked, biased score over the
            whole sequence, the same on every rank; ``None``: none (``run_ring``).
        layout: ``contiguous`` (default), or ``balanced`` under a mask: q, k and v hold this rank's
            chunks of ``mask_balance.default_plan(mask, W)``, in ascending position
            (``layouts.shard(x, "balanced", rank, W, mask=mask)``), every block's global positions
            taken from that plan; or ``ptrr`` under a mask, PyTorch's processing-time round robin
            (``mask_balance.ptrr_plan``), the same way.

    Returns:
        ``out`` ``[B, S/W, Hq, D]`` in q's dtype, differentiable; ``lse`` float32
        ``[B, Hq, S/W]`` (float64 for float64 inputs), not differentiable; with a sink, the
        row's ``logaddexp(lse, s_h)``.

    Raises:
        ValueError: ``cu_seqlens`` given, a sink that is not ``[Hq]``, shapes the kernel refuses, or a
            window that is not positive, without ``causal``, or on a kernel that takes none; a mask
            that is malformed, does not fit the sequence, comes with a window, or on a kernel that
            takes none; a layout other than contiguous, or balanced without a mask.
    """
    if cu_seqlens is not None:
        raise ValueError("ring is the batch form and takes no cu_seqlens; use ring_varlen")
    if layout not in ("contiguous", *mask_balance.PLANNED):
        raise ValueError(f"layout {layout!r} is not one ring takes; choose contiguous, "
                         f"{' or '.join(mask_balance.PLANNED)}")
    if layout in mask_balance.PLANNED and not mask:
        raise ValueError(f"layout {layout!r} follows a mask, and ring was given none; pass mask=, or layout "
                         "contiguous")
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=contiguous_plan, sink=sink, window=window, layout=layout, mask=mask, bias=bias,
                    max_logit=max_logit)
