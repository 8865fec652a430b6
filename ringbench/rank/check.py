"""Correctness of one case: the variant on its ranks against the math kernel in float64 (T_fp64)
and the same kernel on one device over the whole sequence (T_single), under verify's rules
(``tolerance``: the max rule, the kernel rule and the block-decomposition rule; docs/verify.md).
Comparing against float64, not only against the same kernel without context parallelism, keeps a
kernel bug from cancelling itself out.

For the block-decomposition rule the variant's engine reports every kernel call while it runs
(``variants/instruments/observe.py``), and :func:`_shadow` rebuilds out, lse, dq, dk and dv from
those blocks in float64. A check passes only when every rule does. Variants whose engine reports
nothing (peers) keep the max and kernel rules alone, their shadow fields null.

A case with an attention bias (``spec.bias``) takes both references from ``sink_pad``'s
(``sink_pad.references``): the bias over every position, a learnable one's gradient checked as
one more entry, ``dbias``, by the max rule.

A case with ``spec.max_logit`` passes its variant a per-head max logit accumulator on its
first run and checks what every rank holds after it as one more entry, ``max_logit``, by the
max rule (``max_logit_check``).

A case with a mask (``spec.mask``, ``engines/masks.py``) takes both references from the kernel
called with the dense ``[S, S]`` boolean mask of the same slices over the whole sequence (a
``PositionMask`` of every position), and finds its cp-active pair of ranks from the mask's own
predicate over the positions each rank holds (none: ``cp_active`` null, with the reason).

A case with packed documents (a varlen variant, ``docs`` in the spec) builds the global
``cu_seqlens``, shards the row as the variant does (document by document, or by row), passes
``cu_seqlens=`` to the variant, and takes both references from the kernels' varlen form over
the whole row.

With ``spec.repeat`` above 1 (at least 2 under ``spec.require_deterministic``) the variant runs
again on the same inputs in the same process, and every rank compares each repeat's out, lse,
dq, dk and dv with the first's bit for bit (:func:`repeat_variant`). Any difference fails the
case, except gradients alone differing where the kernel's backward is documented as
nondeterministic (``Kernel.nondeterministic_backward``), which is recorded and passes unless
``require_deterministic`` (:func:`determinism_verdict`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ringbench.rank import sink_pad as extras
from ringbench.rank import max_logit_check
from ringbench.rank.tolerance import TENSORS, max_rule_passed, no_shadow, shadow_check, tolerance_check
from ringbench.rank.setup import CaseSetup, Results, bias_of, case_setup, sink_logits
from ringbench.records import cp_reasons
from ringbench.variants import plural
from ringbench.case.spec import CaseSpec
from ringbench.variants.engines import layouts, masks
from ringbench.variants import instruments
from ringbench.variants.instruments import observe
from ringbench.variants.kernels.common import accumulation_dtype
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import merge_

def _index(sel, n: int, device) -> torch.Tensor:
    """Rows (or heads) ``sel`` of a dimension of ``n``, a slice or int64 indices, as int64 indices."""
    if isinstance(sel, slice):
        return torch.arange(n, device=device)[sel]
    return sel.to(device=device, dtype=torch.int64)


class Shadow(NamedTuple):
    """The block-decomposition reference (:func:`_shadow`): what :func:`shadow_check` holds each
    tensor to.

    Attributes:
        tensors: the float64 out, lse, dq, dk, dv rebuilt from the variant's kernel calls
            (``dsink`` ``None``), this rank's rows or gathered into global tensors.
        terms: per tensor (``TENSORS`` order), the most partial results that met in one element,
            over every rank.
        scales: per tensor, the largest magnitude among its partial results and the result,
            over every rank.
    """

    tensors: Results
    terms: list[int]
    scales: list[float]


def _merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, group) -> None:
    """Merge, in float64 and in place, the partial out ``[..., S, H, D]`` and lse ``[..., H, S]``
    that every rank rebuilt for the same rows: ``lse = log sum_r exp(lse_r)`` and out weighted by
    ``exp(lse_r - lse)``. Where one rank holds a row's every block, its result comes back exact."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    seen = torch.isfinite(top)
    weight = torch.where(seen, (lse - top).exp(), 0.0)  # 0 where this rank, or every rank, saw no key
    out.mul_(weight.transpose(-1, -2)[..., None])
    total = weight.clone()
    for t in (out, total):
        dist.all_reduce(t, group=group)
    out.div_(torch.where(seen, total, 1.0).transpose(-1, -2)[..., None])
    lse.copy_(torch.where(seen, top + total.log(), float("-inf")))


def _shadow(seen: "observe.Observation", out_shape, q_shape, k_shape, v_shape, device,
            group) -> Shadow | None:
    """This rank's float64 out, lse, dq, dk, dv rebuilt from the variant's observed kernel calls.

    Forward blocks are merged in float64 in the order they came; dq partials are summed at their
    rows; dK/dV partials are summed in a float64 buffer per owner on every rank, then over the
    ranks (``all_reduce``), and each rank keeps its own rows. Where some rank reported queries
    of another rank's shard (the Ulysses engine's calls, ``observe.regrid``), out and lse are
    rebuilt per owner the same way and merged over the ranks in float64 (:func:`_merge_over_ranks`),
    dq summed. Every rank calls it.

    Returns:
        The :class:`Shadow` of this rank's rows (lse ``[B, H, S/W]``, the others in their
        variant's shape); or ``None`` when no rank observed a kernel call (a variant whose engine
        reports nothing).
    """
    f64 = torch.float64
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    foreign = any(b.owner not in (None, rank) for b in (*seen.forward, *seen.dq))
    seen_any = torch.tensor([float(len(seen)), float(foreign)], dtype=f64, device=device)
    dist.all_reduce(seen_any, group=group)
    if seen_any[0].item() == 0:
        return None
    # One slot per owner of query rows where any rank reported another's; else this rank's only.
    slots = world_size if seen_any[1].item() else 1

    def slot(owner):
        return (rank if owner is None else owner) if slots > 1 else 0

    B, S, H, D = out_shape
    Hkv = k_shape[2]
    out = torch.zeros((slots, *out_shape), dtype=f64, device=device)
    lse = torch.full((slots, B, H, S), float("-inf"), dtype=f64, device=device)
    dq = torch.zeros((slots, *q_shape), dtype=f64, device=device)
    # dK and dV of every owner (v may have its own head dim: head_dim_v), summed over the ranks.
    dks = torch.zeros((world_size, *k_shape), dtype=f64, device=device)
    dvs = torch.zeros((world_size, *v_shape), dtype=f64, device=device)
    n_q = torch.zeros((slots, 2, S, H), dtype=f64, device=device)  # partial results per (row, head): forward, dq
    n_kv = torch.zeros((world_size, S, Hkv), dtype=f64, device=device)
    big = torch.zeros(5, dtype=f64, device=device)  # largest |partial result| of out, lse, dq, dk, dv

    def grow(i, t):
        t = t.double()
        t = t[torch.isfinite(t)]
        if t.numel():
            big[i] = torch.maximum(big[i], t.abs().max())

    for b in seen.forward:
        i = slot(b.owner)
        r, h = _index(b.rows, S, device)[:, None], _index(b.heads, H, device)
        o, l = out[i][:, r, h], lse[i][:, h[:, None], r.T]
        merge_(o, l, b.out.to(device, f64), b.lse.to(device, f64))
        out[i][:, r, h], lse[i][:, h[:, None], r.T] = o, l
        n_q[i, 0, r, h] += 1
        grow(0, b.out)
        grow(1, b.lse)
    for b in seen.dq:
        i = slot(b.owner)
        r, h = _index(b.rows, S, device)[:, None], _index(b.heads, H, device)
        dq[i][:, r, h] += b.dq.to(device, f64)
        n_q[i, 1, r, h] += 1
        grow(2, b.dq)
    for b in seen.dkv:
        r, h = _index(b.rows, S, device)[:, None], _index(b.heads, Hkv, device)
        dks[b.owner][:, r, h] += b.dk.to(device, f64)
        dvs[b.owner][:, r, h] += b.dv.to(device, f64)
        n_kv[b.owner, r, h] += 1
        grow(3, b.dk)
        grow(4, b.dv)
    if slots > 1:
        _merge_over_ranks(out, lse, group)
    summed = (dks, dvs, n_kv, *((dq, n_q) if slots > 1 else ()))
    flat = torch.cat([t.reshape(-1) for t in summed])
    dist.all_reduce(flat, group=group)  # one collective for all: each synchronises every rank
    for t, part in zip(summed, flat.split([t.numel() for t in summed])):
        t.copy_(part.view(t.shape))
    mine = rank if slots > 1 else 0
    out, lse, dq, n_q = out[mine], lse[mine], dq[mine], n_q[mine]
    dk, dv = dks[rank], dvs[rank]
    for i, t in enumerate((out, lse, dq, dk, dv)):
        grow(i, t)
    terms = torch.stack([n_q[0].max(), n_q[0].max(), n_q[1].max(), n_kv.max(), n_kv.max()])
    top = torch.cat([terms, big])
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return Shadow(Results(out, lse, dq, dk, dv), [int(t) for t in top[:5].tolist()], top[5:].tolist())


class Placement:
    """How a case's global tensors map onto the ranks, and what the variant is given with them.

    Attributes:
        shard: ``(x, rank, dim) -> x's shard`` on that rank.
        unshard: ``(parts, dim) -> global tensor`` from every rank's shard.
        extra: keyword arguments for the variant beyond its options (``cu_seqlens``).
        cu_seqlens: the global int32 offsets on the case's device, or ``None`` (batch form).
        docs: the documents' lengths (those offsets' differences), or ``None``.
        watch: ``(source, watcher)`` ranks for :func:`cp_active` (the watcher's queries see
            some of the source's keys), or ``None`` when no rank sees another's keys.
        unwatched: why ``watch`` is ``None`` (one sentence, for the record's
            ``cp_active_reason``); empty when it is not.
        keep: bool ``[S]``, False at padding tokens (``doc_pad``), or ``None``; verify zeroes
            the variant's padding rows (``sink_pad_check``).
    """

    keep: torch.Tensor | None = None

    def __init__(self, case: CaseSetup, device: torch.device):
        layout, docs, causal, world_size, variant = case.layout, case.docs, case.causal, case.world_size, case.variant
        u = case.ulysses_degree
        if docs is None:
            m = case.spec.mask or None  # the balanced layout's chunks follow it
            self.shard = lambda x, rank, dim=1: layouts.shard(x, layout, rank, world_size, dim=dim, ulysses_degree=u,
                                                              mask=m)
            self.unshard = lambda parts, dim=1: layouts.unshard(parts, layout, dim=dim, ulysses_degree=u, mask=m)
            self.cu_seqlens, self.extra, self.docs = None, {}, None
            self.watch = (0, world_size - 1) if causal else (world_size - 1, 0)
            self.unwatched = ""
            if case.spec.window:
                self._watch_window(case.spec.seqlen, world_size, case.spec.window)
            if case.spec.mask:
                self._watch_mask(masks.build(case.spec.mask, case.spec.seqlen), world_size)
            return
        by_doc = variant.shard_by_document
        self.cu_seqlens = layouts.cu_seqlens_from_docs(docs, device=device)
        self.extra = {"cu_seqlens": self.cu_seqlens}
        docs_cu = self.cu_seqlens.tolist()
        self.docs = [b - a for a, b in zip(docs_cu, docs_cu[1:])]
        self.shard = lambda x, rank, dim=1: layouts.shard_varlen(x, docs_cu, layout, rank, world_size,
                                                                 by_document=by_doc, dim=dim, ulysses_degree=u)
        self.unshard = lambda parts, dim=1: layouts.unshard_varlen(parts, docs_cu, layout, by_document=by_doc,
                                                                   dim=dim, ulysses_degree=u)
        owner = torch.empty(docs_cu[-1], dtype=torch.int64)
        for r in range(world_size):
            owner[layouts.varlen_token_index(docs_cu, layout, r, world_size, by_document=by_doc,
                                             ulysses_degree=u)] = r
        self.watch = None
        if case.spec.window:
            self._watch_window(docs_cu[-1], world_size, case.spec.window, docs_cu)
            return
        if case.spec.mask:
            self._watch_mask(masks.documents(case.spec.mask, tuple(self.docs)), world_size)
            return
        # Any document whose first token (a key every query of the document sees) lives on
        # another rank than some of its queries gives a pair; prefer the widest one.
        for a, b in zip(docs_cu, docs_cu[1:]):
            first = int(owner[a]) if b > a else None
            others = sorted(set(owner[a:b].tolist()) - {first})
            if others and (self.watch is None or abs(others[-1] - first) > abs(self.watch[1] - self.watch[0])):
                self.watch = (first, others[-1])
        self.unwatched = "" if self.watch is not None else cp_reasons.no_document_crossing()

    def _watch_window(self, seqlen: int, world_size: int, window: int, docs_cu: list[int] | None = None) -> None:
        # Under a sliding window a document's first token is out of reach of its later queries, so
        # the pair is found from the positions each rank holds, read from the shard function itself
        # (so every layout, the composed Ulysses one too, is covered); a watcher's query
        # p sees a source's key t of the same document when 0 <= p - t < window (positions of later
        # documents are pushed a window apart, so no pair crosses a document boundary).
        where = torch.arange(seqlen)
        if docs_cu is not None:
            doc = torch.searchsorted(torch.tensor(docs_cu[1:]), where, right=True)
            where = where + doc * (seqlen + window)
        held = [self.shard(where.view(1, seqlen), r)[0] for r in range(world_size)]
        self.watch = None
        for watcher in reversed(range(world_size)):
            for source in range(world_size):
                if source == watcher:
                    continue
                keys = torch.sort(held[source]).values
                lo = torch.searchsorted(keys, held[watcher] - window + 1)
                hi = torch.searchsorted(keys, held[watcher], right=True)
                if bool((hi > lo).any()):
                    self.watch = (source, watcher)
                    break
            if self.watch is not None:
                break
        self.unwatched = "" if self.watch is not None else cp_reasons.no_key_crossing(f"window {window}")

    def _watch_mask(self, mask: masks.Mask, world_size: int) -> None:
        # The pair comes from the positions each rank holds, read from the shard function itself (every
        # layout, the composed Ulysses one too), and the mask's own predicate: a watcher's query sees a
        # source's key somewhere.
        where = torch.arange(mask.seqlen)
        held = [self.shard(where.view(1, -1), r)[0] for r in range(world_size)]
        self.watch = next(((source, watcher) for watcher in reversed(range(world_size)) for source in range(world_size)
                           if source != watcher and bool(mask.allows(held[watcher][:, None], held[source][None, :]).any())),
                          None)
        self.unwatched = "" if self.watch is not None else cp_reasons.no_key_crossing(
            f"mask {masks.label(mask.text)}")

    def max_seqlen(self) -> int:
        offsets = self.cu_seqlens.tolist()
        return max(b - a for a, b in zip(offsets, offsets[1:]))


def _gather(tensors, placement: Placement, dims, group) -> list[torch.Tensor]:
    """Each of ``tensors`` (this rank's shards; every rank's of one shape) from every rank, unsharded along
    its dim of ``dims``: one ``all_gather`` of their bytes packed together, since each collective costs a
    synchronisation of every rank (tens of ms with eight CPU ranks on two cores), whatever its size."""
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    packed = torch.cat(flat)
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, packed, group=group)
    out, start = [], 0
    for t, f, dim in zip(tensors, flat, dims):
        end = start + f.numel()
        # clone: a fresh, aligned buffer, whatever the offset of the tensor's bytes in the packed one
        out.append(placement.unshard([p[start:end].clone().view(t.dtype).view(t.shape) for p in parts], dim=dim))
        start = end
    return out


def global_inputs(spec: CaseSpec, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The whole-sequence q, k, v, dout of a verify case, identical on every rank (CPU seed)."""
    B, S, H, Hkv, D, Dv = spec.batch, spec.seqlen, spec.heads, spec.kv_heads, spec.head_dim, spec.value_head_dim()
    gen = torch.Generator().manual_seed(spec.seed)
    shapes = ((B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, Dv), (B, S, H, Dv))
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(device) for s in shapes)


def _run_variant(attention, placement, inputs, *, rank, world_size, causal, scale, group, kernel,
                 options) -> Results:
    """This rank's out, lse, dq, dk, dv of one run of the variant on its shards of ``inputs``."""
    q, k, v, dout = (placement.shard(x, rank) for x in inputs)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    if placement.extra.get("sink") is not None:
        placement.extra["sink"].grad = None  # its d sink is read after each run
    if placement.extra.get("bias") is not None:
        placement.extra["bias"].values.grad = None  # its d bias too
    out, lse = attention(q, k, v, causal=causal, softmax_scale=scale, group=group, kernel=kernel,
                         **options, **placement.extra)
    if placement.keep is not None:
        out = extras.zero_padding(out, placement.shard(placement.keep, rank, dim=0))
    out.backward(dout)
    return Results(out.detach(), lse, q.grad, k.grad, v.grad)


def cp_active(attention, placement, inputs, *, rank, world_size, causal, scale, group, kernel,
              options) -> bool:
    """Whether changing one rank's K/V changes another rank's output (a silent fall-back to local
    attention would not). Batch form, non-causal: K/V of the last rank, output of rank 0; causal:
    K/V of rank 0, output of the last rank, which sees it in every layout ringbench has. Packed
    documents: ``placement.watch``, a pair of ranks that share a document."""
    source, watcher = placement.watch
    q, k, v = (placement.shard(x, rank) for x in inputs[:3])
    with torch.no_grad():
        before, _ = attention(q, k, v, causal=causal, softmax_scale=scale, group=group, kernel=kernel,
                              **options, **placement.extra)
        if rank == source:
            k, v = -k.flip(1), v.flip(1) * 2 + 1
        after, _ = attention(q, k, v, causal=causal, softmax_scale=scale, group=group, kernel=kernel,
                             **options, **placement.extra)
    changed = torch.tensor([float((before.float() - after.float()).abs().max()) if rank == watcher else 0.0],
                           device=q.device)
    dist.all_reduce(changed, group=group)
    return bool(changed.item() > 0)


#: The forward pass's tensors: they must repeat bitwise even where a kernel's backward may not.
FORWARD_TENSORS = ("out", "lse")
#: The integer dtype whose view compares a tensor's elements bit for bit, by element size.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_difference(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[int, float]:
    """How two results for one tensor differ, bit for bit: ``(elements whose bits differ, the
    largest |a - b| among them)``, ``(0, 0.0)`` for the same bits.

    Elements compare by their bits, so a NaN equals a NaN of the same bits and -0.0 differs from
    0.0; a difference that involves a non-finite value is inf. A shape or dtype that differs, or
    a tensor on one side only (``None``), is every element differing by inf.
    """
    if a is None and b is None:
        return 0, 0.0
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return max(1, (a if a is not None else b).numel()), float("inf")
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    bits = _BITS[a.element_size()]
    differ = a.view(bits) != b.view(bits)
    count = int(differ.sum())
    if not count:
        return 0, 0.0
    inf = float("inf")
    gap = torch.nan_to_num((a[differ].double() - b[differ].double()).abs(), nan=inf, posinf=inf)
    return count, float(gap.max())


def repeat_variant(attention, placement: Placement, inputs, first, repeats: int, **kwargs) -> dict:
    """Run the variant ``repeats - 1`` more times on the same inputs and compare each repeat's out,
    lse, dq, dk and dv with ``first`` (the first run's), bit for bit, on every rank.

    Every rank must call it (the counts are summed over the group, the largest gaps maxed), and
    every rank gets the same fields back.

    Args:
        attention, placement, inputs, kwargs: as :func:`_run_variant` takes them.
        first: the first run's :class:`Results` on this rank.
        repeats: runs in all, the first included.

    Returns:
        ``{"repeats", "deterministic", "first_difference", "differing_tensors"}``:
        ``deterministic`` is None when ``repeats`` is 1; ``first_difference`` is
        ``{"tensor", "repeat", "elements", "max_abs_diff"}`` for the earliest repeat (numbered
        from 1, the first run) that differs from the first run and its first differing tensor in
        the order out, lse, dq, dk, dv (elements summed over the ranks), or None;
        ``differing_tensors`` names every tensor that differed in some repeat, in that order.
    """
    if repeats <= 1:
        return {"repeats": 1, "deterministic": None, "first_difference": None, "differing_tensors": []}
    device = first.out.device
    counts = torch.zeros(repeats - 1, len(TENSORS), dtype=torch.float64, device=device)
    gaps = torch.zeros_like(counts)
    for r in range(repeats - 1):
        again = _run_variant(attention, placement, inputs, **kwargs)
        for t, (_, a, b) in enumerate(zip(TENSORS, first, again)):
            counts[r, t], gaps[r, t] = bitwise_difference(a, b)
        del again
    dist.all_reduce(counts, group=kwargs.get("group"))
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX, group=kwargs.get("group"))
    differing = [(r, t) for r in range(repeats - 1) for t in range(len(TENSORS)) if counts[r, t] > 0]
    first_difference = None
    if differing:
        r, t = differing[0]
        first_difference = {"tensor": TENSORS[t], "repeat": r + 2, "elements": int(counts[r, t]),
                            "max_abs_diff": float(gaps[r, t])}
    return {"repeats": repeats, "deterministic": not differing, "first_difference": first_difference,
            "differing_tensors": [n for i, n in enumerate(TENSORS) if any(t == i for _, t in differing)]}


def determinism_verdict(repeated: dict, *, documented: str, require: bool) -> str | None:
    """Why the repeats fail the case (one sentence), or None when they do not.

    Args:
        repeated: :func:`repeat_variant`'s fields.
        documented: the kernel's ``nondeterministic_backward`` (empty: none documented).
        require: ``require_deterministic``: any difference fails.

    Returns:
        None when the repeats were the same bits (or there was one), or when only gradients
        differed, the kernel's backward is documented as nondeterministic and ``require`` is off.
    """
    if repeated.get("deterministic") is not False:
        return None
    differing = repeated["differing_tensors"]
    backward_only = not any(t in FORWARD_TENSORS for t in differing)
    if documented and backward_only and not require:
        return None
    first = repeated["first_difference"]
    text = (f"not deterministic: {first['tensor']} of repeat {first['repeat']} differs bitwise from repeat 1 "
            f"({plural(first['elements'], 'element')}, max |diff| {first['max_abs_diff']:.3g})")
    others = [t for t in differing if t != first["tensor"]]
    if others:
        text += f"; also differing: {', '.join(others)}"
    if documented and backward_only:
        text += "; the kernel's backward is documented as nondeterministic, and --require-deterministic is set"
    return text


def _whole_row(kernel, inputs, placement: Placement, causal: bool, scale: float,
               window: int | None = None, mask: str = "") -> Results:
    """out, lse, dq, dk, dv of ``kernel`` over the whole sequence on one device (varlen form
    over the whole packed row when the case has documents), under the case's sliding window or
    its mask (``mask``, its text: the dense ``[S, S]`` block of its slices, causal then ignored;
    with documents, the mask inside each of them over the packed row, in the batch form)."""
    q, k, v, dout = inputs
    causal, kw = extras.row_keywords(causal, window, mask, q.shape[1], q.device, placement.docs)
    kernel, kw = extras.row_kernel(kernel, kw, mask, q.shape[1], placement.docs)
    if placement.cu_seqlens is None or mask:  # a mask holds the documents: the batch form over the packed row
        out, lse = kernel.forward(q, k, v, causal, scale, **kw)
        return Results(out, lse, *kernel.backward(dout, q, k, v, out, lse, causal, scale, **kw))
    cu, n = placement.cu_seqlens, placement.max_seqlen()
    out, lse = kernel.forward_varlen(q, k, v, cu, cu, n, n, causal, scale, **kw)
    return Results(out, lse, *kernel.backward_varlen(dout, q, k, v, out, lse, cu, cu, n, n, causal, scale, **kw))



def _summed_grad_check(name: str, got, like, single, ref, held: dict, world_size: int, why: str) -> dict:
    """The check of a gradient the engine sums itself (d sink, d bias): the max rule against what the
    result's own out and lse imply (``held``), with its distance to float64 beside it; ``got`` None
    (the variant gave none) reads as NaN, which fails."""
    got = got if got is not None else torch.full_like(like, float("nan"))
    entry = tolerance_check(name, got, single, held["variant"], like.dtype, tuple(like.shape), world_size=world_size,
                            floor=held["floor"], single_ref=held["single"])
    entry["err_fp64"], entry["err_single_fp64"] = (float((t.double() - ref).abs().max()) for t in (got, single))
    return {**entry, **no_shadow(why)}

def verify_case(spec: CaseSpec, *, device: torch.device, group=None) -> dict:
    """Check one ``verify`` case; every rank calls it, every rank gets the same fields back.

    Args:
        spec: the case, its kernel resolved; the whole sequence must fit on one device.
        device: this rank's device.
        group: the context-parallel group (default: the world).

    Returns:
        ``{"status": "ok" | "fail", "reason": str | None, "checks": [...], "cp_active": bool | None,
        "cp_active_reason": str | None, "repeats", "deterministic", "first_difference",
        "differing_tensors", "nondeterministic_backward": str | None}``: ``cp_active_reason`` says
        why ``cp_active`` is None (world size 1, or no rank needs another's K/V); the repeat
        fields are :func:`repeat_variant`'s; ``nondeterministic_backward`` is the kernel's.
    """
    case = case_setup(spec, group)
    rank, world_size, variant, kernel, dtype = case.rank, case.world_size, case.variant, case.kernel, case.dtype
    causal, scale = case.causal, case.scale
    inputs = global_inputs(spec, dtype, device)
    placement = Placement(case, device)
    sink, placement.keep = sink_logits(spec, dtype, device), extras.keep_mask(case, device)
    if sink is not None:
        placement.extra["sink"] = sink
    bias = bias_of(spec, dtype, device)
    if bias is not None:
        placement.extra["bias"] = bias
    kwargs = dict(rank=rank, world_size=world_size, causal=causal, scale=scale, group=group, kernel=kernel,
                  options=case.options)
    peak = max_logit_check.max_logit_of(spec, dtype, device)
    if peak is not None:  # the first run's alone: the repeats and the cp-active runs do not raise it
        placement.extra["max_logit"] = peak
    with instruments.open(observe=True) as inst:
        local = _run_variant(variant.attention, placement, inputs, **kwargs)
    seen = inst.observation
    if peak is not None:
        del placement.extra["max_logit"]
        every_peak = max_logit_check.gather_every_rank(peak.values, group)
    dsink = None if sink is None or sink.grad is None else sink.grad.clone()
    learns_bias = bias is not None and bias.learnable
    dbias = bias.values.grad.clone() if learns_bias and bias.values.grad is not None else None
    dims = (1, 2, 1, 1, 1)  # the sequence dimension of out, lse, dq, dk, dv

    def gather(tensors: Results) -> Results:
        return Results(*_gather(tensors[:len(dims)], placement, dims, group))

    gathered = gather(local)._replace(dsink=dsink, dbias=dbias)
    shadow = _shadow(seen, local.out.shape, local.dq.shape, local.dk.shape, local.dv.shape, device, group)
    del seen
    if shadow is not None:
        shadow = shadow._replace(tensors=gather(shadow.tensors))
    repeats = max(spec.repeat, 2) if spec.require_deterministic else spec.repeat
    repeated = repeat_variant(variant.attention, placement, inputs, local, repeats, **kwargs)
    if world_size == 1:
        active, inactive_reason = None, cp_reasons.SINGLE_RANK
    elif placement.watch is None:
        active, inactive_reason = None, placement.unwatched
    else:
        active, inactive_reason = cp_active(variant.attention, placement, inputs, **kwargs), None

    checks = None
    if rank == 0 and (sink is not None or placement.keep is not None or bias is not None):
        gathered, single, ref, shadow, implied = extras.references(kernel, inputs, case, placement.cu_seqlens,
                                                                   sink, placement.keep, gathered, shadow, bias)
    elif rank == 0:
        single = _whole_row(kernel, inputs, placement, causal, scale, spec.window, spec.mask)
        ref = _whole_row(KERNELS["math"], [x.double() for x in inputs], placement, causal, scale, spec.window,
                         spec.mask)
    if rank == 0:
        q, k, v = inputs[:3]
        expected = ((dtype, (*q.shape[:3], v.shape[3])), (torch.float32 if dtype != torch.float64 else dtype,
                                       (q.shape[0], q.shape[2], ref.lse.shape[2])),
                    (dtype, q.shape), (dtype, k.shape), (dtype, v.shape))
        terms = shadow.terms if shadow is not None else (None,) * len(TENSORS)
        kernel_rule = (dtype, q.shape[2] // k.shape[2])  # the case's dtype, query heads a K/V head
        checks = [tolerance_check(n, g, s, r, *e, world_size=world_size, terms=t, kernel_rule=kernel_rule)
                  for n, g, s, r, e, t in zip(TENSORS, gathered, single, ref, expected, terms)]
        if shadow is None:
            why = "a peer's own engine" if variant.peer else "none of them runs in ringbench's engines"
            for c in checks:
                c.update(no_shadow(f"{variant.name} does not report its kernel calls ({why}), so "
                                    "only the max rule applies"))
        else:
            for c, got, rebuilt, (want_dtype, _), terms, scale in zip(checks, gathered, shadow.tensors, expected,
                                                                       shadow.terms, shadow.scales):
                c.update(shadow_check(got, rebuilt, want_dtype, terms=terms, scale=scale))
                c["passed"] = c["passed"] and c["shadow_passed"]
        if sink is not None and sink.requires_grad:
            checks.append(_summed_grad_check("dsink", gathered.dsink, sink.detach(), single.dsink, ref.dsink,
                                             implied["dsink"], world_size,
                                             "d sink is summed by the engine from out and dout, not by a kernel "
                                             "call, so only the max rule applies"))
        if learns_bias:
            checks.append(_summed_grad_check("dbias", gathered.dbias, bias.values.detach(), single.dbias, ref.dbias,
                                             implied["dbias"], world_size,
                                             "d bias is added up from the kernels' calls and reduced over the ranks "
                                             "by the engine, and the block decomposition does not rebuild it, so "
                                             "only the max rule applies"))
        if peak is not None:
            checks.append(max_logit_check.max_logit_entry(every_peak, kernel, inputs, spec, causal, case.scale, bias,
                                                          world_size))
    if checks is not None:  # malformed results, d sink, d bias and the max logit have no kernel rule: null
        for c in checks:
            for field in ("kernel_units", "kernel_limit", "kernel_passed"):
                c.setdefault(field, None)
    box = [checks]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                               group=group)
    checks = box[0]
    failed = [c["tensor"] for c in checks if not max_rule_passed(c)]
    drifted = [f"{c['tensor']} ({c['shadow_ratio']:.2f}x its allowance)" for c in checks
               if c.get("shadow_passed") is False]
    reasons = []
    if failed:
        reasons.append("over the tolerance or malformed: " + ", ".join(failed))
    if drifted:
        reasons.append("off the variant's own block decomposition (merged in float64): " + ", ".join(drifted))
    off = [f"{c['tensor']} ({c['kernel_units']:.3g} eps, limit {c['kernel_limit']:.3g})"
           for c in checks if c.get("kernel_passed") is False]
    if off:
        reasons.append(f"the {kernel.name} kernel alone on one device is off float64 by more than the kernel rule's "
                       f"limit in eps of {spec.dtype} at the tensor's scale, so the max rule, which scales with that "
                       "error, cannot vouch for the variant: " + ", ".join(off))
    if active is False:
        reasons.append(f"changing one rank's K/V left the other rank's output unchanged, so "
                       f"context parallelism was not active at world size {world_size}")
    documented = getattr(kernel, "nondeterministic_backward", "")
    nondeterministic = determinism_verdict(repeated, documented=documented, require=spec.require_deterministic)
    if nondeterministic:
        reasons.append(nondeterministic)
    return {"status": "fail" if reasons else "ok", "reason": "; ".join(reasons) or None,
            "checks": checks, "cp_active": active, "cp_active_reason": inactive_reason, **repeated,
            "nondeterministic_backward": documented or None}
