"""``run --emulate``: every rank of a ring of any size, played in turn by one process on one device.

The sweep launches an emulated case as a single-rank job (``case.spec.launch_world_size``), and its
worker calls :func:`emulate_case`: it draws every rank's shards from the seed exactly as the W
ranks of a real run would (``bench.rank_inputs``), then, rank by rank, runs that rank's
schedule under ``instruments.open(emulation=...)``, where the ring's transfers are device copies
of the K/V blocks the rank would receive. Each rank is warmed up and timed like a real one
(``bench.measure_rank``), so its time is its compute alone: kernels, merges, copies and the
host's launches, with no link and no waiting for a slower rank.

The record is a run record built by ``bench.run_fields`` with ``emulated: true``:
``per_rank_time_ms`` and ``per_rank_compute_ms`` are each rank's compute-only median,
``time_ms`` the slowest of them, and ``efficiency`` (repeated as ``efficiency_bound``) is the
efficiency of MEASUREMENT.md over that time: the same kernel on one rank's share, divided into
the TFLOP/s per GPU the ring would reach with free, fully hidden communication. A real run at
that world size can only be slower. ``bytes_sent`` is what a rank would send per iteration;
``bus_gib_s`` is null.

Source: issue 15, item 8.
"""

from __future__ import annotations

from ringbench.case.spec import CaseSpec


def emulate_case(spec: CaseSpec, *, device) -> dict:
    """Measure every rank of ``spec`` in turn on ``device`` and return the run fields of its record.

    Args:
        spec: a ``run`` case with ``emulate`` set, its kernel resolved, of a variant with
            ``Variant.emulates`` and no learnable sink (the spec checks refuse the others).
        device: the one device every rank runs on.

    Returns:
        The fields of ``bench.run_fields`` plus ``emulated``, ``per_rank_compute_ms`` and
        ``efficiency_bound`` (module docstring).

    Raises:
        RuntimeError: a TFLOP/s above the device's peak.
    """
    import torch

    from ringbench.rank import bench
    from ringbench.rank.setup import sink_logits
    from ringbench.case.fields import DTYPES, variant_options
    from ringbench.variants import instruments
    from ringbench.variants import get_variant
    from ringbench.variants.kernels import get_kernel
    from ringbench.variants.kernels.common import window_band

    variant, kernel = get_variant(spec.variant), get_kernel(spec.kernel)
    dtype, world_size = getattr(torch, DTYPES[spec.dtype]), spec.world_size
    scale, backward, local = spec.head_dim ** -0.5, spec.mode == "fwd_bwd", spec.seqlen // world_size
    inputs = [bench.rank_inputs(spec, r, dtype, device) for r in range(world_size)]
    shards = [(k, v) for _, k, v, _ in inputs]
    # An off-by-one sink joins each row after the ring's last merge, on its own rank, with no
    # gradient to all-reduce; so it is emulated (spec.validate refuses a learnable one).
    sink = sink_logits(spec, dtype, device)
    options = {**variant_options(spec), **({"sink": sink} if sink is not None else {})}
    gathered: list[bench.RankMeasure] = []
    # Under a sliding window the reference attends the rank's share with the same window.
    band = window_band(spec.window)
    ref_kw, ref_causal = ({"window": band}, False) if band else ({}, spec.causal)
    for rank, (q, k, v, dout) in enumerate(inputs):
        step = bench.iteration(variant.attention, q, k, v, dout, backward=backward, causal=spec.causal,
                               softmax_scale=scale, group=None, kernel=kernel, **options)

        def reference(q=q, k=k, v=v, dout=dout) -> None:
            with torch.no_grad():
                out, lse = kernel.forward(q, k, v, ref_causal, scale, **ref_kw)
                if backward:
                    kernel.backward(dout, q, k, v, out, lse, ref_causal, scale, **ref_kw)

        with instruments.open(emulation=instruments.Emulation(rank, world_size, shards)):
            gathered.append(bench.measure_rank(spec, step, reference, inputs=(q, k, v), device=device, group=None,
                                               ref_docs=None, local=local))
    fields = bench.run_fields(spec, variant, gathered, device=device, emulated=True)
    fields.update(emulated=True, per_rank_compute_ms=fields["per_rank_time_ms"],
                  efficiency_bound=fields["efficiency"])
    return fields
