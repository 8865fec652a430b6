"""No silent hours: every sweep is estimated before it starts, and on CPU a sweep that would pass
30 minutes, or more ranks than the machine holds, is refused unless --yes.

The refusals run the CLI in-process with a launcher stand-in (nothing is launched), the machine's
rate, cores and memory fixed by monkeypatch; one test runs the real command of the issue.
"""

from __future__ import annotations

import re
import time

import pytest
from typer.testing import CliRunner

from helpers import CLI_ENV, ringbench
from ringbench.sweep import estimate, build, run as sweep
from ringbench.cli import app

runner = CliRunner(env=CLI_ENV)


class Recorder:
    """A launcher stand-in: writes each case's ok record as the workers would, and keeps the launches."""

    def __init__(self):
        self.launches: list[dict] = []

    def launch(self, cases, *, world_size, device, results_path, run_id, timeout_s, on_poll=None):
        from ringbench.records import build as records, store as results
        from ringbench.case.spec import CaseSpec

        self.launches.append({"world_size": world_size, "cases": cases})
        for case in cases:
            results.append_record(results_path, records.build(CaseSpec.from_dict(case), run_id=run_id, status="ok"))
        return type("Result", (), {"returncode": 0, "timed_out": False, "log_dir": None, "failure": None})()


@pytest.fixture
def machine(monkeypatch):
    """Two cores, 20 GiB free and a 400 GFLOP/s matmul, wherever the test runs."""
    monkeypatch.setattr(estimate, "cpu_matmul_rate", lambda: 400e9)
    monkeypatch.setattr(estimate, "usable_cores", lambda: 2)
    monkeypatch.setattr(estimate, "available_bytes", lambda: 20 * 2 ** 30)
    return monkeypatch


def _run(args, launcher):
    return runner.invoke(app, ["run", "--device", "cpu", *args], obj=launcher)


def test_estimate_a_long_cpu_sweep_is_refused_with_the_estimate_and_the_flag(machine, tmp_path):
    launcher = Recorder()
    got = _run(["--variant", "zigzag", "--seqlen", "128k", "--out", str(tmp_path)], launcher)
    assert got.exit_code == 2
    message = got.stderr.strip()
    assert len(message.splitlines()) == 1, message
    # 4 * 128k^2 * 4 heads * 32 / 2 * 3.5 FLOPs, (10 + 3) times with the reference's 1/2 more, at 80 GFLOP/s.
    assert re.match(r"this sweep would take about 63 min on cpu \(zigzag S=128k W=2; attention at about 80 "
                    r"GFLOP/s on cpu, from a 400 GFLOP/s float32 matmul measured here\), over the 30 min that "
                    r"ringbench runs on cpu without asking; pass --yes to run it anyway", message), message
    assert launcher.launches == [] and not (tmp_path / "runs.jsonl").exists()


def test_estimate_yes_lets_a_long_sweep_through_and_prints_the_estimate(machine, tmp_path):
    launcher = Recorder()
    got = _run(["--variant", "zigzag", "--seqlen", "128k", "--out", str(tmp_path), "--yes", "--json"], launcher)
    assert got.exit_code == 0, got.output
    assert [c["seqlen"] for launch in launcher.launches for c in launch["cases"]] == [131072]
    assert re.search(r"^estimate: about 63 min for 1 case in 1 launch \(attention at about 80 GFLOP/s",
                     got.stderr, re.M), got.stderr


@pytest.mark.parametrize("world_size, free, why", [
    (64, 200 * 10 ** 9, r"64 ranks on 2 cores are more than the 8 \(4 per core\) that ringbench starts without asking"),
    (4, 2 ** 30, r"its ranks need about 1\.\d GiB of memory \(4 of about 4\d\d MiB\) but 1\.0 GiB is available here"),
])
def test_estimate_a_world_size_the_machine_cannot_hold_is_refused_unless_yes(machine, tmp_path, world_size, free,
                                                                             why):
    machine.setattr(estimate, "available_bytes", lambda: free)
    args = ["--variant", "ring", "--seqlen", "4k", "--world-size", str(world_size), "--iters", "2", "--warmup",
            "1", "--out", str(tmp_path)]
    launcher = Recorder()
    got = _run(args, launcher)
    assert got.exit_code == 2
    assert re.fullmatch(rf"world_size {world_size} on cpu does not fit this machine: {why}; pass a smaller "
                        r"--world-size, or --yes to start it anyway", got.stderr.strip()), got.stderr
    assert launcher.launches == []
    got = _run([*args, "--yes"], launcher)
    assert got.exit_code == 0, got.output
    assert [launch["world_size"] for launch in launcher.launches] == [world_size]


def test_estimate_grows_with_the_flops_and_counts_each_launch(machine):
    def cases(**given):
        return build.cases_for("run", {"variant": ["zigzag"], "device": "cpu", **given})[0]

    small, big = cases(seqlen=16384), cases(seqlen=32768)
    work = estimate.case_seconds(big[0]) - estimate.CASE_OVERHEAD_S
    assert work == pytest.approx(4 * (estimate.case_seconds(small[0]) - estimate.CASE_OVERHEAD_S))
    # 4 * S^2 * H * D / 2 * 3.5 FLOPs, (iters + warmup) times, plus the reference's 1 / world_size, at 80 GFLOP/s.
    flops = 4 * 32768 ** 2 * 4 * 32 / 2 * 3.5
    assert work == pytest.approx(flops * (10 + 3) * 1.5 / 80e9)
    two = cases(seqlen=4096, world_size=[2, 4])
    est = estimate.estimate(two)
    assert sorted(est.launch_s) == [(2, "cpu"), (4, "cpu")]
    assert est.total_s == pytest.approx(sum(est.case_s) + sum(est.launch_s.values()))


def test_estimate_a_time_budget_adds_itself_for_the_variant_and_the_reference(machine):
    def case(**given):
        return build.cases_for("run", {"variant": ["zigzag"], "device": "cpu", "seqlen": 4096, **given})[0][0]

    assert estimate.case_seconds(case(min_time_ms=1500)) == pytest.approx(estimate.case_seconds(case()) + 3.0)


def test_estimate_eta_shows_from_the_first_case_and_follows_the_pace():
    cases = build.cases_for("run", {"variant": ["ring", "zigzag"], "device": "cpu", "seqlen": 1024})[0]
    est = estimate.Estimate(case_s=[10.0, 10.0], launch_s={(2, "cpu"): 5.0})
    now = [100.0]
    eta = sweep._Eta(cases, est, clock=lambda: now[0])
    column = sweep._EtaColumn(eta)
    task = type("Task", (), {"finished": False})()
    eta.running(cases[0].case_id())
    assert column.render(task).plain == "ETA 0:00:25"  # before any case has finished
    now[0] = 130.0  # the first case (15 s estimated with the start-up) took 30 s: the pace is half
    eta.finished(cases[0].case_id())
    eta.running(cases[1].case_id())
    assert column.render(task).plain == "ETA 0:00:20"
    now[0] = 200.0  # far past its estimate: never below zero
    assert column.render(task).plain == "ETA 0:00:00"
    assert sweep._EtaColumn(None).render(task).plain == "ETA -:--:--"


def test_estimate_eta_follows_a_pace_far_below_the_estimate():
    """Issue 27: a sweep on busy cores ran 20x its estimate; the ETA follows, beyond the old 10x bound."""
    cases = build.cases_for("run", {"variant": ["ring", "zigzag"], "seqlen": [1024, 2048], "device": "cpu"})[0]
    assert len(cases) == 4
    est = estimate.Estimate(case_s=[1.0] * 4, launch_s={(2, "cpu"): 1.0})
    now = [0.0]
    eta = sweep._Eta(cases, est, clock=lambda: now[0])
    eta.running(cases[0].case_id())
    now[0] = 40.0  # the first case (2 s estimated with the start-up) took 40 s: 20x
    eta.finished(cases[0].case_id())
    eta.running(cases[1].case_id())
    assert eta.seconds_left() == pytest.approx(3 * 20.0)
    now[0] = 140.0  # the second case has run 100 s: the pace is now at least 140 / 3 per estimated second
    assert eta.seconds_left() == pytest.approx(2 * 140.0 / 3)


def test_estimate_the_issues_command_exits_2_within_seconds_on_cpu(tmp_path):
    """`ringbench run --variant zigzag --seqlen 128k` on a CPU machine: refused before any launch."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU refusal: this machine has a GPU, where the case runs on cuda")
    start = time.monotonic()
    result = ringbench("run", "--variant", "zigzag", "--seqlen", "128k", "--out", str(tmp_path / "out"),
                       cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode == 2
    assert re.fullmatch(r"this sweep would take about .+ on cpu \(zigzag S=128k W=2; .+\), over the 30 min that "
                        r"ringbench runs on cpu without asking; pass --yes to run it anyway, or a smaller --seqlen, "
                        r"fewer --iters or fewer cases", result.stderr.strip()), result.stderr
    assert not (tmp_path / "out" / "runs.jsonl").exists()
    assert elapsed < 30, f"the refusal took {elapsed:.1f} s"


def test_estimate_an_emulated_run_is_one_process_holding_every_ranks_shards(machine):
    """`run --emulate --variant zigzag --world-size 64 --seqlen 2048`: one process, not 64."""
    machine.setattr(estimate, "available_bytes", lambda: 2 * 10 ** 9)

    def case(**given):
        return build.cases_for("run", {"variant": ["zigzag"], "device": "cpu", "seqlen": 2048, "world_size": 64,
                                       **given})[0]

    emulated, real = case(emulate=True), case()
    assert estimate.launch_bytes(emulated[0]) == estimate.RANK_BASE_BYTES + 64 * estimate.shard_bytes(real[0])
    estimate.check(emulated, estimate.estimate(emulated), yes=False)  # about 0.4 GiB: fits
    with pytest.raises(estimate.SpecError, match=r"its ranks need about 2[45]\.\d GiB of memory \(64 of about"):
        estimate.check(real, estimate.estimate(real), yes=False)
    machine.setattr(estimate, "available_bytes", lambda: 10 ** 8)
    with pytest.raises(estimate.SpecError, match=r"one emulating process holding 64 shards of about"):
        estimate.check(emulated, estimate.estimate(emulated), yes=False)


def test_estimate_memory_counts_the_value_head_dim(machine):
    """`verify --head-dim 48 --head-dim-v 100000` needs as much as values of 100000 wide, and is refused."""
    def case(**given):
        return build.cases_for("verify", {"variant": ["zigzag"], "device": "cpu", "seqlen": 512, "world_size": 2,
                                          "head_dim": 48, **given})[0]

    machine.setattr(estimate, "available_bytes", lambda: 8 * 2 ** 30)
    plain, wide = case()[0], case(head_dim_v=100000)[0]
    width = (plain.heads + plain.kv_heads) * (100000 - 48)  # v, out and their gradients grow, q and k do not
    assert estimate.shard_bytes(wide) - estimate.shard_bytes(plain) == 3 * 256 * width * 4
    assert estimate.verify_extra_bytes(wide) - estimate.verify_extra_bytes(plain) == 5 * 512 * width * 8
    with pytest.raises(estimate.SpecError, match=r"its ranks need about \d+\.\d GiB of memory"):
        estimate.check([wide], estimate.estimate([wide]), yes=False)
    estimate.check([plain], estimate.estimate([plain]), yes=False)


def test_estimate_matrix_refuses_what_the_machine_cannot_hold_unless_yes(machine, tmp_path):
    """`ringbench matrix --world-size 16`: the refusal says --yes, and matrix takes it, as run and verify do."""
    args = ["matrix", "--device", "cpu", "--variant", "ring", "--axis", "dtype", "--world-size", "16",
            "--out", str(tmp_path)]
    launcher = Recorder()
    got = runner.invoke(app, args, obj=launcher)
    assert got.exit_code == 2, got.output
    assert re.fullmatch(r"world_size 16 on cpu does not fit this machine: 16 ranks on 2 cores are more than the 8 "
                        r"\(4 per core\) that ringbench starts without asking; pass a smaller --world-size, or --yes "
                        r"to start it anyway", got.stderr.strip()), got.stderr
    assert launcher.launches == []
    got = runner.invoke(app, [*args, "--yes"], obj=launcher)
    assert got.exit_code == 0, got.output
    assert [launch["world_size"] for launch in launcher.launches] == [16]


@pytest.mark.parametrize("given, fix", [
    (["--heads", "100000"], r"fewer --heads, such as --heads (\d+)"),
    (["--batch", "100000"], r"a smaller --batch, such as --batch (\d+)"),
    (["--seqlen", "4M", "--heads", "2", "--kv-heads", "2", "--head-dim", "8"],
     r"a shorter --seqlen, such as --seqlen (\d+)"),
])
def test_estimate_memory_refusal_names_the_term_that_dominates_and_its_value_fits(machine, tmp_path, given, fix):
    """`--heads 100000` or `--batch 100000` was told to pass a smaller --world-size, which frees only the
    ranks' base memory (issue 27); the refusal names the field that makes the memory, with a value that fits
    and that runs within the time limit (`verify --seqlen 1M` was offered a seqlen then refused as 1 h 53 min)."""
    args = ["--variant", "ring", "--world-size", "2", "--iters", "1", "--warmup", "0", "--out", str(tmp_path), *given]
    launcher = Recorder()
    got = _run(args, launcher)
    assert got.exit_code == 2, got.output
    message = got.stderr.strip()
    assert re.fullmatch(rf"world_size 2 on cpu does not fit this machine: its ranks need about [\d.]+ GiB of memory "
                        rf"\(2 of about \d+ MiB\) but 20\.0 GiB is available here; pass {fix}, or --yes to start it "
                        r"anyway", message), message
    assert "--world-size" not in message
    option, value = re.search(r"such as (--[\w-]+) (\d+)", message).groups()
    fixed = list(args)
    fixed[fixed.index(option) + 1] = value
    got = _run(fixed, launcher)  # no --yes: the value also runs within the time limit, so it is not refused next
    assert got.exit_code == 0, got.output
    from ringbench.case.spec import CaseSpec

    case = [CaseSpec.from_dict(c) for c in launcher.launches[-1]["cases"]]
    assert [estimate.launch_bytes(c) <= 20 * 2 ** 30 for c in case] == [True]  # the suggested value fits


def test_estimate_each_launch_measures_the_cpu_rate_again(monkeypatch):
    """The watchdog's limits use the load of the moment: a rate kept from an earlier launch is
    measured again, so a machine that got busier since gets wider limits (issue 27)."""
    case = build.cases_for("run", {"variant": ["ring"], "device": "cpu", "seqlen": 4096})[0][0]
    monkeypatch.setattr(estimate, "_measured_rate", 1e15)  # as if an idle moment had been measured
    stale = estimate.case_limit_s(case)
    monkeypatch.setattr(estimate, "_measured_rate", 1e15)
    fresh = sweep.case_limits_s([case], None)[0]
    assert estimate._measured_rate != 1e15
    assert fresh > stale
    # With --timeout the limits are the user's, and nothing is measured.
    monkeypatch.setattr(estimate, "_measured_rate", 1e15)
    assert sweep.case_limits_s([case], 60.0) == [60.0] and estimate._measured_rate == 1e15


def test_estimate_of_a_masked_case_counts_the_dense_square_the_math_kernel_computes(machine):
    """verify under a mask ran 2 to 4 times its estimate (chunked:64 at 4k: 34 s against 8 s): the estimate
    counted the mask's pairs at the cpu kernel's rate, while the math kernel computes each block whole, about
    twice as slowly, the float64 reference takes the whole square, and each dense mask tests every slice on
    every pair. A masked case now costs the full case on the math kernel plus the masks' building, which
    grows with the slices, and the rate's note names the math kernel."""
    def case(**given):
        cases, _ = build.cases_for("verify", {"device": "cpu", "variant": ["zigzag"], "world_size": [2],
                                              "seqlen": [4096], **given}, resolve_kernels=False, machine=("cpu", 0))
        return cases[0]

    full_math, full_cpu = (estimate.case_seconds(case(causal=False, kernel=k)) for k in ("math", "cpu"))
    overhead = estimate.CASE_OVERHEAD_S
    assert full_math - overhead == pytest.approx(estimate.CPU_MATH_SLOWDOWN * (full_cpu - overhead), rel=1e-9)
    for mask, slices in (("chunked:64", 64), ("prefix:2048", 2), ("window:64,64", 1)):
        masked = case(mask=[mask])
        assert masked.mask == mask
        build_s = 2 * slices * 4096 ** 2 * estimate.MASK_FLOPS_PER_SLICE_PAIR / 400e9
        assert estimate.case_seconds(masked) == pytest.approx(full_math + build_s, rel=1e-9), mask
    assert estimate.case_seconds(case(mask=["chunked:64"])) > 2.5 * full_cpu  # it was 1/64 of the causal case
    masked = case(mask=["chunked:64"])
    text = estimate.summary([masked], estimate.estimate([masked]))
    assert ("attention at about 80 GFLOP/s on cpu (the math kernel at about 42, a mask's work counted over the "
            "whole square and its dense masks built), from a 400 GFLOP/s") in text, text
    assert "math kernel" not in estimate.summary([case()], estimate.estimate([case()]))


def test_estimate_a_long_verify_is_refused_without_naming_iters_it_has_none(tmp_path):
    """verify takes no --iters, so its refusal suggests a smaller --seqlen or fewer cases only."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU refusal: this machine has a GPU, where the case runs on cuda")
    result = ringbench("verify", "--variant", "ring", "--seqlen", "190k", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().endswith("pass --yes to run it anyway, or a smaller --seqlen or fewer cases"), \
        result.stderr
