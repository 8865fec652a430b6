"""The ring engine's fused per-step updates (``variants/engines/merge.py``) on CPU, against the unfused ones.

The engine keeps a row's running result in the input dtype while it holds one block's result
and in float32 while more blocks follow, and its last update writes the input dtype. On the
torch path (the one CPU takes) that must be bitwise what the unfused engine computed: every
block merged (or added) into a float32 accumulator with ``merge_`` (or ``+=``), then one cast.
"""

from __future__ import annotations

import pytest
import torch

from ringbench.variants.engines import merge
from ringbench.variants.engines.merge import add_step, merge_path, merge_step
from ringbench.variants.kernels.common import merge_

#: (B, S, H, D) with awkward sizes.
SHAPES = [(1, 12, 3, 16), (2, 9, 2, 24)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rows(kind: str, S: int, gen: torch.Generator):
    if kind == "all":
        return slice(None), S
    if kind == "tail":
        return slice(S // 2, None), S - S // 2
    idx = torch.randperm(S, generator=gen)[: S // 2 + 1].sort().values
    return idx, idx.numel()


def _blocks(shape, dtype, kinds, gen):
    """Per block: (rows, out [B, n, H, D] in dtype, lse float32 [B, H, n]), some lse -inf and one gap of 200."""
    B, S, H, D = shape
    blocks = []
    for i, kind in enumerate(kinds):
        rows, n = _rows(kind, S, gen)
        out = torch.randn(B, n, H, D, generator=gen).to(dtype)
        lse = torch.randn(B, H, n, generator=gen) * 3
        lse[:, 0, 0] = float("-inf")  # a row that saw no key in this block: out 0 there, as kernels give
        out[:, 0, 0] = 0
        if i == 1:
            lse[:, -1, -1] = 200.0  # a gap the naive form overflows on
        blocks.append((rows, out, lse))
    return blocks


def _unfused_fold(shape, dtype, blocks):
    B, S, H, _ = shape
    out = torch.zeros(shape, dtype=torch.float32)
    lse = torch.full((B, H, S), float("-inf"))
    for rows, b_out, b_lse in blocks:
        if isinstance(rows, slice):
            merge_(out[:, rows], lse[:, :, rows], b_out, b_lse)
        else:
            o, l = out.index_select(1, rows), lse.index_select(2, rows)
            merge_(o, l, b_out, b_lse)
            out.index_copy_(1, rows, o)
            lse.index_copy_(2, rows, l)
    return out.to(dtype), lse


def _engine_fold(shape, dtype, blocks):
    """As ``ring._fold``: the first whole block as it is, float32 in between, the last merge into dtype."""
    B, S, H, _ = shape
    out = lse = None
    for i, (rows, b_out, b_lse) in enumerate(blocks):
        into = dtype if i == len(blocks) - 1 else torch.float32
        if out is None and isinstance(rows, slice) and rows == slice(None):
            out, lse = b_out, b_lse.clone()
            continue
        if out is None:
            out = torch.zeros(shape, dtype=dtype)
            lse = torch.full((B, H, S), float("-inf"))
        out = merge_step(out, lse, rows, b_out, b_lse, into=into)
    return out, lse


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kinds", [("all", "tail"), ("all", "idx", "tail", "all"), ("idx", "all", "idx"),
                                   ("tail",), ("all",)])
def test_merge_step_plan_is_bitwise_the_unfused_float32_fold(shape, dtype, kinds):
    gen = torch.Generator().manual_seed(len(kinds) * 7 + shape[1])
    blocks = _blocks(shape, dtype, kinds, gen)
    want_out, want_lse = _unfused_fold(shape, dtype, blocks)
    got_out, got_lse = _engine_fold(shape, dtype, blocks)
    assert got_out.dtype == dtype and got_out.shape == shape
    diff = (got_out.float() - want_out.float()).abs().max().item()
    print(f"{dtype} {kinds}: max |fused - unfused| out {diff:.3g}")
    assert torch.equal(got_out, want_out)
    assert torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kinds", [("all", "tail"), ("tail", "idx", "all", "all"), ("idx",)])
def test_add_step_plan_is_bitwise_the_unfused_float32_sum(shape, dtype, kinds):
    gen = torch.Generator().manual_seed(len(kinds) * 11 + shape[1])
    grads = [(rows, torch.randn(shape[0], n, *shape[2:], generator=gen).to(dtype))
             for rows, n in (_rows(kind, shape[1], gen) for kind in kinds)]
    want = torch.zeros(shape, dtype=torch.float32)
    for rows, g in grads:
        if isinstance(rows, slice):
            want[:, rows] += g
        else:
            want.index_add_(1, rows, g.float())
    acc = None
    for i, (rows, g) in enumerate(grads):
        into = dtype if i == len(grads) - 1 else torch.float32
        acc = add_step(acc, rows, g, into=into, shape=shape)
    assert acc.dtype == dtype and acc.shape == shape
    assert torch.equal(acc, want.to(dtype))


def test_add_step_without_a_gradient_casts_and_refuses_nothing_at_all():
    x = torch.randn(1, 5, 2, 8)
    assert torch.equal(add_step(x, slice(None), None, into=torch.bfloat16), x.to(torch.bfloat16))
    assert add_step(x, slice(None), None, into=torch.float32) is x  # nothing to do: the same tensor
    with pytest.raises(ValueError, match="both are None"):
        add_step(None, slice(None), None, into=torch.float32, shape=(1, 5, 2, 8))


def test_merge_path_on_cpu_is_torch_and_the_variable_forces_torch(monkeypatch):
    assert merge_path("cpu") == "torch"
    monkeypatch.setenv(merge.MERGE_ENV, "torch")
    assert merge_path("cuda") == "torch"
    # Where no Triton imports (this CPU machine), CUDA would take the torch ops too.
    monkeypatch.delenv(merge.MERGE_ENV)
    assert merge_path("cuda") == ("triton" if merge._triton_imports() else "torch")


@pytest.mark.parametrize("kinds", [("all", "tail", "idx", "all"), ("idx", "all", "tail")])
def test_merge_step_keeps_a_float64_running_lse_beside_a_float32_out(kinds):
    """fp32 inputs: the engines hold the running lse in float64 (``running_lse_dtype``), so a row's lse is
    the float64 fold's, bit for bit, however many blocks meet; out stays a float32 fold."""
    shape = (2, 9, 2, 24)
    B, S, H, _ = shape
    blocks = _blocks(shape, torch.float32, kinds, torch.Generator().manual_seed(5))
    want_out = torch.zeros(shape, dtype=torch.float64)
    want_lse = torch.full((B, H, S), float("-inf"), dtype=torch.float64)
    for rows, b_out, b_lse in blocks:
        o, l = want_out[:, rows], want_lse[:, :, rows]  # a copy where rows are indices
        merge_(o, l, b_out, b_lse)
        want_out[:, rows], want_lse[:, :, rows] = o, l
    out, lse = torch.zeros(shape), torch.full((B, H, S), float("-inf"), dtype=torch.float64)
    for rows, b_out, b_lse in blocks:
        out = merge_step(out, lse, rows, b_out, b_lse, into=torch.float32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float64
    assert torch.equal(lse, want_lse)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=1e-5)


def test_a_float64_running_lse_takes_the_torch_ops(monkeypatch):
    """The fused merge takes no float64: with a float64 lse (fp32 inputs) merge_step takes the torch ops."""
    monkeypatch.setattr(merge, "merge_path", lambda device: "triton")
    out, b_out = torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8)
    lse32, lse64 = torch.zeros(1, 2, 4), torch.zeros(1, 2, 4, dtype=torch.float64)
    assert merge._fused(out, lse32, b_out, lse32)
    assert not merge._fused(out, lse64, b_out, lse32)
