"""Refusals whose fix works: each names a value the spec checks then accept (a new user's report:
usp suggested an --ulysses-degree not dividing W, zigzag_varlen a --seqlen it then refused), and
lists of variants come from the registry."""

from __future__ import annotations

import re

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
    message = _refusal(task="run", variant="ring", seqlen=1024, docs="512,512")
    assert all(n in message for n, v in VARIANTS.items() if v.varlen), message
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
    found = re.fullmatch(r"docs '100,156' is given, but zigzag is a batch variant and takes no documents; use (.+), "
                         r"or drop --docs", message)
    assert found, message
    suggested = re.split(r", | or ", found.group(1))
    assert "llama3_varlen" in suggested
    for name in suggested:
        assert VARIANTS[name].model_refusal() is None, name
        build.cases_for("verify", {"variant": [name], "device": "cpu", "docs": "128,128"}, model="llama-tiny")
    refused = [n for n, v in VARIANTS.items() if v.varlen and v.model_refusal()]
    assert not set(refused) & set(suggested)
