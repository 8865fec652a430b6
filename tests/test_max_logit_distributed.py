"""The per-head max logit (``--max-logit``, issue 26 item 2) under real torchrun (gloo, CPU), through the
harness's own ``ringbench.rank.check.verify_case`` (``tests/dist/verify_cases.py``), one launch per world size.

Every batch engine (ring, zigzag, stripe, llama3, ulysses, usp) on the math kernel verifies its max logit,
every rank's copy, against the float64 reference at world sizes 1, 2 and 4, without a mask and under one
(prefix:40 or chunked:24, in turn), beside out, lse, dq, dk and dv. The full launches add the max logit under
a bias, a window, no causal mask, bf16, llama3 gathering one K/V head at a time, and at four ranks usp
with Ulysses in pairs and a ring of two. At two ranks or more the broken fixture ``max_logit_local_only``
(each rank's own maximum, never reduced over the group) must fail on max_logit alone.

The quick subset is one launch of two ranks over every engine without a mask and the fixture; the rest is
slow. Sizes: 128 tokens, heads 4 over 2 K/V heads, head dim 16, fp32.
"""

from __future__ import annotations


import pytest

from helpers import not_verified, pool_verify_batches, quick_and_full_batches, slow_when
from ringbench.case.spec import CaseSpec, canonical, default_fields, resolve_mask, resolve_options, validate

LAUNCH_TIMEOUT_S = {1: 240, 2: 300, 4: 420}
VARIANTS = ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp")
MASKS = ("prefix:40", "chunked:24")
FIXTURE = "max_logit_local_only"
#: Beside a bias, a window, no causal mask or bf16: (name, variant, fields).
EXTRA = (("alibi_zigzag", "zigzag", {"bias": "alibi"}),
         ("1hss_usp", "usp", {"bias": "1hss"}),
         ("window_llama3", "llama3", {"window": 24}),
         ("stride_llama3", "llama3", {"heads_k_stride": 1}),
         ("full_stripe", "stripe", {"causal": False}),
         ("bf16_ulysses", "ulysses", {"dtype": "bf16"}))


def _spec(variant: str, world_size: int, **fields) -> dict:
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "math",
            "world_size": world_size, "heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "fp32", "seed": 5,
            "seqlen": 128, "max_logit": True, **fields}
    case = resolve_options(canonical(resolve_mask(CaseSpec(**base))))
    validate(case, visible_gpus=0)
    return case.to_dict()


def _cases(world_size: int, quick: bool) -> list[dict]:
    out = [{"name": variant, "spec": _spec(variant, world_size)} for variant in VARIANTS]
    if not quick:
        out += [{"name": f"masked_{variant}", "spec": _spec(variant, world_size, mask=MASKS[i % len(MASKS)])}
                for i, variant in enumerate(VARIANTS)]
        out += [{"name": name, "spec": _spec(variant, world_size, **fields)} for name, variant, fields in EXTRA]
        if world_size == 4:  # a real hybrid: Ulysses in pairs, a ring of two pairs (the default degree is 4)
            out.append({"name": "usp_u2", "spec": _spec("usp", world_size, ulysses_degree=2, mask=MASKS[0])})
    if world_size > 1:
        out.append({"name": FIXTURE, "spec": _spec(FIXTURE, world_size)})
        if not quick:
            out.append({"name": f"{FIXTURE}_masked", "spec": _spec(FIXTURE, world_size, mask=MASKS[0])})
    return out


# World size 1 runs in process (tests/test_max_logit.py); the launches start at two ranks.
LAUNCHES_AT = ((2, True), (2, False), (4, False))
LAUNCHES = [slow_when(p, p != (2, True)) for p in LAUNCHES_AT]


pool_verify_batches(__name__, quick_and_full_batches(LAUNCHES_AT, _cases, LAUNCH_TIMEOUT_S))


@pytest.fixture(scope="module", params=LAUNCHES, ids=lambda p: f"w{p[0]}{'-quick' if p[1] else ''}")
def launch(request, verify_pool) -> dict:
    """One batch's view of the session's launch at its world size (``helpers.VerifyPool``)."""
    return verify_pool.get(__name__, *request.param)


@pytest.mark.dist
def test_max_logit_verify_passes_on_every_batch_engine_and_the_local_only_one_fails(launch):
    records = launch["records"]
    assert not launch["timed_out"] and set(records) == set(launch["expected"]), launch["log_tail"]
    assert len(records) >= len(VARIANTS)  # never vacuous
    broken = {n for n in records if n.startswith(FIXTURE)}
    assert bool(broken) == (launch["world_size"] > 1)
    failed = not_verified(records, skip=broken)
    assert not failed, failed
    for name, rec in records.items():
        if name in broken:
            continue
        entry = rec["checks"][-1]
        assert entry["tensor"] == "max_logit" and entry["shape_ok"] and entry["passed"], (name, entry)
        assert entry["dtype"] == "float32" and entry["err"] <= entry["allowed"], (name, entry)
        if launch["world_size"] > 1:
            assert rec["cp_active"] is True or launch["cases"][name]["mask"], (name, rec["cp_active_reason"])
    for name in broken:
        rec = records[name]
        assert rec["status"] == "ok" and rec["verdict"] == "fail", (name, rec.get("error"))
        bad = {c["tensor"] for c in rec["checks"] if not c["passed"]}
        assert bad == {"max_logit"}, (name, bad)  # only the reduction is missing: the rest is right
    assert launch["returncode"] == 0, launch["log_tail"]
