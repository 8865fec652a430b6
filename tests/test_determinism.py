"""``verify --repeat N``: bitwise determinism of out, lse, dq, dk and dv between repeats.

- The bit comparison, the verdict (a kernel documented as nondeterministic in backward is
  recorded, not failed, unless ``require_deterministic``) and the kernels' documentation.
- ``repeat`` and ``require_deterministic`` are field-table rows outside ``case_id``.
- In process at world size 1: ``verify_case`` with the ring (the same bits) and with the hidden
  ``jitter_ring``, whose dq moves by a rounding at every backward.
- The verify table's ``repeats`` row.
- Under real torchrun: the issue's llama3_varlen command is deterministic and passes, and
  ``jitter_ring`` fails ``--repeat 2`` and ``--require-deterministic``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from rich.console import Console

from helpers import read_jsonl, ringbench_here
from ringbench.rank import check, tolerance
from ringbench.case import fields
from ringbench.present import report
from ringbench.errors import SpecError
from ringbench.case.spec import CaseSpec, default_fields, resolve
from ringbench.variants.kernels import KERNELS

# --------------------------------------------------------------------------- the bit comparison


def test_bitwise_difference_compares_bits_not_values():
    x = torch.tensor([1.0, -0.0, float("nan"), float("-inf")])
    assert check.bitwise_difference(x, x.clone()) == (0, 0.0)  # NaN and -inf with the same bits are the same
    y = x.clone()
    y[1] = 0.0  # -0.0 == 0.0 as values, not as bits
    assert check.bitwise_difference(x, y) == (1, 0.0)
    z = x.clone()
    z[0] = torch.nextafter(z[0], torch.tensor(2.0))
    count, gap = check.bitwise_difference(x, z)
    assert count == 1 and gap == pytest.approx(torch.finfo(torch.float32).eps)
    w = x.clone()
    w[3] = 0.0  # a difference that involves a non-finite value
    assert check.bitwise_difference(x, w) == (1, math.inf)
    half = torch.ones(2, dtype=torch.bfloat16)
    assert check.bitwise_difference(half, half.clone()) == (0, 0.0)


def test_bitwise_difference_of_a_missing_or_malformed_result_is_every_element():
    assert check.bitwise_difference(None, None) == (0, 0.0)
    assert check.bitwise_difference(torch.ones(3), None) == (3, math.inf)
    assert check.bitwise_difference(torch.ones(3), torch.ones(4)) == (3, math.inf)
    assert check.bitwise_difference(torch.ones(3), torch.ones(3, dtype=torch.float64)) == (3, math.inf)


# --------------------------------------------------------------------------- the verdict

def _repeated(*differing: str, repeat: int = 2) -> dict:
    if not differing:
        return {"repeats": repeat, "deterministic": True, "first_difference": None, "differing_tensors": []}
    return {"repeats": repeat, "deterministic": False, "differing_tensors": list(differing),
            "first_difference": {"tensor": differing[0], "repeat": repeat, "elements": 3, "max_abs_diff": 1e-7}}


def test_verdict_fails_any_difference_where_nothing_is_documented():
    assert check.determinism_verdict(_repeated(), documented="", require=True) is None
    assert check.determinism_verdict({"repeats": 1, "deterministic": None}, documented="", require=True) is None
    reason = check.determinism_verdict(_repeated("dq", "dk"), documented="", require=False)
    assert reason == ("not deterministic: dq of repeat 2 differs bitwise from repeat 1 (3 elements, max |diff| "
                      "1e-07); also differing: dk")


def test_verdict_records_documented_backward_nondeterminism_and_fails_it_only_when_required():
    documented = "the kernel's own documentation"
    assert check.determinism_verdict(_repeated("dq", "dv"), documented=documented, require=False) is None
    required = check.determinism_verdict(_repeated("dq"), documented=documented, require=True)
    assert required.startswith("not deterministic: dq of repeat 2") and "--require-deterministic is set" in required
    # The forward pass is no kernel's excuse: out or lse that differ always fail.
    forward = check.determinism_verdict(_repeated("lse", "dq"), documented=documented, require=False)
    assert forward.startswith("not deterministic: lse of repeat 2")


def test_kernels_say_which_backward_is_documented_nondeterministic_and_where():
    assert KERNELS["cpu"].nondeterministic_backward == KERNELS["math"].nondeterministic_backward == ""
    assert "flash_attn_interface.py" in KERNELS["flash-attn"].nondeterministic_backward
    for name in ("torch-flash", "cudnn", "torch-efficient"):
        text = KERNELS[name].nondeterministic_backward
        assert "defaults to a non-deterministic algorithm" in text and "attention_backward.cu" in text, name


# --------------------------------------------------------------------------- the field rows

def _spec(variant: str = "ring", **changes) -> CaseSpec:
    return CaseSpec.from_dict({**default_fields("cpu", 0), "task": "verify", "variant": variant, **changes})


def test_repeat_rows_are_verify_options_outside_case_id():
    for name in ("repeat", "require_deterministic"):
        field = fields.BY_NAME[name]
        assert field.commands == ("verify",) and not field.in_case_id and name in fields.NOT_IN_CASE_ID
    base = _spec()
    assert base.repeat == 1 and base.require_deterministic is False
    assert _spec(repeat=5, require_deterministic=True).case_id() == base.case_id()
    # A record written before the rows existed still reads, at their defaults.
    old = {k: v for k, v in base.to_dict().items() if k not in ("repeat", "require_deterministic")}
    assert CaseSpec.from_dict(old) == base
    with pytest.raises(SpecError, match=r"^repeat 0 must be positive; pass --repeat 1 or more$"):
        fields.check("repeat", 0)


def test_repeat_zero_is_refused_before_anything_starts(tmp_path):
    result = ringbench_here("verify", "--variant", "ring", "--repeat", "0", "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and "repeat 0 must be positive" in result.stderr
    assert not (tmp_path / "verify.jsonl").exists()


# --------------------------------------------------------------------------- verify_case at world size 1

def _verify(variant: str, **changes) -> dict:
    spec = resolve(_spec(variant, seqlen=128, heads=2, kv_heads=1, head_dim=16, **changes))
    return check.verify_case(spec, device=torch.device("cpu"))


@pytest.mark.dist
def test_verify_case_repeats_the_ring_bit_for_bit(solo_group):
    found = _verify("ring", repeat=3)
    assert found["status"] == "ok", found["reason"]
    assert (found["repeats"], found["deterministic"], found["first_difference"]) == (3, True, None)
    assert found["differing_tensors"] == [] and found["nondeterministic_backward"] is None
    once = _verify("ring")
    assert (once["repeats"], once["deterministic"]) == (1, None)


@pytest.mark.dist
def test_verify_case_names_the_first_differing_tensor_and_repeat(solo_group):
    found = _verify("jitter_ring", repeat=3)
    assert all(c["passed"] for c in found["checks"])  # within every tolerance...
    assert found["status"] == "fail" and found["deterministic"] is False  # ...but never the same bits
    assert found["first_difference"]["tensor"] == "dq" and found["first_difference"]["repeat"] == 2
    assert found["first_difference"]["elements"] == 1 and found["differing_tensors"] == ["dq"]
    assert found["reason"].startswith("not deterministic: dq of repeat 2 differs bitwise from repeat 1")
    required = _verify("jitter_ring", require_deterministic=True)  # one repeat asked for: two run
    assert required["repeats"] == 2 and required["status"] == "fail"


@pytest.mark.dist
def test_verify_case_passes_documented_backward_nondeterminism_unless_required(solo_group, monkeypatch):
    """With the cpu kernel documented as nondeterministic in backward (as torch-flash is),
    jitter_ring's differing dq is recorded and passes; --require-deterministic fails it."""
    real = check.case_setup

    def documented(spec, group=None):
        setup = real(spec, group)
        return dataclasses.replace(setup, kernel=dataclasses.replace(
            setup.kernel, nondeterministic_backward="test: documented as nondeterministic"))

    monkeypatch.setattr(check, "case_setup", documented)
    found = _verify("jitter_ring", repeat=2)
    assert found["status"] == "ok" and found["reason"] is None
    assert found["deterministic"] is False and found["differing_tensors"] == ["dq"]
    assert found["nondeterministic_backward"] == "test: documented as nondeterministic"
    required = _verify("jitter_ring", repeat=2, require_deterministic=True)
    assert required["status"] == "fail" and "--require-deterministic is set" in required["reason"]


# --------------------------------------------------------------------------- the table

def _record(variant="ring", status="ok", **fields_) -> dict:
    checks = [{"tensor": t, "err": 1e-7, "allowed": 1e-6, "ratio": 0.1, "finite": True, "dtype_ok": True,
               "shape_ok": True, "passed": True} for t in tolerance.TENSORS]
    spec = {**_spec(variant).to_dict(), **fields_.pop("spec", {})}
    return {"task": "verify", "spec": spec, "status": status, "reason": None, "kernel": spec["kernel"],
            "checks": checks, "cp_active": True, **fields_}


def _table(records, width=200) -> str:
    console = Console(record=True, width=width)
    report.print_verify_table(records, console)
    return console.export_text()


def test_verify_table_shows_the_determinism_verdict():
    same = _record(**_repeated())
    differ = _record("jitter_ring", "fail", **_repeated("dq", "dk"))
    known = _record(spec={"kernel": "torch-flash", "device": "cuda"}, **_repeated("dq"),
                    nondeterministic_backward="PyTorch says so")
    once = _record(repeats=1, deterministic=None)
    text = _table([same, differ, known, once])
    lines = [line for line in text.splitlines() if re.search(r"\brepeats\b[\s│]+-[\s│]+-", line)]
    assert len(lines) == 3, text  # none for the case that ran once
    assert "PASS" in lines[0] and "deterministic over 2 repeats" in lines[0]
    assert "FAIL" in lines[1] and "not deterministic: dq, dk at repeat 2, max |diff| 1e-07" in lines[1]
    assert "WARN" in lines[2] and "not deterministic: dq at repeat 2, max |diff| 1e-07;" in lines[2]
    assert "documented for torch-flash" in text
    assert "note: torch-flash's backward is documented as nondeterministic" in text and "PyTorch says so" in text
    assert "4 cases: 3 passed, 1 failed" in text
    narrow = _table([same, differ, known], width=80)
    assert "…" not in narrow and max(map(len, narrow.splitlines())) <= 80


def test_verify_table_says_a_model_check_ran_once():
    record = _record(spec={"hf_model": "llama-tiny", "repeat": 2}, cp_active=None)
    assert "a model check runs once" in " ".join(_table([record]).split())


# --------------------------------------------------------------------------- under torchrun

@pytest.mark.slow
@pytest.mark.dist
def test_cli_verify_repeat_llama3_varlen_is_deterministic(tmp_path):
    result = ringbench_here("verify", "--repeat", "2", "--variant", "llama3_varlen", "--world-size", "4",
                            "--seqlen", "704", "--docs", "698,6", "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (record,) = read_jsonl(tmp_path / "verify.jsonl")
    assert record["status"] == "ok" and record["spec"]["repeat"] == 2
    assert (record["repeats"], record["deterministic"], record["first_difference"]) == (2, True, None)
    assert record["cp_active"] is True and record["cp_active_reason"] is None
    # The repeats row: its note ("deterministic over 2 repeats") may fold at 80 columns.
    assert re.search(r"\brepeats\b[\s│-]*PASS\b.*\bdetermin", result.stdout), result.stdout


@pytest.mark.slow
@pytest.mark.dist
def test_cli_verify_fails_the_nondeterministic_variant(tmp_path):
    """One launch, two cases: jitter_ring with --repeat 2, and with --require-deterministic alone
    (at another seqlen: cases that differ only in repeat share a case_id, which a sweep refuses)."""
    scenario = tmp_path / "jitter.toml"
    scenario.write_text('[defaults]\ndevice = "cpu"\nvariant = "jitter_ring"\nworld_size = 2\nseqlen = 256\n'
                        'heads = 2\nkv_heads = 1\nhead_dim = 16\n\n'
                        '[[case]]\nrepeat = 2\n\n[[case]]\nrequire_deterministic = true\nseqlen = 128\n')
    result = ringbench_here("verify", "--scenario", str(scenario), "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    records = read_jsonl(tmp_path / "verify.jsonl")
    assert [(r["spec"]["repeat"], r["spec"]["require_deterministic"]) for r in records] == [(2, False), (1, True)]
    for record in records:
        assert record["status"] == "fail" and all(c["passed"] for c in record["checks"])
        assert record["repeats"] == 2 and record["deterministic"] is False
        assert record["first_difference"]["tensor"] == "dq" and record["first_difference"]["repeat"] == 2
        assert record["reason"].startswith("not deterministic: dq of repeat 2 differs bitwise from repeat 1")
    assert "2 cases: 0 passed, 2 failed" in result.stdout
