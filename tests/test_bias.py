"""Attention bias (issue 26, item 3) without torchrun: the math kernel's bias and d bias against autograd
through plain attention, ALiBi's slopes, the spec's and the command line's refusals, case_id, and one
world-size-1 verify in-process (a gloo group of one). The runs over ranks are ``test_bias_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch

from helpers import ringbench_here
from ringbench.case.spec import CaseSpec, default_fields, validate
from ringbench.errors import SpecError
from ringbench.rank import check
from ringbench.variants import VARIANTS
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import Bias, alibi_slopes, bias_tensor_shape
from ringbench.variants.rules import BIAS_KINDS, BIAS_SHAPES

#: Awkward sizes on purpose: 37 rows in tiles of 16, GQA 4/2, batch 2.
B, S, H, HKV, D = 2, 37, 4, 2, 8


def spec(variant: str = "ring", world_size: int = 2, **fields) -> CaseSpec:
    """A validated CPU verify spec of a small problem (raises SpecError when refused)."""
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "math",
            "world_size": world_size, "seqlen": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, **fields}
    case = CaseSpec(**base)
    validate(case, visible_gpus=0)
    return case


def _plain(q, k, v, dout, bias: Bias, causal: bool):
    """out and the gradients of q, k, v and the bias values of attention with the bias added to the scaled scores,
    by autograd through plain torch (q ``[B, S, H, D]``, k and v ``[B, S, Hkv, D]``, float64)."""
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    values = bias.values.detach().clone().requires_grad_(bias.learnable)
    every = torch.arange(q.shape[1])
    g = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", leaves[0], leaves[1].repeat_interleave(g, 2)) * q.shape[-1] ** -0.5
    scores = scores + bias.with_values(values).at(every, every).dense(torch.float64)
    if causal:
        scores = scores.masked_fill(every[None, :] > every[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), leaves[2].repeat_interleave(g, 2))
    (out * dout).sum().backward()
    return out.detach(), *(x.grad for x in leaves), values.grad


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kind", BIAS_KINDS)
def test_bias_math_kernel_matches_autograd_of_plain_attention(kind, causal):
    """out, dq, dk, dv and d bias of the math kernel (tiles of 16 rows) equal plain attention's by autograd,
    in float64, for every bias kind, the broadcast ones' d bias summed over batch, heads (and rows for 111s)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(s, generator=gen, dtype=torch.float64)
                     for s in ((B, S, H, D), (B, S, HKV, D), (B, S, HKV, D), (B, S, H, D)))
    values = (torch.tensor(alibi_slopes(H), dtype=torch.float64) if kind == "alibi" else
              torch.randn(bias_tensor_shape(kind, B, H, S), generator=gen, dtype=torch.float64) * 0.5)
    bias = Bias(kind, values)
    every = torch.arange(S)
    math = KERNELS["math"]
    out, lse = math.forward(q, k, v, causal, D ** -0.5, chunk=16, bias=bias.at(every, every))
    if bias.learnable:
        bias.open_grad(torch.float64)
    grads = math.backward(dout, q, k, v, out, lse, causal, D ** -0.5, chunk=16, bias=bias.at(every, every))
    dbias = bias.close_grad()
    want = _plain(q, k, v, dout, bias, causal)
    for got, ref in zip((out, *grads), want[:4]):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    if bias.learnable:
        assert dbias.shape == values.shape
        torch.testing.assert_close(dbias, want[4], rtol=0, atol=1e-12)
    else:
        assert dbias is None and want[4] is None


def test_bias_changes_the_output_so_dropping_it_is_seen():
    """The bias is not a no-op at the test sizes: without it the kernel's out moves far beyond any tolerance."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((1, S, H, D), (1, S, HKV, D),
                                                                           (1, S, HKV, D)))
    every = torch.arange(S)
    math = KERNELS["math"]
    plain, _ = math.forward(q, k, v, True, D ** -0.5)
    for kind in ("alibi", "111s"):
        values = (torch.tensor(alibi_slopes(H), dtype=torch.float64) if kind == "alibi" else
                  torch.randn(bias_tensor_shape(kind, 1, H, S), generator=gen, dtype=torch.float64) * 0.5)
        biased, _ = math.forward(q, k, v, True, D ** -0.5, bias=Bias(kind, values).at(every, every))
        assert float((biased - plain).abs().max()) > 1e-2, kind


def test_bias_alibi_slopes_are_the_papers_geometric_sequence_and_its_interpolation():
    """Press et al. 2022: 2^(-8/H), 2^(-16/H), ... for H a power of two; otherwise the slopes of the largest power
    of two below H, then every other slope of twice that for the rest."""
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    assert alibi_slopes(4) == [2.0 ** (-2 * (i + 1)) for i in range(4)]
    assert alibi_slopes(1) == [2.0 ** -8]
    assert alibi_slopes(6) == alibi_slopes(4) + [2.0 ** -1, 2.0 ** -3]
    assert alibi_slopes(12) == alibi_slopes(8) + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]


def test_bias_alibi_is_minus_slope_times_distance_both_ways():
    """ALiBi's block is -slope_h * |q_pos - k_pos| (so -slope_h * (q_pos - k_pos) where a causal mask keeps k <= q)."""
    bias = Bias("alibi", torch.tensor([0.5, 0.25], dtype=torch.float64))
    block = bias.at(torch.tensor([3, 7]), torch.tensor([0, 5, 9])).dense(torch.float64)
    assert block.shape == (1, 2, 2, 3)
    assert block[0, 0].tolist() == [[-1.5, -1.0, -3.0], [-3.5, -1.0, -1.0]]
    assert block[0, 1].tolist() == [[-0.75, -0.5, -1.5], [-1.75, -0.5, -0.5]]


@pytest.mark.parametrize("kind, shape", [("1hss", (1, 4, 64, 64)), ("bhss", (2, 4, 64, 64)), ("11ss", (1, 1, 64, 64)),
                                         ("111s", (1, 1, 1, 64)), ("b1ss", (2, 1, 64, 64))])
def test_bias_learnable_shapes_are_transformer_engines(kind, shape):
    assert bias_tensor_shape(kind, 2, 4, 64) == shape
    assert set(BIAS_SHAPES) == {"1hss", "bhss", "11ss", "111s", "b1ss"}


def test_bias_is_in_the_case_id_and_unbiased_ids_stay_what_they_were():
    plain, alibi, learned = spec(), spec(bias="alibi"), spec(bias="1hss")
    assert len({plain.case_id(), alibi.case_id(), learned.case_id()}) == 3
    assert plain.to_dict()["bias"] == ""
    # Left out of the id at its default, so records written before the field keep their ids.
    without = {k: v for k, v in plain.to_dict().items() if k != "bias"}
    assert CaseSpec.from_dict(without).case_id() == plain.case_id()


@pytest.mark.parametrize("fields, message", [
    (dict(bias="1hs"), r"^bias '1hs' is not one ringbench takes: alibi, or a learnable tensor of one of "
                       r"TransformerEngine's post-scale shapes 1hss, bhss, 11ss, 111s or b1ss \(b batch, h heads, "
                       r"s seqlen, 1 broadcast\); pass --bias with one of them$"),
    (dict(bias="1hss", kernel="cpu"), r"^the cpu kernel cannot take bias 1hss \(ringbench calls it without an additive "
                                      r"score bias\); pass --kernel with one of flex, math or auto$"),
    (dict(bias="alibi", variant="zigzag_varlen", docs="32,32"),
     r"^zigzag_varlen cannot take bias alibi, since only ringbench's batch engines add a bias block by block; use one "
     r"of ring, zigzag, stripe, llama3, ulysses, usp$"),
    (dict(bias="alibi", hf_model="llama-tiny"), r"^bias alibi does not go with hf_model llama-tiny, whose layers fix "
                                                r"their own scores; drop --bias$"),
    (dict(bias="bhss", seqlen=65536), r"^seqlen 65536 is above 32768 tokens, the longest sequence over which a "
                                      r"learnable bias bhss is held as a dense"),
])
def test_bias_refusals_name_the_value_and_the_rule(fields, message):
    with pytest.raises(SpecError, match=message):
        spec(**fields)


def test_bias_taken_by_the_batch_engines_only():
    takers = sorted(n for n, v in VARIANTS.items() if "bias" in v.options)
    assert takers == sorted(["ring", "zigzag", "stripe", "llama3", "ulysses", "usp"])
    assert [n for n, k in KERNELS.items() if k.takes_bias] == ["flash-attn-4", "flex", "math"]
    # flash-attn-4 takes ALiBi alone: its backward gives no gradient for a bias tensor.
    assert [n for n, k in KERNELS.items() if k.takes("1hss")] == ["flex", "math"]
    assert [n for n, k in KERNELS.items() if k.takes("alibi")] == ["flash-attn-4", "flex", "math"]


def test_bias_a_tensor_on_flash_attn_4_is_refused_naming_the_kernels_that_take_it():
    from ringbench.variants.kernels import check_kernel

    reason = check_kernel(KERNELS["flash-attn-4"], "cuda", bias="1hss")
    assert reason.startswith("the flash-attn-4 kernel cannot take bias 1hss (its backward gives no gradient")
    assert reason.endswith("pass --kernel with one of flex, math or auto")
    assert check_kernel(KERNELS["flash-attn-4"], "cuda", bias="alibi") is None


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_bias_alibi_on_flash_attn_4_matches_math_in_float64(layout, causal):
    """flash-attn-4's ALiBi score mod against the math kernel in float64 on the same positions: a block of
    a ring step (rows 256 on from 512 contiguously, or every 4th position as stripe deals them, keys
    likewise), GQA 8/2, forward and backward, within twice the math kernel's own bf16 error plus one bf16
    unit at the largest reference value (``tests/test_kernels_gpu.py``'s rule)."""
    from ringbench.variants.kernels.common import PositionBias

    fa4, math_k = KERNELS["flash-attn-4"], KERNELS["math"]
    reason = fa4.why_unavailable()
    if reason:
        pytest.skip(f"kernel flash-attn-4 is unavailable here: {reason}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    s, hq, hkv, d = 384, 8, 2, 128
    q, k, v, dout = (torch.randn(2, s, h, d, generator=gen, device="cuda") for h in (hq, hkv, hkv, hq))
    step = 1 if layout == "contiguous" else 4
    pos = torch.arange(s, device="cuda") * step + (512 if layout == "contiguous" else 3)
    bias = PositionBias(Bias("alibi", torch.tensor(alibi_slopes(hq), device="cuda")), pos, pos)
    scale = d ** -0.5

    def run(kernel, dtype):
        x = [t.to(dtype) for t in (q, k, v, dout)]
        out, lse = kernel.forward(*x[:3], causal, scale, bias=bias)
        grads = kernel.backward(x[3], *x[:3], out, lse, causal, scale, bias=bias)
        return (out, lse, *grads)

    ref, low, got = run(math_k, torch.float64), run(math_k, torch.bfloat16), run(fa4, torch.bfloat16)
    for name, g, lo, r in zip(("out", "lse", "dq", "dk", "dv"), got, low, ref):
        err = (g.double() - r).abs().max().item()
        allowed = 2 * (lo.double() - r).abs().max().item() + torch.finfo(torch.bfloat16).eps * r.abs().max().item()
        assert err <= allowed, f"{name}: {err:.3e} against {allowed:.3e}"
    # The bias is there: without it, out moves by far more than the rule.
    plain = fa4.forward(*(t.to(torch.bfloat16) for t in (q, k, v)), causal, scale)[0]
    assert (plain.double() - ref[0]).abs().max().item() > 10 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("args, value", [
    (("--kernel", "cpu", "--bias", "1hss"), "the cpu kernel cannot take bias 1hss"),
    (("--kernel", "math", "--bias", "bhs1"), "bias 'bhs1' is not one ringbench takes"),
    (("--kernel", "math", "--bias", "alibi", "--variant", "rfa_ring"), "rfa_ring cannot take bias alibi"),
])
def test_bias_refused_on_the_command_line_with_exit_2(tmp_path, args, value):
    proc = ringbench_here("verify", "--device", "cpu", "--variant", "ring", "--world-size", "2", "--seqlen", "64",
                          "--head-dim", "16", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert value in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "results").exists()


def test_bias_auto_kernel_resolves_to_math_on_cpu():
    from ringbench.case.spec import resolve

    assert resolve(spec(kernel="auto", bias="alibi")).kernel == "math"


@pytest.mark.parametrize("bias", ["alibi", "11ss"])
def test_bias_world_size_1_in_process(solo_group, bias):
    """verify_case at world size 1 on a gloo group of one: every check passes, dbias among them for a learnable bias."""
    fields = check.verify_case(spec("zigzag", 1, bias=bias), device=torch.device("cpu"), group=solo_group)
    assert fields["status"] == "ok", fields["reason"]
    names = [c["tensor"] for c in fields["checks"]]
    assert names == ["out", "lse", "dq", "dk", "dv", *(["dbias"] if bias != "alibi" else [])]


@pytest.mark.parametrize("bias, seqlen", [("alibi", "16k"), ("1hss", "128k")])
def test_bias_predict_refuses_it_in_one_sentence(tmp_path, bias, seqlen):
    # 1hss at 128k: the model's refusal comes first, not the learnable bias's 32k rule a user would fix in vain.
    proc = ringbench_here("predict", "--variant", "zigzag", "--seqlen", seqlen, "--bias", bias, "--gpu", "H200",
                          "--world-size", "2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (f"bias {bias} is not priced by the model yet (no calibration rates a kernel call "
                                   "with a bias: flash-attn-4's ALiBi score mod, flex or math); predict the case "
                                   "without --bias, or measure the bias with ringbench run")


def test_bias_a_learnable_tensor_counts_in_the_memory_a_cpu_launch_needs():
    """A learnable bias is held whole on every rank with its gradient (and in float64 on rank 0 of verify): at
    16k over 4 heads, 1 GiB a copy, so a launch that fit without it does not fit with it."""
    from dataclasses import replace

    from ringbench.sweep import estimate

    plain = spec("zigzag", 2, kernel="auto", seqlen=16384)
    biased = replace(plain, bias="1hss")
    assert estimate.bias_bytes(plain) == 0 == estimate.bias_bytes(replace(plain, bias="alibi"))
    assert estimate.bias_bytes(biased) == 2 * 4 * 16384 ** 2 * 4  # values and gradient, float32
    added = estimate.launch_bytes(biased) - estimate.launch_bytes(plain)
    assert added == 2 * estimate.bias_bytes(biased) + 2 * estimate.bias_bytes(biased)  # two ranks, then rank 0's f64
