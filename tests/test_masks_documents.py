"""Masks with packed documents (issue 26): a mask given with ``--docs`` applies inside each document, its
positions re-based to 0, every cross-document pair masked (``masks.documents``).

Unit tests (no process group): the per-document slices, the rule for a document shorter than the mask
needs, a slices file cut at the document boundaries, the refusals, FLOPs and the predicted work per rank.
Distributed tests (real torchrun, gloo, CPU, ``tests/dist/verify_cases.py``): the varlen engines (ring_varlen,
zigzag_varlen, llama3_varlen, ulysses_varlen, usp_varlen) pass verify under each family and a slices file at
world sizes 1, 2 and 4, against the float64 math kernel under the dense per-document mask, and the hidden
``mask_not_rebased`` fixture (the mask laid over the packed row, cut at the documents but never re-based)
fails at every world size. World size 2 is the quick launch; 1 and 4 are slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import pool_verify_batches, read_jsonl, ringbench_here, slow_when
from ringbench.case import work
from ringbench.case.spec import CaseSpec, SpecError, canonical, default_fields, resolve_docs, resolve_mask, \
    resolve_options, validate
from ringbench.variants.engines import masks

DATA = Path(__file__).parent / "data" / "masks"
#: Awkward lengths, every one a multiple of 2 * 4 (zigzag_varlen and usp_varlen at W=4): a document shorter
#: than the prompt (24 < 40), one that starts mid-rank, a long last one.
DOCS = (96, 24, 136)


def _dense(mask: masks.Mask):
    every = torch.arange(mask.seqlen)
    return mask.allows(every[:, None], every[None, :])


def _document_of(docs) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))


# --------------------------------------------------------------------------- units

@pytest.mark.parametrize("text", ["prefix:40", "chunked:24", "window:9,4", "global:4,window:16",
                                  "shared-prefix:16,answers=4"])
def test_documents_mask_is_the_mask_of_each_document_rebased(text):
    """Inside every document the packed mask is the family's mask over that document alone (positions from
    0), and every cross-document pair is masked; the area is the sum of the documents' areas."""
    docs = (96, 32, 128)
    packed = masks.documents(text, docs)
    dense = _dense(packed)
    doc = _document_of(docs)
    assert not bool((dense & (doc[:, None] != doc[None, :])).any())
    at = 0
    for n in docs:
        alone = masks.build(text, n) if masks.rule(masks.parse(text), n) is None else None
        if alone is not None:
            assert torch.equal(dense[at:at + n, at:at + n], _dense(alone)), (text, n)
        at += n
    assert packed.area() == int(dense.sum()) and packed.docs == docs


def test_documents_mask_shorter_document_takes_the_rule():
    """A document shorter than the mask needs is taken by the rule of docs/masks.md: a prompt covering it
    gives full attention within it, a chunk or global tokens covering it causal, a shared prompt covering it
    causal."""
    docs = (24, 40)
    for text, inside in (("prefix:40", "full"), ("chunked:64", "causal"), ("global:30,window:4", "causal"),
                         ("shared-prefix:32,answers=2", "causal")):
        dense = _dense(masks.documents(text, docs))
        expect = _dense(masks.build(inside, 24))
        assert torch.equal(dense[:24, :24], expect), text


def test_documents_mask_not_rebased_differs():
    """The mask laid over the packed row and cut at the documents (what the mask_not_rebased fixture runs)
    is another mask whenever a document starts past 0: the check below has something to catch."""
    docs = (96, 32, 128)
    right = _dense(masks.documents("prefix:40", docs))
    whole = masks.build("prefix:40", sum(docs))
    wrong = _dense(whole._replace(slices=tuple(masks._document_cut(whole.slices, docs))))
    assert torch.equal(right[:96, :96], wrong[:96, :96])  # the first document starts at 0: the same
    assert int((right != wrong).sum()) > 0


def test_documents_mask_file_is_cut_at_the_document_boundaries():
    """A slices file is absolute over the packed row: with documents that match MagiAttention's three samples
    it is unchanged; with a boundary inside a slice, the slice is cut there and the pairs across it masked."""
    text = masks.read_file(DATA / "magi_varlen_block_causal.txt")
    same = masks.documents(text, (512, 256, 192))
    assert same.area() == masks.build(text, 960).area()
    cut = masks.documents(text, (512, 256, 64, 128))
    doc = _document_of((512, 256, 64, 128))
    dense = _dense(cut)
    assert not bool((dense & (doc[:, None] != doc[None, :])).any())
    assert cut.area() == masks.build(text, 960).area() - 2 * 64 * 128


def test_documents_mask_refusals_name_the_value_and_the_rule():
    """The refusals are one sentence naming the value and the rule: answers a document cannot split evenly,
    and slices that leave a row no key of its own document."""
    with pytest.raises(ValueError, match=r"^mask shared-prefix:16,answers=5 with --docs applies per document, "
                                         r"and document 0 of 64 tokens leaves 48 tokens after its prompt of 16"):
        masks.documents("shared-prefix:16,answers=5", (64, 64))
    # every row of the image file sees itself, so no cut leaves a row blind
    assert masks.document_rule(masks.read_file(DATA / "image_in_text.txt"), DOCS) is None
    blind = "slices:0,64,0,64,causal;64,128,0,64,full"
    assert "gives query rows 64 to 127 no key of its own document" in masks.document_rule(blind, (64, 64))


def _spec(variant: str, world_size: int, mask: str, docs=DOCS, **fields) -> CaseSpec:
    base = {**default_fields("cpu", 0), "task": "verify", "variant": variant, "kernel": "math",
            "world_size": world_size, "heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "fp32", "seed": 3,
            "seqlen": sum(docs), "docs": ",".join(map(str, docs)), "mask": mask, **fields}
    if variant == "usp_varlen":
        base["ulysses_degree"] = max(1, world_size // 2)
    case = resolve_options(canonical(resolve_mask(resolve_docs(CaseSpec(**base)))))
    validate(case, visible_gpus=0)
    return case


def test_documents_mask_counts_flops_and_work_per_document():
    """FLOPs and the predicted pairs per rank count the mask inside each document: their sum is the
    per-document area, not the batch mask's over the packed row."""
    area = masks.documents("prefix:40", DOCS).area()
    assert area != masks.build("prefix:40", sum(DOCS)).area()
    for variant, fields in (("ring_varlen", {}), ("zigzag_varlen", {}), ("llama3_varlen", {}),
                            ("llama3_varlen", {"layout": "balanced"}), ("ulysses_varlen", {}), ("usp_varlen", {})):
        pairs = work.pairs_per_rank(_spec(variant, 4, "prefix:40", **fields))
        assert pairs is not None and sum(pairs) == area, variant
    flops = work.attention_flops(batch=1, seqlen=sum(DOCS), heads=1, head_dim=1, causal=False, mode="fwd",
                                 docs=list(DOCS), mask="prefix:40")
    assert flops == 4.0 * area


def test_documents_mask_spec_refusals():
    """validate refuses, before launch, answers a document cannot split, padding beside a mask and a peer
    given one, each in one sentence naming the value."""
    with pytest.raises(SpecError, match=r"^mask shared-prefix:16,answers=5 with --docs applies per document"):
        _spec("zigzag_varlen", 2, "shared-prefix:16,answers=5", docs=(64, 32, 160))
    with pytest.raises(SpecError, match=r"^doc_pad 8 needs the causal mask, which keeps every real token from the "
                                        r"padding at its document's end, and mask prefix:40 decides alone"):
        _spec("ring_varlen", 2, "prefix:40", docs=(61, 13, 125, 45), doc_pad=8)
    with pytest.raises(SpecError, match=r"^rfa_llama3_varlen cannot take mask prefix:40, since only ringbench's "
                                        r"own engines cut their blocks by a mask"):
        _spec("rfa_llama3_varlen", 2, "prefix:40")


@pytest.mark.slow  # one CLI call that is refused before launch: about 2 s
def test_documents_mask_cli_refuses_uneven_answers_with_exit_2(tmp_path):
    """The command line refuses answers a document cannot split evenly before anything starts: exit 2, one
    sentence naming the mask, the document and its length."""
    done = ringbench_here("verify", "--device", "cpu", "--kernel", "math", "--variant", "zigzag_varlen",
                          "--docs", "64,32,160", "--mask", "shared-prefix:16,answers=5", "--seqlen", "256",
                          "--world-size", "2", "--out", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    text = " ".join((done.stdout + done.stderr).split())
    assert ("mask shared-prefix:16,answers=5 with --docs applies per document, and document 0 of 64 tokens leaves "
            "48 tokens after its prompt of 16") in text
    assert not (tmp_path / "verify.jsonl").exists()


# --------------------------------------------------------------------------- distributed

VARIANTS = ("ring_varlen", "zigzag_varlen", "llama3_varlen", "ulysses_varlen", "usp_varlen")
MASKS = (("prefix", "prefix:40"), ("chunked", "chunked:24"), ("window", "window:9,4"),
         ("global", "global:4,window:16"), ("shared_prefix", "shared-prefix:16,answers=4"),
         ("file_image", masks.read_file(DATA / "image_in_text.txt")))
WORLD_SIZES = (1, 2, 4)
LAUNCH_TIMEOUT_S = {1: 240, 2: 300, 4: 420}


def _cases(world_size: int) -> list[dict]:
    """Every (mask, variant) pair at world sizes 2 and 4; at 1 each mask once, on variants in turn; the
    not-rebased fixture under prefix:40, empty and one-token documents, llama3_varlen's balanced layout
    (one case a gather of one K/V head at a time) and a bf16 case at each."""
    out = []
    for m, (name, mask) in enumerate(MASKS):
        for v, variant in enumerate(VARIANTS):
            if world_size == 1 and v != m % len(VARIANTS):
                continue
            out.append({"name": f"{name}_{variant}", "spec": _spec(variant, world_size, mask).to_dict()})
    out.append({"name": "prefix_mask_not_rebased", "spec": _spec("mask_not_rebased", world_size, "prefix:40").to_dict()})
    # Empty documents, one-token documents straddling nothing, and bf16.
    out.append({"name": "empty_docs_chunked_zigzag_varlen",
                "spec": _spec("zigzag_varlen", world_size, "chunked:24", docs=(0, 64, 0, 192)).to_dict()})
    out.append({"name": "one_token_docs_prefix_llama3_varlen",
                "spec": _spec("llama3_varlen", world_size, "prefix:40", docs=(1, 1, 97, 1, 156)).to_dict()})
    out.append({"name": "balanced_prefix_llama3_varlen",
                "spec": _spec("llama3_varlen", world_size, "prefix:40", layout="balanced").to_dict()})
    out.append({"name": "balanced_shared_prefix_llama3_varlen",
                "spec": _spec("llama3_varlen", world_size, "shared-prefix:16,answers=4", layout="balanced",
                              heads_k_stride=1).to_dict()})
    out.append({"name": "bf16_global_ring_varlen",
                "spec": _spec("ring_varlen", world_size, "global:4,window:16", dtype="bf16").to_dict()})
    return out


def _batches(world_size: int, with_slow: bool) -> dict:
    """The module's one batch at ``world_size`` for the session's pooled launch (world size 2 is quick)."""
    if world_size not in WORLD_SIZES or not (with_slow or world_size == 2):
        return {}
    return {None: (_cases(world_size), LAUNCH_TIMEOUT_S[world_size])}


pool_verify_batches(__name__, _batches)


@pytest.fixture(scope="module", params=[slow_when(w, w != 2) for w in WORLD_SIZES], ids=lambda w: f"w{w}")
def launch(request, verify_pool) -> dict:
    """The module's view of the session's launch at this world size (``helpers.VerifyPool``)."""
    return verify_pool.get(__name__, request.param, None)


@pytest.mark.dist
def test_documents_mask_verify_passes_on_every_varlen_engine(launch):
    """Every varlen engine passes verify under every family and a slices file with documents (the max rule
    and the block decomposition on every tensor); the not-rebased fixture fails on out and lse."""
    records = launch["records"]
    assert not launch["timed_out"] and set(records) == set(launch["expected"]), launch["log_tail"]
    assert len(records) >= len(MASKS) + 1  # never vacuous
    broken = "prefix_mask_not_rebased"
    for name, rec in records.items():
        if name == broken:
            continue
        assert rec["status"] == "ok" and rec["verdict"] == "ok", (name, rec.get("error") or rec.get("reason"))
        worst = max(c["ratio"] for c in rec["checks"])
        print(f"{name} W={launch['world_size']}: worst ratio {worst:.3f}")
        assert all(c["passed"] and c["shadow_passed"] for c in rec["checks"]), name
    rec = records[broken]
    assert rec["status"] == "ok" and rec["verdict"] == "fail", rec.get("error")
    assert {"out", "lse"} <= {c["tensor"] for c in rec["checks"] if not c["passed"]}
    assert launch["returncode"] == 0, launch["log_tail"]


@pytest.mark.dist
@pytest.mark.slow  # one launch of two ranks through the CLI, about 10 s on two cores
def test_documents_mask_cli_verify_and_records(tmp_path):
    """``ringbench verify --docs ... --mask prefix:P`` as a user runs it: exit 0 for the varlen engines,
    the records carry the mask and the documents, and their predicted pairs sum to the per-document area."""
    done = ringbench_here("verify", "--device", "cpu", "--kernel", "math", "--variant", "ring_varlen",
                          "--variant", "llama3_varlen", "--docs", "96,24,136", "--mask", "prefix:40", "--seqlen", "256",
                          "--world-size", "2", "--heads", "2", "--head-dim", "16", "--out", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    records = read_jsonl(tmp_path / "verify.jsonl")
    assert {r["spec"]["variant"] for r in records} == {"ring_varlen", "llama3_varlen"}
    for r in records:
        assert r["status"] == "ok" and r["spec"]["mask"] == "prefix:40" and r["spec"]["docs"] == "96,24,136"
        assert sum(r["predicted_pairs_per_rank"]) == masks.documents("prefix:40", DOCS).area()
