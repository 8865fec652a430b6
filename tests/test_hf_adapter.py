"""The Hugging Face adapter without a process group: sharding helpers, set-up errors, the
whole-sequence attention against transformers' own, and verify --model's refusals; with a
world-size-1 group, its CUDA graphs: the eager fallback on CPU, graphed against eager on CUDA."""

from __future__ import annotations

import copy
import re
import sys
import warnings

import pytest
import torch
from typer.testing import CliRunner

from ringbench.adapters import cp
from ringbench.adapters.graphed import GraphedCalls
from ringbench.cli import app
from ringbench.variants.engines import layouts

transformers = pytest.importorskip("transformers")
from ringbench.adapters import hf  # noqa: E402  (needs transformers)

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_shard_batch_cuts_ids_positions_and_labels_as_the_layout(world_size=4, seqlen=48):
    ids = torch.randint(1000, (2, seqlen))
    for variant in ("zigzag", "stripe", "ring"):
        parts = [cp.shard_batch(ids, variant=variant, rank=r, world_size=world_size, labels=ids)
                 for r in range(world_size)]
        layout = {"zigzag": "zigzag", "stripe": "stripe", "ring": "contiguous"}[variant]
        for r, part in enumerate(parts):
            index = layouts.token_index(layout, seqlen, r, world_size)
            assert torch.equal(part.position_ids[0], index)
            assert torch.equal(part.input_ids, ids[:, index])
            assert part.cu_seqlens is None and set(part.model_inputs()) == {"input_ids", "position_ids"}
        # Labels are shifted before the cut: put back together, they are the whole row's next tokens.
        labels = layouts.unshard([p.labels for p in parts], layout)
        assert torch.equal(labels[:, :-1], ids[:, 1:]) and (labels[:, -1] == cp.IGNORE_INDEX).all()


def test_shard_batch_packed_positions_restart_and_documents_do_not_predict_each_other():
    docs, world_size = [8, 24, 0, 16], 2
    ids = torch.randint(1000, (1, sum(docs)))
    cu = layouts.cu_seqlens_from_docs(docs)
    for variant, by_document in (("zigzag_varlen", True), ("llama3_varlen", False)):
        parts = [cp.shard_batch(ids, variant=variant, rank=r, world_size=world_size, labels=ids, cu_seqlens=cu)
                 for r in range(world_size)]
        layout = "zigzag" if by_document else "contiguous"
        whole = {name: layouts.unshard_varlen([getattr(p, name) for p in parts], cu, layout, by_document=by_document)
                 for name in ("input_ids", "position_ids", "labels")}
        assert torch.equal(whole["input_ids"], ids)
        assert whole["position_ids"][0].tolist() == [i for n in docs for i in range(n)]
        ends = [7, 31, 47]  # the last token of each non-empty document
        assert (whole["labels"][0, ends] == cp.IGNORE_INDEX).all()
        keep = [t for t in range(47) if t not in ends]
        assert torch.equal(whole["labels"][0, keep], ids[0, [t + 1 for t in keep]])
        assert torch.equal(parts[1].model_inputs()["cu_seq_lens_q"], cu)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(variant="nope"), r"^variant 'nope' is unknown; choose one of "),
    (dict(variant="zigzag", world_size=5), r"^seqlen 48 is not a multiple of 2 \* world_size = 10, which zigzag needs"),
    (dict(variant="zigzag", cu_seqlens=[0, 16, 48]),
     r"^zigzag is a batch variant and takes no documents; use a varlen variant or drop the documents$"),
    (dict(variant="zigzag_varlen"), r"^zigzag_varlen attends packed documents, but no cu_seqlens was given"),
    (dict(variant="zigzag_varlen", cu_seqlens=[0, 10, 48]),
     r"^document 1 has 10 tokens, not a multiple of 2 \* world_size = 4, which zigzag_varlen needs"),
    (dict(variant="llama3_varlen", cu_seqlens=[0, 16, 40]),
     r"^cu_seqlens \[0, 16, 40\] are not document offsets of a row of 48 tokens"),
    (dict(variant="llama3_varlen", cu_seqlens=[0, 16, 48], batch=2), r"^batch 2 is not 1, but llama3_varlen packs"),
    (dict(variant="zigzag", rank=2), r"^rank 2 is not in the group of world_size 2; pass a rank from 0 to 1$"),
])
def test_shard_batch_refuses_what_cannot_be_right(kwargs, pattern):
    batch = kwargs.pop("batch", 1)
    kwargs.setdefault("world_size", 2)
    kwargs.setdefault("rank", 0)
    with pytest.raises(ValueError, match=pattern):
        cp.shard_batch(torch.zeros(batch, 48, dtype=torch.long), **kwargs)


def test_register_names_the_implementation_and_refuses_bad_setups():
    assert hf.register("zigzag", kernel="cpu") == "ringbench_zigzag"
    assert "ringbench_zigzag" in transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
    if hasattr(transformers, "AttentionMaskInterface"):
        assert "ringbench_zigzag" in transformers.AttentionMaskInterface._global_mapping
    with pytest.raises(ValueError, match=r"^variant 'nope' is unknown"):
        hf.register("nope")
    with pytest.raises(ValueError, match=r"^kernel 'fast' is unknown"):
        hf.register("zigzag", kernel="fast")
    with pytest.raises(ValueError, match=r"^option 'heads_k_stride' is not one zigzag takes"):
        hf.register("zigzag", heads_k_stride=2)
    with pytest.raises(ValueError, match=r"^torch_cp needs its own context held around the whole training step"):
        hf.register("torch_cp")
    with pytest.raises(ValueError, match=r"^window 10 is not an option of register, since each layer brings its own "
                                         r"window \(the sliding_window transformers passes it"):
        hf.register("zigzag", window=10)
    # A name holding "flash" would send transformers looking for a FlashAttention build.
    assert hf.register_single("torch-flash") == "ringbench_single_torch-fa"
    _tiny(hf.register_single("torch-flash"))  # a model switches to it


def _tiny(attn: str):
    from ringbench.case.models import load_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**load_model("llama-tiny").config)).double()
    hf.use_attention(model, attn)
    return model


def test_single_attention_matches_transformers_sdpa_batch_and_packed():
    ids = torch.randint(256, (1, 96))
    ref, ours = _tiny("sdpa"), _tiny(hf.register_single("math"))
    ref(ids).logits.sum().backward()
    ours(ids).logits.sum().backward()
    assert torch.allclose(ours(ids).logits, ref(ids).logits, atol=1e-10)
    for (_, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-9)
    # Two packed documents give what each gives alone.
    cu = torch.tensor([0, 40, 96], dtype=torch.int32)
    positions = torch.cat([torch.arange(40), torch.arange(56)]).unsqueeze(0)
    packed = ours(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits
    assert torch.allclose(packed[:, 40:], ref(ids[:, 40:]).logits, atol=1e-10)


def _shipped(name: str, dtype=torch.float64):
    from ringbench.rank.model_check import build

    return build(name, 0).to(dtype)


def _loss_and_grads(base, attn: str, ids) -> tuple[torch.Tensor, dict]:
    import copy

    model = copy.deepcopy(base)
    hf.use_attention(model, attn)
    logits = model(ids).logits
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow  # transformers' Qwen2 and gpt-oss classes take some 10 s to import here
@pytest.mark.parametrize("name, theirs", [("qwen2-tiny", "sdpa"), ("gpt-oss-tiny", "eager")])
def test_single_and_reference_attention_match_transformers_under_windows_and_sinks(name, theirs):
    """Each layer's sliding window and gpt-oss's sinks mean what transformers means by them:
    the model check's float64 reference and single-device attention give transformers' own
    logits and gradients (its eager attention for gpt-oss, whose softmax takes the sinks; sdpa
    for Qwen2, whose eager softmax runs in float32)."""
    base = _shipped(name)
    ids = torch.randint(256, (1, 96), generator=torch.Generator().manual_seed(0))  # past the 40-key window
    want, want_grads = _loss_and_grads(base, theirs, ids)
    for attn in (hf.register_reference(), hf.register_single("cpu")):
        got, grads = _loss_and_grads(base, attn, ids)
        assert torch.allclose(got, want, rtol=0, atol=1e-10), (attn, float((got - want).abs().max()))
        for n, g in grads.items():
            assert torch.allclose(g, want_grads[n], rtol=0, atol=1e-9), (attn, n, float((g - want_grads[n]).abs().max()))
    sinks = [g for n, g in want_grads.items() if n.endswith("sinks")]
    assert len(sinks) == (2 if name == "gpt-oss-tiny" else 0) and all(bool(g.abs().min() > 0) for g in sinks)
    # The window bites: the same weights with every layer full give other logits.
    full = _shipped(name)
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    assert not torch.allclose(_loss_and_grads(full, hf.register_reference(), ids)[0], want, atol=1e-3)


@pytest.mark.slow  # transformers' Qwen2 and gpt-oss classes take some 10 s to import here
def test_shipped_models_match_what_transformers_builds():
    """What ringbench reads from a model file without transformers (each layer's window, the
    sinks, the parameter count behind the estimate) is what transformers builds from it."""
    from ringbench.case.models import list_models, load_model
    from ringbench.rank.model_check import build

    windowed = sinks = 0
    for name in list_models():
        spec = load_model(name)
        with torch.device("meta"):  # no memory: llama-small is 0.3 B parameters
            model = build(name, 0)
        layers = model.model.layers
        assert [getattr(l.self_attn, "sliding_window", None) or 0 for l in layers] == list(spec.layer_windows), name
        assert all(hasattr(l.self_attn, "sinks") == (spec.sink == "learnable") for l in layers), name
        assert sum(p.numel() for p in model.parameters()) == spec.parameter_count(), name
        windowed += spec.window > 0
        sinks += spec.sink == "learnable"
    assert windowed >= 2 and sinks >= 1  # qwen2-tiny, gpt-oss-tiny: not vacuous


@pytest.mark.slow  # transformers' Qwen2 and gpt-oss classes take some 10 s to import here
def test_a_layers_window_or_sinks_reach_only_a_variant_that_takes_them():
    """A layer's window or sinks given to a variant without them is refused at the call, before
    any communication, not dropped (test-only variants: sink_every_block takes a sink but no
    window, band_one_row a window but no sink; gpt-oss-tiny's first layer has both)."""
    ids = torch.randint(256, (1, 64))
    gpt_oss = _shipped("gpt-oss-tiny", torch.float32)
    hf.use_attention(gpt_oss, hf.register("sink_every_block", kernel="cpu"))
    with pytest.raises(ValueError, match=r"^this layer has a sliding window of 40 keys, which sink_every_block cannot "
                                         r"take; register ring, zigzag, .* or usp_varlen$"):
        gpt_oss(ids)
    hf.use_attention(gpt_oss, hf.register("band_one_row", kernel="cpu"))
    with pytest.raises(ValueError, match=r"^this layer has attention sinks \(s_aux\), which band_one_row cannot take; "
                                         r"register ring, zigzag, .* or usp_varlen$"):
        gpt_oss(ids)


def _graphs(name: str):
    return transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[name].graphs


def test_register_cuda_graph_takes_a_bool_and_no_varlen_variant():
    graphed = _graphs(hf.register("zigzag", kernel="cpu", cuda_graph=True))
    assert isinstance(graphed, GraphedCalls) and graphed.captured == 0 and graphed.reasons == []
    assert _graphs(hf.register("zigzag", kernel="cpu")) is None  # off by default
    with pytest.raises(ValueError, match=r"^cuda_graph 'on' is not True or False; pass cuda_graph=True to replay each "
                                         r"layer's attention from CUDA graphs, or leave it out$"):
        hf.register("zigzag", cuda_graph="on")
    with pytest.raises(ValueError, match=r"^cuda_graph=True does not go with zigzag_varlen: a graph fixes the "
                                         r"documents of the batch it captured"):
        hf.register("zigzag_varlen", cuda_graph=True)


def test_graphed_calls_run_eagerly_off_cuda_and_say_why_once():
    calls, layer = GraphedCalls("ringbench_zigzag"), torch.nn.Linear(1, 1)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)

    def fn(t):
        return (3 * t).sin()

    with pytest.warns(RuntimeWarning, match=r"^ringbench_zigzag runs its attention eagerly: cpu has no CUDA graphs$"):
        out = calls(layer, "shape", fn, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reason is told once
        again = calls(layer, "shape", fn, x)
    out.sum().backward()
    assert torch.equal(out, fn(x)) and torch.equal(again, out) and torch.equal(x.grad, 3 * (3 * x.detach()).cos())
    assert calls.reasons == ["cpu has no CUDA graphs"] and calls.captured == 0
    # Without a backward to replay (evaluation), the call is plain eager, and no fallback.
    quiet = GraphedCalls("ringbench_zigzag")
    with torch.no_grad():
        assert torch.equal(quiet(layer, "shape", fn, x), fn(x.detach()))
    assert quiet.reasons == []


def _with_attention(base, attn: str):
    model = copy.deepcopy(base)
    hf.use_attention(model, attn)
    return model


def _train_steps(model, batches) -> list[tuple[torch.Tensor, dict]]:
    """Logits and parameter grads of ``model`` stepping through ``batches`` (the same layers
    every step, as a training loop has them, so graphs made in the first step replay after)."""
    steps = []
    for ids in batches:
        model.zero_grad(set_to_none=True)
        logits = model(ids).logits
        logits.float().pow(2).mean().backward()
        steps.append((logits.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return steps


@pytest.mark.dist
def test_graphed_registration_on_cpu_is_the_eager_model(solo_group):
    base = _shipped("llama-tiny")
    batches = [torch.randint(256, (1, 32), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    want = _train_steps(_with_attention(base, hf.register("zigzag", kernel="cpu")), batches)
    graphed = _with_attention(base, hf.register("zigzag", kernel="cpu", cuda_graph=True))
    with pytest.warns(RuntimeWarning, match=r"ringbench_zigzag runs its attention eagerly: cpu has no CUDA graphs"):
        got = _train_steps(graphed, batches)
    for (logits, grads), (want_logits, want_grads) in zip(got, want):
        assert torch.equal(logits, want_logits)
        assert grads.keys() == want_grads.keys() and all(torch.equal(grads[n], want_grads[n]) for n in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("name, kernel, dtype, tol", [("llama-tiny", "torch-flash", torch.bfloat16, 2e-2),
                                                      ("gpt-oss-tiny", "math", torch.float32, 1e-5)])
def test_graphed_attention_gives_eager_logits_and_grads_on_cuda(solo_group, name, kernel, dtype, tol):
    """Two training steps on other tokens: the first captures each layer's graphs, the second
    replays them; both match the eager model (within ``tol`` of each tensor's largest value:
    torch-flash's backward adds dq with atomics, so eager differs from itself too)."""
    from ringbench.case.models import architecture_refusal

    if architecture_refusal(name):
        pytest.skip(architecture_refusal(name))
    base = _shipped(name, dtype).cuda()
    batches = [torch.randint(256, (1, 128), generator=torch.Generator().manual_seed(s)).cuda() for s in (0, 1)]
    want = _train_steps(_with_attention(base, hf.register("zigzag", kernel=kernel)), batches)
    name_graphed = hf.register("zigzag", kernel=kernel, cuda_graph=True)
    model = _with_attention(base, name_graphed)  # held: a layer's graphs live as long as it does
    got = _train_steps(model, batches)
    # Every layer replays (a fallback to eager would list its reason).
    assert _graphs(name_graphed).reasons == [] and _graphs(name_graphed).captured == len(model.model.layers)

    def close(a, b):
        return float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max())

    for (logits, grads), (want_logits, want_grads) in zip(got, want):
        assert close(logits, want_logits)
        bad = [n for n in want_grads if not close(grads[n], want_grads[n])]
        assert not bad, bad


def test_padding_mask_is_refused_not_ignored():
    model = _tiny(hf.register_single("math"))
    mask = torch.ones(1, 32, dtype=torch.long)
    mask[0, :4] = 0
    with pytest.raises(ValueError, match=r"^attention_mask has padding"):
        model(torch.randint(256, (1, 32)), attention_mask=mask)


@pytest.mark.parametrize("args, pattern", [
    (["--model", "nope"], r"^model 'nope' is unknown; pass --model with one of gpt-oss-tiny, llama-small, llama-tiny, "
                          r"qwen2-tiny$"),
    (["--model", "llama-tiny", "--world-size", "3"], r"^world_size 3 does not fit model llama-tiny: its 256 tokens"),
    (["--model", "llama-tiny", "--variant", "zigzag", "--docs", "56,200"],
     r"^docs '56,200' does not go with --model llama-tiny on zigzag"),
    (["--model", "llama-tiny", "--docs", "56,100"], r"^docs '56,100' sum to 156 tokens, but model llama-tiny has 256"),
    (["--model", "llama-tiny", "--scenario", "smoke"], r"^--scenario 'smoke' does not go with --model"),
    (["--model", "llama-tiny", "--seqlen", "512"], r"^--seqlen does not go with --model llama-tiny, which fixes seqlen "
                                                   r"at 256; drop --seqlen$"),
    (["--model", "llama-tiny", "--heads", "8"], r"^--heads does not go with --model llama-tiny, which fixes heads"),
    # The model's config gives each layer its window and sinks (issue 27: --window 10 ran, and
    # both ranks failed on an option the adapter then refused).
    (["--model", "llama-tiny", "--window", "10"], r"^--window does not go with --model llama-tiny, which has no sliding "
                                                 r"window; drop --window$"),
    (["--model", "qwen2-tiny", "--window", "40"], r"^--window does not go with --model qwen2-tiny, which has a sliding "
                                                 r"window of 40 keys on layer 2 of 2 from its config; drop --window$"),
    (["--model", "llama-tiny", "--sink", "learnable"], r"^--sink does not go with --model llama-tiny, which has no "
                                                       r"attention sink; drop --sink$"),
    (["--model", "gpt-oss-tiny", "--sink", "none"], r"^--sink does not go with --model gpt-oss-tiny, whose attention "
                                                    r"layers have their own learnable sinks; drop --sink$"),
    (["--model", "llama-tiny", "--docs", "128,128", "--doc-pad", "64"],
     r"^--doc-pad 64 does not go with --model llama-tiny: the model check feeds the documents of --docs to the model "
     r"unpadded, as a training step packs them; drop --doc-pad, or check padded attention alone without --model$"),
    (["--model", "qwen2-tiny", "--variant", "sink_every_block"],
     r"^sink_every_block cannot take what model qwen2-tiny's attention layers need \(a sliding window of 40 keys on "
     r"layer 2 of 2\); use ring, zigzag, .* or usp_varlen, or a model without them such as llama-tiny$"),
    (["--model", "gpt-oss-tiny", "--variant", "band_one_row"],
     r"^band_one_row cannot take what model gpt-oss-tiny's attention layers need \(a learnable sink per query head\); "
     r"use ring, zigzag, .* or usp_varlen, or a model without them such as llama-tiny$"),
    (["--model", "gpt-oss-tiny", "--variant", "yc_ulysses"],
     r"^yc_ulysses cannot be checked with --model: it needs its own context held around the whole training step "
     r"\(forward and backward\), which the Hugging Face adapter does not hold; check its attention without --model$"),
    (["--model", "qwen2-tiny", "--variant", "ulysses", "--world-size", "4"],
     r"^world_size 4 does not fit model qwen2-tiny: ulysses runs Ulysses over every rank, which needs a world size "
     r"that divides its 6 query heads and divides its 2 K/V heads or is a multiple of them; pass --world-size 2$"),
])
def test_verify_model_refuses_bad_input_with_exit_2(args, pattern):
    result = runner.invoke(app, ["verify", *args])
    assert result.exit_code == 2, result.output
    assert re.search(pattern, result.output.strip()), result.output
    assert len(result.output.strip().splitlines()) == 1


def test_verify_model_refuses_an_architecture_the_installed_transformers_lacks(monkeypatch):
    from ringbench.case import models

    monkeypatch.setattr(models.importlib.metadata, "version", lambda name: "4.50.0")
    assert models.architecture_refusal("gpt-oss-tiny") == (
        "model gpt-oss-tiny is a gpt_oss model, which transformers builds from release 4.55 on, but 4.50.0 is "
        "installed; upgrade it with pip install -U 'transformers>=4.55'")
    assert models.architecture_refusal("qwen2-tiny") is None


def test_verify_model_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    result = runner.invoke(app, ["verify", "--model", "llama-tiny"])
    assert result.exit_code == 2
    assert "pip install -e '.[hf]' from the root of the ringbench checkout" in result.output
    assert "ringbench[hf]" not in result.output  # not on an index: one hint, the checkout's
