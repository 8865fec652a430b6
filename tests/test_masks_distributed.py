"""Any mask under real torchrun (gloo, CPU), through the harness's own ``ringbench.rank.check.verify_case``:
every named family beyond the plain ones (window:L,R, prefix, shared-prefix, chunked, global) and the three
slices files of ``tests/data/masks/`` on ring, zigzag, stripe, llama3, ulysses and usp, against the float64
math kernel under the dense mask of the same slices (the max rule, the block-decomposition check and the
cp-active check, null with its reason where no rank needs another's K/V), one launch per world size
(``tests/dist/verify_cases.py``).

Every (mask, variant) pair runs at every world size, in bf16 at some and fp32 at the others, so each pair
meets both dtypes over the four launches. The hidden ``mask_local_only`` variant (its mask cuts only the
blocks of its own K/V) joins each launch of two ranks or more and must fail there. A few cases of each launch
add a sink (learnable, checked with d sink, or off-by-one) and a value head dim apart from the query one, on
variants taken in turn. Every launch is slow (the "quick" one of world size 2 too, 15-22 s on two cores; it
keeps its own few cases, every mask of 256 tokens once); the quick subset checks masks in one process
(tests/test_masks.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import (not_verified, pool_cli_run, pool_verify_batches, read_jsonl, ringbench_here,
                     scenario_text_cases, slow_when)
from ringbench.case.spec import CaseSpec, canonical, default_fields, resolve_mask, resolve_options, validate
from ringbench.variants.engines import masks

DATA = Path(__file__).parent / "data" / "masks"
LAUNCH_TIMEOUT_S = {1: 240, 2: 300, 4: 420, 8: 540}

VARIANTS = ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp")
#: (name, mask, seqlen): chosen against the blocks of S = 256 (a rank's block 256 / W, a zigzag chunk half
#: that): a prompt and chunks that end inside a block, answers that straddle ranks, a band two-sided.
MASKS = (
    ("window_two_sided", "window:9,4", 256),
    ("prefix", "prefix:40", 256),
    ("shared_prefix", "shared-prefix:28,answers=3", 256),
    ("chunked", "chunked:24", 256),
    ("global", "global:4,window:24", 256),
    ("file_magi", masks.read_file(DATA / "magi_varlen_block_causal.txt"), 960),
    ("file_window", masks.read_file(DATA / "two_sided_window.txt"), 256),
    ("file_image", masks.read_file(DATA / "image_in_text.txt"), 256),
)
#: The cases of world size 2 that stay in the quick subset: every mask of 256 tokens once, each on another
#: variant (ulysses and usp need 8 heads, for world size 8).
QUICK = {f"{name}_{VARIANTS[i % len(VARIANTS)]}" for i, (name, _, seqlen) in enumerate(MASKS) if seqlen == 256}
WORLD_SIZES = (1, 2, 4, 8)


#: Cases with a sink, a value head dim apart from the query one, or both, beside a mask: (mask index of
#: MASKS, sink, head_dim_v). Each launch adds them on variants taken in turn, so every engine meets them over
#: the launches; the quick launch the first two.
EXTRAS = ((1, "learnable", 0), (3, "off-by-one", 8), (6, "learnable", 24))


def _spec(variant: str, world_size: int, mask: str, seqlen: int, dtype: str, **fields) -> dict:
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "math",
            "world_size": world_size, "heads": 8 if variant in ("ulysses", "usp") else 4, "kv_heads": 2,
            "head_dim": 16, "dtype": dtype, "seed": 5,
            "seqlen": seqlen, "mask": mask, **fields}
    if variant == "usp":  # a ring of two Ulysses groups wherever there are two ranks or more
        base["ulysses_degree"] = max(1, world_size // 2)
    case = resolve_options(canonical(resolve_mask(CaseSpec(**base))))
    validate(case, visible_gpus=0)
    return case.to_dict()


def _chosen(world_size: int, m: int, v: int, case: str, quick: bool) -> bool:
    """Whether mask ``m`` on variant ``v`` runs in this launch. Each (mask, variant) pair runs at one world
    size of two or more (the quick ones at 2, the rest in turn at 2, 4 and 8), and each mask once at world
    size 1: the suite stays in its time, and the whole grid of every pair at every world size and dtype is
    the committed sweep of results/reference/2026-12-02-cpu-masks/ (its run.sh)."""
    if world_size == 1:
        return v == m % len(VARIANTS)
    if world_size == 2 and quick:
        return case in QUICK
    return case not in QUICK and (m + v) % 3 == WORLD_SIZES.index(world_size) - 1


def _cases(world_size: int, *, quick: bool) -> list[dict]:
    at = WORLD_SIZES.index(world_size)
    out = []
    for m, (name, mask, seqlen) in enumerate(MASKS):
        for v, variant in enumerate(VARIANTS):
            case = f"{name}_{variant}"
            if not _chosen(world_size, m, v, case, quick):
                continue
            dtype = ("bf16", "fp32")[(at + m + v) % 2]  # each pair: both dtypes over the four world sizes
            out.append({"name": case, "spec": _spec(variant, world_size, mask, seqlen, dtype)})
        if world_size > 1 and (world_size != 2 or not quick) and m in (1, 3):  # prefix, chunked
            out.append({"name": f"{name}_mask_local_only",
                        "spec": _spec("mask_local_only", world_size, mask, seqlen, "bf16")})
    if world_size > 1 and not quick:  # chunks of 32 inside the ring's blocks of 256 / W: no rank needs another's K/V
        out.append({"name": "chunked_inside_blocks_ring", "spec": _spec("ring", world_size, "chunked:32", 256, "fp32")})
    first = sum(len(_extras(q)) for _, q in LAUNCHES_AT[:LAUNCHES_AT.index((world_size, quick))])
    for c, (m, sink, dv) in enumerate(_extras(quick), first):  # c counts over the launches: variants in turn
        name, mask, seqlen = MASKS[m]
        variant = VARIANTS[c % len(VARIANTS)]
        out.append({"name": f"{name}_sink_{sink}_dv{dv}_{variant}",
                    "spec": _spec(variant, world_size, mask, seqlen, ("bf16", "fp32")[c % 2], sink=sink,
                                  head_dim_v=dv)})
    return out


def _extras(quick: bool) -> tuple:
    """The :data:`EXTRAS` a launch runs: the first two in the quick one."""
    return EXTRAS[:2] if quick else EXTRAS


#: The launches, (world size, quick), in order: the sink cases take their variants by this order.
LAUNCHES_AT = ((1, False), (2, True), (2, False), (4, False), (8, False))
LAUNCHES = [slow_when(p, True) for p in LAUNCHES_AT]  # the quick one too: 15-22 s on two cores


def _batches(world_size: int, with_slow: bool) -> dict:
    """The batches (quick or not) at ``world_size`` for the session's pooled launch, every one slow: none
    unless the session runs the slow tests; world size 2's quick and full batches (no case in both) share it."""
    return {quick: (_cases(world_size, quick=quick), LAUNCH_TIMEOUT_S[world_size])
            for w, quick in LAUNCHES_AT if w == world_size and with_slow}


pool_verify_batches(__name__, _batches)


@pytest.fixture(scope="module", params=LAUNCHES, ids=lambda p: f"w{p[0]}{'-quick' if p[1] else ''}")
def launch(request, verify_pool) -> dict:
    """One batch's view of the session's launch at its world size (``helpers.VerifyPool``)."""
    return verify_pool.get(__name__, *request.param)


@pytest.mark.dist
def test_masks_verify_passes_every_family_and_file_on_every_variant(launch):
    """Every mask case passes verify at this world size (both rules on every tensor), with context
    parallelism proven active wherever a rank's queries see another rank's keys, and cp_active null with
    the reason where none does; the locally-masked fixture fails every launch of two ranks or more."""
    records = launch["records"]
    assert not launch["timed_out"] and set(records) == set(launch["expected"]), launch["log_tail"]
    assert len(records) >= len(QUICK)  # never vacuous
    broken = {n for n in records if n.endswith("_mask_local_only")}
    failed = not_verified(records, skip=broken)
    assert not failed, failed
    for name, rec in records.items():
        if name in broken:
            continue
        # d sink has no block decomposition (the engine sums it from out and dout): the max rule alone.
        assert all(c["passed"] and (c["shadow_passed"] or c["tensor"] == "dsink") for c in rec["checks"]), name
        spec = launch["cases"][name]
        assert ("dsink" in {c["tensor"] for c in rec["checks"]}) == (spec["sink"] == "learnable"), name
        if launch["world_size"] == 1:
            assert rec["cp_active"] is None and rec["cp_active_reason"].startswith("world size 1"), name
        elif name == "chunked_inside_blocks_ring":
            assert rec["cp_active"] is None, name
            assert rec["cp_active_reason"] == ("under mask chunked:32 no query sees a key of another rank, so no "
                                               "rank needs another's K/V")
        else:
            assert rec["cp_active"] is True, (name, rec["cp_active_reason"])
    for name in broken:
        rec = records[name]
        assert rec["status"] == "ok" and rec["verdict"] == "fail", (name, rec.get("error"))
        assert {"out", "lse"} <= {c["tensor"] for c in rec["checks"] if not c["passed"]}, name
    assert launch["returncode"] == 0, launch["log_tail"]


@pytest.mark.dist
@pytest.mark.slow  # one launch of two ranks through the CLI, about 10 s on two cores
def test_masks_cli_verify_reads_a_mask_file_and_fails_the_local_only_mask(tmp_path):
    """``--mask-file`` through the command line as a user runs it: the slices reach the records as the
    ``mask`` field (case_id from the slices), zigzag passes and the locally-masked fixture fails (exit 1)."""
    done = ringbench_here("verify", "--device", "cpu", "--variant", "zigzag", "--variant", "mask_local_only",
                          "--mask-file", str(DATA / "image_in_text.txt"), "--seqlen", "256", "--world-size", "2",
                          "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "bf16", "--out", str(tmp_path),
                          cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    by_variant = {r["spec"]["variant"]: r for r in read_jsonl(tmp_path / "verify.jsonl")}
    assert by_variant["zigzag"]["status"] == "ok" and by_variant["mask_local_only"]["status"] == "fail"
    assert by_variant["zigzag"]["spec"]["mask"] == masks.read_file(DATA / "image_in_text.txt")
    assert by_variant["zigzag"]["spec"]["causal"] is False
    area = masks.build(by_variant["zigzag"]["spec"]["mask"], 256).area()
    assert sum(by_variant["zigzag"]["predicted_pairs_per_rank"]) == area


#: Two forward-only run cases of one launch: ring at W=4 over blocks of 64 tokens, full and chunked:128.
EARLY_STOP = """
[defaults]
variant = "ring"
device = "cpu"
kernel = "math"
world_size = 4
seqlen = 256
heads = 2
kv_heads = 1
head_dim = 16
mode = "fwd"
iters = 2
warmup = 1
[sweep]
mask = ["full", "chunked:128"]
"""

# The session's pooled run command (--json) runs its cases (helpers.CliRunPool).
pool_cli_run(__name__, lambda: scenario_text_cases(EARLY_STOP, "run"))


@pytest.mark.dist
@pytest.mark.slow  # one launch of four ranks through the CLI
def test_masks_ring_sends_only_the_kv_some_rank_needs_and_counts_only_unmasked_flops(cli_run_pool):
    """chunked:128 over ring blocks of 64: odd ranks need their left neighbour's K/V, no rank needs more,
    so the forward ring stops after one step (one K/V block sent per rank instead of three); FLOPs and
    the predicted work count only the chunks' causal pairs."""
    got = cli_run_pool.get(__name__)
    done = got["result"]
    assert done.returncode == 0, done.stderr
    full, chunked = sorted((rec for printed in got["printed"] for rec in printed), key=lambda r: r["spec"]["mask"])
    assert full["status"] == chunked["status"] == "ok"
    assert full["spec"]["mask"] == "" and full["spec"]["causal"] is False  # --mask full is --no-causal
    kv_block = 2 * 64 * 1 * 16 * 4  # K and V, 64 tokens, 1 head, dim 16, fp32
    assert (full["bytes_sent"], chunked["bytes_sent"]) == (3 * kv_block, kv_block)
    area = 2 * 128 * 129 // 2
    assert chunked["flops_per_gpu"] == pytest.approx(4 * area * 2 * 16 / 4)
    assert chunked["predicted_pairs_per_rank"] == [64 * 65 // 2, 64 * 64 + 64 * 65 // 2] * 2
