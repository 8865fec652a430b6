"""``run --emulate``: every rank of a context-parallel group of any size, played in turn by one process on one device.

The sweep launches an emulated case as a single-rank job (``case.spec.launch_world_size``), and its
worker calls :func:`emulate_case`: it draws every rank's shards from the seed exactly as the W
ranks of a real run would (``bench.rank_inputs``), then, rank by rank, runs that rank's
code under ``instruments.open(emulation=...)``, where every transfer of ringbench's
communicators is a device copy (``variants/instruments/emulation.py`` says which are exact):
the ring's K/V blocks, the all-gather engines' K/V gather and dK/dV reduce-scatter, the
Ulysses all-to-alls, USP's both, a learnable sink's gradient all-reduce and the varlen
``cu_seqlens`` check. Each rank is set up (``bench.rank_calls``: its documents prepared, its
reference), warmed up and timed like a real one (``bench.measure_rank``), so its time is its
compute alone: kernels, merges, copies and the host's launches, with no link and no waiting
for a slower rank.

The record is a run record built by ``bench.run_fields`` with ``emulated: true``:
``per_rank_time_ms`` and ``per_rank_compute_ms`` are each rank's compute-only median,
``time_ms`` the slowest of them, and ``efficiency`` (repeated as ``efficiency_bound``) is the
efficiency of MEASUREMENT.md over that time: the same kernel on one rank's share, divided into
the TFLOP/s per GPU the variant would reach with free, fully hidden communication. A real run at
that world size can only be slower. ``bytes_sent`` is what a rank would send per iteration,
counted by the same rules as a real run (an all-gather's shard times W - 1, an all-to-all's
parts but its own); ``bus_gib_s`` is null.

Source: issue 15, item 8; issue 25, item 3 (every engine).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ringbench.case.spec import CaseSpec


def emulate_case(spec: CaseSpec, *, device) -> dict:
    """Measure every rank of ``spec`` in turn on ``device`` and return the run fields of its record.

    Args:
        spec: a ``run`` case with ``emulate`` set, its kernel resolved, of a variant with
            ``Variant.emulates`` (the spec checks refuse the others).
        device: the one device every rank runs on.

    Returns:
        The fields of ``bench.run_fields`` plus ``emulated``, ``per_rank_compute_ms`` and
        ``efficiency_bound`` (module docstring).

    Raises:
        RuntimeError: a TFLOP/s above the device's peak.
    """
    import torch

    from ringbench.case.fields import DTYPES
    from ringbench.rank import bench
    from ringbench.rank.setup import case_setup
    from ringbench.variants import get_variant, instruments

    dtype, world_size = getattr(torch, DTYPES[spec.dtype]), spec.world_size
    inputs = [bench.rank_inputs(spec, r, dtype, device) for r in range(world_size)]

    def measure(rank: int, choice: str) -> bench.RankMeasure:
        q, k, v, _ = inputs[rank]
        with instruments.open(emulation=instruments.Emulation(rank, world_size, inputs)):
            case = case_setup(replace(spec, cuda_graph=choice))  # the emulated rank of the emulated world
            step, reference, ref_docs = bench.rank_calls(case, inputs[rank], device=device)
            return bench.measure_rank(case.spec, step, reference, inputs=(q, k, v), device=device, group=None,
                                      ref_docs=ref_docs, local=spec.seqlen // world_size)

    gathered = agree([measure(rank, spec.cuda_graph) for rank in range(world_size)], measure)
    fields = bench.run_fields(spec, get_variant(spec.variant), gathered, device=device, emulated=True)
    fields.update(emulated=True, per_rank_compute_ms=fields["per_rank_time_ms"],
                  efficiency_bound=fields["efficiency"])
    return fields


def agree(gathered: list, measure: Callable[[int, str], Any]) -> list:
    """The ranks' measures, all replayed or all eager, as a real run's ranks agree (``graphs.for_case``).

    Emulated ranks each decide for themselves, and a record whose slowest rank ran eagerly beside
    replayed ones would mix two protocols. Where the ranks differ, the fewer are measured again
    the way of the more (``measure(rank, "on")`` or ``"off"``); where a rank cannot replay when
    made to, the replayed ones are measured again eagerly. A rank measured again says so in its
    note, with its own first choice.

    Args:
        gathered: each rank's ``bench.RankMeasure``, in rank order.
        measure: ``measure(rank, choice)``, one rank measured again with ``--cuda-graph choice``.
    """
    replayed = [r for r, g in enumerate(gathered) if g.cuda_graph]
    eager = [r for r, g in enumerate(gathered) if not g.cuda_graph]
    if not replayed or not eager:
        return gathered
    out = list(gathered)
    if len(replayed) >= len(eager):
        again = {r: measure(r, "on") for r in eager}
        if all(m.cuda_graph for m in again.values()):
            for r, m in again.items():
                out[r] = _noted(m, gathered[r], "replayed like the other ranks")
            return out
    for r in replayed:
        out[r] = _noted(measure(r, "off"), gathered[r], "ran eagerly like the other ranks")
    return out


def _noted(m, first, what: str):
    return replace(m, cuda_graph_note=f"{what} (its own choice: {first.cuda_graph_note})")
