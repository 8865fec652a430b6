"""Every row of docs/operations.md's exit-code table of ``run`` and ``verify``, one test per row, through the CLI.

0 every case passed; 1 a case failed and every case was reported by its own launch; 2 bad
input; 3 a launch failed or timed out before a case reported (a killed rank: its case's record
says ``error``, and the command exits 3); 130 Ctrl-C; 143 SIGTERM. The CLI gets a stand-in
launcher (typer's context object) that writes the records the workers would; the killed rank
is also run for real, under torchrun, in ``test_cli_e2e.py`` (its exit code 3, its record and
the fresh launch of the case after it).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import read_jsonl
from ringbench.cli import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
#: Every launch here is a stand-in's: the CPU rate is measured once, not before each (conftest.py).
pytestmark = pytest.mark.usefixtures("rate_measured_once")

#: Three small CPU cases of one launch (world size 2).
THREE = ["run", "--variant", "ring", "--variant", "zigzag", "--variant", "stripe", "--device", "cpu",
         "--world-size", "2", "--seqlen", "1k", "--json"]
#: What launch reports for a rank that was killed (no error file: torchrun's own log).
KILLED = ("torchrun exited with status 1 and no rank left an error; end of logs/torchrun.stderr.log:\n"
          "  exitcode  : -9 (pid: 4242)\n  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 4242")


@dataclass
class Result:
    returncode: int
    timed_out: bool
    log_dir: Path | None
    failure: str | None


class Launcher:
    """Stands in for ``ringbench.sweep.launch``: each launch writes the records its cases get from
    ``outcome(case, launch_number)`` (None: the case never reports) and returns ``result(n)``."""

    def __init__(self, outcome=lambda case, n: "ok", result=lambda n: None, during=None):
        self.outcome, self.result, self.during = outcome, result, during
        self.launches: list[list[str]] = []

    def launch(self, cases, *, world_size, device, results_path, run_id, timeout_s, on_poll=None, **nodes):
        from ringbench.records import build as records, store as results
        from ringbench.case.spec import CaseSpec

        n = len(self.launches)
        self.launches.append([c["variant"] for c in cases])
        for case in cases:
            if self.during is not None:
                self.during(case)
            status = self.outcome(case, n)
            if status is None:
                break  # the job died in this case: none after it reports either
            results.append_record(results_path, records.build(CaseSpec.from_dict(case), run_id=run_id,
                                                              status=status, reason=None if status == "ok" else "why"))
            if on_poll is not None:
                on_poll()
        return self.result(n) or Result(0, False, None, None)


def invoke(args, launcher, tmp_path):
    return runner.invoke(app, [*args, "--out", str(tmp_path)], obj=launcher)


def statuses(tmp_path: Path, name: str = "runs.jsonl") -> dict[str, str]:
    path = tmp_path / name
    return {r["spec"]["variant"]: r["status"] for r in read_jsonl(path)} if path.exists() else {}


def test_exit_0_every_case_passed(tmp_path):
    result = invoke(THREE, Launcher(), tmp_path)
    assert result.exit_code == 0, result.output
    assert statuses(tmp_path) == {"ring": "ok", "zigzag": "ok", "stripe": "ok"}


@pytest.mark.parametrize("status", ["fail", "oom", "error"])
def test_exit_1_a_case_failed_and_every_case_was_reported(tmp_path, status):
    launcher = Launcher(outcome=lambda case, n: status if case["variant"] == "zigzag" else "ok")
    result = invoke(THREE, launcher, tmp_path)
    assert result.exit_code == 1, result.output
    assert statuses(tmp_path) == {"ring": "ok", "zigzag": status, "stripe": "ok"}
    assert launcher.launches == [["ring", "zigzag", "stripe"]]  # one launch, ended well


def test_exit_2_bad_input_is_refused_before_anything_starts(tmp_path):
    launcher = Launcher()
    result = invoke(["run", "--variant", "ring", "--device", "cpu", "--world-size", "2", "--seqlen", "1001"],
                    launcher, tmp_path)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("seqlen 1001 is not a multiple of world_size = 2, which ring needs; "
                                     "use 1002")
    assert launcher.launches == [] and statuses(tmp_path) == {}


def test_exit_3_a_killed_rank_records_error_and_the_sweep_goes_on(tmp_path):
    """The rank running zigzag is killed: the sweep records zigzag as error with the launch's
    failure, runs stripe in a fresh launch, and exits 3 although every status is one of the exit-1
    statuses of docs/operations.md's table."""
    log_dir = tmp_path / "logs" / "000-w2"
    (log_dir / "progress").mkdir(parents=True)
    (log_dir / "progress" / "rank1.txt").write_text("2026-12-01T00:00:00+00:00 case 2/3 start zigzag S=1024\n")
    launcher = Launcher(outcome=lambda case, n: None if n == 0 and case["variant"] == "zigzag" else "ok",
                        result=lambda n: Result(1, False, log_dir, KILLED) if n == 0 else None)
    result = invoke(THREE, launcher, tmp_path)
    assert result.exit_code == 3, result.output
    assert statuses(tmp_path) == {"ring": "ok", "zigzag": "error", "stripe": "ok"}
    killed = next(r for r in read_jsonl(tmp_path / "runs.jsonl") if r["spec"]["variant"] == "zigzag")
    assert "Signal 9 (SIGKILL)" in killed["reason"]
    assert launcher.launches == [["ring", "zigzag", "stripe"], ["stripe"]]
    assert "the case after it goes to a fresh launch" in result.stderr


def _interrupted_by(sig: int):
    def during(case):
        if case["variant"] == "zigzag":
            if sig == signal.SIGINT:
                raise KeyboardInterrupt  # what Ctrl-C raises in the CLI's process
            os.kill(os.getpid(), sig)  # the sweep's SIGTERM handler stops the launch
            time.sleep(5)  # not reached: the handler raises first
    return during


def test_exit_130_ctrl_c_keeps_the_records_written(tmp_path):
    result = invoke(THREE, Launcher(during=_interrupted_by(signal.SIGINT)), tmp_path)
    assert result.exit_code == 130, result.output
    assert statuses(tmp_path) == {"ring": "ok"}
    assert re.search(r"^interrupted: 1 of 3 cases has a record in .*runs\.jsonl; to run the others: "
                     r"ringbench .*--resume$", result.stderr, re.M), result.stderr


def test_exit_143_sigterm_keeps_the_records_written(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    result = invoke(THREE, Launcher(during=_interrupted_by(signal.SIGTERM)), tmp_path)
    assert result.exit_code == 143, result.output
    assert statuses(tmp_path) == {"ring": "ok"}
    assert "interrupted: 1 of 3 cases has a record" in result.stderr
    assert signal.getsignal(signal.SIGTERM) == previous  # the sweep put the handler back
