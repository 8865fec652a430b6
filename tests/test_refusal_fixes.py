"""Refusals whose fix works: each names a value the spec checks then accept (a new user's report:
usp suggested an --ulysses-degree not dividing W, zigzag_varlen a --seqlen it then refused), and
lists of variants come from the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringbench.sweep import build
from ringbench.errors import SpecError
from ringbench.variants import VARIANTS


def _cases(task="verify", **given):
    given = {"device": "cpu", **given}
    given["variant"] = [given["variant"]]
    return build.cases_for(task, given)[0]


def _refusal(task="verify", **given) -> str:
    with pytest.raises(SpecError) as got:
        _cases(task, **given)
    return str(got.value)


@pytest.mark.parametrize("given, pattern, fix", [
    (dict(variant="usp", ulysses_degree=4, world_size=4, heads=6, kv_heads=2),
     r"divides 6 and world_size 4, such as (\d+)$", "ulysses_degree"),
    (dict(variant="usp", ulysses_degree=4, world_size=8, heads=12, kv_heads=6),
     r"world_size 8, such as (\d+)$", "ulysses_degree"),
    (dict(variant="ulysses", world_size=4, heads=6, kv_heads=2),
     r"pass a --world-size that divides 6, such as (\d+), or --heads", "world_size"),
    (dict(variant="ulysses", world_size=4, heads=6, kv_heads=2),
     r"or --heads a multiple of 4, such as (\d+)$", "heads"),
    (dict(variant="ulysses", world_size=4, heads=12, kv_heads=6), r"--kv-heads (\d+)$", "kv_heads"),
    # heads % kv_heads comes before the degree's rule, whose fix would assume heads it refuses.
    (dict(variant="usp", ulysses_degree=4, world_size=4, heads=8, kv_heads=3),
     r"^heads 8 is not a multiple of kv_heads 3; pass --kv-heads with a divisor of 8, such as (\d+)$", "kv_heads"),
    (dict(variant="zigzag_varlen", world_size=4, seqlen=1024, docs="100,300,612", doc_pad=7),
     r"pass --doc-pad (\d+)$", "doc_pad"),
])
def test_a_refusals_suggested_value_is_accepted(given, pattern, fix):
    message = _refusal(**given)
    assert "\n" not in message
    found = re.search(pattern, message)
    assert found, message
    _cases(**{**given, fix: int(found.group(1))})  # raises if the suggestion is refused too


def test_ulysses_refusal_talks_of_the_world_size_not_a_degree():
    message = _refusal(variant="ulysses", world_size=4, heads=6, kv_heads=2)
    assert message.startswith("world_size 4 does not divide heads 6") and "degree" not in message, message


def test_lists_of_variants_in_refusals_come_from_the_registry():
    hybrids = [n for n, v in VARIANTS.items() if "ulysses_degree" in v.options]
    assert {"usp", "usp_varlen", "yc_usp"} <= set(hybrids)
    message = _refusal(variant="ring", ulysses_degree=2)
    assert all(n in message for n in hybrids), message
    message = _refusal(task="run", variant="rfa_zigzag", seqlen=1024, docs="512,512")
    assert all(n in message for n, v in VARIANTS.items() if v.varlen), message
    assert all(re.search(rf"\b{n}\b", message) for n in ("ring", "zigzag", "stripe", "llama3", "ulysses", "usp"))
    assert "ulysses_varlen" in message and "usp_varlen" in message


def test_emulate_refusal_of_a_peer_says_why_and_its_fix_lists_every_variant_that_emulates():
    message = _refusal(task="run", variant="rfa_zigzag", emulate=True)
    assert message.startswith("rfa_zigzag cannot run with --emulate: it is a peer whose own code drives "
                              "torch.distributed"), message
    listed = message.split("; emulate ")[1].split(", or run ")[0]
    own = [n for n, v in VARIANTS.items() if not v.peer]
    assert all(re.search(rf"\b{n}\b", listed) for n in own) and not re.search(r"\b(rfa|yc)_|torch_cp", listed), listed
    for name in ("usp", "llama3_varlen"):  # the fix is accepted
        _cases("run", variant=name, emulate=True, world_size=4, seqlen=1024, heads=4, kv_heads=2,
               **({"docs": "100,924"} if name.endswith("_varlen") else {}))


def test_a_model_refusal_suggests_only_variants_that_model_takes():
    """`verify --model llama-tiny --variant zigzag --docs 100,156` listed rfa_llama3_varlen, which --model
    then refuses where its adapter does not import (issue 27); every variant it names is accepted."""
    with pytest.raises(SpecError) as got:
        build.cases_for("verify", {"variant": ["zigzag"], "device": "cpu", "docs": "100,156"}, model="llama-tiny")
    message = str(got.value)
    found = re.fullmatch(r"docs '100,156' does not go with --model llama-tiny on zigzag, which takes documents as a "
                         r"document mask and the model's layers fix their own masks; use (.+), or drop --docs", message)
    assert found, message
    suggested = re.split(r", | or ", found.group(1))
    assert "llama3_varlen" in suggested
    for name in suggested:
        assert VARIANTS[name].model_refusal() is None, name
        build.cases_for("verify", {"variant": [name], "device": "cpu", "docs": "128,128"}, model="llama-tiny")
    refused = [n for n, v in VARIANTS.items() if v.varlen and v.model_refusal()]
    assert not set(refused) & set(suggested)


# --------------------------------------------------------------------------- under --model

#: The options of the fields a model fixes: under --model a refusal may only say to drop them
#: (issue 27: a document refusal suggested --seqlen 704, which --model then refused).
FIXED_BY_MODEL = ("--seqlen", "--batch", "--heads", "--kv-heads", "--head-dim", "--no-causal", "--causal", "--mode",
                  "--window", "--sink")
ONES = ",".join(["1"] * 64 + ["192"])  # 65 documents filling llama-tiny's 256 tokens


def _model_cases(model: str, given: dict) -> list:
    """verify --model MODEL's cases as the command builds them: its option checks, then the model's."""
    case = {"device": "cpu", "hf_model": model, **{k: list(v) if isinstance(v, list) else v for k, v in given.items()}}
    from ringbench.case import options

    options.check_given(case)
    case.pop("hf_model")
    return build.cases_for("verify", case, model=model)[0]


def _variants(text: str) -> list[str]:
    found = re.split(r", | or ", text)
    assert all(n in VARIANTS for n in found), text
    return found


def _fixes(message: str, model: str, given: dict) -> list[tuple[str, dict]]:
    """Every fix the refusal suggests, as the (model, options) of the command that follows it; a
    form not listed here fails, so a new kind of suggestion is followed too once it is added."""
    fix = message.rsplit("; ", 1)[1]
    for option in FIXED_BY_MODEL:
        assert re.sub(rf"drop {option}\b", "", fix).find(option + " ") < 0, message

    def with_(**changes) -> tuple[str, dict]:
        return model, {**given, **changes}

    if found := re.fullmatch(r"drop (--[a-z-]+)(?:, or check .* without --model)?", fix):
        name = found.group(1)[2:].replace("-", "_")
        assert name in given, message
        return [(model, {k: v for k, v in given.items() if k != name})]
    if found := re.fullmatch(r"pass --world-size (\d+)(?: or (\d+))?", fix):
        return [with_(world_size=[int(w)]) for w in found.groups() if w]
    if found := re.fullmatch(r"(?:pass --docs (\S+), or )?use --variant (\w+), which takes any document lengths", fix):
        docs, variant = found.groups()
        return ([with_(docs=docs)] if docs else []) + [with_(variant=[variant])]
    if found := re.fullmatch(r"use (.+), or a model without them such as ([\w-]+)", fix):
        return [with_(variant=[n]) for n in _variants(found.group(1))] + [(found.group(2), given)]
    if found := re.fullmatch(r"use (.+), or drop --docs", fix):
        return [with_(variant=[n]) for n in _variants(found.group(1))] + [
            (model, {k: v for k, v in given.items() if k != "docs"})]
    if found := re.fullmatch(r"use a degree that .*, such as (\d+)", fix):
        return [with_(ulysses_degree=int(found.group(1)))]
    if found := re.fullmatch(r"pass --heads-k-stride (\d+) or fewer", fix):
        return [with_(heads_k_stride=int(found.group(1)))]
    if fix == "check its attention without --model":
        return []  # another command: the variant is one --model cannot check here
    pytest.fail(f"a fix this test cannot follow yet: {fix!r} (of {message!r})")


@pytest.mark.parametrize("model, given, start", [
    ("llama-tiny", dict(variant=["zigzag_varlen"], world_size=[4], docs=ONES), "64 documents of 1 token are not"),
    ("llama-tiny", dict(variant=["zigzag_varlen"], world_size=[4], docs="1,255"), "documents 1 and 2 have 1 and 255"),
    ("llama-tiny", dict(variant=["zigzag_varlen"], world_size=[2, 4], docs="1,255"), "documents 1 and 2 have"),
    ("llama-tiny", dict(variant=["zigzag"], docs=ONES), "docs '1,1,1,...,192' (65 documents) does not go with --model"),
    ("llama-tiny", dict(world_size=[3]), "world_size 3 does not fit model llama-tiny"),
    ("llama-tiny", dict(variant=["ulysses"], world_size=[8]), "world_size 8 does not fit model llama-tiny"),
    ("qwen2-tiny", dict(variant=["ulysses"], world_size=[4]), "world_size 4 does not fit model qwen2-tiny"),
    ("qwen2-tiny", dict(variant=["usp"], world_size=[4], ulysses_degree=4), "Ulysses degree 4 does not divide heads 6"),
    ("llama-tiny", dict(variant=["llama3"], heads_k_stride=3), "heads_k_stride 3 must be between 1 and kv_heads = 2"),
    ("llama-tiny", dict(seqlen=512), "--seqlen does not go with --model llama-tiny"),
    ("llama-tiny", dict(window=10), "--window does not go with --model llama-tiny"),
    ("qwen2-tiny", dict(window=40), "--window does not go with --model qwen2-tiny"),
    ("llama-tiny", dict(sink="learnable"), "--sink does not go with --model llama-tiny"),
    ("gpt-oss-tiny", dict(sink="none"), "--sink does not go with --model gpt-oss-tiny"),
    ("llama-tiny", dict(docs="128,128", doc_pad=64), "--doc-pad 64 does not go with --model llama-tiny"),
    ("qwen2-tiny", dict(variant=["sink_every_block"]), "sink_every_block cannot take what model qwen2-tiny's"),
    ("gpt-oss-tiny", dict(variant=["band_one_row"]), "band_one_row cannot take what model gpt-oss-tiny's"),
    ("gpt-oss-tiny", dict(variant=["yc_ulysses"]), "yc_ulysses cannot be checked with --model"),
])
def test_every_fix_a_model_refusal_suggests_is_one_the_same_command_takes(model, given, start):
    with pytest.raises(SpecError) as got:
        _model_cases(model, given)
    message = str(got.value)
    assert message.startswith(start) and "\n" not in message, message
    for fixed_model, fixed in _fixes(message, model, given):
        assert _model_cases(fixed_model, fixed), (message, fixed_model, fixed)  # raises if the fix is refused too


def test_a_varlen_variant_under_model_without_documents_packs_the_row_as_one():
    """So batch and varlen variants go in one command (zigzag, llama3_varlen, usp), and each
    record says what ran: docs is the model's seqlen."""
    cases = _model_cases("qwen2-tiny", dict(variant=["zigzag", "llama3_varlen", "usp"], world_size=[2, 4]))
    assert [(c.variant, c.world_size, c.docs) for c in cases] == [
        ("zigzag", 2, ""), ("zigzag", 4, ""), ("llama3_varlen", 2, "256"), ("llama3_varlen", 4, "256"),
        ("usp", 2, ""), ("usp", 4, "")]
    assert {(c.window, c.sink) for c in cases} == {(40, "none")}
    assert {(c.window, c.sink) for c in _model_cases("gpt-oss-tiny", dict(variant=["ring"]))} == {(40, "learnable")}


# --------------------------------------------------------------------------- issue 27, item 4: fixes the command takes

def _invoke(args):
    from typer.testing import CliRunner

    from ringbench.cli import app

    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, args)


def _check(args, task="run") -> str | None:
    """The sentence the CLI refuses ``TASK ARGS`` with before any process starts (None: accepted)."""
    from ringbench.case import fields, options

    by_option = {f.option: f for f in fields.FIELDS}
    by_option.update({f.file_option: f for f in fields.FIELDS if f.file_option})
    given: dict = {}
    for option, value in zip(args[::2], args[1::2]):
        field = by_option[option]
        parse = field.file_parse if option == field.file_option else field.value_type
        parsed = parse.parse(value) if parse else value
        if field.repeatable:
            given.setdefault(field.name, []).append(parsed)
        else:
            given[field.name] = parsed
    try:
        options.check_given(given)
        build.cases_for(task, {"device": "cpu", **given})
    except SpecError as exc:
        return str(exc)
    return None


def test_a_world_size_past_any_machine_is_refused_with_a_world_size_the_check_takes():
    """`run --world-size 99999999999999999999` said 'use 99999999999999999999', a seqlen above the limit."""
    result = _invoke(["run", "--variant", "ring", "--world-size", "99999999999999999999"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("world_size 99999999999999999999 is above the limit of 65536 ranks (4096 hosts "
                                     "of 16); pass --world-size 65536 or fewer")
    # The fix passes this rule; the next one (the seqlen's multiple) names a seqlen that passes too.
    message = _check(["--variant", "ring", "--world-size", "65536"])
    assert message == "seqlen 4096 is not a multiple of world_size = 65536, which ring needs; use 65536"
    assert _check(["--variant", "ring", "--world-size", "65536", "--seqlen", "65536"]) is None


@pytest.mark.parametrize("args, fix", [
    # The multiple above 1024M passes the seqlen limit: the one below it is offered.
    (["--variant", "ring", "--seqlen", "1024M", "--world-size", "3"], "use 1073741823"),
    (["--variant", "zigzag", "--seqlen", "1024M", "--world-size", "3", "--world-size", "5", "--world-size", "7"],
     "use 1073741760"),
    (["--variant", "zigzag", "--seqlen", "4097", "--world-size", "3"], "use 4098"),
])
def test_a_seqlen_refusal_offers_a_seqlen_within_the_limit(args, fix):
    message = _check(args)
    assert message.endswith(f"; {fix}"), message
    value = fix.split()[-1]
    followed = list(args)
    followed[followed.index("--seqlen") + 1] = value
    assert _check(followed) is None, followed


def test_world_sizes_no_seqlen_can_cut_together_are_told_to_run_apart():
    message = _check(["--variant", "zigzag", "--seqlen", "1k", "--world-size", "65535", "--world-size", "65536"])
    assert message == ("seqlen 1024 is not a multiple of 8589803520, which zigzag needs to cut it at every world size "
                       "given (65535, 65536); no seqlen up to the limit of 1073741824 tokens is one, so run these "
                       "world sizes in separate commands")


def test_a_world_size_off_the_nodes_is_offered_one_within_the_limit():
    with pytest.raises(SpecError) as got:
        build.cases_for("run", {"variant": ["ring"], "device": "cpu", "world_size": [65535]}, nnodes=4095)
    found = re.search(r"pass --world-size (\d+)$", str(got.value))
    assert found and int(found.group(1)) == 65520, got.value  # 4095 * 16: the multiple above passes 65536
    build.cases_for("run", {"variant": ["ring"], "device": "cpu", "world_size": [65520], "seqlen": [65520]},
                    nnodes=4095)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7])
def test_the_matrix_refuses_no_cell_for_a_length_it_chose_itself(world_size):
    """`matrix --world-size 3` refused every ring cell with 'seqlen 256 ...; use 258', a --seqlen matrix does not
    take: its base length (and the padded column's doc_pad) now fit every layout at any world size. Only the odd
    column, whose point is a length some layouts cannot cut, may be refused so."""
    from ringbench.sweep import matrix as mx

    grid = mx.build_grid(device="cpu", world_sizes=[world_size])
    seqlen = mx.base_seqlen("cpu", world_size)
    assert seqlen % (2 * world_size) == 0 and seqlen >= 256 and (seqlen == 256 or world_size not in (2, 4))
    refused = [(c.implementation, c.columns, c.refusal) for c in grid.cells if c.refusal
               and re.match(r"(seqlen|doc_pad|documents?) \d", c.refusal) and "odd" not in c.columns]
    assert refused == []
    assert sum(c.refusal is None for c in grid.cells) > 100


def test_the_matrix_refusal_offers_only_what_matrix_takes():
    """`matrix --variant ulysses --world-size 3` offered verify's '--heads a multiple of 3', which matrix lacks."""
    from ringbench.sweep import matrix as mx

    result = _invoke(["matrix", "--variant", "ulysses", "--world-size", "3", "--out", "/nonexistent/m"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "nothing to verify: every one of the 20 cells of this matrix is refused on cpu, all of them because "
        "world_size 3 does not divide heads 8, and ulysses runs Ulysses over every rank, giving each heads / "
        "world_size query heads; pass a --world-size that divides 8, such as 2")
    mx.check_runnable(mx.build_grid(device="cpu", world_sizes=[2], variants=["ulysses"]))  # the fix runs
    assert mx.matrix_fix("x; pass --heads 9") == "x; pass another --world-size or --variant"
    assert mx.matrix_fix("x; run it with --device cuda") == "x; run it with --device cuda"


# --------------------------------------------------------------------------- issue 26: an offered seqlen every rule takes

MASKS = Path(__file__).parent / "data" / "masks"


@pytest.mark.parametrize("args, offered", [
    # zigzag's multiple of 4 refused the mask's 1026, and the mask zigzag's 1028.
    (["--variant", "zigzag", "--mask", "shared-prefix:256,answers=5", "--seqlen", "1k"], 1036),
    (["--variant", "zigzag", "--mask", "shared-prefix:256,answers=5", "--seqlen", "1k", "--world-size", "2",
      "--world-size", "4"], 1016),
    # The mask's 40001 is past verify's dense limit: the nearest below it that the answers split.
    (["--variant", "zigzag", "--mask", "shared-prefix:256,answers=5", "--seqlen", "40000"], 32756),
    (["--variant", "stripe", "--mask", "shared-prefix:256,answers=5", "--seqlen", "1k", "--world-size", "8"], 1016),
    # 256 rows of slices past 1k tokens: 256 is the only seqlen they fit, which zigzag at W=3 cannot cut.
    (["--variant", "zigzag", "--mask-file", str(MASKS / "image_in_text.txt"), "--seqlen", "1k", "--world-size", "3"],
     None),
    (["--variant", "zigzag", "--mask-file", str(MASKS / "image_in_text.txt"), "--seqlen", "1k"], 256),
])
def test_a_seqlen_a_refusal_offers_passes_every_rule_of_the_case(args, offered):
    """`verify --variant zigzag --mask shared-prefix:256,answers=5 --seqlen 1k` offered 1026, which zigzag refused
    offering 1028, which the answers refused: the offer is now the nearest seqlen that every check takes."""
    from helpers import ringbench_here

    result = ringbench_here("verify", "--device", "cpu", *args, cwd=Path.cwd())
    message = result.stderr.strip()
    assert result.returncode == 2 and "\n" not in message, message
    found = re.search(r"(?:--seqlen|use) (\d+)", message.rsplit("; ", 1)[-1])
    assert (int(found.group(1)) if found else None) == offered, message
    if offered is None:
        assert message.endswith("; pass slices that give those rows a key"), message
        return
    followed = list(args)
    followed[followed.index("--seqlen") + 1] = str(offered)
    assert _check(followed, task="verify") is None


@pytest.mark.parametrize("args, offered", [
    # 16386 splits the answers, zigzag over 8 ranks needs a multiple of 16: 16416 takes both.
    (["--mask", "shared-prefix:4k,answers=5"], 16416),
    (["--mask", "shared-prefix:4k,answers=7", "--world-size", "2", "--seqlen", "4k"], 4124),
])
def test_predict_offers_a_seqlen_every_rule_of_the_case_takes(args, offered):
    """`predict --variant zigzag --gpu H100 --mask shared-prefix:4k,answers=5` offered 16386, which zigzag
    refused offering 16400, which the answers refused again: predict now holds its offers to every rule, as
    run and verify do."""
    from helpers import ringbench_here

    result = ringbench_here("predict", "--variant", "zigzag", "--gpu", "H100", *args, cwd=Path.cwd())
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and f"pass --seqlen {offered} or another P or A" in message, message
    followed = [a for a in args if a not in ("--seqlen", "4k")] + ["--seqlen", str(offered)]
    again = ringbench_here("predict", "--variant", "zigzag", "--gpu", "H100", "--json", *followed, cwd=Path.cwd())
    assert again.returncode == 0, again.stderr


def test_refusal_of_a_mask_onto_a_scenario_window_names_the_scenarios_window():
    """verify --scenario smoke --mask causal said 'mask causal and window 100 do not go together ...; pass one
    of them', as if the user had given the window: the scenario set it, so the sentence says so and the fix is
    the user's own option."""
    with pytest.raises(SpecError) as got:
        build.cases_for("verify", {"device": "cpu", "mask": ["causal"]}, scenario="smoke", resolve_kernels=False,
                        machine=("cpu", 0))
    message = str(got.value)
    assert re.fullmatch(r"scenario smoke \(built-in\) case \d+ of \d+ \([^)]*\): the scenario sets window (\d+) on this "
                        r"case, and a window is itself a mask \(--window L is the short form of --mask window:L\), so "
                        r"--mask causal cannot join it; drop --mask, or give the mask without --scenario"
                        r"(; \d+ more of its \d+ cases (is|are) refused too, by this rule or another \(--variant "
                        r"keeps the ones named\))?", message), message
    assert "pass one of them" not in message
    with pytest.raises(SpecError, match="pass one of them"):  # both given by the user: still theirs to choose
        build.cases_for("verify", {"device": "cpu", "variant": ["zigzag"], "mask": ["causal"], "window": [64],
                                   "seqlen": [512], "world_size": [2]}, resolve_kernels=False, machine=("cpu", 0))


@pytest.mark.parametrize("variant, layout, fix", [
    ("zigzag", "balanced", "drop --layout, or use --variant ring --layout balanced"),
    ("stripe", "zigzag", "drop --layout, or use --variant zigzag"),
    ("ring_varlen", "zigzag", "drop --layout, or use --variant zigzag_varlen"),
    ("ulysses_varlen", "balanced", "drop --layout, or use --variant llama3_varlen --layout balanced"),
])
def test_a_layout_a_one_layout_variant_refuses_says_what_to_do(variant, layout, fix):
    """"layout 'balanced' is not one zigzag takes; choose zigzag" named the variant's own layout, which is
    no fix: the sentence says to drop --layout or use a variant that takes the layout."""
    docs = {"docs": "2k,2k"} if VARIANTS[variant].varlen else {}
    message = _refusal(variant=variant, layout=layout, seqlen=4096, world_size=2, **docs)
    assert message == (f"layout {layout!r} is not one {variant} takes, since it lays the sequence out as "
                       f"{VARIANTS[variant].layout} only; {fix}")


def test_refusal_of_an_option_onto_a_scenario_counts_the_other_cases_it_refuses():
    """verify --scenario smoke --bias alibi named the first case's fix (--kernel math); taking it met the next
    case's refusal, and so on: the sentence counts the scenario's other refused cases, and one refused case
    alone keeps the sentence as it was."""
    with pytest.raises(SpecError) as got:
        build.cases_for("verify", {"device": "cpu", "bias": ["alibi"], "kernel": ["math"]}, scenario="smoke",
                        resolve_kernels=False, machine=("cpu", 0))
    found = re.search(r"; (\d+) more of its (\d+) cases (?:is|are) refused too, by this rule or another \(--variant "
                      r"keeps the ones named\)$", str(got.value))
    assert found and 0 < int(found.group(1)) < int(found.group(2)), str(got.value)
    with pytest.raises(SpecError) as one:
        build.cases_for("verify", {"device": "cpu", "bias": ["alibi"], "kernel": ["math"], "variant": ["ring_varlen"]},
                        scenario="smoke", resolve_kernels=False, machine=("cpu", 0))  # its one case
    assert str(one.value).endswith("use one of ring, zigzag, stripe, llama3, ulysses, usp"), str(one.value)
