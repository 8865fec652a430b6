"""``run --profile``: where each rank's time goes, from the spans of ``variants/instruments/timeline.py``.

Per rank, one extra pass of ``iters`` iterations after the timed ones records a span around
every kernel call, merge and communication wait of ringbench's engines (ring, all-gather,
Ulysses). One rank's breakdown (:func:`breakdown`) is the mean over those iterations of:

- ``wall_ms``: the iteration, first mark to last;
- ``kernel_ms``, ``merge_ms``, ``comm_ms``: the sums of the spans of each kind;
- ``host_gap_ms`` (CUDA; 0 on CPU): the time the GPU sat idle before a span, waiting for the
  host to issue it (launches, Python between calls; ``timeline.py`` says how it is told from
  queued device work). It is where the host's cost shows at a few thousand tokens per rank;
- ``other_ms``: the rest, ``wall_ms`` minus the four: device work outside the spans (casts
  outside the merges, the autograd machinery's own kernels) and, on CPU, the host's work
  between calls. Spans never overlap on one stream, so it is not negative beyond clock
  resolution;
- ``busy_ms``: ``kernel_ms + merge_ms``, the rank's own work. Coupled ranks wait for each other,
  so their wall times agree even when their work does not; ``busy_imbalance`` (max / min of
  ``busy_ms``) shows the work imbalance that ``imbalance`` (of wall times) hides;
- ``steps``: per phase (``fwd``, ``bwd``) and ring step, the kernel, merge and comm means.

Means, not medians, so the parts add up to ``wall_ms``. A variant whose code makes no kernel
call ringbench sees (the peers) gets ``kernel_calls_per_iteration`` 0 and no busy time: its wall
time, and the comm spans of whatever transfers pass through ringbench's communicator.

The CLI prints ``present.profile.print_tables`` after a profiled run and writes its
``write_plots`` (a stacked bar per rank, matplotlib) next to the results.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

PARTS = ("kernel", "merge", "comm", "host_gap", "other")


def measure(step: Callable[[], None], *, iters: int, device, group=None) -> dict:
    """Run ``step`` ``iters`` times while spans are recorded and return this rank's breakdown.

    Every iteration starts after a barrier (when a process group exists), as timed ones do.
    On CUDA nothing waits for the device until the iterations are done.
    """
    import torch.distributed as dist

    from ringbench.variants import instruments

    with instruments.open(timeline=device) as inst:
        tl = inst.timeline
        for _ in range(iters):
            if dist.is_initialized():
                dist.barrier(group=group)
            tl.begin_iteration()
            step()
            tl.end_iteration()
        iterations = tl.resolve()
    out = breakdown(iterations)
    out["clock"] = "cuda events" if tl.cuda else "perf_counter"
    return out


def breakdown(iterations: list[dict]) -> dict:
    """One rank's breakdown (module docstring) from ``Timeline.resolve()``'s iterations.

    Raises:
        ValueError: no iteration.
    """
    if not iterations:
        raise ValueError("a profile needs at least one iteration; pass --iters 1 or more")
    n = len(iterations)
    totals = dict.fromkeys(("wall", "kernel", "merge", "comm", "host_gap"), 0.0)
    steps: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: dict.fromkeys(("kernel", "merge", "comm"),
                                                                                      0.0))
    spans = kernels = 0
    for it in iterations:
        totals["wall"] += it["wall_ms"]
        totals["host_gap"] += it.get("host_gap_ms", 0.0)
        spans += len(it["spans"])
        for kind, phase, index, ms in it["spans"]:
            totals[kind] += ms
            steps[(phase, index)][kind] += ms
            kernels += kind == "kernel"
    mean = {k: v / n for k, v in totals.items()}
    out = {f"{k}_ms": mean[k] for k in ("wall", "kernel", "merge", "comm", "host_gap")}
    out["other_ms"] = mean["wall"] - sum(mean[k] for k in ("kernel", "merge", "comm", "host_gap"))
    out["busy_ms"] = mean["kernel"] + mean["merge"]
    out["iters"] = n
    out["spans_per_iteration"] = spans / n
    out["kernel_calls_per_iteration"] = kernels / n
    order = {"fwd": 0, "bwd": 1}
    out["steps"] = [{"phase": phase, "step": index, **{f"{k}_ms": v / n for k, v in parts.items()}}
                    for (phase, index), parts in sorted(steps.items(), key=lambda kv: (order.get(kv[0][0], 2),
                                                                                        kv[0][1]))]
    return out


def record_fields(per_rank: list[dict | None]) -> dict:
    """The record's ``profile``, ``per_rank_busy_ms`` and ``busy_imbalance`` from every rank's
    :func:`measure` (rank order); all null when the run was not profiled."""
    if not per_rank or any(p is None for p in per_rank):
        return {"profile": None, "per_rank_busy_ms": None, "busy_imbalance": None}
    busy = [p["busy_ms"] for p in per_rank]
    # Busy time needs the kernel calls: a peer whose transfers alone pass through ringbench's
    # communicator shows comm spans but no kernel, and its busy time would read 0.
    reported = all(p["kernel_calls_per_iteration"] > 0 for p in per_rank)
    return {
        "profile": {"clock": per_rank[0]["clock"], "iters": per_rank[0]["iters"],
                    "per_rank": [{"rank": r, **{k: v for k, v in p.items() if k != "clock"}}
                                 for r, p in enumerate(per_rank)]},
        "per_rank_busy_ms": busy if reported else None,
        "busy_imbalance": max(busy) / min(busy) if reported and min(busy) > 0 else None,
    }
