"""Peaks (ringbench/rank/peaks.py): the datasheet table and its name matcher, the measured peak of a
device the table lacks (every CPU), and the refusal of a result above either, in one sentence."""

from __future__ import annotations

import pytest
import torch

from ringbench.rank import peaks
from ringbench.rank.bench import bench_case, refusal
from ringbench.rank.peaks import Peak, case_peak, match_datasheet, measured_peak, table_peak


@pytest.fixture(autouse=True)
def fresh_measurements(monkeypatch):
    """Every test measures for itself: no peak kept from another test."""
    monkeypatch.setattr(peaks, "_MEASURED", {})


# --------------------------------------------------------------------------- the table

@pytest.mark.parametrize("name, entry, bf16, fp32", [
    # As torch.cuda.get_device_name() gives them.
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 494.7),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5),
    ("NVIDIA H200", "H200 SXM", 989.4, 494.7),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 417.5),
    ("NVIDIA H20", "H20", 148, 74),
    ("NVIDIA H800", "H800 SXM", 989.4, 494.7),
    ("NVIDIA GH200 480GB", "GH200", 989.4, 494.7),
    ("NVIDIA B200", "B200", 2250, 1100),
    ("NVIDIA GB200", "GB200", 2500, 1250),
    ("NVIDIA A100-SXM4-80GB", "A100", 312, 156),
    ("NVIDIA A100-SXM4-40GB", "A100", 312, 156),
    ("NVIDIA A100-PCIE-40GB", "A100", 312, 156),
    ("NVIDIA A100 80GB PCIe", "A100", 312, 156),
    ("NVIDIA A800-SXM4-80GB", "A800", 312, 156),
    ("NVIDIA L40S", "L40S", 366, 183),
    ("NVIDIA L40", "L40", 181.05, 90.5),
    ("NVIDIA L4", "L4", 121, 60),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 364.2, 182.1),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2, 82.6),
    ("AMD Instinct MI300X", "MI300X", 1307.4, 653.7),
    ("AMD Instinct MI300X VF", "MI300X", 1307.4, 653.7),
    ("AMD Instinct MI250X / MI250", "MI250X", 383, 95.7),  # no TF32: fp32 is the matrix peak
    ("AMD Instinct MI210", "MI210", 181, 45.3),
])
def test_peaks_match_the_names_torch_gives(name, entry, bf16, fp32):
    found = match_datasheet(name)
    assert found is not None and found.name == entry
    assert table_peak(name, "bf16").tflops == bf16
    assert table_peak(name, "fp32").tflops == fp32  # the TF32 figure where the GPU has TF32


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 3090", "NVIDIA H1000", "Intel(R) Data Center GPU Max 1550",
                                  "", None])
def test_peaks_unknown_names_have_no_table_peak(name):
    assert match_datasheet(name) is None
    assert table_peak(name, "bf16") is None


def test_peaks_similar_names_do_not_take_each_others_entry():
    assert [match_datasheet(n).name for n in ("NVIDIA H20", "NVIDIA H200", "NVIDIA L4", "NVIDIA L40",
                                               "NVIDIA L40S", "NVIDIA B200", "NVIDIA GB200")] == [
        "H20", "H200 SXM", "L4", "L40", "L40S", "B200", "GB200"]


def test_peaks_a_dtype_the_datasheet_lacks_has_no_table_peak():
    assert table_peak("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores: measured instead
    assert table_peak("Tesla V100-SXM2-16GB", "fp16").tflops == 125
    assert table_peak("NVIDIA L40S", "fp64") is None
    assert table_peak("NVIDIA H100 80GB HBM3", "fp64").tflops == 66.9  # FP64 tensor cores
    assert table_peak("NVIDIA GeForce RTX 4090", "fp16").tflops == 330.3  # fp16 accumulation, the faster


def test_peaks_every_entry_is_dense_and_ordered():
    for entry in peaks.DATASHEETS:
        figures = [f for f in (entry.bf16, entry.fp16, entry.tf32, entry.fp32, entry.fp64) if f is not None]
        assert figures and all(f > 0 for f in figures), entry
        if entry.tf32 is not None:
            assert entry.tf32 >= entry.fp32, entry  # fp32's bound is the faster of the two
            assert entry.bf16 >= entry.tf32, entry


# --------------------------------------------------------------------------- the refusal

def test_peaks_refusal_of_a_table_peak_names_the_figure_and_the_datasheet():
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16").refusal(1200.0) == (
        "measured 1200 TFLOP/s per GPU exceeds the dense bf16 peak of 989 TFLOP/s that the H100 SXM datasheet "
        "gives for the NVIDIA H100 80GB HBM3; the result cannot be true, so it is refused")
    assert table_peak("NVIDIA H200", "fp32").refusal(600.0) == (
        "measured 600 TFLOP/s per GPU exceeds the dense fp32 peak (TF32 tensor cores) of 495 TFLOP/s that the "
        "H200 SXM datasheet gives for the NVIDIA H200; the result cannot be true, so it is refused")
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16").refusal(900.0) is None


def test_peaks_refusal_of_a_measured_peak_names_the_matmul_and_the_allowance():
    peak = Peak(tflops=0.05, source="measured", dtype="fp32", device="cpu", device_type="cpu",
                datasheet="fp32 matmul", allowance=3.0)
    assert peak.refusal(0.149) is None
    assert peak.refusal(0.2) == (
        "measured 0.2 TFLOP/s per rank exceeds 3 times the 0.05 TFLOP/s that a fp32 matmul reached on this cpu "
        "in the same launch (the peak was measured, as ringbench's datasheet table has no fp32 figure for it); "
        "the result cannot be true, so it is refused")


def test_peaks_bench_refusal_takes_a_peak_or_a_datasheet_figure():
    peak = table_peak("NVIDIA B200", "bf16")
    assert refusal(tflops=2300.0, peak=peak, bytes_sent=1, world_size=2, variant="ring") == peak.refusal(2300.0)
    assert refusal(tflops=1200.0, peak=989.0, bytes_sent=1, world_size=2, variant="ring") == (
        "measured 1200 TFLOP/s per GPU exceeds the dense peak of 989 TFLOP/s from ringbench's datasheet table; "
        "the result cannot be true, so it is refused")
    assert refusal(tflops=1e9, peak=None, bytes_sent=1, world_size=2, variant="ring") is None


# --------------------------------------------------------------------------- measured peaks

def test_peaks_cpu_is_measured_once_per_process_with_a_matmul():
    cpu = torch.device("cpu")
    peak = measured_peak(cpu, "fp32")
    assert peak.source == "measured" and peak.tflops > 0 and peak.device == "cpu" and peak.device_type == "cpu"
    assert peak.datasheet == "fp32 matmul" and peak.allowance == peaks.MEASURED_ALLOWANCE["cpu"] == 3.0
    assert measured_peak(cpu, "fp32") is peak  # kept: once per launch


def test_peaks_cpu_reduced_precision_takes_the_faster_of_its_dtype_and_fp32(monkeypatch):
    rates = {"bf16": 0.01, "fp32": 0.04}
    monkeypatch.setattr(peaks, "matmul_tflops", lambda device, dtype: rates[dtype])
    peak = measured_peak(torch.device("cpu"), "bf16")
    assert (peak.tflops, peak.dtype, peak.datasheet) == (0.04, "bf16", "fp32 matmul")


def test_peaks_are_measured_again_before_a_result_above_them_is_refused(monkeypatch):
    rates = iter([0.01, 0.05, 0.02])  # a busy first measurement, then a fair one, then a busy one
    calls = []

    def matmul(device, dtype):
        calls.append(dtype)
        return next(rates)

    monkeypatch.setattr(peaks, "matmul_tflops", matmul)
    cpu = torch.device("cpu")
    assert case_peak(cpu, "fp32", tflops=0.001).tflops == 0.01  # within 3 x 0.01: measured once
    assert len(calls) == 1
    peak = case_peak(cpu, "fp32", tflops=0.1)  # above 3 x 0.01: measured again, kept at the fastest
    assert peak.tflops == 0.05 and peak.refusal(0.1) is None and len(calls) == 2
    monkeypatch.setattr(peaks, "matmul_tflops", lambda device, dtype: 0.05)
    assert case_peak(cpu, "fp32", tflops=1.0).refusal(1.0).startswith("measured 1 TFLOP/s per rank exceeds 3 times")


def _cpu_run_case():
    from ringbench.case.spec import CaseSpec, default_fields

    return CaseSpec.from_dict({**default_fields("cpu", 0), "task": "run", "variant": "ring", "kernel": "cpu",
                               "world_size": 1, "seqlen": 256, "heads": 2, "kv_heads": 1, "head_dim": 16,
                               "iters": 2, "warmup": 1})


@pytest.mark.dist
def test_peaks_a_cpu_run_records_its_measured_peak(solo_group):
    fields = bench_case(_cpu_run_case(), device=torch.device("cpu"))
    assert fields["peak_source"] == "measured" and fields["peak_tflops"] > 0
    assert fields["tflops_per_gpu"] <= 3 * fields["peak_tflops"]


@pytest.mark.dist
def test_peaks_a_cpu_run_above_its_measured_peak_is_refused(solo_group, monkeypatch):
    monkeypatch.setattr(peaks, "matmul_tflops", lambda device, dtype: 1e-9)  # a machine slower than any
    with pytest.raises(RuntimeError, match=r"^measured \S+ TFLOP/s per rank exceeds 3 times the 1e-09 TFLOP/s that "
                                           r"a fp32 matmul reached on this cpu in the same launch \(the peak was "
                                           r"measured, as ringbench's datasheet table has no fp32 figure for it\); "
                                           r"the result cannot be true, so it is refused$"):
        bench_case(_cpu_run_case(), device=torch.device("cpu"))


@pytest.mark.gpu
def test_peaks_this_gpu_matmul_stays_under_its_datasheet_peak():
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    for dtype in ("bf16", "fp16", "fp32"):
        rate = peaks.matmul_tflops(device, dtype)
        table = table_peak(name, dtype)
        print(f"{name} {dtype}: matmul {rate:.1f} TFLOP/s, table {table.tflops if table else None}")
        if table is not None:
            assert rate < table.tflops, (name, dtype, rate, table)
        else:
            assert peaks.device_peak(device, dtype).source == "measured"
