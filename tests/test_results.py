"""The record store: append-only JSON Lines, safe under concurrent writers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from ringbench.records import store as results

REPO = Path(__file__).resolve().parents[1]


def _record(i: int, **extra) -> dict:
    return {"task": "run", "run_id": "r1", "case_id": f"c{i}", "status": "ok",
            "spec": {"variant": "ring", "seqlen": 1024 * (i + 1), "world_size": 2},
            "env": {"torch": "2.13", "hostname": "h"}, **extra}


def test_results_append_round_trip_adds_schema_version(tmp_path):
    path = tmp_path / "deep" / "er" / "out.jsonl"
    rec = _record(0, time_ms=1.5)
    results.append_record(path, rec)
    results.append_record(path, _record(1, schema_version=7))
    got = results.read_records(path)
    assert [r["case_id"] for r in got] == ["c0", "c1"]
    assert got[0]["schema_version"] == results.SCHEMA_VERSION
    assert got[1]["schema_version"] == 7  # an explicit version is kept
    assert got[0]["time_ms"] == 1.5 and "created_at" in got[0]
    assert "schema_version" not in rec  # the caller's dict is untouched
    assert path.read_text().count("\n") == 2


def test_results_nonfinite_stored_as_null_and_restored(tmp_path):
    path = tmp_path / "out.jsonl"
    rec = _record(0, checks=[{"tensor": "dq", "err": math.nan, "allowed": 1e-3},
                             {"tensor": "dk", "err": math.inf, "allowed": -math.inf}])
    results.append_record(path, rec)
    line = json.loads(path.read_text())  # strict JSON: no NaN tokens in the file
    assert line["checks"][0]["err"] is None
    assert {"path": ["checks", 1, "err"], "value": "inf"} in line["nonfinite"]
    got = results.read_records(path)[0]
    assert math.isnan(got["checks"][0]["err"])
    assert got["checks"][1]["err"] == math.inf and got["checks"][1]["allowed"] == -math.inf
    assert "nonfinite" not in got


def test_results_unserialisable_value_names_field(tmp_path):
    with pytest.raises(ValueError, match=r"spec\.kernel holds a object"):
        results.append_record(tmp_path / "x.jsonl", {"spec": {"kernel": object()}})
    assert not (tmp_path / "x.jsonl").exists()


def test_results_missing_file_reads_empty(tmp_path):
    assert results.read_records(tmp_path / "nope.jsonl") == []


def test_results_corrupt_line_skipped_with_warning(tmp_path):
    path = tmp_path / "out.jsonl"
    results.append_record(path, _record(0))
    with open(path, "a") as f:
        f.write('{"task": "run", "trunc\n')  # line 2: a record cut short
        f.write("[1, 2]\n")                   # line 3: JSON, but not a record
    results.append_record(path, _record(3))
    with pytest.warns(RuntimeWarning) as caught:
        got = results.read_records(path)
    assert [r["case_id"] for r in got] == ["c0", "c3"]
    messages = [str(w.message) for w in caught]
    assert any(m.startswith(f"skipped line 2 of {path}, which is not a whole JSON record (") for m in messages), messages
    assert f"skipped line 3 of {path}, which is a JSON list, not a record object" in messages, messages


def test_results_append_after_torn_line_starts_new_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"task": "run", "cut')  # a writer died without its newline
    results.append_record(path, _record(1))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = results.read_records(path)
    assert [r["case_id"] for r in got] == ["c1"]


def test_results_concurrent_append_keeps_every_line(tmp_path):
    path = tmp_path / "shared.jsonl"
    # Big records (~20 KB) make an interleaved write likely if the locking were wrong.
    script = textwrap.dedent("""
        import sys
        from ringbench.records import store as results
        who, path = sys.argv[1], sys.argv[2]
        for i in range(200):
            results.append_record(path, {"writer": who, "i": i, "pad": who * 20000})
    """)
    env = {"PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", script, who, str(path)], env=env)
             for who in ("a", "b")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    lines = path.read_text().splitlines()
    assert len(lines) == 400
    parsed = [json.loads(line) for line in lines]  # every line is whole
    for who in ("a", "b"):
        assert sorted(r["i"] for r in parsed if r["writer"] == who) == list(range(200))


def test_results_load_flattens_nested_and_keeps_checks(tmp_path):
    checks = [{"tensor": "out", "err": 1e-3, "passed": True}]
    results.append_record(tmp_path / "a.jsonl", _record(0, checks=checks))
    results.append_record(tmp_path / "sub" / "b.jsonl", _record(1, checks=checks))
    (tmp_path / "notes.txt").write_text("not a record file")
    df = results.load(tmp_path)
    assert len(df) == 2
    assert list(df["spec.seqlen"]) == [1024, 2048]
    assert list(df["env.torch"]) == ["2.13", "2.13"]
    assert "spec" not in df.columns
    assert df["checks"].iloc[0] == checks
    assert df["source"].iloc[1].endswith("b.jsonl")
    # A single file and a list of files work too.
    assert len(results.load(tmp_path / "a.jsonl")) == 1
    assert len(results.load([tmp_path / "a.jsonl", str(tmp_path / "sub" / "b.jsonl")])) == 2


def test_results_load_missing_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        results.load(tmp_path / "typo.jsonl")


def test_results_load_empty_folder_gives_empty_frame(tmp_path):
    assert results.load(tmp_path).empty


def test_results_read_records_from_follows_appends_whole_lines_only(tmp_path):
    path = tmp_path / "r.jsonl"
    assert results.read_records_from(path, 0) == ([], 0)
    results.append_record(path, {"case_id": "a"})
    first, offset = results.read_records_from(path, 0)
    assert [r["case_id"] for r in first] == ["a"] and offset == path.stat().st_size
    results.append_record(path, {"case_id": "b"})
    with open(path, "ab") as f:
        f.write(b'{"case_id": "c"')  # a line still being written
    second, offset2 = results.read_records_from(path, offset)
    assert [r["case_id"] for r in second] == ["b"]
    with open(path, "ab") as f:
        f.write(b"}\n")
    third, _ = results.read_records_from(path, offset2)
    assert [r["case_id"] for r in third] == ["c"]
    assert [r["case_id"] for r in results.read_records(path)] == ["a", "b", "c"]
