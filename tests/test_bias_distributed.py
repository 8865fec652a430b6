"""Attention bias (issue 26, item 3) under real torchrun (gloo, CPU), through the harness's own
``ringbench.rank.check.verify_case`` (``tests/dist/verify_cases.py``), one launch per world size.

Every batch engine (ring, zigzag, stripe, llama3, ulysses, usp) on the math kernel verifies ALiBi and the
learnable shapes 1hss, bhss and 111s at world sizes 1, 2 and 4: out, lse, dq, dk, dv against the float64
reference (max rule and block decomposition) and, for a learnable bias, dbias (the max rule, each result
held to what its own out and lse imply). Beside them, each launch but the quick one adds a bias under a
mask (prefix:40, with a learnable sink and batch 2 in one case, 11ss and b1ss there), a sliding window
or no causal mask, and at two ranks or more, the two broken
fixtures, which must fail: ``bias_local_only`` (received K/V blocks take no bias: out and dbias fail) and
``dbias_unreduced`` (each rank's dbias share never summed: dbias alone fails).

The quick subset is one launch of two ranks over a case per engine (the biases in turn) and the fixtures;
the whole grid at 1, 2 and 4 is slow. Sizes: 64 tokens (128 under the mask), heads 4 over 2 K/V heads,
head dim 16, fp32.
"""

from __future__ import annotations


import pytest

from helpers import not_verified, pool_verify_batches, quick_and_full_batches, slow_when
from ringbench.case.spec import CaseSpec, canonical, default_fields, resolve_mask, resolve_options, validate

LAUNCH_TIMEOUT_S = {1: 240, 2: 300, 4: 420}
VARIANTS = ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp")
BIASES = ("alibi", "1hss", "bhss", "111s")
FIXTURES = ("bias_local_only", "dbias_unreduced")
#: Biases beside a mask, a sink, a sliding window or no causal mask, over 128 tokens: (name, variant, bias, fields).
MASKED = (("prefix_1hss_zigzag", "zigzag", "1hss", {"mask": "prefix:40"}),
          ("chunked_alibi_ulysses", "ulysses", "alibi", {"mask": "chunked:24"}),
          ("prefix_b1ss_sink_usp", "usp", "b1ss", {"mask": "prefix:40", "sink": "learnable", "batch": 2}),
          ("full_11ss_llama3", "llama3", "11ss", {"causal": False}),
          ("full_111s_stripe", "stripe", "111s", {"causal": False}),
          ("window_bhss_ring", "ring", "bhss", {"window": 24}),
          ("window_alibi_usp", "usp", "alibi", {"window": 24}))


def _spec(variant: str, world_size: int, bias: str, **fields) -> dict:
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "math",
            "world_size": world_size, "heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "fp32", "seed": 7,
            "seqlen": 64, "bias": bias, **fields}
    case = resolve_options(canonical(resolve_mask(CaseSpec(**base))))
    validate(case, visible_gpus=0)
    return case.to_dict()


def _cases(world_size: int, quick: bool) -> list[dict]:
    out = []
    for v, variant in enumerate(VARIANTS):
        for b, bias in enumerate(BIASES):
            if quick and b != v % len(BIASES):
                continue
            out.append({"name": f"{bias}_{variant}", "spec": _spec(variant, world_size, bias)})
    if not quick:
        for name, variant, bias, fields in MASKED:
            out.append({"name": name, "spec": _spec(variant, world_size, bias, seqlen=128, **fields)})
    if world_size > 1:
        for fixture in FIXTURES:
            out.append({"name": f"{fixture}_1hss", "spec": _spec(fixture, world_size, "1hss")})
    return out


LAUNCHES_AT = ((1, False), (2, True), (2, False), (4, False))
LAUNCHES = [slow_when(p, p != (2, True)) for p in LAUNCHES_AT]


pool_verify_batches(__name__, quick_and_full_batches(LAUNCHES_AT, _cases, LAUNCH_TIMEOUT_S))


@pytest.fixture(scope="module", params=LAUNCHES, ids=lambda p: f"w{p[0]}{'-quick' if p[1] else ''}")
def launch(request, verify_pool) -> dict:
    """One batch's view of the session's launch at its world size (``helpers.VerifyPool``)."""
    return verify_pool.get(__name__, *request.param)


@pytest.mark.dist
def test_bias_verify_passes_on_every_batch_engine_and_the_broken_ones_fail(launch):
    records = launch["records"]
    assert not launch["timed_out"] and set(records) == set(launch["expected"]), launch["log_tail"]
    assert len(records) >= len(VARIANTS)  # never vacuous
    broken = {n for n in records if n.startswith(FIXTURES)}
    assert bool(broken) == (launch["world_size"] > 1)
    failed = not_verified(records, skip=broken)
    assert not failed, failed
    for name, rec in records.items():
        if name in broken:
            continue
        spec = launch["cases"][name]
        tensors = [c["tensor"] for c in rec["checks"]]
        learns = spec["bias"] != "alibi"
        assert ("dbias" in tensors) == learns and ("dsink" in tensors) == (spec["sink"] == "learnable"), name
        # dbias and d sink have no block decomposition: the max rule alone; every other tensor both rules.
        assert all(c["passed"] and (c["shadow_passed"] or c["tensor"] in ("dbias", "dsink"))
                   for c in rec["checks"]), name
        if learns:
            dbias = next(c for c in rec["checks"] if c["tensor"] == "dbias")
            assert dbias["err_fp64"] < 1e-4 and dbias["shape_ok"], (name, dbias)
        if launch["world_size"] > 1:
            assert rec["cp_active"] is True, (name, rec["cp_active_reason"])
    for name in broken:
        rec = records[name]
        assert rec["status"] == "ok" and rec["verdict"] == "fail", (name, rec.get("error"))
        bad = {c["tensor"] for c in rec["checks"] if not c["passed"]}
        if name.startswith("bias_local_only"):
            assert {"out", "lse", "dbias"} <= bad, (name, bad)
        else:  # only the reduction is missing: out, lse and the input gradients are right
            assert bad == {"dbias"}, (name, bad)
    assert launch["returncode"] == 0, launch["log_tail"]
