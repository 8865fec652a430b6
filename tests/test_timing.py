"""The timing protocol (issue 25): quantiles of the iteration times, the time budget that every
rank agrees on, the L2 flush, and what they leave in the record and in ``case_id``."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import command_cases, pool_cli_run, pool_verify_batches, ringbench_here
from ringbench.case.spec import CaseSpec, default_fields
from ringbench.rank.bench import quantiles, time_iterations


def _spec(**changes) -> CaseSpec:
    return CaseSpec.from_dict({"task": "run", "variant": "zigzag", **default_fields("cpu", 0), "kernel": "cpu",
                               **changes})


def test_timing_quantiles_interpolate_between_the_sorted_times():
    # torch.quantile's linear rule on 1..10: position q * (n - 1) of the sorted list.
    assert quantiles([float(x) for x in (7, 1, 10, 4, 2, 9, 3, 8, 6, 5)]) == pytest.approx((2.8, 5.5, 8.2))
    assert quantiles([3.0]) == (3.0, 3.0, 3.0)
    p20, p50, p80 = quantiles([1.0, 100.0])  # the median of an even count is the mean of the middle two
    assert p50 == 50.5 and p20 < p50 < p80


def test_timing_budget_extends_the_loop_and_flushes_before_every_iteration():
    flushes = []
    times = time_iterations(lambda: time.sleep(1e-3), iters=2, warmup=1, device=torch.device("cpu"),
                            min_time_ms=20, flush=lambda: flushes.append(1))
    assert sum(times) >= 20 and len(times) >= 2
    assert len(flushes) == len(times)  # none in the warm-up
    assert len(time_iterations(lambda: None, iters=3, warmup=0, device=torch.device("cpu"))) == 3


def test_timing_budget_and_flush_keep_or_change_the_case_id_as_they_change_the_measurement():
    base = _spec()
    assert _spec(min_time_ms=500).case_id() == base.case_id()  # more iterations of the same measurement
    assert _spec(flush_l2=False).case_id() == base.case_id()  # records written before the field keep their id
    assert _spec(flush_l2=True).case_id() != base.case_id()  # a cold L2 is another measurement


def _budget_batches(world_size: int, with_slow: bool) -> dict:
    """``tests/dist/timing_loop.py``'s loop (``--iters 3 --min-time-ms 30``) as a case of the session's pooled
    launch of two ranks (``helpers.VerifyPool``), where it had a launch of its own; its test is slow."""
    if world_size != 2 or not with_slow:
        return {}
    return {"budget": ([{"name": "budget", "script": "timing", "iters": 3, "min_time_ms": 30}], 120)}


pool_verify_batches(__name__, _budget_batches)


@pytest.mark.dist
@pytest.mark.slow
def test_timing_budget_gives_every_rank_the_same_count(verify_pool):
    launch = verify_pool.get(__name__, 2, "budget")
    assert launch["returncode"] == 0 and not launch["timed_out"], launch["log_tail"][-2000:]
    rec = launch["records"]["budget"]
    assert rec["status"] == "ok", rec.get("error")
    ranks = rec["ranks"]
    assert len(ranks) == 2
    # Rank 0 sleeps half as long as rank 1, so it needs more iterations; both run its count.
    assert ranks[0]["count"] == ranks[1]["count"] >= 3
    assert all(r["spent_ms"] >= 30 for r in ranks), ranks
    assert all(r["flushes"] == r["count"] for r in ranks)


def _spread_run_cases() -> list:
    """``run --variant zigzag --world-size 1 --world-size 2 --seqlen 256 --heads 2 --kv-heads 1 --head-dim 16 --iters 3
    --warmup 1 --min-time-ms 40``'s cases, as the command line builds them."""
    return command_cases("run", {"variant": ["zigzag"], "world_size": [1, 2], "seqlen": 256, "heads": 2, "kv_heads": 1,
                                 "head_dim": 16, "iters": 3, "warmup": 1, "min_time_ms": 40})


# The session's pooled run command runs them (helpers.CliRunPool): its launches of one and two ranks.
pool_cli_run(__name__, _spread_run_cases)


@pytest.mark.dist
@pytest.mark.slow
def test_timing_run_records_the_spread_and_the_counts_at_world_sizes_1_and_2(cli_run_pool):
    got = cli_run_pool.get(__name__)
    result = got["result"]
    assert result.returncode == 0, result.stderr
    records = got["records"]
    assert None not in records, result.stderr
    assert sorted(r["spec"]["world_size"] for r in records) == [1, 2]
    for r in records:
        w = r["spec"]["world_size"]
        assert r["status"] == "ok" and r["spec"]["min_time_ms"] == 40 and r["spec"]["flush_l2"] is False
        assert r["case_id"] == CaseSpec.from_dict({**r["spec"], "min_time_ms": 0}).case_id()
        assert r["timed_iters"] >= 3 and r["ref_timed_iters"] >= 3
        lows, mids, highs = r["per_rank_time_ms_p20"], r["per_rank_time_ms"], r["per_rank_time_ms_p80"]
        assert len(lows) == len(mids) == len(highs) == w
        assert all(lo <= mid <= hi for lo, mid, hi in zip(lows, mids, highs))
        assert (r["time_ms_p20"], r["time_ms"], r["time_ms_p80"]) == (max(lows), max(mids), max(highs))
        assert r["ref_time_ms_p20"] <= r["ref_time_ms"] <= r["ref_time_ms_p80"]
        assert len(r["per_rank_ref_time_ms"]) == w and r["ref_time_ms"] in r["per_rank_ref_time_ms"]
        assert r["l2_flush_bytes"] is None


def _ranks(ref_ms: list[float], flops: list[float] | None = None):
    from ringbench.rank.bench import RankMeasure

    return [RankMeasure(time_ms=1.0, time_ms_p20=1.0, time_ms_p80=1.0, ref_time_ms=ms, ref_time_ms_p20=ms,
                        ref_time_ms_p80=ms, timed_iters=1, ref_timed_iters=1, bytes_sent=0, bytes_received=0,
                        peak_allocated_gib=None, peak_reserved_gib=None, l2_flush_bytes=None,
                        ref_flops=(flops or [1.0] * len(ref_ms))[i], profile=None, cuda_graph=False,
                        cuda_graph_note="")
            for i, ms in enumerate(ref_ms)]


@pytest.mark.parametrize("ref_ms, flops, want", [
    # One rank's reference 2.4x slow (the H200's emulated W=8 at 2k tokens per rank): the median stands.
    ([0.31, 0.32, 0.30, 0.31, 0.33, 0.31, 0.75, 0.32], None, 0.31),
    ([0.5, 2.0], None, 0.5),  # of two, the faster: the efficiency is not raised by the slower
    ([4.0], None, 4.0),
    # Shares of different work (llama3_varlen's pieces): by rate, with the rank's own time.
    ([1.0, 3.0, 2.0], [1.0, 6.0, 3.0], 2.0),  # rates 1, 2 and 1.5 TFLOP/s: the middle one
])
def test_timing_the_reference_is_the_rank_at_the_median_rate_not_the_slowest(ref_ms, flops, want):
    from ringbench.rank.bench import reference_rank

    assert reference_rank(_ranks(ref_ms, flops)).ref_time_ms == want


@pytest.mark.parametrize("args, message", [
    (["--flush-l2"], "flush_l2 writes a buffer larger than a GPU's L2 cache between timed iterations, and device "
                     "cpu has no L2 that ringbench flushes; drop --flush-l2 or pass --device cuda"),
    (["--min-time-ms", "-5"], "min_time_ms -5 must be zero or more; pass --min-time-ms 0 or more"),
    (["--min-time-ms", "0.5"],
     "min_time_ms '0.5' is not a whole number; pass --min-time-ms with an integer, such as 0"),
])
def test_timing_bad_options_are_refused_before_anything_starts(tmp_path, args, message):
    out = tmp_path / "results"
    result = ringbench_here("run", "--device", "cpu", "--variant", "zigzag", *args, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip() == message
    assert not out.exists()


def test_timing_l2_flush_needs_a_cuda_device():
    from ringbench.rank.bench import l2_flush

    with pytest.raises(ValueError, match=r"^flush_l2 needs a cuda device, not cpu; drop --flush-l2 on cpu$"):
        l2_flush(torch.device("cpu"))


@pytest.mark.gpu
def test_timing_flush_l2_on_cuda_records_its_buffer_and_leaves_it_out_of_the_peak(solo_group):
    from ringbench.rank.bench import MIN_FLUSH_BYTES
    from ringbench.rank.emulation import emulate_case

    spec = _spec(device="cuda", kernel="torch-flash", dtype="bf16", world_size=2, seqlen=8192, heads=8, kv_heads=2,
                 head_dim=128, iters=5, warmup=2, emulate=True, min_time_ms=20)
    warm = emulate_case(spec, device=torch.device("cuda"))
    cold = emulate_case(spec.replace(flush_l2=True), device=torch.device("cuda"))
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flushed = cold["l2_flush_bytes"]
    assert warm["l2_flush_bytes"] is None and flushed >= max(2 * l2, MIN_FLUSH_BYTES) and flushed % 2 ** 21 == 0
    # The buffer is live through the window, and exactly its bytes come off the allocated peak.
    print(warm["peak_allocated_gib"], cold["peak_allocated_gib"], flushed / 2 ** 30)
    assert abs(cold["peak_allocated_gib"] - warm["peak_allocated_gib"]) < flushed / 2 ** 30 / 4
    for fields in (warm, cold):
        assert fields["time_ms_p20"] <= fields["time_ms"] <= fields["time_ms_p80"] and fields["timed_iters"] >= 5
