"""Fast unit tests of ringbench.variants: the lse merge, the layouts, the local kernels, the ring
communicator's misuse errors and the registry. No test here needs more than one process.

Every numerical test prints its max and mean differences before asserting, so a failure says how
far off it was.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import attention_fp64, slow_when
from ringbench.variants import LAYOUT_CHUNKS, TESTING_ENV, TESTING_VARIANTS, VARIANTS, get_variant, list_variants
from ringbench.variants.engines import layouts
from ringbench.variants.kernels import AUTO_ORDER, KERNELS, as_kernel, check_kernel, get_kernel, resolve_kernel
from ringbench.variants.kernels.common import merge_

Tensor = torch.Tensor


# --------------------------------------------------------------------------- helpers

def report(label: str, got: Tensor, want: Tensor) -> tuple[float, float]:
    """Print and return the max and mean |got - want| over the entries where ``want`` is finite."""
    want = want.double()
    finite = torch.isfinite(want)
    diff = (got.double() - want)[finite].abs()
    max_diff = float(diff.max()) if diff.numel() else 0.0
    mean_diff = float(diff.mean()) if diff.numel() else 0.0
    print(f"{label}: max diff {max_diff:.3e}, mean diff {mean_diff:.3e}, "
          f"max |ref| {float(want[finite].abs().max()) if finite.any() else 0.0:.3e}")
    return max_diff, mean_diff


# --------------------------------------------------------------------------- merge_

def fold(blocks: list[tuple[Tensor, Tensor]], acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Fold (out, lse) blocks with merge_ from the empty state the ring starts from."""
    out0, lse0 = blocks[0]
    out = torch.zeros(out0.shape, dtype=acc)
    lse = torch.full(lse0.shape, -math.inf, dtype=acc)
    for b_out, b_lse in blocks:
        merge_(out, lse, b_out, b_lse.to(acc))
    return out, lse


def exact_combination(blocks: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The exact union of partial results in float64, through torch.logsumexp."""
    outs = torch.stack([o.double() for o, _ in blocks])            # [N, B, S, H, D]
    lses = torch.stack([l.double() for _, l in blocks])            # [N, B, H, S]
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse).transpose(2, 3).unsqueeze(-1)  # [N, B, S, H, 1]
    return (weights * outs).sum(0), lse


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    gaps=st.lists(st.sampled_from([0.0, 3.0, -7.5, 30.0, -60.0, 100.0, -100.0, 1000.0, -1000.0]),
                  min_size=6, max_size=6),
    seqlen=st.integers(1, 7),
    seed=st.integers(0, 2**16),
    acc=st.sampled_from([torch.float64, torch.float32]),
)
def test_merge_fold_matches_logsumexp_combination(sizes, gaps, seqlen, seed, acc):
    """Attention over a key set split into blocks, folded block by block, equals the whole.

    Block i's keys get ``gaps[i]`` added to every score, so partial lse values differ by up to
    ~2000 between blocks; the fold must still equal both the exact logsumexp combination and
    plain attention over all the keys.
    """
    gen = torch.Generator().manual_seed(seed)
    B, H, D = 2, 3, 8
    n_keys = sum(sizes)
    q = torch.randn(B, seqlen, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, n_keys, H, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, n_keys, H, D, generator=gen, dtype=torch.float64)
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    owner = owner[torch.randperm(n_keys, generator=gen)]  # a random split, not only contiguous runs
    bias = torch.tensor(gaps, dtype=torch.float64)[owner]
    scale = D ** -0.5
    blocks = []
    for i in range(len(sizes)):
        keys = (owner == i).nonzero().flatten()
        blocks.append(attention_fp64(q, k[:, keys], v[:, keys], causal=False, scale=scale,
                                     key_bias=bias[keys]))
    whole_out, whole_lse = attention_fp64(q, k, v, causal=False, scale=scale, key_bias=bias)
    comb_out, comb_lse = exact_combination(blocks)
    out, lse = fold([(o.to(acc), l.to(acc)) for o, l in blocks], acc)

    rtol = 1e-12 if acc == torch.float64 else 4e-6
    lse_scale = float(whole_lse.abs().max()) + 1.0
    d_out, _ = report("out vs logsumexp combination", out, comb_out)
    d_lse, _ = report("lse vs logsumexp combination", lse, comb_lse)
    d_out_whole, _ = report("out vs whole attention", out, whole_out)
    d_lse_whole, _ = report("lse vs whole attention", lse, whole_lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # A merge weight is a sigmoid of an lse difference, and an lse near 1000 is known to
    # float32 only to ~6e-5; the output's error scales with the lse's magnitude too.
    assert d_out <= rtol * 8 * lse_scale and d_out_whole <= rtol * 8 * lse_scale
    assert d_lse <= rtol * lse_scale and d_lse_whole <= rtol * lse_scale


@pytest.mark.parametrize("gap", [100.0, 1000.0])
@pytest.mark.parametrize("big_first", [True, False], ids=["big_first", "big_second"])
def test_merge_large_gap_is_finite_and_exact(gap, big_first):
    """Two blocks whose lse differ by 100 or 1000 merge in float32 without overflow, in both orders."""
    gen = torch.Generator().manual_seed(int(gap) + big_first)
    B, S, H, D = 2, 5, 3, 4
    small = (torch.randn(B, S, H, D, generator=gen, dtype=torch.float64),
             torch.randn(B, H, S, generator=gen, dtype=torch.float64))
    big = (torch.randn(B, S, H, D, generator=gen, dtype=torch.float64), small[1] + gap)
    blocks = [big, small] if big_first else [small, big]
    want_out, want_lse = exact_combination(blocks)
    # The naive form lse + log(1 + exp(lse_b - lse)) overflows here in float32: this case is the pitfall.
    naive = small[1].float() + torch.log1p(torch.exp(big[1].float() - small[1].float()))
    assert not torch.isfinite(naive).all()

    out, lse = fold([(o.float(), l.float()) for o, l in blocks], torch.float32)
    d_out, _ = report(f"out, gap {gap}", out, want_out)
    d_lse, _ = report(f"lse, gap {gap}", lse, want_lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert d_out <= 4 * torch.finfo(torch.float32).eps * float(want_out.abs().max())
    assert d_lse <= 4 * torch.finfo(torch.float32).eps * float(want_lse.abs().max())


def _merge_case(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    B, S, H, D = 2, 6, 3, 4
    return (torch.randn(B, S, H, D, generator=gen), torch.randn(B, H, S, generator=gen),
            torch.randn(B, S, H, D, generator=gen), torch.randn(B, H, S, generator=gen))


def test_merge_neg_inf_running_lse_takes_block_exactly():
    """A running lse of -inf (nothing seen yet) contributes nothing: the result is the block, bit for bit."""
    out, lse, b_out, b_lse = _merge_case(1)
    lse[:, :, ::2] = -math.inf  # some rows empty, the others not
    keep_out, keep_lse = out.clone(), lse.clone()
    merge_(out, lse, b_out, b_lse)
    empty = torch.zeros_like(lse, dtype=torch.bool)
    empty[:, :, ::2] = True
    rows = empty.transpose(1, 2)  # [B, S, H]
    report("out on empty rows vs block", out[rows], b_out[rows])
    assert torch.equal(out[rows], b_out[rows])
    assert torch.equal(lse[empty], b_lse[empty])
    # The other rows really merged (they differ from both inputs).
    assert not torch.equal(out[~rows], keep_out[~rows]) and not torch.equal(lse[~empty], keep_lse[~empty])


def test_merge_neg_inf_block_lse_leaves_result_unchanged():
    """A block lse of -inf (a fully masked block) contributes nothing: the running result is kept exactly."""
    out, lse, b_out, b_lse = _merge_case(2)
    b_lse.fill_(-math.inf)
    keep_out, keep_lse = out.clone(), lse.clone()
    merge_(out, lse, b_out, b_lse)
    report("out vs before", out, keep_out)
    assert torch.equal(out, keep_out)
    assert torch.equal(lse, keep_lse)


def test_merge_both_neg_inf_stays_empty_and_finite():
    """Both lse -inf: lse stays -inf, out is unchanged and finite (no NaN from -inf - -inf)."""
    out, lse, b_out, b_lse = _merge_case(3)
    lse.fill_(-math.inf)
    b_lse.fill_(-math.inf)
    out.zero_()  # the ring's initial state
    merge_(out, lse, b_out, b_lse)
    report("out vs zeros", out, torch.zeros_like(out))
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


# --------------------------------------------------------------------------- layouts

AWKWARD_LOCAL = (1, 3, 7, 13)


@pytest.mark.parametrize("layout", sorted(LAYOUT_CHUNKS))
@pytest.mark.parametrize("world_size", range(1, 9))
def test_layouts_shard_unshard_round_trip(layout, world_size):
    """unshard(shard(x, r) for every r) gives x back exactly, and each position is held once."""
    for per_chunk in AWKWARD_LOCAL:
        seqlen = per_chunk * layouts.required_multiple(layout, world_size)
        x = torch.randn(2, seqlen, 3, 5)
        lse_like = torch.randn(2, 3, seqlen)
        shards = [layouts.shard(x, layout, r, world_size) for r in range(world_size)]
        lse_shards = [layouts.shard(lse_like, layout, r, world_size, dim=2) for r in range(world_size)]
        assert all(s.shape == (2, seqlen // world_size, 3, 5) for s in shards)
        back = layouts.unshard(shards, layout)
        lse_back = layouts.unshard(lse_shards, layout, dim=2)
        report(f"{layout} W={world_size} S={seqlen} round trip", back, x)
        assert torch.equal(back, x)
        assert torch.equal(lse_back, lse_like)
        held = torch.cat([layouts.token_index(layout, seqlen, r, world_size) for r in range(world_size)])
        assert torch.equal(held.sort().values, torch.arange(seqlen))


def test_layouts_zigzag_token_index_w2_s8():
    """Zigzag at W=2, S=8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    assert layouts.token_index("zigzag", 8, 0, 2).tolist() == [0, 1, 6, 7]
    assert layouts.token_index("zigzag", 8, 1, 2).tolist() == [2, 3, 4, 5]
    assert layouts.token_index("contiguous", 8, 1, 2).tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout, seqlen, world_size, multiple", [
    ("zigzag", 1000, 8, 16), ("zigzag", 12, 4, 8), ("contiguous", 10, 4, 4), ("contiguous", 97, 2, 2)])
def test_layouts_seqlen_not_multiple_raises(layout, seqlen, world_size, multiple):
    """A seqlen the layout cannot split evenly is refused with a ValueError naming both numbers."""
    pattern = rf"seqlen {seqlen}\b.*\b{multiple}\b"
    with pytest.raises(ValueError, match=pattern):
        layouts.token_index(layout, seqlen, 0, world_size)
    with pytest.raises(ValueError, match=pattern):
        layouts.shard(torch.zeros(1, seqlen, 1, 1), layout, 0, world_size)


# --------------------------------------------------------------------------- kernels

#: Allowed max error, in units of eps(input dtype) * max|reference|. A bf16 result is rounded
#: once to bf16 (half a unit) after blockwise work in float32; fp32 results carry rounding
#: accumulated over about sqrt(S) terms of the softmax sums and matmuls (S up to 257 here).
EPS_UNITS = {torch.float32: 32.0, torch.bfloat16: 4.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seqlen", [97, slow_when(257, True)])  # 257: 24 cases of up to 1.4 s on two cores
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kernel_name", ["cpu", "math"])
def test_kernels_match_fp64_reference(kernel_name, causal, kv_heads, seqlen, dtype):
    """Forward (out, lse) and backward (dq, dk, dv) of the CPU kernels against float64 autograd."""
    kernel = KERNELS[kernel_name]
    B, H, D = 2, 4, 32
    gen = torch.Generator().manual_seed(seqlen * 10 + kv_heads + 100 * causal)
    q = torch.randn(B, seqlen, H, D, generator=gen).to(dtype)
    k = torch.randn(B, seqlen, kv_heads, D, generator=gen).to(dtype)
    v = torch.randn(B, seqlen, kv_heads, D, generator=gen).to(dtype)
    dout = torch.randn(B, seqlen, H, D, generator=gen).to(dtype)
    scale = D ** -0.5

    out, lse = kernel.forward(q, k, v, causal, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)

    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    r_out, r_lse = attention_fp64(q64, k64, v64, causal=causal, scale=scale)
    r_out.backward(dout.double())
    want = {"out": r_out.detach(), "lse": r_lse.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}

    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (B, H, seqlen)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    failures = []
    for name in got:
        max_diff, _ = report(f"{kernel_name} {name}", got[name], want[name])
        allowed = EPS_UNITS[dtype] * torch.finfo(dtype).eps * float(want[name].abs().max())
        if not (torch.isfinite(got[name]).all() and max_diff <= allowed):
            failures.append(f"{name}: max diff {max_diff:.3e} > allowed {allowed:.3e}")
    assert not failures, "; ".join(failures)


def test_kernels_auto_on_cpu_is_cpu():
    assert resolve_kernel("auto", "cpu").name == "cpu"
    assert resolve_kernel("math", "cpu").name == "math"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
@pytest.mark.parametrize("name", [n for n, k in KERNELS.items() if k.device_type == "cuda"])
def test_kernels_cuda_unavailable_with_reason(name):
    """Without a GPU each CUDA kernel says why it cannot run, and resolve refuses it with that reason."""
    reason = KERNELS[name].unavailable()
    print(f"{name}: {reason}")
    assert isinstance(reason, str) and reason
    with pytest.raises(ValueError, match=rf"^kernel {re.escape(repr(name))} is unavailable here: {re.escape(reason)}; "
                                         r"pass another --kernel or auto$"):
        resolve_kernel(name, "cuda")
    with pytest.raises(ValueError, match="runs on cuda, not cpu"):
        resolve_kernel(name, "cpu")


def _available_everywhere() -> dict:
    """Stand-ins for KERNELS on a CUDA machine with every backend installed (flash-attn too)."""
    import dataclasses

    return {n: dataclasses.replace(k, unavailable=lambda: None) for n, k in KERNELS.items()}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_kernels_auto_for_a_varlen_call_picks_only_a_kernel_with_a_varlen_form(device):
    """The bug this guards: flash-attn installed, auto took it for packed documents, and the
    varlen call raised. For every dtype and head dim, auto's pick for a varlen call has a varlen form."""
    kernels = _available_everywhere()
    assert resolve_kernel("auto", device, kernels=kernels).name == AUTO_ORDER[device][0]

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for head_dim in (64, 128, 200, 256, 300):
            batch = resolve_kernel("auto", device, dtype=dtype, head_dim=head_dim, kernels=kernels)
            kern = resolve_kernel("auto", device, dtype=dtype, head_dim=head_dim, varlen=True, kernels=kernels)
            print(device, dtype, head_dim, batch.name, kern.name)
            assert kern.varlen and dtype in kern.dtypes and kern.check_head_dim(head_dim) is None
            assert kern.device_type in (device, "any")
    if device == "cuda":
        # flash-attn-4 comes first for batch and varlen calls; without it, flash-attn, then torch-flash.
        for varlen in (False, True):
            assert resolve_kernel("auto", "cuda", dtype=torch.bfloat16, head_dim=128, varlen=varlen,
                                  kernels=kernels).name == "flash-attn-4"
        without = {n: k for n, k in kernels.items() if n != "flash-attn-4"}
        assert resolve_kernel("auto", "cuda", dtype=torch.bfloat16, head_dim=128, varlen=True,
                              kernels=without).name == "flash-attn"
        # A value head dim apart from the query/key one: only the kernels that take it.
        assert resolve_kernel("auto", "cuda", dtype=torch.bfloat16, head_dim=192, head_dim_v=128,
                              kernels=kernels).name == "flash-attn-4"
        assert resolve_kernel("auto", "cuda", dtype=torch.bfloat16, head_dim=192, head_dim_v=128,
                              kernels=without).name == "math"


def test_kernels_auto_says_why_no_kernel_fits():
    kernels = _available_everywhere()
    # A peer's own kernels (among) and none of them has a varlen form: each refusal is named.
    with pytest.raises(ValueError, match=r"^kernel auto found no kernel on cuda for packed documents, head_dim 128 "
                                         r"and dtype bf16 \(the cudnn kernel has no varlen form in ringbench \(.+\)\); "
                                         r"change --dtype or --head-dim$"):
        resolve_kernel("auto", "cuda", dtype=torch.bfloat16, head_dim=128, varlen=True, among=("cudnn",),
                       kernels=kernels)
    with pytest.raises(ValueError, match=r"^kernel auto found no kernel on cuda for dtype fp32 \(dtype fp32 is not "
                                         r"supported by the flash-attn kernel, which takes bf16 and fp16\)"):
        resolve_kernel("auto", "cuda", dtype=torch.float32, among=("flash-attn",), kernels=kernels)
    with pytest.raises(ValueError, match=r"^kernel auto has no kernels for device type 'mps'; run on cuda or cpu$"):
        resolve_kernel("auto", "mps", kernels=kernels)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"name": "cudnn", "device_type": "cpu", "varlen": True},
     r"^the cudnn kernel has no varlen form in ringbench \(.+\); pass --kernel with one of cpu, math or auto$"),
    ({"name": "cpu", "device_type": "cuda"},
     r"^kernel 'cpu' runs on cpu, not cuda; pass --kernel with one of "
     + re.escape(", ".join(n for n, k in KERNELS.items() if k.device_type in ("cuda", "any"))) + " or auto$"),
    ({"name": "torch-flash", "device_type": "cuda", "head_dim": 300},
     r"^head_dim 300 exceeds 256, the largest the torch-flash kernel takes; pass another --head-dim, or --kernel math$"),
    ({"name": "torch-flash", "device_type": "cuda", "dtype": torch.float32},
     r"^dtype fp32 is not supported by the torch-flash kernel, which takes bf16 and fp16; pass --dtype bf16$"),
    ({"name": "nope", "device_type": "cpu"},
     r"^kernel 'nope' is unknown; choose one of " + re.escape(", ".join(KERNELS)) + " or auto$"),
])
def test_kernels_resolve_names_the_value_the_rule_and_the_fix(kwargs, pattern):
    kernels = _available_everywhere()
    with pytest.raises(ValueError, match=pattern):
        resolve_kernel(kwargs.pop("name"), kernels=kernels, **kwargs)


def test_a_kernel_of_another_device_is_refused_offering_only_kernels_that_take_the_rest_of_the_case():
    """flash-attn-4 on CPU with ALiBi offered the cpu kernel, which refuses a bias."""
    reason = check_kernel(KERNELS["flash-attn-4"], "cpu", bias="alibi", head_dim=64)
    assert reason == "kernel 'flash-attn-4' runs on cuda, not cpu; pass --kernel with one of flex, math or auto"


def test_as_kernel_resolves_names_and_checks_kernel_objects_by_the_same_rules():
    assert as_kernel("auto", "cpu", torch.float32, head_dim=32, varlen=True).name == "cpu"
    assert as_kernel(KERNELS["math"], "cpu", torch.float64) is KERNELS["math"]
    reason = check_kernel(KERNELS["cudnn"], "cuda", varlen=True)
    with pytest.raises(ValueError, match=f"^{re.escape(reason)}$"):
        as_kernel(KERNELS["cudnn"], "cuda", torch.bfloat16, varlen=True)
    with pytest.raises(ValueError, match=r"^kernel 'cpu' runs on cpu, not cuda"):
        as_kernel("cpu", "cuda", torch.float32)


def test_kernels_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="nope") as info:
        get_kernel("nope")
    for name in KERNELS:
        assert name in str(info.value)


@pytest.mark.parametrize("kernel_name", ["cpu", "math"])
def test_kernels_causal_rectangular_raises(kernel_name):
    """A causal block with Sq != Sk is refused (backends disagree on its alignment)."""
    kernel = KERNELS[kernel_name]
    q, k = torch.randn(1, 8, 2, 4), torch.randn(1, 6, 2, 4)
    with pytest.raises(ValueError, match=r"Sq == Sk.*8 and 6"):
        kernel.forward(q, k, k, True, 0.5)
    with pytest.raises(ValueError, match=r"Sq == Sk.*8 and 6"):
        kernel.backward(q, q, k, k, q, torch.zeros(1, 2, 8), True, 0.5)
    out, lse = kernel.forward(q, k, k, False, 0.5)  # the same shapes without a mask are fine
    assert out.shape == q.shape and lse.shape == (1, 2, 8)


# --------------------------------------------------------------------------- RingComm

@pytest.mark.dist
def test_ringcomm_misuse_raises(solo_group):
    from ringbench.variants.engines.comm import RingComm

    comm = RingComm()
    with pytest.raises(RuntimeError, match=r"wait\(\).*no batch in flight"):
        comm.wait()
    with pytest.raises(RuntimeError, match=r"commit\(\).*nothing queued"):
        comm.commit()
    with pytest.raises(RuntimeError, match="must match"):
        comm.send_recv(torch.zeros(4), torch.zeros(5))
    with pytest.raises(RuntimeError, match="must match"):
        comm.send_recv(torch.zeros(4), torch.zeros(4, dtype=torch.float64))


# --------------------------------------------------------------------------- registry

def test_registry_lists_only_user_variants_and_tests_reach_theirs():
    names = list_variants()
    assert "ring" in names and "zigzag" in names and names == list(VARIANTS)
    assert not set(names) & set(TESTING_VARIANTS)
    assert {"broken_merge", "fault_hang", "fault_silent", "plain_dist_peer", "uncounted_peer"} <= set(TESTING_VARIANTS)
    assert all(v.summary.startswith("test only") for v in TESTING_VARIANTS.values())
    assert get_variant("broken_merge") is TESTING_VARIANTS["broken_merge"]  # conftest.py sets TESTING_ENV


def test_registry_without_the_test_variable_refuses_test_variants(monkeypatch):
    monkeypatch.delenv(TESTING_ENV)
    for name in TESTING_VARIANTS:
        with pytest.raises(ValueError, match=rf"^variant '{name}' is unknown; choose one of "
                                             rf"{re.escape(', '.join(list_variants()))}$"):
            get_variant(name)
    assert get_variant("ring") is VARIANTS["ring"]
    monkeypatch.setenv(TESTING_ENV, "0")
    with pytest.raises(ValueError, match="is unknown"):
        get_variant("fault_hang")


def test_registry_unknown_variant_lists_user_facing_ones():
    with pytest.raises(ValueError, match="'nope' is unknown") as info:
        get_variant("nope")
    assert "ring" in str(info.value) and "zigzag" in str(info.value)
    assert "broken_merge" not in str(info.value)


def test_registry_declares_where_traffic_cannot_be_counted():
    """Only torch_cp's bytes are unseen (DTensor); ring-flash-attn's are counted by its session."""
    assert [n for n, v in VARIANTS.items() if not v.traffic_counted] == ["torch_cp"]
    # rfa.session holds comm.dist_session (and notes afresh what serves the package's kernel calls).
    assert all(v.session == "peers.rfa:session" for n, v in VARIANTS.items() if n.startswith("rfa_"))
    assert not TESTING_VARIANTS["uncounted_peer"].traffic_counted


def test_registry_check_zigzag_names_rule_and_fix():
    message = get_variant("zigzag").check(seqlen=1000, world_size=8, causal=True)
    print(message)
    assert message is not None
    assert "seqlen 1000" in message
    assert "2 * world_size = 16" in message
    assert re.search(r"\buse 1008\b", message)
    assert get_variant("zigzag").check(seqlen=1008, world_size=8, causal=True) is None


def test_registry_check_ring_names_rule_and_fix():
    message = get_variant("ring").check(seqlen=1001, world_size=8, causal=False)
    print(message)
    assert message is not None and "world_size = 8" in message and re.search(r"\buse 1008\b", message)
    assert get_variant("ring").check(seqlen=1000, world_size=8, causal=True) is None


# --------------------------------------------------------------------------- the tolerance rule

def test_check_compare_shape_mismatch_is_a_failed_check():
    """A result of the wrong shape is a failed check (shape_ok False), not an exception.

    ringbench/rank/check.py's docstring says a shape that differs from the input's fails; compare
    indexes the result with the reference's finite mask first, so it raises instead.
    """
    from ringbench.rank.tolerance import tolerance_check

    ref = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    single = ref.float()
    got = torch.randn(1, 4, 2, 4)  # half the tokens: a lost shard
    entry = tolerance_check("out", got, single, ref, torch.float32, tuple(ref.shape))
    print(entry)
    assert entry["shape_ok"] is False and entry["passed"] is False


def test_tolerance_check_passes_and_fails():
    """err <= 2 * err_single + floor passes; a little above it fails; NaN and a wrong dtype fail."""
    from ringbench.rank.tolerance import tolerance_check

    gen = torch.Generator().manual_seed(5)
    ref = torch.randn(1, 16, 2, 4, generator=gen, dtype=torch.float64)
    single = ref + 1e-3
    shape = tuple(ref.shape)
    floor = tolerance_check("out", ref, single, ref, torch.float64, shape)["floor"]
    allowed = 2e-3 + floor
    inside = tolerance_check("out", ref + 0.99 * allowed, single, ref, torch.float64, shape)
    outside = tolerance_check("out", ref + 1.01 * allowed, single, ref, torch.float64, shape)
    print(inside, outside, sep="\n")
    assert inside["passed"] and not outside["passed"]
    nan = ref.float().clone()
    nan[0, 3, 1, 2] = math.nan
    assert not tolerance_check("out", nan, single, ref, torch.float32, shape)["passed"]
    assert not tolerance_check("out", ref.half(), single, ref, torch.float32, shape)["passed"]


# --------------------------------------------------------------------------- peers

def test_rfa_loads_only_its_modules_and_runs_without_flash_attn():
    # The test extra installs ring-flash-attn; flash-attn needs CUDA and is not installed here,
    # so ringbench's kernels serve the package's flash-attn calls (tests/test_rfa.py).
    assert importlib.util.find_spec("ring_flash_attn") is not None
    assert get_variant("rfa_zigzag").unavailable() is None
    # The package's __init__ (which imports its Hugging Face adapter) never ran, and no
    # flash_attn module is visible.
    assert "ring_flash_attn" not in sys.modules and "flash_attn" not in sys.modules


def test_peers_are_marked_and_need_cuda_and_their_kernels():
    cp = get_variant("torch_cp")
    assert cp.peer and cp.check_device("cpu") and cp.check_device("cuda") is None
    assert cp.check_kernel("cpu") == ("kernel 'cpu' is not one torch_cp runs with, since it brings its own attention "
                                      "calls; pass --kernel torch-flash, cudnn or torch-efficient")
    assert cp.check_kernel("cudnn") is None and cp.check_kernel("auto") is None
    assert cp.notes(heads=32, kv_heads=8) == ["K/V expanded from 8 to 32 heads before torch_cp, which has no "
                                              "native GQA"]
    assert cp.notes(heads=8, kv_heads=8) == [] and get_variant("zigzag").notes(heads=32, kv_heads=8) == []
    assert not get_variant("zigzag").peer and get_variant("zigzag").unavailable() is None


def test_torch_cp_outside_its_session_refuses():
    from ringbench.variants.peers.torch_cp import torch_cp_attention

    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"runs inside torch_cp\.session"):
        torch_cp_attention(q, q, q, causal=True, softmax_scale=1.0, kernel="torch-flash")
    with pytest.raises(ValueError, match="needs causal=True"):
        torch_cp_attention(q, q, q, causal=False, softmax_scale=1.0, kernel="torch-flash")


@pytest.mark.dist
def test_torch_cp_session_lays_out_zigzag_and_pytorch_has_no_cpu_context_parallel(solo_group):
    # Why torch_cp is refused on CPU, kept true: inside PyTorch's context_parallel the CPU SDPA
    # op has no sharding rule. When a PyTorch release adds one, this fails: enable torch_cp on CPU.
    from torch.distributed.tensor import DTensor, Shard

    from ringbench.variants.peers import torch_cp

    spec = {"seqlen": 16}
    with torch_cp.session(spec, None, torch.device("cpu")):
        assert torch_cp._mesh is not None
        q = DTensor.from_local(torch.randn(1, 2, 16, 8), torch_cp._mesh, [Shard(2)], run_check=False)
        with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"):
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
    assert torch_cp._mesh is None


def test_tolerance_floor_in_float64_admits_the_variants_own_roundings():
    """In float64 the single-device math kernel is the reference itself (no error), and the variant
    accumulates in float64: the floor allows two roundings of the output's precision per block."""
    from ringbench.rank.tolerance import floor_for

    eps64 = torch.finfo(torch.float64).eps
    assert floor_for(torch.float64, 2.0, 4) == 4 * 4 * eps64 * 2.0
    assert floor_for(torch.float32, 2.0, 4) == 4 * 4 * torch.finfo(torch.float32).eps * 2.0
    assert floor_for(torch.float32, 2.0, 4, terms=32) == 2 * 32 * torch.finfo(torch.float32).eps * 2.0
    assert floor_for(torch.bfloat16, 2.0, 4, terms=32) == 0.5 * torch.finfo(torch.bfloat16).eps * 2.0


def test_expand_kv_and_reduce_kv_are_a_gather_and_its_gradient():
    """Expanded K/V serve query head h from kv head h // groups; reduce_kv is the gradient of that."""
    from ringbench.variants.kernels.common import expand_kv, reduce_kv

    k = torch.randn(2, 5, 3, 4, dtype=torch.float64, requires_grad=True)
    wide = expand_kv(k, 4)
    assert wide.shape == (2, 5, 12, 4)
    assert all(torch.equal(wide[:, :, h], k[:, :, h // 4]) for h in range(12))
    g = torch.randn_like(wide)
    wide.backward(g)
    assert torch.allclose(reduce_kv(g, 4), k.grad)
    assert reduce_kv(g[0], 4).shape == (5, 3, 4)  # the packed form [S, H, D] too
    assert expand_kv(k, 1) is k and reduce_kv(g, 1) is g
