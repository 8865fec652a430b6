"""A bad night, provoked on CPU: hangs, crashes, out of memory, refused results and two nodes.

Each sweep runs a good case before the faulty ones and, where the launch survives or is
relaunched, one after them; every test checks the faulty case's status, its reason, and that
the good records are intact. The hang and the raise share one sweep (a module fixture), whose
time is mostly the hang's 10 s watchdog (the start-up and case 1, which run under the same limit,
take about 5 s). The faults come from the hidden ``fault_*`` test variants; verify's refusal of the one that never communicates is in ``test_cli_e2e.py``, beside
verify's other failing variant.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import COMMAND_TIMEOUT_S, read_jsonl, ringbench_here
from helpers import live_cmdlines_with as _live_cmdlines_with

SMALL = ["--device", "cpu", "--world-size", "2", "--seqlen", "256", "--heads", "2", "--kv-heads", "1",
         "--head-dim", "16", "--iters", "3", "--warmup", "1"]


def sweep(tmp_path: Path, variants: list[str]) -> Path:
    """A scenario file of the small shape that runs ``variants`` in order."""
    path = tmp_path / "faults.toml"
    listed = ", ".join(f'"{v}"' for v in variants)
    path.write_text(f"""
[defaults]
device = "cpu"
world_size = 2
seqlen = 256
heads = 2
kv_heads = 1
head_dim = 16
iters = 3
warmup = 1

[sweep]
variant = [{listed}]
""")
    return path


def by_variant(path: Path) -> dict[str, dict]:
    records = read_jsonl(path)
    assert all(r["schema_version"] == 1 for r in records)
    return {r["spec"]["variant"]: r for r in records}


def assert_good(records: dict[str, dict], *variants: str) -> None:
    for variant in variants:
        record = records[variant]
        assert record["status"] == "ok", record["reason"]
        assert record["bytes_sent"] > 0 and record["bytes_received"] > 0 and record["bus_gib_s"] > 0


@pytest.fixture(scope="module")
def hang_and_raise(tmp_path_factory):
    """One sweep of ring, fault_hang, fault_raise and zigzag: the hang times out its launch, the raise
    fails the next one, and zigzag runs in a third (the two faults share the sweep and its
    command, which each had to themselves)."""
    tmp_path = tmp_path_factory.mktemp("hang_and_raise")
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGBENCH_FAULT_WAIT_S", "2")  # the faulted rank's wait for the others, in every rank
        result = ringbench_here("run", "--scenario", str(sweep(tmp_path, ["ring", "fault_hang", "fault_raise", "zigzag"])),
                                "--out", str(out), "--timeout", "10", cwd=tmp_path)
    return {"result": result, "out": out, "records": read_jsonl(out / "runs.jsonl"),
            "left": _live_cmdlines_with(str(out / "logs"))}


@pytest.mark.dist
@pytest.mark.slow
def test_faults_hang_times_out_names_each_rank_step_and_the_sweep_goes_on(hang_and_raise):
    result, records = hang_and_raise["result"], hang_and_raise["records"]
    assert result.returncode == 3  # a launch timed out
    assert [r["spec"]["variant"] for r in records] == ["ring", "fault_hang", "fault_raise", "zigzag"]
    hung = records[1]
    assert hung["status"] == "timeout"
    # The case's own clock: it ran its 10 s limit, however long the case before it took.
    assert re.match(r"case 2/4 timed out: it ran 1[01] s, past its limit of 10 s \(the launch ran \d+ s\); "
                    "last progress mark of each rank:", hung["reason"]), hung["reason"]
    for rank in (0, 1):  # both stopped inside the hanging case
        assert re.search(rf"rank {rank}: \S+ case 2/4 start fault_hang S=256", hung["reason"]), hung["reason"]
    assert_good(by_variant(hang_and_raise["out"] / "runs.jsonl"), "ring", "zigzag")
    assert "timed out" in result.stderr and "the case after it goes to a fresh launch" in result.stderr
    assert hang_and_raise["left"] == []  # every rank ended, none orphaned


@pytest.mark.dist
@pytest.mark.slow
def test_faults_raise_on_one_rank_records_its_rank_and_traceback(hang_and_raise):
    records = by_variant(hang_and_raise["out"] / "runs.jsonl")
    assert len(records) == 4
    crashed = records["fault_raise"]
    assert crashed["status"] == "error"
    # The root cause from rank 1's torchelastic error file: its rank, the exception, its traceback.
    assert crashed["reason"].startswith("rank 1/2 failed"), crashed["reason"]
    assert "RuntimeError: [rank 1/2] injected fault" in crashed["reason"]
    assert re.search(r'File ".*fixtures/broken\.py", line \d+, in fault_raise_attention', crashed["reason"])
    assert_good(records, "ring", "zigzag")  # zigzag in a fresh launch after the failed one
    assert hang_and_raise["left"] == []


@pytest.mark.dist
def test_faults_oom_silent_and_unavailable_variants_are_recorded_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "out"
    variants = ["ring", "fault_oom", "fault_unavailable", "fault_silent", "zigzag"]
    result = ringbench_here("run", "--scenario", str(sweep(tmp_path, variants)), "--out", str(out), "--json", cwd=tmp_path)
    assert result.returncode == 1  # cases failed, the launch did not
    assert [json.loads(line)["spec"]["variant"] for line in result.stdout.splitlines()] == variants
    records = by_variant(out / "runs.jsonl")
    assert len(records) == 5
    # A variant whose library is missing here is skipped with the reason, never launched.
    missing = records["fault_unavailable"]
    assert (missing["status"], missing["reason"]) == (
        "skipped", "variant fault_unavailable is unavailable here: test only: its library is never installed")
    assert missing["time_ms"] is None and missing["env"]["torch"]  # where it was skipped is part of the record
    oom = records["fault_oom"]
    assert oom["status"] == "oom"
    assert re.match(r"\[rank [01]/2\] out of memory: requested \d+\.\d\d GiB, free \d+\.\d\d GiB; "
                    r"torch\.OutOfMemoryError: CUDA out of memory", oom["reason"]), oom["reason"]
    silent = records["fault_silent"]
    assert silent["status"] == "error"
    assert re.match(r"\[rank [01]/2\] RuntimeError: the fault_silent variant sent no bytes at world size 2; "
                    r"context parallelism was not active, so the timing is refused$", silent["reason"])
    assert_good(records, "ring", "zigzag")


def test_faults_without_the_test_variable_a_fault_variant_is_unknown(tmp_path, monkeypatch):
    """The test-only variants are no user's: without RINGBENCH_TEST_VARIANTS=1 (conftest.py sets it)
    run refuses fault_hang as unknown, listing only user variants, and ringbench variants never lists one."""
    monkeypatch.delenv("RINGBENCH_TEST_VARIANTS")
    result = ringbench_here("run", "--variant", "fault_hang", *SMALL, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode != 0
    assert "variant 'fault_hang' is unknown; choose one of ring, zigzag" in result.stderr
    assert "fault_" not in result.stderr.replace("'fault_hang'", "")
    assert not (tmp_path / "out" / "runs.jsonl").exists()
    listing = ringbench_here("variants", cwd=tmp_path)
    assert "ring" in listing.stdout and "fault_" not in listing.stdout and "broken_merge" not in listing.stdout


@pytest.mark.dist
@pytest.mark.slow
def test_faults_two_nodes_on_localhost_write_one_record(tmp_path):
    """Two torchrun agents on localhost act as two nodes, one rank each (gloo)."""
    from ringbench.sweep.launch import free_port

    out = tmp_path / "out"
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "ringbench.cli", "run", "--variant", "ring", *SMALL,
                               "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint,
                               "--out", str(out)],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}, start_new_session=True)
             for node in (1, 0)]  # node 1's agent first: c10d may give it global rank 0
    procs.reverse()
    try:
        outputs = [p.communicate(timeout=COMMAND_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    print(outputs)
    assert [p.returncode for p in procs] == [0, 0]
    records = read_jsonl(out / "runs.jsonl")
    assert len(records) == 1
    assert records[0]["status"] == "ok" and records[0]["spec"]["world_size"] == 2
    assert records[0]["bytes_sent"] > 0
    assert "node 1 of 2: 1 case ran; node 0 writes their records" in outputs[1][1]


def test_faults_refusals_of_results_that_cannot_be_true():
    from ringbench.rank.bench import refusal

    assert refusal(tflops=1200.0, peak=989.0, bytes_sent=1, world_size=2, variant="ring") == (
        "measured 1200 TFLOP/s per GPU exceeds the dense peak of 989 TFLOP/s from ringbench's datasheet table; "
        "the result cannot be true, so it is refused")
    assert refusal(tflops=10.0, peak=None, bytes_sent=0, world_size=2, variant="fault_silent").startswith(
        "the fault_silent variant sent no bytes at world size 2")
    assert refusal(tflops=10.0, peak=989.0, bytes_sent=0, world_size=1, variant="ring") is None
    assert refusal(tflops=900.0, peak=989.0, bytes_sent=1, world_size=2, variant="ring") is None


def test_faults_timeout_default_scales_with_the_case(monkeypatch):
    from ringbench.sweep import estimate
    from ringbench.sweep.run import case_limits_s
    from ringbench.case.spec import CaseSpec, default_fields

    monkeypatch.setattr(estimate, "cpu_matmul_rate", lambda: 400e9)
    monkeypatch.setattr(estimate, "usable_cores", lambda: 2)
    small = CaseSpec.from_dict({**default_fields("cpu", 0), "task": "run", "variant": "ring", "kernel": "cpu",
                                "seqlen": 256})
    big = small.replace(seqlen=64 * 1024)
    for case in (small, big):  # each case its own: the floor plus ten times its estimate
        assert estimate.case_limit_s(case) == pytest.approx(300.0 + 10 * estimate.case_seconds(case))
    assert estimate.case_limit_s(small) == pytest.approx(300.0, abs=5.0)
    assert estimate.case_limit_s(big) > 10 * estimate.case_limit_s(small)
    # One limit per case, not one for the launch: a small case after a big one keeps its own.
    assert case_limits_s([big, small], None) == [estimate.case_limit_s(big), estimate.case_limit_s(small)]
    assert case_limits_s([big, small], 45.0) == [45.0, 45.0]  # --timeout is the limit of each case