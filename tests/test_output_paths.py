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
