"""Packed documents prepared once per batch (``variants.varlen.prepare``): the cu_seqlens check
runs once per tensor, the per-step schedules once per set of offsets (their fingerprint), and
every call given the prepared documents checks and builds nothing."""

from __future__ import annotations

import pytest
import torch

from ringbench.variants.engines import varlen
from ringbench.variants.engines.llama3_varlen import llama3_varlen_attention
from ringbench.variants.engines.ring_varlen import zigzag_varlen_attention

SEQLEN = 64


@pytest.fixture
def group(solo_group):
    varlen._BY_FINGERPRINT.clear()
    varlen._BY_TENSOR.clear()
    yield solo_group
    varlen._BY_FINGERPRINT.clear()
    varlen._BY_TENSOR.clear()


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, SEQLEN, 4, 16, generator=gen)
    k = torch.randn(1, SEQLEN, 2, 16, generator=gen)
    v = torch.randn(1, SEQLEN, 2, 16, generator=gen)
    return q, k, v


def _cu(*offsets: int) -> torch.Tensor:
    return torch.tensor(offsets, dtype=torch.int32)


def _no_check(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("cu_seqlens was checked again")

    monkeypatch.setattr(varlen, "check_cu_seqlens", refuse)


def _run(attention, q, k, v, cu, group):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = attention(q, k, v, causal=True, group=group, kernel="cpu", cu_seqlens=cu)
    out.backward(torch.ones_like(out))
    return out.detach(), lse, q.grad, k.grad, v.grad


def test_varlen_prepare_same_tensor_is_not_checked_again(group, monkeypatch):
    cu = _cu(0, 16, 40, SEQLEN)
    docs = varlen.prepare(cu, SEQLEN, group)
    assert docs.offsets == (0, 16, 40, SEQLEN) and docs.lengths == [16, 24, 24]
    _no_check(monkeypatch)
    assert varlen.prepare(cu, SEQLEN, group) is docs
    assert varlen.prepare(docs, SEQLEN, group) is docs


def test_varlen_prepare_same_fingerprint_reuses_the_schedules(group):
    q, k, v = _inputs()
    first = _cu(0, 16, 40, SEQLEN)
    ref = _run(zigzag_varlen_attention, q, k, v, first, group)
    docs = varlen.prepare(first, SEQLEN, group)
    assert docs.builds == 1  # forward and backward shared one schedule
    again = _cu(0, 16, 40, SEQLEN)  # another tensor, the same offsets
    assert varlen.prepare(again, SEQLEN, group) is docs
    got = _run(zigzag_varlen_attention, q, k, v, again, group)
    assert docs.builds == 1
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    _run(llama3_varlen_attention, q, k, v, again, group)  # another variant: its own schedule
    assert docs.builds == 2


def test_varlen_prepare_different_fingerprint_rebuilds(group):
    q, k, v = _inputs()
    a = varlen.prepare(_cu(0, 16, 40, SEQLEN), SEQLEN, group)
    _run(zigzag_varlen_attention, q, k, v, a, group)
    b = varlen.prepare(_cu(0, 32, SEQLEN), SEQLEN, group)
    assert b is not a and b.fingerprint != a.fingerprint and b.builds == 0
    _run(zigzag_varlen_attention, q, k, v, b, group)
    assert a.builds == 1 and b.builds == 1


def test_varlen_prepare_sees_a_tensor_changed_in_place(group):
    cu = _cu(0, 16, 40, SEQLEN)
    a = varlen.prepare(cu, SEQLEN, group)
    cu[1] = 8  # a new version of the same tensor: checked again, new documents
    b = varlen.prepare(cu, SEQLEN, group)
    assert b is not a and b.offsets == (0, 8, 40, SEQLEN)


def test_varlen_prepared_documents_are_neither_checked_nor_rebuilt_in_the_call(group, monkeypatch):
    q, k, v = _inputs(1)
    cu = _cu(0, 2, 2, 30, SEQLEN)  # an empty document too
    ref = {name: _run(att, q, k, v, cu, group) for name, att in
           (("zigzag_varlen", zigzag_varlen_attention), ("llama3_varlen", llama3_varlen_attention))}
    docs = varlen.prepare(cu, SEQLEN, group)
    builds = docs.builds
    _no_check(monkeypatch)
    for name, att in (("zigzag_varlen", zigzag_varlen_attention), ("llama3_varlen", llama3_varlen_attention)):
        got = _run(att, q, k, v, docs, group)
        for a, b in zip(got, ref[name]):
            assert torch.equal(a, b), name
    assert docs.builds == builds


def test_varlen_prepare_refuses_documents_of_another_row_length(group):
    docs = varlen.prepare(_cu(0, 16, SEQLEN), SEQLEN, group)
    with pytest.raises(ValueError, match=r"prepared for 64 tokens per rank but q holds 32"):
        varlen.prepare(docs, 32, group)
