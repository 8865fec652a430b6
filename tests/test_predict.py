"""ringbench predict, advise and calibrate (issue 24): the model walks the engines' own plans.

Hand-computed cases from a flat calibration (one rate for every block) and a link of one
bandwidth, compute-bound and then communication-bound; a plan that changes changes the
prediction; the engine, run under emulation, makes exactly the kernel calls the model walks;
bad cluster files are refused in one sentence; advise lists the Ulysses degrees the heads refuse.
"""

from __future__ import annotations

import json
from dataclasses import replace as dc_replace

import pytest

from helpers import ringbench_here
from ringbench.case.spec import CaseSpec, default_fields
from ringbench.model import calibration as C
from ringbench.model import schedule
from ringbench.model.fabric import Cluster, Link
from ringbench.model.predict import predict_case

RATE = 1e12  # FLOP/s of every kernel call in the flat calibration
SHAPE = C.Shape(1, 2, 1, 16, 16, "fp32")
SIZES = (8, 16, 32, 64, 128, 256, 512)


def _flat_calibration(rate: float = RATE) -> dict:
    """A calibration whose every call runs at ``rate``, with no overheads worth a rounding."""
    surfaces = []
    for mode in C.MODES:
        for mask in ("full", "causal"):
            points = []
            for q in SIZES:
                for k in (SIZES if mask == "full" else (q,)):
                    t = C.call_flops(C.Call(mode, mask, q, k, C.point_pairs(mask, q, k)), SHAPE) / rate * 1e3
                    points.append({"q": q, "k": k, "time_ms": t, "lo_ms": t, "hi_ms": t})
            surfaces.append(C.surface_dict(mode, mask, SHAPE, points))
    free = {"fixed_ms": 0.0, "gib_s": 1e15}
    return {"format": C.FORMAT, "schema_version": C.SCHEMA_VERSION, "device": "cpu", "device_type": "cpu",
            "kernels": {"cpu": {"version": "test", "surfaces": surfaces}},
            "overheads": {"merge": free, "add": free, "copy": free, "launch_ms": 0.0}, "source": "test"}


def _spec(variant: str, world_size: int, seqlen: int, **kw) -> CaseSpec:
    fields = {**default_fields("cpu", world_size), "task": "run", "variant": variant, "world_size": world_size,
              "seqlen": seqlen, "heads": SHAPE.heads, "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim,
              "dtype": "fp32", "kernel": "cpu", "mode": "fwd", **kw}
    return CaseSpec.from_dict(fields)


def _cluster(world_size: int, gb_s: float) -> Cluster:
    link = Link("test", "test link", "intra-node", gb_s, 0.0, (), "test")
    return Cluster("cpu", world_size, 1, link, link)


def _ms(pairs: float) -> float:
    """Milliseconds of a forward call of ``pairs`` pairs at RATE (4 * pairs * H * D FLOPs)."""
    return 4 * pairs * SHAPE.heads * SHAPE.head_dim / RATE * 1e3


@pytest.mark.parametrize("gb_s", [1e6, 1e-3], ids=["compute-bound", "communication-bound"])
def test_predict_two_rank_ring_by_hand(gb_s):
    """ring at W=2: rank 0 computes its causal diagonal, rank 1 its diagonal, waits for rank 0's K/V,
    then the full block: time = max(causal, transfer) + full."""
    cal = C.from_dict(_flat_calibration(), "test")
    S = 512
    m = S // 2
    spec = _spec("ring", 2, S)
    rec = predict_case(spec, calibration=cal, kernel="cpu", cluster=_cluster(2, gb_s))
    kv_bytes = m * SHAPE.kv_heads * (SHAPE.head_dim + SHAPE.head_dim_v) * 4
    transfer = kv_bytes / (gb_s * 1e9) * 1e3
    causal, full = _ms(m * (m + 1) / 2), _ms(m * m)
    assert rec["time_ms"] == pytest.approx(max(causal, transfer) + full, rel=1e-6)
    assert rec["per_rank_time_ms"][0] == pytest.approx(max(causal, transfer), rel=1e-6)
    path = rec["prediction"]["critical_path_ms"]
    assert path["compute"] == pytest.approx(causal + full, rel=1e-6)
    assert path["comm"] == pytest.approx(max(0.0, transfer - causal), rel=1e-6, abs=1e-9)
    assert rec["bytes_sent"] == kv_bytes


@pytest.mark.parametrize("gb_s", [1e6, 1e-3], ids=["compute-bound", "communication-bound"])
def test_predict_four_rank_zigzag_by_hand(gb_s):
    """zigzag at W=4, every rank alike: the causal diagonal, then three half blocks, a K/V transfer in
    flight behind each of the first three steps: max(c, x) + 2 max(h, x) + h."""
    cal = C.from_dict(_flat_calibration(), "test")
    S = 1024
    m = S // 4
    rec = predict_case(_spec("zigzag", 4, S), calibration=cal, kernel="cpu", cluster=_cluster(4, gb_s))
    x = m * SHAPE.kv_heads * (SHAPE.head_dim + SHAPE.head_dim_v) * 4 / (gb_s * 1e9) * 1e3
    c, h = _ms(m * (m + 1) / 2), _ms(m * m / 2)
    expected = max(c, x) + 2 * max(h, x) + h
    assert rec["time_ms"] == pytest.approx(expected, rel=1e-6)
    assert rec["per_rank_time_ms"] == pytest.approx([expected] * 4, rel=1e-6)
    # Against the same kernel on one rank's share (m tokens, causal), in the run record's convention.
    flops_per_gpu, ref_flops = 4 * S * S / 2 * SHAPE.heads * SHAPE.head_dim / 4, 4 * m * m / 2 * SHAPE.heads * SHAPE.head_dim
    assert rec["efficiency"] == pytest.approx((flops_per_gpu / expected) / (ref_flops / c), rel=1e-6)


def test_predict_follows_a_changed_plan(monkeypatch):
    """A plan that computes one more block (the ring's skipped future block of rank 0) adds that
    kernel call and its time to the prediction: the model walks the plan, not a copy of it."""
    from ringbench.variants.engines import ring

    cal = C.from_dict(_flat_calibration(), "test")
    S, m = 512, 256
    before = predict_case(_spec("ring", 2, S), calibration=cal, kernel="cpu", cluster=_cluster(2, 1e6))
    original = ring.contiguous_plan

    def one_more(step, source, rank, world_size, seqlen_local, causal):
        block = original(step, source, rank, world_size, seqlen_local, causal)
        return ring.Block(slice(None), slice(None), False) if block is None else block

    monkeypatch.setattr(ring, "contiguous_plan", one_more)
    after = predict_case(_spec("ring", 2, S), calibration=cal, kernel="cpu", cluster=_cluster(2, 1e6))
    assert after["per_rank_time_ms"][0] == pytest.approx(before["per_rank_time_ms"][0] + _ms(m * m), rel=1e-6)
    progs, _ = schedule.programs(_spec("ring", 2, S))
    assert sum(op.kind == "kernel" for op, _ in progs[0] if isinstance(op, schedule.Compute)) == 2


def _recording_kernel(calls: list):
    """The cpu kernel, recording every forward and backward call's (mode, q rows, k rows, mask)."""
    from ringbench.variants.kernels import KERNELS

    cpu = KERNELS["cpu"]

    def mask(causal, window):
        return "window" if window is not None else ("causal" if causal else "full")

    def forward(q, k, v, causal, scale, **kw):
        calls.append(("fwd", q.shape[1], k.shape[1], mask(causal, kw.get("window"))))
        return cpu.forward(q, k, v, causal, scale, **kw)

    def backward(dout, q, k, v, out, lse, causal, scale, **kw):
        calls.append(("bwd", q.shape[1], k.shape[1], mask(causal, kw.get("window"))))
        return cpu.backward(dout, q, k, v, out, lse, causal, scale, **kw)

    return dc_replace(cpu, forward=forward, backward=backward)


@pytest.mark.parametrize("variant,window", [("ring", 0), ("zigzag", 0), ("stripe", 0), ("zigzag", 96)])
def test_predict_walks_the_calls_the_engine_makes(variant, window):
    """Every rank's kernel calls, played by the real engine under emulation (one process, transfers as
    copies), are the model's calls, in order, shape by shape."""
    import torch

    from ringbench.variants import get_variant, instruments

    W, S = 4, 512
    spec = _spec(variant, W, S, mode="fwd_bwd", window=window)
    progs, _ = schedule.programs(spec)
    local = S // W
    gen = torch.Generator().manual_seed(0)
    shards = [tuple(torch.randn(1, local, h, SHAPE.head_dim, generator=gen) for h in (2, 1, 1)) for _ in range(W)]
    for rank in range(W):
        calls: list = []
        kernel = _recording_kernel(calls)
        q, k, v = (t.clone().requires_grad_(True) for t in shards[rank])
        emul = instruments.Emulation(rank, W, [(s[1], s[2]) for s in shards[:rank]] + [(k, v)] +
                                     [(s[1], s[2]) for s in shards[rank + 1:]])
        with instruments.open(emulation=emul):
            out, _ = get_variant(variant).attention(q, k, v, causal=True, softmax_scale=None, group=None, kernel=kernel,
                                                    **({"window": window} if window else {}))
            out.backward(torch.ones_like(out))
        walked = [(op.call.mode, op.call.q, op.call.k, op.call.mask) for op, _ in progs[rank]
                  if isinstance(op, schedule.Compute) and op.kind == "kernel"]
        assert walked == calls, (rank, walked, calls)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("body,words", [
    ("gpus_per_node = 8\nnodse = 2\n", "has key 'nodse'"),
    ("gpus_per_node = [8\n", "is not valid TOML"),
    ("intra = \"nvlink9\"\n", "'nvlink9' is not in the fabric table"),
    ("intra = \"ib-ndr\"\n", "is an inter-node link"),
    ("gpus_per_node = 0\n", "gpus_per_node 0 must be a whole number of 1 or more"),
    ("[fabric.mine]\nclass = \"intra-node\"\ngb_s = 10.0\nlatency_us = 1.0\n", "has no source"),
    ("[fabric.mine]\nclass = \"between\"\ngb_s = 10.0\nlatency_us = 1.0\nsource = \"x\"\n", "has class 'between'"),
], ids=["unknown-key", "bad-toml", "unknown-link", "wrong-class", "zero-gpus", "no-source", "bad-class"])
def test_predict_refuses_a_bad_cluster_file_in_one_sentence(tmp_path, body, words):
    path = _write(tmp_path / "cluster.toml", body)
    res = ringbench_here("predict", "--variant", "zigzag", "--gpu", "H100", "--cluster", str(path), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    message = " ".join(res.stderr.split())
    assert words in message and "cluster file" in message, message
    assert message.count(". ") == 0 and "Traceback" not in res.stderr, message


@pytest.mark.slow
def test_predict_json_records_are_marked_predicted(tmp_path):
    """predict --json through the CLI with a calibration file and a cluster file: one record per case,
    predicted: true, run-record fields, the figures of the hand-computed case."""
    cal = _write(tmp_path / "cal.json", json.dumps(_flat_calibration()))
    cluster = _write(tmp_path / "cluster.toml", "gpus_per_node = 2\nintra = \"mine\"\n[fabric.mine]\n"
                     "class = \"intra-node\"\ngb_s = 1000000.0\nlatency_us = 0.0\nsource = \"test\"\n")
    res = ringbench_here("predict", "--variant", "ring", "--world-size", "2", "--seqlen", "512", "--heads", "2",
                         "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp32", "--mode", "fwd", "--calibration",
                         str(cal), "--cluster", str(cluster), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (rec,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert rec["predicted"] is True and rec["status"] == "ok" and rec["task"] == "run"
    assert rec["spec"]["world_size"] == 2 and rec["kernel"] == "cpu"
    m = 256
    assert rec["time_ms"] == pytest.approx(_ms(m * (m + 1) / 2) + _ms(m * m), rel=1e-4)
    assert rec["prediction"]["validated_error"].startswith("not yet validated")


@pytest.mark.slow
def test_advise_lists_refused_ulysses_degrees_with_the_reason(tmp_path):
    """12 query heads over 4 K/V heads at W=8: Ulysses over 8 ranks and usp at U=8 cannot split the
    heads, and advise says so; the degrees that can are ranked, each with its commands."""
    cal = _write(tmp_path / "cal.json", json.dumps(_flat_calibration()))
    res = ringbench_here("advise", "--heads", "12", "--kv-heads", "4", "--head-dim", "16", "--dtype", "fp32",
                         "--seqlen", "2k", "--calibration", str(cal), "--gpus-per-node", "8", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    entries = [json.loads(line) for line in res.stdout.splitlines()]
    refused = {e["candidate"]: e["refused"] for e in entries if e["refused"]}
    assert "Ulysses degree 8 does not divide heads 12" in refused["usp U=8, cpu"], refused
    assert "world_size 8 does not divide heads 12" in refused["ulysses, cpu"], refused
    ranked = [e for e in entries if e["rank"]]
    assert {"usp U=2, cpu", "usp U=4, cpu", "zigzag, cpu"} <= {e["candidate"] for e in ranked}
    times = [e["prediction"]["time_ms"] for e in ranked]
    assert times == sorted(times)
    assert ranked[0]["commands"]["verify"].startswith("ringbench verify --variant ")
