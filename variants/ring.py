"""Ring attention: K/V travel around the ring while each rank keeps its queries.

The engine here serves every ring-shaped variant; a variant only says, through its *plan*,
which part of its queries meets which part of the visiting K/V block at each step, and with
what mask. ``ring`` is the plain contiguous layout.

While an observation is held (``observe.observing``, verify's variant run), the engine reports
every kernel call's block with its rows; otherwise it reports nothing.

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

from . import bands, emulation, observe, timeline, window as _window
from .comm import RingComm
from .kernels import Kernel, accumulation_dtype, as_kernel
from .merge import merge_
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

_ALL = slice(None)


class Step(NamedTuple):
    """A plan's block made concrete for one kernel call.

    ``q`` and ``kv`` are local rows: a slice, or (varlen) int64 row indices. For packed
    documents, ``cu_q`` and ``cu_k`` are the int32 offsets of the documents within the taken
    rows, and ``max_q`` and ``max_k`` their longest lengths; ``None`` and 0 in the batch form.
    Under a sliding window, ``parts`` are its kernel calls (``window.py``), q and kv all rows.
    """

    q: "slice | Tensor"
    kv: "slice | Tensor"
    causal: bool
    cu_q: Tensor | None = None
    cu_k: Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    parts: tuple = ()


#: ``steps(step, source_rank) -> Step | None``: what this rank computes at each ring step.
Steps = Callable[[int, int], "Step | None"]


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
    document whole become plain slices, so ``ring_varlen`` never copies rows. Steps are built
    once per distinct pattern and reused by forward and backward.

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
                sel = _ALL
            else:
                idx = [torch.arange(starts[d] + a, starts[d] + b) for d, a, b in
                       ((p[0], *p[pos]) for p in picks)]
                sel = torch.cat(idx).to(self.device) if idx else torch.empty(0, dtype=torch.int64, device=self.device)
            rows[side] = (sel, lens)
        (q_sel, q_lens), (kv_sel, kv_lens) = rows["q"], rows["kv"]
        if sum(q_lens) == 0 or sum(kv_lens) == 0:
            return None
        # Documents empty on both sides add nothing; dropping them keeps the kernel's batch small.
        kept = [(a, b) for a, b in zip(q_lens, kv_lens) if a or b]
        return Step(q_sel, kv_sel, masks.pop(), _offsets([a for a, _ in kept], self.device),
                    _offsets([b for _, b in kept], self.device), max(a for a, _ in kept), max(b for _, b in kept))


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
def _attend(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, st: Step, scale: float) -> tuple[Tensor, Tensor]:
    if st.parts:
        return _window.attend(kernel, q, k, v, st.parts, scale)
    if st.cu_q is None:
        return kernel.forward(q, k, v, st.causal, scale)
    return kernel.forward_varlen(q, k, v, st.cu_q, st.cu_k, st.max_q, st.max_k, st.causal, scale)


@timeline.timed("kernel")
def _attend_backward(kernel: Kernel, dout, q, k, v, out, lse, st: Step, scale: float):
    if st.parts:
        return _window.attend_backward(kernel, dout, q, k, v, out, lse, st.parts, scale)
    if st.cu_q is None:
        return kernel.backward(dout, q, k, v, out, lse, st.causal, scale)
    return kernel.backward_varlen(dout, q, k, v, out, lse, st.cu_q, st.cu_k, st.max_q, st.max_k, st.causal,
                                  scale)


@timeline.timed("merge")
def _merge_rows(out: Tensor, lse: Tensor, sel, b_out: Tensor, b_lse: Tensor) -> None:
    if isinstance(sel, slice):
        merge_(out[:, sel], lse[:, :, sel], b_out, b_lse)
        return
    o, l = out.index_select(1, sel), lse.index_select(2, sel)
    merge_(o, l, b_out, b_lse)
    out.index_copy_(1, sel, o)
    lse.index_copy_(2, sel, l)


@timeline.timed("merge")
def _add_rows(acc: Tensor, sel, grad: Tensor) -> None:
    if isinstance(sel, slice):
        acc[:, sel] += grad
    else:
        acc.index_add_(1, sel, grad.to(acc.dtype))


def contiguous_plan(step: int, source: int, rank: int, world_size: int, seqlen_local: int,
                    causal: bool) -> Block | None:
    """The plan of the plain ring: the diagonal block is causal, later ranks' blocks are skipped."""
    if not causal:
        return Block(_ALL, _ALL, False)
    if step == 0:
        return Block(_ALL, _ALL, True)
    return Block(_ALL, _ALL, False) if source < rank else None


@timeline.timed("merge")
def _dense(t: Tensor, dtype: torch.dtype) -> Tensor:
    # Accumulators are updated in place and sent as they are: contiguous, in the accumulation dtype.
    return t.to(dtype).contiguous()


def _round_(acc: Tensor, dtype: torch.dtype) -> None:
    # Test fixtures only (``lossy``): the accumulator keeps its storage but holds input-dtype values.
    acc.copy_(acc.to(dtype))


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                  group, kernel: Kernel, steps: Steps, lossy: frozenset = frozenset(),
                  sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    comm = RingComm(group)
    rank, world_size = comm.rank, comm.world_size
    B, S, H, D = (*q.shape[:3], v.shape[3])  # out has v's head dim
    acc = accumulation_dtype(q.dtype)
    seen = observe.current()
    out = lse = None
    spare = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, world_size - 1))]
    kv = (k, v)
    n_steps = getattr(steps, "n_steps", world_size)  # a window may end the ring early
    for step in range(n_steps):
        timeline.step("fwd", step)
        if step + 1 < n_steps:
            nxt = spare[step % 2]
            comm.send_recv(kv[0], nxt[0])
            comm.send_recv(kv[1], nxt[1])
            comm.commit()
        block = steps(step, (rank - step) % world_size)
        if block is not None:
            b_out, b_lse = _attend(kernel, _rows(q, block.q), _rows(kv[0], block.kv), _rows(kv[1], block.kv),
                                   block, scale)
            if seen is not None:
                seen.forward_block(block.q, _ALL, b_out, b_lse)
            if out is None and _is_all(block.q):
                # The first block that covers every query is the accumulator: no merge needed.
                out, lse = _dense(b_out, acc), _dense(b_lse, acc)
            else:
                if out is None:
                    out = torch.zeros(B, S, H, D, dtype=acc, device=q.device)
                    lse = torch.full((B, H, S), float("-inf"), dtype=acc, device=q.device)
                _merge_rows(out, lse, block.q, b_out, b_lse)
                if "out" in lossy:
                    _round_(out, q.dtype)
        if step + 1 < n_steps:
            comm.wait()
            kv = nxt
    if out is None:  # no block at all: every query sees no key
        out = torch.zeros(B, S, H, D, dtype=acc, device=q.device)
        lse = torch.full((B, H, S), float("-inf"), dtype=acc, device=q.device)
    if sink is not None:  # the row's sink joins after its last merge, once (sinks.py)
        out, lse = apply_sink(out, lse, sink)
    return out.to(q.dtype), lse


def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   causal: bool, scale: float, group, kernel: Kernel,
                   steps: Steps, lossy: frozenset = frozenset()) -> tuple[Tensor, Tensor, Tensor]:
    kv_comm, dkv_comm = RingComm(group), RingComm(group)
    rank, world_size = kv_comm.rank, kv_comm.world_size
    acc = accumulation_dtype(q.dtype)
    seen = observe.current()
    dq = None
    spare = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, world_size - 1))]
    kv = (k, v)
    cur = in_flight = None
    for step in range(world_size):
        timeline.step("bwd", step)
        last = step == world_size - 1
        if not last:
            nxt = spare[step % 2]
            kv_comm.send_recv(kv[0], nxt[0])
            kv_comm.send_recv(kv[1], nxt[1])
            kv_comm.commit()
        source = (rank - step) % world_size
        block = steps(step, source)
        grads = None
        if block is not None:
            grads = _attend_backward(kernel, _rows(dout, block.q), _rows(q, block.q), _rows(kv[0], block.kv),
                                     _rows(kv[1], block.kv), _rows(out, block.q), _rows(lse, block.q, 2),
                                     block, scale)
            if seen is not None:
                seen.dq_block(block.q, _ALL, grads[0])
                seen.dkv_block(source, block.kv, _ALL, grads[1], grads[2])
            if dq is None and _is_all(block.q):
                dq = _dense(grads[0], acc)
            else:
                if dq is None:
                    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
                _add_rows(dq, block.q, grads[0])
                if "dq" in lossy:
                    _round_(dq, q.dtype)
        # dK/dV of the visiting block travel with it, in float32, and reach their owner after
        # W hops; the buffer arriving now holds the earlier ranks' share for this block.
        if step == 0:
            if grads is not None and _is_all(block.kv):
                cur = (_dense(grads[1], acc), _dense(grads[2], acc))
            else:
                cur = (torch.zeros(k.shape, dtype=acc, device=k.device),
                       torch.zeros(v.shape, dtype=acc, device=v.device))
                if grads is not None:
                    _add_rows(cur[0], block.kv, grads[1])
                    _add_rows(cur[1], block.kv, grads[2])
        else:
            dkv_comm.wait()
            cur, in_flight = in_flight[1], None
            if grads is not None:
                _add_rows(cur[0], block.kv, grads[1])
                _add_rows(cur[1], block.kv, grads[2])
                if "dkv" in lossy:
                    _round_(cur[0], k.dtype)
                    _round_(cur[1], v.dtype)
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
    def forward(ctx, q, k, v, sink, causal, scale, group, kernel, steps, lossy):
        out, lse = _ring_forward(q, k, v, causal, scale, group, kernel, steps, lossy, sink)
        # With a sink these are (out_f, L), with which the kernels' backward gives exact dq, dk, dv.
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (causal, scale, group, kernel, steps, lossy)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
        dsink = sink_grad(dout, out, lse, sink, ctx.args[2]) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None, None, None, None


def run_ring(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None,
             group: dist.ProcessGroup | None, kernel: Kernel | str, plan: Plan,
             doc_lengths: list[int] | None = None, lossy: tuple[str, ...] = (),
             sink: Tensor | None = None, window: int | None = None,
             layout: str = "contiguous") -> tuple[Tensor, Tensor]:
    """Run the ring engine with ``plan``; shared by the ring-shaped variants.

    ``sink`` (``[Hq]``, see ``sinks.py``) joins every row once, after its last merge; its
    gradient is summed over the group.

    With ``doc_lengths`` (the local tokens of every document, document-wise sharding), q, k
    and v are packed rows ``[1, S/W, H, D]`` and every step is one varlen kernel call over the
    documents' pieces (:class:`VarlenSteps`).

    With ``window`` (keys each query sees, itself included; causal only), the steps come from
    the global positions of ``layout`` (the variant's: contiguous, zigzag or stripe, by document
    with ``doc_lengths``) instead of the plan: ``window.py``.

    ``lossy`` is for test fixtures only (``testing.py``), never correct: the accumulators it
    names (``out``, the running output; ``dq``; ``dkv``, the dK/dV travelling the ring) are
    rounded to the input dtype after every update, the low-precision accumulation verify's
    block-decomposition check must catch.

    Raises:
        ValueError: a kernel the call cannot run with (``kernels.as_kernel``): with
            ``doc_lengths`` one without a varlen form, with ``window`` one that takes none, the
            message starting ``[rank r/W]``; a window that is not positive, or without ``causal``.
    """
    rank, world_size = emulation.rank_and_size(group)
    prefix = f"[rank {rank}/{world_size}] "
    _window.check_window(window, causal, prefix)
    try:
        kernel = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
                           varlen=doc_lengths is not None, window=window is not None)
    except ValueError as exc:
        if doc_lengths is None and window is None:
            raise
        raise ValueError(f"{prefix}{exc}") from None
    if window is not None:
        steps = _window_steps(layout, q.shape[1], doc_lengths, rank, world_size, window)
    elif doc_lengths is None:
        steps = batch_steps(plan, rank, world_size, q.shape[1], causal)
    else:
        steps = VarlenSteps(plan, doc_lengths, rank, world_size, causal, q.device)
    if sink is not None:
        check_sink(sink, q.shape[2], f"[rank {rank}/{world_size}] ")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return RingAttention.apply(q, k, v, sink, causal, scale, group, kernel, steps, frozenset(lossy))


def _window_steps(layout: str, seqlen_local: int, doc_lengths: list[int] | None, rank: int, world_size: int,
                  window: int) -> Steps:
    """The steps of a windowed ring: each one's parts (``window.WindowParts``), q and kv all rows."""
    if doc_lengths is None:
        def runs_of(r):
            return bands.layout_runs(layout, seqlen_local * world_size, r, world_size)
    else:
        def runs_of(r):
            return bands.document_runs([n * world_size for n in doc_lengths], layout, r, world_size)
    parts_of = _window.WindowParts(runs_of, rank, world_size, window)

    def steps(step: int, source: int) -> Step | None:
        parts = parts_of(step, source)
        return None if parts is None else Step(_ALL, _ALL, False, parts=parts)

    steps.n_steps = parts_of.n_steps
    return steps


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                   softmax_scale: float | None = None, group: dist.ProcessGroup | None = None,
                   kernel: Kernel | str = "auto", cu_seqlens: Tensor | None = None,
                   sink: Tensor | None = None, window: int | None = None) -> tuple[Tensor, Tensor]:
    """Attention over the whole sequence, each rank holding one contiguous chunk of it.

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

    Returns:
        ``out`` ``[B, S/W, Hq, D]`` in q's dtype, differentiable; ``lse`` float32
        ``[B, Hq, S/W]`` (float64 for float64 inputs), not differentiable; with a sink, the
        row's ``logaddexp(lse, s_h)``.

    Raises:
        ValueError: ``cu_seqlens`` given, a sink that is not ``[Hq]``, shapes the kernel refuses, or a
            window that is not positive, without ``causal``, or on a kernel that takes none.
    """
    if cu_seqlens is not None:
        raise ValueError("ring is the batch form and takes no cu_seqlens; use ring_varlen")
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=contiguous_plan, sink=sink, window=window, layout="contiguous")
