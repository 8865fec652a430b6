"""run --profile (spans per rank and step, the breakdown table and plot) and run --emulate (one
process playing every rank of a ring, its transfers as device copies).

The emulated forward output and dq are the ring's own, so they are held to float64 attention;
the gloo launch checks the breakdown of a real world-size-2 run and of an emulated one.
"""

from __future__ import annotations

import io
import re

import pytest
import torch

from helpers import attention_fp64, pool_cli_run
from ringbench.present import profile as present_profile
from ringbench.rank import profile
from ringbench.errors import SpecError
from ringbench.case.spec import CaseSpec, default_fields, validate
from ringbench.variants import instruments
from ringbench.variants.instruments import timeline
from ringbench.variants import get_variant
from ringbench.variants.engines import layouts


def _spec(**changes) -> CaseSpec:
    return CaseSpec.from_dict({"task": "run", "variant": "zigzag", **default_fields("cpu", 0), "kernel": "cpu",
                               **changes})


@pytest.mark.parametrize("name", ["ring", "zigzag", "stripe"])
def test_emulation_out_and_dq_equal_fp64_attention(name):
    world_size, seqlen = 4, 64
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, seqlen, h, 8, generator=gen, dtype=torch.float64) for h in (2, 1, 1, 2))
    q.requires_grad_(True)
    want, _ = attention_fp64(q, k, v, causal=True, scale=8 ** -0.5)
    want.backward(dout)
    layout = get_variant(name).layout
    shard = [[layouts.shard(t, layout, r, world_size).detach().contiguous() for t in (q, k, v, dout)]
             for r in range(world_size)]
    outs, dqs = [], []
    with instruments.open(traffic=True) as counted:
        for rank, (qr, kr, vr, dr) in enumerate(shard):
            qr.requires_grad_(True)
            with instruments.open(emulation=instruments.Emulation(rank, world_size, [(s[1], s[2]) for s in shard])):
                out, _ = get_variant(name).attention(qr, kr, vr, causal=True, kernel="math")
                out.backward(dr)
            outs.append(out.detach())
            dqs.append(qr.grad)
    got_out, got_dq = layouts.unshard(outs, layout), layouts.unshard(dqs, layout)
    err_out, err_dq = (got_out - want).abs().max().item(), (got_dq - q.grad).abs().max().item()
    print(f"{name}: max |out - fp64| {err_out:.2e}, max |dq - fp64| {err_dq:.2e}")
    assert err_out < 1e-12 and err_dq < 1e-12
    # Each rank would send its K/V W-1 times forward and backward, and dK/dV W times.
    assert counted.traffic.bytes_sent > 0 and counted.traffic.bytes_sent == counted.traffic.bytes_received


@pytest.mark.parametrize("changes, message", [
    ({"variant": "rfa_zigzag"}, r"^rfa_zigzag cannot run with --emulate: it is a peer"),
    ({"task": "verify"}, r"^emulate is a run measurement"),
])
def test_emulation_refuses_what_one_process_cannot_play(changes, message):
    with pytest.raises(SpecError, match=message) as info:
        validate(_spec(emulate=True, **changes), visible_gpus=0)
    assert "\n" not in str(info.value) and "; " in str(info.value)  # one sentence, then the fix


def test_emulation_takes_more_ranks_than_gpus():
    validate(_spec(emulate=True, world_size=8, device="cuda", kernel="auto"), visible_gpus=1)
    with pytest.raises(SpecError, match="exceeds the 1 visible GPUs"):
        validate(_spec(world_size=8, device="cuda", kernel="auto"), visible_gpus=1)


def test_timeline_records_one_span_per_outer_call_inside_iterations_only():
    calls = []

    @timeline.timed("merge")
    def inner():
        calls.append("inner")

    @timeline.timed("kernel")
    def outer():
        inner()

    outer()  # nothing recorded, nothing raised
    with instruments.open(timeline=torch.device("cpu")) as inst:
        tl = inst.timeline
        outer()  # outside an iteration
        tl.begin_iteration()
        timeline.step("bwd", 3)
        outer()
        inner()
        tl.end_iteration()
        (it,) = tl.resolve()
    assert [s[:3] for s in it["spans"]] == [("kernel", "bwd", 3), ("merge", "bwd", 3)]
    assert all(ms >= 0 for *_, ms in it["spans"]) and sum(s[3] for s in it["spans"]) <= it["wall_ms"]
    assert calls == ["inner"] * 4 and timeline.current() is None


def test_profile_breakdown_means_add_up_to_the_wall_time():
    its = [{"wall_ms": 10.0, "spans": [("kernel", "fwd", 0, 4.0), ("merge", "fwd", 0, 1.0), ("comm", "fwd", 0, 2.0),
                                       ("kernel", "fwd", 1, 1.0)]},
           {"wall_ms": 12.0, "spans": [("kernel", "fwd", 0, 6.0), ("comm", "fwd", 0, 1.0)]}]
    b = profile.breakdown(its)
    assert (b["wall_ms"], b["kernel_ms"], b["merge_ms"], b["comm_ms"], b["other_ms"], b["busy_ms"]) == \
        (11.0, 5.5, 0.5, 1.5, 3.5, 6.0)
    assert b["steps"] == [{"phase": "fwd", "step": 0, "kernel_ms": 5.0, "merge_ms": 0.5, "comm_ms": 1.5},
                          {"phase": "fwd", "step": 1, "kernel_ms": 0.5, "merge_ms": 0.0, "comm_ms": 0.0}]
    fields = profile.record_fields([{**b, "clock": "perf_counter"}, {**b, "busy_ms": 2.0, "clock": "perf_counter"}])
    assert fields["per_rank_busy_ms"] == [6.0, 2.0] and fields["busy_imbalance"] == 3.0
    assert profile.record_fields([None, None]) == {"profile": None, "per_rank_busy_ms": None, "busy_imbalance": None}
    # Comm spans without a kernel call (a peer's transfers through ringbench's communicator): no busy time.
    peer = profile.breakdown([{"wall_ms": 5.0, "spans": [("comm", "fwd", 0, 2.0)]}])
    assert peer["kernel_calls_per_iteration"] == 0 and peer["spans_per_iteration"] == 1
    fields = profile.record_fields([{**peer, "clock": "perf_counter"}] * 2)
    assert fields["per_rank_busy_ms"] is None and fields["busy_imbalance"] is None


def _profiled_record(world_size: int) -> dict:
    b = profile.breakdown([{"wall_ms": 123.456, "spans": [("kernel", "fwd", 0, 100.0), ("comm", "fwd", 1, 3.0)]}])
    spec = _spec(world_size=world_size, profile=True)
    return {"status": "ok", "case_id": spec.case_id(), "spec": spec.to_dict(), "kernel": "cpu", "imbalance": 1.0,
            **profile.record_fields([{**b, "clock": "perf_counter"}] * world_size)}


def test_profile_breakdown_takes_the_host_gap_out_of_other():
    its = [{"wall_ms": 10.0, "host_gap_ms": 3.0, "spans": [("kernel", "fwd", 0, 4.0), ("merge", "fwd", 0, 1.0)]},
           {"wall_ms": 10.0, "host_gap_ms": 1.0, "spans": [("kernel", "fwd", 0, 4.0), ("merge", "fwd", 0, 1.0)]}]
    b = profile.breakdown(its)
    assert (b["host_gap_ms"], b["other_ms"]) == (2.0, 3.0)
    # Iterations resolved before the host gap was measured (CPU, or old records) have none.
    assert profile.breakdown([{k: v for k, v in its[0].items() if k != "host_gap_ms"}])["other_ms"] == 5.0


@pytest.mark.gpu
def test_timeline_host_gap_is_the_gpu_waiting_for_the_host():
    """A host that sleeps between two spans leaves the GPU idle: that is a host gap. Device work
    queued between two spans (a long matmul outside them) is not."""
    import time

    a = torch.randn(4096, 4096, device="cuda")
    with instruments.open(timeline=torch.device("cuda")) as inst:
        tl = inst.timeline
        tl.begin_iteration()
        with timeline.span("kernel"):
            a @ a
        torch.cuda.synchronize()
        time.sleep(0.02)
        with timeline.span("merge"):
            a @ a
        tl.end_iteration()
        tl.begin_iteration()
        with timeline.span("kernel"):
            a.add_(0)
        for _ in range(20):
            a @ a  # queued work outside the spans, issued faster than the GPU runs it
        with timeline.span("merge"):
            a.add_(0)
        tl.end_iteration()
        slept, queued = tl.resolve()
    assert slept["host_gap_ms"] > 15
    assert queued["host_gap_ms"] < 1


def test_profile_table_has_a_row_per_rank_within_80_columns(tmp_path):
    from rich.console import Console

    buf = io.StringIO()
    present_profile.print_tables([_profiled_record(8)], Console(file=buf, width=80, no_color=True))
    lines = buf.getvalue().splitlines()
    print(buf.getvalue())
    assert max(len(line) for line in lines) <= 80
    rows = [line for line in lines if re.match(r"^\s+\d+\s+123\.456\s+100\.000", line)]
    assert len(rows) == 8
    (path,) = present_profile.write_plots([_profiled_record(2)], tmp_path)
    assert path.name.startswith("profile-") and path.stat().st_size > 1000


def test_profile_pictures_are_named_by_case_label_and_titled_with_the_mode(tmp_path):
    import matplotlib.pyplot as plt

    record = _profiled_record(2)
    fwd = {**_profiled_record(2), "spec": {**record["spec"], "mode": "fwd"}, "case_id": "f00d"}
    twin = {**record, "case_id": "beef"}  # another case of the same label: both keep their case_id
    (path,) = present_profile.write_plots([record], tmp_path / "one")
    assert path.name == "profile-zigzag_W2_S4k_H4-2_D32_fp32_causal_cpu_fwd_bwd.png", path.name
    assert present_profile.plot_path(tmp_path, fwd).name == "profile-zigzag_W2_S4k_H4-2_D32_fp32_causal_cpu_fwd.png"
    assert present_profile.plot_path(tmp_path, {**record, "emulated": True}).name.endswith("_fwd_bwd_emulated.png")
    both = present_profile.write_plots([record, twin], tmp_path / "two")
    assert [p.name for p in both] == [f"profile-zigzag_W2_S4k_H4-2_D32_fp32_causal_cpu_fwd_bwd_{c}.png"
                                      for c in (record["case_id"], "beef")]
    for r, words in ((record, "forward + backward"), (fwd, "forward")):
        fig = present_profile.figure(r)
        try:
            assert fig.axes[0].get_title().splitlines()[1] == f"{words}, perf_counter"
        finally:
            plt.close(fig)


def test_emulate_case_gives_compute_time_per_rank_and_its_bound(solo_group):
    from ringbench.rank.emulation import emulate_case

    spec = _spec(world_size=4, seqlen=256, heads=2, kv_heads=1, head_dim=16, iters=2, warmup=1, emulate=True,
                 profile=True, min_time_ms=5)
    fields = emulate_case(spec, device=torch.device("cpu"))
    assert fields["emulated"] is True and len(fields["per_rank_compute_ms"]) == 4
    assert fields["time_ms"] == max(fields["per_rank_compute_ms"])
    # The spread of each emulated rank's own loop, which ran until its own budget was spent.
    assert fields["time_ms_p20"] == max(fields["per_rank_time_ms_p20"]) <= fields["time_ms"]
    assert fields["time_ms_p80"] == max(fields["per_rank_time_ms_p80"]) >= fields["time_ms"]
    assert len(fields["per_rank_time_ms_p80"]) == 4 and fields["timed_iters"] >= 2
    assert fields["efficiency_bound"] == fields["efficiency"] > 0
    assert fields["bytes_sent"] > 0 and fields["bus_gib_s"] is None
    ranks = fields["profile"]["per_rank"]
    assert [p["rank"] for p in ranks] == [0, 1, 2, 3]
    for p in ranks:
        assert [(s["phase"], s["step"]) for s in p["steps"]] == [(ph, i) for ph in ("fwd", "bwd") for i in range(4)]
        assert p["kernel_ms"] > 0 and p["comm_ms"] > 0 and p["other_ms"] >= -1e-6
    assert len(fields["per_rank_busy_ms"]) == 4


def test_emulate_case_applies_an_off_by_one_sink(solo_group, monkeypatch):
    """An off-by-one sink needs no collective (it joins each row after the ring's last merge, with
    no gradient), so an emulated run takes it, and every rank's call gets it."""
    from ringbench.rank.emulation import emulate_case
    from ringbench.variants.engines import zigzag

    sinks, attention = [], zigzag.zigzag_attention

    def spy(*args, **kwargs):
        sinks.append(kwargs.get("sink"))
        return attention(*args, **kwargs)

    monkeypatch.setattr(zigzag, "zigzag_attention", spy)
    spec = _spec(world_size=4, seqlen=256, heads=2, kv_heads=1, head_dim=16, iters=1, warmup=1, emulate=True,
                 sink="off-by-one")
    validate(spec, visible_gpus=0)
    fields = emulate_case(spec, device=torch.device("cpu"))
    assert fields["emulated"] is True and len(fields["per_rank_compute_ms"]) == 4
    assert sinks and all(s is not None and s.shape == (2,) and not s.any() and not s.requires_grad for s in sinks)


def _emulated_sink_cases() -> list:
    """``run --emulate --variant zigzag --world-size 4 --sink off-by-one --device cpu --seqlen 512 --heads 4
    --kv-heads 2 --head-dim 32 --iters 2 --warmup 1``'s case, as the command line builds it."""
    from helpers import command_cases

    return command_cases("run", {"emulate": True, "variant": ["zigzag"], "world_size": [4], "sink": "off-by-one",
                                 "device": "cpu", "seqlen": 512, "heads": 4, "kv_heads": 2, "head_dim": 32, "iters": 2,
                                 "warmup": 1})


# The session's pooled run command runs it (helpers.CliRunPool): its launch of one rank.
pool_cli_run(__name__, _emulated_sink_cases)


@pytest.mark.dist
@pytest.mark.slow  # the session's pooled run command; the quick subset keeps one fault, one run and one verify
def test_emulated_run_with_an_off_by_one_sink_on_cpu(cli_run_pool):
    got = cli_run_pool.get(__name__)
    proc = got["result"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    (record,) = got["records"]
    assert record is not None, proc.stderr[-2000:]
    assert record["status"] == "ok" and record["emulated"] is True and record["spec"]["sink"] == "off-by-one"
    assert len(record["per_rank_compute_ms"]) == 4


PROFILE_SCENARIO = """
[defaults]
device = "cpu"
kernel = "cpu"
variant = "zigzag"
seqlen = 512
heads = 4
kv_heads = 2
head_dim = 32
iters = 3
warmup = 1
profile = true
[[case]]
world_size = 2
[[case]]
world_size = 4
emulate = true
[[case]]
world_size = 2
variant = "llama3"
heads_k_stride = 1
[[case]]
world_size = 2
variant = "llama3_varlen"
docs = "100,300,112"
[[case]]
world_size = 2
variant = "ulysses"
"""


@pytest.mark.dist
@pytest.mark.slow
def test_profile_gloo_breakdown_per_rank_adds_up(tmp_path):
    from helpers import read_jsonl, ringbench_here

    (tmp_path / "p.toml").write_text(PROFILE_SCENARIO)
    proc = ringbench_here("run", "--scenario", str(tmp_path / "p.toml"), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    by = {(r["spec"]["variant"], r["emulated"]): r for r in read_jsonl(tmp_path / "out" / "runs.jsonl")}
    real, emulated = by["zigzag", False], by["zigzag", True]
    gathered, gathered_varlen, ulysses = by["llama3", False], by["llama3_varlen", False], by["ulysses", False]
    for record, world_size in ((real, 2), (emulated, 4), (gathered, 2), (gathered_varlen, 2), (ulysses, 2)):
        ranks = record["profile"]["per_rank"]
        assert len(ranks) == world_size and len(record["per_rank_busy_ms"]) == world_size
        for p in ranks:
            parts = [p[f"{k}_ms"] for k in profile.PARTS]
            # other_ms is what the spans leave of the wall time: never negative beyond the clock's
            # resolution, and the four parts give the wall time back to rounding.
            assert min(parts) >= -1e-6 and p["kernel_ms"] > 0 and p["comm_ms"] > 0
            assert abs(sum(parts) - p["wall_ms"]) <= 1e-9 * p["wall_ms"]
        assert present_profile.plot_path(tmp_path / "out", record).exists()
    assert real["bus_gib_s"] > 0 and emulated["bus_gib_s"] is None
    # The all-gather engines: a step is a head group (llama3 gathers one K/V head at a time here).
    for p in gathered["profile"]["per_rank"]:
        assert {(s["phase"], s["step"]) for s in p["steps"]} == {("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1)}
    tables = proc.stdout[proc.stdout.index("profile:"):]
    assert "reports no kernel spans" not in tables
    assert len(re.findall(r"^\s+[0-3]\s+\d+\.\d{3}\s", tables, flags=re.M)) == 2 + 4 + 2 + 2 + 2
    assert all(len(line) <= 80 for line in proc.stdout.splitlines())


@pytest.mark.gpu
def test_profile_cuda_events_of_an_emulated_zigzag(solo_group):
    from ringbench.rank.emulation import emulate_case

    spec = _spec(device="cuda", kernel="torch-flash", dtype="bf16", world_size=4, seqlen=8192, heads=8, kv_heads=2,
                 head_dim=128, iters=5, warmup=2, emulate=True, profile=True)
    fields = emulate_case(spec, device=torch.device("cuda"))
    assert fields["profile"]["clock"] == "cuda events"
    for p in fields["profile"]["per_rank"]:
        print(p["rank"], {k: round(p[f"{k}_ms"], 4) for k in ("wall", *profile.PARTS)})
        # The ring's copies run on a side stream (emulation.py): comm is the exposed wait, maybe none.
        assert p["kernel_ms"] > 0 and p["comm_ms"] >= 0 and p["other_ms"] >= -1e-3
        assert p["kernel_ms"] + p["merge_ms"] + p["comm_ms"] <= p["wall_ms"] * (1 + 1e-6)
    assert 0 < fields["efficiency_bound"] <= 1.2 and fields["peak_allocated_gib"] > 0


def test_contracts_say_only_the_peers_report_no_spans():
    """per_rank_busy_ms is null where a variant reports no kernel spans: the peers; ringbench's own engines,
    llama3 and llama3_varlen among them, report theirs (the gloo test above profiles both)."""
    from pathlib import Path

    from ringbench.variants import VARIANTS

    text = (Path(__file__).parents[1] / "docs" / "contracts.md").read_text(encoding="utf-8")
    entry = text[text.index("per_rank_busy_ms    spec.profile only"):text.index("busy_imbalance      max / min")]
    assert "the peers" in entry
    assert not [n for n, v in VARIANTS.items() if not v.peer and re.search(rf"\b{n}\b", entry)], entry


def test_profile_names_each_layouts_predicted_balance_under_a_mask():
    from rich.console import Console

    by = {"contiguous": 1.3845, "zigzag": 1.2307, "stripe": 1.0015, "balanced": 1.0}
    buf = io.StringIO()
    record = {**_profiled_record(2), "predicted_max_over_mean_by_layout": by}
    present_profile.print_tables([record], Console(file=buf, width=80, no_color=True))
    text = " ".join(buf.getvalue().split())
    assert "by layout: contiguous 1.385, zigzag 1.231, stripe 1.002, balanced 1.000" in text
    assert max(len(line) for line in buf.getvalue().splitlines()) <= 80
    buf = io.StringIO()
    present_profile.print_tables([_profiled_record(2)], Console(file=buf, width=80, no_color=True))
    assert "by layout" not in buf.getvalue()
