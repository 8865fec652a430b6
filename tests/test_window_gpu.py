"""The CUDA kernels that take a sliding window (``Kernel.takes_window``: torch-flash, flash-attn, and
any added later) against the math kernel in float64 under the same window, on a GPU.

Each is checked forward (out, lse) and backward (dq, dk, dv): the batch form on square and
rectangular blocks with windows of both sides (the bottom-right-aligned convention of
``variants/kernels/__init__.py``), and the varlen form over documents of awkward lengths. The rule is that
of ``tests/test_kernels_gpu.py``: within twice the error of the math kernel in the same low dtype,
plus a floor of one unit in the last place (16 for float32) at the largest reference value.
Skipped where no CUDA device is visible, and for a kernel that is unavailable here.
"""

from __future__ import annotations

import pytest
import torch

from ringbench.variants.kernels import KERNELS

MATH = KERNELS["math"]
WINDOW_KERNELS = tuple(n for n, k in KERNELS.items() if k.device_type == "cuda" and k.takes_window)
#: (Sq, Sk, (left, right)): a causal window on a square block, and the bands ring steps make.
BLOCKS = ((1025, 1025, (127, 0)), (257, 1025, (300, 0)), (1025, 257, (None, 40)), (512, 512, (0, 0)),
          (700, 900, (64, 64)))
DOCS = ((97, 257, 1025, 1), (97, 257, 1025, 1))
FLOOR_ULPS = {torch.bfloat16: 1, torch.float16: 1, torch.float32: 16}
pytestmark = pytest.mark.gpu


def _kernel(name):
    kern = KERNELS[name]
    reason = kern.why_unavailable()
    if reason:
        pytest.skip(f"kernel {name} is unavailable here: {reason}")
    return kern


def _check(name, got, low, ref, dtype):
    ref = ref.double()
    finite = torch.isfinite(ref)
    err = (got.double() - ref)[finite].abs().max().item()
    err_low = (low.double() - ref)[finite].abs().max().item()
    top = ref[finite].abs().max().item()
    floor = FLOOR_ULPS[got.dtype if got.dtype in FLOOR_ULPS else dtype] * torch.finfo(got.dtype).eps * top
    allowed = 2 * err_low + floor
    print(f"{name}: err {err:.3e} low {err_low:.3e} allowed {allowed:.3e}")
    assert torch.equal(torch.isfinite(got), finite), name
    assert err <= allowed, name


def _inputs(sq, sk, dtype, gen):
    q = torch.randn(2, sq, 8, 64, generator=gen, device="cuda").to(dtype)
    k = torch.randn(2, sk, 2, 64, generator=gen, device="cuda").to(dtype)
    v = torch.randn(2, sk, 2, 64, generator=gen, device="cuda").to(dtype)
    return q, k, v, torch.randn(2, sq, 8, 64, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("name", WINDOW_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk,window", BLOCKS)
def test_window_gpu_kernel_batch(name, dtype, sq, sk, window):
    """A windowed batch call against float64 math under the same window."""
    kern = _kernel(name)
    gen = torch.Generator(device="cuda").manual_seed(sq + sk)
    q, k, v, dout = _inputs(sq, sk, dtype, gen)
    out, lse = kern.forward(q, k, v, False, 0.125, window=window)
    grads = kern.backward(dout, q, k, v, out, lse, False, 0.125, window=window)
    low = MATH.forward(q, k, v, False, 0.125, window=window)
    low_grads = MATH.backward(dout, q, k, v, low[0], low[1], False, 0.125, window=window)
    d = [t.double() for t in (q, k, v, dout)]
    ref = MATH.forward(*d[:3], False, 0.125, window=window)
    ref_grads = MATH.backward(d[3], *d[:3], ref[0], ref[1], False, 0.125, window=window)
    for tensor, g, lo, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*low, *low_grads),
                                (*ref, *ref_grads)):
        _check(f"{name} {tensor}", g, lo, r, dtype)


@pytest.mark.parametrize("name", [n for n in WINDOW_KERNELS if KERNELS[n].varlen])
@pytest.mark.parametrize("window", [(63, 0), (None, 0), (200, 5)])
def test_window_gpu_kernel_varlen(name, window):
    """A windowed varlen call (bottom-right aligned per document) against float64 math."""
    kern = _kernel(name)
    gen = torch.Generator(device="cuda").manual_seed(7)
    lq, lk = DOCS
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v, dout = (t[:1] for t in _inputs(sum(lq), sum(lk), torch.bfloat16, gen))
    args = (cu_q, cu_k, max(lq), max(lk), False, 0.125)
    out, lse = kern.forward_varlen(q, k, v, *args, window=window)
    grads = kern.backward_varlen(dout, q, k, v, out, lse, *args, window=window)
    low = MATH.forward_varlen(q, k, v, *args, window=window)
    low_grads = MATH.backward_varlen(dout, q, k, v, *low, *args, window=window)
    d = [t.double() for t in (q, k, v, dout)]
    ref = MATH.forward_varlen(*d[:3], *args, window=window)
    ref_grads = MATH.backward_varlen(d[3], *d[:3], *ref, *args, window=window)
    for tensor, g, lo, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (*low, *low_grads),
                                (*ref, *ref_grads)):
        _check(f"{name} varlen {tensor}", g, lo, r, torch.bfloat16)
