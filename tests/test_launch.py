"""launch.py against the real torchrun, with a stand-in worker written per test."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from helpers import live_cmdlines_with as _live_cmdlines_with
from ringbench.sweep import launch as launch_mod
from ringbench.records import store as results
from ringbench.sweep.launch import launch

REPO = Path(__file__).resolve().parents[1]

# Each case says what the stand-in does: "record" (rank 0 appends a record), "raise"
# (rank 1 raises, rank 0 waits as a peer blocked in a collective would), "hang" (every rank
# sleeps; the rank named by ignore_term_rank also ignores SIGTERM, like a rank stuck in a
# C call, so only SIGKILL stops it), "die" (rank 1 is killed by SIGKILL, as the kernel's
# out-of-memory killer does; rank 0 waits), "sleep" (every rank sleeps ``seconds`` after a start
# mark in ringbench.rank.worker's form, which the watchdog's per-case clock reads). Like ringbench.rank.worker, it dies with its torchrun.
FAKE_WORKER = '''
import argparse, json, os, signal, sys, time
from ringbench.records import store as results
from ringbench.rank.lifeline import die_with_torchrun

die_with_torchrun()

if os.environ["RANK"] == "1" and "raise" in open(sys.argv[sys.argv.index("--cases") + 1]).read():
    # Only the rank that raises needs torchelastic's error file; importing torch costs
    # seconds, so the other ranks and tests go without it.
    from torch.distributed.elastic.multiprocessing.errors import record
else:
    def record(fn):
        return fn


def mark(rank, text):
    with open(os.path.join(os.environ["RINGBENCH_PROGRESS_DIR"], f"rank{rank}.txt"), "a") as f:
        f.write(text + "\\n")


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases")
    parser.add_argument("--results")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    with open(args.cases) as f:
        job = json.load(f)
    for i, case in enumerate(job["cases"]):
        mark(rank, f"case {i} {case['action']} start")
        if case["action"] == "record":
            if rank == 0:
                results.append_record(args.results, {"run_id": job["run_id"], "case_id": i,
                                                     "status": "ok"})
        elif case["action"] == "raise":
            if rank == 1:
                raise RuntimeError("boom: rank 1 could not run case " + str(i))
            time.sleep(60)
        elif case["action"] == "die":
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        elif case["action"] == "hang":
            if case.get("ignore_term_rank") == rank:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            mark(rank, f"case {i} waiting forever")
            time.sleep(3600)
        elif case["action"] == "sleep":  # a case in the worker's own mark form, for the per-case watchdog
            mark(rank, f"2026-12-02T00:00:00 case {i + 1}/{len(job['cases'])} start sleep")
            time.sleep(case["seconds"])
        mark(rank, f"case {i} done")


if __name__ == "__main__":
    main()
'''


@pytest.fixture
def worker_env(tmp_path):
    """Env that makes the stand-in importable as ``fake_worker`` in torchrun's children."""
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "fake_worker.py").write_text(FAKE_WORKER)
    path = os.pathsep.join(p for p in (str(folder), str(REPO), os.environ.get("PYTHONPATH"))
                           if p)
    return {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _run(tmp_path, worker_env, cases, *, timeout_s, **kw):
    kw.setdefault("log_dir", tmp_path / "logs")
    return launch(cases, world_size=2, device="cpu", results_path=tmp_path / "out.jsonl",
                  run_id="t1", timeout_s=timeout_s, module="fake_worker", env=worker_env, **kw)


@pytest.mark.dist
def test_launch_success_writes_records_and_logs_and_on_poll_sees_them_while_the_job_runs(tmp_path, worker_env):
    cases = [{"action": "record", "world_size": 2, "device": "cpu"} for _ in range(3)]
    seen: list[int] = []
    res = _run(tmp_path, worker_env, cases, timeout_s=60, log_dir=None,
               on_poll=lambda: seen.append(len(results.read_records(tmp_path / "out.jsonl"))))
    assert (res.returncode, res.timed_out, res.failure) == (0, False, None)
    recs = results.read_records(tmp_path / "out.jsonl")
    assert [(r["run_id"], r["case_id"]) for r in recs] == [("t1", 0), ("t1", 1), ("t1", 2)]
    # Default log folder: <results dir>/logs/<run_id>/<nnn>-w<W>, with per-rank logs.
    assert res.log_dir.parent == tmp_path / "logs" / "t1"
    assert res.log_dir.name.endswith("-w2")
    assert (res.log_dir / "cases.json").exists()
    assert len(list((res.log_dir / "torchrun").glob("*/attempt_0/1/stderr.log"))) == 1
    assert launch_mod.last_progress(res.log_dir, 2) == {0: "case 2 done", 1: "case 2 done"}
    assert len(seen) >= 2 and seen[-1] == 3  # polled while running, and once after the end
    assert seen == sorted(seen)


@pytest.mark.dist
@pytest.mark.slow  # 6-14 s on two cores; the quick subset keeps test_faults' oom, silent and unavailable
def test_launch_rank_failure_names_rank_and_exception(tmp_path, worker_env):
    cases = [{"action": "record"}, {"action": "raise"}]
    start = time.monotonic()
    res = _run(tmp_path, worker_env, cases, timeout_s=60)
    elapsed = time.monotonic() - start
    assert res.returncode != 0 and not res.timed_out
    assert res.failure is not None
    assert res.failure.startswith("rank 1/2 failed")
    assert "RuntimeError: boom: rank 1 could not run case 1" in res.failure
    assert "fake_worker.py" in res.failure  # the traceback came along
    assert len(results.read_records(tmp_path / "out.jsonl")) == 1  # case 0 kept
    assert elapsed < 30, f"torchrun took {elapsed:.1f} s to stop rank 0 after rank 1 failed"


@pytest.mark.dist
@pytest.mark.slow
def test_launch_timeout_kills_every_process(tmp_path, worker_env, monkeypatch):
    # A short grace keeps the test quick. Rank 1 ignores SIGTERM and torchrun's own shutdown
    # wait is longer than this grace, so the SIGKILL path is what must stop rank 1.
    monkeypatch.setattr(launch_mod, "TERM_GRACE_S", 1.5)
    cases = [{"action": "record"}, {"action": "hang", "ignore_term_rank": 1}]
    timeout_s = 8.0
    start = time.monotonic()
    res = _run(tmp_path, worker_env, cases, timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert res.timed_out and res.returncode != 0
    assert timeout_s <= elapsed < timeout_s + launch_mod.TERM_GRACE_S + 4
    assert "timed out after 8 s" in res.failure
    assert "rank 0: case 1 waiting forever" in res.failure
    assert "rank 1: case 1 waiting forever" in res.failure
    leftovers = _live_cmdlines_with(str(res.log_dir / "cases.json"))
    assert leftovers == []


@pytest.mark.dist
@pytest.mark.slow
def test_launch_ctrl_c_stops_job_and_reraises(tmp_path, worker_env, monkeypatch):
    monkeypatch.setattr(launch_mod, "TERM_GRACE_S", 1.5)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGALRM stands in for Ctrl-C: both raise KeyboardInterrupt in the main thread.
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(tmp_path, worker_env, [{"action": "hang", "ignore_term_rank": 0}],
                 timeout_s=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _live_cmdlines_with(str(tmp_path / "logs" / "cases.json")) == []


def test_launch_mismatched_case_world_size_raises(tmp_path):
    with pytest.raises(ValueError, match=r"case 1 has world_size 4 but this launch uses 2"):
        launch([{"world_size": 2}, {"world_size": 4}], world_size=2, device="cpu",
               results_path=tmp_path / "r.jsonl", run_id="x", timeout_s=5)
    assert not (tmp_path / "logs").exists()  # refused before anything was written


@pytest.mark.dist
@pytest.mark.slow  # a torchrun launch each, 1.5-2 s on two cores
def test_launch_on_poll_error_stops_the_job_and_propagates(tmp_path, worker_env, monkeypatch):
    monkeypatch.setattr(launch_mod, "TERM_GRACE_S", 1.5)
    calls: list[float] = []

    def poll():
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise RuntimeError("progress display broke")

    with pytest.raises(RuntimeError, match="progress display broke"):
        _run(tmp_path, worker_env, [{"action": "hang"}], timeout_s=60, on_poll=poll)
    assert len(calls) == 3
    assert _live_cmdlines_with(str(tmp_path / "logs" / "cases.json")) == []


@pytest.mark.dist
@pytest.mark.slow  # 6-14 s on two cores; the quick subset keeps test_faults' oom, silent and unavailable
def test_launch_killed_rank_gives_its_root_cause_and_keeps_torchruns_report_in_the_log(tmp_path, worker_env):
    res = _run(tmp_path, worker_env, [{"action": "record"}, {"action": "die"}], timeout_s=60)
    assert res.returncode != 0 and not res.timed_out
    # One line: the rank, its signal, and where torchrun's own report is; not the report itself.
    assert re.fullmatch(r"rank 1/2 was killed by SIGKILL \(signal 9, pid \d+\) and left no error file: killed "
                        r"from outside, or by the kernel's out-of-memory killer \(see dmesg\); torchrun then "
                        r"stopped rank 0; torchrun's report: " + re.escape(str(res.log_dir / "torchrun.stderr.log")),
                        res.failure), res.failure
    report = (res.log_dir / "torchrun.stderr.log").read_text()
    assert "Root Cause (first observed failure)" in report and "Signal 9 (SIGKILL)" in report


@pytest.mark.dist
@pytest.mark.slow  # a torchrun launch each, 1.5-2 s on two cores
def test_launch_torchrun_killed_takes_its_ranks_with_it(tmp_path, worker_env):
    """torchrun dies without a word (SIGKILL): its ranks die too (die_with_torchrun) and the
    failure says that torchrun was killed."""
    log_dir = tmp_path / "logs"

    def kill_torchrun_once_ranks_wait():
        marks = launch_mod.last_progress(log_dir, 2)
        if all(m and "waiting forever" in m for m in marks.values()) and not killed:
            (torchrun,) = [int(line.split(":")[0]) for line in _live_cmdlines_with(str(log_dir / "cases.json"))
                           if "torch.distributed.run" in line]
            os.kill(torchrun, signal.SIGKILL)
            killed.append(torchrun)

    killed: list[int] = []
    res = _run(tmp_path, worker_env, [{"action": "hang"}], timeout_s=60, on_poll=kill_torchrun_once_ranks_wait)
    assert killed and res.returncode == -signal.SIGKILL and not res.timed_out
    assert res.failure.startswith("torchrun was killed by SIGKILL (signal 9) and no rank left an error; its "
                                  "output: "), res.failure
    deadline = time.monotonic() + 5
    while (left := _live_cmdlines_with(str(log_dir / "cases.json"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def test_launch_failures_file_carries_torchelastics_root_cause_and_exit_statuses(tmp_path):
    """What ``sweep.torchrun`` writes from torchelastic's ChildFailedError is what the failure text
    is told from: the earliest failure is the root cause, the others follow (no torchrun needed)."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ringbench.sweep.torchrun import failures_record

    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none"))
    stopped = ProcessFailure(local_rank=0, pid=4241, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none"))
    killed.timestamp, stopped.timestamp = 100, 101
    error = ChildFailedError("ringbench.rank.worker", {0: stopped, 1: killed})
    (tmp_path / launch_mod.FAILURES_FILE).write_text(json.dumps(failures_record(error)))
    text = launch_mod._failure_text(tmp_path, 2, 1)
    assert text == ("rank 1/2 was killed by SIGKILL (signal 9, pid 4242) and left no error file: killed from "
                    "outside, or by the kernel's out-of-memory killer (see dmesg); torchrun then stopped rank 0; "
                    f"torchrun's report: {tmp_path / 'torchrun.stderr.log'}"), text


def test_launch_watch_clock_starts_at_each_cases_own_start_mark(tmp_path):
    progress = tmp_path / "progress"
    progress.mkdir()
    now = [100.0]
    watch = launch_mod._Watch(progress, 2, [30.0, 5.0], clock=lambda: now[0])

    def marks(*texts):
        for rank, text in enumerate(texts):
            with open(progress / f"rank{rank}.txt", "a") as f:
                f.write(f"2026-12-02T00:00:00 {text}\n")

    assert watch.poll() == 30.0 and watch.case is None  # the start-up, under case 1's limit
    now[0] = 110.0
    marks("case 1/2 start ring S=1024", "ready")
    assert watch.poll() == 20.0 and watch.case is None  # rank 1 has not started case 1 yet
    now[0] = 112.0
    marks("case 1/2 done ok", "case 1/2 start ring S=1024")
    assert watch.poll() == 30.0 and watch.case == 0  # case 1's clock: the slowest rank's start
    now[0] = 140.0  # case 1 took 28 s, far past case 2's whole limit
    marks("case 2/2 start zigzag S=1024", "case 2/2 start zigzag S=1024")
    assert watch.poll() == 5.0 and watch.case == 1  # case 2 gets its own 5 s, from its start
    now[0] = 146.0
    assert watch.poll() == -1.0 and watch.ran_s() == 6.0


def test_launch_watched_case_is_the_slowest_ranks():
    assert launch_mod.watched_case({0: "t case 3/4 start a S=1", 1: "t case 2/4 raised RuntimeError; waiting"}) == 1
    assert launch_mod.watched_case({0: "t case 1/4 done ok", 1: "t ready"}) is None
    assert launch_mod.watched_case({0: None, 1: "t case 1/4 start a S=1"}) is None


@pytest.mark.dist
@pytest.mark.slow
def test_launch_each_case_has_its_own_limit_from_its_own_start(tmp_path, worker_env):
    """One launch, two properties. Case 2 starts after the start-up and case 1's 4 s, past its own
    6 s limit had that counted, and passes; case 3 passes its own 3 s limit, times out, and the
    failure says how long it ran."""
    cases = [{"action": "sleep", "seconds": 4}, {"action": "sleep", "seconds": 3},
             {"action": "sleep", "seconds": 600}]
    start = time.monotonic()
    res = _run(tmp_path, worker_env, cases, timeout_s=[30, 6, 3])
    assert time.monotonic() - start > 4 + 3 + 3
    assert res.timed_out and res.timed_out_case == 2, res.failure  # not case 2 (index 1), whose 6 s were its own
    assert re.match(r"case 3/3 timed out: it ran [34] s, past its limit of 3 s \(the launch ran \d+ s\); "
                    r"last progress mark of each rank:", res.failure), res.failure
    assert _live_cmdlines_with(str(res.log_dir / "cases.json")) == []
