"""The field table: the one home of a case field, and what is generated from it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ringbench.case import fields
from ringbench.errors import SpecError
from ringbench.case.spec import CaseSpec, default_fields

CONTRACTS = Path(__file__).parents[1] / "docs" / "contracts.md"


def test_fields_table_in_contracts_is_the_generated_one():
    text = CONTRACTS.read_text(encoding="utf-8")
    found = re.search(r"<!-- fields:begin -->\n(.*?)<!-- fields:end -->", text, re.S)
    assert found, "docs/contracts.md lost its fields:begin/fields:end markers"
    assert found.group(1) == fields.markdown_table(), (
        "docs/contracts.md's field table differs from ringbench.case.fields.markdown_table(); paste the new one")


def test_fields_casespec_is_generated_from_the_table():
    assert tuple(f.name for f in dataclasses.fields(CaseSpec)) == fields.NAMES
    assert {f.name: f.type for f in dataclasses.fields(CaseSpec)} == {f.name: f.type for f in fields.FIELDS}
    for f in fields.FIELDS:
        assert f"{f.name} ({f.type.__name__})" in CaseSpec.__doc__


def test_fields_defaults_come_from_the_table_per_device():
    cpu, cuda = default_fields("cpu", 0), default_fields("cuda", 8)
    assert cpu["world_size"] == 2 and cuda["world_size"] == 8 and default_fields("cuda", 0)["world_size"] == 1
    for f in fields.FIELDS:
        if f.cpu is not None:
            assert cpu[f.name] == f.cpu
        if f.cuda is not None and f.cuda != fields.VISIBLE_GPUS:
            assert cuda[f.name] == f.cuda


def test_fields_growth_key_is_every_case_id_field_but_the_world_size_and_the_seed():
    assert set(fields.GROWTH_KEY) == {f.name for f in fields.FIELDS if f.in_case_id} - {"task", "world_size"} | {"seed"}
    assert "repeat" not in fields.GROWTH_KEY  # how often a problem is checked does not make it another
    for name in ("layout", "heads_k_stride", "rotate", "docs", "doc_dist", "hf_model", "seed"):
        assert name in fields.GROWTH_KEY


def test_fields_variant_options_are_the_rows_that_say_so():
    assert fields.VARIANT_OPTIONS == ("layout", "heads_k_stride", "rotate", "window", "mask", "ulysses_degree")
    spec = CaseSpec.from_dict({"task": "run", "variant": "llama3", **default_fields("cpu", 0), "layout": "contiguous"})
    assert fields.variant_options(spec) == {"layout": "contiguous"}
    assert fields.variant_options(spec.to_dict()) == {"layout": "contiguous"}


@pytest.mark.parametrize("name, value, pattern", [
    ("batch", 0, r"^batch 0 must be positive; pass --batch 1 or more$"),
    ("seed", -1, r"^seed -1 must be zero or more; pass --seed 0 or more$"),
    ("dtype", "fp8", r"^dtype 'fp8' is unknown; pass --dtype with one of bf16, fp16, fp32, fp64$"),
    ("seqlen", "12q", r"^seqlen '12q' is not a size"),
    ("heads", "4", r"^heads '4' is a str, but heads must be an integer; fix its value$"),
    ("causal", 1, r"^causal 1 is an int, but causal must be true or false"),
    ("docs", "1,,2", r"^docs '1,,2' has no length for document 2"),
    ("rotate", "ring", r"^rotate 'ring' is unknown; pass --rotate with one of allgather, alltoall$"),
    ("hf_model", "nope", r"^model 'nope' is unknown; pass --model with one of gpt-oss-tiny, llama-"),
    ("colour", "red", r"^field 'colour' is not a case field; use one of task, variant"),
])
def test_fields_each_row_checks_its_own_value(name, value, pattern):
    with pytest.raises(SpecError, match=pattern):
        fields.check(name, value)


def test_fields_every_option_of_run_and_verify_is_a_row():
    import typer.main

    from ringbench.cli import app

    commands = typer.main.get_command(app).commands
    for command in ("run", "verify"):
        names = {p.name for p in commands[command].params}
        assert {f.name for f in fields.fields_of(command)} <= names
        assert not {f.name for f in fields.FIELDS if command not in f.commands} & names


def test_fields_help_says_who_takes_an_option_and_what_its_values_mean():
    """--window names every variant that takes one (the registry's ``takes_window``: the Ulysses ones
    too), --layout does not tie balanced to a causal mask, which it runs without too, and
    --ulysses-degree says what 0 is, as docs/contracts.md does."""
    from ringbench.case.spec import validate
    from ringbench.variants import VARIANTS

    window = fields.BY_NAME["window"].help
    takers = [n for n, v in VARIANTS.items() if v.takes_window]
    assert {"ulysses", "ulysses_varlen", "usp", "usp_varlen"} <= set(takers)
    assert all(re.search(rf"\b{n}\b", window) for n in takers), window
    assert not any(re.search(rf"\b{n}\b", window) for n, v in VARIANTS.items() if not v.takes_window), window
    layout = fields.BY_NAME["layout"].help
    assert "balanced under a causal mask" not in layout and "either mask" in layout, layout
    spec = CaseSpec.from_dict({"task": "verify", "variant": "llama3_varlen", **default_fields("cpu", 0),
                               "layout": "balanced", "causal": False, "docs": "100,156", "seqlen": 256})
    validate(spec, visible_gpus=0)
    assert "0: the largest such divisor" in fields.BY_NAME["ulysses_degree"].help


@pytest.mark.parametrize("name", ["bias", "docs", "doc_dist"])
def test_fields_none_as_the_help_shows_the_default_is_no_value(name):
    """``--bias none`` (and --docs, --doc-dist), the default their help shows, is the case without one: the
    same case_id as leaving it out; it was refused as an unknown bias."""
    from helpers import command_cases

    given = {"variant": ["ring"], "world_size": [2], "seqlen": 64, "head_dim": 16}
    [plain] = command_cases("verify", given)
    [none] = command_cases("verify", {**given, name: "none"})
    assert getattr(none, name) == "" and none.case_id() == plain.case_id()
