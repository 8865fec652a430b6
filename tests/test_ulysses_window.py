"""Sliding windows through Ulysses and USP: the ring over the ring group takes the window, in the
composed layout, under real torchrun and gloo, checked by ``ringbench verify`` against float64
(with a learnable sink too, in one case)."""

from __future__ import annotations

import pytest

from helpers import pool_cli_verify, scenario_text_cases

SCENARIO = """
description = "windows through ulysses and usp"
[defaults]
device = "cpu"
kernel = "cpu"
heads = 4
kv_heads = 2
head_dim = 16
seqlen = 512
dtype = "fp32"
world_size = 4
window = 50
[[case]]
variant = "ulysses"
[[case]]
variant = "usp"
ulysses_degree = "auto"
[[case]]
variant = "ulysses_varlen"
docs = "96,160,256"
[[case]]
variant = "usp_varlen"
ulysses_degree = 2
docs = "96,160,256"
[[case]]
variant = "usp"
ulysses_degree = 2
sink = "learnable"
dtype = "bf16"
"""


# The session's pooled verify command of world size 4 runs them (helpers.CliVerifyPool).
pool_cli_verify(__name__, lambda world_size: scenario_text_cases(SCENARIO) if world_size == 4 else [])


@pytest.mark.dist
@pytest.mark.slow
def test_ulysses_and_usp_take_a_window_at_every_factorization(cli_verify_pool):
    got = cli_verify_pool.get(__name__, 4)
    print(got["result"].stdout[-3000:], got["result"].stderr[-2000:])
    assert got["result"].returncode == 0
    records = got["records"]
    seen = sorted((r["spec"]["variant"], r["spec"]["ulysses_degree"]) for r in records)
    assert seen == [("ulysses", 0), ("ulysses_varlen", 0), ("usp", 1), ("usp", 2), ("usp", 2), ("usp", 4),
                    ("usp_varlen", 2)]
    for rec in records:
        assert rec["spec"]["window"] == 50 and rec["status"] == "ok", rec["reason"]
        assert rec["cp_active"] is True
        assert all(c["passed"] for c in rec["checks"])
        assert ("dsink" in {c["tensor"] for c in rec["checks"]}) == (rec["spec"]["sink"] == "learnable")
