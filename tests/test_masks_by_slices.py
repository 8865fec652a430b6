"""A mask on a kernel that takes windows but no mask (``Kernel.by_slices``: flash-attn-4, flash-attn,
torch-flash, cpu): every partial block cut into one flash-attn window call per slice of the mask
(``masked.slice_parts`` over ``bands.box_part``), merged by lse.

The quick tests check the cut itself, exhaustively over the named families and a slices file, the
three layouts and world sizes 1 to 8: the calls of a block hold exactly the pairs the mask leaves in
it, each once, every call's rows see a key, and every window is one flash-attn takes (both sides 0
or more); and the one-device cut (``masked.Sliced``) against the float64 math kernel under the dense
mask. The slow one runs verify through the CLI with the cpu kernel on every batch engine, where the
locally-masked fixture must fail.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from helpers import command_cases, pool_cli_verify
from ringbench.variants.engines import bands, masked, masks
from ringbench.variants.kernels import KERNELS

DATA = Path(__file__).parent / "data" / "masks"
S = 128
TEXTS = ("window:9,4", "prefix:40", "shared-prefix:28,answers=4", "chunked:24", "global:4,window:24", "window:17,0")
#: A slices file, at the 256 tokens it covers: image tokens that see each other both ways inside causal text.
IMAGE = masks.read_file(DATA / "image_in_text.txt")


def _cover(parts, m: int, n: int) -> torch.Tensor:
    """int ``[m, n]``: how many of ``parts`` hold each (row, key) pair of the block."""
    seen = torch.zeros(m, n, dtype=torch.int64)
    for p in parts:
        (q0, q1), (k0, k1) = p.q, p.kv
        mq, nk = q1 - q0, k1 - k0
        i, j = torch.arange(mq)[:, None], torch.arange(nk)[None, :]
        ok = torch.ones(mq, nk, dtype=torch.bool)
        assert getattr(p, "mask", None) is None, f"{p} needs a mask-taking kernel"  # full parts are MaskPart(mask=None)
        if getattr(p, "window", None) is not None:
            left, right = p.window
            assert (left is None or left >= 0) and (right is None or right >= 0), p
            ok &= (j >= i + nk - mq - left) if left is not None else ok
            ok &= (j <= i + nk - mq + right) if right is not None else ok
        assert ok.any(1).all(), f"a row of {p} sees no key"
        seen[q0:q1, k0:k1] += ok.long()
    return seen


@pytest.mark.parametrize("text, seqlen", [(t, S) for t in TEXTS] + [(IMAGE, 256)], ids=lambda t: masks.label(str(t))[:24])
def test_by_slices_the_calls_of_every_block_hold_exactly_the_masks_pairs_once(text, seqlen):
    mask = masks.build(text, seqlen)
    dense = masked.dense_mask(mask)
    blocks = 0
    for layout, world_size in itertools.product(("contiguous", "zigzag", "stripe"), (1, 2, 4, 8)):
        runs = [bands.layout_runs(layout, seqlen, r, world_size) for r in range(world_size)]
        for r, source in itertools.product(range(world_size), repeat=2):
            qpos = torch.cat([masked.positions(x) for x in runs[r]])
            kpos = torch.cat([masked.positions(x) for x in runs[source]])
            parts = masked.block_parts(mask, runs[r], runs[source], by_slices=True)
            got = _cover(parts, len(qpos), len(kpos))
            assert got.max() <= 1 and torch.equal(got.bool(), dense[qpos][:, kpos]), (layout, world_size, r, source)
            blocks += 1
    assert blocks == 3 * (1 + 4 + 16 + 64)


@pytest.mark.parametrize("inner, docs", [("full", (32, 1, 95)), ("prefix:10", (7, 25, 1, 95)),
                                         ("window:20,5", (7, 25, 1, 95)), ("causal", (1, 63, 1, 63))])
def test_by_slices_a_one_token_document_makes_no_empty_call(inner, docs):
    # A batch engine's layout over the packed row: under stripe a one-token document's key sits on one
    # rank only, and the others' blocks must not call the kernel on no keys (a crash, found trying
    # verify --docs 32,1,31 --no-causal on stripe as a new user would).
    mask = masks.build(masks.packed(docs, inner), 128)
    dense = masked.dense_mask(mask)
    for layout, world_size in itertools.product(("contiguous", "zigzag", "stripe"), (2, 4)):
        runs = [bands.layout_runs(layout, 128, r, world_size) for r in range(world_size)]
        for r, source in itertools.product(range(world_size), repeat=2):
            qpos = torch.cat([masked.positions(x) for x in runs[r]])
            kpos = torch.cat([masked.positions(x) for x in runs[source]])
            parts = masked.block_parts(mask, runs[r], runs[source], by_slices=True)
            assert all(p.q[1] > p.q[0] and p.kv[1] > p.kv[0] for p in parts), (layout, world_size, r, source, parts)
            got = _cover(parts, len(qpos), len(kpos))
            assert got.max() <= 1 and torch.equal(got.bool(), dense[qpos][:, kpos]), (layout, world_size, r, source)


def test_by_slices_prefix_makes_at_most_two_calls_a_block_and_chunked_one_a_chunk():
    runs = bands.layout_runs("contiguous", 256, 0, 1)
    assert len(masked.block_parts(masks.build("prefix:40", 256), runs, runs, by_slices=True)) == 2
    assert len(masked.block_parts(masks.build("chunked:32", 256), runs, runs, by_slices=True)) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("text", TEXTS[1:5])
def test_by_slices_one_device_matches_the_dense_float64_mask(text, dtype):
    """The whole row through the cpu kernel's window calls against the math kernel in float64 under
    the dense mask: out and lse within a few roundings of the dtype, dq dk dv too."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, 2, 16, dtype=torch.float64) for _ in range(4))
    mask = masks.build(text, S)
    row = [bands.Run(0, 0, 1, S)]
    sliced = masked.Sliced(KERNELS["cpu"], mask, row, row)
    assert len(sliced.parts) > 1
    every = torch.arange(S)
    dense = {"mask": masked.PositionMask(every, every, mask.allows, text)}
    math = KERNELS["math"]
    ref_out, ref_lse = math.forward(q, k, v, False, 0.25, **dense)
    ref_grads = math.backward(dout, q, k, v, ref_out, ref_lse, False, 0.25, **dense)
    low = [x.to(dtype) for x in (q, k, v, dout)]
    out, lse = sliced.forward(*low[:3], False, 0.25)
    grads = sliced.backward(low[3], *low[:3], out, lse, False, 0.25)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    tol = 8 * torch.finfo(dtype).eps
    for got, want in ((out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)):
        assert (got.double() - want).abs().max() <= tol * (1 + want.abs().max()), text


def test_by_slices_one_device_passes_the_bias_block_to_each_window_call():
    """The cut under ALiBi (the math kernel taking the window calls, since it takes a bias): every call gets
    its rows' and keys' block of the bias, so out, lse and the gradients equal the dense mask's with the
    same bias in float64 (a cut that dropped or shifted the bias would be off by the slopes' distances)."""
    from ringbench.variants.kernels.common import Bias, PositionBias, alibi_slopes

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, 4, 16, dtype=torch.float64) for _ in range(4))
    mask, every = masks.build("prefix:40", S), torch.arange(S)
    bias = PositionBias(Bias("alibi", torch.tensor(alibi_slopes(4), dtype=torch.float64)), every, every)
    row = [bands.Run(0, 0, 1, S)]
    math = KERNELS["math"]
    sliced = masked.Sliced(math, mask, row, row)
    assert len(sliced.parts) > 1
    dense = {"mask": masked.PositionMask(every, every, mask.allows, "prefix:40"), "bias": bias}
    ref_out, ref_lse = math.forward(q, k, v, False, 0.25, **dense)
    ref_grads = math.backward(dout, q, k, v, ref_out, ref_lse, False, 0.25, **dense)
    out, lse = sliced.forward(q, k, v, False, 0.25, bias=bias)
    grads = sliced.backward(dout, q, k, v, out, lse, False, 0.25, bias=bias)
    for got, want in ((out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    plain = sliced.forward(q, k, v, False, 0.25)[0]
    assert (plain - ref_out).abs().max() > 1e-2


BY_SLICES_VARIANTS = ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp", "mask_local_only")


def _by_slices_cases() -> list:
    """``verify --kernel cpu --world-size 4 ... --mask shared-prefix:28,answers=4 --mask chunked:24`` of every batch
    engine and the local-only mask, as the command line builds it."""
    return command_cases("verify", {"device": "cpu", "kernel": "cpu", "world_size": [4], "seqlen": 256, "heads": 8,
                                    "kv_heads": 2, "head_dim": 16, "dtype": "bf16",
                                    "mask": ["shared-prefix:28,answers=4", "chunked:24"],
                                    "variant": list(BY_SLICES_VARIANTS)})


# The session's pooled verify command of world size 4 with failing cases runs them (helpers.CliVerifyPool).
pool_cli_verify(__name__, lambda world_size: _by_slices_cases() if world_size == 4 else [], exit_code=1)


@pytest.mark.dist
@pytest.mark.slow  # a share of the session's pooled launch of four ranks through the CLI
def test_by_slices_verify_passes_every_batch_engine_on_the_cpu_kernel_and_the_local_only_mask_fails(cli_verify_pool):
    got = cli_verify_pool.get(__name__, 4)
    done, records = got["result"], got["records"]
    assert done.returncode == 1 and len(records) == 2 * len(BY_SLICES_VARIANTS), done.stdout + done.stderr
    for r in records:
        assert r["kernel"] == "cpu", r["kernel"]
        ok = r["status"] == "ok" and all(c["passed"] for c in r["checks"])
        assert ok == (r["spec"]["variant"] != "mask_local_only"), (r["spec"]["variant"], r["spec"]["mask"], r["reason"])
        if ok:
            assert r["cp_active"] is True and all(c["shadow_passed"] for c in r["checks"]), r["spec"]["variant"]
