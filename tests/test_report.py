"""report.py: the run and verify tables, the verify summary and JUnit XML."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
from rich.console import Console

from ringbench.present import report

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
    assert "4 cases: 1 passed, 1 failed, 1 error, 1 skipped" in text


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
    assert failure.startswith("2 of 3 tensors failed")
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
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if "128k" in line)
    row = lines[i] + lines[i + 1]  # variant over kernel, sizes over dtype, mask and mode
    for cell in ("zigzag", "W2 128k 32/8×128", "ok", "12.35", "1.021", "512.3", "0.988",
                 "10.50", "cudnn", "bf16 causal fwd_bwd"):
        assert cell in row, (cell, row)
    oom_row = next(line for line in text.splitlines() if "oom" in line)
    assert "oom [1]" in oom_row and "CUDA" not in oom_row
    assert oom_row.count(" - ") >= 5  # its missing figures show as "-"
    assert text.splitlines()[-1] == "[1] CUDA out of memory on rank 1"


def test_report_case_label_names_a_batch_above_one():
    assert report.case_label(_verify("ok", batch=2)).startswith("zigzag W=2 B=2 S=16k ")


# --------------------------------------------------------------------------- error growth

def _growth_record(world_size: int, errs: dict, **spec) -> dict:
    return _verify("ok", [_check(t, e, allowed=1.0) for t, e in errs.items()],
                   world_size=world_size, **spec)


def _lines_after(text: str, title: str) -> list[list[str]]:
    """The whitespace-split lines of the table whose title starts with ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("error growth:") or not line.strip():
            break
        rows.append(line.split())
    return rows


def test_report_growth_table_ratio_is_worst_over_world_size_one():
    records = [
        _growth_record(1, {"out": 1e-3, "dq": 4e-3}),
        _growth_record(2, {"out": 1.5e-3, "dq": 1e-3}),
        _growth_record(4, {"out": 2e-3, "dq": 2e-3}),
        _verify("error", reason="rank 3 died", world_size=8),  # no checks: no W=8 column
        _growth_record(2, {"out": 1e-3}, variant="ring"),  # no W=1: ratio "-"
        _growth_record(4, {"out": 3e-3}, variant="ring"),
        _growth_record(2, {"out": 9.0}, seqlen=4096),  # one world size only: no table
    ]
    text = _render(report.print_growth_table, records)
    assert text.count("error growth:") == 2
    zigzag = _lines_after(text, "error growth: zigzag S=16k H=32/8 D=128 bf16 causal cpu")
    assert zigzag[0] == ["tensor", "W=1", "W=2", "W=4", "max/W=1"]
    assert ["out", "1.00e-03", "1.50e-03", "2.00e-03", "2.00"] in zigzag
    assert ["dq", "4.00e-03", "1.00e-03", "2.00e-03", "0.50"] in zigzag
    ring = _lines_after(text, "error growth: ring S=16k")
    assert ring[0] == ["tensor", "W=2", "W=4", "max/W=1"]
    assert ["out", "1.00e-03", "3.00e-03", "-"] in ring
    assert "9.00e+00" not in text


def test_report_growth_groups_keep_problems_apart():
    records = [_growth_record(w, {"out": 1e-3}, **spec)
               for spec in ({}, {"dtype": "fp32"}, {"kv_heads": 32}, {"causal": False})
               for w in (1, 2)]
    groups = report.growth_groups(records)
    assert len(groups) == 4 and all(list(by_world) == [1, 2] for _, by_world in groups)


@pytest.mark.parametrize("variant, field, values", [
    ("llama3", "layout", ("zigzag", "contiguous")),
    ("llama3_varlen", "docs", ("4096,12288", "8192,8192")),
])
def test_report_growth_groups_keep_options_and_documents_apart(variant, field, values):
    # Two problems that differ only in a variant option or the documents: each keeps its own
    # records at every world size instead of the last one standing for both.
    records = [_growth_record(w, {"out": 1e-3 * (i + 1) * w}, variant=variant, **{field: value})
               for i, value in enumerate(values) for w in (2, 4)]
    groups = report.growth_groups(records)
    assert [first["spec"][field] for first, _ in groups] == list(values)
    for i, (_, by_world) in enumerate(groups):
        assert {w: r["checks"][0]["err"] for w, r in by_world.items()} == {2: 2e-3 * (i + 1), 4: 4e-3 * (i + 1)}
    text = _render(report.print_growth_table, records)
    assert text.count("error growth:") == 2


# --------------------------------------------------------------------------- 80 columns

def _render_80(fn, records) -> str:
    console = Console(record=True, width=80)
    fn(records, console)
    return console.export_text()


def test_report_run_table_fits_80_columns_with_whole_numbers():
    spec = {**SPEC, "task": "run", "variant": "zigzag", "world_size": 8, "seqlen": 2**20,
            "heads": 64, "causal": False}
    ok = {"spec": spec, "status": "ok", "kernel": "torch-flash", "time_ms": 12345.678,
          "imbalance": 1.0213, "tflops_per_gpu": 512.34, "efficiency": 0.9876,
          "peak_allocated_gib": 123.456, "bus_gib_s": 1234.56}
    cpu = {"spec": {**SPEC, "task": "run", "seqlen": 4096}, "status": "ok", "kernel": "cpu",
           "time_ms": 492.83, "imbalance": 1.005, "tflops_per_gpu": 0.015251,
           "efficiency": 0.7742, "peak_allocated_gib": None, "bus_gib_s": 0.0079262}
    oom = {"spec": {**spec, "variant": "ring", "batch": 4}, "status": "oom", "kernel": "cudnn",
           "reason": "CUDA out of memory on rank 1 while allocating 2.00 GiB; logs in "
                     "/tmp/ringbench-logs/0123456789abcdef"}
    text = _render_80(report.print_run_table, [ok, cpu, oom])
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80
    for cell in ("12346", "1.021", "512.3", "0.988", "123.46", "1234.6",  # big figures
                 "492.8", "0.0153", "0.774", "0.00793",  # a CPU run's small rates
                 "W8 1M", "64/8×128", "W8 B4 1M", "torch-flash", "non-causal", "fwd_bwd"):
        assert cell in text, (cell, text)
    assert "oom [1]" in text and "[1] CUDA out of memory on rank 1 while allocating" in text


def test_report_verify_table_fits_80_columns_with_whole_numbers():
    records = [
        _verify("fail", [_check("out", 3.1416), _check("dv", math.inf)], variant="broken_merge",
                kernel="torch-flash", seqlen=2**20, causal=False, batch=2),
        _verify("timeout", reason="no progress for 600 s at case 3; logs in "
                                  "/tmp/ringbench-logs/0123456789abcdef"),
    ]
    text = _render_80(report.print_verify_table, records)
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80
    for cell in ("3.142e+00", "1.000e-03", "3.14e+03", "inf", "FAIL", "timeout"):
        assert cell in text, (cell, text)


def test_report_verify_table_leaves_out_an_empty_note_column():
    text = _render(report.print_verify_table, [_verify("ok", [_check("out", 1e-4)])])
    assert "note" not in text and "PASS" in text


def test_report_run_table_marks_an_emulated_run_and_its_efficiency_as_the_bound():
    emulated = {"spec": {**SPEC, "task": "run", "seqlen": 131072, "emulate": True}, "status": "ok", "kernel": "cudnn",
                "time_ms": 12.3456, "imbalance": 1.0213, "tflops_per_gpu": 512.34, "efficiency": 0.9876,
                "efficiency_bound": 0.9876, "emulated": True, "peak_allocated_gib": 10.5, "bus_gib_s": None}
    real = {**emulated, "spec": {**SPEC, "task": "run"}, "emulated": False}
    real.pop("efficiency_bound")
    text = _render(report.print_run_table, [emulated])
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if "128k" in line)
    row = lines[i] + lines[i + 1]
    assert "≤0.988" in row and "bf16 causal fwd_bwd emulated" in row, row
    assert any(line.startswith("emulated: one process played every rank") for line in lines), text
    text = _render(report.print_run_table, [real])
    assert "emulated" not in text and "≤" not in text and "0.988" in text


def test_report_a_kernel_rule_failure_says_why_in_the_note_and_the_junit_message():
    """A tensor within the max rule that fails the kernel rule read 'FAIL' with an empty note, and the JUnit
    message said 'over allowance: dk: within the max rule'."""
    from ringbench.present.report import _check_notes, _failure_message

    bad = {"tensor": "dk", "err": 4e-2, "allowed": 8e-2, "ratio": 0.5, "finite": True, "dtype_ok": True,
           "shape_ok": True, "passed": False, "kernel_units": 12.6, "kernel_passed": False}
    good = {**bad, "tensor": "dq", "passed": True, "kernel_units": 0.6, "kernel_passed": True}
    assert _check_notes(bad) == "the kernel alone is 12.6 eps off float64, over the kernel rule's limit"
    assert _check_notes(good) == ""
    message = _failure_message({"checks": [good, bad], "status": "fail"})
    assert message == ("1 of 2 tensors failed: dk: within the max rule (the kernel alone is 12.6 eps off float64, "
                       "over the kernel rule's limit)"), message
