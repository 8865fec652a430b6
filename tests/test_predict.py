"""ringbench predict, advise and calibrate (issue 24): the model walks the engines' own plans.

Hand-computed cases from a flat calibration (one rate for every block) and a link of one
bandwidth, compute-bound and then communication-bound; a plan that changes changes the
prediction; the engine, run under emulation, makes exactly the kernel calls the model walks;
bad cluster files are refused in one sentence; advise lists the Ulysses degrees the heads refuse.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace as dc_replace

import pytest
from pathlib import Path

from helpers import flat_calibration, ringbench_here
from ringbench.case.spec import CaseSpec, default_fields
from ringbench.model import calibration as C
from ringbench.model import schedule
from ringbench.model.fabric import Cluster, Link
from ringbench.model.predict import predict_case

RATE = 1e12  # FLOP/s of every kernel call in the flat calibration
SHAPE = C.Shape(1, 2, 1, 16, 16, "fp32")


def _flat_calibration(rate: float = RATE) -> dict:
    return flat_calibration(rate, SHAPE)


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


def test_predict_prices_a_short_document_of_a_varlen_call_at_the_edge_rate():
    """A batch call of 4 keys, below the calibration's smallest size (8), is launch-bound and takes that
    point's time; four documents of 4 keys inside one varlen call of 256 rows are one launch, and
    take the edge's rate: their FLOPs at RATE."""
    cal = C.from_dict(_flat_calibration(), "test")
    batch = C.Call("fwd", "full", 256, 4, 256.0 * 4)
    at_rate = C.call_flops(batch, SHAPE) / RATE * 1e3
    assert cal.kernel_ms("cpu", batch, SHAPE) == pytest.approx(2 * at_rate, rel=1e-9)
    varlen = C.Call("fwd", "full", 256, 16, 256.0 * 4, docs=((64, 4, 64.0 * 4),) * 4)
    assert cal.kernel_ms("cpu", varlen, SHAPE) == pytest.approx(at_rate, rel=1e-9)


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

    def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, **kw):
        calls.append(("fwd", q.shape[1], k.shape[1], mask(causal, kw.get("window")), _lengths(cu_q, cu_k)))
        return cpu.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, **kw)

    def backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, **kw):
        calls.append(("bwd", q.shape[1], k.shape[1], mask(causal, kw.get("window")), _lengths(cu_q, cu_k)))
        return cpu.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, **kw)

    return dc_replace(cpu, forward=forward, backward=backward, forward_varlen=forward_varlen,
                      backward_varlen=backward_varlen)


def _lengths(cu_q, cu_k) -> tuple:
    """(query rows, keys) of every document of a varlen call."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return tuple((b - a, d - c) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:]))


@pytest.mark.parametrize("variant,window,mask,layout", [
    ("ring", 0, "", ""), ("zigzag", 0, "", ""), ("stripe", 0, "", ""), ("zigzag", 96, "", ""),
    # Under a mask, a window-taking kernel's partial blocks are window calls, one per slice.
    ("zigzag", 0, "prefix:100", ""), ("stripe", 0, "shared-prefix:64,answers=4", ""),
    ("ring", 0, "chunked:96", "balanced"), ("llama3", 0, "global:8,window:40", ""), ("usp", 0, "prefix:100", "")])
def test_predict_walks_the_calls_the_engine_makes(variant, window, mask, layout):
    """Every rank's kernel calls, played by the real engine under emulation (one process, transfers as
    copies), are the model's calls, in order, shape by shape."""
    import torch

    from ringbench.variants import get_variant, instruments

    W, S = 4, 512
    degree = {"ulysses_degree": 2} if variant == "usp" else {}  # a ring of 2 over Ulysses groups of 2
    spec = _spec(variant, W, S, mode="fwd_bwd", window=window, mask=mask, layout=layout, **degree)
    options = {**({"window": window} if window else {}), **({"mask": mask} if mask else {}),
               **({"layout": layout} if layout else {}), **degree}
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
                                                    **options)
            out.backward(torch.ones_like(out))
        walked = [(op.call.mode, op.call.q, op.call.k, op.call.mask) for op, _ in progs[rank]
                  if isinstance(op, schedule.Compute) and op.kind == "kernel"]
        assert walked == calls, (rank, walked, calls)
        if mask:
            assert any(c[3] == "window" for c in calls)  # the mask's partial blocks were cut, and walked


@pytest.mark.parametrize("layout,window", [("contiguous", 0), ("balanced", 0), ("contiguous", 40)])
def test_predict_walks_the_varlen_calls_llama3_varlen_makes(layout, window):
    """llama3_varlen over packed documents that straddle ranks: every rank's varlen kernel calls, played by
    the real engine under emulation, are the model's calls, document piece by document piece."""
    import torch

    from ringbench.variants import get_variant, instruments
    from ringbench.variants.engines import layouts

    W, docs = 4, [200, 56, 160, 96]
    S = sum(docs)
    spec = _spec("llama3_varlen", W, S, mode="fwd_bwd", docs=",".join(map(str, docs)), layout=layout, window=window)
    progs, _ = schedule.programs(spec)
    assert sum(isinstance(op, schedule.Post) for op, _ in progs[0]) > 0  # the gathers and reduce-scatters
    cu = layouts.cu_seqlens_from_docs(docs)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(1, S, h, SHAPE.head_dim, generator=gen) for h in (2, 1, 1)]
    shards = [tuple(layouts.shard_varlen(x, cu, layout, r, W, by_document=False) for x in rows) for r in range(W)]
    pieces = 0
    for rank in range(W):
        calls: list = []
        q, k, v = (t.clone().requires_grad_(True) for t in shards[rank])
        emul = instruments.Emulation(rank, W, [(s[1], s[2]) for s in shards[:rank]] + [(k, v)] +
                                     [(s[1], s[2]) for s in shards[rank + 1:]])
        with instruments.open(emulation=emul):
            out, _ = get_variant("llama3_varlen").attention(
                q, k, v, causal=True, softmax_scale=None, group=None, kernel=_recording_kernel(calls), cu_seqlens=cu,
                layout=layout, **({"window": window} if window else {}))
            out.backward(torch.ones_like(out))
        walked = [(op.call.mode, op.call.q, op.call.k, op.call.mask, tuple((lq, lk) for lq, lk, _ in op.call.docs))
                  for op, _ in progs[rank] if isinstance(op, schedule.Compute) and op.kind == "kernel"]
        assert [c[0] for c in calls] == ["fwd", "bwd"], calls  # one head group: one call each way
        assert walked == calls, (rank, walked, calls)
        pieces = max(pieces, len(calls[0][4]))
    assert pieces >= 2  # a rank whose rows hold pieces of several documents


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
    ("[fabric.mine]\nclass = \"intra-node\"\ngb_s = 10.0\nsource = \"x\"\n",
     "fabric row 'mine' has no latency_us; write latency_us (or a measured curve in place of gb_s and latency_us)"),
    # The GPU's own row laid over by one of another class: it was taken as the intra-node link at 1 GB/s.
    ("nodes = 2\n[fabric.nvlink4]\nclass = \"inter-node\"\ngb_s = 1.0\nlatency_us = 5.0\nsource = \"x\"\n",
     "fabric row 'nvlink4', the intra-node link of H100, has class 'inter-node'; give it class 'intra-node', or "
     "name another row as intra"),
], ids=["unknown-key", "bad-toml", "unknown-link", "wrong-class", "zero-gpus", "no-source", "bad-class",
        "no-latency", "own-row-wrong-class"])
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
    # A cpu calibration's records are checked nowhere, and the prediction says so.
    assert rec["prediction"]["validated_error"].startswith("not validated on cpu")


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


# --------------------------------------------------------------------------- host costs and CUDA graphs (issue 24)

def _hosted_calibration(host_ms: float, device_type: str = "cpu") -> C.Calibration:
    """The flat calibration with every kernel call costing the host ``host_ms`` to issue."""
    raw = _flat_calibration()
    raw["device_type"] = device_type
    raw["kernels"]["cpu"]["host_ms"] = {"fwd": host_ms, "bwd": host_ms}
    return C.from_dict(raw, "test")


def test_a_graph_replay_prices_no_host_issue_cost():
    """W=1 fwd_bwd is one forward and one backward call (no merge, no add: the engine keeps the
    kernel's own results). Eager, the GPU waits for the host's issue of each call; replayed as a
    graph, the calls run back to back after one launch (launch_ms, 0 here)."""
    S = 256
    cal = _hosted_calibration(5.0)
    spec = _spec("ring", 1, S, mode="fwd_bwd")
    fwd = _ms(S * (S + 1) / 2)  # causal: the square block's lower triangle
    work = fwd * (1 + C.BWD_OVER_FWD)
    eager = predict_case(spec, calibration=cal, kernel="cpu", cluster=_cluster(1, 1e6), graph=False)
    graph = predict_case(spec, calibration=cal, kernel="cpu", cluster=_cluster(1, 1e6), graph=True)
    assert graph["time_ms"] == pytest.approx(work, rel=1e-9)
    # the second call's issue ends after the first call's work (5 ms against microseconds): it sets the time
    assert eager["time_ms"] == pytest.approx(10.0 + fwd * C.BWD_OVER_FWD, rel=1e-9)
    assert (eager["cuda_graph"], graph["cuda_graph"]) == (False, True)


def test_cuda_graph_auto_mirrors_run():
    """auto replays a host-bound W=1 case on cuda, leaves a real W=2 run eager (NCCL), and a case
    whose GPU time dwarfs the host's stays eager; on and off are taken as said; cpu has no graphs."""
    cuda = _hosted_calibration(5.0, "cuda")

    def rec(spec, cal=cuda):
        return predict_case(spec, calibration=cal, kernel="cpu", cluster=_cluster(spec.world_size, 1e6))

    w1 = rec(_spec("ring", 1, 256, mode="fwd_bwd"))
    assert w1["cuda_graph"] is True and w1["cuda_graph_note"].startswith("auto replays it")
    w2 = rec(_spec("ring", 2, 256, mode="fwd_bwd"))
    assert w2["cuda_graph"] is False and "NCCL" in w2["cuda_graph_note"]
    assert rec(_spec("ring", 2, 256, mode="fwd_bwd", cuda_graph="on"))["cuda_graph"] is True
    assert rec(_spec("ring", 1, 256, mode="fwd_bwd", cuda_graph="off"))["cuda_graph"] is False
    gpu_bound = rec(_spec("ring", 1, 256, mode="fwd_bwd"), _hosted_calibration(1e-6, "cuda"))
    assert gpu_bound["cuda_graph"] is False and "host issues an iteration" in gpu_bound["cuda_graph_note"]
    assert rec(_spec("ring", 1, 256), _hosted_calibration(5.0))["cuda_graph_note"] == "cpu has no CUDA graphs"


@pytest.mark.parametrize("variant", ["ring", "zigzag"])
def test_the_backward_adds_only_where_the_engine_launches_one(variant):
    """ring._accumulate keeps the first gradient over every row as the kernel returned it: W=1
    launches no add; W=2 adds at its last step (the incoming dK/dV), and zigzag's half blocks add too."""
    progs, _ = schedule.programs(_spec(variant, 1, 256, mode="fwd_bwd"))
    assert not [op for op, _ in progs[0] if isinstance(op, schedule.Compute) and op.kind == "add"]
    progs, _ = schedule.programs(_spec(variant, 2, 256, mode="fwd_bwd"))
    for prog in progs:
        adds = [op for op, _ in prog if isinstance(op, schedule.Compute) and op.kind == "add"]
        assert adds and adds[-1].step == 1


def test_a_version_1_calibration_is_read_as_host_inclusive():
    """A schema 1 file (one call between two events per point, one launch_ms for every op) is read:
    its points are marked host-inclusive and every op costs the host its launch_ms; a schema this
    ringbench does not know is refused in one sentence."""
    raw = _flat_calibration()
    raw["schema_version"] = 1
    for k in raw["kernels"].values():
        del k["host_ms"], k["timing"]
    for key in ("merge", "add", "copy"):
        raw["overheads"][key] = {k: v for k, v in raw["overheads"][key].items() if k != "host_ms"}
    raw["overheads"]["launch_ms"] = 0.5
    cal = C.from_dict(raw, "old")
    assert cal.host_inclusive and cal.kernel("cpu").timing == {"fwd": C.HOST_INCLUSIVE, "bwd": C.HOST_INCLUSIVE}
    assert cal.issue_ms("kernel", "cpu", "bwd") == cal.issue_ms("merge") == 0.5
    assert "host-inclusive" in cal.provenance()
    new = C.from_dict(_flat_calibration(), "new")
    assert not new.host_inclusive and new.issue_ms("kernel", "cpu", "fwd") == 0.0
    with pytest.raises(C.SpecError, match="schema_version 3"):
        C.from_dict({**raw, "schema_version": 3}, "future")


@pytest.mark.slow
def test_calibrate_on_cpu_end_to_end(tmp_path):
    """ringbench calibrate --device cpu writes a schema 2 file: GPU-free points timed by the CPU clock,
    each kernel's host cost per direction and merge/add/copy's; predict reads it back."""
    out = tmp_path / "cpu.json"
    res = ringbench_here("calibrate", "--device", "cpu", "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    raw = json.loads(out.read_text())
    assert raw["schema_version"] == C.SCHEMA_VERSION == 2
    kernel = raw["kernels"]["cpu"]
    assert kernel["timing"] == {"fwd": "cpu-clock", "bwd": "cpu-clock"}
    assert all(kernel["host_ms"][m] > 0 for m in C.MODES)
    assert all(raw["overheads"][k]["host_ms"] > 0 for k in ("merge", "add", "copy"))
    # A Ulysses rank's head shape (half the heads) is measured on causal squares alone.
    ranks = [s for s in kernel["surfaces"] if (s["heads"], s["kv_heads"]) == (2, 1)]
    assert sorted((s["mode"], s["mask"]) for s in ranks) == [("bwd", "causal"), ("fwd", "causal")]
    cal = C.load(out)
    assert not cal.host_inclusive and cal.issue_ms("kernel", "cpu", "bwd") == kernel["host_ms"]["bwd"]
    res = ringbench_here("predict", "--calibration", str(out), "--gpu", str(out), "--variant", "zigzag",
                         "--world-size", "2", "--seqlen", "1024", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
                         "--dtype", "fp32", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout.splitlines()[0])
    assert rec["time_ms"] > 0 and rec["cuda_graph"] is False


@pytest.mark.gpu
def test_calibrate_times_the_gpu_free_of_the_host():
    """On CUDA a small point's GPU time (a graph of calls replayed) is well below one call between
    two events, which is the host's launch cost for a block of microseconds of work."""
    import torch

    from ringbench.model import calibrate
    from ringbench.rank.bench import time_iterations
    from ringbench.variants.kernels import resolve_kernel

    dev = torch.device("cuda")
    grid = calibrate.Grid(sizes=(256,), windows=(), shapes=((32, 8, 128, 128),), dtype="bf16", iters=5, warmup=2)
    raw = calibrate.measure(device="cuda", kernels=["torch-flash"], grid=grid)
    kernel = raw["kernels"]["torch-flash"]
    assert kernel["timing"]["fwd"] == "graph" and kernel["host_ms"]["fwd"] > 0
    point = next(s for s in kernel["surfaces"] if s["mode"] == "fwd" and s["mask"] == "full")["points"][0]
    k = resolve_kernel("torch-flash", "cuda", dtype=torch.bfloat16, head_dim=128, head_dim_v=128)
    q = torch.randn(1, 256, 32, 128, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, 256, 8, 128, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        one_call = sorted(time_iterations(lambda: k.forward(q, kv, kv, False, 128 ** -0.5), iters=10, warmup=3,
                                          device=dev))[5]
    assert point["time_ms"] < 0.5 * one_call
    assert C.from_dict(raw, "gpu").issue_ms("kernel", "torch-flash", "fwd") == kernel["host_ms"]["fwd"]


# --------------------------------------------------------------------------- advise and --against output (issue 24)

def test_against_prints_every_time_at_four_significant_digits_and_every_error_at_one_decimal():
    """A measured 7.1764 ms once printed as 7.1764 beside 101.2 and 29.14: one column, mixed precision.
    Every time now has four significant digits (as the validation page writes them), every error one decimal."""
    import re

    from rich.console import Console

    from ringbench.model.against import Bound, summary
    from ringbench.present.predict import print_against

    pairs = [(7.1764, 7.7982), (101.23, 104.44), (29.144, 30.702), (1.57531, 6.18962), (0.123456, 0.130004)]
    rows = [{"label": f"case {i}", "measured_ms": m, "predicted_ms": p, "error": p / m - 1}
            for i, (m, p) in enumerate(pairs)]
    console = Console(record=True, width=200)
    print_against(rows, {**summary(rows, Bound(0.08)), "left_out": None}, console)
    lines = [line.split() for line in console.export_text().splitlines() if re.match(r"case \d ", line)]
    assert len(lines) == len(pairs)
    for _, _, measured, predicted, error in lines:
        for ms in (measured, predicted):
            assert len(ms.replace(".", "").lstrip("0")) == 4, (ms, lines)
        assert re.fullmatch(r"[+-]\d+\.\d%", error), (error, lines)


def _advise(tmp_path, *args):
    cal = _write(tmp_path / "cal.json", json.dumps(_flat_calibration()))
    return ringbench_here("advise", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32",
                          "--seqlen", "1k", "--mode", "fwd", "--calibration", str(cal), *args, cwd=tmp_path)


def test_advise_takes_world_size_as_predict_does(tmp_path):
    """--world-size 4 is one node of four GPUs (the default node holds 8): every candidate and its
    commands are at world size 4, and usp factorizes 4, not 8."""
    res = _advise(tmp_path, "--world-size", "4", "--json")
    assert res.returncode == 0, res.stderr
    entries = [json.loads(line) for line in res.stdout.splitlines()]
    ranked = [e for e in entries if e["rank"]]
    assert {"usp U=2, cpu", "zigzag, cpu"} <= {e["candidate"] for e in ranked}
    assert not any("U=8" in e["candidate"] for e in entries)
    for e in ranked:
        assert e["prediction"]["spec"]["world_size"] == 4
        assert " --world-size 4 " in e["commands"]["verify"] and " --world-size 4 " in e["commands"]["run"]


@pytest.mark.parametrize("args,words", [
    (("--world-size", "16", "--nodes", "4"), "world_size 16 disagrees with nodes 4 x gpus_per_node 8 = 32"),
    (("--world-size", "12", "--gpus-per-node", "8"), "world_size 12 is more than one node of 8 GPUs"),
    (("--world-size", "0"), "world_size 0 must be positive"),
    # Both wrong: --nodes first, since the multiple's fix (9) would still disagree with 2 x 3.
    (("--world-size", "8", "--gpus-per-node", "3", "--nodes", "2"),
     "world_size 8 disagrees with nodes 2 x gpus_per_node 3 = 6; pass one of --world-size and --nodes"),
], ids=["against-nodes", "not-whole-nodes", "zero", "against-nodes-first"])
def test_advise_refuses_a_world_size_the_cluster_contradicts_in_one_sentence(tmp_path, args, words):
    res = _advise(tmp_path, *args)
    assert res.returncode == 2, res.stderr
    message = " ".join(res.stderr.split())
    assert words in message and message.count(". ") == 0 and "Traceback" not in res.stderr, message


def _candidate(variant: str, ms: float, spread: float = 0.05, efficiency: float = 0.9):
    """A fitting candidate predicted at ``ms`` (interval ``ms`` -/+ ``spread``), compute-bound."""
    from ringbench.model.advise import Candidate

    record = {"time_ms": ms, "tflops_per_gpu": 500.0, "efficiency": efficiency, "peak_allocated_gib": 1.0,
              "prediction": {"interval": {"time_ms": [ms * (1 - spread), ms * (1 + spread)]},
                             "critical_path_ms": {"compute": ms, "overhead": 0.0, "comm": 0.0, "wait": 0.0},
                             "busy_max_over_mean": 1.0}}
    return Candidate({"variant": variant, "kernel": "cpu"}, record=record,
                     commands={"verify": f"ringbench verify --variant {variant}",
                               "run": f"ringbench run --variant {variant}"})


def _advice_text(ranked, top=5) -> str:
    from rich.console import Console

    from ringbench.present.predict import print_advice

    console = Console(record=True, width=300)
    print_advice(ranked, console, top=top, cluster="test cluster", calibration="test")
    return console.export_text()


def test_advise_calls_candidates_within_the_models_error_tied_and_names_no_winner():
    """#2 1.1% behind #1 (and #3 3% behind) lie inside each other's intervals: tied with the best in
    --json and marked in the table; the summary names no single winner and points at the commands
    that decide. #4, 30% behind, is not tied."""
    from ringbench.model import advise as adv

    cands = [_candidate("zigzag", 100.0), _candidate("stripe", 101.1), _candidate("llama3", 103.0),
             _candidate("ring", 130.0)]
    ranked = adv.rank(cands)
    entries = [adv.entry(c, i) for i, c in enumerate(ranked, 1)]
    assert [e["tied_with_best"] for e in entries] == [True, True, True, False]
    assert all(e["interval_ms"][0] < e["prediction"]["time_ms"] < e["interval_ms"][1] for e in entries)
    text = _advice_text(ranked)
    rows = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0][0].isdigit()]
    assert rows[:4] == ["1=", "2=", "3=", "4"], text
    assert "No single winner: #1 to #3 are tied within the model's error" in " ".join(text.split())
    assert "Fastest" not in text and "fastest beyond" not in text
    for c in ranked:  # what decides: each one's verify and run commands
        assert c.commands["verify"] in text and c.commands["run"] in text


def test_advise_names_a_winner_only_beyond_the_models_error():
    from ringbench.model import advise as adv

    from ringbench.model.predict import model_error

    behind = 100.0 * (1 + model_error()) / (1 - model_error()) * 1.01  # just past both widened intervals
    ranked = adv.rank([_candidate("zigzag", 100.0, spread=0.0), _candidate("ring", behind, spread=0.0)])
    assert [c.tied for c in ranked] == [False, False]
    text = " ".join(_advice_text(ranked).split())
    assert "Fastest: zigzag, cpu, ahead of every other beyond the model's error" in text
    assert "No single winner" not in text and "1=" not in text


def test_an_efficiency_above_one_is_marked_and_explained():
    """advise printed 1.03 with no word why: the mark and the footnote say the reference is a
    causal block and a ring rank runs full ones; below 1 there is neither."""
    above = _advice_text([_candidate("zigzag", 100.0, efficiency=1.034)])
    assert "1.034*" in above and "efficiency above 1: the reference is the same kernel" in " ".join(above.split())
    below = _advice_text([_candidate("zigzag", 100.0, efficiency=0.97)])
    assert "0.970" in below and "*" not in below and "efficiency above 1" not in below


def test_advise_prints_each_shown_candidates_verify_command(tmp_path):
    res = _advise(tmp_path, "--world-size", "4", "--top", "3")
    assert res.returncode == 0, res.stderr
    verify = [line for line in res.stdout.splitlines() if line.strip().startswith("ringbench verify ")]
    assert len(verify) == 3 and len(set(verify)) == 3, res.stdout


def test_advise_asks_git_once_and_predicts_with_the_collector_paused(tmp_path, monkeypatch):
    """advise's speed (issue 24: under 10 s for 64 GPUs on a loaded 2-core CPU): git ran twice per
    record, and the garbage collector's passes over the programs took half the time; neither
    changes a figure."""
    import gc

    from ringbench.model import advise as adv
    from ringbench.records import envinfo

    asked, collecting = [], []
    monkeypatch.setattr(envinfo, "git_commit", lambda: asked.append(1) or "abc")
    predict = adv.predict_case

    def watched(*args, **kw):
        collecting.append(gc.isenabled())
        return predict(*args, **kw)

    monkeypatch.setattr(adv, "predict_case", watched)
    res = _advise(tmp_path, "--world-size", "4", "--json")
    assert res.returncode == 0, res.stderr
    entries = [json.loads(line) for line in res.stdout.splitlines() if json.loads(line)["prediction"]]
    assert len(entries) > 2 and {e["prediction"]["env"]["git_commit"] for e in entries} == {"abc"}
    assert len(asked) == 1
    assert collecting and not any(collecting) and gc.isenabled()


def test_advise_holds_one_cases_programs_at_a_time(tmp_path, monkeypatch):
    """advise at 1024 GPUs kept every case's walked programs (about 4 GB each) to the end and peaked at
    16.8 GB; it keeps one case's while its kernels and placements are priced, and walks each case once."""
    from ringbench.model import advise as adv

    walked, held = [], []
    programs, predict = adv.schedule.programs, adv.predict_case

    def walk(spec, *args, **kw):
        walked.append(spec.replace(kernel="auto"))
        return programs(spec, *args, **kw)

    def watched(*args, cache=None, **kw):
        held.append(sum(1 for key in cache if key[0] == "segments"))
        return predict(*args, cache=cache, **kw)

    monkeypatch.setattr(adv.schedule, "programs", walk)
    monkeypatch.setattr(adv, "predict_case", watched)
    res = _advise(tmp_path, "--world-size", "4", "--json", "--both-placements")
    assert res.returncode == 0, res.stderr
    assert len(walked) > 3 and len(walked) == len(set(walked))
    assert held and max(held) <= 1


def test_the_models_error_is_its_devices_measured_median_never_below_its_bound(tmp_path, monkeypatch):
    """advise widens by what validation measured on the calibration's own device (or on the device a
    derived calibration comes from, saying so), not by the 3% it is held to, nor by another card's check;
    a missing or smaller measurement falls back to the bound, and predict's note gives the numbers."""
    from ringbench.model import predict as pr

    def cal(device, derived_from=None):
        return C.from_dict({**_flat_calibration(), "device": device, "device_type": "cuda"}, "test") if not \
            derived_from else C.derive(cal(derived_from), device, rate_scale=1.0, memory_scale=1.0)

    a, b = cal("GPU A"), cal("GPU B")
    monkeypatch.setattr(pr, "VALIDATED", tmp_path / "validated.json")
    assert pr.model_error(a) == pr.MEDIAN_BOUND and pr.validated_error(a).startswith("not validated on GPU A")
    check = {"check": "a", "median_bound": 0.03, "worst_bound": 0.08}
    (tmp_path / "validated.json").write_text(json.dumps({"checks": [
        {**check, "device": "GPU A", "median_error": 0.08, "worst_error": 2.9, "records": 42, "passed": False},
        {**check, "device": "GPU B", "median_error": 0.01, "worst_error": 0.05, "records": 40, "passed": True}]}))
    assert pr.model_error(a) == 0.08 and pr.model_error(b) == pr.MEDIAN_BOUND
    assert "on GPU A finds a median error of 8.0% and a worst of 290.0% over 42" in pr.validated_error(a)
    assert pr.validated_error(b).startswith("within its bounds")
    derived = cal("GPU C", derived_from="GPU B")
    assert pr.model_error(derived) == pr.MEDIAN_BOUND
    assert "(this calibration is derived from it, and not checked itself)" in pr.validated_error(derived)
    assert pr.validated_error(derived).startswith("not yet within its bounds")
    assert pr.model_error() == 0.08  # no calibration: the largest of every check's


def test_advise_refuses_a_top_below_one_and_exits_2_when_every_candidate_is_refused(tmp_path):
    """--top 0 printed an empty table and --top -1 a Python slice, both with exit 0; a seqlen that
    every candidate refuses ranked nothing and still exited 0."""
    for top in ("0", "-1"):
        res = _advise(tmp_path, "--world-size", "4", "--top", top)
        assert res.returncode == 2, res.stdout
        assert res.stderr.strip() == (f"top {top} must be 1 or more: it is how many ranked candidates the table "
                                      "shows; pass --top 5, say")
    res = _advise(tmp_path, "--world-size", "3")  # 1k tokens: no multiple of 3 (nor of 6) to cut
    assert res.returncode == 2, res.stdout
    *refusals, verdict = res.stderr.strip().splitlines()
    assert verdict.startswith("every one of the ") and "so nothing was ranked" in verdict
    # A refusal: no table, no verdict on memory, only the refusals (one line per reason) and the verdict.
    assert res.stdout == "" and refusals and all(line.startswith("refused: ") for line in refusals), res.stderr
    # --json: the refused candidates on stdout, as its help says, and the verdict alone on stderr.
    res = _advise(tmp_path, "--world-size", "3", "--json")
    entries = [json.loads(line) for line in res.stdout.splitlines()]
    assert res.returncode == 2 and len(entries) >= len(refusals) and all(e["refused"] for e in entries), res.stdout
    assert res.stderr.strip().startswith("every one of the ") and res.stderr.strip().endswith("refusals on stdout name")


def test_advise_offers_no_layout_that_needs_a_mask_it_cannot_take():
    """advise takes no --mask, so ring's mask-balancing layout is no candidate (it was listed as refused,
    with a fix naming --mask, which advise does not take); llama3_varlen's balanced layout of documents stays."""
    from ringbench.model import advise as adv

    shape = {"heads": 8, "kv_heads": 2, "head_dim": 64, "seqlen": 8192}
    batch = adv.candidates(shape, world_size=4, nodes=1, kernels=["torch-flash"])
    assert not [c for c in batch if c.fields.get("layout") == "balanced"]
    varlen = adv.candidates({**shape, "docs": "4096,4096"}, world_size=4, nodes=1, kernels=["torch-flash"])
    assert [c for c in varlen if c.fields["variant"] == "llama3_varlen" and c.fields.get("layout") == "balanced"]


def test_a_causal_call_of_few_heads_is_priced_at_its_own_rows():
    """A Ulysses rank's causal call over the whole sequence with an eighth of the calibrated heads costs
    about an eighth of the call with them all (thread blocks as long as theirs), not the price of a
    square of an eighth of the rows at every head (short rows, far slower: 85% off on the H200)."""
    from ringbench.model import calibration as cal_mod
    from ringbench.model.calibration import Call, Shape

    cal = cal_mod.load(Path(cal_mod.__file__).parent / "calibrations" / "h200.json")
    S = 16384
    def ms(heads, kv_heads):
        shape = Shape(1, heads, kv_heads, 128, 128, "bf16")
        return sum(cal.kernel_ms("flash-attn-4", Call(mode, "causal", S, S, S * (S + 1) / 2), shape)
                   for mode in ("fwd", "bwd"))
    whole, eighth = ms(32, 8), ms(4, 1)
    assert whole / 8 <= eighth <= 1.25 * whole / 8, (whole, eighth)


def test_a_causal_call_of_few_heads_takes_a_measured_surface_of_its_own_heads():
    """Where calibrate measured causal squares at a Ulysses rank's heads (Grid.rank_shapes), a causal call of
    those heads is priced from them exactly, ahead of the occupancy rule; full calls, which have no such
    surface, keep the whole shape's surface at scaled rows."""
    from helpers import flat_calibration

    whole, few = C.Shape(1, 32, 8, 128, 128, "bf16"), C.Shape(1, 4, 1, 128, 128, "bf16")
    raw = flat_calibration(100e12, whole)
    fast = flat_calibration(150e12, few)["kernels"]["cpu"]["surfaces"]
    raw["kernels"]["cpu"]["surfaces"] += [s for s in fast if s["mask"] == "causal"]
    cal = C.from_dict(raw, "test")
    for mode in C.MODES:
        causal = C.Call(mode, "causal", 256, 256, 256 * 257 / 2)
        assert cal.kernel_ms("cpu", causal, few) == pytest.approx(C.call_flops(causal, few) / 150e12 * 1e3)
        assert cal.kernel_ms("cpu", causal, whole) == pytest.approx(C.call_flops(causal, whole) / 100e12 * 1e3)
        full = C.Call(mode, "full", 256, 256, 256 * 256)
        assert cal.kernel_ms("cpu", full, few) == pytest.approx(C.call_flops(full, few) / 100e12 * 1e3)


def test_a_causal_call_of_few_heads_past_its_squares_takes_the_whole_shapes_rate():
    """Past the largest square of a few-heads causal surface, whose rate rose between its last squares as
    it filled the GPU, a call is priced by the surface of the most heads of the same GQA ratio (its rise
    the diagonal's alone), not by the few-heads rise carried on (a Ulysses rank at 64k on the H100 was
    priced 22% fast so). Up to that square the few-heads surface still prices it."""
    from helpers import flat_calibration

    whole, few = C.Shape(1, 32, 8, 128, 128, "bf16"), C.Shape(1, 4, 1, 128, 128, "bf16")
    raw = flat_calibration(100e12, whole)
    rising = flat_calibration(150e12, few)["kernels"]["cpu"]["surfaces"]
    for surface in rising:  # half the rate below the largest square: a steep rise into it
        for point in surface["points"]:
            if point["q"] < 512:
                point.update({key: 2 * point[key] for key in ("time_ms", "lo_ms", "hi_ms")})
    raw["kernels"]["cpu"]["surfaces"] += [s for s in rising if s["mask"] == "causal"]
    cal = C.from_dict(raw, "test")
    for mode in C.MODES:
        inside, past = (C.Call(mode, "causal", s, s, s * (s + 1) / 2) for s in (512, 4096))
        assert cal.kernel_ms("cpu", inside, few) == pytest.approx(C.call_flops(inside, few) / 150e12 * 1e3)
        assert cal.kernel_ms("cpu", past, few) == pytest.approx(C.call_flops(past, few) / 100e12 * 1e3)


def test_a_window_call_open_to_every_key_left_of_the_diagonal_is_priced_as_causal():
    """A window call whose band reaches every key (a prefix mask's causal rows after the prompt: q <= k,
    window >= k) is a causal call to the kernel and takes the causal rate; a narrow window keeps the
    window surface's. (Priced at the widest measured band, W=1 prefix:8k at 64k came out 8% slow.)"""
    from helpers import flat_calibration

    shape = C.Shape(1, 32, 8, 128, 128, "bf16")
    raw = flat_calibration(100e12, shape)
    for mode in C.MODES:
        points = []
        for q in (64, 128, 256, 512):
            for w in (32, 64, 128):
                t = C.call_flops(C.Call(mode, "window", q, q, C.point_pairs("window", q, q, w)), shape) / 50e12 * 1e3
                points.append({"q": q, "k": q, "window": w, "time_ms": t, "lo_ms": t, "hi_ms": t})
        raw["kernels"]["cpu"]["surfaces"].append(C.surface_dict(mode, "window", shape, points))
    cal = C.from_dict(raw, "test")
    q, k = 384, 512
    for mode in C.MODES:
        open_band = C.Call(mode, "window", q, k, q * (k - q) + q * (q + 1) / 2, window=k)
        assert cal.kernel_ms("cpu", open_band, shape) == pytest.approx(
            C.call_flops(open_band, shape) / 100e12 * 1e3, rel=1e-9)
        narrow = C.Call(mode, "window", 256, 256, C.point_pairs("window", 256, 256, 64), window=64)
        assert cal.kernel_ms("cpu", narrow, shape) == pytest.approx(C.call_flops(narrow, shape) / 50e12 * 1e3)


def test_a_causal_document_of_a_varlen_call_pays_its_own_diagonal():
    """In one varlen call the call's rows set how full the GPU is, and each causal document pays the causal
    square's share of the full rate at its own rows: short documents, whose diagonal tiles are a larger
    share, cost more per FLOP than one long one (zigzag_varlen's 512-row pieces came out 10-19% fast)."""
    from helpers import flat_calibration

    shape = C.Shape(1, 32, 8, 128, 128, "bf16")
    raw = flat_calibration(100e12, shape)
    for surface in raw["kernels"]["cpu"]["surfaces"]:  # causal squares up to 64 rows at half the full rate
        if surface["mask"] == "causal":
            for point in surface["points"]:
                if point["q"] <= 64:
                    point.update({key: 2 * point[key] for key in ("time_ms", "lo_ms", "hi_ms")})
    cal = C.from_dict(raw, "test")
    for mode in C.MODES:
        short = C.Call(mode, "causal", 512, 512, 8 * 64 * 65 / 2, docs=tuple((64, 64, 64 * 65 / 2) for _ in range(8)))
        long = C.Call(mode, "causal", 512, 512, 512 * 513 / 2, docs=((512, 512, 512 * 513 / 2),))
        assert cal.kernel_ms("cpu", short, shape) == pytest.approx(C.call_flops(short, shape) / 50e12 * 1e3)
        assert cal.kernel_ms("cpu", long, shape) == pytest.approx(C.call_flops(long, shape) / 100e12 * 1e3)


def test_a_causal_rate_past_the_largest_square_follows_the_diagonal_law():
    """calibration._causal_beyond: a rate that rose between the two largest causal squares goes on
    rising past them as r_inf (1 - c / s), never above r_inf; one that fell stays flat."""
    from ringbench.model.calibration import _causal_beyond

    # r(s) = 600 (1 - 1024 / s): 562.5 at 16k, 581.25 at 32k, 590.6 at 64k.
    r1, r2 = 600 * (1 - 1024 / 16384), 600 * (1 - 1024 / 32768)
    assert _causal_beyond(16384, r1, 32768, r2, 65536) == pytest.approx(600 * (1 - 1024 / 65536))
    assert r2 < _causal_beyond(16384, r1, 32768, r2, 1 << 20) < 600
    assert _causal_beyond(16384, 613.0, 32768, 600.0, 65536) == 600.0


def test_merges_beside_the_kernels_save_all_but_their_stolen_share():
    """variants/engines/overlap.py: on CUDA each forward merge runs on a side stream beside the next
    kernel. A compute-bound zigzag rank at W=4 (the diagonal, then three half blocks, a merge after
    each) then costs the compute stream SIDE_SHARE of each merge, and the last one in full (the
    join waits for it): in line minus (1 - SIDE_SHARE) times every merge but the last."""
    from ringbench.model.simulate import SIDE_SHARE

    cal = C.from_dict(_flat_calibration(), "test")
    spec, cluster = _spec("zigzag", 4, 1024), _cluster(4, 1e6)
    progs, _ = schedule.programs(spec, side=False)
    merges = [cal.overhead_ms("merge", op.nbytes) for op, _ in progs[0]
              if isinstance(op, schedule.Compute) and op.kind == "merge"]
    assert len(merges) == 3
    in_line = predict_case(spec, calibration=cal, kernel="cpu", cluster=cluster, side=False)
    beside = predict_case(spec, calibration=cal, kernel="cpu", cluster=cluster, side=True)
    saved = in_line["per_rank_time_ms"][0] - beside["per_rank_time_ms"][0]
    assert saved == pytest.approx((1 - SIDE_SHARE) * sum(merges[:-1]), rel=1e-6)
    assert schedule.programs(spec)[0] == progs  # a cpu case merges in line


def test_a_prediction_says_where_its_calls_are_past_the_calibrated_blocks():
    """Calls with more rows than the calibration measured are priced by extrapolation, and the prediction
    says so in a note naming both sizes; a case inside the measured blocks has no such note."""
    cal = C.from_dict(_flat_calibration(), "test")  # blocks of 8 to 512 rows

    def notes(seqlen: int) -> list[str]:
        fields = predict_case(_spec("zigzag", 2, seqlen), calibration=cal, kernel="cpu", cluster=_cluster(2, 1e6))
        return [n for n in fields["prediction"]["notes"] if "past the calibration's largest block" in n]

    assert notes(512) == []
    assert notes(4096) == ["calls of up to 2048 rows are past the calibration's largest block (512 rows): a causal "
                           "call's rate there follows the diagonal's law through the two largest squares, any other "
                           "takes the largest block's rate"]


def test_a_cpu_calibration_says_its_link_is_assumed(tmp_path):
    """A cpu calibration has no fabric row of its own, so the default NVLink row it is priced with is titled
    as assumed, with the option that names a link; a GPU of the table keeps its own row's title."""
    from ringbench.model.target import target

    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(_flat_calibration()), encoding="utf-8")
    cpu = target(gpu=None, calibrations=[path], cluster_file=None, gpus_per_node=4, nodes=None, fabric=None,
                 dtype="fp32")
    assert cpu.cluster(4).describe().endswith("(NVLink 4 (H100 and H200 SXM), assumed: no intra-node link is known "
                                              "for cpu; pass --fabric INTRA)")
    # Two nodes of PCIe cards: PCIe inside a node, their network assumed, and said to be the network.
    l4 = target(gpu="L4", calibrations=[], cluster_file=None, gpus_per_node=8, nodes=2, fabric=None, dtype="bf16")
    assert l4.cluster(16).describe() == ("2 x 8 L4 (PCIe 4.0 x16; between nodes InfiniBand NDR (400 Gb/s per GPU), "
                                         "assumed: no inter-node link is known for L4; pass --fabric INTRA,INTER)")
    gpu = target(gpu="H100", calibrations=[], cluster_file=None, gpus_per_node=8, nodes=None, fabric=None,
                 dtype="bf16")
    assert "assumed" not in gpu.cluster(8).describe()


def test_an_emulated_rank_pays_the_copies_that_stand_for_its_collectives():
    """run --emulate makes a rank's collectives device copies on its compute stream: an all-gather copies every
    member's shard (read and written), a reduce-scatter its own shard, and an all-to-all is one cat in place of
    the packing copy, the exchange and the joining copy (one of the two copies around it comes off); the ring's
    point-to-point copies run on a side stream and add nothing."""
    from ringbench.model.predict import emulated_copies_ms

    raw = _flat_calibration()
    raw["overheads"]["copy"] = {"fixed_ms": 0.01, "gib_s": 1.0, "host_ms": 0.0}
    cal = C.from_dict(raw, "test")
    gib = 2 ** 30
    group = (0, 1, 2, 3)
    program = [(schedule.Post("g", "all_gather", "fwd", 0, gib / 8, group), None),
               (schedule.Post("r", "reduce_scatter", "bwd", 0, gib / 4, group), None),
               (schedule.Post("a", "all_to_all", "fwd", 0, gib / 2, group), None),
               (schedule.Post("p", "p2p", "fwd", 0, gib, group, 1, 3), None)]
    # 0.01 ms + 1 s per GiB moved: 2 x 4 x 1/8, 2 x 1/4, and minus 2 x 1/2 GiB.
    assert emulated_copies_ms(program, cal) == pytest.approx((0.01 + 1e3) + (0.01 + 500) - (0.01 + 1e3))


@pytest.mark.parametrize("args, says", [
    # No bf16 peak, but --dtype fp16 is no fix: no calibrated kernel runs on sm70.
    (("--gpu", "V100"), "gpu V100 (sm70) runs none of the calibration's kernels (flash-attn-4 needs NVIDIA sm90 or "
                        "newer, torch-flash needs NVIDIA sm80 or newer, cudnn needs NVIDIA sm80 or newer); pass --gpu "
                        "with a GPU that runs one, or a calibration measured on it (ringbench calibrate there, then "
                        "--calibration FILE)"),
    (("--gpu", "H100", "--dtype", "fp64"), "dtype fp64 is not supported by the flash-attn-4 kernel, which takes bf16 "
                                           "and fp16; pass --dtype bf16"),
    # No calibrated kernel takes it: no --kernel is offered (math would be, and is not in the calibration).
    (("--gpu", "H100", "--head-dim", "512"), "head_dim 512 exceeds 256, the largest the flash-attn-4 kernel takes; "
                                             "pass another --head-dim"),
    (("--gpu", "H100", "--head-dim", "100", "--kernel", "torch-flash"),
     "head_dim 100 is not a multiple of 8, which the torch-flash kernel needs; pass another --head-dim"),
    (("--gpu", "H100", "--head-dim-v", "64", "--kernel", "torch-flash"),
     "head_dim_v 64 differs from head_dim 128, which the torch-flash kernel cannot take (it needs one head dim for q, "
     "k and v); pass another --head-dim-v, or --kernel flash-attn-4"),
    # Another device than the calibration's: how to make a calibration of it.
    (("--gpu", "H100", "--device", "cpu"), "device 'cpu' is not the calibration's (cuda, measured 2026-12-07 by "
                                           "ringbench calibrate on NVIDIA H100 80GB HBM3); drop --device, or pass a "
                                           "calibration of that device (ringbench calibrate --device cpu --out FILE "
                                           "there, then --calibration FILE)"),
    # An uncalibrated kernel on a GPU that runs only some of the calibrated ones: offer only those.
    (("--gpu", "L4", "--kernel", "cudnn"), "kernel 'cudnn' is not in the calibration of L4, which holds torch-flash "
                                           "(those L4 runs); pass --kernel with one of them, or calibrate cudnn with "
                                           "ringbench calibrate --kernel cudnn"),
    # A kernel of another device: the calibration's rule, whose fix offers only what it can price (the case
    # rule offered every CUDA kernel, most of them then refused as not calibrated).
    (("--gpu", "H100", "--kernel", "cpu"), "kernel 'cpu' is not in the calibration of NVIDIA H100 80GB HBM3, which "
                                           "holds flash-attn-4, torch-flash; pass --kernel with one of them"),
])
def test_predict_refuses_what_no_calibrated_kernel_or_peak_takes(tmp_path, args, says):
    """A GPU with no peak in the case's dtype (V100 in bf16) was a traceback; --kernel auto priced fp64 or a
    512-wide head on flash-attn-4, which refuses both when named. Each is now one sentence, exit 2."""
    res = ringbench_here("predict", "--variant", "zigzag", "--world-size", "8", "--seqlen", "64k", *args, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip() == says


@pytest.mark.parametrize("peer, ours", [("rfa_ring", "ring"), ("rfa_stripe", "stripe"), ("yc_ulysses", "ulysses"),
                                        ("yc_usp", "usp"), ("yc_ring", "zigzag"), ("torch_cp", "zigzag"),
                                        ("rfa_llama3_varlen", "llama3_varlen")])
def test_a_peers_refusal_names_the_ringbench_variant_to_predict_instead(peer, ours):
    """The refusal named a layout as if it were a variant ("ringbench's contiguous variant"); it names the
    ringbench variant of the peer's own name and layout, or else of its layout, form and Ulysses use."""
    extra = {"docs": "512,512"} if peer.endswith("varlen") else {}
    reason = schedule.refusal(_spec(peer, 2, 1024, **extra))
    assert reason.endswith(f"predict ringbench's {ours} instead, of the same layout"), reason


def test_predict_and_advise_refuse_more_ranks_than_the_model_walks(tmp_path):
    """4096 ranks ran for minutes and were killed for memory at 23 GB (the walk grows with the square of
    the ranks): above MAX_RANKS both commands refuse in one sentence, exit 2, before walking anything."""
    from ringbench.model.target import MAX_RANKS

    for command in (("predict", "--variant", "ring"), ("advise", "--preset", "llama3-70b")):
        res = ringbench_here(*command, "--gpu", "H100", "--nodes", str(2 * MAX_RANKS // 8), "--seqlen", "16M",
                             cwd=tmp_path)
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stderr.strip().startswith(f"world_size {2 * MAX_RANKS} is above {MAX_RANKS}, the most ranks the "
                                             "model walks"), res.stderr


# --------------------------------------------------------------------------- kernels a GPU cannot run

@pytest.mark.parametrize("kernel, runs, refused", [
    ("flash-attn-4", ("sm90", "sm100", "sm120"), ("sm89", "sm80", "sm70", "gfx942")),
    ("flash-attn", ("sm80", "sm89", "sm90"), ("sm75", "sm70", "gfx90a")),
    ("torch-flash", ("sm80", "sm86", "sm100"), ("sm75", "gfx942")),
    ("cudnn", ("sm80", "sm90"), ("sm70", "gfx942")),
    ("math", ("sm70", "gfx942"), ()),
])
def test_kernel_architecture_rule_runs_on_its_archs_only(kernel, runs, refused):
    from ringbench.variants.kernels import KERNELS

    for arch in runs:
        assert KERNELS[kernel].check_arch(arch) is None, (kernel, arch)
    for arch in refused:
        reason = KERNELS[kernel].check_arch(arch, "gpu X")
        assert reason.startswith(f"gpu X ({arch}) cannot run the {kernel} kernel, which runs on NVIDIA GPUs of "
                                 "sm"), reason


def test_every_gpu_of_the_peaks_table_has_an_architecture():
    import re

    from ringbench.rank.peaks import DATASHEETS

    assert DATASHEETS
    for sheet in DATASHEETS:
        assert re.fullmatch(r"sm\d{2,3}|gfx9\w+", sheet.arch), sheet


@pytest.mark.parametrize("gpu, says", [
    ("A100", "gpu A100 (sm80) cannot run the flash-attn-4 kernel, which runs on NVIDIA GPUs of sm90 or newer only"),
    ("L4", "gpu L4 (sm89) cannot run the flash-attn-4 kernel, which runs on NVIDIA GPUs of sm90 or newer only"),
    ("MI300X", "gpu MI300X (gfx942) cannot run the flash-attn-4 kernel"),
])
def test_predict_refuses_a_named_kernel_the_gpu_cannot_run(tmp_path, gpu, says):
    """--gpu A100 --kernel flash-attn-4 priced FlashAttention-4 from the H100's calibration scaled by peak
    ratio, though it runs on Hopper and Blackwell only: one sentence, exit 2."""
    res = ringbench_here("predict", "--variant", "zigzag", "--world-size", "8", "--seqlen", "16k", "--gpu", gpu,
                         "--kernel", "flash-attn-4", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    message = " ".join(res.stderr.split())
    assert message.startswith(says) and message.count(". ") == 0 and "Traceback" not in res.stderr, message
    assert message.endswith("pass --kernel with one of torch-flash or auto" if gpu != "MI300X"
                            else "pass another --gpu"), message


def test_predict_auto_takes_the_first_calibrated_kernel_the_gpu_runs(tmp_path):
    res = ringbench_here("predict", "--variant", "zigzag", "--world-size", "8", "--seqlen", "16k", "--gpu", "A100",
                         "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (rec,) = [json.loads(line) for line in res.stdout.splitlines()]
    assert rec["kernel"] == "torch-flash"
    res = ringbench_here("predict", "--variant", "zigzag", "--world-size", "8", "--seqlen", "16k", "--gpu", "MI300X",
                         cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().startswith("gpu MI300X (gfx942) runs none of the calibration's kernels (flash-attn-4 "
                                         "needs NVIDIA sm90 or newer, torch-flash needs NVIDIA sm80 or newer)")


def test_advise_lists_a_kernel_the_gpu_cannot_run_as_refused(tmp_path):
    res = ringbench_here("advise", "--preset", "llama3-8b", "--seqlen", "16k", "--gpu", "A100", "--world-size", "8",
                         "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    entries = [json.loads(line) for line in res.stdout.splitlines()]
    fa4 = [e for e in entries if e["fields"]["kernel"] == "flash-attn-4"]
    assert fa4 and all(e["refused"].startswith("gpu A100 (sm80) cannot run the flash-attn-4 kernel") for e in fa4)
    ranked = [e for e in entries if e["rank"]]
    assert ranked and {e["fields"]["kernel"] for e in ranked} == {"torch-flash"}


def test_against_says_how_to_calibrate_a_kernel_the_calibration_lacks(tmp_path):
    """A record measured with cudnn (in no shipped calibration) or on cpu said "pass --kernel", which
    --against refuses; it says the record cannot be checked against the calibration and how to calibrate
    its kernel."""
    ref = Path(__file__).resolve().parents[1] / "results/reference/2026-12-01-h200-fa4/runs-w1.jsonl"
    records = [json.loads(line) for line in ref.read_text(encoding="utf-8").splitlines()]
    cudnn = next(r for r in records if r.get("kernel") == "cudnn" and r["status"] == "ok")
    fa4 = next(r for r in records if r.get("kernel") == "flash-attn-4" and r["status"] == "ok")
    cpu = json.loads(json.dumps(cudnn))
    cpu["kernel"] = cpu["spec"]["kernel"] = "cpu"
    cpu["spec"].update(device="cpu", dtype="fp32", seqlen=4096)
    cpu["env"].update(gpu_name=None, gpu_count=0)
    path = _write(tmp_path / "runs.jsonl", "".join(json.dumps(r) + "\n" for r in (cudnn, cpu, fa4)))
    res = ringbench_here("predict", "--against", str(path), "--bound", "900%", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    reasons = [json.loads(line).get("reason") for line in res.stdout.splitlines()][:2]
    for reason, kernel in zip(reasons, ("cudnn", "cpu")):
        assert "pass --kernel" not in reason and "cannot be checked against" in reason, reason
        assert reason.endswith(f"with ringbench calibrate --kernel {kernel} and pass the file with "
                               "--calibration"), reason


def test_predict_help_says_what_device_world_size_and_cuda_graph_mean_in_a_prediction(tmp_path):
    """predict --help showed run's texts: --device "Run on cuda (NCCL...)", --world-size "Default: cuda every
    visible GPU, cpu 2" (predict's is gpus-per-node x nodes), --cuda-graph as if it ran anything; --seed, hidden
    though it draws --doc-dist's documents, is shown with what it does in a prediction."""
    def help_text(command):
        res = ringbench_here(command, "--help", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        return " ".join(" ".join(line.strip("│ ") for line in res.stdout.splitlines()).split())

    text = help_text("predict")
    assert "every visible GPU" not in text and "(NCCL, one GPU per rank)" not in text, text
    assert "--seed INT The seed that draws the documents of --doc-dist" in text, text  # not run's random inputs
    assert "The device type of the calibration that prices the case, cuda or cpu" in text, text
    assert "Repeat for several: one case per value; above 1024 ranks" in text and "gpus-per-node x nodes." in text
    assert "Price each iteration replayed as one CUDA graph" in text
    # --kernel auto is the first calibrated kernel, not "the first one available here"; a bias and --rotate
    # (torch_cp's) cannot be priced, so they are not offered; the mask text says which variants are refused.
    assert "--kernel NAME The kernel each case is priced with" in text and "available here" not in text, text
    assert "--bias" not in text and "--rotate" not in text, text
    from ringbench.model.schedule import MASK_PRICED

    priced = ", ".join(MASK_PRICED[:-1]) + f" and {MASK_PRICED[-1]}"
    assert "--mask NAME[:PARAMS] The mask each case is priced under" in text, text
    assert f"Priced on {priced}, as the window calls" in text and "a varlen variant under a mask is refused" in text
    run = help_text("run")  # run keeps its own texts
    assert "every visible GPU" in run and "--seed" in run and "(NCCL, one GPU per rank)" in run
    assert "--bias" in run and "--rotate" in run and "first one available here" in run
    for args, says in ((("--bias", "alibi"), "bias alibi is not priced by the model yet"),
                       (("--rotate", "alltoall"), "--rotate is how torch_cp (PyTorch's context parallel, a peer) "
                                                  "moves K/V, and predict prices ringbench's own engines only")):
        res = ringbench_here("predict", "--gpu", "H100", "--variant", "zigzag", "--seqlen", "8k", *args, cwd=tmp_path)
        assert res.returncode == 2 and says in res.stderr, res.stderr


@pytest.mark.parametrize("args, says", [
    (("calibrate", "--device", "cpu", "--out", "taken.json"),
     "--out 'taken.json' cannot be written (it is a folder); pass --out with a writable file path, such as "
     "results/calibration.json"),
    (("predict", "--variant", "zigzag", "--gpu", "H100", "--out", "taken.jsonl"),
     "--out 'taken.jsonl' cannot be written (it is a folder); pass --out with a writable file path, such as "
     "results/predicted.jsonl"),
    (("predict", "--variant", "zigzag", "--gpu", "missing.json"),
     "calibration 'missing.json' cannot be read (No such file or directory); pass --gpu with a GPU of the peaks "
     "table (H100, A100...) or a file ringbench calibrate wrote"),
    (("predict", "--variant", "zigzag", "--cluster", "binary.toml"),
     "cluster file 'binary.toml' cannot be read (it is not UTF-8 text); pass --cluster with a readable TOML file"),
    (("predict", "--variant", "zigzag", "--gpu", "binary.json"),
     "calibration 'binary.json' cannot be read (it is not UTF-8 text); pass --gpu with a GPU of the peaks table "
     "(H100, A100...) or a file ringbench calibrate wrote"),
    (("predict", "--against", "binary.json"),
     "against 'binary.json' cannot be read (it is not UTF-8 text); pass --against with a .jsonl file of run records"),
], ids=["calibrate-out", "predict-out", "gpu-file", "binary-cluster", "binary-gpu", "binary-against"])
def test_calibration_and_prediction_files_are_refused_with_their_own_fix(tmp_path, args, says):
    """calibrate --out offered compare.md as its example, and a --gpu file that was not there said
    "pass --calibration"; a binary file given for a text one came out as a UnicodeDecodeError traceback."""
    (tmp_path / "taken.json").mkdir()
    (tmp_path / "taken.jsonl").mkdir()
    for name in ("binary.toml", "binary.json"):
        (tmp_path / name).write_bytes(b"\x00\xff\xfe")
    res = ringbench_here(*args, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert " ".join(res.stderr.split()) == says


@pytest.mark.parametrize("change, says", [
    (lambda raw: raw["kernels"]["torch-flash"].update(
        surfaces=[s for s in raw["kernels"]["torch-flash"]["surfaces"] if s["mode"] != "bwd"]),
     "has no bwd surface for kernel torch-flash"),  # it was a traceback when priced, exit 1
    (lambda raw: raw.update(device_type="tpu"), "has device_type 'tpu', which is neither cuda nor cpu"),
    (lambda raw: raw["overheads"].update(launch_ms=-1), "has launch_ms -1, which must be a number of ms, 0 or more"),
])
def test_a_calibration_file_with_a_bad_device_type_or_launch_cost_is_refused_naming_the_file(change, says):
    """A device_type of tpu was refused as "device 'tpu' is unknown; pass --device", blaming an option the
    user had not given; a negative launch_ms was taken and priced every transfer below nothing."""
    import copy

    from importlib import resources

    raw = json.loads(resources.files("ringbench.model").joinpath("calibrations/h100.json").read_text(encoding="utf-8"))
    raw = copy.deepcopy(raw)
    change(raw)
    with pytest.raises(C.SpecError) as got:
        C.from_dict(raw, "'mine.json'")
    assert str(got.value) == f"calibration 'mine.json' {says}; write it again with ringbench calibrate"


@pytest.mark.parametrize("variant,degree", [("zigzag", 0), ("usp", 4), ("llama3", 0)])
def test_play_counts_each_ranks_bytes_and_calls_as_its_program_holds_them(variant, degree):
    """``simulate.play`` sums every rank's bytes per link class over the whole cluster at once, and
    ``price`` counts kernel calls from its table of distinct ops: each rank's figures, and the order
    of its classes (as it first met them), are those of its own program recounted transfer by transfer."""
    from ringbench.model import simulate

    W = 16
    spec = _spec(variant, W, 1024, mode="fwd_bwd", heads=8, kv_heads=4,
                 **({"ulysses_degree": degree} if degree else {}))
    progs, _ = schedule.programs(spec)
    intra = Link("in", "in", "intra-node", 100.0, 0.0, (), "test")
    inter = Link("out", "out", "inter-node", 10.0, 0.0, (), "test")
    cluster = Cluster("cpu", 4, 4, intra, inter)
    place = (lambda r: (r % 4) * 4 + r // 4) if degree else (lambda r: r)  # usp's groups across the nodes
    cal = C.from_dict(_flat_calibration(), "test")
    got = simulate.simulate(progs, calibration=cal, kernel="cpu", cluster=cluster, place=place)["mid"]

    def link(a, b):
        return cluster.link(place(a), place(b))

    for r, prog in enumerate(progs):
        by: dict = {}
        for op, _ in prog:
            if isinstance(op, schedule.Post):
                for cls, nbytes in simulate._by_class(op, r, link).items():
                    by[cls] = by.get(cls, 0.0) + nbytes
        assert list(got[r].bytes_by_class.items()) == list(by.items()), r
        assert got[r].kernel_calls == sum(isinstance(op, schedule.Compute) and op.kind == "kernel" for op, _ in prog)
    assert variant != "usp" or len(got[0].bytes_by_class) == 2  # a2a inside a node, the ring across them


def test_predict_table_says_which_row_is_which_mask(tmp_path):
    # Three masks of one variant were three rows all labelled "zigzag W=8 flash-attn-4" (found trying
    # predict as a new user would); each row now names what sets it apart.
    res = ringbench_here("predict", "--variant", "zigzag", "--world-size", "8", "--seqlen", "64k", "--gpu", "H100",
                         "--mask", "chunked:8k", "--mask", "global:64,window:4k", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "mask=chunked:8192" in res.stdout and "mask=global:64,window:4096" in res.stdout, res.stdout


class _KeptLaunches:
    """A launcher that keeps the cases it is handed and runs none of them (``ringbench_here``'s ``launcher``)."""

    def __init__(self):
        self.cases = []

    def launch(self, cases, **_):
        self.cases += cases
        raise RuntimeError("launches are kept, not run, in this test")


def test_advise_prints_verify_and_run_commands_of_varlen_candidates_that_pass_the_checks(tmp_path):
    """advise dropped --docs from every verify command it shortened to 32k, which verify then refused
    (exit 2: the case has no documents): the printed commands pass the pre-launch checks, and verify's
    documents, scaled to its seqlen, are multiples of what each variant needs."""
    cal = _write(tmp_path / "cal.json", json.dumps(_flat_calibration()))
    res = ringbench_here("advise", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32",
                         "--seqlen", "64k", "--docs", "1000,7192,57344", "--mode", "fwd", "--calibration", str(cal),
                         "--world-size", "4", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    entries = [json.loads(line) for line in res.stdout.splitlines()]
    ranked = [e for e in entries if e["rank"]]
    assert {e["fields"]["variant"] for e in ranked} >= {"ring_varlen", "zigzag_varlen", "llama3_varlen"}
    for e in ranked:
        for task, command in e["commands"].items():
            kept = _KeptLaunches()
            got = ringbench_here(*shlex.split(command)[1:], "--out", str(tmp_path / "out"), cwd=tmp_path,
                                 launcher=kept)
            assert got.returncode != 2 and kept.cases, (command, got.stderr)
            assert kept.cases[0]["docs"], command
            if task == "verify":
                assert kept.cases[0]["seqlen"] == 32 * 1024, command


def test_advise_scales_documents_to_the_verify_seqlen_in_multiples():
    from ringbench.model.advise import scaled_docs

    assert scaled_docs([64 * 1024, 64 * 1024], 32 * 1024, 8) == [16 * 1024, 16 * 1024]
    assert scaled_docs([1000, 7192, 57344], 32768, 8) == [496, 3600, 28672]
    # Documents that shrink below one multiple merge into their neighbour; the row stays filled.
    assert scaled_docs([1, 1, 65534], 32768, 16) == [32768]
    for docs, total, multiple in (([3000, 500, 12288, 115284], 32768, 16), ([7] * 100, 64, 8)):
        got = scaled_docs(docs, total, multiple)
        assert sum(got) == total and all(d > 0 and d % multiple == 0 for d in got), got


@pytest.mark.parametrize("dtype", [[], ["--dtype", "fp16"]], ids=["bf16", "fp16"])
def test_predict_says_no_calibrated_kernel_runs_on_a_v100_whatever_the_dtype(tmp_path, dtype):
    """--gpu V100 said "pass --dtype fp16" (it has no bf16 peak), and with it came a second refusal: no
    calibrated kernel runs on sm70. The first sentence gives the advice that works."""
    res = ringbench_here("predict", "--variant", "ring", "--seqlen", "32k", "--gpu", "V100", *dtype, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    message = " ".join(res.stderr.split())
    assert message.startswith("gpu V100 (sm70) runs none of the calibration's kernels (flash-attn-4 needs NVIDIA "
                              "sm90 or newer"), message
    assert "--dtype" not in message and message.endswith("then --calibration FILE)"), message


@pytest.mark.parametrize("args", [["--world-size", "3"], ["--gpu", "MI300X"], ["--gpu", "A100", "--kernel",
                                                                                "flash-attn-4"]])
def test_advise_refusing_every_candidate_prints_no_table_and_no_validation_note(tmp_path, args):
    """Every candidate refused printed an empty table and a note that the model is not validated (the
    H100's calibration is), the refusal sentence last after many lines; now the refusals, one line per
    reason, then the verdict, exit 2."""
    gpu = [] if "--gpu" in args else ["--gpu", "H100"]
    res = ringbench_here("advise", "--preset", "llama3-8b", "--seqlen", "128k", *gpu, *args, cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "", res.stdout
    *refusals, verdict = res.stderr.strip().splitlines()
    assert refusals and all(line.startswith("refused: ") for line in refusals), res.stderr
    assert verdict.startswith("every one of the ") and "validated" not in res.stderr


def test_advise_refuses_a_dtype_no_calibrated_kernel_takes_before_anything(tmp_path):
    """--help said bf16|fp16 while fp32 was taken, then refused per candidate under an empty table."""
    res = ringbench_here("advise", "--preset", "llama3-8b", "--seqlen", "128k", "--gpu", "H100", "--dtype", "fp32",
                         cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr.strip() == ("dtype fp32 is taken by none of the calibration's kernels (flash-attn-4 takes "
                                  "bf16 and fp16; torch-flash takes bf16 and fp16), and advise ranks only what a "
                                  "kernel runs; pass --dtype bf16")
    help_text = " ".join(ringbench_here("advise", "--help", cwd=tmp_path).stdout.split())
    assert "bf16|fp16|fp32" in help_text and "the cpu kernel: fp32" in help_text


@pytest.mark.parametrize("command", [["predict", "--variant", "ring", "--seqlen", "32k"],
                                     ["advise", "--preset", "llama3-8b", "--seqlen", "32k"]])
def test_a_cluster_files_unknown_gpu_is_refused_naming_the_file_and_its_key(tmp_path, command):
    """gpu = "Z9000" in a cluster file said "pass --gpu ...", naming neither the file nor its key."""
    path = _write(tmp_path / "cluster.toml", 'gpu = "Z9000"\n')
    res = ringbench_here(*command, "--cluster", str(path), cwd=tmp_path)
    assert res.returncode == 2, res.stdout
    message = " ".join(res.stderr.split())
    assert message.startswith(f"cluster file {str(path)!r}: gpu 'Z9000' is not in the peaks table; set its gpu to "
                              "one of "), message
    assert message.count(". ") == 0 and "Traceback" not in res.stderr, message


@pytest.mark.parametrize("option", [["--iters", "5"], ["--warmup", "0"], ["--min-time-ms", "100"], ["--flush-l2"],
                                    ["--emulate"], ["--profile"]])
def test_predict_refuses_every_option_of_how_to_measure_in_one_sentence(tmp_path, option):
    """--iters, --warmup, --min-time-ms and --flush-l2 were taken in silence (exit 0) where --emulate and
    --profile were refused: each is refused the same way."""
    res = ringbench_here("predict", "--variant", "ring", "--seqlen", "32k", "--gpu", "H100", *option, cwd=tmp_path)
    assert res.returncode == 2 and res.stdout == "", res.stdout
    assert res.stderr.strip() == f"{option[0]} is a way to measure, and predict measures nothing; drop {option[0]}"


def test_predict_help_shows_seed_which_draws_the_documents_of_doc_dist(tmp_path):
    shown = " ".join(ringbench_here("predict", "--help", cwd=tmp_path).stdout.split())
    assert "--seed INT The seed that draws the documents of --doc-dist" in shown.replace("│ ", "").replace(" │", "")
    times = set()
    for seed in ("0", "1"):
        res = ringbench_here("predict", "--variant", "llama3_varlen", "--seqlen", "32k", "--doc-dist",
                             "lognormal:mean=4k,sigma=1", "--gpu", "H100", "--seed", seed, "--json", cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        times.add(json.loads(res.stdout)["spec"]["docs"])
    assert len(times) == 2  # the seed draws other documents


def test_every_gpu_a_calibrated_kernel_runs_on_has_its_own_memory_and_links():
    """A GPU that predict can price gets its own memory and intra-node link, never NVLink assumed for a
    PCIe card (an L4's ring of 8 crosses PCIe 4.0, not NVLink 4); every row's links are fabric rows of
    their class, and every row names a GPU of the peaks table."""
    from ringbench.model import gpus
    from ringbench.model.fabric import fabric_table, link
    from ringbench.rank.peaks import DATASHEETS

    rows, names = gpus._gpu_rows(), {d.name for d in DATASHEETS}
    assert set(rows) <= names, set(rows) - names
    runs_a_kernel = [d.name for d in DATASHEETS if d.arch and d.arch.startswith("sm") and int(d.arch[2:]) >= 80]
    assert "L4" in runs_a_kernel and "B200" in runs_a_kernel
    for name in runs_a_kernel:
        gpu = gpus.find_gpu(name)
        assert gpu.intra and gpu.memory_gib and gpu.hbm_gb_s and rows[name].get("source"), name
        link(gpu.intra, link_class="intra-node")
        if gpu.inter:
            link(gpu.inter, link_class="inter-node")
    table = fabric_table()
    assert gpus.find_gpu("L4").intra == "pcie4" and table["pcie4"].gb_s < table["pcie5"].gb_s
    assert gpus.find_gpu("GeForce RTX 4090").inter is None  # its network is not assumed silently
    # A part of one entry's name finds it (A6000, 4090); a part of two (6000) is refused.
    assert (gpus.find_gpu("A6000").name, gpus.find_gpu("4090").name) == ("RTX A6000", "GeForce RTX 4090")
    with pytest.raises(C.SpecError, match="gpu '6000' is not in the peaks table"):
        gpus.find_gpu("6000")


def test_against_says_when_gpu_prices_records_as_another_gpu(tmp_path):
    """``--against H100 records --gpu A100`` printed a 196% error with no word that the GPUs differ; it
    says how many records ran on another GPU than they are priced as, on stderr and in the summary."""
    ref = Path(__file__).resolve().parents[1] / "results/reference/2026-12-07-s4/h100/runs.jsonl"
    args = ("predict", "--against", str(ref), "--bound", "900%", "--json")
    other = ringbench_here(*args, "--gpu", "A100", cwd=tmp_path)
    summary = json.loads(other.stdout.splitlines()[-1])["summary"]
    assert summary["other_gpu"].startswith("1 record ran on another GPU than A100, which --gpu (or the cluster file) "
                                           "prices it as: its error compares two GPUs")
    assert summary["other_gpu"] in " ".join(other.stderr.split())
    # The flash-attn-4 records, which an A100 cannot run, say so, and not "pass --kernel" (--against takes none).
    reasons = {json.loads(line).get("reason") for line in other.stdout.splitlines()[:-1]} - {None}
    fa4 = [r for r in reasons if r.startswith("gpu A100 (sm80) cannot run the flash-attn-4 kernel")]
    cudnn = [r for r in reasons if r.startswith("kernel 'cudnn' is not in the calibration of A100, which holds ")]
    assert cudnn and "flash-attn-4" not in cudnn[0], cudnn  # only what an A100 runs
    assert fa4 and all(r.endswith("and the record ran it; drop --gpu to price each record on the GPU it ran on")
                       and "--kernel" not in r for r in fa4), fa4
    same = ringbench_here(*args, "--gpu", "H100", cwd=tmp_path)
    assert json.loads(same.stdout.splitlines()[-1])["summary"]["other_gpu"] is None


def test_a_varlen_zigzag_half_step_pays_the_row_copies_its_index_rows_make():
    """zigzag_varlen's half-steps pick every document's half by index (``ring.VarlenSteps``), and
    ``ring._rows`` copies those rows (``index_select``) before the kernel: q forward; dout, q, out and the
    float32 lse backward; k and v at key rows. The model prices each copy (read and written); ring_varlen,
    whose blocks are slices, makes none. Hand-computed at W=2, documents 64 and 128 (48 rows a half)."""
    W, docs = 2, "64,128"
    progs, _ = schedule.programs(_spec("zigzag_varlen", W, 192, mode="fwd_bwd", docs=docs))
    H, Hk, D, e = SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim, 4  # fp32
    half = (64 + 128) // W // 2

    def copies(rank, phase):
        return [op.nbytes for op, _ in progs[rank] if isinstance(op, schedule.Compute) and op.kind == "copy"
                and op.phase == phase]

    q_rows, kv_rows = 2 * half * H * D * e, 2 * half * Hk * D * e
    # rank 0 meets rank 1's block at step 1 with its second halves of queries; rank 1 meets rank 0's with
    # the first halves of keys.
    assert copies(0, "fwd") == [q_rows] and copies(0, "bwd") == [q_rows, q_rows, q_rows, 2 * half * H * 4]
    assert copies(1, "fwd") == [kv_rows, kv_rows] and copies(1, "bwd") == [kv_rows, kv_rows]
    ring, _ = schedule.programs(_spec("ring_varlen", W, 192, mode="fwd_bwd", docs=docs))
    assert not [op for prog in ring for op, _ in prog if isinstance(op, schedule.Compute) and op.kind == "copy"]


def test_fabric_help_names_every_row_of_the_fabric_table_in_its_class():
    """--fabric's help lists the rows by class; a row added to fabrics.toml (pcie4, a800-nvlink) must be
    listed, under the class it is."""
    from ringbench.cli import FABRIC_HELP
    from ringbench.model.fabric import fabric_table

    inside, between = FABRIC_HELP.split("between nodes:")
    for name, row in fabric_table().items():
        where = inside if row.link_class == "intra-node" else between
        assert f" {name}," in where or f" {name})" in where or f" {name};" in where, (name, row.link_class)
