"""Case specs, size parsing, validation and scenario files: fast, no process group."""

from __future__ import annotations

import re
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringbench.case.scenarios import builtin_names, load_scenario, parse_scenario
from ringbench.case.spec import (MAX_SEQLEN, CaseSpec, SpecError, default_fields, detect_device, field_names,
                                 format_size, parse_size, resolve, validate)
from ringbench.variants.kernels import KERNELS
from ringbench.variants import get_variant, list_variants


def make(**changes) -> CaseSpec:
    """A valid CPU verify case with ``changes`` applied."""
    fields = {"task": "verify", "variant": "ring", **default_fields("cpu", 0), "kernel": "cpu"}
    fields.update(changes)
    return CaseSpec(**fields)


def cuda_case(**changes) -> CaseSpec:
    """A valid cuda case for the torch-flash kernel with ``changes`` applied."""
    fields = {"task": "run", "variant": "ring", **default_fields("cuda", 2), "kernel": "torch-flash"}
    fields.update(changes)
    return CaseSpec(**fields)


# --------------------------------------------------------------------------- parse_size

@given(st.integers(min_value=1, max_value=MAX_SEQLEN))
def test_parse_size_plain_int_round_trips(n):
    assert parse_size(str(n)) == n


@given(st.integers(min_value=1, max_value=MAX_SEQLEN // 1024), st.sampled_from(["k", "K"]))
def test_parse_size_k_suffix_is_1024(n, suffix):
    assert parse_size(f"{n}{suffix}") == n * 1024


@given(st.integers(min_value=1, max_value=MAX_SEQLEN // 1024**2), st.sampled_from(["M", "m"]))
def test_parse_size_m_suffix_is_1024_squared(n, suffix):
    assert parse_size(f"{n}{suffix}") == n * 1024**2


@given(st.integers(min_value=1, max_value=MAX_SEQLEN))
def test_format_size_round_trips_through_parse_size(n):
    assert parse_size(format_size(n)) == n


def test_parse_size_examples():
    assert (parse_size("4096"), parse_size("128k"), parse_size("128K"), parse_size("1M"), parse_size("1m"),
            parse_size("1.5k"), parse_size(" 8k ")) == (4096, 131072, 131072, 1048576, 1048576, 1536, 8192)


@pytest.mark.parametrize("text, pattern", [
    ("12q", r"^seqlen '12q' is not a size; use a whole number with an optional k or M suffix, such as 4096 or 128k$"),
    ("", r"seqlen '' is not a size"),
    ("k", r"seqlen 'k' is not a size"),
    ("1e3", r"seqlen '1e3' is not a size"),
    ("4 096", r"seqlen '4 096' is not a size"),
    ("-5", r"seqlen '-5' must be positive"),
    ("-1k", r"seqlen '-1k' must be positive"),
    ("0", r"seqlen '0' must be positive"),
    ("0k", r"seqlen '0k' must be positive"),
    ("0.3k", r"seqlen '0.3k' is 307.2 tokens, not a whole number"),
    ("10.5", r"seqlen '10.5' is 10.5 tokens, not a whole number"),
    ("1025M", r"seqlen '1025M' is 1074790400 tokens, above the limit of 1073741824"),
])
def test_parse_size_refuses_bad_forms(text, pattern):
    with pytest.raises(SpecError, match=pattern):
        parse_size(text)


# --------------------------------------------------------------------------- CaseSpec

def test_casespec_dict_round_trips():
    spec = make(seqlen=520, causal=False, dtype="bf16")
    data = spec.to_dict()
    assert list(data) == list(field_names())
    assert CaseSpec.from_dict(data) == spec


def test_casespec_from_dict_accepts_size_string():
    assert CaseSpec.from_dict({**make().to_dict(), "seqlen": "2k"}).seqlen == 2048


@pytest.mark.parametrize("change, pattern", [
    ({"colour": "red"}, r"field 'colour' is not a case field"),
    ({"heads": "4"}, r"heads '4' is a str, but heads must be an integer"),
    ({"heads": True}, r"heads True is a bool, but heads must be an integer"),
    ({"causal": 1}, r"causal 1 is an int, but causal must be true or false"),
])
def test_casespec_from_dict_refuses_bad_fields(change, pattern):
    with pytest.raises(SpecError, match=pattern):
        CaseSpec.from_dict({**make().to_dict(), **change})


def test_casespec_from_dict_refuses_missing_field():
    data = make().to_dict()
    del data["mode"]
    with pytest.raises(SpecError, match=r"field 'mode' is missing"):
        CaseSpec.from_dict(data)


def test_case_id_ignores_iters_warmup_seed():
    spec = make()
    assert re.fullmatch(r"[0-9a-f]{12}", spec.case_id())
    assert spec.replace(iters=99, warmup=0, seed=7).case_id() == spec.case_id()
    assert spec.replace(seqlen=spec.seqlen + 8).case_id() != spec.case_id()
    assert spec.replace(task="run").case_id() != spec.case_id()


def test_case_id_is_stable_across_processes():
    # A fixed value: the hash must not depend on dict order, hash seeds or the process.
    spec = CaseSpec("verify", "ring", "cpu", "cpu", 2, 1, 520, 4, 2, 32, "fp32", True, "fwd_bwd", 3, 1, 0)
    assert spec.case_id() == "eaf58dd5c290"


def test_default_fields_follow_device():
    cpu, cuda = default_fields("cpu", 0), default_fields("cuda", 8)
    assert (cpu["world_size"], cpu["heads"], cpu["kv_heads"], cpu["head_dim"], cpu["dtype"], cpu["seqlen"],
            cpu["iters"], cpu["warmup"]) == (2, 4, 2, 32, "fp32", 4096, 10, 3)
    assert (cuda["world_size"], cuda["heads"], cuda["kv_heads"], cuda["head_dim"], cuda["dtype"],
            cuda["seqlen"], cuda["iters"], cuda["warmup"]) == (8, 32, 8, 128, "bf16", 16384, 20, 5)
    for d in (cpu, cuda):
        assert (d["batch"], d["causal"], d["mode"], d["kernel"], d["seed"]) == (1, True, "fwd_bwd", "auto", 0)
    assert set(cpu) == set(field_names()) - {"task", "variant"}


# --------------------------------------------------------------------------- validate

def test_validate_accepts_defaults():
    validate(make(), visible_gpus=0)
    validate(cuda_case(), visible_gpus=2)


@pytest.mark.parametrize("variant, seqlen", [("zigzag", 2999), ("zigzag", 3004)])
def test_validate_refuses_zigzag_seqlen_not_multiple_of_2w(variant, seqlen):
    pattern = (rf"^seqlen {seqlen} is not a multiple of 2 \* world_size = 8, which zigzag needs; "
               rf"use {(seqlen // 8 + 1) * 8}$")
    with pytest.raises(SpecError, match=pattern):
        validate(make(variant=variant, seqlen=seqlen, world_size=4), visible_gpus=0)


def test_validate_refuses_ring_seqlen_not_multiple_of_w():
    with pytest.raises(SpecError, match=r"seqlen 2999 is not a multiple of world_size = 4, which ring needs; use 3000"):
        validate(make(variant="ring", seqlen=2999, world_size=4), visible_gpus=0)


@pytest.mark.parametrize("variant, seqlen", [("ring", 3004), ("ring", 3000), ("zigzag", 3000),
                                             ("ring", 3008), ("zigzag", 3008)])
def test_validate_accepts_seqlen_the_layout_divides(variant, seqlen):
    validate(make(variant=variant, seqlen=seqlen, world_size=4), visible_gpus=0)


@pytest.mark.parametrize("change, pattern", [
    ({"variant": "nope"}, r"^variant 'nope' is unknown; choose one of " + re.escape(", ".join(list_variants())) + "$"),
    ({"kernel": "nope"}, r"^kernel 'nope' is unknown; choose one of " + re.escape(", ".join(KERNELS)) + " or auto$"),
    ({"heads": 6, "kv_heads": 4}, r"^heads 6 is not a multiple of kv_heads 4; pass --kv-heads with a divisor of 6, "
                                  r"such as 3$"),
    ({"world_size": 0}, r"^world_size 0 must be positive; pass --world-size 1 or more$"),
    ({"batch": 0}, r"^batch 0 must be positive; pass --batch 1 or more$"),
    ({"heads": -1}, r"^heads -1 must be positive"),
    ({"head_dim": 0}, r"^head_dim 0 must be positive"),
    ({"iters": 0}, r"^iters 0 must be positive; pass --iters 1 or more$"),
    ({"warmup": -1}, r"^warmup -1 must be zero or more; pass --warmup 0 or more$"),
    ({"seed": -3}, r"^seed -3 must be zero or more"),
    ({"dtype": "fp8"}, r"^dtype 'fp8' is unknown; pass --dtype with one of bf16, fp16, fp32, fp64$"),
    ({"mode": "bwd"}, r"^mode 'bwd' is unknown; pass --mode with one of fwd, fwd_bwd$"),
    ({"device": "tpu"}, r"^device 'tpu' is unknown; pass --device with one of cuda, cpu$"),
    ({"task": "bench"}, r"^task 'bench' is unknown"),
    ({"seqlen": MAX_SEQLEN * 2}, r"^seqlen 2147483648 is above the limit of 1073741824 tokens"),
    ({"kernel": "torch-flash"}, r"^kernel 'torch-flash' runs on cuda, not cpu; pass --kernel with one of cpu, flex, "
                                r"math or auto$"),
])
def test_validate_refuses_bad_cpu_fields(change, pattern):
    with pytest.raises(SpecError, match=pattern):
        validate(make(**change), visible_gpus=0)


def test_check_fields_refuses_heads_before_the_ulysses_degree():
    """A degree's fix (``such as 1``) would be refused next for heads 8 over kv_heads 3: the heads come first,
    in the CLI's early check of the options given as in validate."""
    from ringbench.case.spec import check_fields

    heads = r"^heads 8 is not a multiple of kv_heads 3; pass --kv-heads with a divisor of 8, such as 2$"
    given = {"variant": "usp", "world_size": 4, "seqlen": 1024, "ulysses_degree": 4, "heads": 8, "kv_heads": 3}
    with pytest.raises(SpecError, match=heads):
        check_fields(given)
    with pytest.raises(SpecError, match=heads):
        validate(make(**given), visible_gpus=0)
    validate(make(**{**given, "kv_heads": 2}), visible_gpus=0)


@pytest.mark.parametrize("change, gpus, pattern", [
    ({"world_size": 4}, 2, r"^world_size 4 exceeds the 2 visible GPUs; pass --world-size 2 or fewer$"),
    ({}, 0, r"^device cuda needs a visible GPU and none is visible; run on a GPU machine or pass --device cpu$"),
    ({"head_dim": 300}, 2, r"^head_dim 300 exceeds 256, the largest the torch-flash kernel takes; pass another "
                           r"--head-dim, or --kernel math$"),
    ({"head_dim": 100}, 2, r"^head_dim 100 is not a multiple of 8, which the torch-flash kernel needs"),
    ({"dtype": "fp32"}, 2, r"^dtype fp32 is not supported by the torch-flash kernel, which takes bf16 and fp16; "
                           r"pass --dtype bf16$"),
    ({"kernel": "cpu"}, 2, r"^kernel 'cpu' runs on cpu, not cuda; pass --kernel with one of "
                           + re.escape(", ".join(n for n, k in KERNELS.items() if k.device_type in ("cuda", "any")))
                           + " or auto$"),
])
def test_validate_refuses_bad_cuda_fields(change, gpus, pattern):
    with pytest.raises(SpecError, match=pattern):
        validate(cuda_case(**change), visible_gpus=gpus)


def test_validate_accepts_math_kernel_on_either_device():
    validate(make(kernel="math", dtype="fp64"), visible_gpus=0)
    validate(cuda_case(kernel="math", dtype="fp64"), visible_gpus=2)


# --------------------------------------------------------------------------- resolve / detect_device

def test_resolve_picks_cpu_kernel_for_auto_on_cpu():
    assert resolve(make(kernel="auto")).kernel == "cpu"
    assert resolve(make(kernel="math")).kernel == "math"


def test_detect_device_matches_torch():
    import torch

    device, gpus = detect_device()
    if torch.cuda.is_available():
        assert (device, gpus) == ("cuda", torch.cuda.device_count())
    else:
        assert (device, gpus) == ("cpu", 0)


def test_resolve_refuses_unavailable_cuda_kernel():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible, so torch-flash may be available")
    with pytest.raises(SpecError, match=r"^kernel 'torch-flash' is unavailable here: no CUDA device is visible; "
                                        r"pass another --kernel or auto$"):
        resolve(cuda_case())


@pytest.mark.parametrize("change", [{"dtype": "fp32"}, {"head_dim": 300}])
def test_resolve_auto_skips_kernels_that_refuse_the_shape(change):
    # Every fast cuda kernel takes only half dtypes and head dims up to 256 (flex is named, never picked).
    assert resolve(cuda_case(kernel="auto", **change)).kernel == "math"


# --------------------------------------------------------------------------- scenarios

def test_scenario_builtins_load_and_expand_to_valid_cases():
    names = builtin_names()
    assert {"smoke", "ci-nightly"} <= set(names)
    checked = 0
    for name in names:
        for task in ("run", "verify"):
            # masks goes to 128k, past verify's dense mask reference (32k); verify takes it at --seqlen 32k.
            over = {"seqlen": 32768} if (name, task) == ("masks", "verify") else {}
            cases = load_scenario(name).cases(task, "cpu", over, visible_gpus=8)
            assert len(cases) > 0, name
            for case in cases:
                validate(case, visible_gpus=8)
                checked += 1
    assert checked > 0
    masks = load_scenario("masks").cases("run", "cuda", {"emulate": True}, visible_gpus=1)
    assert {c.mask.split(":")[0] for c in masks} >= {"causal", "prefix", "shared-prefix", "chunked", "global"}
    assert any(c.window == 128 and c.sink == "learnable" for c in masks)  # gpt-oss's banded layers


def test_scenario_smoke_is_cpu_with_odd_local_lengths():
    cases = load_scenario("smoke").cases("verify", "cuda", {}, visible_gpus=2)
    assert {c.device for c in cases} == {"cpu"} and {c.kernel for c in cases if not c.mask} == {"cpu"}
    assert {c.kernel for c in cases if c.mask} == {"math"}  # the kernel that takes a partial block's mask
    assert {c.world_size for c in cases} == {1, 2, 4, 8}
    # verify with no arguments covers every variant that runs on CPU (of the peers, torch_cp needs CUDA).
    assert {c.variant for c in cases} == {n for n in list_variants() if "cpu" in get_variant(n).devices}
    assert {"ring", "zigzag", "stripe", "llama3", "llama3_varlen"} <= {c.variant for c in cases}
    assert any(c.kv_heads < c.heads for c in cases)
    assert any(c.variant == "ring" and (c.seqlen // c.world_size) % 2 for c in cases)
    assert any(c.variant == "zigzag" and (c.seqlen // (2 * c.world_size)) % 2 for c in cases)
    # The window's edges: 1, 2 (a band part of one query row), and a rank's chunk - 1 and + 1.
    windows = {(c.variant, c.window - chunk) for c in cases if c.window
               for chunk in (c.seqlen // (c.world_size * (2 if c.variant == "zigzag" else 1)),)}
    assert {c.window for c in cases} >= {1, 2}
    assert {("ring", -1), ("ring", 1), ("zigzag", -1), ("zigzag", 1)} <= windows, windows


def test_scenario_ci_nightly_pairs_heads_through_shape():
    cases = load_scenario("ci-nightly").cases("verify", "cpu", {}, visible_gpus=2)
    assert {(c.heads, c.kv_heads) for c in cases} == {(32, 32), (32, 8)}
    assert {c.kernel for c in cases} == {"torch-flash", "cudnn"} and {c.world_size for c in cases} == {2}
    assert any(c.variant == "ring" and (c.seqlen // 2) % 2 for c in cases)


def write(tmp_path, text: str):
    path = tmp_path / "s.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_scenario_sweep_is_cartesian_product_with_sizes(tmp_path):
    path = write(tmp_path, """
        [defaults]
        device = "cpu"
        [sweep]
        variant = ["ring", "zigzag"]
        seqlen = ["1k", 2048]
        shape = [{heads = 4, kv_heads = 4}, {heads = 4, kv_heads = 1}]
    """)
    cases = load_scenario(str(path)).cases("run", "cpu", {})
    assert len(cases) == 8
    assert {c.seqlen for c in cases} == {1024, 2048}
    assert {(c.heads, c.kv_heads) for c in cases} == {(4, 4), (4, 1)}


def test_scenario_overrides_replace_axes_and_filter_explicit_cases(tmp_path):
    path = write(tmp_path, """
        [defaults]
        device = "cpu"
        [sweep]
        variant = ["ring", "zigzag"]
        world_size = [1, 2]
        [[case]]
        variant = "ring"
        world_size = 4
        seqlen = 516
    """)
    scen = load_scenario(str(path))
    assert len(scen.cases("verify", "cpu", {})) == 5
    only_zigzag = scen.cases("verify", "cpu", {"variant": ["zigzag"]})
    assert [(c.variant, c.world_size) for c in only_zigzag] == [("zigzag", 1), ("zigzag", 2)]
    at_four = scen.cases("verify", "cpu", {"world_size": [4]})
    assert sorted((c.variant, c.seqlen) for c in at_four) == [("ring", 516), ("ring", 4096), ("zigzag", 4096)]
    assert {c.kernel for c in scen.cases("verify", "cpu", {"kernel": "math"})} == {"math"}


@pytest.mark.parametrize("text, pattern", [
    ('colour = "red"\n[sweep]\nvariant = ["ring"]\n', r"s\.toml, line 1: 'colour' is not a scenario key"),
    ('[defaults]\ncolour = 1\n[sweep]\nvariant = ["ring"]\n',
     r"s\.toml, line 2: \[defaults\] key 'colour' is not a case field; use one of variant, "),
    ('[sweep]\nvariant = ["ring"]\ncolour = [1]\n', r"s\.toml, line 3: \[sweep\] key 'colour' is not a case field"),
    ('[[case]]\nvariant = "ring"\n\n[[case]]\nvariant = "ring"\nheadz = 4\n',
     r"s\.toml, line 6: \[\[case\]\] 2 key 'headz' is not a case field"),
    ('[defaults]\nheads = "four"\n[sweep]\nvariant = ["ring"]\n',
     r"s\.toml, line 2: \[defaults\] key 'heads' is refused: heads 'four' is a str, but heads must be an integer"),
    ('[sweep]\nvariant = "ring"\n', r"s\.toml, line 2: \[sweep\] variant must be a non-empty list"),
    ('[sweep]\nvariant = ["ring"]\ncausal = ["yes"]\n', r"line 3: \[sweep\] key 'causal' is refused"),
    ('[sweep]\nvariant = ["ring"]\nseqlen = ["12q"]\n', r"line 3: \[sweep\] key 'seqlen' is refused: seqlen '12q' is not a size"),
    ('[sweep]\nshape = [\n  {heads = 4},\n  {heads = 4, colour = 1},\n]\n',
     r"line 4: \[sweep\] shape item key 'colour' is not a case field"),
    ('description = "nothing"\n', r"s\.toml: the file declares no case"),
    ('[sweep]\nvariant = ["ring",\nheads = 4\n', r"s\.toml is not valid TOML: .*line 3"),
    ('preset = "llama3-9b"\n[sweep]\nvariant = ["ring"]\n', r"s\.toml, line 1: preset 'llama3-9b' is not a shape preset; "
     r"use one of llama3-8b, llama3-70b, qwen2\.5-7b, mha-d64"),
    ('preset = 8\n[sweep]\nvariant = ["ring"]\n', r"line 1: preset 8 is not a shape preset"),
    ('model = "llama3-8b"\n[sweep]\nvariant = ["ring"]\n', r"line 1: 'model' is not a key: an attention-shape preset .* is the top-level key preset"),
    ('preset = "llama3-8b"\n[defaults]\nkv_heads = 4\n[sweep]\nvariant = ["ring"]\n',
     r"line 3: \[defaults\] key 'kv_heads' clashes with preset 'llama3-8b'"),
    ('[sweep]\nvariant = ["ring"]\ndocuments = ["lognormal"]\n',
     r"line 3: \[sweep\] key 'documents' is not a case field; packed documents are docs"),
])
def test_scenario_refuses_bad_files(tmp_path, text, pattern):
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=pattern):
        load_scenario(str(path))


def test_scenario_refuses_missing_file():
    with pytest.raises(SpecError, match=r"scenario '/nonexistent\.toml' is neither a built-in \(.*smoke.*\) nor a file"):
        load_scenario("/nonexistent.toml")


def test_scenario_without_variant_is_refused_on_expansion():
    scen = parse_scenario('[sweep]\nheads = [4]\n', name="x", source="x.toml")
    with pytest.raises(SpecError, match=r"scenario x\.toml gives a case without a variant"):
        scen.cases("run", "cpu", {})


@pytest.mark.parametrize("model, shape", [
    ("llama3-8b", (32, 8, 128)), ("llama3-70b", (64, 8, 128)), ("qwen2.5-7b", (28, 4, 128)), ("mha-d64", (16, 16, 64)),
])
def test_scenario_shape_preset_sets_heads_and_head_dim(model, shape):
    scen = parse_scenario(f'preset = "{model}"\n[sweep]\nvariant = ["ring", "zigzag"]\n', name="m", source="m.toml")
    cases = scen.cases("run", "cpu", {})
    assert scen.preset == model and len(cases) == 2
    assert {(c.heads, c.kv_heads, c.head_dim) for c in cases} == {shape}


def test_scenario_model_preset_yields_to_sweep_case_and_overrides():
    scen = parse_scenario('preset = "llama3-8b"\n[sweep]\nvariant = ["ring"]\nhead_dim = [64, 128]\n'
                          '[[case]]\nvariant = "zigzag"\nkv_heads = 32\n', name="m", source="m.toml")
    cases = scen.cases("run", "cpu", {})
    assert [(c.variant, c.heads, c.kv_heads, c.head_dim) for c in cases] == [
        ("ring", 32, 8, 64), ("ring", 32, 8, 128), ("zigzag", 32, 32, 128)]
    assert {c.heads for c in scen.cases("run", "cpu", {"heads": 16})} == {16}


def test_scenario_llama3_8b_sweeps_8k_to_128k_on_the_preset():
    scen = load_scenario("llama3-8b")
    cases = scen.cases("run", "cuda", {}, visible_gpus=2)
    assert scen.preset == "llama3-8b"
    assert {(c.heads, c.kv_heads, c.head_dim, c.world_size) for c in cases} == {(32, 8, 128, 2)}
    assert sorted({c.seqlen for c in cases}) == [8192, 16384, 32768, 65536, 131072]
    assert {c.variant for c in cases} == {"ring", "zigzag", "stripe", "llama3"}
    assert len(cases) == 4 * 2 * 5 * 2  # variants x kernels x seqlens x modes


def test_spec_largest_seed_draws_every_ranks_inputs():
    """The largest seed the check takes (2^63 - 1) draws inputs and sinks on every rank: the ranks'
    streams are derived modulo 2^63, so none overflows torch's generator."""
    import torch

    from ringbench.case.spec import check_fields
    from ringbench.rank.bench import rank_inputs
    from ringbench.rank.setup import sink_logits

    seed = 2 ** 63 - 1
    check_fields({"seed": seed})
    spec = make(task="run", seqlen=64, heads=2, kv_heads=2, head_dim=8, world_size=2, seed=seed, sink="learnable")
    for rank in range(2):
        assert rank_inputs(spec, rank, torch.float32, torch.device("cpu"))[0].shape == (1, 32, 2, 8)
    assert sink_logits(spec, torch.float32, torch.device("cpu")).shape == (2,)
