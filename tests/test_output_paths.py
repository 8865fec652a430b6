"""Output paths are checked before any process starts (issue 27, a new user's items 3 and 10): a
results file that is a folder or read-only, a folder that cannot be written in, ``compare --plot`` /
``--markdown`` to a folder or an unwritable place, and ``--out ""``. Each is refused in one sentence
with exit code 2, before a launch, instead of a traceback after the work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringbench.cli import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
#: Every launch here is a stand-in's: the CPU rate is measured once, not before each (conftest.py).
pytestmark = pytest.mark.usefixtures("rate_measured_once")

RUN = ["run", "--variant", "ring", "--device", "cpu", "--world-size", "2", "--seqlen", "1k"]
VERIFY = ["verify", "--variant", "ring", "--device", "cpu", "--world-size", "2", "--seqlen", "1k"]


class NoLaunch:
    """A launcher that fails the test if the CLI gets as far as starting a process."""

    def launch(self, *args, **kwargs):
        raise AssertionError("a process was started before the output paths were checked")


def _refused(args: list[str], pattern: str) -> str:
    result = runner.invoke(app, args, obj=NoLaunch())
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert re.search(pattern, message), message
    assert len(message.splitlines()) == 1 and "Traceback" not in result.output
    return message


@pytest.fixture
def in_tmp(monkeypatch, tmp_path) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _read_only_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    path.chmod(0o444)
    return path


@pytest.mark.parametrize("task, args, name", [("run", RUN, "runs.jsonl"), ("verify", VERIFY, "verify.jsonl")])
def test_out_whose_results_file_is_a_folder_is_refused_before_launch(in_tmp, task, args, name):
    (in_tmp / "D" / name).mkdir(parents=True)
    _refused([*args, "--out", "D"], rf"^out 'D' holds {name}, which ringbench cannot append to \(it is a folder\); "
                                    r"pass --out with another folder$")


def test_out_whose_results_file_is_read_only_is_refused_before_launch(in_tmp):
    _read_only_file(in_tmp / "D" / "runs.jsonl")
    _refused([*RUN, "--out", "D"], r"^out 'D' holds runs.jsonl, which ringbench cannot append to \(the file is "
                                   r"read-only\); pass --out with another folder$")


def test_out_folder_that_cannot_be_written_is_refused_before_launch(in_tmp):
    (in_tmp / "afile").write_text("")  # a folder under a file cannot be made, root or not
    _refused([*RUN, "--out", "afile/results"], r"^out 'afile/results' is not a folder ringbench can write in "
                                               r"\(.+\); pass --out with a writable folder$")
    (in_tmp / "ro").mkdir()
    (in_tmp / "ro").chmod(0o555)
    _refused([*RUN, "--out", "ro"], r"^out 'ro' is not a folder ringbench can write in \(the folder is "
                                    r"read-only\); pass --out with a writable folder$")


@pytest.mark.parametrize("command", [RUN, VERIFY, ["matrix", "--variant", "ring", "--world-size", "2"]])
def test_empty_out_is_refused_not_written_to_the_working_folder(in_tmp, command):
    _refused([*command, "--out", ""], r"^out '' names no folder; pass --out with a folder, such as results$")
    assert list(in_tmp.iterdir()) == []


def test_matrix_out_whose_files_cannot_be_written_is_refused(in_tmp):
    _read_only_file(in_tmp / "M" / "matrix.md")
    _refused(["matrix", "--variant", "ring", "--world-size", "2", "--out", "M"],
             r"^out 'M' holds matrix.md, which ringbench cannot append to \(the file is read-only\)")


@pytest.fixture
def runs(in_tmp) -> Path:
    path = in_tmp / "runs.jsonl"
    path.write_text(json.dumps({"task": "run", "status": "ok", "spec": {"variant": "ring", "seqlen": 1024}}) + "\n")
    return path


@pytest.mark.parametrize("option, suffix", [("--plot", ".png"), ("--markdown", ".md")])
def test_compare_output_to_a_folder_or_unwritable_place_is_refused(runs, in_tmp, option, suffix):
    folder = in_tmp / f"out{suffix}"
    folder.mkdir()
    _refused(["compare", str(runs), option, str(folder)],
             rf"^{option} '{re.escape(str(folder))}' cannot be written \(it is a folder\); pass {option} with a "
             rf"writable file path, such as compare{re.escape(suffix)}$")
    (in_tmp / "afile").write_text("")
    _refused(["compare", str(runs), option, f"afile/t{suffix}"],
             rf"^{option} 'afile/t{re.escape(suffix)}' cannot be written \(.+\); pass {option} with a writable")
    _read_only_file(in_tmp / f"old{suffix}")
    _refused(["compare", str(runs), option, f"old{suffix}"], r"\(the file is read-only\)")


class Recorder:
    """A launcher stand-in: writes each case's ok record, as the workers would."""

    def launch(self, cases, *, world_size, device, results_path, run_id, timeout_s, on_poll=None):
        from ringbench.case.spec import CaseSpec
        from ringbench.records import build as records, store as results

        for case in cases:
            results.append_record(results_path, records.build(CaseSpec.from_dict(case), run_id=run_id, status="ok",
                                                              fields={"time_ms": 1.0, "tflops_per_gpu": 1.0}))
        return type("Result", (), {"returncode": 0, "timed_out": False, "log_dir": None, "failure": None})()


def test_window_at_or_above_seqlen_is_no_window_with_a_note(in_tmp):
    """`--window 1M --seqlen 1k` was a case apart from no window, while compare showed `window=0` for none
    (issue 27): it is now the no-window case, said in a note, and compare names it `no window`."""
    args = ["run", "--variant", "zigzag", "--device", "cpu", "--world-size", "2", "--seqlen", "1k", "--iters", "1",
            "--warmup", "0", "--out", "D"]
    for extra in (["--window", "1M"], [], ["--window", "1k"], ["--window", "512"]):
        result = runner.invoke(app, [*args, *extra], obj=Recorder())
        assert result.exit_code == 0, result.output
        note = re.search(r"window (\S+) is at or above seqlen 1024, so each query sees every key before it: the "
                         r"same case as no window, which it is run and recorded as", result.stderr)
        assert bool(note) == (extra in (["--window", "1M"], ["--window", "1k"])), result.stderr
    records = [json.loads(line) for line in (in_tmp / "D" / "runs.jsonl").read_text().splitlines()]
    assert [r["spec"]["window"] for r in records] == [0, 0, 0, 512]
    assert len({r["case_id"] for r in records[:3]}) == 1 and records[3]["case_id"] != records[0]["case_id"]
    assert runner.invoke(app, [*args, "--window", "0"]).exit_code == 2  # 0 stays refused
    table = runner.invoke(app, ["compare", "D", "--by", "variant,window", "--json"])
    assert table.exit_code == 0, table.output
    rows = [json.loads(line) for line in table.stdout.splitlines()]
    assert "window=0" not in table.stdout, table.stdout
    assert len(rows) == 2, rows
    table = runner.invoke(app, ["compare", "D", "--by", "variant,window"])
    assert re.search(r"zigzag +none ", table.stdout) and not re.search(r"zigzag +0 ", table.stdout), table.stdout
