"""Every rank's program for one case, walked from the engines' own plans: kernel calls, merges, transfers, waits.

The model restates no algorithm. What each rank computes at each ring step comes from the
engine's plan through ``ring.steps_for`` (the steps ``run_ring`` runs: ``contiguous_plan``,
``zigzag_plan``, ``stripe_plan``, their varlen steps and the window's parts), llama3's from
``llama3.schedule`` (its head groups and kernel blocks), llama3_varlen's from
``llama3_varlen.schedule`` (its head groups and the document pieces of its one varlen call per
group, the very function the engine builds them with), and the Ulysses head split from the
registry's rules (``Variant.ulysses_degree``, ``variants.rules``). What this module adds is the
*order* in which an engine issues its transfers, computes and waits, one function per engine
loop, each following the loop it names line by line, so the overlap is the engine's:

- ring forward (``ring._ring_forward``): at step s the K/V for step s + 1 is committed, then
  step s's kernel and merge run, then the wait;
- ring backward (``ring._ring_backward``): the reverse ring, K/V for step i + 1 committed before
  step i's kernel, the dK/dV partial of step i - 1 waited for after it, added, sent on; the own
  block last, its dK/dV hop waited for after the last compute;
- all-gather (``llama3._forward``/``_backward``, ``llama3_varlen._forward``/``_backward``): the
  next head group's gather in flight while the current one computes; backward reduce-scatters
  each group's float32 dK/dV, blocking;
- Ulysses (``ulysses.UlyssesRing``): blocking all-to-alls of q, k, v (K/V replicated first when
  the degree exceeds kv_heads), the ring over the ring group, then out and lse back; backward
  dout over, the ring's backward, dq, dk, dv back.

A program is a list of ops; every rank's has the same sequence of :class:`Post` and
:class:`Wait` (the engines' loops do not depend on the rank), only the compute between them
differs, which is what ``simulate`` relies on. Torch is imported (the plans live in torch
modules), but nothing runs on a device: index tensors of varlen steps are built on CPU.

Source: issue 24 ("the model is the engines' own schedule").
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
from dataclasses import dataclass
from typing import NamedTuple

from ringbench.model.calibration import Call, Shape
from ringbench.variants import VARIANTS, get_variant

#: The plan of each ring layout, as (engine module, function), looked up when a case is walked,
#: so a plan that changes (or a test's plan) changes the prediction.
PLANS = {"contiguous": ("ring", "contiguous_plan"), "zigzag": ("zigzag", "zigzag_plan"),
         "stripe": ("stripe", "stripe_plan")}
#: Bytes per element of each dtype; float32 accumulators are 4.
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}


class Compute(NamedTuple):
    """GPU work on the rank's compute stream: a ``kernel`` call, or a ``merge``, ``add`` or ``copy``
    of ``nbytes`` bytes; ``phase`` is fwd or bwd, ``step`` the engine's step. ``side``: issued on the
    ring's side stream beside the next kernel (``variants/engines/overlap.py``, CUDA); a ``join``
    (no work) makes the compute stream wait for the side stream."""

    kind: str
    phase: str
    step: int
    call: Call | None = None
    nbytes: float = 0.0
    side: bool = False


class Post(NamedTuple):
    """A transfer issued on the rank's communication stream at the current point of its compute stream.

    ``op``: ``p2p`` (send ``nbytes`` to ``send_to``, receive as much from ``recv_from``, one batch),
    or a collective over ``group`` (``all_gather``, ``reduce_scatter``: ``nbytes`` the local
    shard; ``all_to_all``: ``nbytes`` the whole local tensor). ``channel`` names what a later
    :class:`Wait` waits for.
    """

    channel: str
    op: str
    phase: str
    step: int
    nbytes: float
    group: tuple[int, ...] = ()
    send_to: int = -1
    recv_from: int = -1
    side: bool = False  # issued from the side stream, after its work (the backward's dK/dV hop)


class Wait(NamedTuple):
    """The compute stream waits for the latest :class:`Post` of ``channel``."""

    channel: str


@dataclass(frozen=True)
class Layout:
    """How a case's ranks are arranged for its engine: the Ulysses degree and the ring over the rest."""

    ulysses_degree: int
    ring_degree: int


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector paused for a block: a walk builds W² small tuples, none in a cycle,
    and each collection would scan them all again (most of predict's time at hundreds of ranks)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Unpredictable(ValueError):
    """A case whose schedule the model cannot walk (a peer, a form not covered yet); the message says why."""


# --------------------------------------------------------------------------- from the plans' blocks to calls

def _rows(sel, n: int) -> int:
    if isinstance(sel, slice):
        a, b, _ = sel.indices(n)
        return max(0, b - a)
    return int(sel.numel())


def _causal_doc_pairs(lq: int, lk: int) -> float:
    # The kernels' causal mask is aligned bottom-right: query i sees keys j <= i + lk - lq.
    if lk >= lq:
        return lq * (lk - lq) + lq * (lq + 1) / 2
    return lk * (lk + 1) / 2


def part_pairs(q: int, k: int, band) -> float:
    """Pairs of a block of ``q`` rows and ``k`` keys under a flash-attn band ``(left, right)``
    (bottom-right aligned, ``None`` unbounded): a closed form of ``bands.part_pairs``."""
    if band is None:
        return float(q) * k
    left, right = band
    shift = k - q  # query i sees keys i + shift - left .. i + shift + right
    total = 0.0
    # The count per row is piecewise linear in i; sum it over the pieces where the ends are clipped.
    def count(i):
        a = 0 if left is None else max(0, i + shift - left)
        b = k - 1 if right is None else min(k - 1, i + shift + right)
        return max(0, b - a + 1)
    cuts = {0, q}
    for c in ((left - shift) if left is not None else None, (k - 1 - shift - right) if right is not None else None,
              (-shift - right) if right is not None else None, (k - shift + (left or 0)) if left is not None else None):
        if c is not None:
            for x in (c, c + 1):
                if 0 < x < q:
                    cuts.add(x)
    cuts = sorted(cuts)
    for a, b in zip(cuts, cuts[1:]):
        n = b - a
        total += (count(a) + count(b - 1)) * n / 2  # linear on the piece
    return total


def band_call(mode: str, m: int, n: int, band) -> Call:
    """The call of ``m`` query rows against ``n`` keys under a flash-attn band ``(left, right)``
    (:func:`part_pairs`), or of every pair where ``band`` is ``None``."""
    if band is None:
        return Call(mode, "full", m, n, float(m) * n)
    return Call(mode, "window", m, n, part_pairs(m, n, band), window=band[0] + 1 if band[0] is not None else n)


def step_calls(step, mode: str, seqlen_local: int) -> list[Call]:
    """The kernel calls of one engine :class:`ring.Step` (a window step's parts are several)."""
    if step.parts:
        calls = []
        # A mask's full part (masked.MaskPart) has no window.
        return [band_call(mode, p.q[1] - p.q[0], p.kv[1] - p.kv[0], getattr(p, "window", None)) for p in step.parts]
    if step.cu_q is not None:
        cq, ck = step.cu_q.tolist(), step.cu_k.tolist()
        docs = []
        for (a, b), (c, d) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
            lq, lk = b - a, d - c
            docs.append((lq, lk, _causal_doc_pairs(lq, lk) if step.causal else float(lq) * lk))
        q, k = cq[-1], ck[-1]
        return [Call(mode, "causal" if step.causal else "full", q, k, sum(p for *_, p in docs), docs=tuple(docs))]
    m, n = _rows(step.q, seqlen_local), _rows(step.kv, seqlen_local)
    if step.causal:
        return [Call(mode, "causal", m, n, m * (m + 1) / 2)]
    return [Call(mode, "full", m, n, float(m) * n)]


def _whole(parts, seqlen_local: int) -> bool:
    # window._whole: one part over the whole block is the kernel's own result.
    return len(parts) == 1 and parts[0].q == (0, seqlen_local) and parts[0].kv == (0, seqlen_local)


def _merge_bytes(rows: int, shape: Shape, esize: int, *, local: int | None = None, held: int = 4,
                 into: int = 4) -> float:
    """Bytes of one ``merge.merge_step``: the block's out read, the running out read at its rows and
    written in ``into`` bytes an element; where the running out changes dtype (``held`` bytes, as
    the engine keeps it: the input dtype while it holds one block, float32 while more follow)
    every one of its ``local`` rows is carried over; lse read twice and written once."""
    touched = local if (local is not None and held != into) else rows
    per_row = shape.batch * shape.heads
    return per_row * (touched * shape.head_dim_v * (held + into) + rows * shape.head_dim_v * esize + rows * 12)


def _grad_elements(q_rows: int, kv_rows: int, shape: Shape) -> int:
    # dq at q_rows, dk and dv at kv_rows: the elements of a step's gradients.
    return shape.batch * (q_rows * shape.heads * shape.head_dim + kv_rows * shape.kv_heads *
                          (shape.head_dim + shape.head_dim_v))


def _add_bytes(q_rows: int, kv_rows: int, shape: Shape, esize: int) -> float:
    # add_steps: dq at the block's query rows, dk and dv at its key rows; read sum and grad, write the sum.
    return _grad_elements(q_rows, kv_rows, shape) * (4 + esize + 4)


# --------------------------------------------------------------------------- the ring engine

def ring_steps(layout: str, seqlen_local: int, ring_rank: int, ring_degree: int, causal: bool, window: int | None,
               doc_lengths: list[int] | None, mask=None):
    """The engine's steps for one ring rank (``ring.steps_for`` with the layout's plan, looked up now);
    under ``mask`` (a ``masks.Mask`` over the global sequence) the steps a window-taking kernel runs,
    each partial block cut into one window call per slice of the mask (``masked.ring_steps``)."""
    from ringbench.variants.engines import ring

    module, name = PLANS.get(layout, PLANS["contiguous"])  # balanced, ptrr: the mask's own parts, no plan
    plan = getattr(importlib.import_module(f"ringbench.variants.engines.{module}"), name)
    return _memo(ring.steps_for(plan, layout, seqlen_local, ring_rank, ring_degree, causal, window=window,
                                doc_lengths=doc_lengths, device="cpu", mask=mask, by_slices=mask is not None))


def _row_copies(block, phase: str, step: int, shape: Shape, esize: int) -> list:
    """The copies ``ring._rows`` makes of a block whose rows are indices (a varlen zigzag half-step):
    at its query rows q (forward), or dout, q, out and the float32 lse (backward); at its key rows k
    and v. Each is one ``index_select``: its rows read and written."""
    sizes = []
    if not isinstance(block.q, slice):
        row = shape.batch * _rows(block.q, 0) * shape.heads
        sizes += [row * shape.head_dim * esize] if phase == "fwd" else [
            row * shape.head_dim_v * esize, row * shape.head_dim * esize, row * shape.head_dim_v * esize, row * 4]
    if not isinstance(block.kv, slice):
        row = shape.batch * _rows(block.kv, 0) * shape.kv_heads
        sizes += [row * shape.head_dim * esize, row * shape.head_dim_v * esize]
    return [Compute("copy", phase, step, nbytes=2 * n) for n in sizes]


def _memo(steps):
    """``steps`` asked once per ``(step, source)``: the forward ring counts its blocks and walks them, and
    the backward walks them again (three plan calls per step otherwise, W² of them per case)."""
    seen: dict = {}

    def memo(step: int, source: int):
        key = (step, source)
        if key not in seen:
            seen[key] = steps(step, source)
        return seen[key]

    if hasattr(steps, "n_steps"):  # a window's or mask's ring, which may end early
        memo.n_steps = steps.n_steps
    return memo


@functools.lru_cache(maxsize=4096)
def _slice_calls(q: tuple, kv: tuple, causal: bool, mode: str, seqlen_local: int) -> tuple[Call, ...]:
    # step_calls of a batch step, by value: every rank's plan gives one of a few blocks.
    from ringbench.variants.engines.ring import Step

    return tuple(step_calls(Step(slice(*q), slice(*kv), causal), mode, seqlen_local))


def _block_calls(block, mode: str, seqlen_local: int) -> list[Call]:
    """:func:`step_calls` of ``block``, those of a batch step (slices, no parts) kept between ranks."""
    if block.parts or block.cu_q is not None or not (isinstance(block.q, slice) and isinstance(block.kv, slice)):
        return step_calls(block, mode, seqlen_local)
    q, kv = block.q, block.kv
    return list(_slice_calls((q.start, q.stop, q.step), (kv.start, kv.stop, kv.step), block.causal, mode,
                             seqlen_local))


def ring_forward(steps, *, ring: tuple[int, ...], me: int, seqlen_local: int, shape: Shape, esize: int,
                 tag: str = "kv", side: bool = False) -> list:
    """Rank ``ring[me]``'s forward ring, in ``ring._ring_forward``'s order; ``side``: each step's merge
    on the side stream (CUDA), joined after the last."""
    R = len(ring)
    n_steps = getattr(steps, "n_steps", R)
    kv_bytes = seqlen_local * shape.batch * shape.kv_heads * (shape.head_dim + shape.head_dim_v) * esize
    ops, held = [], None  # the running out's bytes per element (None: no block yet)
    left = sum(steps(s, (me - s) % R) is not None for s in range(n_steps))  # ring._blocks_of
    for step in range(n_steps):
        if step + 1 < n_steps:
            ops.append(Post(f"{tag}f", "p2p", "fwd", step, kv_bytes, ring, ring[(me + 1) % R], ring[(me - 1) % R]))
        block = steps(step, (me - step) % R)
        if block is not None:
            ops += _row_copies(block, "fwd", step, shape, esize)
            calls = _block_calls(block, "fwd", seqlen_local)
            folded = block.parts and not _whole(block.parts, seqlen_local)  # window.attend folds its parts
            if folded:  # into a float32 out and lse of the block's rows, zeroed first
                zeroed = shape.batch * shape.heads * _rows(block.q, seqlen_local) * (shape.head_dim_v + 1) * 4
                ops.append(Compute("copy", "fwd", step, nbytes=zeroed))
            ops += [Compute("kernel", "fwd", step, c) for c in calls]
            if folded:
                ops += [Compute("merge", "fwd", step, nbytes=_merge_bytes(c.q, shape, esize)) for c in calls]
            whole = isinstance(block.q, slice) and block.q == slice(None)
            left -= 1
            into = esize if left == 0 else 4  # the last merge writes the input dtype (ring._ring_forward)
            if held is None and whole:  # the first block over every row is the running output as it is
                held = esize
            else:
                ops.append(Compute("merge", "fwd", step, nbytes=_merge_bytes(
                    _rows(block.q, seqlen_local), shape, esize, local=seqlen_local, held=held or 4, into=into),
                    side=side))
                held = into
        if step + 1 < n_steps:
            ops.append(Wait(f"{tag}f"))
    return ops + ([Compute("join", "fwd", n_steps - 1)] if side else [])


def ring_backward(steps, *, ring: tuple[int, ...], me: int, seqlen_local: int, shape: Shape, esize: int,
                  tag: str = "kv", side: bool = False) -> list:
    """Rank ``ring[me]``'s backward ring, in ``ring._ring_backward``'s order (the reverse ring);
    ``side``: each step's adds and the dK/dV hop they feed on the side stream (CUDA), joined before
    the last add."""
    R = len(ring)
    kv_bytes = seqlen_local * shape.batch * shape.kv_heads * (shape.head_dim + shape.head_dim_v)
    windowed = hasattr(steps, "n_steps")
    nxt, prv = ring[(me - 1) % R], ring[(me + 1) % R]  # reverse: send to rank - 1, receive from rank + 1
    ops = []
    if R > 1 and windowed and getattr(steps, "n_steps", R) < R:  # the forward ended early: fetch rank + 1's block
        ops += [Post(f"{tag}b", "p2p", "bwd", -1, kv_bytes * esize, ring, nxt, prv), Wait(f"{tag}b")]
    block, dq_held = None, False  # dq_held: a running dq exists (ring._ring_backward's dq)
    for i in range(R):
        own = i == R - 1
        source = (me + 1 + i) % R
        receive = i + 2 < R
        if receive:
            ops.append(Post(f"{tag}b", "p2p", "bwd", i, kv_bytes * esize, ring, nxt, prv))
        block = steps((me - source) % R, source)
        if block is not None:
            ops += _row_copies(block, "bwd", i, shape, esize)
            calls = _block_calls(block, "bwd", seqlen_local)
            summed = block.parts and not _whole(block.parts, seqlen_local)  # window.attend_backward sums its parts
            if summed:  # into float32 dq, dk and dv of the block's rows, zeroed first
                ops.append(Compute("copy", "bwd", i, nbytes=4 * _grad_elements(_rows(block.q, seqlen_local),
                                                                               _rows(block.kv, seqlen_local), shape)))
            ops += [Compute("kernel", "bwd", i, c) for c in calls]
            if summed:
                ops += [Compute("add", "bwd", i, nbytes=_add_bytes(c.q, c.k, shape, esize)) for c in calls]
        if own:
            break
        if i > 0:
            ops.append(Wait(f"{tag}d"))
        ops += _step_add(block, i, dq_held, i > 0, seqlen_local, shape, esize, side)
        dq_held = dq_held or block is not None
        hop = esize if (i == 0 and not windowed) else 4
        ops.append(Post(f"{tag}d", "p2p", "bwd", i, kv_bytes * hop, ring, nxt, prv, side=side))
        if receive:
            ops.append(Wait(f"{tag}b"))
    if side:
        ops.append(Compute("join", "bwd", R - 1))
    if R > 1:
        ops.append(Wait(f"{tag}d"))
    ops += _step_add(block, R - 1, dq_held, R > 1, seqlen_local, shape, esize)
    return ops


def _step_add(block, step: int, dq_held: bool, incoming: bool, seqlen_local: int, shape: Shape, esize: int,
              side: bool = False) -> list:
    """The one add launch of a backward step (``ring._accumulate``), or none: a sum is launched
    for dq where a running dq is held or the block's rows are not all of them, and for dK/dV where
    a partial came in or the block's keys are not all of them; the first term over every row is
    the kernel's own gradient, kept as it is (so W=1 launches no add at all)."""
    rows_q = rows_kv = 0
    launched = False
    if block is not None:
        every_q = isinstance(block.q, slice) and block.q == slice(None)
        every_kv = isinstance(block.kv, slice) and block.kv == slice(None)
        if dq_held or not every_q:
            rows_q, launched = _rows(block.q, seqlen_local), True
        if incoming or not every_kv:
            rows_kv, launched = _rows(block.kv, seqlen_local), True
    elif incoming:
        launched = True  # the partial passed on as it came
    return [Compute("add", "bwd", step, nbytes=_add_bytes(rows_q, rows_kv, shape, esize), side=side)] if launched else []


# --------------------------------------------------------------------------- all-gather (llama3, llama3_varlen)

def _group_shape(shape: Shape, hs: slice) -> Shape:
    """The attention shape of one head group (K/V heads ``hs`` and their query heads)."""
    h = hs.stop - hs.start
    return shape._replace(heads=h * (shape.heads // shape.kv_heads), kv_heads=h)


def _kv_shard(gs: Shape, local: int, esize: int) -> float:
    """Bytes of this rank's K and V of one head group."""
    return local * gs.batch * gs.kv_heads * (gs.head_dim + gs.head_dim_v) * esize


def _gathered_forward(heads: list[slice], shape: Shape, local: int, world_size: int, esize: int, compute) -> list:
    """``llama3._gathered_kv``'s order: group 0's gather first, then each group posts the next
    one's gather before it waits for its own, unshards it (a copy) and runs ``compute(i, gs)``."""
    everyone = tuple(range(world_size))
    ops = [Post("gather0", "all_gather", "fwd", 0, _kv_shard(_group_shape(shape, heads[0]), local, esize), everyone)]
    for i, hs in enumerate(heads):
        gs = _group_shape(shape, hs)
        if i + 1 < len(heads):
            ops.append(Post(f"gather{i + 1}", "all_gather", "fwd", i + 1,
                            _kv_shard(_group_shape(shape, heads[i + 1]), local, esize), everyone))
        ops.append(Wait(f"gather{i}"))
        ops.append(Compute("copy", "fwd", i, nbytes=2 * world_size * _kv_shard(gs, local, esize)))  # _to_global
        ops += compute(i, gs)
    return ops


def _reduce_scatter(i: int, gs: Shape, local: int, world_size: int) -> list:
    """``llama3.reduce_scatter_shards`` of one head group's float32 dK and dV: the shards cut (a
    copy), then a blocking reduce-scatter, for each."""
    ops = []
    for part in ("k", "v"):
        dim = gs.head_dim if part == "k" else gs.head_dim_v
        shard = local * gs.batch * gs.kv_heads * dim * 4
        ops.append(Compute("copy", "bwd", i, nbytes=2 * world_size * shard))
        ops.append(Post(f"rs{part}", "reduce_scatter", "bwd", i, shard, tuple(range(world_size))))
        ops.append(Wait(f"rs{part}"))
    return ops


def _with_group_shapes(ops, heads: list[slice], shape: Shape):
    # A kernel call of head group i (its step) runs at that group's heads.
    return [(op, _group_shape(shape, heads[op.step])) if isinstance(op, Compute) and op.kind == "kernel"
            else (op, None) for op in ops]


def gather_program(spec, rank: int, world_size: int, shape: Shape, esize: int, backward: bool) -> list:
    """Rank ``rank``'s llama3 forward (and backward), in ``llama3._forward``/``_backward``'s order."""
    from ringbench.variants.engines import llama3

    layout = spec.layout or get_variant(spec.variant).layout
    local = spec.seqlen // world_size
    stride = spec.heads_k_stride or shape.kv_heads
    groups = llama3.schedule(layout, spec.causal, rank, world_size, local, shape.kv_heads, stride,
                             spec.window or None, mask_of(spec))
    heads = [hs for hs, _ in groups]

    def calls(blocks, mode):
        out = []
        for rows, keys, causal, kw in blocks:
            m = _rows(rows, local)
            n = keys.stop - keys.start
            if causal and kw.get("window") is None:
                out.append(Call(mode, "causal", m, n, m * (m + 1) / 2))
            else:  # a mask's full part by slices carries window None
                out.append(band_call(mode, m, n, kw.get("window")))
        return out

    def forward(i, gs):
        ops = []
        for c in calls(groups[i][1], "fwd"):
            ops.append(Compute("kernel", "fwd", i, c))
            ops.append(Compute("merge", "fwd", i, nbytes=_merge_bytes(c.q, gs, esize)))
        return ops

    ops = _gathered_forward(heads, shape, local, world_size, esize, forward)
    if not backward:
        return _with_group_shapes(ops, heads, shape)
    for i, (hs, blocks) in enumerate(groups):
        gs = _group_shape(shape, hs)
        full = world_size * local * gs.batch * gs.kv_heads * (gs.head_dim + gs.head_dim_v) * 4
        ops.append(Compute("copy", "bwd", i, nbytes=full))  # the float32 dK/dV of the whole sequence, zeroed
        for c in calls(blocks, "bwd"):
            ops.append(Compute("kernel", "bwd", i, c))
            ops.append(Compute("add", "bwd", i, nbytes=_add_bytes(c.q, c.k, gs, esize)))
        ops += _reduce_scatter(i, gs, local, world_size)
    return _with_group_shapes(ops, heads, shape)


def pieces_call(pieces, mode: str, causal: bool, window: int | None) -> Call:
    """The one varlen kernel call of ``llama3_varlen``'s :class:`Pieces`: per local document piece
    its query rows, its keys and the pairs it attends (causal aligned bottom-right, or the window's band)."""
    cq, ck = pieces.cu_q.tolist(), pieces.cu_k.tolist()
    docs = []
    for (a, b), (c, d) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        lq, lk = b - a, d - c
        if window is not None:
            pairs = part_pairs(lq, lk, (window - 1, 0))
        else:
            pairs = _causal_doc_pairs(lq, lk) if causal else float(lq) * lk
        docs.append((lq, lk, pairs))
    mask = "window" if window is not None else ("causal" if causal else "full")
    return Call(mode, mask, cq[-1], ck[-1], sum(p for *_, p in docs), window=window or 0, docs=tuple(docs))


def gather_varlen_program(spec, rank: int, world_size: int, shape: Shape, esize: int, backward: bool,
                          doc_lengths: list[int]) -> list:
    """Rank ``rank``'s llama3_varlen forward (and backward), in ``llama3_varlen._forward``/``_backward``'s
    order: per head group the gather (as llama3's), one varlen kernel call over ``llama3_varlen.schedule``'s
    pieces, its out copied into place; backward one varlen call, dq copied into place, and the float32
    dK/dV of the gathered row (zeroed, the pieces' gradients scattered in) reduce-scattered to their owners."""
    from ringbench.variants.engines import layouts, llama3_varlen

    layout = spec.layout or get_variant(spec.variant).layout
    local = spec.seqlen // world_size
    stride = spec.heads_k_stride or shape.kv_heads
    window = spec.window or None
    offsets = layouts.cu_seqlens_from_docs(doc_lengths).tolist()
    heads, pieces = llama3_varlen.schedule(offsets, layout, spec.causal, rank, world_size, local, shape.kv_heads,
                                           stride, window)
    one_group = len(heads) == 1
    # _keys: a slice of the gathered row is a view; the balanced layout's indices gather a copy.
    indexed = not isinstance(pieces.keys, slice)
    keys = pieces.cu_k[-1].item()

    def key_copy(phase: str, i: int, gs: Shape) -> list:
        if not indexed:
            return []
        return [Compute("copy", phase, i, nbytes=2 * keys * gs.batch * gs.kv_heads * (gs.head_dim + gs.head_dim_v)
                        * esize)]

    def forward(i, gs):
        ops = key_copy("fwd", i, gs) + [Compute("kernel", "fwd", i, pieces_call(pieces, "fwd", spec.causal, window))]
        if not one_group:  # out[:, :, heads] = the group's out (and its lse)
            ops.append(Compute("copy", "fwd", i, nbytes=2 * local * gs.batch * gs.heads * (gs.head_dim_v * esize + 4)))
        return ops

    ops = _gathered_forward(heads, shape, local, world_size, esize, forward)
    if not backward:
        return _with_group_shapes(ops, heads, shape)
    whole = world_size == 1 and not indexed and pieces.keys == slice(0, local)
    for i, hs in enumerate(heads):
        gs = _group_shape(shape, hs)
        ops += key_copy("bwd", i, gs)
        ops.append(Compute("kernel", "bwd", i, pieces_call(pieces, "bwd", spec.causal, window)))
        if whole and one_group:
            continue  # the kernel's gradients are the result
        ops.append(Compute("copy", "bwd", i, nbytes=2 * local * gs.batch * gs.heads * gs.head_dim * esize))  # dq
        if whole:
            ops.append(Compute("copy", "bwd", i, nbytes=2 * _kv_shard(gs, local, esize)))  # dk, dv into place
            continue
        for dim in (gs.head_dim, gs.head_dim_v):
            # the float32 row zeroed, the pieces' gradient written (or index-added) into it
            row = world_size * local * gs.batch * gs.kv_heads * dim * 4
            ops.append(Compute("copy", "bwd", i, nbytes=row + keys * gs.batch * gs.kv_heads * dim * (esize + 4)))
        ops += _reduce_scatter(i, gs, local, world_size)
    return _with_group_shapes(ops, heads, shape)


# --------------------------------------------------------------------------- Ulysses and USP

def ulysses_program(spec, rank: int, world_size: int, degree: int, shape: Shape, esize: int, backward: bool,
                    doc_lengths: list[int] | None, side: bool = False) -> list:
    """Rank ``rank``'s Ulysses (or USP) forward and backward, in ``ulysses.UlyssesRing``'s order.

    The grid is ``grid.process_grid``'s: Ulysses groups of ``degree`` consecutive ranks, the ring
    across them over the ranks with the same Ulysses rank.
    """
    U, R = degree, world_size // degree
    urank, rrank = rank % U, rank // U
    ugroup = tuple(rank // U * U + i for i in range(U))
    ring = tuple(j * U + urank for j in range(R))
    local = spec.seqlen // world_size
    replicas = max(1, U // shape.kv_heads)
    hshape = shape._replace(heads=shape.heads // U, kv_heads=shape.kv_heads * replicas // U)
    ring_len = local * U
    layout = get_variant(spec.variant).layout
    ring_docs = [d // R for d in doc_lengths] if doc_lengths is not None else None
    steps = ring_steps(layout, ring_len, rrank, R, spec.causal, spec.window or None, ring_docs, mask_of(spec))
    B = shape.batch

    def swap(phase: str, name: str, elems: float, size: int = esize) -> list:
        nbytes = elems * size
        if U == 1:
            return []
        # seq_to_heads / heads_to_seq: permute into a contiguous send buffer, the blocking
        # all-to-all, permute back (two copies around it).
        return [Compute("copy", phase, 0, nbytes=2 * nbytes), Post(f"a2a-{name}", "all_to_all", phase, 0, nbytes, ugroup),
                Wait(f"a2a-{name}"), Compute("copy", phase, 0, nbytes=2 * nbytes)]

    kv_elems = local * B * shape.kv_heads * replicas * (shape.head_dim + shape.head_dim_v)  # replicated K and V
    ops = []
    if replicas > 1:
        ops.append(Compute("copy", "fwd", 0, nbytes=2 * kv_elems * esize))  # repeat_interleave of k and v
    ops += swap("fwd", "q", local * B * shape.heads * shape.head_dim)
    ops += swap("fwd", "k", local * B * shape.kv_heads * replicas * shape.head_dim)
    ops += swap("fwd", "v", local * B * shape.kv_heads * replicas * shape.head_dim_v)
    ops += ring_forward(steps, ring=ring, me=rrank, seqlen_local=ring_len, shape=hshape, esize=esize,
                        side=side)
    ops += swap("fwd", "out", local * B * shape.heads * shape.head_dim_v)
    ops += swap("fwd", "lse", local * B * shape.heads, 4)
    if backward:
        ops += swap("bwd", "dout", local * B * shape.heads * shape.head_dim_v)
        ops += ring_backward(steps, ring=ring, me=rrank, seqlen_local=ring_len, shape=hshape, esize=esize,
                             side=side)
        ops += swap("bwd", "dq", local * B * shape.heads * shape.head_dim)
        ops += swap("bwd", "dk", local * B * shape.kv_heads * replicas * shape.head_dim)
        ops += swap("bwd", "dv", local * B * shape.kv_heads * replicas * shape.head_dim_v)
        if replicas > 1:  # the replicas' gradients summed in float32
            ops.append(Compute("copy", "bwd", 0, nbytes=kv_elems * (esize + 4)))
    return [(op, hshape if isinstance(op, Compute) and op.kind == "kernel" else None) for op in ops]


# --------------------------------------------------------------------------- a case

def case_shape(spec) -> Shape:
    """The attention shape of a case (``CaseSpec``)."""
    return Shape(spec.batch, spec.heads, spec.kv_heads, spec.head_dim, spec.value_head_dim(), spec.dtype)


#: The engines whose masked steps the model walks: the ring's and Ulysses' ring (``masked.ring_steps``,
#: any layout) and llama3's gathered blocks (``masked.gathered_blocks``), partial blocks as window calls
#: by slices (``tests/test_predict.py`` checks them against the engines' own calls). The varlen
#: engines under a mask are not walked yet.
MASK_PRICED = ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp")


def mask_of(spec):
    """``spec``'s mask as a ``masks.Mask`` over its global sequence (per document over the packed row
    for a varlen variant), or ``None`` for none and for the plain masks (causal, full, window:L),
    which are the plain cases."""
    from ringbench.case.spec import padded_docs
    from ringbench.variants.engines import masks

    text = getattr(spec, "mask", "")
    if not text or masks.plain_fields(text) is not None:
        return None
    return masks.over(text, spec.seqlen, padded_docs(spec) if get_variant(spec.variant).varlen else None)


def engine_mask_refusal(text: str, variant: str) -> str | None:
    """Why the model cannot price mask ``text`` (any text ``--mask`` or ``--mask-file`` gives) on
    ``variant``, in one sentence, or ``None``: a mask is priced on :data:`MASK_PRICED` alone. Needs no
    sequence length, so the CLI asks it before a mask's own rules, which no seqlen would help here."""
    from ringbench.variants.engines import masks

    if not text or masks.plain_fields(text) is not None or variant in MASK_PRICED:
        return None
    return (f"mask {masks.label(masks.parse(text))} is priced on {', '.join(MASK_PRICED)} only, not on "
            f"{variant} (the model does not walk its masked blocks yet); predict one of those, or measure "
            f"{variant} under the mask with ringbench run")


def mask_refusal(spec) -> str | None:
    """Why the model cannot price ``spec``'s mask, in one sentence, or ``None``:
    :func:`engine_mask_refusal`, then a mask of more slices than ``masks.MAX_SLICES`` (each a window
    call of every block it meets)."""
    from ringbench.variants.engines import masks

    reason = engine_mask_refusal(spec.mask, spec.variant)
    built = None if reason else mask_of(spec)
    if built is not None and len(built.slices) > masks.MAX_SLICES:
        return (f"mask {masks.label(masks.parse(spec.mask))} cuts {spec.seqlen} tokens into {len(built.slices)} "
                f"slices, more than the {masks.MAX_SLICES} the model walks (each a window call of every block it "
                "meets); predict a coarser mask, or measure this one with ringbench run")
    return reason


def _own_twin(peer) -> str:
    """The ringbench variant closest to ``peer``: its own name without the library's prefix where that is one
    of the same layout, else the first of the same layout, form and Ulysses use."""
    from ringbench.variants import VARIANTS, list_variants

    ours = [VARIANTS[n] for n in list_variants() if not VARIANTS[n].peer]
    named = [v for v in ours if v.name == peer.name.split("_", 1)[-1] and v.layout == peer.layout]
    alike = [v for v in ours if (v.layout, v.varlen, bool(v.ulysses)) == (peer.layout, peer.varlen, bool(peer.ulysses))]
    return (named or alike or [VARIANTS["zigzag"]])[0].name


def bias_refusal(bias: str) -> str:
    """Why the model does not price a case with ``bias`` (its ``--bias`` value), in one sentence."""
    return (f"bias {bias} is not priced by the model yet (no calibration rates a kernel call with a bias: "
            "flash-attn-4's ALiBi score mod, flex or math); predict the case without --bias, or measure the bias "
            "with ringbench run")


def refusal(spec) -> str | None:
    """Why the model cannot walk ``spec``'s schedule, in one sentence, or ``None``."""
    variant = VARIANTS.get(spec.variant)
    if variant is None:
        return f"variant {spec.variant!r} is not one the model knows"
    if variant.peer:
        return (f"{spec.variant} is a peer, and its schedule is its own library's code, not a ringbench plan the "
                f"model can walk, so it is not predicted; predict ringbench's {_own_twin(variant)} instead, of the "
                "same layout")
    reason = mask_refusal(spec)
    if reason:
        return reason
    if getattr(spec, "bias", ""):
        return bias_refusal(spec.bias)
    if spec.sink != "none":
        return None  # the sink joins once per row: no step of its own worth pricing
    return None


def programs(spec, *, ulysses_degree: int | None = None, side: bool | None = None) -> tuple[list[list], Layout]:
    """Every rank's program for ``spec`` (a resolved ``CaseSpec``): per rank a list of
    ``(op, shape)``, ``shape`` the attention shape a kernel call runs at (``None`` for other ops).
    ``side``: the ring's merges and adds on a side stream (``variants/engines/overlap.py``); None: as
    the engine does now, on CUDA (a record measured in line is priced with False).

    Raises:
        Unpredictable: :func:`refusal`'s reasons.
    """
    reason = refusal(spec)
    if reason:
        raise Unpredictable(reason)
    with paused_gc():
        return _programs(spec, ulysses_degree, side)


def _programs(spec, ulysses_degree: int | None, side: bool | None) -> tuple[list[list], Layout]:
    from ringbench.case.spec import padded_docs

    variant = get_variant(spec.variant)
    W = spec.world_size
    side = spec.device == "cuda" if side is None else side
    shape = case_shape(spec)
    esize = ELEMENT_BYTES[spec.dtype]
    backward = spec.mode == "fwd_bwd"
    docs = padded_docs(spec) if variant.varlen else None
    if variant.ulysses:
        U = variant.ulysses_degree(W, ulysses_degree or spec.ulysses_degree)
        if spec.batch != 1 and docs is not None:
            raise Unpredictable("packed documents take batch 1")
        progs = [ulysses_program(spec, r, W, U, shape, esize, backward, docs, side) for r in range(W)]
        return progs, Layout(U, W // U)
    if spec.variant == "llama3":
        return [gather_program(spec, r, W, shape, esize, backward) for r in range(W)], Layout(1, W)
    if spec.variant == "llama3_varlen":
        if spec.batch != 1:
            raise Unpredictable("packed documents take batch 1")
        return [gather_varlen_program(spec, r, W, shape, esize, backward, docs) for r in range(W)], Layout(1, W)
    layout = spec.layout or variant.layout
    local = spec.seqlen // W
    doc_lengths = [d // W for d in docs] if docs is not None else None
    mask = mask_of(spec)
    ring = tuple(range(W))
    progs = []
    for r in range(W):
        steps = ring_steps(layout, local, r, W, spec.causal, spec.window or None, doc_lengths, mask)
        ops = ring_forward(steps, ring=ring, me=r, seqlen_local=local, shape=shape, esize=esize, side=side)
        if backward:
            ops += ring_backward(steps, ring=ring, me=r, seqlen_local=local, shape=shape, esize=esize, side=side)
        progs.append([(op, shape if isinstance(op, Compute) and op.kind == "kernel" else None) for op in ops])
    return progs, Layout(1, W)
