"""No sweep outlives its command, and --resume never runs beside a live sweep of the same file.

Under real torchrun: ``kill -9`` of the CLI takes torchrun and every rank with it (a
parent-death signal, ``ringbench.sweep.launch``), and ``--resume`` afterwards writes each case once.
The lease on the results file (``ringbench.sweep.lease``) is held here by small helper processes,
so the refusals and the take-over of a dead sweep's lock cost no torchrun.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import SLOW_SWEEP, COMMAND_TIMEOUT_S, CLI_ENV, read_jsonl, ringbench, ringbench_here
from helpers import live_cmdlines_with
from ringbench.sweep import lease
from ringbench.cli import app

REPO = Path(__file__).resolve().parents[1]


SMALL = ["--variant", "ring", "--device", "cpu", "--world-size", "2", "--seqlen", "256", "--heads", "2",
         "--kv-heads", "1", "--head-dim", "16", "--iters", "2", "--warmup", "1"]


def _start_cli(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ringbench.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **CLI_ENV},
                            start_new_session=True)


def _wait_gone(needle: str, within_s: float) -> list[str]:
    """Live processes whose command line names ``needle``, once none is left or ``within_s`` passed."""
    deadline = time.monotonic() + within_s
    while (left := live_cmdlines_with(needle)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.dist
@pytest.mark.slow
def test_survival_cli_killed_takes_the_sweep_with_it_and_resume_writes_no_duplicates(tmp_path):
    from ringbench.case.scenarios import load_scenario

    scenario = tmp_path / "sweep.toml"
    scenario.write_text(SLOW_SWEEP)
    ids = {c.case_id() for c in load_scenario(str(scenario)).cases("run", "cpu")}
    out = tmp_path / "out"
    runs = out / "runs.jsonl"
    proc = _start_cli(["run", "--scenario", str(scenario), "--out", str(out)], tmp_path)
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not (runs.exists() and runs.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before its first record"
            time.sleep(0.05)
        assert len(live_cmdlines_with(str(out / "logs"))) == 3  # torchrun and its two ranks
        os.kill(proc.pid, signal.SIGKILL)  # the CLI alone, as `kill -9 PID` does: no cleanup runs
        proc.communicate(timeout=30)
        left = _wait_gone(str(out), within_s=5.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert left == [], f"processes of the killed sweep still run: {left}"
    first = read_jsonl(runs)
    ok_first = {r["case_id"] for r in first if r["status"] == "ok"}
    assert 1 <= len(ok_first) < len(ids), "the kill did not land midway"

    result = ringbench("run", "--scenario", str(scenario), "--out", str(out), "--resume", cwd=tmp_path)
    assert result.returncode == 0
    assert f"--resume: {len(ok_first)} of 6 cases already {'has' if len(ok_first) == 1 else 'have'} an ok record" \
        in result.stderr
    records = read_jsonl(runs)
    assert records[:len(first)] == first
    counts = collections.Counter(r["case_id"] for r in records if r["status"] == "ok")
    assert set(counts) == ids and set(counts.values()) == {1}, counts  # every case once, none twice


# --------------------------------------------------------------------------- the lease

HOLDER = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    from ringbench.sweep import lease

    held = lease.acquire(Path(sys.argv[1]), exclusive=sys.argv[2] == "exclusive")
    if sys.argv[3] == "orphan":
        # Like a killed CLI whose torchrun still runs: a child holds the lock, the holder is gone.
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(float(%r))" % sys.argv[4]],
                         pass_fds=lease.held_fds())
        print("held", flush=True)
        os._exit(0)
    print("held", flush=True)
    time.sleep(float(sys.argv[4]))
""")


def _hold(results: Path, *, exclusive: bool, orphan: bool = False, seconds: float = 60) -> subprocess.Popen:
    """A process that holds the lease of ``results`` (or leaves a child holding it) until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(results), "exclusive" if exclusive else "shared",
                             "orphan" if orphan else "stay", str(seconds)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


class OneRecordLauncher:
    """Writes each case's ok record as the workers would, and counts its launches."""

    def __init__(self):
        self.launched = 0

    def launch(self, cases, *, world_size, device, results_path, run_id, timeout_s, on_poll=None):
        from ringbench.records import build as records, store as results
        from ringbench.case.spec import CaseSpec

        self.launched += 1
        for case in cases:
            results.append_record(results_path, records.build(CaseSpec.from_dict(case), run_id=run_id, status="ok"))
        return type("Result", (), {"returncode": 0, "timed_out": False, "log_dir": None, "failure": None})()


def test_survival_resume_is_refused_while_a_live_sweep_holds_the_results_file(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = _hold(out / "runs.jsonl", exclusive=False)
    try:
        result = ringbench_here("run", *SMALL, "--out", str(out), "--resume", cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert f"another sweep (pid {holder.pid}," in message
    assert f"is writing to {out / 'runs.jsonl'}, so --resume would run some of its cases a second time" in message
    assert f"(kill {holder.pid})" in message
    assert not (out / "runs.jsonl").exists()


def test_survival_two_plain_sweeps_share_the_file_but_not_beside_a_resume(tmp_path):
    runner = CliRunner(env=CLI_ENV)
    out = tmp_path / "out"
    out.mkdir()
    plain = _hold(out / "runs.jsonl", exclusive=False)
    try:  # docs/operations.md: two sweeps may append to one file at once
        got = runner.invoke(app, ["run", *SMALL, "--out", str(out)], obj=OneRecordLauncher())
        assert got.exit_code == 0, got.output
    finally:
        plain.kill()
        plain.wait()
    resuming = _hold(out / "runs.jsonl", exclusive=True)
    try:
        got = runner.invoke(app, ["run", *SMALL, "--out", str(out)], obj=OneRecordLauncher())
    finally:
        resuming.kill()
        resuming.wait()
    assert got.exit_code == 2
    assert f"a --resume sweep (pid {resuming.pid}," in got.stderr
    assert f"is writing to {out / 'runs.jsonl'}" in got.stderr and "pass another --out" in got.stderr


def test_survival_a_dead_sweeps_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = {"pid": int(gone.stdout), "start": 1, "host": os.uname().nodename, "mode": "run",
            "since": "2026-12-01T00:00:00+00:00", "command": "ringbench run --scenario x"}
    lease.lock_path(out / "runs.jsonl").write_text(json.dumps(dead) + "\n")
    launcher = OneRecordLauncher()
    got = CliRunner(env=CLI_ENV).invoke(app, ["run", *SMALL, "--out", str(out), "--resume"], obj=launcher)
    assert got.exit_code == 0, got.output
    assert launcher.launched == 1
    holders = [json.loads(line) for line in lease.lock_path(out / "runs.jsonl").read_text().splitlines()]
    assert [h["pid"] for h in holders] == [os.getpid()] and holders[0]["mode"] == "resume"


def test_survival_resume_waits_for_the_processes_a_killed_sweep_left(tmp_path):
    """The killed CLI's torchrun still holds the lock while it stops its workers: resume waits for it."""
    out = tmp_path / "out"
    out.mkdir()
    holder = _hold(out / "runs.jsonl", exclusive=False, orphan=True, seconds=2)
    holder.wait()
    launcher = OneRecordLauncher()
    start = time.monotonic()
    got = CliRunner(env=CLI_ENV).invoke(app, ["run", *SMALL, "--out", str(out), "--resume"], obj=launcher)
    assert got.exit_code == 0, got.output
    assert 0.5 < time.monotonic() - start < 15
    assert f"the sweep that held {out / 'runs.jsonl'} (pid {holder.pid}) has ended; waiting up to" in got.stderr
    assert launcher.launched == 1


def test_survival_a_rank_whose_torchrun_is_gone_does_not_start(tmp_path):
    # RINGBENCH_TORCHRUN_PID names a process that is not this one's parent: torchrun has ended.
    code = "from ringbench.rank.lifeline import die_with_torchrun; die_with_torchrun(); print('started')"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RINGBENCH_TORCHRUN_PID": "1"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux only")
    assert got.returncode == 1 and "started" not in got.stdout
    assert "ringbench: torchrun (pid 1) has ended; this rank does not start" in got.stderr


#: Busy-loop processes the load test starts beside the sweep, on however many cores there are.
BUSY_PROCESSES = 8
#: The load test's own limit: the sweep under load takes minutes, past COMMAND_TIMEOUT_S.
LOADED_COMMAND_TIMEOUT_S = 1800


@pytest.mark.dist
@pytest.mark.slow
def test_survival_default_watchdog_kills_no_case_under_load(tmp_path):
    """Issue 27: a default CPU verify with W=4 launches, beside 8 busy processes, records no timeout (W=4 alone:
    its four ranks on the shared cores are the tighter case of the two default world sizes)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(BUSY_PROCESSES)]
    try:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringbench.cli", "verify", "--device", "cpu", "--variant", "ring", "--variant",
             "zigzag", "--world-size", "4", "--seqlen", "1024", "--out", str(tmp_path)],
            cwd=tmp_path, env={**os.environ, **CLI_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=LOADED_COMMAND_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall_s = time.monotonic() - start
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()
    estimate_line = next((line for line in stderr.splitlines() if line.startswith("estimate")), "(none)")
    print(f"under {BUSY_PROCESSES} busy processes: wall {wall_s:.0f} s; {estimate_line}")
    records = read_jsonl(tmp_path / "verify.jsonl")
    statuses = collections.Counter(r["status"] for r in records)
    assert len(records) == 2 and statuses["timeout"] == 0, (statuses, stderr[-3000:])
    assert proc.returncode == 0 and statuses == {"ok": len(records)}, (proc.returncode, statuses, stderr[-3000:])
