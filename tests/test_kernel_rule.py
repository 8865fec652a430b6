"""Verify's kernel rule (``tolerance.kernel_check``, docs/verify.md): the case's kernel alone, on one device,
is held to a bound that does not move with it.

The max rule allows the variant twice the single run's own error, so a kernel that is wrong the same way
on one device and in the ring passes it (flash-attn-4's ALiBi backward under GQA on an H100: dq off by
568 against an allowance of 1137). Here a kernel wrong in its dq alone (the cpu kernel's dq times 1.25)
passes the max rule and the block decomposition at world size 1 and fails the kernel rule; the right
kernel passes with its error in eps; fp32 leaves the rule out.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringbench.case.spec import CaseSpec, default_fields, resolve
from ringbench.rank import check, tolerance
from ringbench.variants.kernels import KERNELS


def _spec(dtype: str) -> CaseSpec:
    return resolve(CaseSpec.from_dict({**default_fields("cpu", 0), "task": "verify", "variant": "zigzag",
                                       "kernel": "cpu", "world_size": 1, "seqlen": 128, "heads": 4, "kv_heads": 2,
                                       "head_dim": 16, "dtype": dtype}))


def _wrong_dq(monkeypatch) -> None:
    right = KERNELS["cpu"]

    def backward(*args, **kwargs):
        dq, dk, dv = right.backward(*args, **kwargs)
        return dq * 1.25, dk, dv

    monkeypatch.setitem(KERNELS, "cpu", dataclasses.replace(right, backward=backward))


@pytest.mark.dist
def test_kernel_rule_fails_a_kernel_wrong_the_same_way_on_one_device(solo_group, monkeypatch):
    _wrong_dq(monkeypatch)
    found = check.verify_case(_spec("bf16"), device=torch.device("cpu"), group=solo_group)
    by = {c["tensor"]: c for c in found["checks"]}
    assert by["dq"]["err"] <= by["dq"]["allowed"] and by["dq"]["shadow_passed"]  # the other rules pass it
    assert by["dq"]["kernel_passed"] is False and by["dq"]["kernel_units"] > 2 * tolerance.KERNEL_UNITS
    assert not by["dq"]["passed"] and all(by[t]["passed"] for t in ("out", "lse", "dk", "dv"))
    assert found["status"] == "fail"
    assert ("the cpu kernel alone on one device is off float64 by more than the kernel rule's limit in eps of bf16"
            in found["reason"] and "dq (" in found["reason"]), found["reason"]


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_kernel_rule_passes_the_right_kernel_and_leaves_fp32_out(solo_group, dtype):
    found = check.verify_case(_spec(dtype), device=torch.device("cpu"), group=solo_group)
    assert found["status"] == "ok", found["reason"]
    for c in found["checks"]:
        if dtype == "fp32":
            assert c["kernel_units"] is None and c["kernel_passed"] is None
        else:
            assert c["kernel_passed"] is True and 0 <= c["kernel_units"] <= tolerance.kernel_limit(c["tensor"], 2), c


@pytest.mark.dist
def test_kernel_rule_fields_are_null_on_the_entries_it_does_not_judge(solo_group):
    """d sink (and d bias, the max logit) carry the kernel fields as null, as the record's contract says."""
    spec = resolve(CaseSpec.from_dict({**_spec("bf16").to_dict(), "sink": "learnable"}))
    found = check.verify_case(spec, device=torch.device("cpu"), group=solo_group)
    assert found["status"] == "ok", found["reason"]
    dsink = [c for c in found["checks"] if c["tensor"] == "dsink"]
    assert len(dsink) == 1 and dsink[0]["kernel_units"] is None and dsink[0]["kernel_passed"] is None


@pytest.mark.dist
@pytest.mark.slow
def test_kernel_rule_lets_dk_and_dv_grow_with_the_query_heads_a_kv_head(solo_group):
    """PyTorch's CPU flash op rounds each query head's dK/dV before summing a GQA group: at 128 query heads a
    K/V head its correct dk read 12.6 eps in fp16 (1024 tokens) and failed a flat bound of 8; dk and dv get
    8 * sqrt(128). At 512 tokens dv reads 9.2."""
    spec = resolve(CaseSpec.from_dict({**_spec("fp16").to_dict(), "seqlen": 512, "heads": 128, "kv_heads": 1,
                                       "head_dim": 64, "causal": False}))
    found = check.verify_case(spec, device=torch.device("cpu"), group=solo_group)
    assert found["status"] == "ok", found["reason"]
    worst = max((c for c in found["checks"] if c["tensor"] in ("dk", "dv")), key=lambda c: c["kernel_units"])
    assert worst["kernel_units"] > tolerance.KERNEL_UNITS  # over the flat bound ...
    assert worst["kernel_units"] <= tolerance.kernel_limit(worst["tensor"], 128)  # ... within the group's
    assert tolerance.kernel_limit("dq", 128) == tolerance.KERNEL_UNITS
