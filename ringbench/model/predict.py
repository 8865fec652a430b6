"""``ringbench predict``: one case's time, throughput, memory and traffic on a cluster, from a calibration.

:func:`predict_case` walks the case's programs (``schedule.programs``: the engines' own plans),
plays them on the cluster (``simulate.simulate``) three times, at the calibration's low, middle
and high quantiles, and returns record fields shaped like a run record's (docs/contracts.md),
with ``predicted: true`` and a ``prediction`` object holding what a run cannot measure: the
forward and backward times, the critical path split, bytes per link class and the intervals.

An iteration is priced eager (every op issued by the host, at its own host cost) or replayed as
one CUDA graph (no host cost after the one launch), as ``spec.cuda_graph`` says, with ``run``'s
semantics (:func:`graph_choice`); ``--against`` prices each record as it ran (its ``cuda_graph``).

Every figure carries an interval from the calibration's spread (its 10th and 90th percentile
calls). The model's own error, validated against measured records (``predict --against``), is
not folded in: ``prediction.validated_error`` says where it stands.

Source: issue 24.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from ringbench.case.work import attention_flops
from ringbench.model import memory, schedule
from ringbench.model.calibration import Calibration, Call
from ringbench.model.fabric import Cluster
from ringbench.model.simulate import PARTS, issue_and_run_ms, play, price, segments

GIB = 1024 ** 3
#: The median error docs/validation.md's check (a) holds the model to (its bound, not its result).
MEDIAN_BOUND = 0.03
#: Check (a)'s measured result, written by ``python -m ringbench.present.validation`` beside the page.
VALIDATED = Path(__file__).resolve().parent / "validated.json"


def _validated() -> dict:
    """``validated.json`` as written by the validation page's command, or ``{}`` where it is missing."""
    try:
        return json.loads(VALIDATED.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _checks() -> list[dict]:
    """The checks ``validated.json`` holds, one per device with a check of its own records."""
    checks = _validated().get("checks")
    return [c for c in checks if isinstance(c, dict) and isinstance(c.get("median_error"), (int, float))
            and isinstance(c.get("worst_error"), (int, float))] if isinstance(checks, list) else []


def _check_of(cal: Calibration | None) -> tuple[dict | None, str | None]:
    """The check of ``cal``'s device (of the device it was derived from, for a derived one), and that
    device's name where it is another's; (None, None) where none was made."""
    if cal is None:
        return None, None
    device = cal.derived_from or cal.device
    check = next((c for c in _checks() if c.get("device") == device), None)
    return check, (device if cal.derived_from else None)


def model_error(cal: Calibration | None = None) -> float:
    """The model's own relative error that advise widens each interval by before it calls one
    candidate faster than another: the measured median error of the check of ``cal``'s device
    (``validated.json``; the largest of every check's where that device has none, or no ``cal``
    is given), never less than :data:`MEDIAN_BOUND`."""
    check, _ = _check_of(cal)
    medians = [check["median_error"]] if check else [c["median_error"] for c in _checks()]
    return max([MEDIAN_BOUND, *map(float, medians)])


def validated_error(cal: Calibration | None = None) -> str:
    """What ``prediction.validated_error`` says: the result of docs/validation.md's check of ``cal``'s
    device in numbers (of the device it was derived from, saying so), and how to read the figures."""
    check, source = _check_of(cal)
    if check is None:
        where = f" on {cal.device}" if cal is not None else ""
        return (f"not validated{where}: docs/validation.md checks no records of its calibration, so read every "
                "figure as an estimate")
    found = (f"docs/validation.md's check ({check.get('check')}) on {check['device']} finds a median error of "
             f"{100 * check['median_error']:.1f}% and a worst of {100 * check['worst_error']:.1f}% over "
             f"{check.get('records')} measured records")
    if source:
        found += " (this calibration is derived from it, and not checked itself)"
    if check.get("passed") and not source:
        return f"within its bounds: {found}"
    bounds = (f"median {100 * check.get('median_bound', MEDIAN_BOUND):g}%, "
              f"worst {100 * (check.get('worst_bound') or 0):g}%")
    return f"not yet within its bounds ({bounds}): {found}, so read every figure as an estimate"


def reference_ms(spec, cal: Calibration, kernel: str, which: str = "mid") -> tuple[float, float]:
    """The same kernel on one rank's share (S / W tokens, the case's mask and mode), as the run's
    reference is (``bench``): (ms, FLOPs). Packed documents sharded by row (llama3_varlen) give
    each rank its own pieces; the rank whose reference takes longest stands, as in ``bench``."""
    from ringbench.case.spec import padded_docs, spec_docs
    from ringbench.variants import get_variant

    variant = get_variant(spec.variant)
    shape = schedule.case_shape(spec)
    local = spec.seqlen // spec.world_size
    window = spec.window or 0
    real = spec_docs(spec) if variant.varlen else None

    def one(docs) -> tuple[float, float]:
        total = 0.0
        for mode in ("fwd", "bwd") if spec.mode == "fwd_bwd" else ("fwd",):
            if docs is not None:
                pieces = tuple((d, d, (d * (d + 1) / 2) if spec.causal else float(d) * d) for d in docs)
                call = Call(mode, "causal" if spec.causal else "full", local, local, sum(p for *_, p in pieces),
                            docs=pieces)
            elif window and window < local:
                call = Call(mode, "window", local, local, schedule.part_pairs(local, local, (window - 1, 0)),
                            window=window)
            elif spec.causal:
                call = Call(mode, "causal", local, local, local * (local + 1) / 2)
            else:
                call = Call(mode, "full", local, local, float(local) * local)
            total += cal.kernel_ms(kernel, call, shape, which)
        flops = attention_flops(batch=spec.batch, seqlen=local, heads=spec.heads, head_dim=spec.head_dim,
                                causal=spec.causal, mode=spec.mode, docs=docs if real else None,
                                head_dim_v=spec.value_head_dim(), window=spec.window or None)
        return total, flops

    if schedule.mask_of(spec) is not None:
        return max((_masked_share(spec, cal, kernel, which, shape, rank) for rank in range(spec.world_size)),
                   key=lambda tf: tf[0])
    if not variant.varlen:
        return one(None)
    from ringbench.variants.engines import layouts

    cu = layouts.cu_seqlens_from_docs(padded_docs(spec))
    layout = spec.layout or variant.layout
    degree = variant.layout_degree(spec.world_size, spec.ulysses_degree)
    ranks = range(1) if variant.shard_by_document else range(spec.world_size)  # by document: every rank alike
    found = []
    for rank in ranks:
        local_cu = layouts.varlen_local_cu_seqlens(cu, layout, rank, spec.world_size,
                                                   by_document=variant.shard_by_document,
                                                   ulysses_degree=degree).tolist()
        found.append(one([b - a for a, b in zip(local_cu, local_cu[1:])]))
    return max(found, key=lambda tf: tf[0])


def _masked_share(spec, cal: Calibration, kernel: str, which: str, shape, rank: int) -> tuple[float, float]:
    """Rank ``rank``'s reference under a mask (:func:`_masked_share_calls`) priced at quantile
    ``which``: (ms, FLOPs)."""
    calls, pairs = _masked_share_calls(spec, rank)
    total = sum(cal.kernel_ms(kernel, call, shape, which) for call in calls)
    flops = attention_flops(batch=spec.batch, seqlen=spec.seqlen // spec.world_size, heads=spec.heads,
                            head_dim=spec.head_dim, causal=False, mode=spec.mode, head_dim_v=spec.value_head_dim(),
                            pairs=pairs)
    return total, flops


@functools.lru_cache(maxsize=64)
def _masked_share_calls(spec, rank: int) -> tuple[tuple[Call, ...], float]:
    """The kernel calls of rank ``rank``'s reference under ``spec``'s mask, as ``bench`` runs it: the mask
    between the positions the rank holds (``bench.reference_mask``), cut into one window call per slice
    (``masked.Sliced``), in each mode of ``spec``; and the pairs they attend. Cut once per case and rank,
    for every quantile."""
    from ringbench.case.spec import padded_docs
    from ringbench.variants import get_variant
    from ringbench.variants.engines import layouts, masked
    from ringbench.variants.engines.ring import Step

    variant = get_variant(spec.variant)
    W = spec.world_size
    layout = spec.layout or variant.layout
    degree = variant.ulysses_degree(W, spec.ulysses_degree) if variant.ulysses else 1
    docs = padded_docs(spec) if variant.varlen else None
    if docs is not None:
        held = layouts.varlen_token_index(layouts.cu_seqlens_from_docs(docs).tolist(), layout, rank, W,
                                          by_document=variant.shard_by_document, ulysses_degree=degree)
    else:
        held = layouts.token_index(layout, spec.seqlen, rank, W, ulysses_degree=degree, mask=spec.mask)
    runs = masked.runs_of(held.tolist())
    share = Step(slice(None), slice(None), False, parts=masked.block_parts(schedule.mask_of(spec), runs, runs,
                                                                           by_slices=True))
    by_mode = {mode: schedule.step_calls(share, mode, len(held))
               for mode in (("fwd", "bwd") if spec.mode == "fwd_bwd" else ("fwd",))}
    return tuple(c for calls in by_mode.values() for c in calls), sum(c.pairs for c in by_mode["fwd"])


def placement(cluster: Cluster, layout: schedule.Layout, how: str):
    """The host slot of each rank: ``ulysses-inner`` (the grid's own: Ulysses groups of consecutive
    ranks, inside a node where they fit) or ``ring-inner`` (the other placement, for comparison:
    the ring's ranks consecutive, the Ulysses groups strided across the nodes)."""
    if how == "ulysses-inner" or layout.ulysses_degree in (1, cluster.world_size):
        return lambda r: r
    U, R = layout.ulysses_degree, layout.ring_degree
    return lambda r: (r % U) * R + r // U


def graph_choice(spec, priced, *, device_type: str, play_graph) -> tuple[bool, str]:
    """Whether ``run`` would replay ``spec``'s iteration as a CUDA graph (``rank.graphs.for_case``'s
    rules), and why: ``off`` eager; no graphs off cuda; ``on`` replayed; ``auto`` eager for a real
    run with NCCL transfers (world size above 1, not emulated), eager where the host issues an
    iteration in less than ``graphs.HOST_BOUND`` of the GPU's time to run it (every rank's, from
    the priced ops: ``simulate.issue_and_run_ms``), else replayed where the replay is predicted
    faster (``play_graph(graph) -> ms``)."""
    from ringbench.rank.graphs import HOST_BOUND

    choice = getattr(spec, "cuda_graph", "auto")
    if choice == "off":
        return False, "--cuda-graph off"
    if device_type != "cuda":
        return False, f"{device_type} has no CUDA graphs"
    if choice == "on":
        return True, "--cuda-graph on"
    if spec.world_size > 1 and not getattr(spec, "emulate", False):
        return False, "auto leaves a run with NCCL transfers eager (--cuda-graph on captures them)"
    mid = priced.whiches.index("mid") if "mid" in priced.whiches else 0
    costs = [issue_and_run_ms(priced, r, mid) for r in range(spec.world_size)]
    if all(host < HOST_BOUND * gpu for host, gpu in costs):
        host, gpu = max(costs, key=lambda hg: hg[0] / hg[1] if hg[1] else 0.0)
        return False, (f"auto leaves it eager: the host issues an iteration in {host:.3f} ms and the GPU runs it in "
                       f"{gpu:.3f} ms")
    eager_ms, graph_ms = play_graph(False), play_graph(True)
    if graph_ms >= eager_ms:
        return False, f"auto leaves it eager: the graph is predicted no faster ({graph_ms:.3f} ms against {eager_ms:.3f} ms)"
    return True, f"auto replays it: {graph_ms:.3f} ms against {eager_ms:.3f} ms eager"


def predict_case(spec, *, calibration: Calibration, kernel: str, cluster: Cluster,
                 place: str = "ulysses-inner", programs: tuple | None = None,
                 cache: dict | None = None, graph: bool | None = None, side: bool | None = None) -> dict[str, Any]:
    """The predicted run fields of ``spec`` (a resolved ``CaseSpec`` at ``cluster.world_size``).

    Returns:
        A run record's fields (``time_ms``, ``per_rank_time_ms``, ``tflops_per_gpu``, ``efficiency``,
        ``peak_allocated_gib`` estimated, ``bytes_sent``...) plus ``predicted: true`` and
        ``prediction`` (module docstring).

    ``programs``: ``schedule.programs(spec)`` where the caller has it already (one walk serves
    every kernel and placement of a case); ``cache``: a dict the caller keeps across calls, where
    the programs' segments and their prices per kernel are kept. ``graph``: price the iteration
    replayed as a CUDA graph (True) or eager (False); None: as ``spec.cuda_graph`` says
    (:func:`graph_choice`). ``side``: ``schedule.programs``' (where ``programs`` is not given).

    Raises:
        schedule.Unpredictable: a case whose schedule the model does not walk.
    """
    with schedule.paused_gc():
        return _predict_case(spec, calibration=calibration, kernel=kernel, cluster=cluster, place=place,
                             programs=programs, cache=cache, graph=graph, side=side)


def _predict_case(spec, *, calibration: Calibration, kernel: str, cluster: Cluster, place: str, programs: tuple | None,
                  cache: dict | None, graph: bool | None, side: bool | None) -> dict[str, Any]:
    progs, layout = programs if programs is not None else schedule.programs(spec, side=side)
    where = placement(cluster, layout, place)
    cache = {} if cache is None else cache
    if ("segments", id(progs)) not in cache:  # the programs are kept with their segments, so their id stays theirs
        cache[("segments", id(progs))] = (progs, segments(progs))
    segs = cache[("segments", id(progs))][1]
    key = ("priced", id(progs), kernel, id(calibration))
    if key not in cache:
        cache[key] = (progs, price(segs, calibration=calibration, kernel=kernel, whiches=("lo", "mid", "hi")))
    priced = cache[key][1]
    if graph is None:
        def mid_ms(g: bool) -> float:
            return max(t.total_ms for t in play(priced, cluster=cluster, place=where, graph=g)["mid"])

        graph, graph_note = graph_choice(spec, priced, device_type=calibration.device_type, play_graph=mid_ms)
    else:
        graph_note = "replayed as a CUDA graph, as asked" if graph else "eager, as asked"
    runs = play(priced, cluster=cluster, place=where, graph=graph)
    mid = runs["mid"]
    W = spec.world_size
    # The rank whose time it is: the last to finish, and among those (a collective ends them together)
    # the busiest, whose path holds the work rather than the wait.
    busy = [t.parts["compute"] + t.parts["overhead"] for t in mid]
    last = max(t.total_ms for t in mid)
    slowest = max((r for r in range(W) if mid[r].total_ms >= last * (1 - 1e-9)), key=lambda r: busy[r])
    time_ms = mid[slowest].total_ms
    # Each end is a simulation of its own, whose slowest rank or graph choice may differ from the
    # point's: the interval holds the point whatever they give.
    ends = (max(t.total_ms for t in runs["lo"]), max(t.total_ms for t in runs["hi"]))
    interval = [min(*ends, time_ms), max(*ends, time_ms)]
    from ringbench.case.spec import spec_docs
    from ringbench.variants import get_variant

    variant = get_variant(spec.variant)
    real = spec_docs(spec) if variant.varlen else None
    flops_per_gpu = attention_flops(batch=spec.batch, seqlen=sum(real) if real else spec.seqlen, heads=spec.heads,
                                    head_dim=spec.head_dim, causal=spec.causal, mode=spec.mode, docs=real,
                                    head_dim_v=spec.value_head_dim(), window=spec.window or None,
                                    mask="" if schedule.mask_of(spec) is None else spec.mask) / W
    ref = {which: reference_ms(spec, calibration, kernel, which) for which in ("lo", "mid", "hi")}
    ref_ms, ref_flops = ref["mid"]

    def tflops(ms: float) -> float:
        return flops_per_gpu / (ms * 1e-3) / 1e12 if ms > 0 else math.inf

    ref_tflops = ref_flops / (ref_ms * 1e-3) / 1e12
    efficiency = tflops(time_ms) / ref_tflops
    # The efficiency's ends: the fast end of the ring over the fast end of the kernel, and so on.
    ends = (tflops(interval[1]) / (ref["hi"][1] / (ref["hi"][0] * 1e-3) / 1e12),
            tflops(interval[0]) / (ref["lo"][1] / (ref["lo"][0] * 1e-3) / 1e12))
    eff_lo, eff_hi = min(*ends, efficiency), max(*ends, efficiency)
    sent = [t.bytes_sent for t in mid]
    by_class: dict[str, float] = {}
    for t in mid:
        for cls, nbytes in t.bytes_by_class.items():
            by_class[cls] = max(by_class.get(cls, 0.0), nbytes)
    fwd_ms = max((t.fwd_ms if t.fwd_ms is not None else t.total_ms) for t in mid) if spec.mode == "fwd_bwd" else time_ms
    parts = {p: mid[slowest].parts[p] for p in PARTS}
    notes = _notes(spec, calibration, kernel) + _past_grid_notes(progs[slowest], calibration, kernel)
    peak = memory.peak_gib(spec, ulysses_degree=layout.ulysses_degree)
    return {
        "predicted": True,
        "time_ms": time_ms,
        "per_rank_time_ms": [t.total_ms for t in mid],
        "imbalance": time_ms / min(t.total_ms for t in mid) if min(t.total_ms for t in mid) > 0 else None,
        "flops_convention": "flash-attn",
        "flops_per_gpu": flops_per_gpu,
        "tflops_per_gpu": tflops(time_ms),
        "ref_time_ms": ref_ms,
        "ref_tflops": ref_tflops,
        "efficiency": efficiency,
        "peak_allocated_gib": peak,
        "peak_reserved_gib": None,
        "bytes_sent": int(max(sent)) if W > 1 else 0,
        "bytes_received": int(max(sent)) if W > 1 else 0,
        "bus_gib_s": max(sent) / GIB / (time_ms * 1e-3) if W > 1 and time_ms > 0 else None,
        "bytes_counted": True,
        "per_rank_busy_ms": busy,
        "cuda_graph": graph,
        "cuda_graph_note": graph_note,
        "busy_imbalance": max(busy) / min(busy) if min(busy) > 0 else None,
        "prediction": {
            "fwd_ms": fwd_ms,
            "bwd_ms": time_ms - fwd_ms if spec.mode == "fwd_bwd" else None,
            "critical_path_ms": parts,
            "slowest_rank": slowest,
            "busy_max_over_mean": max(busy) / (sum(busy) / W) if sum(busy) > 0 else None,
            # Each rank alone, with free and instant transfers: what run --emulate measures.
            "compute_only_ms": max(t.parts["compute"] + t.parts["overhead"] + emulated_copies_ms(prog, calibration)
                                   for t, prog in zip(mid, progs)),
            "bytes_by_link_class": by_class,
            "interval": {"time_ms": interval, "tflops_per_gpu": [tflops(interval[1]), tflops(interval[0])],
                         "efficiency": [eff_lo, eff_hi]},
            "ulysses_degree": layout.ulysses_degree,
            "ring_degree": layout.ring_degree,
            "placement": place if layout.ulysses_degree not in (1, W) else None,
            "kernel_calls": mid[slowest].kernel_calls,
            "calibration": calibration.provenance(),
            "cluster": cluster.describe(),
            "memory": "estimated from shapes (ringbench/model/memory.py)",
            "validated_error": validated_error(calibration),
            "notes": notes,
        },
    }


def emulated_copies_ms(program: list, cal: Calibration) -> float:
    """What ``run --emulate`` adds to a rank's compute and overhead for its collectives, ms
    (``variants/instruments/emulation.py``, on the compute stream): an all-gather copies every
    member's shard into place and a reduce-scatter its own shard, each read and written; an
    all-to-all is one ``torch.cat`` of the parts in place of ``engines.comm.all_to_all``'s packing
    copy, the exchange and its joining copy, so one of the two copies the program holds around it
    (``schedule.ulysses_program``'s ``swap``) comes off. The ring's point-to-point copies run beside
    the compute (a side stream) and add nothing."""
    total = 0.0
    for op, _ in program:
        if not isinstance(op, schedule.Post):
            continue
        if op.op == "all_gather":
            total += cal.overhead_ms("copy", 2 * len(op.group) * op.nbytes)
        elif op.op == "reduce_scatter":
            total += cal.overhead_ms("copy", 2 * op.nbytes)
        elif op.op == "all_to_all":
            total -= cal.overhead_ms("copy", 2 * op.nbytes)
    return total


def _past_grid_notes(program: list, cal: Calibration, kernel: str) -> list[str]:
    """A note where the slowest rank's kernel calls have more rows than the calibration measured."""
    kcal = cal.kernel(kernel)
    beyond, largest = 0, 0
    for op, shape in program:
        if isinstance(op, schedule.Compute) and op.kind == "kernel":
            surface, _ = kcal.surface(op.call.mode, op.call.mask, shape)
            top = max(p["q"] for p in surface.points)
            if op.call.q > top:
                beyond, largest = max(beyond, op.call.q), top
    if not beyond:
        return []
    return [f"calls of up to {beyond} rows are past the calibration's largest block ({largest} rows): a causal "
            "call's rate there follows the diagonal's law through the two largest squares, any other takes "
            "the largest block's rate"]


def _notes(spec, cal: Calibration, kernel: str) -> list[str]:
    """What the prices had to assume for this case (a mask or head dim the calibration lacks)."""
    shape = schedule.case_shape(spec)
    out = []
    kcal = cal.kernel(kernel)
    for mode in ("fwd", "bwd"):
        for mask in ("full", "causal") + (("window",) if spec.window else ()):
            _, note = kcal.surface(mode, mask, shape)
            if note and note not in out:
                out.append(note)
    return out
