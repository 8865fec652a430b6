"""Records: one builder for every status, and records written before the restructure still load and resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ringbench.records import build as records, store as results
from ringbench.case.spec import CaseSpec, default_fields

DATA = Path(__file__).parent / "data"
#: The commands that wrote tests/data/main-2026-12-01.runs.jsonl (tests/data/README.md), as case options.
OLD_RUNS = [
    {"variant": ["zigzag"], "seqlen": 256, "heads": 2, "kv_heads": 1, "head_dim": 16, "iters": 2, "warmup": 1},
    {"variant": ["llama3"], "layout": "contiguous", "heads_k_stride": 1, "seqlen": 256, "heads": 2, "kv_heads": 2,
     "head_dim": 16, "iters": 2, "warmup": 1},
    {"variant": ["zigzag_varlen"], "docs": "128,64,64", "seqlen": 256, "heads": 2, "kv_heads": 1, "head_dim": 16,
     "iters": 2, "warmup": 1},
]


class NoLaunch:
    """A launcher that fails the test if the sweep asks it to start anything."""

    def launch(self, cases, **kwargs):
        raise AssertionError(f"launched {len(cases)} cases that --resume should have skipped")


def _case(task="run", **changes) -> CaseSpec:
    return CaseSpec.from_dict({"task": task, "variant": "zigzag", **default_fields("cpu", 0), "kernel": "cpu",
                               **changes})


@pytest.mark.parametrize("name", ["main-2026-12-01.runs.jsonl", "main-2026-12-01.verify.jsonl"])
def test_records_written_before_the_restructure_load_with_the_same_case_id(name):
    old = results.read_records(DATA / name)
    assert old
    for record in old:
        assert record["schema_version"] == records.SCHEMA_VERSION
        assert CaseSpec.from_dict(record["spec"]).case_id() == record["case_id"]
        if record["task"] == "run":
            # The fields the builder gives a case that reported none; the peak, the profile and the
            # spread of the timing (issue 25) came after these records.
            later = {"peak_tflops", "peak_source", "per_rank_busy_ms", "busy_imbalance", "profile", "time_ms_p20",
                     "time_ms_p80", "per_rank_time_ms_p20", "per_rank_time_ms_p80", "timed_iters",
                     "ref_time_ms_p20", "ref_time_ms_p80", "ref_timed_iters", "l2_flush_bytes",
                     "per_rank_ref_time_ms"}
            assert set(records.RUN_FIELDS) - later <= record.keys()
    frame = results.load(DATA / name)
    assert len(frame) == len(old) and "spec.seqlen" in frame.columns


def test_records_resume_skips_the_cases_of_records_written_before_the_restructure(tmp_path, capsys):
    from ringbench.sweep import build, run as sweep

    shutil.copy(DATA / "main-2026-12-01.runs.jsonl", tmp_path / "runs.jsonl")
    # Written on a CPU machine: the same options there give the same specs, wherever this runs.
    cases = [c for given in OLD_RUNS for c in build.cases_for("run", {**given, "device": "cpu"})[0]]
    outcome = sweep.run_sweep(cases, task="run", out=tmp_path, resume=True, launcher=NoLaunch())
    assert outcome.exit_code == 0 and outcome.written == 0
    assert [r["case_id"] for r in outcome.records] == [r["case_id"] for r in results.read_records(tmp_path / "runs.jsonl")]
    assert "--resume: 3 of 3 cases already have an ok record" in capsys.readouterr().err


@pytest.mark.parametrize("status", records.STATUSES)
def test_records_build_gives_every_status_the_same_fields(status):
    for task in ("run", "verify"):
        case = _case(task)
        record = records.build(case, run_id="r", status=status, reason=None if status == "ok" else "why",
                               env={"torch": "x"})
        assert record["status"] == status and record["case_id"] == case.case_id() and record["spec"] == case.to_dict()
        assert record["schema_version"] == records.SCHEMA_VERSION and record["env"]["kernel"] == "cpu"
        if task == "run":
            assert set(records.RUN_FIELDS) <= record.keys() and record["flops_convention"] == "flash-attn"
        else:
            assert record["checks"] == [] and record["cp_active"] is None


def test_records_build_refuses_an_unknown_status():
    with pytest.raises(ValueError, match=r"^status 'done' is unknown; use one of ok, fail, oom"):
        records.build(_case(), run_id="r", status="done")


def test_records_out_of_memory_is_classified_once_by_type_and_by_text():
    class OutOfMemoryError(RuntimeError):  # torch.cuda.OutOfMemoryError's name, without torch
        pass

    assert records.status_of_exception(OutOfMemoryError("no room")) == "oom"
    assert records.status_of_exception(RuntimeError("no room")) == "error"
    assert records.status_of_exception(RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: "
                                                    "can't allocate memory: you tried to allocate 8 GB")) == "oom"
    assert records.status_of_failure(False, "[rank 1/2] torch.OutOfMemoryError: CUDA out of memory") == "oom"
    assert records.status_of_failure(False, "[rank 1/2] RuntimeError: boom") == "error"
    assert records.status_of_failure(True, None) == "timeout"


@pytest.mark.parametrize("record, done", [
    ({"status": "ok", "task": "run"}, True),
    ({"status": "fail", "task": "run"}, False),
    ({"status": "ok", "task": "verify", "checks": [{"passed": True}]}, True),
    ({"status": "ok", "task": "verify", "checks": [{"passed": True}, {"passed": True, "finite": False}]}, False),
    ({"status": "ok", "task": "verify", "checks": []}, False),
])
def test_records_done_is_decided_once(record, done):
    assert records.is_done(record) is done
