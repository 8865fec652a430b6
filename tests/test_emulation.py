"""run --emulate for every engine of ringbench (variants/instruments/emulation.py, ringbench/rank/emulation.py).

One process plays each rank in turn, every transfer of ringbench's communicators a device copy.
The forward exchanges are exact (the K/V all-gather, the Ulysses q/k/v all-to-all, the ring's
K/V blocks over the ring group of USP), so what each emulated rank computes from them is the
real run's. The tests here hold it to float64 attention, with no process group:

- the ring and the all-gather engines: the emulated ranks' out, lse and dq, unsharded, are float64
  attention's (dq needs only the gathered K/V and the rank's own rows);
- Ulysses and USP: the output, lse and gradient all-to-alls back to sequence sharding are
  same-shape copies (emulation.py), so emulated rank g's head block j is what it computed for the
  rows of member j of its Ulysses group: real rank j's head block of index g. Put back so, every
  rank's out, lse and dq are float64 attention's.

A gloo launch then shows the emulated ranks' out and lse bitwise equal to a real world-size-4
run's, and their bytes equal to the real ranks' counts; a CLI run at world size 8 gives ok records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import (GLOO_CASES, Sharding, attention_fp64, doc_offsets, pool_cli_run, pool_verify_batches,
                     scenario_text_cases)
from ringbench.case.spec import CaseSpec, default_fields, validate
from ringbench.variants import get_variant, instruments
from ringbench.variants.engines.sinks import apply_sink

D = 8


def _inputs(heads: int, kv_heads: int, seqlen: int, dv: int = D, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, seqlen, h, d, generator=gen, dtype=torch.float64)
                 for h, d in ((heads, D), (kv_heads, D), (kv_heads, dv), (heads, dv)))


def emulate(name: str, shards: list[list[torch.Tensor]], *, backward: bool = True, **options):
    """Every rank of ``shards`` (per rank ``[q, k, v, dout]``) played in turn; per rank ``(out, lse, dq)``
    and the bytes counted over all of them."""
    world_size, results = len(shards), []
    with instruments.open(traffic=True) as counted:
        for rank, (q, k, v, dout) in enumerate(shards):
            with instruments.open(emulation=instruments.Emulation(rank, world_size, shards)):
                for t in (q, k, v):
                    t.requires_grad_(backward)
                out, lse = get_variant(name).attention(q, k, v, causal=True, kernel="math", **options)
                if backward:
                    out.backward(dout)
                results.append((out.detach(), lse, q.grad))
                for t in (q, k, v):
                    t.grad = None
                    t.requires_grad_(False)
    return results, counted.traffic


def as_real(parts: list[torch.Tensor], ulysses_degree: int, head_dim: int) -> list[torch.Tensor]:
    """Emulated ranks' tensors that came back through a copying all-to-all (module docstring), as the
    real ranks hold them: real rank m's head block u_g is emulated rank g's head block u_m, g and m of
    one Ulysses group (ranks u * U ... u * U + U - 1). ``head_dim``: the heads' dimension."""
    if ulysses_degree == 1:
        return parts
    real = [torch.empty_like(p) for p in parts]
    block = parts[0].shape[head_dim] // ulysses_degree
    for g, part in enumerate(parts):
        first = g - g % ulysses_degree
        for j in range(ulysses_degree):
            into = real[first + j].narrow(head_dim, (g % ulysses_degree) * block, block)
            into.copy_(part.narrow(head_dim, j * block, block))
    return real


CASES = {
    # the ring engines: on CUDA their merges and adds run on a side stream (engines/overlap.py)
    "ring": dict(name="ring", world_size=4),
    "zigzag": dict(name="zigzag", world_size=4),
    "stripe-window": dict(name="stripe", world_size=4, options={"window": 12}),
    "ring_varlen": dict(name="ring_varlen", world_size=4, docs=[16, 32, 16]),
    "zigzag_varlen": dict(name="zigzag_varlen", world_size=4, docs=[16, 32, 16]),
    "llama3": dict(name="llama3", world_size=4),
    "llama3-contiguous": dict(name="llama3", world_size=4, options={"layout": "contiguous"}),
    "llama3-stride1-head_dim_v": dict(name="llama3", world_size=4, options={"heads_k_stride": 1}, dv=4),
    "llama3-window": dict(name="llama3", world_size=4, options={"window": 12}),
    "llama3-learnable_sink": dict(name="llama3", world_size=4, sink=True),
    "llama3_varlen": dict(name="llama3_varlen", world_size=4, docs=[10, 30, 24]),
    "llama3_varlen-balanced": dict(name="llama3_varlen", world_size=4, docs=[16, 32, 16],
                                   options={"layout": "balanced"}),
    "llama3_varlen-window": dict(name="llama3_varlen", world_size=4, docs=[10, 30, 24], options={"window": 7}),
    "ulysses-replicated_kv": dict(name="ulysses", world_size=4),
    "ulysses-mha": dict(name="ulysses", world_size=4, heads=8, kv_heads=8),
    "ulysses-window-sink": dict(name="ulysses", world_size=4, options={"window": 9}, sink=True),
    "ulysses_varlen": dict(name="ulysses_varlen", world_size=4, docs=[10, 30, 24]),
    "usp-U2": dict(name="usp", world_size=4, ulysses_degree=2),
    "usp-W8-U1": dict(name="usp", world_size=8, ulysses_degree=1, heads=8, seqlen=128),
    "usp-W8-U2": dict(name="usp", world_size=8, ulysses_degree=2, heads=8, seqlen=128),
    "usp-W8-U4-window-sink": dict(name="usp", world_size=8, ulysses_degree=4, heads=8, seqlen=128,
                                  options={"window": 20}, sink=True),
    "usp-W8-U8": dict(name="usp", world_size=8, ulysses_degree=8, heads=8, seqlen=128),
    "usp_varlen-U2": dict(name="usp_varlen", world_size=4, ulysses_degree=2, docs=[16, 32, 16]),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("key", list(CASES))
def test_emulation_out_lse_and_dq_of_every_engine_equal_fp64_attention(key, device):
    c = CASES[key]
    name, world_size, degree = c["name"], c["world_size"], c.get("ulysses_degree", 0)
    heads, kv_heads, seqlen, dv = c.get("heads", 4), c.get("kv_heads", 2), c.get("seqlen", 64), c.get("dv", D)
    options, docs = dict(c.get("options", {})), c.get("docs")
    q, k, v, dout = _inputs(heads, kv_heads, seqlen, dv)
    sink = torch.randn(heads, generator=torch.Generator().manual_seed(7), dtype=torch.float64) if c.get("sink") \
        else None
    window = options.get("window")
    q.requires_grad_(True)
    cu = doc_offsets(docs) if docs else None
    want, want_lse = attention_fp64(q, k, v, scale=D ** -0.5, causal=True, cu_seqlens=cu,
                                    window=(window - 1, 0) if window else None)
    if sink is not None:
        want, want_lse = apply_sink(want, want_lse, sink)
    want.backward(dout)
    cut = Sharding(name, world_size, degree, options, docs)
    shards = [[cut.cut(t, r).to(device) for t in (q, k, v, dout)] for r in range(world_size)]
    if degree:
        options["ulysses_degree"] = degree
    if docs:  # checked by the emulated all-gather
        options["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
    if sink is not None:  # its gradient's all-reduce is emulated
        options["sink"] = sink.to(device).requires_grad_(True)
    results, traffic = emulate(name, shards, **options)
    u = get_variant(name).ulysses_degree(world_size, degree)
    outs, lses, dqs = (as_real([r[i].cpu() for r in results], u, head_dim=1 if i == 1 else 2) for i in range(3))
    errors = {"out": (cut.join(outs) - want).abs().max().item(),
              "lse": (cut.join(lses, dim=2) - want_lse).abs().max().item(),
              "dq": (cut.join(dqs) - q.grad).abs().max().item()}
    print(key, {t: f"{e:.1e}" for t, e in errors.items()}, f"{traffic.bytes_sent} bytes")
    assert max(errors.values()) < 1e-12, errors
    assert traffic.bytes_sent > 0 and traffic.bytes_sent == traffic.bytes_received


def test_emulation_copies_what_depends_on_other_ranks_work():
    """What an all-to-all of computed tensors brings back is this rank's own send, in the received
    shape (the output's head blocks are the rank's rows of other ranks, module docstring): without
    that transposition the emulated outputs are not attention's; and an unknown all-gather input
    (not a view of a starting tensor) is copied, not invented."""
    q, k, v, dout = _inputs(4, 2, 64)
    cut = Sharding("ulysses", 4, 0, {}, None)
    shards = [[cut.cut(t, r) for t in (q, k, v, dout)] for r in range(4)]
    results, _ = emulate("ulysses", shards, backward=False)
    want, _ = attention_fp64(q, k, v, scale=D ** -0.5, causal=True)
    assert (cut.join([r[0] for r in results]) - want).abs().max() > 1e-3
    from ringbench.variants.engines import comm

    with instruments.open(emulation=instruments.Emulation(0, 4, shards)):
        fresh, out = shards[0][1] * 2, torch.empty(4, *shards[0][1].shape[1:], dtype=torch.float64)
        comm.all_gather_into_tensor(out, fresh).wait()
        gathered = torch.empty(4, 16, 1, D, dtype=torch.float64)
        comm.all_gather_into_tensor(gathered, shards[0][1][:, :, 1:]).wait()  # a view: every rank's, exact
    assert all(torch.equal(part, fresh[0]) for part in out)
    assert all(torch.equal(gathered[r], shards[r][1][0, :, 1:]) for r in range(4))


def test_emulation_refuses_a_real_process_group():
    shards = [[torch.zeros(1, 4, 1, D)] for _ in range(2)]
    with instruments.open(emulation=instruments.Emulation(0, 2, shards)):
        with pytest.raises(RuntimeError, match=r"an emulated rank runs over group None \(its world\) or the groups"):
            instruments.emulation.rank_and_size(object())


# --------------------------------------------------------------------------- the harness's emulated case

def _spec(**changes) -> CaseSpec:
    spec = CaseSpec.from_dict({"task": "run", **default_fields("cpu", 0), "kernel": "cpu", "emulate": True,
                               "world_size": 4, "seqlen": 256, "heads": 4, "kv_heads": 2, "head_dim": 16,
                               "iters": 1, "warmup": 1, **changes})
    validate(spec, visible_gpus=torch.cuda.device_count() if spec.device == "cuda" else 0)
    return spec


def _expected_bytes(spec: CaseSpec) -> int:
    """What one real rank of ``spec`` (fp32, fwd_bwd, W = 4) sends per iteration, by the byte rules."""
    local, w, fp32 = spec.seqlen // spec.world_size, spec.world_size, 4
    kv_shard = local * spec.kv_heads * spec.head_dim * fp32
    if spec.variant == "ulysses":
        # One head a rank after the all-to-all (4 heads, 2 K/V heads replicated to 4): each
        # exchange sends W - 1 parts of local x 1 head x D, for q, k, v and out forward, dout
        # and dq, dk, dv backward; and the lse's W - 1 parts of local x 1 head.
        return 8 * (w - 1) * local * spec.head_dim * fp32 + (w - 1) * local * fp32
    # K and V gathered (W - 1 shards each), dK and dV reduce-scattered in float32: the
    # documents' check is prepared once outside the timing, so it is not counted.
    sent = 4 * (w - 1) * kv_shard
    if spec.sink == "learnable":  # d sink [H] float32 all-reduced: 2 (W - 1) / W of it
        sent += 2 * (w - 1) * spec.heads * fp32 // w
    return sent


@pytest.mark.parametrize("changes", [
    {"variant": "llama3", "sink": "learnable"},
    {"variant": "llama3_varlen", "docs": "100,100,56"},
    {"variant": "ulysses"},
])
def test_emulate_case_counts_the_bytes_a_real_rank_sends(solo_group, changes):
    from ringbench.rank.emulation import emulate_case

    spec = _spec(**changes)
    fields = emulate_case(spec, device=torch.device("cpu"))
    print(spec.variant, fields["bytes_sent"], _expected_bytes(spec))
    assert fields["emulated"] is True and len(fields["per_rank_compute_ms"]) == 4
    assert fields["bytes_sent"] == fields["bytes_received"] == _expected_bytes(spec)
    assert fields["efficiency_bound"] == fields["efficiency"] > 0 and fields["bus_gib_s"] is None


# --------------------------------------------------------------------------- against a real run, on gloo

def _gloo_batches(world_size: int, with_slow: bool) -> dict:
    """``helpers.real_and_emulated`` as a case of the session's pooled launch of four ranks (``helpers.VerifyPool``),
    where it had four spawned processes of its own; its test is slow. The ranks' files go to a new folder."""
    if world_size != 4 or not with_slow:
        return {}
    import tempfile

    return {"gloo": ([{"name": "gloo", "script": "emulation", "out": tempfile.mkdtemp(prefix="emulation-ranks-")}],
                     240)}


pool_verify_batches(__name__, _gloo_batches)


@pytest.mark.dist
@pytest.mark.slow  # a share of the session's pooled launch of four ranks
def test_emulated_ranks_equal_a_real_gloo_run_bitwise_and_count_its_bytes(verify_pool):
    import shutil

    world_size = 4
    launch = verify_pool.get(__name__, world_size, "gloo")
    assert launch["returncode"] == 0 and not launch["timed_out"], launch["log_tail"]
    rec = launch["records"]["gloo"]
    assert rec["status"] == "ok", rec.get("error")
    out = Path(launch["cases"]["gloo"]["out"])
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world_size)]
    shutil.rmtree(out)
    for key, name, options, _ in GLOO_CASES:
        u = get_variant(name).ulysses_degree(world_size, options.get("ulysses_degree", 0))
        for tensor, head_dim in (("out", 2), ("lse", 1), ("dq", 2)):
            real = [found[key][tensor] for found in ranks]
            emulated = as_real([found[key][f"emulated_{tensor}"] for found in ranks], u, head_dim)
            differ = [r for r in range(world_size) if not torch.equal(emulated[r], real[r])]
            print(key, tensor, "ranks differing:", differ)
            assert not differ, (key, tensor)
        counts = [(found[key]["bytes"], found[key]["emulated_bytes"]) for found in ranks]
        print(key, json.dumps(counts))
        assert all(real == emulated > 0 for real, emulated in counts), (key, counts)


#: 512 tokens (64 a rank; usp_varlen's documents multiples of twice its ring of two): what the test asserts
#: (every engine runs emulated at W=8, counts bytes, and llama3 gathers what llama3_varlen does) holds at
#: any length the engines take; 1024 only made each case's work larger.
EMULATED_SCENARIO = """
[defaults]
device = "cpu"
kernel = "cpu"
emulate = true
world_size = 8
seqlen = 512
heads = 8
kv_heads = 2
head_dim = 16
iters = 1
warmup = 1
[[case]]
variant = "llama3"
[[case]]
variant = "llama3_varlen"
docs = "50,350,112"
[[case]]
variant = "ulysses"
sink = "learnable"
[[case]]
variant = "ulysses_varlen"
docs = "50,350,112"
[[case]]
variant = "usp"
ulysses_degree = 2
[[case]]
variant = "usp"
ulysses_degree = 4
window = 100
[[case]]
variant = "usp_varlen"
ulysses_degree = 4
docs = "128,256,128"
"""


# The session's pooled run command runs them (helpers.CliRunPool): its launch of one rank.
pool_cli_run(__name__, lambda: scenario_text_cases(EMULATED_SCENARIO, "run"))


@pytest.mark.dist
@pytest.mark.slow  # seven emulated cases of 8 ranks, in the pooled launch of one rank
def test_emulated_run_of_every_collective_engine_at_world_size_8_on_cpu(cli_run_pool):
    got = cli_run_pool.get(__name__)
    proc = got["result"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    records = got["records"]
    assert None not in records, proc.stderr[-2000:]
    assert [(r["spec"]["variant"], r["spec"]["ulysses_degree"]) for r in records] == [
        ("llama3", 0), ("llama3_varlen", 0), ("ulysses", 0), ("ulysses_varlen", 0), ("usp", 2), ("usp", 4),
        ("usp_varlen", 4)]
    for r in records:
        print(r["spec"]["variant"], r["status"], r["bytes_sent"], r["efficiency_bound"])
        assert r["status"] == "ok" and r["emulated"] is True and r["spec"]["world_size"] == 8, r["reason"]
        assert len(r["per_rank_compute_ms"]) == 8 and r["efficiency_bound"] > 0
        assert r["bytes_sent"] == r["bytes_received"] > 0 and r["bus_gib_s"] is None
    # The same exchanges at another layout: llama3 and llama3_varlen gather and scatter the same bytes.
    assert records[0]["bytes_sent"] == records[1]["bytes_sent"]


@pytest.mark.gpu
@pytest.mark.parametrize("name, options", [("zigzag", {}), ("stripe", {"window": 300}),
                                           ("zigzag_varlen", {"docs": [512, 1536]})])
def test_side_stream_merges_give_the_in_line_results_on_cuda(name, options, monkeypatch):
    """engines/overlap.py: with the merges and adds beside the next kernel (the default on CUDA),
    bf16 out and lse are bitwise those of the merges in line (RINGBENCH_SIDE_MERGE=0), and dq (a
    backward whose kernel may add with atomics) within bf16 rounding of them."""
    options = dict(options)
    docs = options.pop("docs", None)
    world_size, seqlen = 4, 2048
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, seqlen, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2, 8))
    cut = Sharding(name, world_size, 0, options, docs)
    shards = [[cut.cut(t, r) for t in (q, k, v, dout)] for r in range(world_size)]
    if docs:
        options["cu_seqlens"] = torch.tensor(doc_offsets(docs), dtype=torch.int32, device="cuda")
    got = {}
    for side in ("1", "0"):
        monkeypatch.setenv("RINGBENCH_SIDE_MERGE", side)
        results = []
        with instruments.open(traffic=True):
            for rank, (rq, rk, rv, rd) in enumerate(shards):
                with instruments.open(emulation=instruments.Emulation(rank, world_size, shards)):
                    for t in (rq, rk, rv):
                        t.requires_grad_(True)
                    out, lse = get_variant(name).attention(rq, rk, rv, causal=True, kernel="auto", **options)
                    out.backward(rd)
                    results.append((out.detach().clone(), lse.clone(), rq.grad.clone()))
                    for t in (rq, rk, rv):
                        t.grad = None
                        t.requires_grad_(False)
        torch.cuda.synchronize()
        got[side] = results
    for (out, lse, dq), (out0, lse0, dq0) in zip(got["1"], got["0"]):
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
        assert (dq.float() - dq0.float()).abs().max().item() <= 2e-2 * dq0.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("changes", [
    {"variant": "llama3", "heads_k_stride": 1},
    {"variant": "llama3_varlen", "docs": "1000,5000,2192"},
    {"variant": "ulysses", "sink": "learnable"},
    {"variant": "usp", "ulysses_degree": 2},
    {"variant": "usp_varlen", "ulysses_degree": 4, "docs": "2048,4096,2048"},
])
def test_emulate_case_of_the_collective_engines_on_cuda(solo_group, changes):
    from ringbench.rank.emulation import emulate_case

    spec = _spec(device="cuda", kernel="torch-flash", dtype="bf16", world_size=8, seqlen=8192, heads=8, kv_heads=2,
                 head_dim=128, iters=5, warmup=2, profile=True, **changes)
    fields = emulate_case(spec, device=torch.device("cuda"))
    print(spec.variant, [round(t, 3) for t in fields["per_rank_compute_ms"]], fields["efficiency_bound"],
          fields["bytes_sent"])
    assert fields["emulated"] is True and len(fields["per_rank_compute_ms"]) == 8
    # Above 1 is no fault: a Ulysses rank runs the whole sequence on its heads, one long causal block
    # that the kernel runs faster than the share's (1.26 for ulysses with a sink on the H200); a rank
    # whose work went missing would read about W = 8.
    assert 0 < fields["efficiency_bound"] <= 2.0 and fields["bytes_sent"] == fields["bytes_received"] > 0
    for p in fields["profile"]["per_rank"]:
        assert p["kernel_ms"] > 0 and p["comm_ms"] > 0 and p["other_ms"] >= -1e-3


def _measure(graph: bool, note: str):
    from ringbench.rank.bench import RankMeasure

    return RankMeasure(time_ms=1.0, time_ms_p20=1.0, time_ms_p80=1.0, ref_time_ms=1.0, ref_time_ms_p20=1.0,
                       ref_time_ms_p80=1.0, timed_iters=1, ref_timed_iters=1, bytes_sent=0, bytes_received=0,
                       peak_allocated_gib=None, peak_reserved_gib=None, l2_flush_bytes=None, ref_flops=1.0,
                       profile=None, cuda_graph=graph, cuda_graph_note=note)


@pytest.mark.parametrize("first, can_replay, want_graph, again", [
    ([True, True, False], True, True, {(2, "on")}),  # the one eager rank replays like the rest
    ([True, True, False], False, False, {(2, "on"), (0, "off"), (1, "off")}),  # it cannot: all eager
    ([True, False, False], True, False, {(0, "off")}),  # the one replayed rank runs eagerly
    ([False, False], True, False, set()),  # they agree already
])
def test_emulated_ranks_agree_on_the_graph_as_real_ones_do(first, can_replay, want_graph, again):
    from ringbench.rank.emulation import agree

    asked = set()

    def measure(rank, choice):
        asked.add((rank, choice))
        return _measure(choice == "on" and can_replay, f"rank {rank} again")

    out = agree([_measure(g, f"rank {r} first") for r, g in enumerate(first)], measure)
    assert asked == again
    assert {m.cuda_graph for m in out} == {want_graph}
    for rank, choice in asked:
        if out[rank].cuda_graph == (choice == "on"):  # the measure that was kept names the first choice
            assert f"its own choice: rank {rank} first" in out[rank].cuda_graph_note
