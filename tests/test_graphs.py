"""CUDA graphs in the timed loop (``ringbench/rank/graphs.py``, issue 25 item 1).

On CPU: the rules (what ``auto``, ``on`` and ``off`` choose where no graph can run) and the
replay check's verdicts, output
by output, on tensors built to take each branch. On a GPU (``gpu``): an emulated zigzag and a
world-size-1 ring are captured, and one replay gives the eager outputs bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from helpers import ringbench_here
from ringbench.case.spec import CaseSpec, default_fields
from ringbench.rank import bench, graphs


def _eager_runs(dq_noise: list[float], dk=(0.0, 0.0, 0.0)) -> list[list[torch.Tensor]]:
    """Three eager calls of (out, dq, dk): out repeats bit for bit, dq and dk move by the given
    offsets (powers of two, so every difference below is exact)."""
    out = torch.arange(6.0).reshape(2, 3)
    return [[out.clone(), torch.ones(4) + torch.tensor([0.0, e, 0.0, 0.0]), torch.full((3,), 2.0) + d]
            for e, d in zip(dq_noise, dk)]


def test_graphs_replay_check_bitwise_when_eager_repeats_bit_for_bit():
    eager = _eager_runs([0.0, 0.0, 0.0])
    check = graphs.compare([t.clone() for t in eager[0]], eager)
    assert check == graphs.Check(True, "bitwise", 0.0)


def test_graphs_replay_check_passes_a_nondeterministic_output_within_eager_spread():
    # dq's spread over three calls is 2^-8 (the widest pair); the replay sits 2^-7 from one call.
    eager = _eager_runs([0.0, 2 ** -9, 2 ** -8])
    replay = [eager[0][0].clone(), eager[0][1] + torch.tensor([0.0, -2 ** -8, 0.0, 0.0]), eager[0][2].clone()]
    check = graphs.compare(replay, eager)
    assert check.ok and check.worst_ratio == 2.0
    assert check.note == "within 8x eager's own spread: dq at 2.00x (out, dk bitwise)"


def test_graphs_replay_check_fails_where_eager_is_deterministic_and_the_replay_is_not():
    # dq is noisy, so one max over every output (the old rule) would pass dk's 1-ulp slip.
    eager = _eager_runs([0.0, 2 ** -4, 2 ** -3])
    replay = [eager[0][0].clone(), eager[0][1].clone(), eager[0][2] + torch.tensor([0.0, 2 ** -22, 0.0])]
    check = graphs.compare(replay, eager)
    assert not check.ok and check.worst_ratio == math.inf
    assert check.note == "dk of the replay differs from eager by 2.38e-07, where 3 eager calls agree bit for bit"


def test_graphs_replay_check_fails_beyond_its_multiple_of_each_outputs_own_spread():
    # dq's spread 2^-3 would cover dk's 2^-6 slip under one max; dk's own spread is 2^-10.
    eager = _eager_runs([0.0, 2 ** -4, 2 ** -3], dk=(0.0, 2 ** -10, 0.0))
    replay = [eager[0][0].clone(), eager[0][1].clone(), eager[0][2] + 2 ** -6]
    check = graphs.compare(replay, eager)
    assert not check.ok and check.worst_ratio == 16.0
    assert check.note == ("dk of the replay differs from eager by 0.0156, 16.00x eager's own spread 0.000977 over 3 "
                          "calls (8x allowed)")
    # Exactly eight times the spread is still in.
    edge = graphs.compare([eager[0][0], eager[0][1], eager[0][2] + 2 ** -7], eager)
    assert edge.ok and edge.note == "within 8x eager's own spread: dq at 1.00x, dk at 8.00x (out bitwise)"


def test_graphs_replay_check_of_a_nondeterministic_backward_allows_units_in_the_last_place():
    """A backward with atomic adds (flash-attn-4's) may reorder them in a replay where three eager calls
    happened to agree bit for bit: a gradient then gets SPREAD_MULTIPLE units in the last place of its
    largest magnitude, and no more; out, and a kernel with a deterministic backward, stay bitwise."""
    eager = _eager_runs([0.0, 0.0, 0.0], dk=(0.0, 0.0, 0.0))  # dk's largest magnitude 2: float32 ulp 2^-22
    slip = [eager[0][0].clone(), eager[0][1].clone(), eager[0][2] + torch.tensor([0.0, 3 * 2 ** -22, 0.0])]
    check = graphs.compare(slip, eager, nondeterministic=True)
    assert check.ok and check.worst_ratio == 3.0
    assert check.note == ("within 8x eager's own spread: dk at 3.00x of one unit in the last place "
                          "(out, dq bitwise)")
    assert not graphs.compare(slip, eager).ok  # a deterministic kernel: bitwise or fail
    far = [eager[0][0].clone(), eager[0][1].clone(), eager[0][2] + torch.tensor([0.0, 9 * 2 ** -22, 0.0])]
    assert not graphs.compare(far, eager, nondeterministic=True).ok  # 9 units: a fault, not an order
    moved = [eager[0][0] + 2 ** -20, eager[0][1].clone(), eager[0][2].clone()]
    assert not graphs.compare(moved, eager, nondeterministic=True).ok  # out comes from no atomics
    # Eager calls that differ by less than a unit at the largest magnitude (small elements only):
    # the floor is still that unit, so 3 units pass where 3 / 2^-30 times their spread would not.
    out, dq = torch.arange(6.0).reshape(2, 3), torch.ones(4)
    tiny = [[out.clone(), dq.clone(), torch.tensor([2.0, 2.0 ** -20 + e, 2.0])] for e in (0.0, 2.0 ** -43, 0.0)]
    slip = [out.clone(), dq.clone(), tiny[0][2] + torch.tensor([3 * 2 ** -22, 0.0, 0.0])]
    assert graphs.compare(slip, tiny, nondeterministic=True).ok
    assert not graphs.compare(slip, tiny).ok


def test_graphs_replay_check_refuses_mismatched_outputs():
    eager = _eager_runs([0.0, 0.0, 0.0])
    short = graphs.compare(eager[0][:2], eager)
    assert not short.ok and short.note == "the replay gave 2 outputs and eager 3"
    wide = graphs.compare([eager[0][0], eager[0][1].double(), eager[0][2]], eager)
    assert not wide.ok and wide.note == "dq of the replay is torch.float64 (4,), eager's torch.float32 (4,)"
    nan = graphs.compare([eager[0][0], eager[0][1], eager[0][2] * float("nan")], _eager_runs([0.0, 2 ** -4, 0.0],
                                                                                          dk=(0.0, 1.0, 0.0)))
    assert not nan.ok  # a NaN is never within any spread
    with pytest.raises(ValueError, match=r"^1 eager call\(s\) give no spread; pass two or more$"):
        graphs.compare(eager[0], eager[:1])


def test_graphs_record_note_is_the_worst_ranks():
    base = bench.RankMeasure(time_ms=1.0, time_ms_p20=1.0, time_ms_p80=1.0, ref_time_ms=1.0, ref_time_ms_p20=1.0,
                             ref_time_ms_p80=1.0, timed_iters=3, ref_timed_iters=3, bytes_sent=0.0,
                             bytes_received=0.0, peak_allocated_gib=None, peak_reserved_gib=None,
                             l2_flush_bytes=None, ref_flops=1.0, profile=None, cuda_graph=True,
                             cuda_graph_note="bitwise", cuda_graph_ratio=0.0)
    near = replace(base, cuda_graph_note="within 8x eager's own spread: dq at 3.00x", cuda_graph_ratio=3.0)
    eager = replace(base, cuda_graph=False, cuda_graph_note="a replay's outputs differed", cuda_graph_ratio=9.0)
    assert bench.graph_note([base, base]) == "bitwise"
    assert bench.graph_note([base, near, base]) == "rank 1: within 8x eager's own spread: dq at 3.00x"
    assert bench.graph_note([base, near, eager]) == "rank 2: a replay's outputs differed"


def test_graphs_choice_where_no_graph_runs():
    step = lambda: ()  # noqa: E731 - never called: no choice below captures
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kw = {"emulated": False, "median_ms": lambda fn: 1.0}
    assert graphs.for_case("off", step, device=cuda, world_size=1, **kw).reason == "--cuda-graph off"
    assert graphs.for_case("auto", step, device=cpu, world_size=1, **kw).reason == "cpu has no CUDA graphs"
    nccl = graphs.for_case("auto", step, device=cuda, world_size=2, **kw)
    assert nccl.replay is None and "NCCL" in nccl.reason
    held = graphs.for_case("on", step, device=cuda, world_size=1, eager_reason="a learnable bias", **kw)
    assert held.replay is None and held.reason == "a learnable bias"


def test_graphs_on_is_refused_off_cuda_before_anything_runs(tmp_path):
    got = ringbench_here("run", "--device", "cpu", "--variant", "ring", "--cuda-graph", "on", "--out", str(tmp_path),
                         cwd=tmp_path)
    assert got.returncode == 2, got.stderr
    assert "cuda_graph 'on' needs --device cuda, and this case runs on cpu; pass --cuda-graph auto or off" in got.stderr
    assert not (tmp_path / "runs.jsonl").exists()


def _spec(**changes) -> CaseSpec:
    return CaseSpec.from_dict({"task": "run", "variant": "zigzag", **default_fields("cuda", 1), "kernel": "torch-flash",
                               "seqlen": 8192, "iters": 3, "warmup": 1, **changes})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_graphs_replay_of_an_emulated_zigzag_is_bitwise_eager(mode):
    from ringbench.variants import get_variant, instruments
    from ringbench.variants.kernels import get_kernel

    spec = _spec(world_size=4, emulate=True, mode=mode)
    device, dtype = torch.device("cuda"), torch.bfloat16
    inputs = [bench.rank_inputs(spec, r, dtype, device) for r in range(4)]
    q, k, v, dout = inputs[1]
    step = bench.iteration(get_variant("zigzag").attention, q, k, v, dout, backward=mode == "fwd_bwd", causal=True,
                           softmax_scale=spec.head_dim ** -0.5, group=None, kernel=get_kernel("torch-flash"))
    with instruments.open(emulation=instruments.Emulation(1, 4, [(k_, v_) for _, k_, v_, _ in inputs])):
        captured = graphs.capture(step, device=device)
        assert captured.replay is not None, captured.reason
        eager = [t.clone() for t in step()]
        captured.replay()
        torch.cuda.synchronize()
    assert len(captured.outputs) == len(eager) == (1 if mode == "fwd" else 4)
    if captured.check == "bitwise":
        assert all(torch.equal(a, b) for a, b in zip(captured.outputs, eager))


@pytest.mark.gpu
def test_graphs_run_records_say_whether_the_loop_replayed(tmp_path):
    import json

    got = ringbench_here("run", "--device", "cuda", "--world-size", "1", "--variant", "ring", "--kernel", "torch-flash",
                         "--seqlen", "4k", "--cuda-graph", "on", "--out", str(tmp_path), "--json", cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert record["cuda_graph"] is True and record["cuda_graph_note"].startswith(("bitwise", "within 8x eager's own spread"))


@pytest.mark.gpu
def test_graphs_auto_leaves_a_gpu_bound_iteration_eager_and_captures_a_host_bound_one():
    device = torch.device("cuda")
    big = torch.randn(8192, 8192, device=device)
    small = torch.randn(64, 64, device=device)
    heavy = lambda: (big @ big @ big,)  # noqa: E731 - two launches, tens of ms of GPU work
    light = lambda: tuple(small @ small for _ in range(200))  # noqa: E731 - 200 launches of microseconds each
    heavy(), light()  # warm, as measure_rank's warm-up is: cuBLAS's handle and the allocator's first blocks
    kw = {"emulated": False, "world_size": 1, "device": device,
          "median_ms": lambda fn: bench.quantiles(bench.time_iterations(fn, iters=5, warmup=1, device=device))[1]}
    left = graphs.for_case("auto", heavy, **kw)
    assert left.replay is None and left.reason.startswith("auto left it eager: the host issues"), left.reason
    taken = graphs.for_case("auto", light, **kw)
    assert taken.replay is not None, taken.reason
