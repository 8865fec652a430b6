"""CUDA graphs in the timed loop (``ringbench/rank/graphs.py``, issue 25 item 1).

On CPU: the rules (what ``auto``, ``on`` and ``off`` choose where no graph can run) and the
replay check's verdicts. On a GPU (``gpu``): an emulated zigzag and a world-size-1 ring are
captured, and one replay gives the eager outputs bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from helpers import ringbench_here
from ringbench.case.spec import CaseSpec, default_fields
from ringbench.rank import bench, graphs


def test_graphs_replay_check_tells_bitwise_spread_and_mismatch():
    a = [torch.tensor([1.0, 2.0])]
    assert graphs.compare([a[0].clone()], a, a) == "bitwise"
    noisy = [torch.tensor([1.0, 2.0 + 1e-3])]
    assert graphs.compare([torch.tensor([1.0, 2.0 + 1.5e-3])], a, noisy) == "within eager's own spread"
    assert graphs.compare([torch.tensor([1.0, 2.1])], a, noisy) is None
    # Eager that repeats bit for bit leaves no room: any difference is a mismatch.
    assert graphs.compare([torch.tensor([1.0, 2.0 + 1e-6])], a, a) is None


def test_graphs_choice_where_no_graph_runs():
    step = lambda: ()  # noqa: E731 - never called: no choice below captures
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    kw = {"emulated": False, "median_ms": lambda fn: 1.0}
    assert graphs.for_case("off", step, device=cuda, world_size=1, **kw).reason == "--cuda-graph off"
    assert graphs.for_case("auto", step, device=cpu, world_size=1, **kw).reason == "cpu has no CUDA graphs"
    nccl = graphs.for_case("auto", step, device=cuda, world_size=2, **kw)
    assert nccl.replay is None and "NCCL" in nccl.reason


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
    assert record["cuda_graph"] is True and record["cuda_graph_note"] in ("bitwise", "within eager's own spread")
