"""``ring --layout ptrr``: PyTorch's processing-time round robin (its PTRR load balancer for FlexAttention block
masks) in the mask planner's terms (``variants/engines/mask_balance.py``): chunks of 128 tokens (S / 2W where the
sequence does not take 128 per rank), each chunk's processing time the key chunks its rows meet, dealt longest first
in rounds of W, every other round backwards. Units (no process group): the snake draft, the processing times, the
plan's chunk rule and work, the record's ``ptrr`` entry, the shard. Distributed (real torchrun through the CLI, gloo,
CPU): ring with ``--layout ptrr`` passes verify under a mask and under documents over the whole row."""

from __future__ import annotations

import pytest
import torch

from helpers import command_cases, pool_cli_verify
from ringbench.variants.engines import layouts, mask_balance, masked, masks


def test_snake_deals_longest_first_every_other_round_backwards():
    """Sixteen chunks to four ranks: ranks 0..3 take the four longest, 3..0 the next four, and so on."""
    times = [9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10]
    held = mask_balance.snake(times, 4)
    assert held == ((3, 12, 13, 14), (2, 4, 7, 9), (1, 8, 11, 15), (0, 5, 6, 10))
    assert [sum(times[i] for i in mine) for mine in held] == [45, 45, 43, 47]
    with pytest.raises(ValueError, match=r"^15 chunks cannot go evenly to world_size 4"):
        mask_balance.snake(times[:15], 4)


def test_chunk_times_count_the_key_chunks_a_chunk_meets():
    """Under the causal mask chunk i meets i + 1 key chunks; inside documents only its own document's."""
    assert mask_balance.chunk_times(masks.build("chunked:64", 256), 32) == [1, 2] * 4
    docs = masks.build(masks.packed((64, 128, 64), "causal"), 256)
    assert mask_balance.chunk_times(docs, 64) == [1, 1, 2, 1]


@pytest.mark.parametrize("seqlen,world_size,chunk", [(1024, 4, 128), (4096, 8, 128), (256, 4, 32), (256, 2, 128),
                                                     (384, 4, 48)])
def test_ptrr_plan_chunk_and_work(seqlen, world_size, chunk):
    mask = masks.build("prefix:96", seqlen)
    plan = mask_balance.ptrr_plan(mask, world_size)
    assert plan.chunk == chunk
    assert sorted(i for mine in plan.chunks for i in mine) == list(range(seqlen // chunk))
    assert len({len(mine) for mine in plan.chunks}) == 1  # equal tokens per rank
    assert sum(plan.work) == mask.area()


def test_record_and_shard_follow_the_ptrr_plan():
    from ringbench.case import work

    mask = masks.build("shared-prefix:64,answers=4", 1024)
    plan = mask_balance.ptrr_plan(mask, 4)
    by = work.max_over_mean_by_layout(mask.text, 1024, 4)
    assert by["ptrr"] == pytest.approx(plan.max_over_mean())
    x = torch.arange(1024).view(1, 1024)
    shards = [layouts.shard(x, "ptrr", r, 4, mask=mask.text) for r in range(4)]
    for r, part in enumerate(shards):
        assert part[0].tolist() == [p for a, b in plan.positions(r) for p in range(a, b)]
    assert masked.layout_runs(mask, "ptrr", 1024, 4) == [plan.runs(r) for r in range(4)]


def test_ring_refuses_ptrr_without_a_mask():
    from ringbench.variants import VARIANTS

    reason = VARIANTS["ring"].check(seqlen=256, world_size=4, causal=True, layout="ptrr")
    assert reason.startswith("layout 'ptrr' of ring evens a mask's work, and the case has none; pass --mask"), reason
    assert VARIANTS["zigzag"].check(seqlen=256, world_size=4, causal=True, layout="ptrr", mask="prefix:16")


def _verified_cases() -> list:
    """Two verify commands' cases (fp32 under two masks at 1024 tokens; bf16 packed documents under a chunked
    mask, batch 2), as the command line builds them."""
    common = {"device": "cpu", "kernel": "math", "variant": ["ring"], "layout": "ptrr", "world_size": [4],
              "heads": 2, "head_dim": 16}
    return command_cases("verify", {**common, "dtype": "fp32", "mask": ["prefix:96", "shared-prefix:64,answers=4"],
                                    "seqlen": 1024}) + \
        command_cases("verify", {**common, "dtype": "bf16", "docs": "96,64,96", "mask": "chunked:24", "batch": 2,
                                 "seqlen": 256})


# The session's pooled verify command of world size 4 runs them (helpers.CliVerifyPool).
pool_cli_verify(__name__, lambda world_size: _verified_cases() if world_size == 4 else [])


@pytest.mark.dist
@pytest.mark.slow  # a share of the session's pooled launch of four ranks through the CLI
def test_ring_ptrr_verifies_under_a_mask_and_documents(cli_verify_pool):
    """Two verify commands' cases in one command (the session's pooled one of four ranks)."""
    cases = _verified_cases()
    got = cli_verify_pool.get(__name__, 4)
    assert got["result"].returncode == 0, got["result"].stdout + got["result"].stderr
    records = got["records"]
    assert len(records) == 3 and [r["case_id"] for r in records] == [c.case_id() for c in cases]
    for r in records:
        assert r["status"] == "ok" and r["spec"]["layout"] == "ptrr", r["reason"]
        assert r["predicted_max_over_mean"] == pytest.approx(r["predicted_max_over_mean_by_layout"]["ptrr"])


@pytest.mark.parametrize("text,seqlen,expected", [("chunked:3072", 8192, 1.000), ("chunked:1536", 8192, 1.043),
                                                  ("prefix:3k", 8192, 1.012), ("shared-prefix:1k,answers=2", 8192, 1.013)])
def test_ptrr_at_w8_is_docs_masks_table(text, seqlen, expected):
    """docs/masks.md's ptrr column at W=8."""
    assert mask_balance.ptrr_plan(masks.build(text, seqlen), 8).max_over_mean() == pytest.approx(expected, abs=5e-4)


@pytest.mark.parametrize("text", ["prefix:96", "chunked:24", "window:9,4", "global:4,window:16",
                                  "shared-prefix:28,answers=3", "docs:96,24,136;prefix:40", "docs:96,24,136;window:9,4"])
@pytest.mark.parametrize("chunk", [8, 32])
def test_chunk_times_are_the_key_chunks_with_a_pair(text, chunk):
    """The closed form (one run of keys per slice and query chunk) against counting every key chunk's pairs."""
    from ringbench.variants.engines.bands import Run

    mask = masks.build(text, 256)
    n = 256 // chunk
    brute = [sum(1 for j in range(n) if mask.pairs(Run(0, i * chunk, 1, chunk), Run(0, j * chunk, 1, chunk)))
             for i in range(n)]
    assert mask_balance.chunk_times(mask, chunk) == brute
