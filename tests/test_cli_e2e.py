"""The CLI end to end: ``python -m ringbench.cli`` as a user runs it, with real torchrun and gloo.

Nothing is stood in for: each test starts the command line in a subprocess of the interpreter
running pytest, which launches the workers, and then reads what a user would read: the exit
code, stdout, stderr, the records file and the JUnit XML. About 50 s on two CPU cores, 28 s of
it the smoke scenario (marked slow; its world size 8 launch is most of that).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from helpers import SLOW_SWEEP, COMMAND_TIMEOUT_S, command_cases, read_jsonl, ringbench
from helpers import live_cmdlines_with as _live_cmdlines_with
from ringbench.variants import list_variants


@pytest.mark.dist
@pytest.mark.slow
def test_cli_e2e_verify_smoke_passes_every_case(tmp_path):
    from ringbench.case.scenarios import load_scenario

    cases = load_scenario("smoke").cases("verify", "cpu")
    assert len(cases) > 0
    junit = tmp_path / "j.xml"
    result = ringbench("verify", "--out", str(tmp_path), "--junit-xml", str(junit), cwd=tmp_path)
    assert result.returncode == 0

    records = read_jsonl(tmp_path / "verify.jsonl")
    assert sorted(r["case_id"] for r in records) == sorted(c.case_id() for c in cases)
    assert [r["status"] for r in records] == ["ok"] * len(cases)
    assert all(len(r["checks"]) == 5 and all(c["passed"] for c in r["checks"]) for r in records)
    assert f"{len(cases)} cases: {len(cases)} passed, 0 failed, 0 errors" in result.stdout

    suite = ET.parse(junit).getroot().find("testsuite")
    testcases = suite.findall("testcase")
    assert len(testcases) == len(cases) and suite.get("tests") == str(len(cases))
    assert (suite.get("failures"), suite.get("errors")) == ("0", "0")
    assert all(list(tc) == [] for tc in testcases)  # no failure, error or skipped element

    # The growth table of the one problem the smoke scenario runs at world sizes 1 to 8.
    lines = result.stdout.splitlines()
    title = lines.index("error growth: zigzag S=512 H=4/2 D=32 bf16 causal cpu")
    assert lines[title + 1].split() == ["tensor", "W=1", "W=2", "W=4", "W=8", "max/W=1"]
    rows = [line.split() for line in lines[title + 3:title + 8]]
    assert [row[0] for row in rows] == ["out", "lse", "dq", "dk", "dv"]
    assert all(re.fullmatch(r"\d+\.\d\d", row[-1]) for row in rows), rows
    assert "…" not in result.stdout  # every cell whole at 80 columns


@pytest.mark.dist
def test_cli_e2e_verify_broken_variant_fails(tmp_path):
    """broken_merge drops a block, so its errors pass the tolerance; fault_silent computes on each
    rank alone, so its numbers can pass but changing one rank's K/V leaves the others' output as it
    was: both fail, each for its own reason, in one launch."""
    result = ringbench("verify", "--variant", "broken_merge", "--variant", "fault_silent", "--world-size", "2",
                       "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1
    records = read_jsonl(tmp_path / "verify.jsonl")
    assert len(records) > 0 and {r["status"] for r in records} == {"fail"}
    assert "FAIL" in result.stdout and "PASS" not in result.stdout
    assert f"{len(records)} cases: 0 passed, {len(records)} failed, 0 errors" in result.stdout
    broken = [r for r in records if r["spec"]["variant"] == "broken_merge"]
    assert broken and all("over the tolerance or malformed" in r["reason"] for r in broken)
    silent = [r for r in records if r["spec"]["variant"] == "fault_silent"]
    checked = [r for r in silent if r["cp_active"] is not None]
    assert checked and all(r["cp_active"] is False for r in checked)
    assert all("context parallelism was not active at world size 2" in r["reason"] for r in checked)


@pytest.mark.dist
@pytest.mark.slow  # 6-12 s on two cores; the quick subset runs `run` under torchrun in the --resume test
def test_cli_e2e_run_json_prints_one_record(tmp_path):
    result = ringbench("run", "--variant", "zigzag", "--seqlen", "4k", "--heads", "2", "--kv-heads", "1", "--head-dim",
                       "16", "--iters", "3", "--warmup", "1", "--out", str(tmp_path), "--json", cwd=tmp_path)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["status"] == "ok" and record["reason"] is None
    assert record["spec"]["seqlen"] == 4096 and record["spec"]["world_size"] == 2
    assert record["tflops_per_gpu"] > 0 and record["efficiency"] > 0 and record["bytes_sent"] > 0
    assert record["time_ms_p20"] <= record["time_ms"] <= record["time_ms_p80"]  # the spread (issue 25)
    assert record["timed_iters"] == record["ref_timed_iters"] == 3 and record["l2_flush_bytes"] is None
    assert record["env"]["torch"]
    assert record["merge_path"] == "torch"  # every CPU takes the engine's torch merges
    assert read_jsonl(tmp_path / "runs.jsonl") == [record]


@pytest.mark.parametrize("args, message", [
    (["run", "--variant", "ring", "--seqlen", "1000", "--world-size", "3"],
     r"seqlen 1000 is not a multiple of world_size = 3, which ring needs; use 1002"),
    # A test-only variant runs when named, but a user is never offered it.
    (["run", "--variant", "nope"], r"variant 'nope' is unknown; choose one of " + re.escape(", ".join(list_variants()))),
])
def test_cli_e2e_refused_case_starts_nothing(tmp_path, args, message):
    out = tmp_path / "results"
    result = ringbench(*args, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 2
    assert re.fullmatch(message, result.stderr.strip())
    assert result.stdout == ""
    assert not out.exists()




@pytest.mark.dist
def test_cli_e2e_resume_launches_only_the_cases_without_an_ok_record(tmp_path):
    """The quick subset's --resume under torchrun: ring already has an ok record (written by the
    record builder the workers use), so --resume launches zigzag alone and keeps the file's line."""
    from ringbench.records import build as records, store

    small = ["--device", "cpu", "--world-size", "2", "--seqlen", "256", "--heads", "2", "--kv-heads", "1",
             "--head-dim", "16", "--iters", "2", "--warmup", "1"]
    ring, zigzag = command_cases("run", {"variant": ["ring", "zigzag"], "device": "cpu", "world_size": [2],
                                         "seqlen": 256, "heads": 2, "kv_heads": 1, "head_dim": 16, "iters": 2,
                                         "warmup": 1})
    out = tmp_path / "out"
    out.mkdir()
    store.append_record(out / "runs.jsonl", records.build(ring, run_id="earlier", status="ok"))
    before = read_jsonl(out / "runs.jsonl")
    result = ringbench("run", "--variant", "ring", "--variant", "zigzag", *small, "--out", str(out), "--resume",
                       cwd=tmp_path)
    assert result.returncode == 0
    assert "--resume: 1 of 2 cases already has an ok record" in result.stderr
    after = read_jsonl(out / "runs.jsonl")
    assert after[:1] == before  # the earlier record kept as it was
    assert [(r["case_id"], r["status"]) for r in after[1:]] == [(zigzag.case_id(), "ok")]  # zigzag alone ran
    assert after[1]["bytes_sent"] > 0 and after[1]["run_id"] != "earlier"
    (launch,) = out.glob("logs/*/*/cases.json")  # one launch, of zigzag
    assert [c["variant"] for c in json.loads(launch.read_text())["cases"]] == ["zigzag"]


@pytest.mark.dist
@pytest.mark.slow
def test_cli_e2e_sweep_killed_then_resumed_keeps_one_ok_record_per_case(tmp_path):
    from ringbench.case.scenarios import load_scenario

    scenario = tmp_path / "kill.toml"
    scenario.write_text(SLOW_SWEEP)
    ids = {c.case_id() for c in load_scenario(str(scenario)).cases("run", "cpu")}
    assert len(ids) == 6
    out = tmp_path / "out"
    runs = out / "runs.jsonl"
    args = [sys.executable, "-m", "ringbench.cli", "run", "--scenario", str(scenario), "--out", str(out)]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not (runs.exists() and runs.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before its first record"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # as a batch system stops a job
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(stderr[-3000:])
    assert proc.returncode == 128 + signal.SIGTERM
    assert "--resume" in stderr
    first = read_jsonl(runs)
    ok_first = {r["case_id"] for r in first if r["status"] == "ok"}
    assert 1 <= len(ok_first) < len(ids), "the kill did not land midway"
    assert _live_cmdlines_with(str(out / "logs")) == []  # no rank outlived the CLI

    result = ringbench("run", "--scenario", str(scenario), "--out", str(out), "--resume", cwd=tmp_path)
    assert result.returncode == 0
    assert f"--resume: {len(ok_first)} of 6 cases already {'has' if len(ok_first) == 1 else 'have'} an ok record" \
        in result.stderr
    records = read_jsonl(runs)
    assert records[:len(first)] == first  # nothing rewritten
    ok = [r["case_id"] for r in records if r["status"] == "ok"]
    assert sorted(ok) == sorted(ids)  # every case once: none lost, none duplicated
    resumed = {r["case_id"] for r in records[len(first):]}
    assert resumed == ids - ok_first


def _worker_pids(needle: str, rank: int) -> list[int]:
    """Live worker processes whose command line holds ``needle`` and whose RANK is ``rank``."""
    return [int(line.split(":")[0]) for line in _live_cmdlines_with(needle)
            if "ringbench.rank.worker" in line and _env_of(int(line.split(":")[0])).get("RANK") == str(rank)]


@pytest.mark.dist
@pytest.mark.slow
def test_cli_e2e_a_killed_rank_shows_its_root_cause_not_torchruns_dump(tmp_path):
    """A rank killed by SIGKILL (as the out-of-memory killer does) leaves no traceback: the case's
    record and the terminal give one line naming it, torchrun's report stays in the launch log,
    the command exits 3, and the case after it runs in a fresh launch. fault_hang keeps rank 1
    asleep in its case; the test kills that process."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "ringbench.cli", "run", "--variant", "ring", "--variant", "fault_hang", "--variant",
            "zigzag", "--device", "cpu", "--world-size", "2", "--seqlen", "256", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "16", "--iters", "2", "--warmup", "1", "--timeout", "120", "--out", str(out)]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while True:  # rank 1 inside fault_hang
            marks = list(out.glob("logs/*/*/progress/rank1.txt"))
            if marks and "start fault_hang" in marks[0].read_text():
                break
            assert proc.poll() is None and time.monotonic() < deadline, "rank 1 never reached fault_hang"
            time.sleep(0.05)
        (rank1,) = _worker_pids(str(out / "logs"), rank=1)
        os.kill(rank1, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(stderr[-3000:])
    assert proc.returncode == 3
    records = {r["spec"]["variant"]: r for r in read_jsonl(out / "runs.jsonl")}
    assert {v: r["status"] for v, r in records.items()} == {"ring": "ok", "fault_hang": "error", "zigzag": "ok"}
    reason = records["fault_hang"]["reason"]
    assert re.match(rf"rank 1/2 was killed by SIGKILL \(signal 9, pid {rank1}\) and left no error file", reason)
    assert "\n" not in reason
    assert f"launch at world_size 2 on cpu failed: {reason}" in stderr
    assert "the case after it goes to a fresh launch" in stderr
    for raw in ("Root Cause", "ringbench.rank.worker FAILED", "=====", "error_file", "traceback :"):
        assert raw not in stderr  # torchrun's dump
    (log,) = out.glob("logs/*/000-w2/torchrun.stderr.log")  # the launch whose rank was killed
    assert "Root Cause (first observed failure)" in log.read_text()
    assert _live_cmdlines_with(str(out / "logs")) == []


def _env_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)
