"""Every CUDA kernel of ``KERNELS`` against the math kernel in float64, on a GPU.

The kernels are those of ``ringbench.variants.kernels.KERNELS`` whose device type is ``"cuda"``,
so a kernel added there is tested here without an edit. Each is checked forward (out, lse) and
backward (dq, dk, dv), in the batch form and, where the kernel has one, the varlen form; causal
and not; GQA (Hq=8, Hkv=2) and MHA; lengths that are no power of two (97, 257, 1025) and, without
the causal mask, query and key blocks of different lengths (as ring steps have); in each of bf16,
fp16 and fp32 that the kernel takes.

The rule is FlashAttention's test rule: the reference is the math kernel on the same inputs in
float64; the kernel's max error against it must be within twice the max error of the math kernel
run in the same low dtype (float32 accumulation, one rounding to the dtype at the end), plus a
small floor: ``helpers.FLOOR_ULPS`` of the dtype the tensor comes back in, units in the last place at the
largest reference value (1 for bf16 and fp16, whose error is the final rounding; 16 for float32,
lse included, where the kernel's and the math kernel's sums over up to 1025 keys differ by a few
ulps and the math kernel's own error is no wider). lse (float32 always) must be ``-inf`` exactly
where the reference's is, and is compared where it is finite. The max and mean differences are printed before the asserts.

Skipped, with the reason, where no CUDA device is visible and for a kernel whose ``unavailable()``
gives one; on a CPU machine the file is collected and every test skips.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ringbench.variants.kernels import KERNELS
from helpers import kernel_rule_problem

Tensor = torch.Tensor

MATH = KERNELS["math"]
#: The kernels under test: every CUDA kernel registered, in registry order.
CUDA_KERNELS = tuple(name for name, kern in KERNELS.items() if kern.device_type == "cuda")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BATCH = 2
HEAD_DIM = 64
HEADS = {"gqa": (8, 2), "mha": (8, 8)}
#: (Sq, Sk) of the batch form: square blocks under the causal mask (the contract asks Sq == Sk
#: there), and rectangles without it.
SQUARE = ((97, 97), (257, 257), (1025, 1025))
RECTANGLES = ((257, 1025), (1025, 97))
#: (query lengths, key lengths) of the varlen form's documents. "rect": each document's query
#: block is its last tokens (the bottom-right causal mask); "empty": documents without queries or
#: without keys, and one with more queries than keys, whose first queries see no key under the
#: causal mask.
DOCS = {
    "equal": ((97, 257, 1025), (97, 257, 1025)),
    "rect": ((33, 257, 700), (97, 257, 1025)),
    "empty": ((0, 97, 64, 100), (50, 97, 0, 60)),
}

NO_CUDA_REASON = "no CUDA device is visible: these tests run the CUDA kernels on a GPU"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)]


def _kernel_dtype_params(varlen: bool) -> list:
    """(kernel, dtype) pairs: every dtype the kernel takes, each skipped with the kernel's own
    reason where it cannot run here; for ``varlen`` only the kernels that have that form."""
    params = []
    for name in CUDA_KERNELS:
        kern = KERNELS[name]
        if varlen and not kern.varlen:
            continue
        reason = kern.unavailable()
        for label, dtype in DTYPES.items():
            if dtype in kern.dtypes:
                params.append(pytest.param(name, dtype, id=f"{name}-{label}",
                                           marks=pytest.mark.skipif(reason is not None,
                                                                    reason=f"the {name} kernel: {reason}")))
    return params


@pytest.fixture(autouse=True)
def _no_tf32():
    """The math kernel's float32 matmuls stay float32 (a TF32 reference would be no reference)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def _check_contract(name: str, dtype: torch.dtype, q: Tensor, k: Tensor, out: Tensor, lse: Tensor,
                    grads: tuple[Tensor, Tensor, Tensor]) -> None:
    B, S, Hq, _ = q.shape
    assert out.shape == q.shape and out.dtype == dtype, f"{name} out {tuple(out.shape)} {out.dtype}"
    assert lse.shape == (B, Hq, S) and lse.dtype == torch.float32, f"{name} lse {tuple(lse.shape)} {lse.dtype}"
    for tensor, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, k)):
        assert grad.shape == like.shape and grad.dtype == dtype, f"{name} {tensor} {tuple(grad.shape)} {grad.dtype}"


def _assert_rule(name: str, got: tuple, low: tuple, ref: tuple) -> None:
    failed = [p for p in (kernel_rule_problem(t, g, lo, r) for t, g, lo, r in zip(("out", "lse", "dq", "dk", "dv"), got, low, ref))
              if p]
    assert not failed, f"the {name} kernel breaks the rule: " + " | ".join(failed)


# --------------------------------------------------------------------------- batch form

BATCH_SHAPES = [pytest.param(True, sq, sk, id=f"causal-{sq}") for sq, sk in SQUARE] + \
               [pytest.param(False, sq, sk, id=f"full-{sq}x{sk}") for sq, sk in SQUARE + RECTANGLES]


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("causal, sq, sk", BATCH_SHAPES)
@pytest.mark.parametrize("name, dtype", _kernel_dtype_params(varlen=False))
def test_cuda_kernel_batch_matches_math_fp64(name, dtype, causal, sq, sk, heads):
    kern = KERNELS[name]
    hq, hkv = HEADS[heads]
    assert kern.check_head_dim(HEAD_DIM) is None
    gen = torch.Generator(device="cuda").manual_seed(sq * 1009 + sk)
    q = _randn(BATCH, sq, hq, HEAD_DIM, dtype=dtype, gen=gen)
    k = _randn(BATCH, sk, hkv, HEAD_DIM, dtype=dtype, gen=gen)
    v = _randn(BATCH, sk, hkv, HEAD_DIM, dtype=dtype, gen=gen)
    dout = _randn(BATCH, sq, hq, HEAD_DIM, dtype=dtype, gen=gen)
    scale = 1 / math.sqrt(HEAD_DIM)
    print(f"{name} {str(dtype)[6:]} {'causal' if causal else 'full'} B={BATCH} Sq={sq} Sk={sk} "
          f"Hq={hq} Hkv={hkv} D={HEAD_DIM}")

    out, lse = kern.forward(q, k, v, causal, scale)
    grads = kern.backward(dout, q, k, v, out, lse, causal, scale)
    torch.cuda.synchronize()
    _check_contract(name, dtype, q, k, out, lse, grads)

    low_out, low_lse = MATH.forward(q, k, v, causal, scale)
    low_grads = MATH.backward(dout, q, k, v, low_out, low_lse, causal, scale)
    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = MATH.forward(q64, k64, v64, causal, scale)
    ref_grads = MATH.backward(dout64, q64, k64, v64, ref_out, ref_lse, causal, scale)
    _assert_rule(name, (out, lse, *grads), (low_out, low_lse, *low_grads), (ref_out, ref_lse, *ref_grads))


# --------------------------------------------------------------------------- varlen form

def _cu_seqlens(lengths: tuple[int, ...]) -> Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("docs", list(DOCS), ids=list(DOCS))
@pytest.mark.parametrize("name, dtype", _kernel_dtype_params(varlen=True))
def test_cuda_kernel_varlen_matches_math_fp64(name, dtype, docs, causal, heads):
    kern = KERNELS[name]
    hq, hkv = HEADS[heads]
    lens_q, lens_k = DOCS[docs]
    cu_q, cu_k = _cu_seqlens(lens_q), _cu_seqlens(lens_k)
    tq, tk, mq, mk = sum(lens_q), sum(lens_k), max(lens_q), max(lens_k)
    gen = torch.Generator(device="cuda").manual_seed(tq * 1009 + tk)
    q = _randn(1, tq, hq, HEAD_DIM, dtype=dtype, gen=gen)
    k = _randn(1, tk, hkv, HEAD_DIM, dtype=dtype, gen=gen)
    v = _randn(1, tk, hkv, HEAD_DIM, dtype=dtype, gen=gen)
    dout = _randn(1, tq, hq, HEAD_DIM, dtype=dtype, gen=gen)
    scale = 1 / math.sqrt(HEAD_DIM)
    print(f"{name} varlen {str(dtype)[6:]} {'causal' if causal else 'full'} queries {lens_q} keys {lens_k} "
          f"Hq={hq} Hkv={hkv} D={HEAD_DIM}")

    out, lse = kern.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, causal, scale)
    grads = kern.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, causal, scale)
    torch.cuda.synchronize()
    _check_contract(name, dtype, q, k, out, lse, grads)

    low_out, low_lse = MATH.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, causal, scale)
    low_grads = MATH.backward_varlen(dout, q, k, v, low_out, low_lse, cu_q, cu_k, mq, mk, causal, scale)
    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = MATH.forward_varlen(q64, k64, v64, cu_q, cu_k, mq, mk, causal, scale)
    ref_grads = MATH.backward_varlen(dout64, q64, k64, v64, ref_out, ref_lse, cu_q, cu_k, mq, mk, causal, scale)
    _assert_rule(name, (out, lse, *grads), (low_out, low_lse, *low_grads), (ref_out, ref_lse, *ref_grads))


@pytest.mark.parametrize("name, dtype", _kernel_dtype_params(varlen=False))
def test_cuda_kernel_takes_head_slices_as_the_all_gather_variants_pass_them(name, dtype):
    """llama3 with heads_k_stride hands the kernel head-group views (``q[:, rows, qh]``, ``out[:, rows, qh]``,
    ``lse[:, qh, rows]``) that are not contiguous; the results must be those of the same values contiguous."""
    kern = KERNELS[name]
    hq, hkv, sq = 4, 2, 257
    gen = torch.Generator(device="cuda").manual_seed(11)
    q_all = _randn(BATCH, sq, 2 * hq, HEAD_DIM, dtype=dtype, gen=gen)
    k_all = _randn(BATCH, sq, 2 * hkv, HEAD_DIM, dtype=dtype, gen=gen)
    v_all = _randn(BATCH, sq, 2 * hkv, HEAD_DIM, dtype=dtype, gen=gen)
    dout_all = _randn(BATCH, sq, 2 * hq, HEAD_DIM, dtype=dtype, gen=gen)
    q, k, v, dout = q_all[:, :, hq:], k_all[:, :, hkv:], v_all[:, :, hkv:], dout_all[:, :, hq:]
    assert not q.is_contiguous()
    scale = 1 / math.sqrt(HEAD_DIM)
    out_c, lse_c = kern.forward(q.contiguous(), k.contiguous(), v.contiguous(), True, scale)
    out_all = torch.zeros_like(q_all)
    out_all[:, :, hq:] = out_c
    lse_all = torch.zeros(BATCH, 2 * hq, sq, dtype=lse_c.dtype, device="cuda")
    lse_all[:, hq:] = lse_c
    out, lse = kern.forward(q, k, v, True, scale)
    grads = kern.backward(dout, q, k, v, out_all[:, :, hq:], lse_all[:, hq:], True, scale)
    q64, k64, v64, dout64 = (t.double() for t in (q, k, v, dout))
    ref_out, ref_lse = MATH.forward(q64, k64, v64, True, scale)
    ref_grads = MATH.backward(dout64, q64, k64, v64, ref_out, ref_lse, True, scale)
    low_out, low_lse = MATH.forward(q, k, v, True, scale)
    low_grads = MATH.backward(dout, q, k, v, low_out, low_lse, True, scale)
    _assert_rule(name, (out, lse, *grads), (low_out, low_lse, *low_grads), (ref_out, ref_lse, *ref_grads))
