"""report.py: the run and verify tables, the verify summary and JUnit XML."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

from ringbench import report

SPEC = {"task": "verify", "variant": "zigzag", "kernel": "cpu", "device": "cpu", "world_size": 2,
        "batch": 1, "seqlen": 16384, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "dtype": "bf16", "causal": True, "mode": "fwd_bwd", "iters": 10, "warmup": 3, "seed": 0}
ENV = {"python": "3.12.1", "torch": "2.13.0", "gpu_name": None, "hostname": "box",
       "git_commit": "abc123"}


def _check(tensor: str, err: float, allowed: float = 1e-3, **kw) -> dict:
    passed = math.isfinite(err) and err <= allowed
    return {"tensor": tensor, "err": err, "err_single": allowed / 2, "floor": 0.0,
            "allowed": allowed, "ratio": err / allowed, "mean_err": err / 10,
            "mean_err_single": allowed / 20, "finite": math.isfinite(err), "dtype_ok": True,
            "shape_ok": True, "passed": passed, **kw}


def _verify(status: str, checks=(), reason=None, **spec) -> dict:
    return {"schema_version": 1, "task": "verify", "run_id": "r", "case_id": "c",
            "spec": {**SPEC, **spec}, "status": status, "reason": reason, "kernel": "cpu",
            "checks": list(checks), "env": ENV}


def _records() -> list[dict]:
    return [
        _verify("ok", [_check("out", 1e-4), _check("dq", 5e-4)]),
        _verify("fail", [_check("out", 1e-4), _check("dq", 3e-3), _check("dk", math.nan)],
                reason="2 tensors over allowance", variant="ring"),
        _verify("timeout", reason="no progress for 600 s at case 3", seqlen=131072),
        _verify("skipped", reason="flash-attn is not installed", kernel="flash-attn"),
    ]


def _render(fn, records) -> str:
    console = Console(record=True, width=200)
    fn(records, console)
    return console.export_text()


@pytest.mark.parametrize("n, text", [(16384, "16k"), (131072, "128k"), (1048576, "1M"),
                                     (3000, "3000"), (1024, "1k"), (0, "0"), (1536, "1536"),
                                     (3 * 2**20, "3M")])
def test_format_size_binary_units(n, text):
    assert report.format_size(n) == text


def test_report_case_label_names_the_shape():
    label = report.case_label(_verify("ok"))
    assert label == "zigzag W=2 S=16k H=32/8 D=128 bf16 causal cpu"
    assert report.case_label(_verify("ok", mode="fwd", causal=False)).endswith("non-causal cpu fwd")


def test_report_verify_table_shows_fail_for_failing_check():
    text = _render(report.print_verify_table, _records())
    dq_ring = next(line for line in text.splitlines() if "dq" in line and "3.000e-03" in line)
    assert "FAIL" in dq_ring and "PASS" not in dq_ring
    assert "3.00" in dq_ring  # ratio err / allowed
    dk_ring = next(line for line in text.splitlines() if " dk " in line)
    assert "FAIL" in dk_ring and "non-finite" in dk_ring and "nan" in dk_ring
    assert text.count("PASS") == 3  # out and dq of zigzag, out of ring
    assert "no progress for 600 s" in text and "timeout" in text
    assert "4 cases: 1 passed, 1 failed, 1 errors, 1 skipped" in text


def test_report_verify_summary_counts_ok_with_bad_check_as_failed():
    records = _records() + [_verify("ok", [_check("lse", 1.0)]), _verify("ok", [])]
    assert report.verify_summary(records) == {"cases": 6, "passed": 1, "failed": 2,
                                              "errors": 2, "skipped": 1}


def test_report_junit_round_trip_counts_and_messages(tmp_path):
    path = tmp_path / "ci" / "junit.xml"
    report.write_junit(_records(), path)
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert suite.get("name") == "ringbench.verify"
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"),
            suite.get("skipped")) == ("4", "1", "1", "1")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["torch"] == "2.13.0" and props["git_commit"] == "abc123"
    assert props["gpu_name"] == ""
    cases = suite.findall("testcase")
    assert [c.get("classname") for c in cases] == [
        "ringbench.verify.zigzag", "ringbench.verify.ring", "ringbench.verify.zigzag",
        "ringbench.verify.zigzag"]
    assert cases[0].get("name") == "zigzag W=2 S=16k H=32/8 D=128 bf16 causal cpu"
    assert list(cases[0]) == []  # a pass has no child element
    failure = cases[1].find("failure").get("message")
    assert failure.startswith("2 of 3 tensors over allowance")
    assert "dq: err 3.000e-03 > allowed 1.000e-03" in failure
    assert "dk: err nan > allowed 1.000e-03 (non-finite values)" in failure
    assert "out:" not in failure
    error = cases[2].find("error")
    assert error.get("type") == "timeout" and "no progress" in error.get("message")
    assert cases[3].find("skipped") is not None


def test_report_run_table_shows_figures_and_reasons():
    ok = {"spec": {**SPEC, "task": "run", "seqlen": 131072}, "status": "ok", "kernel": "cudnn",
          "time_ms": 12.3456, "imbalance": 1.0213, "tflops_per_gpu": 512.34, "efficiency": 0.9876,
          "peak_allocated_gib": 10.5, "bus_gib_s": None}
    oom = {"spec": {**SPEC, "task": "run", "variant": "ring"}, "status": "oom", "kernel": "cudnn",
           "reason": "CUDA out of memory on rank 1"}
    text = _render(report.print_run_table, [ok, oom])
    row = next(line for line in text.splitlines() if "128k" in line)
    for cell in ("zigzag", "cudnn", "32/8", "causal", "fwd_bwd", "12.35", "1.021", "512.3",
                 "0.988", "10.50"):
        assert cell in row, (cell, row)
    oom_row = next(line for line in text.splitlines() if "oom" in line)
    assert "CUDA out of memory on rank 1" in oom_row
    assert oom_row.count(" - ") >= 5  # its missing figures show as "-"
