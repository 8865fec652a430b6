"""Packed documents on the batch engines (issue 26 item 2): ``--docs`` on ring, zigzag, stripe, llama3, ulysses
and usp becomes the mask ``docs:LENGTHS;MASK`` (``masks.packed``): the case's mask (causal by default) inside each
document, every pair of two documents masked, over the engine's own layout of the whole row, so a document may
straddle ranks (zigzag's head-tail over the row, as PyTorch's context-parallel tests balance FlexAttention document
masks). Every row of ``--batch`` packs the same lengths.

Unit tests (no process group): the family's text, rule and slices, the spec rewrite, FLOPs and predicted work, the
refusals. Distributed tests (real torchrun through the CLI, gloo, CPU): one ``verify --scenario`` launch per world
size (1, 2, 4) of every batch engine under causal, ``prefix:16`` and ``chunked:24`` inside documents 96, 64, 96, in
bf16 and fp32, batch 1 and 2; the hidden ``mask_local_only`` fixture (the mask cut only on its own K/V's blocks,
every received block taken as full, so documents leak into each other across ranks) fails at W >= 2.
"""

from __future__ import annotations

import pytest
import torch

from helpers import command_cases, pool_cli_verify, read_jsonl, ringbench_here, scenario_text_cases
from ringbench.case import work
from ringbench.case.spec import CaseSpec, SpecError, default_fields, pack_documents, resolve_docs, resolve_mask
from ringbench.sweep import build
from ringbench.variants.engines import masks
from ringbench.variants.engines.masked import dense_mask

DOCS = (96, 64, 96)
BATCH_ENGINES = ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp")
LAUNCH_TIMEOUT_S = 420


def _spec(variant: str = "zigzag", **fields) -> CaseSpec:
    given = {"task": "verify", **default_fields("cpu", 0), "variant": variant, "kernel": "math", "seqlen": 256,
             "world_size": 2, "docs": ",".join(map(str, DOCS)), **fields}
    return resolve_mask(pack_documents(resolve_docs(CaseSpec.from_dict(given))))


# --------------------------------------------------------------------------- units

@pytest.mark.parametrize("inner", ["causal", "full", "prefix:16", "chunked:24", "shared-prefix:16,answers=4"])
def test_packed_mask_is_the_documents_mask_over_the_batch_row(inner):
    """``docs:..;MASK`` holds exactly ``masks.documents``' pairs, but as a batch row's mask (``Mask.docs`` empty,
    so the engines keep their own layout over the whole row); no pair crosses a document."""
    text = masks.packed(DOCS, inner)
    assert text == f"docs:96,64,96;{masks.parse(inner)}" and masks.parse(text) == text
    built = masks.build(text, sum(DOCS))
    assert built.docs == () and built.seqlen == 256
    per_doc = masks.documents(inner, DOCS)
    assert built.area() == per_doc.area() and built.slices == per_doc.slices
    seen = dense_mask(built)
    doc = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))
    assert not bool((seen & (doc[:, None] != doc[None, :])).any())
    assert masks.plain_fields(text) is None and masks.disguise(text, 256) is None


def test_packed_mask_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match=r"^mask 'docs:96,64' names no mask to apply inside the documents"):
        masks.parse("docs:96,64")
    with pytest.raises(ValueError, match=r"packs documents inside documents"):
        masks.parse("docs:96,64;docs:96,64;causal")
    assert masks.rule(masks.packed(DOCS, "causal"), 200) == (
        "documents 96,64,96 sum to 256 tokens but seqlen is 200; the documents must fill the row exactly, so pass "
        "--seqlen 256 or documents that sum to 200")
    assert "do not split into 5 answers" in masks.rule(masks.packed((64, 64), "shared-prefix:16,answers=5"), 128)
    assert masks.label(masks.packed(DOCS, "prefix:16")) == "prefix:16 in 3 docs"
    from ringbench.present.formatting import cell_text

    assert cell_text("mask", masks.packed(DOCS, "prefix:16")) == "prefix:16 in 3 docs"  # tables: not the lengths


@pytest.mark.parametrize("fields, inner", [({}, "causal"), ({"causal": False}, "full"), ({"window": 16}, "window:16"),
                                           ({"mask": "prefix:16"}, "prefix:16")])
def test_batch_engine_takes_documents_as_its_mask(fields, inner):
    """The spec rewrite: the documents move into the mask (docs and doc_dist emptied, causal false: the mask alone
    decides); --no-causal is full attention inside each document, --window a window inside each."""
    spec = _spec(**fields)
    assert spec.mask == masks.packed(DOCS, inner) and not spec.docs and not spec.doc_dist
    assert spec.causal is False and spec.window == 0
    assert pack_documents(spec) == spec  # idempotent


def test_batch_engine_flops_and_predicted_work_count_the_document_pairs():
    """FLOPs are 4·B·area·H·D over the documents' unmasked pairs; the predicted pairs per rank sum to B·area, on
    zigzag's head-tail over the whole row (a document straddles the ranks)."""
    spec = _spec(mask="prefix:16", batch=2)
    area = masks.documents("prefix:16", DOCS).area()
    flops = work.attention_flops(batch=spec.batch, seqlen=spec.seqlen, heads=spec.heads, head_dim=spec.head_dim,
                                 causal=spec.causal, mode="fwd", mask=spec.mask)
    assert flops == 4 * 2 * area * spec.heads * spec.head_dim
    pairs = work.pairs_per_rank(spec)
    assert sum(pairs) == 2 * area and len(pairs) == 2


def test_doc_dist_is_drawn_into_the_mask():
    spec = _spec(docs="", doc_dist="lognormal:mean=64,sigma=1")
    docs, inner = masks.packed_parts(spec.mask)
    assert sum(docs) == 256 and len(docs) > 1 and inner == "causal" and not spec.doc_dist


def test_packed_documents_refusals_name_the_rule():
    """A kernel with a window takes the document mask by slices; --doc-pad and the peers keep their refusals; a
    varlen engine with --batch 2 says to use a batch engine with --docs."""
    base = {"device": "cpu", "docs": "96,64,96", "seqlen": 256, "world_size": [2]}
    [case], _ = build.cases_for("verify", {**base, "variant": ["zigzag"], "kernel": "cpu"})  # by slices
    assert case.kernel == "cpu" and case.mask == "docs:96,64,96;causal"
    with pytest.raises(SpecError, match=r"^zigzag is a batch variant and takes no documents padded by --doc-pad 8 "):
        build.cases_for("verify", {**base, "variant": ["zigzag"], "docs": "90,60,90", "doc_pad": 8})
    with pytest.raises(SpecError, match=r"^docs '96,64,96' is given, but rfa_zigzag is a batch variant and takes "
                                        r"no documents; use ring, zigzag, stripe, llama3, "):
        build.cases_for("verify", {**base, "variant": ["rfa_zigzag"]})
    with pytest.raises(SpecError, match=r"^batch 2 is not 1, but zigzag_varlen packs the documents into one row; pass "
                                        r"--batch 1, or use a batch variant \(ring, zigzag, stripe, llama3, ulysses or "
                                        r"usp\) with --docs, which packs the same documents into every row"):
        build.cases_for("verify", {**base, "variant": ["zigzag_varlen"], "batch": 2})
    with pytest.raises(SpecError, match=r"^mask shared-prefix:16,answers=5 with --docs applies per document, and "
                                        r"document 0 of 64 tokens leaves 48 tokens"):
        build.cases_for("verify", {**base, "variant": ["zigzag"], "docs": "64,64,128",
                                   "mask": ["shared-prefix:16,answers=5"]})
    # A prompt longer than a document (or the row) is full attention inside it, as on the varlen engines.
    [case], _ = build.cases_for("verify", {**base, "variant": ["zigzag"], "mask": ["prefix:300"]})
    assert case.mask == "docs:96,64,96;prefix:300"
    [case], _ = build.cases_for("verify", {**base, "variant": ["ring"], "layout": "balanced"})
    assert case.layout == "balanced" and case.mask == "docs:96,64,96;causal"
    cases, _ = build.cases_for("verify", {**base, "variant": list(BATCH_ENGINES), "batch": 2})
    assert [c.mask for c in cases] == [masks.packed(DOCS, "causal")] * len(BATCH_ENGINES)


# --------------------------------------------------------------------------- distributed, through the CLI

SCENARIO = """
[defaults]
device = "cpu"
kernel = "{kernel}"
dtype = "{dtype}"
docs = "96,64,96"
seqlen = 256
heads = 4
kv_heads = 2
head_dim = 16
world_size = {world_size}
[sweep]
variant = [{variants}]
mask = ["causal", "prefix:16", "chunked:24"]
batch = [1, 2]
"""
#: Kernel and dtype per world size: the math kernel's dense blocks in both dtypes, the cpu kernel's window
#: calls (one per slice) at W=4. The whole grid (both dtypes at every world size) passed when this was built.
AT = {2: ("math", "fp32"), 4: ("cpu", "bf16")}


def _packed_names(world_size: int) -> list[str]:
    return [*BATCH_ENGINES, *(["mask_local_only"] if world_size >= 2 else [])]


def _packed_cases(world_size: int) -> list:
    kernel, dtype = AT[world_size]
    return scenario_text_cases(SCENARIO.format(world_size=world_size, kernel=kernel, dtype=dtype,
                                               variants=", ".join(f'"{n}"' for n in _packed_names(world_size))))


# The session's pooled verify command with failing cases of each world size runs them (helpers.CliVerifyPool).
pool_cli_verify(__name__, lambda world_size: _packed_cases(world_size) if world_size in AT else [], exit_code=1)


@pytest.mark.dist
@pytest.mark.slow  # a share of the session's pooled launch of W ranks through the CLI: 36 cases (42 at W >= 2)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"w{w}")  # W=1: the quick in-process tests
def test_batch_engines_verify_packed_documents_and_the_local_only_mask_fails(world_size, cli_verify_pool):
    """Every batch engine passes verify (the max rule and the block decomposition on every tensor) with documents
    that straddle ranks, alone and under a mask inside each, batch 1 and 2, in a dtype and kernel per world
    size (:data:`AT`); the locally-masked fixture fails on out at every world size from 2 (exit 1)."""
    names = _packed_names(world_size)
    kernel = AT[world_size][0]
    got = cli_verify_pool.get(__name__, world_size)
    done, records = got["result"], got["records"]
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(records) == len(names) * 6 and {r["kernel"] for r in records} == {kernel}  # never vacuous
    by_name = {f"{r['spec']['variant']}/{r['spec']['mask']}/B{r['spec']['batch']}": r
               for r in records}
    failed = {n: r.get("reason") for n, r in by_name.items()
              if r["status"] != "ok" and not n.startswith("mask_local_only/")}
    assert not failed, failed
    for name, r in by_name.items():
        assert r["spec"]["mask"].startswith("docs:96,64,96;") and not r["spec"]["docs"], name
        inner = masks.packed_parts(r["spec"]["mask"])[1]
        area = masks.documents(inner, DOCS).area()
        if name.startswith("mask_local_only/"):
            assert r["status"] == "fail" and "out" in {c["tensor"] for c in r["checks"] if not c["passed"]}, name
        else:
            assert sum(r["predicted_pairs_per_rank"]) == r["spec"]["batch"] * area, name
            print(f"{name} W={world_size}: worst ratio {max(c['ratio'] for c in r['checks']):.3f}")
            assert all(c["passed"] and c["shadow_passed"] for c in r["checks"]), name


@pytest.mark.dist
@pytest.mark.slow  # one launch of two ranks through the CLI, and a refusal in process
def test_the_issues_commands_now_run(tmp_path):
    """The two commands of issue 26 item 2: zigzag over the whole packed row passes; zigzag_varlen with --batch 2
    is refused before launch (exit 2) with the batch engine as the fix."""
    done = ringbench_here("verify", "--device", "cpu", "--kernel", "math", "--variant", "zigzag", "--docs", "96,64,96",
                          "--seqlen", "256", "--world-size", "2", "--out", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    [record] = read_jsonl(tmp_path / "verify.jsonl")
    assert record["status"] == "ok" and record["spec"]["mask"] == "docs:96,64,96;causal"
    done = ringbench_here("verify", "--device", "cpu", "--kernel", "math", "--variant", "zigzag_varlen", "--batch",
                          "2", "--docs", "96,64,96", "--seqlen", "256", "--world-size", "2", "--out", str(tmp_path),
                          cwd=tmp_path)  # refused before launch: the command line in this process
    assert done.returncode == 2 and "use a batch variant" in done.stderr, done.stdout + done.stderr


def _composed_cases() -> list:
    """The two verify commands' cases, as the command line builds them."""
    common = {"device": "cpu", "kernel": "math", "docs": "96,64,96", "seqlen": 256, "world_size": [4], "head_dim": 16}
    return command_cases("verify", {**common, "variant": ["zigzag", "usp"], "mask": "prefix:16", "sink": "learnable",
                                    "bias": "1hss", "heads": 4}) + \
        command_cases("verify", {**common, "variant": ["ring"], "layout": "balanced", "heads": 2})


# The session's pooled verify command of world size 4 runs them (helpers.CliVerifyPool).
pool_cli_verify(f"{__name__}:compose", lambda world_size: _composed_cases() if world_size == 4 else [])


@pytest.mark.dist
@pytest.mark.slow  # a share of the session's pooled launch of four ranks through the CLI
def test_packed_documents_compose_with_a_sink_a_bias_and_ring_balanced(cli_verify_pool):
    """The document mask composes as any mask does: a learnable sink (dsink checked) and a learnable bias (dbias
    checked) on zigzag and usp, and ring's mask planner over the whole row."""
    got = cli_verify_pool.get(f"{__name__}:compose", 4)
    assert got["result"].returncode == 0, got["result"].stdout[-3000:] + got["result"].stderr[-3000:]
    records = got["records"]
    assert len(records) == 3 and all(r["status"] == "ok" for r in records)
    checked = {c["tensor"] for r in records[:2] for c in r["checks"]}
    assert {"dsink", "dbias"} <= checked, checked
    assert records[2]["spec"]["layout"] == "balanced" and records[2]["spec"]["mask"] == "docs:96,64,96;causal"
