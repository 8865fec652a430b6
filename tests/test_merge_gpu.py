"""The Triton kernels of the ring engine's per-step updates (``variants/engines/merge_triton.py``) against
the torch ops they replace (``variants/engines/merge.py``, the path every CPU takes), on a GPU.

Both compute in float32 and round once to the result's dtype, in different orders, so they
may differ by float32 roundings before that last one: a result is compared within
``ULPS`` units in the last place of its dtype at its largest magnitude, the lse within a few
float32 ulps of its magnitude, and ``-inf`` must be ``-inf`` in both. Row forms: every row,
a tail slice (zigzag's later ranks), int64 indices (varlen steps) with and without the
inverse map; in place (the result already in its dtype) and into another dtype; non-contiguous
block outputs (cuDNN's are transposed views); head dims 64, 128, 192 and 256; bf16, fp16, fp32.
The max differences are printed before the asserts.

Run on a GPU machine: ``python -m pytest -q tests/test_merge_gpu.py``; skipped, with the
reason, where no CUDA device is visible or Triton does not import.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from ringbench.variants.engines import merge

pytestmark = pytest.mark.gpu

ULPS = 2
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: (B, S, H, D): awkward lengths, GQA-like head counts, the head dims kernels take.
SHAPES = [(1, 97, 8, 128), (2, 33, 2, 64), (1, 257, 4, 192), (1, 16, 1, 256), (3, 5, 3, 128)]
ROWS = ["all", "tail", "idx", "idx_inv"]


@pytest.fixture(autouse=True)
def _needs_triton():
    if merge.merge_path("cuda") != "triton":
        pytest.skip("Triton does not import here (or RINGBENCH_MERGE=torch), so CUDA takes the torch ops")


def _rows(kind: str, S: int, gen):
    if kind == "all":
        return slice(None), S, None
    if kind == "tail":
        return slice(S // 2, None), S - S // 2, None
    idx = torch.randperm(S, generator=gen, device="cuda")[: max(1, S // 2)].sort().values
    inv = None
    if kind == "idx_inv":
        inv = torch.full((S,), -1, dtype=torch.int32, device="cuda")
        inv[idx] = torch.arange(idx.numel(), dtype=torch.int32, device="cuda")
    return idx, idx.numel(), inv


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
    diff = (got.double() - want.double()).abs().max().item()
    allowed = ULPS * torch.finfo(want.dtype).eps * max(1.0, want.double().abs().max().item())
    print(f"{name}: max |triton - torch| {diff:.3g}, allowed {allowed:.3g}")
    assert diff <= allowed, name


CASES = list(itertools.product(SHAPES, DTYPES, ROWS, ["same", "float32", "input"], [False, True]))


@pytest.mark.parametrize("shape,dtype,rows_kind,into_kind,transposed", CASES)
def test_merge_gpu_triton_matches_torch(shape, dtype, rows_kind, into_kind, transposed, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((shape, rows_kind)).encode()))
    B, S, H, D = shape
    rows, n, inv = _rows(rows_kind, S, gen)
    acc_dtype = dtype if into_kind != "float32" else torch.float32
    into = {"same": acc_dtype, "float32": torch.float32, "input": dtype}[into_kind]
    out = torch.randn(shape, generator=gen, device="cuda").to(acc_dtype)
    lse = torch.randn(B, H, S, generator=gen, device="cuda") * 4
    lse[:, 0, 0] = float("-inf")
    if transposed:  # a [B, H, n, D] buffer seen as [B, n, H, D], as cuDNN returns it
        b_out = torch.randn(B, H, n, D, generator=gen, device="cuda").to(dtype).transpose(1, 2)
    else:
        b_out = torch.randn(B, n, H, D, generator=gen, device="cuda").to(dtype)
    b_lse = torch.randn(B, H, n, generator=gen, device="cuda") * 4
    b_lse[:, 0, -1] = float("-inf")
    b_lse[:, -1, 0] = 150.0  # a gap the naive form overflows on
    lse_t, lse_r = lse.clone(), lse.clone()
    got = merge.merge_step(out.clone(), lse_t, rows, b_out, b_lse, into=into, inv=inv)
    monkeypatch.setenv(merge.MERGE_ENV, "torch")
    want = merge.merge_step(out.clone(), lse_r, rows, b_out, b_lse, into=into)
    _close("out", got, want)
    assert torch.equal(lse_t.isneginf(), lse_r.isneginf())
    finite = lse_r.isfinite()
    diff = (lse_t[finite] - lse_r[finite]).abs().max().item() if finite.any() else 0.0
    allowed = 4 * torch.finfo(torch.float32).eps * max(1.0, lse_r[finite].abs().max().item())
    print(f"lse: max |triton - torch| {diff:.3g}, allowed {allowed:.3g}")
    assert diff <= allowed


@pytest.mark.parametrize("shape,dtype,rows_kind,into_kind,transposed", CASES)
@pytest.mark.parametrize("start", ["sum", "none", "cast"])
def test_add_gpu_triton_matches_torch(shape, dtype, rows_kind, into_kind, transposed, start, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((shape, rows_kind, start)).encode()))
    B, S, H, D = shape
    rows, n, inv = _rows(rows_kind, S, gen)
    acc_dtype = dtype if into_kind != "float32" else torch.float32
    into = {"same": acc_dtype, "float32": torch.float32, "input": dtype}[into_kind]
    acc = None if start == "none" else torch.randn(shape, generator=gen, device="cuda").to(acc_dtype)
    if start == "cast":
        grad = None
    elif transposed:
        grad = torch.randn(B, H, n, D, generator=gen, device="cuda").to(dtype).transpose(1, 2)
    else:
        grad = torch.randn(B, n, H, D, generator=gen, device="cuda").to(dtype)
    got = merge.add_step(None if acc is None else acc.clone(), rows, grad, into=into, shape=shape, inv=inv)
    monkeypatch.setenv(merge.MERGE_ENV, "torch")
    want = merge.add_step(None if acc is None else acc.clone(), rows, grad, into=into, shape=shape)
    _close("sum", got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows_kind", ROWS)
def test_add_steps_gpu_one_launch_matches_three_torch_adds(dtype, rows_kind, monkeypatch):
    """A backward step's dq, dk and dv adds in one launch (``merge.add_steps``): GQA head counts,
    head_dim_v of its own, a float32 hop and a last add into the input dtype."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((dtype, rows_kind)).encode()))
    B, S = 2, 97
    jobs = []
    for H, D, into, start in ((8, 192, dtype, "sum"), (2, 192, torch.float32, "none"), (2, 128, torch.float32, "sum")):
        rows, n, inv = _rows(rows_kind, S, gen)
        acc = None if start == "none" else torch.randn(B, S, H, D, generator=gen, device="cuda").to(into)
        grad = torch.randn(B, n, H, D, generator=gen, device="cuda").to(dtype)
        jobs.append((acc, rows, grad, into, (B, S, H, D), inv))

    def fresh():
        return [(None if a is None else a.clone(), *rest) for a, *rest in jobs]

    got = merge.add_steps(fresh())
    monkeypatch.setenv(merge.MERGE_ENV, "torch")
    want = merge.add_steps(fresh())
    for i, (g, w) in enumerate(zip(got, want)):
        _close(f"job {i}", g, w)
