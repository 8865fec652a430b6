"""The flex kernel (PyTorch's FlexAttention, ``variants/kernels/flex.py``) against the math kernel.

On CPU in float64 (flex's eager fallback takes it, so the two kernels agree to rounding, 1e-10): out, lse,
dq, dk, dv and d bias under the mask families prefix, shared-prefix, chunked and global beside a window,
plain causal and no mask, each without a bias, with ALiBi and with a learnable ``1hss`` bias, with GQA
(4 query heads over 2) and an awkward length (40 rows); a value head dim apart from the query one. The
ring's use of the backward: keys split in two blocks, the blocks' results merged by lse, each block's
backward given the merged out and lse, the gradients summed, equal to the whole row's; a block whose rows
see no key (out 0, lse ``-inf``, zero gradient, no NaN). Where ``auto`` puts flex, and the kernel's one-
sentence refusals. Then verify with the flex kernel on two and four ranks (gloo), in the session's shared launches. Last, bf16 and fp32 against the float64 math kernel by the rule of ``test_kernels_gpu.py`` (twice the
math kernel's own error in that dtype, plus a floor), the two-block split again: on CPU, and on a GPU
(``gpu``) with the compiled flex.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from helpers import kernel_rule_problem, not_verified, pool_verify_batches
from ringbench.case.spec import CaseSpec, canonical, default_fields, resolve_mask, resolve_options, validate
from ringbench.variants.engines import masks
from ringbench.variants.kernels import AUTO_ORDER, KERNELS, resolve_kernel
from ringbench.variants.kernels.common import Bias, PositionMask, alibi_slopes, bias_tensor_shape, merge_

FLEX, MATH = KERNELS["flex"], KERNELS["math"]
#: 40 rows (no power of two), GQA 4/2, batch 2; float64 on CPU.
B, S, H, HKV, D = 2, 40, 4, 2, 16
SCALE = D ** -0.5
#: The mask families beside the plain ones ("causal": causal=True and no mask; "": neither).
MASKS = ("prefix:10", "shared-prefix:8,answers=2", "chunked:12", "global:3,window:9", "causal", "")
BIASES = ("", "alibi", "1hss")


def _inputs(device="cpu", dtype=torch.float64, s: int = S, dv: int = D, seed: int = 3) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, s, H, D), (B, s, HKV, D), (B, s, HKV, dv), (B, s, H, dv))
    return tuple(torch.randn(x, generator=gen, dtype=torch.float64).to(device, dtype) for x in shapes)


def _bias(kind: str, device="cpu", s: int = S) -> Bias | None:
    if not kind:
        return None
    if kind == "alibi":
        return Bias(kind, torch.tensor(alibi_slopes(H), dtype=torch.float64, device=device))
    gen = torch.Generator().manual_seed(11)
    return Bias(kind, (torch.randn(bias_tensor_shape(kind, B, H, s), generator=gen, dtype=torch.float64) * 0.5)
                .to(device))


def _keywords(mask: str, bias: Bias | None, q_pos, k_pos, s: int = S) -> tuple[bool, dict]:
    """(causal, kernel keywords) of a call of rows ``q_pos`` against keys ``k_pos``."""
    kw = {} if bias is None else {"bias": bias.at(q_pos, k_pos)}
    if mask in ("causal", ""):
        return mask == "causal", kw
    return False, {**kw, "mask": _position_mask(mask, q_pos, k_pos, s)}


def _position_mask(text: str, q_pos, k_pos, s: int = S, *, slices: bool = True) -> PositionMask:
    """The PositionMask of mask ``text`` over ``s`` tokens, with its slices as data (as the engines give it,
    ``masked.position_mask``) or, ``slices`` False, its predicate alone."""
    built = masks.build(text, s)
    data = tuple((x.q0, x.q1, x.k0, x.k1, x.lo, x.hi) for x in built.slices) if slices else None
    return PositionMask(q_pos, k_pos, built.allows, text, slices=data)


def _run(kernel, q, k, v, dout, causal, kw, bias: Bias | None, grad_dtype=torch.float64) -> dict:
    """out, lse, dq, dk, dv (and dbias for a learnable bias) of one call, forward then backward."""
    if bias is not None and bias.learnable:
        bias.open_grad(grad_dtype)
    out, lse = kernel.forward(q, k, v, causal, SCALE, **kw)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, SCALE, **kw)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    if bias is not None and bias.learnable:
        got["dbias"] = bias.close_grad()
    return got


def _assert_close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), f"{name}: -inf at other positions"
        finite = torch.isfinite(b)
        diff = (a[finite] - b[finite]).abs()
        print(f"{name}: max {float(diff.max()):.3e} mean {float(diff.mean()):.3e}")
        assert torch.isfinite(a[finite]).all() and float(diff.max()) <= tol, name


@pytest.mark.parametrize("bias_kind", BIASES, ids=lambda b: b or "no-bias")
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m or "full")
def test_flex_matches_math_under_every_mask_and_bias(mask, bias_kind):
    """Every mask family (and plain causal, and no mask) with no bias, ALiBi and a learnable 1hss bias, GQA:
    flex's out, lse, dq, dk, dv and d bias equal the math kernel's in float64."""
    q, k, v, dout = _inputs()
    every = torch.arange(S)
    found = {}
    for kernel in (FLEX, MATH):
        bias = _bias(bias_kind)
        causal, kw = _keywords(mask, bias, every, every)
        found[kernel.name] = _run(kernel, q, k, v, dout, causal, kw, bias)
    _assert_close(found["flex"], found["math"], 1e-10)


def test_flex_takes_a_value_head_dim_apart_from_the_query_one():
    """v of head dim 8 beside q and k of 16 (MLA's shapes), under a mask and a learnable bias: as math."""
    q, k, v, dout = _inputs(dv=8)
    every = torch.arange(S)
    found = {}
    for kernel in (FLEX, MATH):
        bias = _bias("1hss")
        causal, kw = _keywords("chunked:12", bias, every, every)
        found[kernel.name] = _run(kernel, q, k, v, dout, causal, kw, bias)
    assert found["flex"]["out"].shape == (B, S, H, 8)
    _assert_close(found["flex"], found["math"], 1e-10)


@pytest.mark.parametrize("bias_kind", ("alibi", "1hss"))
def test_flex_backward_of_two_key_blocks_with_the_merged_out_and_lse_gives_the_whole_rows(bias_kind):
    """The ring's use: keys split in two blocks (positions 0..19 and 20..39, so under prefix:10 the first 20
    queries see nothing of the second block), each block's out and lse from flex, merged by lse; each block's
    backward given the merged out and lse and its gradients summed (dq over the blocks, dk and dv at their
    keys, d bias into one open gradient) equal the math kernel's over the whole rows."""
    q, k, v, dout = _inputs()
    every, halves = torch.arange(S), (slice(0, S // 2), slice(S // 2, S))
    bias = _bias(bias_kind)
    want = _run(MATH, q, k, v, dout, *_keywords("prefix:10", bias, every, every), bias)

    calls = [(keys, *_keywords("prefix:10", bias, every, every[keys])) for keys in halves]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((B, H, S), -math.inf, dtype=torch.float64)
    for keys, causal, kw in calls:
        merge_(out, lse, *FLEX.forward(q, k[:, keys], v[:, keys], causal, SCALE, **kw))
    if bias.learnable:
        bias.open_grad(torch.float64)
    got = dict(out=out, lse=lse, dq=torch.zeros_like(q), dk=torch.zeros_like(k), dv=torch.zeros_like(v))
    for keys, causal, kw in calls:
        dq, dk, dv = FLEX.backward(dout, q, k[:, keys], v[:, keys], out, lse, causal, SCALE, **kw)
        got["dq"] += dq
        got["dk"][:, keys], got["dv"][:, keys] = dk, dv
    if bias.learnable:
        got["dbias"] = bias.close_grad()
    _assert_close(got, want, 1e-10)


def test_flex_gives_a_row_that_sees_no_key_out_0_lse_minus_inf_and_no_gradient():
    """Queries 0..15 against keys 8..23 under chunked:8: rows 0..7 see no key (another chunk). Their out is 0,
    lse -inf and dq 0, every gradient finite, and everything as the math kernel's."""
    q, k, v, dout = _inputs(s=16)
    q_pos, k_pos = torch.arange(16), torch.arange(8, 24)
    found = {}
    for kernel in (FLEX, MATH):
        bias = _bias("1hss", s=24)
        kw = {"mask": _position_mask("chunked:8", q_pos, k_pos, 24, slices=False), "bias": bias.at(q_pos, k_pos)}
        found[kernel.name] = _run(kernel, q, k, v, dout, False, kw, bias)
    got = found["flex"]
    assert torch.isneginf(got["lse"][:, :, :8]).all() and torch.isfinite(got["lse"][:, :, 8:]).all()
    assert not got["out"][:, :8].any() and not got["dq"][:, :8].any()
    assert all(torch.isfinite(t).all() for t in got.values() if t is not got["lse"])
    _assert_close(got, found["math"], 1e-10)


@pytest.mark.parametrize("mask", [m for m in MASKS if ":" in m] + ["window:9,4"])
def test_flex_mask_mod_from_the_slices_is_the_predicate(mask):
    """The mask_mod that reads the slices as data (what compiles once per slice count) allows exactly the
    pairs of the mask's predicate, over a block of queries 5..36 against keys 12..39."""
    from torch.nn.attention.flex_attention import create_mask

    from ringbench.variants.kernels import flex

    q_pos, k_pos = torch.arange(5, 37), torch.arange(12, 40)
    for slices in (True, False):
        held = _position_mask(mask, q_pos, k_pos, slices=slices)
        assert (held.slices is not None) == slices
        got = create_mask(flex._position_mod(held), None, None, len(q_pos), len(k_pos), device="cpu")
        assert torch.equal(got[0, 0], held.dense())


def test_flex_keeps_one_block_mask_per_mask_object():
    """Forward and backward of one PositionMask build its BlockMask once (kept beside the mask)."""
    from ringbench.variants.kernels import flex

    q, k, v, dout = _inputs()
    every = torch.arange(S)
    causal, kw = _keywords("prefix:10", None, every, every)
    first = flex.block_mask(kw["mask"], q.device)
    _run(FLEX, q, k, v, dout, causal, kw, None)
    assert flex.block_mask(kw["mask"], q.device) is first


def _everywhere(registry: dict) -> dict:
    """The registry with every kernel available (as on a GPU with every package), for ``auto``'s order."""
    return {n: dataclasses.replace(kern, unavailable=lambda: None) for n, kern in registry.items()}


def test_flex_is_named_never_picked_by_auto():
    """``auto`` never picks flex (it compiles each block shape on CUDA, and one GPU case fails): flash-attn-4
    keeps plain causal bf16, masks (window calls) and ALiBi (a score mod), math takes a bias tensor or fp32; ``--kernel flex`` takes both."""
    assert "flex" not in AUTO_ORDER["cuda"] and "flex" not in AUTO_ORDER["cpu"]
    every = _everywhere(KERNELS)
    pick = lambda **rules: resolve_kernel("auto", "cuda", head_dim=128, kernels=every, **rules).name  # noqa: E731
    assert pick(dtype=torch.bfloat16) == "flash-attn-4"
    assert pick(dtype=torch.bfloat16, mask="prefix:512") == "flash-attn-4"
    assert pick(dtype=torch.bfloat16, bias="alibi") == "flash-attn-4"  # its own score mod
    assert pick(dtype=torch.bfloat16, bias="1hss") == "math"
    assert pick(dtype=torch.float32, mask="prefix:512", bias="1hss") == "math"
    assert resolve_kernel("flex", "cuda", head_dim=128, kernels=every, dtype=torch.bfloat16, bias="alibi").name == "flex"
    assert resolve_kernel("flex", "cpu", dtype=torch.float64, mask="prefix:10", bias="alibi") is FLEX


@pytest.mark.parametrize("rules, pattern", [
    (dict(varlen=True), r"^the flex kernel has no varlen form in ringbench \(its packed-documents form .*\); "
                        r"pass --kernel with one of cpu, math or auto$"),
    (dict(window=True), r"^the flex kernel cannot take a sliding window \(it takes masks by position, and a one-sided "
                        r"window \(--window L, --mask window:L\) runs as window calls; window:L,R and "
                        r"global:G,window:L run on it\); pass --kernel with one of cpu, math or auto$"),
    (dict(max_logit=True), r"^the flex kernel cannot return the per-head max logit \(.*max_scores.*\), which "
                           r"--max-logit needs; pass --kernel math$"),
    (dict(head_dim=512), r"^head_dim 512 exceeds 256, the largest the flex kernel takes; pass another --head-dim, "
                         r"or --kernel with one of cpu, math$"),
])
def test_flex_refusals_are_one_sentence_naming_the_value_and_rule(rules, pattern):
    with pytest.raises(ValueError, match=pattern) as caught:
        resolve_kernel("flex", "cpu", **rules)
    assert caught.value.args[0].count(". ") == 0


def test_flex_refuses_a_window_call_and_a_mask_with_causal():
    q, k, v, _ = _inputs()
    every = torch.arange(S)
    with pytest.raises(ValueError, match=r"the flex kernel takes no window call \(\(8, 0\)\); a one-sided window runs on"):
        FLEX.forward(q, k, v, False, SCALE, window=(8, 0))
    _, kw = _keywords("prefix:10", None, every, every)
    with pytest.raises(ValueError, match="a call with a mask takes neither causal=True nor a window"):
        FLEX.forward(q, k, v, True, SCALE, **kw)


# --------------------------------------------------------------------------- through the command line

#: The verify cases at two and four ranks: (variants, mask, bias).
VERIFIED = {2: (("ring", "zigzag", "llama3", "ulysses"), "prefix:40", "1hss"),
            4: (("stripe", "usp", "ring"), "shared-prefix:28,answers=2", "alibi")}


def _verify_spec(variant: str, world_size: int, mask: str, bias: str) -> dict:
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "flex", "seqlen": 128,
            "world_size": world_size, "heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "fp32", "mask": mask,
            "bias": bias}
    case = resolve_options(canonical(resolve_mask(CaseSpec(**base))))
    validate(case, visible_gpus=0)
    return case.to_dict()


def _verify_batches(world_size: int, with_slow: bool) -> dict:
    # Slow only: the session's launch at that world size (helpers.VerifyPool) takes these cases beside the
    # other modules', so they cost no launch of their own.
    if not with_slow or world_size not in VERIFIED:
        return {}
    variants, mask, bias = VERIFIED[world_size]
    return {"flex": ([{"name": v, "spec": _verify_spec(v, world_size, mask, bias)} for v in variants], 300)}


pool_verify_batches(__name__, _verify_batches)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(VERIFIED), ids=lambda w: f"w{w}")
def test_flex_verify_passes_under_a_mask_and_a_bias(verify_pool, world_size):
    """verify with the flex kernel, a mask and a bias on real torchrun (gloo, CPU): every variant passes every
    tensor (out, lse, dq, dk, dv, and dbias for the learnable one) against the float64 reference."""
    launch = verify_pool.get(__name__, world_size, "flex")
    records = launch["records"]
    assert not launch["timed_out"] and set(records) == set(launch["expected"]), launch["log_tail"]
    assert sorted(records) == sorted(VERIFIED[world_size][0])
    assert not not_verified(records), not_verified(records)
    for name, rec in records.items():
        spec = launch["cases"][name]
        assert spec["kernel"] == "flex" and rec["cp_active"] is True, name
        tensors = {c["tensor"] for c in rec["checks"] if c["passed"]}
        assert {"out", "lse", "dq", "dk", "dv"} <= tensors, name
        assert ("dbias" in tensors) == (spec["bias"] != "alibi"), name


# --------------------------------------------------------------------------- in low precision, and on a GPU

#: The rule's device: CPU (flex's eager fallback, the CPU backward) and, on a GPU, CUDA (the compiled flex).
DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device is visible: this case runs flex on a GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "fp32"))
@pytest.mark.parametrize("mask, bias_kind", [("prefix:100", "1hss"), ("chunked:96", "alibi"),
                                             ("global:8,window:64", ""), ("causal", "1hss")])
def test_flex_matches_math_by_the_kernel_rule_in_low_precision(device, dtype, mask, bias_kind, request):
    """flex in bf16 and fp32 (compiled on CUDA), split in two key blocks as the ring calls it (merged by lse,
    backward with the merged out and lse), against the math kernel in float64 on the same inputs, by
    ``test_kernels_gpu.py``'s rule: within twice the error of the math kernel in the same dtype, plus its floor
    (16 float32 ulps for lse and dbias)."""
    if (device, dtype, mask, bias_kind) == ("cuda", torch.bfloat16, "causal", "1hss"):
        # Strict: a fix makes this fail, and the note in docs/variants-and-kernels.md goes with it.
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "on an H100 (torch 2.11, 2026-12-07) d bias was 1.28e-2 off against an allowed 1.03e-2 (1.25x), about one "
            "bf16 unit of its largest entry, with a learnable bias in bf16 under the causal mask by positions; the "
            "lse, 124x its bound before the bias was added in float32, is now at 0.06x; not yet understood")))

    s = 384 if device == "cuda" else 160  # two chunks of chunked:96 on CPU too, in a second or two a case
    q, k, v, dout = _inputs(device, dtype, s=s)
    every, halves = torch.arange(s, device=device), (slice(0, s // 2), slice(s // 2, s))

    def whole(kernel, x):
        bias = _bias(bias_kind, device, s)
        return _run(kernel, *x, *_keywords(mask, bias, every, every, s), bias,
                    grad_dtype=torch.float64 if x[0].dtype == torch.float64 else torch.float32)

    ref = whole(MATH, tuple(t.double() for t in (q, k, v, dout)))
    low = whole(MATH, (q, k, v, dout))
    bias = _bias(bias_kind, device, s)
    out = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.full((B, H, s), -math.inf, dtype=torch.float32, device=device)
    calls = []
    for keys in halves:
        causal, kw = _keywords(mask, bias, every, every[keys], s)
        if causal:  # a rectangular block under causal is the mask "causal" by positions
            causal, kw = False, {**kw, "mask": _position_mask("causal", every, every[keys], s)}
        calls.append((keys, causal, kw))
        merge_(out, lse, *FLEX.forward(q, k[:, keys], v[:, keys], causal, SCALE, **kw))
    out = out.to(dtype)
    if bias is not None and bias.learnable:
        bias.open_grad(torch.float32)
    got = dict(out=out, lse=lse, dq=torch.zeros_like(q, dtype=torch.float32),
               dk=torch.zeros_like(k, dtype=torch.float32), dv=torch.zeros_like(v, dtype=torch.float32))
    for keys, causal, kw in calls:
        dq, dk, dv = FLEX.backward(dout, q, k[:, keys], v[:, keys], out, lse, causal, SCALE, **kw)
        got["dq"] += dq
        got["dk"][:, keys], got["dv"][:, keys] = dk.float(), dv.float()
    got["dq"] = got["dq"].to(dtype)
    got["dk"], got["dv"] = got["dk"].to(dtype), got["dv"].to(dtype)
    if bias is not None and bias.learnable:
        got["dbias"] = bias.close_grad()
    failed = [p for p in (kernel_rule_problem(t, got[t], low[t], ref[t]) for t in ref) if p]
    assert not failed, "flex breaks the rule: " + " | ".join(failed)



def test_flex_runs_alibi_beside_a_mask_at_world_size_1(tmp_path):
    """At world size 1 the engine's call and the reference's give flex a mask and ALiBi over the same
    position tensors; dynamo's aliasing guard failed with an IndexError on the second call's recompile."""
    from helpers import ringbench_here

    res = ringbench_here("run", "--device", "cpu", "--kernel", "flex", "--variant", "zigzag", "--world-size", "1",
                         "--seqlen", "128", "--head-dim", "16", "--mask", "prefix:40", "--bias", "alibi",
                         "--iters", "1", "--warmup", "0", "--out", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rec = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[0])
    assert rec["status"] == "ok", rec.get("reason")
