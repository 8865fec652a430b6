"""``ringbench advise``: every variant, layout, factorization and kernel the rules allow, predicted and ranked.

For one attention shape, sequence (or documents) and cluster, :func:`candidates` lists what
ringbench could run: each of its own variants of the shape's form (batch, or packed documents),
each layout a variant takes, each Ulysses degree of the hybrids (a divisor of the world size),
on request each placement of a hybrid's groups on a multi-node cluster (the Ulysses group inside
a node, the grid's own, and the other way round for comparison) and each calibrated kernel that
takes the shape. Each is built as ``run`` builds a case (``sweep.build``), so the registry's rules refuse
what they refuse (Ulysses degrees the heads cannot split, with the reason), and predicted
(``predict.predict_case``). :func:`advise` drops what would not fit in the GPU's memory, ranks
the rest by time and says why each wins or loses: compute-bound, exposed communication, waiting
for slower ranks (imbalance), per-step overhead, or memory. A runner-up whose interval (the
calibration's spread widened by the model's own error, :func:`predict.model_error`) overlaps the
leader's is tied with it: the model cannot order them, only a measurement can. :func:`scaling` predicts the best
candidate of each of the leading variants again at smaller world sizes, for ``advise --plot``:
the predicted time against world size.

Source: issue 24.
"""

from __future__ import annotations

import gc
import shlex
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ringbench.case.fields import format_size, parse_docs
from ringbench.model import schedule
from ringbench.model.predict import model_error, predict_case
from ringbench.model.target import Target
from ringbench.variants import VARIANTS, factorizations

#: Share of a GPU's memory the attention call may take before a candidate is dropped (the rest:
#: the model's weights, activations, the allocator's slack).
MEMORY_SHARE = 0.9
#: A critical-path term above this share of the time is named as the reason.
NAMED_SHARE = 0.1
#: The largest seqlen the verify command asks for: its float64 reference holds the whole sequence.
VERIFY_SEQLEN = 32 * 1024


@dataclass
class Candidate:
    """One thing ringbench could run: its case fields, and after :func:`advise` its fate.

    Attributes:
        fields: the case options (``variant``, ``layout``, ``ulysses_degree``, ``kernel``...).
        placement: ``ulysses-inner`` or ``ring-inner`` (hybrids on several nodes), else None.
        refusal: why the rules refuse it (never predicted), or None.
        record: its predicted record, or None.
        fits: whether its estimated peak memory fits (``MEMORY_SHARE`` of the GPU's).
        reason: why it wins or loses, one phrase.
    """

    fields: dict
    placement: Optional[str] = None
    refusal: Optional[str] = None
    record: Optional[dict] = None
    fits: bool = True
    reason: str = ""
    commands: dict = field(default_factory=dict)
    tied: bool = False
    error: float = 0.0  # the model's own error for its calibration (predict.model_error), set by advise

    @property
    def band(self) -> tuple[float, float]:
        """Its time's interval (ms): the calibration's 10th to 90th percentile calls, widened by the
        model's own error (:func:`predict.model_error`); what ranking compares."""
        lo, hi = self.record["prediction"]["interval"]["time_ms"]
        error = self.error or model_error()
        return lo * (1 - error), hi * (1 + error)

    @property
    def label(self) -> str:
        f = self.fields
        out = f["variant"]
        if f.get("layout"):
            out += f" {f['layout']}"
        if f.get("ulysses_degree"):
            out += f" U={f['ulysses_degree']}"
        if self.placement == "ring-inner":
            out += " ring-inner"
        return f"{out}, {f.get('kernel', 'auto')}"


def candidates(shape: dict, *, world_size: int, nodes: int, kernels: list[str], device: str = "cuda",
               both_placements: bool = False) -> list[Candidate]:
    """Every candidate of ``shape`` (case fields without a variant) at ``world_size`` (module docstring);
    a hybrid's groups placed as the grid places them (the Ulysses group inside a node), and with
    ``both_placements`` also the other way round (the ring's ranks inside a node), for comparison."""
    varlen = bool(shape.get("docs") or shape.get("doc_dist"))
    out = []
    for name, v in VARIANTS.items():
        if v.peer or v.varlen != varlen or device not in v.devices or (shape.get("causal") is False and not v.non_causal):
            continue
        # advise takes no mask, so a layout that follows one (ring's balanced) has nothing to follow.
        option = v.options.get("layout")
        layouts = [""] + [lay for lay in v.layouts if shape.get("mask") or not (option and option.needs_mask(lay))]
        # A hybrid (usp) at U=1 is its zigzag ring, whose schedule the model walks as zigzag's (a candidate
        # of its own), so a second row would only tie with it. U=W stays: where the heads refuse Ulysses
        # over every rank, its row says so for the hybrid too.
        degrees = ([d for d in factorizations(world_size) if d != 1 or world_size == 1]
                   if "ulysses_degree" in v.options else [0])
        for layout in layouts:
            for degree in degrees:
                hybrid = degree not in (0, 1, world_size)
                placements = ["ulysses-inner", "ring-inner"] if hybrid and nodes > 1 and both_placements else [None]
                for placement in placements:
                    for kernel in kernels:
                        fields = {**shape, "variant": name, "kernel": kernel}
                        if layout:
                            fields["layout"] = layout
                        if degree:
                            fields["ulysses_degree"] = degree
                        out.append(Candidate(fields, placement))
    return out


def dtype_refusal(dtype: Optional[str], kernels: list[str]) -> Optional[str]:
    """Why none of ``kernels`` (calibrated kernel names) takes ``dtype`` (``--dtype``'s name; ``None``:
    bf16), in one sentence with the fix, or ``None``: every candidate would be refused for it alone.
    Imports torch (the kernels' registry)."""
    from ringbench.variants.kernels import DTYPE_NAMES, KERNELS

    takes = {n: [short for d, short in DTYPE_NAMES.items() if d in KERNELS[n].dtypes] for n in kernels
             if n in KERNELS}
    dtype = dtype or "bf16"
    if not takes or any(dtype in names for names in takes.values()):
        return None
    each = "; ".join(f"{n} takes {' and '.join(names)}" for n, names in takes.items())
    first = next(iter(takes.values()))[0]
    return (f"dtype {dtype} is taken by none of the calibration's kernels ({each}), and advise ranks only what a "
            f"kernel runs; pass --dtype {first}")


def _reason(rec: dict, best: Optional[dict], *, tied: bool = False, ties: int = 0) -> str:
    """Why ``rec`` wins or loses; ``tied``: it is a runner-up tied with ``best``; ``ties``: (for the
    best) how many runners-up are tied with it."""
    p = rec["prediction"]
    total = rec["time_ms"] or 1.0
    parts = p["critical_path_ms"]
    named = [(parts["comm"] / total, "exposed communication"), (parts["wait"] / total, "imbalance (waiting for "
                                                                                       "slower ranks)"),
             (parts["overhead"] / total, "per-step overhead (merges, adds, copies, launches)")]
    big = [f"{what} {100 * share:.0f}%" for share, what in sorted(named, reverse=True) if share > NAMED_SHARE]
    spread = p.get("busy_max_over_mean") or 1.0
    if spread > 1 + NAMED_SHARE:
        big.append(f"work imbalance (the busiest rank {spread:.2f}x the mean)")
    why = ", ".join(big) if big else f"compute-bound ({100 * parts['compute'] / total:.0f}% in the kernel)"
    if best is None or best is rec:
        if ties:
            return f"fastest by the median, {ties} more tied with it within the model's error; {why}"
        return f"fastest beyond the model's error; {why}"
    slower = 100 * (rec["time_ms"] / best["time_ms"] - 1)
    by = f"{slower:.1f}%" if slower < 10 else f"{slower:.0f}%"
    if tied:
        return f"tied with #1 ({by} slower by the median); {why}"
    return f"{by} slower than the best; {why}" if slower < 10 else f"{by} slower; {why}"


def commands(c: Candidate, *, world_size: int, nodes: int) -> dict[str, str]:
    """The ``ringbench run`` and ``ringbench verify`` commands that check candidate ``c`` on real GPUs.

    ``run`` measures the very case at the cluster's size (with ``--nnodes``, run on every node with
    its own ``--node-rank`` and the same ``--rdzv-endpoint``); ``verify`` checks it at the same world
    size at a seqlen its float64 reference can hold (at most :data:`VERIFY_SEQLEN`), a varlen case's
    ``--docs`` scaled to that seqlen (:func:`scaled_docs`, each a multiple of what the variant cuts
    every document into) and its ``--doc-dist`` as given (documents drawn to that seqlen).
    """
    f = c.fields
    args = ["--variant", f["variant"], "--world-size", str(world_size)]
    for key, option in (("layout", "--layout"), ("ulysses_degree", "--ulysses-degree"), ("heads", "--heads"),
                        ("kv_heads", "--kv-heads"), ("head_dim", "--head-dim"), ("head_dim_v", "--head-dim-v"),
                        ("batch", "--batch"), ("dtype", "--dtype"), ("window", "--window"), ("sink", "--sink"),
                        ("kernel", "--kernel")):
        if f.get(key) not in (None, "", 0, "none") and not (key == "batch" and f[key] == 1):
            args += [option, str(f[key])]
    if f.get("causal") is False:
        args.append("--no-causal")
    nodes_args = ["--nnodes", str(nodes), "--node-rank", "NODE_RANK", "--rdzv-endpoint", "HOST:29500"] if nodes > 1 else []
    seqlen = f["seqlen"]
    docs = [a for key, option in (("docs", "--docs"), ("doc_dist", "--doc-dist")) if f.get(key)
            for a in (option, str(f[key]))]
    run = ["ringbench", "run", *args, "--seqlen", format_size(seqlen), *docs, *nodes_args]
    multiple = 2 * world_size
    small = max(multiple, min(seqlen, VERIFY_SEQLEN) // multiple * multiple)
    if small != seqlen and f.get("docs"):  # a varlen case verifies its documents, shortened with the sequence
        each = VARIANTS[f["variant"]].seqlen_multiple(world_size) if VARIANTS[f["variant"]].shard_by_document else 1
        docs = ["--docs", ",".join(map(format_size, scaled_docs(parse_docs(f["docs"]), small, each)))]
    verify = ["ringbench", "verify", *args, "--seqlen", format_size(small), *docs, *nodes_args]
    return {"run": shlex.join(run), "verify": shlex.join(verify)}


def scaled_docs(docs: list[int], total: int, multiple: int) -> list[int]:
    """Document lengths (tokens) of the same proportions as ``docs`` that sum to ``total`` tokens,
    each a positive multiple of ``multiple``: each boundary of the row moved to the nearest multiple
    at the new length, so documents that shrink to nothing merge into their neighbour.
    ``total`` must be a multiple of ``multiple``."""
    whole, bounds, sum_so_far = sum(docs), [0], 0
    for length in docs[:-1]:
        sum_so_far += length
        bound = round(sum_so_far * total / whole / multiple) * multiple
        if bounds[-1] < bound < total:
            bounds.append(bound)
    bounds.append(total)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def rank(cands: list[Candidate]) -> list[Candidate]:
    """The predicted candidates that fit, by time, each with its reason; a runner-up whose
    :attr:`Candidate.band` overlaps the first's is marked ``tied`` (and the first with it)."""
    ranked = sorted((c for c in cands if c.record and c.fits), key=lambda c: c.record["time_ms"])
    best = ranked[0].record if ranked else None
    for c in ranked[1:]:
        c.tied = c.band[0] <= ranked[0].band[1]
    ties = sum(c.tied for c in ranked)
    if ranked:
        ranked[0].tied = ties > 0  # the leader belongs to its tied group
    for c in ranked:
        c.reason = _reason(c.record, best, tied=c.tied, ties=ties)
    return ranked


@contextmanager
def _collector_paused():
    """The cyclic garbage collector off while the candidates are predicted: their programs are
    hundreds of thousands of small acyclic tuples, and its passes over them took half of advise's
    time and freed nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def advise(cands: list[Candidate], *, build: Callable[[dict], Any], tgt: Target, world_size: int,
           memory_gib: Optional[float], progress: Optional[Callable[[int, Candidate], None]] = None
           ) -> list[Candidate]:
    """Build, predict and rank ``cands`` in place; returns them ranked: the fitting ones by time,
    then those that do not fit, then the refused ones.

    ``build(fields) -> CaseSpec`` builds one case as ``run`` would, raising ``SpecError`` with the
    rules' refusal. ``progress(i, candidate)``, if given, is called before each candidate (i from 0).
    One case's walked programs are kept while its kernels and placements are priced (they come
    together in ``candidates``' order), then dropped: at 1024 ranks each case's take about 4 GB.
    """
    from ringbench.errors import SpecError

    cluster = tgt.cluster(world_size)
    walked_key, walked = None, None  # the case whose programs are held, and its programs
    priced: dict = {}  # the programs' segments and prices, shared by the kernels and placements of a case
    with _collector_paused():
        for i, c in enumerate(cands):
            if progress is not None:
                progress(i, c)
            c.refusal = tgt.kernel_refusal(c.fields["kernel"])  # a kernel the GPU cannot run
            if c.refusal:
                continue
            try:
                spec = build(c.fields)
            except SpecError as exc:
                c.refusal = str(exc)
                continue
            reason = schedule.refusal(spec)
            if reason:
                c.refusal = reason
                continue
            spec = spec.replace(kernel=c.fields["kernel"])
            key = spec.replace(kernel="auto")
            if key != walked_key:  # one walk of the plans serves every kernel and placement of a case
                priced.clear()
                walked = None  # the last case's programs freed before the next walk, not after it
                walked_key, walked = key, schedule.programs(spec)
            fields = predict_case(spec, calibration=tgt.calibration, kernel=spec.kernel, cluster=cluster,
                                  place=c.placement or "ulysses-inner", programs=walked, cache=priced)
            from ringbench.records.build import build as build_record

            c.record = build_record(spec, run_id=tgt.run_id, status="ok", fields=fields, env=tgt.env())
            c.error = model_error(tgt.calibration)
            c.fits = memory_gib is None or c.record["peak_allocated_gib"] <= MEMORY_SHARE * memory_gib
    ranked = rank(cands)
    for c in cands:
        if c.record and not c.fits:
            c.reason = (f"does not fit: needs about {c.record['peak_allocated_gib']:.1f} GiB for attention, above "
                        f"{100 * MEMORY_SHARE:.0f}% of the GPU's {memory_gib:g} GiB")
        if c.record:
            c.commands = commands(c, world_size=world_size, nodes=cluster.nodes)
    return ranked + [c for c in cands if c.record and not c.fits] + [c for c in cands if c.refusal]


def entry(c: Candidate, rank: Optional[int]) -> dict[str, Any]:
    """The JSON object of one candidate (``advise --json``). ``tied_with_best``: a ranked candidate
    the model cannot tell from the first (the first too, when any is); ``interval_ms``: the interval
    that decides it (the calibration's, widened by the model's error ``model_error``)."""
    ranked = rank is not None
    return {"rank": rank, "candidate": c.label, "fields": c.fields, "placement": c.placement,
            "refused": c.refusal, "fits": c.fits if c.record else None, "reason": c.reason or c.refusal,
            "tied_with_best": c.tied if ranked else None, "interval_ms": list(c.band) if ranked else None,
            "model_error": (c.error or model_error()) if ranked else None, "prediction": c.record,
            "commands": c.commands or None}


#: How many variants ``advise --plot`` draws: the best candidate of each, in rank order.
PLOT_LEADERS = 5


def leaders(ranked: list[Candidate], n: int = PLOT_LEADERS) -> list[Candidate]:
    """The best fitting candidate of each of the first ``n`` variants of ``ranked`` (``advise``'s order)."""
    out: dict[str, Candidate] = {}
    for c in ranked:
        if c.record and c.fits and c.fields["variant"] not in out:
            out[c.fields["variant"]] = c
            if len(out) == n:
                break
    return list(out.values())


def plot_world_sizes(world_size: int, gpus_per_node: int) -> list[int]:
    """The world sizes ``advise --plot`` predicts at: every power of two up to ``world_size``, and
    ``world_size``; above one node only multiples of ``gpus_per_node`` (every node is full)."""
    sizes = {world_size}
    w = 1
    while w < world_size:
        sizes.add(w)
        w *= 2
    return sorted(w for w in sizes if w <= gpus_per_node or w % gpus_per_node == 0)


def scaling(cands: list[Candidate], *, build: Callable[[dict, int], Any], tgt: Target, world_sizes: list[int],
            memory_gib: Optional[float]) -> list[dict]:
    """Each candidate predicted at every world size of ``world_sizes``, the global sequence the same
    (strong scaling), for ``advise --plot``.

    ``build(fields, world_size) -> CaseSpec`` builds a case as ``run`` would, raising ``SpecError``
    where the rules refuse it at that size (a Ulysses degree above it, a seqlen it does not divide).

    Returns:
        Per candidate ``{"label", "variant", "kernel", "points"}``; ``points`` per world size
        ``{"world_size", "time_ms", "fits"}``, or ``{"world_size", "refused"}`` with the reason.
    """
    from ringbench.errors import SpecError

    out = []
    with _collector_paused():
        for c in cands:
            points = []
            for w in world_sizes:
                try:
                    spec = build(c.fields, w)
                    reason = schedule.refusal(spec)
                    if reason:
                        raise SpecError(reason)
                    spec = spec.replace(kernel=c.fields["kernel"])
                    fields = predict_case(spec, calibration=tgt.calibration, kernel=spec.kernel,
                                          cluster=tgt.cluster(w), place=c.placement or "ulysses-inner")
                except (SpecError, schedule.Unpredictable) as exc:
                    points.append({"world_size": w, "refused": str(exc)})
                    continue
                fits = memory_gib is None or fields["peak_allocated_gib"] <= MEMORY_SHARE * memory_gib
                points.append({"world_size": w, "time_ms": fields["time_ms"], "fits": fits})
            out.append({"label": c.label, "variant": c.fields["variant"], "kernel": c.fields["kernel"],
                        "points": points})
    return out

