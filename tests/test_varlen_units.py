"""Fast unit tests of packed documents (varlen): the kernels' varlen form, the document-wise and
row-wise layouts, the ring engine's varlen steps, llama3_varlen's pieces, cu_seqlens checks, the
spec's document fields and rules, and the varlen FLOP count. No test needs more than one process;
the variants themselves run here at world size 1 (tests/test_varlen_distributed.py runs them at 2
and 4). Numerical tests print their max differences before asserting.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.distributed as dist

from helpers import attention_fp64
from ringbench.case.work import attention_flops
from ringbench.case.spec import (CaseSpec, SpecError, check_fields, default_fields, draw_docs, parse_doc_dist,
                                 parse_docs, resolve, resolve_docs, spec_docs, validate)
from ringbench.variants import get_variant
from ringbench.variants.engines import layouts
from ringbench.variants.kernels import KERNELS
from ringbench.variants.engines.llama3_varlen import local_pieces
from ringbench.variants.engines.ring import _ALL, VarlenSteps, contiguous_plan
from ringbench.variants.engines.zigzag import zigzag_plan

Tensor = torch.Tensor
VARLEN = ("ring_varlen", "zigzag_varlen", "llama3_varlen")


def _max_diff(label: str, got: Tensor, want: Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    finite = torch.isfinite(want)
    diff = (got - want)[finite].abs()
    d = float(diff.max()) if diff.numel() else 0.0
    print(f"{label}: max diff {d:.3e}")
    assert torch.equal(torch.isfinite(got), finite), f"{label}: -inf rows differ"
    return d


#: (cu_seqlens_q, cu_seqlens_k): square documents of awkward lengths with an empty one; and
#: rectangles: fewer queries than keys, more queries than keys, queries without keys, keys
#: without queries, and a document empty on both sides.
DOC_CASES = {
    "square": ([0, 97, 97, 100, 357], [0, 97, 97, 100, 357]),
    "rectangles": ([0, 3, 3, 7, 8, 8, 12], [0, 6, 6, 7, 7, 9, 20]),
}


@pytest.mark.parametrize("doc_case", list(DOC_CASES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kernel_name", ["math", "cpu"])
def test_kernels_varlen_matches_dense_mask_reference(kernel_name, causal, doc_case):
    """forward_varlen and backward_varlen equal a dense-mask float64 attention, bottom-right causal."""
    cu_q, cu_k = DOC_CASES[doc_case]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, cu_q[-1], 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, cu_k[-1], 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, cu_k[-1], 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, cu_q[-1], 4, 8, generator=gen, dtype=torch.float64)
    want_out, want_lse = attention_fp64(q, k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=causal, scale=0.3)
    want_out.backward(dout)
    kern = KERNELS[kernel_name]
    tq, tk = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    with torch.no_grad():
        out, lse = kern.forward_varlen(q, k, v, tq, tk, max_q, max_k, causal, 0.3)
        grads = kern.backward_varlen(dout, q, k, v, out, lse, tq, tk, max_q, max_k, causal, 0.3)
    assert out.shape == q.shape and lse.shape == (1, 4, cu_q[-1]) and lse.dtype == torch.float64
    diffs = [_max_diff("out", out, want_out), _max_diff("lse", lse, want_lse)]
    diffs += [_max_diff(n, g, t.grad) for n, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v))]
    assert max(diffs) < 1e-12
    # A query that sees no key: out 0 and lse -inf.
    empty = ~torch.isfinite(want_lse)
    if doc_case == "rectangles":
        assert empty.any()
    assert (lse[empty] == -math.inf).all()
    assert (out.transpose(1, 2)[empty] == 0).all()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("kernel_name", ["math", "cpu"])
def test_kernels_varlen_one_document_is_the_batch_call(kernel_name, causal):
    """One document over the whole row gives exactly the batch call's out, lse and gradients, in bf16."""
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 65, 4, 16, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(1, 65, 2, 16, generator=gen).bfloat16() for _ in range(2))
    cu = torch.tensor([0, 65], dtype=torch.int32)
    kern = KERNELS[kernel_name]
    out, lse = kern.forward_varlen(q, k, v, cu, cu, 65, 65, causal, 0.25)
    b_out, b_lse = kern.forward(q, k, v, causal, 0.25)
    grads = kern.backward_varlen(dout, q, k, v, out, lse, cu, cu, 65, 65, causal, 0.25)
    b_grads = kern.backward(dout, q, k, v, b_out, b_lse, causal, 0.25)
    assert torch.equal(out, b_out) and torch.equal(lse, b_lse)
    assert all(torch.equal(a, b) for a, b in zip(grads, b_grads))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3


@pytest.mark.parametrize("kernel_name", ["math", "cpu"])
def test_kernels_varlen_refuses_malformed_input(kernel_name):
    kern = KERNELS[kernel_name]
    q, k = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 1, 4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"batch > 1; pack the sequences into one row"):
        kern.forward_varlen(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                            cu, cu, 5, 5, True, 0.5)
    with pytest.raises(ValueError, match=r"cu_seqlens_q is torch\.int64 .* must be a 1-D int32 tensor"):
        kern.forward_varlen(q, k, k, cu.long(), cu, 5, 5, True, 0.5)
    with pytest.raises(ValueError, match=r"cu_seqlens_q has 2 documents and cu_seqlens_k 1"):
        kern.forward_varlen(q, k, k, cu, torch.tensor([0, 8], dtype=torch.int32), 5, 8, True, 0.5)
    with pytest.raises(ValueError, match=r"ending at 6 does not run from 0, non-decreasing, to the 8 packed tokens"):
        short = torch.tensor([0, 3, 6], dtype=torch.int32)
        kern.forward_varlen(q, k, k, short, short, 3, 3, True, 0.5)


def test_kernels_varlen_support_is_declared():
    """math, cpu and torch-flash have a varlen form; every kernel without one says why, naming those that have one."""
    assert {"math", "cpu", "torch-flash"} <= {n for n, k in KERNELS.items() if k.varlen}
    for name, kernel in KERNELS.items():
        if kernel.varlen:
            assert kernel.check_varlen() is None
            continue
        message = kernel.check_varlen()
        print(message)
        takes = [n for n, k in KERNELS.items() if k.varlen and k.device_type in (kernel.device_type, "any")]
        assert re.match(rf"the {name} kernel has no varlen form in ringbench \(.+\); pass --kernel with one of "
                        + re.escape(", ".join(takes)) + " or auto$", message)


# --------------------------------------------------------------------------- layouts

def test_layouts_varlen_token_index_by_document_and_by_row():
    cu = [0, 8, 16]
    by_doc = {(layout, r): layouts.varlen_token_index(cu, layout, r, 2, by_document=True).tolist()
              for layout in ("contiguous", "zigzag") for r in range(2)}
    print(by_doc)
    assert by_doc[("contiguous", 0)] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert by_doc[("contiguous", 1)] == [4, 5, 6, 7, 12, 13, 14, 15]
    assert by_doc[("zigzag", 0)] == [0, 1, 6, 7, 8, 9, 14, 15]
    assert by_doc[("zigzag", 1)] == [2, 3, 4, 5, 10, 11, 12, 13]
    assert layouts.varlen_token_index(cu, "contiguous", 1, 2, by_document=False).tolist() == list(range(8, 16))


@pytest.mark.parametrize("layout, by_document, docs", [
    ("contiguous", True, [12, 0, 4, 28]),
    ("zigzag", True, [16, 0, 8, 24]),
    ("contiguous", False, [3, 0, 1, 30, 7, 7]),
])
def test_layouts_varlen_shard_unshard_round_trip(layout, by_document, docs):
    world_size = 4
    cu = layouts.cu_seqlens_from_docs(docs)
    x = torch.randn(1, sum(docs), 3, 2)
    shards = [layouts.shard_varlen(x, cu, layout, r, world_size, by_document=by_document) for r in range(world_size)]
    assert all(s.shape == (1, sum(docs) // world_size, 3, 2) for s in shards)
    assert torch.equal(layouts.unshard_varlen(shards, cu, layout, by_document=by_document), x)
    lse = torch.randn(1, 3, sum(docs))
    lse_shards = [layouts.shard_varlen(lse, cu, layout, r, world_size, by_document=by_document, dim=2)
                  for r in range(world_size)]
    assert torch.equal(layouts.unshard_varlen(lse_shards, cu, layout, by_document=by_document, dim=2), lse)


def test_layouts_varlen_local_cu_seqlens():
    """By document: L/W of every document on every rank; by row: the documents' pieces on the rank."""
    for r in range(2):
        local = layouts.varlen_local_cu_seqlens([0, 8, 8, 24], "zigzag", r, 2, by_document=True)
        assert local.tolist() == [0, 4, 4, 12]
    row = [layouts.varlen_local_cu_seqlens([0, 3, 13, 13, 16], "contiguous", r, 2, by_document=False).tolist()
           for r in range(2)]
    print(row)
    assert row == [[0, 3, 8], [0, 5, 8]]
    assert layouts.varlen_local_cu_seqlens([0, 3, 13, 13, 16], "contiguous", 0, 2,
                                           by_document=False).dtype == torch.int32


def test_layouts_varlen_document_rule_names_first_offender():
    with pytest.raises(ValueError, match=r"^document 2 has 100 tokens, not a multiple of 2 \* world_size = 8, which "
                                         r"the zigzag layout, document by document, needs; make it 104 or 96 tokens"):
        layouts.varlen_token_index([0, 8, 108, 1008], "zigzag", 0, 4, by_document=True)


# --------------------------------------------------------------------------- the ring engine's steps

def test_ring_varlen_steps_zigzag_pick_each_documents_half():
    """Zigzag per document: the earlier rank's visiting K/V gives its first half of every document,
    a later rank's visiting K/V meets the second half of every local document; empty documents drop."""
    lengths = [4, 0, 8]
    later = VarlenSteps(zigzag_plan, lengths, rank=1, world_size=2, causal=True, device="cpu")
    diag = later(0, 1)
    assert (diag.q, diag.kv, diag.causal) == (_ALL, _ALL, True)
    assert diag.cu_q.tolist() == diag.cu_k.tolist() == [0, 4, 12] and (diag.max_q, diag.max_k) == (8, 8)
    from_earlier = later(1, 0)
    assert from_earlier.q == _ALL and from_earlier.kv.tolist() == [0, 1, 4, 5, 6, 7]
    assert from_earlier.cu_q.tolist() == [0, 4, 12] and from_earlier.cu_k.tolist() == [0, 2, 6]
    assert from_earlier.causal is False and (from_earlier.max_q, from_earlier.max_k) == (8, 4)
    earlier = VarlenSteps(zigzag_plan, lengths, rank=0, world_size=2, causal=True, device="cpu")
    from_later = earlier(1, 1)
    assert from_later.q.tolist() == [2, 3, 8, 9, 10, 11] and from_later.kv == _ALL
    assert from_later.cu_q.tolist() == [0, 2, 6] and from_later.cu_k.tolist() == [0, 4, 12]
    assert earlier(1, 1) is from_later  # built once, reused by the backward


def test_ring_varlen_steps_contiguous_skip_later_ranks():
    steps = VarlenSteps(contiguous_plan, [4, 8], rank=0, world_size=2, causal=True, device="cpu")
    assert steps(1, 1) is None
    full = VarlenSteps(contiguous_plan, [4, 8], rank=0, world_size=2, causal=False, device="cpu")(1, 1)
    assert (full.q, full.kv, full.causal, full.cu_q.tolist()) == (_ALL, _ALL, False, [0, 4, 12])


def test_llama3_varlen_local_pieces_straddle_and_empty():
    """Rank 1 of 4 (rows 16..31): a one-token document, another, and the start of a document that
    runs to row 47; empty documents leave no piece. Rank 2 holds the rest of that document."""
    offsets = [0, 0, 1, 16, 16, 17, 18, 48, 48, 64]
    p = local_pieces(offsets, 1, 16, causal=True)
    assert (p.cu_q.tolist(), p.cu_k.tolist(), p.keys, p.max_q, p.max_k) == ([0, 1, 2, 16], [0, 1, 2, 16],
                                                                           slice(16, 32), 14, 14)
    assert local_pieces(offsets, 1, 16, causal=False).keys == slice(16, 48)
    p2 = local_pieces(offsets, 2, 16, causal=True)
    assert (p2.cu_q.tolist(), p2.cu_k.tolist(), p2.keys) == ([0, 16], [0, 30], slice(18, 48))


# --------------------------------------------------------------------------- the variants at world size 1

@pytest.fixture
def solo_group(tmp_path):
    """A world-size-1 gloo process group on a FileStore, destroyed after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("variant", VARLEN)
def test_varlen_variants_world_size_one_match_reference(solo_group, variant):
    """At world size 1, each variant with the math kernel in float64 equals the dense-mask reference."""
    docs = [0, 2, 30, 4, 0, 28]  # even lengths: zigzag_varlen at W=1 cuts each document in 2
    cu_list = layouts.offsets_of(layouts.cu_seqlens_from_docs(docs))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 64, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 64, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 64, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 64, 4, 8, generator=gen, dtype=torch.float64)
    want_out, want_lse = attention_fp64(q, k, v, cu_seqlens=cu_list, causal=True, scale=0.3)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    out, lse = get_variant(variant).attention(q, k, v, causal=True, softmax_scale=0.3, kernel="math",
                                              cu_seqlens=layouts.cu_seqlens_from_docs(docs))
    got = torch.autograd.grad(out, (q, k, v), dout)
    diffs = [_max_diff("out", out, want_out), _max_diff("lse", lse, want_lse)]
    diffs += [_max_diff(n, g, w) for n, g, w in zip(("dq", "dk", "dv"), got, want)]
    assert max(diffs) < 1e-12


@pytest.mark.dist
@pytest.mark.parametrize("cu, pattern", [
    (torch.tensor([0, 64]), r"^\[rank 0/1\] cu_seqlens has dtype torch\.int64, but it must be int32"),
    (torch.tensor([[0, 64]], dtype=torch.int32), r"cu_seqlens has shape \(1, 2\), but it must be 1-D"),
    (torch.tensor([1, 64], dtype=torch.int32), r"cu_seqlens starts at 1, but it must start at 0"),
    (torch.tensor([0, 40, 39, 64], dtype=torch.int32), r"cu_seqlens decreases from 40 to 39 at index 2"),
    (torch.tensor([0, 32], dtype=torch.int32), r"cu_seqlens ends at 32 but the packed row holds 64 tokens; the last "
                                               r"offset must equal the token count"),
    (None, r"^\[rank 0/1\] llama3_varlen takes packed documents and needs cu_seqlens"),
])
def test_varlen_variant_refuses_bad_cu_seqlens(solo_group, cu, pattern):
    q, k = torch.randn(1, 64, 2, 8), torch.randn(1, 64, 1, 8)
    with pytest.raises(ValueError, match=pattern):
        get_variant("llama3_varlen").attention(q, k, k, causal=True, kernel="cpu", cu_seqlens=cu)


@pytest.mark.dist
def test_batch_variants_refuse_cu_seqlens_and_varlen_refuses_cudnn(solo_group):
    q = torch.randn(1, 8, 2, 4)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="use ring_varlen"):
        get_variant("ring").attention(q, q, q, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"the cudnn kernel has no varlen form"):
        get_variant("ring_varlen").attention(q, q, q, kernel="cudnn", cu_seqlens=cu)


# --------------------------------------------------------------------------- spec

def varlen_spec(variant: str = "llama3_varlen", **changes) -> CaseSpec:
    fields = {"task": "verify", "variant": variant, **default_fields("cpu", 0), "kernel": "cpu"}
    fields.update(changes)
    return CaseSpec(**fields)


def test_parse_docs_examples():
    assert parse_docs("3000,500,12k") == [3000, 500, 12288]
    assert parse_docs(" 0, 1 ,1.5k") == [0, 1, 1536]


@pytest.mark.parametrize("text, pattern", [
    ("", r"^docs '' is empty; pass document lengths separated by commas"),
    ("3000,,500", r"^docs '3000,,500' has no length for document 2"),
    ("3000,abc", r"^document 2 'abc' is not a size"),
    ("-4", r"^document 1 '-4' must be 0 or more tokens; pass lengths such as 3000,0,12k$"),
])
def test_parse_docs_refuses_bad_text(text, pattern):
    with pytest.raises(SpecError, match=pattern):
        parse_docs(text)


def test_parse_doc_dist_examples():
    assert parse_doc_dist("lognormal:mean=4k,sigma=1") == ("lognormal", {"mean": 4096, "sigma": 1.0})
    assert parse_doc_dist("uniform:min=512,max=8k") == ("uniform", {"min": 512, "max": 8192})


@pytest.mark.parametrize("text, pattern", [
    ("gauss:mean=4k", r"^doc_dist 'gauss:mean=4k' is not a document distribution; use lognormal"),
    ("lognormal:mean=4k", r"^doc_dist 'lognormal:mean=4k' lacks sigma"),
    ("lognormal:mean=4k,sigma=x", r"sigma 'x' must be a number from 0 to 10"),
    ("uniform:min=8k,max=512", r"min 8192 is above max 512; swap them"),
    ("uniform:min=1,max=8,min=2", r"'min=2' is not one of uniform's parameters min and max, each given once"),
])
def test_parse_doc_dist_refuses_bad_text(text, pattern):
    with pytest.raises(SpecError, match=pattern):
        parse_doc_dist(text)


def test_resolve_docs_same_seed_same_documents():
    spec = varlen_spec(seqlen=65536, doc_dist="lognormal:mean=4k,sigma=1", seed=3)
    a, b = resolve_docs(spec), resolve_docs(spec)
    other = resolve_docs(spec.replace(seed=4))
    print(a.docs, other.docs, sep="\n")
    assert a.docs == b.docs and a.docs != other.docs
    assert sum(parse_docs(a.docs)) == sum(parse_docs(other.docs)) == 65536
    assert a.doc_dist == spec.doc_dist and resolve_docs(a) == a  # idempotent, the distribution kept


@pytest.mark.parametrize("variant, world_size, multiple", [("ring_varlen", 4, 4), ("zigzag_varlen", 4, 8),
                                                           ("zigzag_varlen", 3, 6), ("llama3_varlen", 4, 1)])
@pytest.mark.parametrize("dist_text", ["lognormal:mean=3k,sigma=1.5", "uniform:min=1,max=2k"])
def test_resolve_docs_fills_seqlen_with_the_variants_multiple(variant, world_size, multiple, dist_text):
    spec = varlen_spec(variant, world_size=world_size, seqlen=48 * 1024, doc_dist=dist_text, seed=11)
    docs = parse_docs(resolve_docs(spec).docs)
    print(len(docs), docs[:10])
    assert sum(docs) == 48 * 1024 and all(d >= multiple and d % multiple == 0 for d in docs)
    validate(resolve_docs(spec), visible_gpus=0)


def test_draw_docs_lognormal_mean_and_uniform_range():
    docs = draw_docs("lognormal", {"mean": 4096, "sigma": 1.0}, 8 * 1024**2, seed=0)
    mean = sum(docs[:-1]) / len(docs[:-1])
    print(len(docs), mean)
    assert abs(mean / 4096 - 1) < 0.1
    uni = draw_docs("uniform", {"min": 512, "max": 8192}, 1024**2, seed=0)
    assert all(512 <= d <= 8192 for d in uni[:-1]) and 1 <= uni[-1] <= 8192 and sum(uni) == 1024**2


def test_resolve_docs_normalises_and_refuses_disagreement():
    spec = varlen_spec(seqlen=15788, docs="3000, 500,12k")
    resolved = resolve_docs(spec)
    assert resolved.docs == "3000,500,12288"
    assert resolved.case_id() == resolve_docs(spec.replace(docs="3000,500,12288")).case_id()
    assert resolved.case_id() != resolve_docs(spec.replace(docs="3500,12288")).case_id()
    plain = varlen_spec("ring")
    assert resolve_docs(plain) is plain
    with pytest.raises(SpecError, match=r"are both given and disagree; pass --docs or --doc-dist, not both"):
        resolve_docs(spec.replace(doc_dist="uniform:min=1,max=8"))


@pytest.mark.parametrize("variant", VARLEN)
@pytest.mark.parametrize("causal", [True, False])
def test_validate_issue_documents_accepted_by_every_varlen_variant(variant, causal):
    validate(resolve_docs(varlen_spec(variant, world_size=4, seqlen=4240, docs="128,1120,2992", causal=causal)),
             visible_gpus=0)


def test_validate_zigzag_varlen_names_every_document_off_its_multiple():
    spec = varlen_spec("zigzag_varlen", world_size=4, seqlen=4096, docs="100,900,3096")
    with pytest.raises(SpecError, match=r"^documents 1 and 2 have 100 and 900 tokens, not multiples of 2 \* world_size "
                                        r"= 8, which zigzag_varlen needs for every document; pass --docs "
                                        r"104,896,3096, pad the documents with --doc-pad 8 --seqlen 4104, or use "
                                        r"--variant llama3_varlen, which takes any document lengths$"):
        validate(spec, visible_gpus=0)
    validate(spec.replace(docs="104,896,3096"), visible_gpus=0)
    validate(spec.replace(doc_pad=8, seqlen=4104), visible_gpus=0)
    validate(spec.replace(variant="llama3_varlen"), visible_gpus=0)


def test_validate_ring_varlen_rule_is_a_multiple_of_world_size():
    """100, 900 and 3096 are all multiples of W = 4, so ring_varlen takes them at W=4 (it then passes the
    verify rule: test_varlen_distributed); at W = 8 it names the 100-token document."""
    spec = varlen_spec("ring_varlen", world_size=4, seqlen=4096, docs="100,900,3096")
    validate(spec, visible_gpus=0)
    with pytest.raises(SpecError, match=r"^documents 1 and 2 have 100 and 900 tokens, not multiples of world_size = "
                                        r"8, which ring_varlen needs for every document; pass --docs 104,896,3096,"):
        validate(spec.replace(world_size=8), visible_gpus=0)
    with pytest.raises(SpecError, match=r"^documents 3 and 4 have 90 and 3006 tokens, not multiples of world_size = 4"):
        validate(spec.replace(docs="100,900,90,3006"), visible_gpus=0)


def test_validate_documents_must_sum_to_seqlen():
    spec = varlen_spec("ring_varlen", world_size=2, seqlen=65536, docs="4096,4096")
    with pytest.raises(SpecError, match=r"^documents sum to 8192 but seqlen is 65536; the documents must fill the row "
                                        r"exactly, so pass --seqlen 8192 or documents that sum to 65536$"):
        validate(spec, visible_gpus=0)


@pytest.mark.parametrize("changes, pattern", [
    ({"variant": "llama3_varlen"}, r"^llama3_varlen attends packed documents, but the case has none; pass --docs"),
    ({"variant": "rfa_ring", "docs": "4096"}, r"^docs '4096' is given, but rfa_ring is a batch variant and takes no "
                                              r"documents; use ring, zigzag, stripe, llama3, ring_varlen, zigzag_varlen, "
                                              r"llama3_varlen, ulysses, ulysses_varlen, usp, usp_varlen or "
                                              r"rfa_llama3_varlen, or drop --docs$"),
    ({"variant": "zigzag", "doc_dist": "uniform:min=1,max=8"}, r"^doc_dist 'uniform:min=1,max=8' is given, but zigzag "
                                                                r"is a batch variant"),
    ({"variant": "llama3_varlen", "docs": "2048,2048", "batch": 2}, r"^batch 2 is not 1, but llama3_varlen packs the "
                                                                    r"documents into one row; pass --batch 1"),
    ({"variant": "llama3_varlen", "docs": "40,x"}, r"^document 2 'x' is not a size"),
])
def test_validate_refuses_documents_that_do_not_fit(changes, pattern):
    with pytest.raises(SpecError, match=pattern):
        validate(varlen_spec(**changes), visible_gpus=0)


def test_validate_varlen_kernel_must_have_a_varlen_form():
    spec = varlen_spec("zigzag_varlen", device="cuda", world_size=2, seqlen=4096, docs="4096", dtype="bf16",
                       kernel="cudnn", head_dim=64)
    with pytest.raises(SpecError, match=r"^the cudnn kernel has no varlen form in ringbench"):
        validate(spec, visible_gpus=2)
    validate(spec.replace(kernel="torch-flash"), visible_gpus=2)
    assert resolve(varlen_spec(docs="4096", kernel="auto")).kernel == "cpu"


def test_check_fields_names_the_documents_before_the_seqlen_rule():
    """The issue's case: the seqlen rule's fix (use 260) was refused next for the sum (pass 258), and
    the 102-token document never named; the document comes first, with fixes that fill the row."""
    given = {"variant": "ring_varlen", "world_size": 4, "docs": "102,156", "seqlen": 258}
    with pytest.raises(SpecError, match=r"^document 1 has 102 tokens, not a multiple of world_size = 4, which "
                                        r"ring_varlen needs for every document; pass --docs 104,156 --seqlen 260, or "
                                        r"pad the documents with --doc-pad 4 --seqlen 260$"):
        check_fields(given)
    check_fields({**given, "docs": "104,156", "seqlen": 260})
    check_fields({**given, "doc_pad": 4, "seqlen": 260})
    check_fields({**given, "variant": "llama3_varlen", "docs": "102,154", "seqlen": 256})  # any lengths


def test_check_fields_refuses_bad_document_text_early():
    with pytest.raises(SpecError, match=r"document 1 '1e3' is not a size"):
        check_fields({"docs": "1e3"})
    with pytest.raises(SpecError, match=r"doc_dist 'lognormal' is not a document distribution"):
        check_fields({"doc_dist": "lognormal"})


def test_spec_docs_draws_a_distribution():
    spec = varlen_spec(seqlen=8192, doc_dist="uniform:min=100,max=900", seed=1)
    assert spec_docs(spec) == parse_docs(resolve_docs(spec).docs)
    assert spec_docs(varlen_spec("ring")) is None


# --------------------------------------------------------------------------- FLOPs

def test_attention_flops_sum_over_documents():
    """A causal document of length L counts 2 * L^2 * Hq * D forward; the total is the sum."""
    assert attention_flops(batch=1, seqlen=8, heads=2, head_dim=4, causal=True, mode="fwd", docs=[3, 5]) == \
        2 * (9 + 25) * 2 * 4
    assert attention_flops(batch=1, seqlen=8, heads=2, head_dim=4, causal=False, mode="fwd_bwd", docs=[3, 0, 5]) == \
        3.5 * 4 * (9 + 25) * 2 * 4
    one = attention_flops(batch=1, seqlen=4096, heads=32, head_dim=128, causal=True, mode="fwd_bwd", docs=[4096])
    assert one == attention_flops(batch=1, seqlen=4096, heads=32, head_dim=128, causal=True, mode="fwd_bwd")
    with pytest.raises(ValueError, match=r"documents sum to 8192 but seqlen is 65536"):
        attention_flops(batch=1, seqlen=65536, heads=1, head_dim=1, causal=True, mode="fwd", docs=[8192])


@pytest.mark.parametrize("variant, seqlen", [("llama3_varlen", 4096), ("ring_varlen", 65536), ("zigzag_varlen", 24576)])
def test_a_varlen_case_without_documents_offers_documents_that_fill_its_seqlen(variant, seqlen):
    """The refusal offered --docs 3000,500,12k "(lengths that sum to --seqlen)", which summed to none of
    them: its example fills the case's seqlen, and the case takes it."""
    spec = varlen_spec(variant, world_size=2, seqlen=seqlen).replace(docs="")
    with pytest.raises(SpecError) as got:
        validate(spec, visible_gpus=0)
    example = re.search(r"pass --docs such as (\S+) \(lengths that sum to seqlen (\d+) tokens\)", str(got.value))
    assert example and int(example[2]) == seqlen, str(got.value)
    docs = parse_docs(example[1])
    assert sum(docs) == seqlen
    validate(spec.replace(docs=example[1]), visible_gpus=0)
