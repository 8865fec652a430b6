"""Sliding windows and the balanced layout under real torchrun (gloo, CPU), through the harness's own
``ringbench.rank.check.verify_case``: every variant that takes a window, batch and varlen, against the
float64 math kernel under the same window (the max rule, the block-decomposition check and the
cp-active check), one launch per world size (``tests/dist/verify_cases.py``).

The windows are chosen against each layout's blocks: 1 and 2, a chunk - 1 and + 1, smaller than a
chunk, larger than one, and spanning several ring steps; the balanced layout gets documents whose
lengths 2W does not divide.
Every world size is slow (2, a few cases, takes 5-7 s on two cores).
"""

from __future__ import annotations

import pytest

from helpers import (not_verified, pool_cli_run, pool_verify_batches, read_jsonl, ringbench_here,
                     scenario_text_cases, slow_when)
from ringbench.case.spec import CaseSpec, default_fields, resolve_docs, validate

LAUNCH_TIMEOUT_S = {1: 120, 2: 150, 4: 240, 8: 300}


def _spec(variant: str, world_size: int, window: int = 0, docs: str = "", **fields) -> dict:
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "cpu", "world_size": world_size,
            "heads": 2, "kv_heads": 1, "head_dim": 16, "dtype": "bf16", "seed": 3, "window": window, "docs": docs,
            "seqlen": sum(int(d) for d in docs.split(",")) if docs else 32 * world_size}
    base.update(fields)
    case = resolve_docs(CaseSpec(**base))
    validate(case, visible_gpus=0)
    return case.to_dict()


def _cases(world_size: int) -> list[dict]:
    """Cases at ``world_size``: S = 32W batch (a rank's block is 32 tokens, a zigzag chunk 16)."""
    W = world_size
    few = (5, 40, 32 * W - 7) if W > 1 else (5,)  # inside a chunk, across one block, across most of the ring
    docs = ",".join(str(n) for n in (8 * W + 3, 0, 16 * W - 1, 1, 7 * W - 3, W))  # not multiples of 2W; sum 32W
    per_doc = ",".join(str(n * 2 * W) for n in (3, 8, 5))
    out = []
    for variant in ("ring", "zigzag", "stripe", "llama3"):
        out += [(f"{variant}_window{w}", _spec(variant, W, w)) for w in few]
    out += [("stripe_window1", _spec("stripe", W, 1)), ("llama3_contiguous_window40",
                                                       _spec("llama3", W, 40, layout="contiguous"))]
    out += [(f"{v}_window{w}", _spec(v, W, w, docs=per_doc)) for v in ("ring_varlen", "zigzag_varlen") for w in few]
    out += [(f"llama3_varlen_window{w}", _spec("llama3_varlen", W, w, docs=docs)) for w in few]
    out += [("llama3_varlen_balanced", _spec("llama3_varlen", W, docs=docs, layout="balanced")),
            ("llama3_varlen_balanced_full", _spec("llama3_varlen", W, docs=docs, layout="balanced", causal=False))]
    out += [(f"llama3_varlen_balanced_window{w}", _spec("llama3_varlen", W, w, docs=docs, layout="balanced"))
            for w in few]
    # Padded documents (doc_pad 4): the references apply the window within each real document.
    if W <= 4:  # padded to 16, 32 and 24, which zigzag_varlen cuts only up to 2W = 8
        out += [(f"{v}_pad_window{w}", _spec(v, W, w, docs="13,30,21", doc_pad=4, seqlen=72))
                for v in ("zigzag_varlen", "llama3_varlen") for w in (5, 40)]
        out += [("llama3_varlen_balanced_pad_window40",  # 252 padded tokens: a multiple of W up to 4 only
                 _spec("llama3_varlen", W, 40, docs="25,70,150", doc_pad=4, seqlen=252, layout="balanced"))]
    # A window and a learnable sink together (gpt-oss's banded layers), bf16.
    out += [(f"{v}_window{w}_sink", _spec(v, W, w, sink="learnable")) for v in ("zigzag", "stripe", "llama3")
            for w in few]
    out += [("ring_varlen_window40_sink", _spec("ring_varlen", W, 40, docs=per_doc, sink="learnable"))]
    # The window's edges: 1, 2 (one query row of a block sees the block before it: a band part of
    # one row), and a rank's block (ring: 32 tokens) or chunk (zigzag: 16) - 1 and + 1.
    out += [(f"ring_window{w}", _spec("ring", W, w)) for w in (1, 2, 31, 33)]
    out += [(f"zigzag_window{w}", _spec("zigzag", W, w)) for w in (2, 15, 17)]
    far = f"window{32 * W - 7}"
    keep = {  # a few of each form per launch, so the slow launches stay near 15 s each on two cores
        1: {"zigzag_window5", "llama3_varlen_balanced_window5", "llama3_varlen_pad_window40"},
        2: {"zigzag_window40", "stripe_window5", "llama3_window40", "ring_varlen_window40",
            "llama3_varlen_balanced", "llama3_varlen_balanced_window5", "zigzag_varlen_pad_window5",
            "llama3_varlen_pad_window40", "zigzag_window40_sink", "ring_window1", "ring_window2", "ring_window31",
            "ring_window33", "zigzag_window2", "zigzag_window15", "zigzag_window17"},
        4: {"ring_window5", f"ring_{far}", "zigzag_window40", "stripe_window5", "stripe_window1",
            "llama3_contiguous_window40", "zigzag_varlen_window40", f"llama3_varlen_{far}", "llama3_varlen_balanced",
            "llama3_varlen_balanced_full", "llama3_varlen_balanced_window40", "llama3_varlen_balanced_pad_window40",
            "llama3_window40_sink", "ring_varlen_window40_sink"},
        8: {"ring_window40", f"zigzag_{far}", "stripe_window5", "llama3_window40", "ring_varlen_window5",
            "llama3_varlen_balanced", "llama3_varlen_balanced_window40", "stripe_window5_sink"},
    }[W]
    out = [c for c in out if c[0] in keep]
    assert len(out) == len(keep), "every kept case must exist"
    return [{"name": name, "spec": spec} for name, spec in out]


def _batches(world_size: int, with_slow: bool) -> dict:
    """The module's one batch at ``world_size`` for the session's pooled launch (every world size is slow)."""
    return {None: (_cases(world_size), LAUNCH_TIMEOUT_S[world_size])} if with_slow and world_size in LAUNCH_TIMEOUT_S else {}


pool_verify_batches(__name__, _batches)


@pytest.fixture(scope="module", params=[slow_when(w, True) for w in (1, 2, 4, 8)], ids=lambda w: f"w{w}")
def launch(request, verify_pool) -> dict:
    """The module's view of the session's launch at this world size (``helpers.VerifyPool``)."""
    return verify_pool.get(__name__, request.param, None)


def test_window_verify_passes_every_case(launch):
    """Every windowed and balanced case passes verify's rule at this world size, with context
    parallelism proven active wherever a rank needs another's keys."""
    records = launch["records"]
    assert not launch["timed_out"] and set(records) == set(launch["expected"]), launch["log_tail"]
    failed = not_verified(records)
    assert not failed, failed
    for name, rec in records.items():
        # d sink has no block-decomposition check (its shadow_passed is None).
        assert all(c["passed"] and (c["shadow_passed"] or c["tensor"] == "dsink") for c in rec["checks"]), name
        assert ("dsink" in {c["tensor"] for c in rec["checks"]}) == name.endswith("_sink"), name
        if launch["world_size"] > 1 and not name.endswith("_window1"):
            assert rec["cp_active"] is True, (name, rec["cp_active_reason"])
    for name in ("stripe_window1", "ring_window1"):
        if name in records and launch["world_size"] > 1:  # each query sees itself alone: no K/V moves
            assert records[name]["cp_active"] is None
            assert "no query sees a key of another rank" in records[name]["cp_active_reason"]
    assert launch["returncode"] == 0, launch["log_tail"]


#: Two run cases of one launch: ring at W=4, forward only, without and with a window of 8 keys.
EARLY_STOP = """
[defaults]
variant = "ring"
device = "cpu"
kernel = "cpu"
world_size = 4
seqlen = 256
heads = 2
kv_heads = 1
head_dim = 16
mode = "fwd"
iters = 2
warmup = 1
[sweep]
window = [0, 8]
"""

# The session's pooled run command (--json) runs its cases (helpers.CliRunPool).
pool_cli_run(__name__, lambda: scenario_text_cases(EARLY_STOP, "run"))


@pytest.mark.slow
def test_window_ring_stops_early_in_forward(cli_run_pool):
    """ring at W=4 with a window shorter than a rank's block needs one step of K/V from its left
    neighbour: its forward sends one block of K/V per rank instead of three, and the FLOPs count
    only the pairs inside the window."""
    got = cli_run_pool.get(__name__)
    done = got["result"]
    assert done.returncode == 0
    full, windowed = sorted((rec for printed in got["printed"] for rec in printed), key=lambda r: r["spec"]["window"])
    assert full["status"] == windowed["status"] == "ok"
    kv_block = 2 * 64 * 1 * 16 * 4  # K and V, 64 tokens, 1 head, dim 16, fp32
    assert (full["bytes_sent"], windowed["bytes_sent"]) == (3 * kv_block, kv_block)
    assert windowed["flops_per_gpu"] == pytest.approx(4 * (256 * 8 - 32) * 2 * 16 / 4)
    assert windowed["predicted_pairs_per_rank"] == [36 + 56 * 8, 64 * 8, 64 * 8, 64 * 8]


#: The hidden band_one_row fixture (bands.band_part's ``i0 > i1`` written ``i0 >= i1``) at W=2:
#: a window of 2 leaves one query row of each block seeing the block before it; 40 leaves many.
BAND_ONE_ROW = """
[defaults]
variant = "band_one_row"
device = "cpu"
kernel = "cpu"
world_size = 2
seqlen = 64
heads = 2
kv_heads = 1
head_dim = 16
dtype = "bf16"
[sweep]
window = [2, 40]
"""


@pytest.mark.dist
@pytest.mark.slow  # 6-9 s on two cores: the quick subset keeps one fault, one run and one verify
def test_window_verify_fails_the_one_row_band_part_bug_at_window_2(tmp_path):
    (tmp_path / "band.toml").write_text(BAND_ONE_ROW)
    result = ringbench_here("verify", "--scenario", str(tmp_path / "band.toml"), "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 cases: 1 passed, 1 failed, 0 errors" in result.stdout
    by_window = {r["spec"]["window"]: r for r in read_jsonl(tmp_path / "verify.jsonl")}
    assert by_window[2]["status"] == "fail" and by_window[40]["status"] == "ok"
    failed = {c["tensor"] for c in by_window[2]["checks"] if not c["passed"]}
    assert {"out", "lse", "dq", "dk", "dv"} <= failed, by_window[2]["checks"]
