"""Sliding windows and the balanced layout without a process group: the kernels' window against a
dense float64 mask, the band algebra of ``variants/engines/bands.py`` against brute force over every
layout, the balanced layout's cut, the predicted work per rank against hand-computed counts, and
the refusals (exit code 2, one sentence) through the CLI in-process.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from helpers import attention_fp64
from ringbench.case import work
from ringbench.case.work import attention_flops
from ringbench.cli import app
from ringbench.case.spec import CaseSpec, default_fields, resolve_docs
from ringbench.variants.engines import balanced, bands, layouts
from ringbench.variants.kernels import KERNELS, check_kernel, resolve_kernel

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


# (Sq, Sk, window, causal): square, rectangular both ways, unbounded sides, rows that see nothing.
SHAPES = [(8, 8, (3, 0), False), (5, 9, (2, 1), False), (9, 4, (None, 0), False), (7, 7, (2, None), True),
          (6, 10, (0, 0), False), (6, 10, (1, None), False),
          # several query tiles (64 rows each under these windows), each meeting only its band's keys
          (300, 260, (20, 0), False), (200, 330, (70, 5), False), (260, 260, (9, None), True)]


@pytest.mark.parametrize("name", ["math", "cpu"])
@pytest.mark.parametrize("sq,sk,window,causal", SHAPES)
def test_window_kernel_matches_dense_mask(name, sq, sk, window, causal):
    """out, lse, dq, dk, dv of a windowed call (batch and varlen) equal float64 attention under the
    bottom-right-aligned band; a row that sees no key gets out 0 and lse -inf."""
    kernel = KERNELS[name]
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(1, sq, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, sk, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, sk, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, sq, 4, 8, generator=gen, dtype=torch.float64)
    ref_out, ref_lse = attention_fp64(q, k, v, causal=causal, window=window, scale=0.3)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    ref_out, ref_lse = ref_out.detach(), ref_lse.detach()
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = kernel.forward(q, k, v, causal, 0.3, window=window)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 0.3, window=window)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    errs = [(out - ref_out).abs().max(), (lse - ref_lse).nan_to_num(0).abs().max(),
            *((a - b).abs().max() for a, b in zip(grads, ref_grads))]
    # Two documents of the same shape packed into one row: the second must equal the batch call.
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (sq, sk))
    two = [torch.cat([t, t], 1) for t in (q, k, v, dout)]
    v_out, v_lse = kernel.forward_varlen(*two[:3], cu_q, cu_k, sq, sk, causal, 0.3, window=window)
    v_grads = kernel.backward_varlen(two[3], *two[:3], v_out, v_lse, cu_q, cu_k, sq, sk, causal, 0.3, window=window)
    errs += [(v_out[:, sq:] - ref_out).abs().max(), (v_grads[0][:, sq:] - ref_grads[0]).abs().max(),
             (v_grads[1][:, sk:] - ref_grads[1]).abs().max()]
    print(name, sq, sk, window, causal, [f"{float(e):.1e}" for e in errs])  # before the assert
    assert max(float(e) for e in errs) < 1e-12


@pytest.mark.parametrize("name", ["math", "cpu"])
def test_window_kernel_meets_only_the_keys_of_its_band(name, monkeypatch):
    """A windowed call works tile by tile of query rows, each against the keys its band reaches
    alone: at 2048 rows and a window of 512 no tile meets more than its rows + 511 keys."""
    from ringbench.variants.kernels import reference

    widths = []
    if name == "cpu":
        real = reference._cpu_op_forward

        def op(q, k, v, causal, scale, mask=None):
            widths.append((q.shape[1], k.shape[1]))
            return real(q, k, v, causal, scale, mask)

        monkeypatch.setattr(reference, "_cpu_op_forward", op)
    else:
        real = reference._masked

        def op(scores, s, e, j0, j1, *args):
            widths.append((e - s, j1 - j0))
            return real(scores, s, e, j0, j1, *args)

        monkeypatch.setattr(reference, "_masked", op)
    q = torch.randn(1, 2048, 2, 16)
    KERNELS[name].forward(q, q[:, :, :1], q[:, :, :1], True, 0.25, window=(511, 0))
    assert sum(rows for rows, _ in widths) == 2048 and len(widths) == 8  # tiles of 256 rows
    assert all(keys <= rows + 511 for rows, keys in widths), widths
    pairs = sum(rows * keys for rows, keys in widths)
    assert pairs < 0.4 * 2048 * 2048, pairs  # the whole block would be 2048 * 2048


def test_window_kernels_that_take_none_say_why():
    """cudnn and torch-efficient refuse a windowed call in one sentence naming the kernels that take
    one; auto skips them; a negative side is refused."""
    reason = check_kernel(KERNELS["cudnn"], "cuda", window=True)
    assert reason == ("the cudnn kernel cannot take a sliding window (PyTorch's cuDNN attention op takes no "
                      "window size); pass --kernel with one of flash-attn-4, flash-attn, torch-flash, math or auto")
    assert "memory-efficient" in check_kernel(KERNELS["torch-efficient"], "cuda", window=True)
    assert check_kernel(KERNELS["cpu"], "cpu", window=True) is None
    assert resolve_kernel("auto", "cpu", dtype=torch.float32, window=True).name == "cpu"
    with pytest.raises(ValueError, match="window left -1 is negative"):
        KERNELS["math"].forward(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), False,
                                1.0, window=(-1, 0))


def _brute_pairs(q_pos, k_pos, window):
    """{(local query row, local key row)} that a causal window of ``window`` keys admits (same document)."""
    return {(i, j) for i, (dq, p) in enumerate(q_pos) for j, (dk, t) in enumerate(k_pos)
            if dq == dk and p - window < t <= p}


def _positions(runs):
    out = {}
    for r in runs:
        for i in range(r.count):
            out[r.local + i] = (r.doc, r.start + r.stride * i)
    return [out[i] for i in sorted(out)]


def _part_pairs(parts):
    got = set()
    for p in parts:
        m, n = p.q[1] - p.q[0], p.kv[1] - p.kv[0]
        left, right = (None, None) if p.window is None else p.window
        assert left is None or left >= 0
        assert right is None or right >= 0
        for i in range(m):
            for j in range(n):
                if (left is None or j >= i + n - m - left) and (right is None or j <= i + n - m + right):
                    got.add((p.q[0] + i, p.kv[0] + j))
    return got


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_window_bands_match_brute_force(layout, world_size):
    """For every pair of ranks and windows smaller than a chunk, larger, and spanning several ranks,
    the parts attend exactly the pairs inside the window, each part a flash-attn window with both
    sides 0 or more (the bounding-box trim), and their pair counts add up."""
    seqlen = 24 * world_size
    runs = [bands.layout_runs(layout, seqlen, r, world_size) for r in range(world_size)]
    doc_runs = [bands.document_runs([8 * world_size, 0, 16 * world_size], layout, r, world_size)
                for r in range(world_size)] if layout != "stripe" else None
    for window in (1, 2, 5, 12, 25, 49, 1000):
        for case in filter(None, (runs, doc_runs)):
            for r in range(world_size):
                for s in range(world_size):
                    parts = bands.block_parts(case[r], case[s], window)
                    want = _brute_pairs(_positions(case[r]), _positions(case[s]), window)
                    assert _part_pairs(parts) == want, (layout, world_size, window, r, s, parts)
                    assert sum(bands.part_pairs(p) for p in parts) == len(want)


def test_window_bands_stripe_window_narrower_than_the_stride():
    """Stripe at W=4 with a window of 2 keys: rank 0 sees rank 3's previous token and nothing of ranks 1, 2."""
    runs = [bands.layout_runs("stripe", 16, r, 4) for r in range(4)]
    assert bands.block_parts(runs[0], runs[1], 2) == ()
    assert bands.block_parts(runs[0], runs[2], 2) == ()
    assert bands.block_parts(runs[0], runs[3], 2) == (bands.Part((1, 4), (0, 3), (0, 0)),)  # 4 sees 3, 8 sees 7...


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_balanced_layout_holds_every_token_once_and_equal_shares(world_size):
    """Documents of awkward lengths (0, 1, below 2W, not multiples of 2W): every position on exactly one
    rank, S/W on each, each rank's pieces a head and a tail chunk of each document in order."""
    docs = [0, 1, 2 * world_size - 1, 37, 5 * world_size + 3, 96]
    docs.append((-sum(docs)) % world_size or world_size)
    offsets = [0]
    for n in docs:
        offsets.append(offsets[-1] + n)
    held = [balanced.token_index(offsets, r, world_size) for r in range(world_size)]
    assert sorted(p for h in held for p in h) == list(range(offsets[-1]))
    assert {len(h) for h in held} == {offsets[-1] // world_size}
    for r in range(world_size):
        docs_seen = [p.doc for p in balanced.pieces(offsets, world_size)[r]]
        assert docs_seen == sorted(docs_seen)
    cu = layouts.varlen_local_cu_seqlens(offsets, "balanced", 0, world_size, by_document=False)
    assert cu.tolist()[-1] == offsets[-1] // world_size
    x = torch.arange(offsets[-1]).view(1, -1)
    shards = [layouts.shard_varlen(x, offsets, "balanced", r, world_size, by_document=False) for r in range(world_size)]
    assert torch.equal(layouts.unshard_varlen(shards, offsets, "balanced", by_document=False), x)


def _spec(**changes):
    base = default_fields("cpu", 0) | dict(task="run", variant="ring", seqlen=16, world_size=2)
    return resolve_docs(CaseSpec(**(base | changes)))


def test_work_per_rank_hand_computed():
    """Attention pairs per rank, counted by hand.

    ring, S=16, W=2, causal: rank 0 holds 0..7 (1+..+8 = 36), rank 1 holds 8..15 (9+..+16 = 100);
    max/mean = 100/68. A window of 4: rank 0 1+2+3+4*5 = 26, rank 1 8*4 = 32. zigzag, W=2, S=16:
    rank 0 chunks 0 and 3 (1+2+3+4 + 13+14+15+16 = 68), rank 1 chunks 1 and 2 (5+..+12 = 68).
    stripe, W=2, S=8, window 3: rank 0 positions 0,2,4,6 (1+3+3+3), rank 1 1,3,5,7 (2+3+3+3).
    Not causal: every rank 8 * 16. llama3_varlen, docs 10,6 at W=2 contiguous: rank 0 holds doc 0's
    0..7 (36), rank 1 doc 0's 8, 9 (9+10) and doc 1 (21): 40. Batch 2 doubles every count.
    """
    assert work.pairs_per_rank(_spec()) == [36, 100]
    assert work.predicted_fields(_spec())["predicted_max_over_mean"] == pytest.approx(100 / 68)
    assert work.pairs_per_rank(_spec(window=4)) == [26, 32]
    assert work.pairs_per_rank(_spec(variant="zigzag")) == [68, 68]
    assert work.pairs_per_rank(_spec(variant="stripe", seqlen=8, window=3)) == [10, 11]
    assert work.pairs_per_rank(_spec(causal=False)) == [128, 128]
    assert work.pairs_per_rank(_spec(variant="llama3_varlen", docs="10,6")) == [36, 40]
    assert work.pairs_per_rank(_spec(batch=2)) == [72, 200]


def test_work_rides_in_every_record():
    """A record of any status carries the prediction (here a skipped one, built with no process)."""
    from ringbench.records import build as records

    rec = records.build(_spec(), run_id="r", status="skipped", reason="not here")
    assert rec["predicted_pairs_per_rank"] == [36, 100]
    assert rec["predicted_max_over_mean"] == pytest.approx(100 / 68)


@pytest.mark.parametrize("world_size,contiguous", [(2, 1.28), (8, 2.54)])
def test_balanced_layout_evens_the_lognormal_mix(world_size, contiguous):
    """The 12-document lognormal mix at 64k (mean 8k, sigma 1, seed 0): the contiguous cut gives
    max/mean about 1.28 at W=2 and 2.54 at W=8; balanced gives at most 1.05."""
    fields = dict(variant="llama3_varlen", seqlen=65536, world_size=world_size, doc_dist="lognormal:mean=8k,sigma=1")
    before = work.predicted_fields(_spec(**fields))["predicted_max_over_mean"]
    after = work.predicted_fields(_spec(**fields, layout="balanced"))["predicted_max_over_mean"]
    print(f"W={world_size}: contiguous {before:.4f}, balanced {after:.4f}")
    assert len(_spec(**fields).docs.split(",")) == 12
    assert before == pytest.approx(contiguous, abs=0.01)
    assert after <= 1.05


def test_window_flops_count_only_the_pairs_inside():
    """A window as long as the sequence is the causal figure; a window of w keys over S tokens gives
    4 * (S*w - w^2/2) * H * D forward."""
    base = dict(batch=1, seqlen=1024, heads=2, head_dim=8, causal=True, mode="fwd")
    assert attention_flops(**base, window=1024) == attention_flops(**base)
    assert attention_flops(**base, window=4096) == attention_flops(**base)
    assert attention_flops(**base, window=128) == 4 * (1024 * 128 - 128 ** 2 / 2) * 2 * 8
    assert attention_flops(**base, docs=[1000, 24], window=100) == 4 * (1000 * 100 - 5000 + 24 * 24 - 288) * 2 * 8


@pytest.mark.parametrize("args,sentence", [
    (["--variant", "ring", "--window", "0"], "window '0' must be positive; use a size such as 4096 or 128k"),
    (["--variant", "ring", "--window", "-8"], "window '-8' must be positive; use a size such as 4096 or 128k"),
    (["--variant", "ring", "--window", "64", "--no-causal"],
     "a sliding window is causal (query p sees keys p - window + 1 .. p), so --window 64 needs --causal; drop "
     "--no-causal or --window"),
    (["--variant", "rfa_ring", "--window", "64"],
     "rfa_ring cannot take a sliding window (--window 64); use one of ring, zigzag, stripe, llama3, ring_varlen, "
     "zigzag_varlen, llama3_varlen, ulysses, ulysses_varlen, usp, usp_varlen"),
    (["--variant", "torch_cp", "--window", "64"],
     "torch_cp cannot take a sliding window (--window 64); use one of ring, zigzag, stripe, llama3, ring_varlen, "
     "zigzag_varlen, llama3_varlen, ulysses, ulysses_varlen, usp, usp_varlen"),
])
def test_window_refusals_exit_2_with_one_sentence(tmp_path, args, sentence):
    """Bad windows, and windows given to peers, are refused before anything starts, by run as by verify."""
    for task in ("verify", "run"):
        result = runner.invoke(app, [task, *args, "--device", "cpu", "--seqlen", "256", "--out", str(tmp_path)])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == sentence, task
        assert not (tmp_path / f"{task}.jsonl").exists() and not (tmp_path / "runs.jsonl").exists()
