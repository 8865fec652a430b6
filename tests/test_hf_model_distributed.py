"""``ringbench verify --model`` end to end: real torchrun, gloo, the Hugging Face adapter.

llama-tiny: the batch variant zigzag beside the hidden ``broken_merge`` (a ring that drops a
block, which the model check must catch) at world sizes 2 and 4, and the packed documents
through zigzag_varlen and llama3_varlen at world size 4. The presets with windows and sinks
(issue 27): qwen2-tiny (a sliding-window layer) and gpt-oss-tiny (banded and full layers,
learnable sinks) through zigzag, llama3_varlen and usp at world sizes 2 and 4, gpt-oss-tiny
beside the hidden ``window_off_by_one`` (zigzag under a window one key wider), which must fail.

Those are the cases of four ``verify --model`` commands (:data:`COMMANDS`), built as the
command line builds them (``helpers.command_cases``) and verified together in one ``verify
--scenario`` of exactly those cases: one launch per world size, so each rank imports torch and
transformers once rather than once per command. Each test reads its command's records.
"""

from __future__ import annotations

import json

import pytest

from helpers import command_cases, read_jsonl, ringbench_here, scenario_cases, scenario_of

pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one shared run of 2 to 4 minutes

DOCS = "40,96,8,112"  # every length a multiple of 2 * 4, as zigzag_varlen needs at world size 4

#: The four ``verify --model`` commands: the model, then the case options each passes.
COMMANDS = {
    "batch": ("llama-tiny", {"variant": ["zigzag", "broken_merge"], "world_size": [2, 4]}),
    "packed": ("llama-tiny", {"variant": ["zigzag_varlen", "llama3_varlen"], "world_size": [4], "docs": DOCS}),
    "qwen2-tiny": ("qwen2-tiny", {"variant": ["zigzag", "llama3_varlen", "usp"], "world_size": [2, 4]}),
    "gpt-oss-tiny": ("gpt-oss-tiny", {"variant": ["zigzag", "llama3_varlen", "usp", "window_off_by_one"],
                                      "world_size": [2, 4]}),
}


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """The four commands' cases verified in one command; ``{name: {(variant, world_size): record}}``."""
    folder = tmp_path_factory.mktemp("model_checks")
    wanted = {name: command_cases("verify", given, model=model) for name, (model, given) in COMMANDS.items()}
    scenario = folder / "models.toml"
    scenario.write_text(scenario_of([c for cases in wanted.values() for c in cases],
                                    "the cases of four verify --model commands"))
    # The very cases the --model commands build (a case_id is the case's fields).
    assert [c.case_id() for c in scenario_cases("verify", scenario)] == \
        [c.case_id() for cases in wanted.values() for c in cases]
    result = ringbench_here("verify", "--scenario", str(scenario), "--json", "--out", str(folder), cwd=folder)
    records = {r["case_id"]: r for r in read_jsonl(folder / "verify.jsonl")}
    by_command = {name: {(c.variant, c.world_size): records.get(c.case_id()) for c in cases}
                  for name, cases in wanted.items()}
    return {"result": result, "records": list(records.values()), "by_command": by_command}


def _assert_checked_every_parameter(record: dict) -> None:
    names = [c["tensor"] for c in record["checks"]]
    assert names[0] == "loss" and len(names) == 22  # the loss and 21 parameters of llama-tiny
    assert all(n.startswith("grad model.") or n == "grad lm_head.weight" for n in names[1:])
    worst = max(record["checks"][1:], key=lambda c: c["ratio"])
    assert record["worst_param"] == {"tensor": worst["tensor"], "ratio": worst["ratio"]}


def test_model_check_run_prints_one_record_per_case_and_fails_with_the_broken_variants(checks):
    result = checks["result"]
    assert result.returncode == 1  # broken_merge and window_off_by_one fail
    printed = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda r: r["case_id"])
    assert printed == sorted(checks["records"], key=lambda r: r["case_id"])  # --json: the records, nothing else
    assert len(printed) == 20 and None not in [r for cases in checks["by_command"].values() for r in cases.values()]


def test_model_check_batch_passes_zigzag_and_catches_a_broken_variant(checks):
    records = checks["by_command"]["batch"]
    assert len(records) == 4 and {r["spec"]["hf_model"] for r in records.values()} == {"llama-tiny"}
    for world_size in (2, 4):
        good, bad = records["zigzag", world_size], records["broken_merge", world_size]
        assert good["status"] == "ok" and all(c["passed"] for c in good["checks"]), good["reason"]
        _assert_checked_every_parameter(good)
        assert bad["status"] == "fail" and bad["reason"].startswith("over the tolerance or malformed: loss")
        assert bad["worst_param"]["ratio"] > 10


def test_model_check_packed_documents_through_varlen_variants(checks):
    from rich.console import Console

    from ringbench.present import report

    records = list(checks["by_command"]["packed"].values())
    assert len(records) == 2
    for record in records:
        assert record["status"] == "ok" and record["spec"]["docs"] == DOCS and record["cp_active"] is None
        _assert_checked_every_parameter(record)
    console = Console(record=True, width=80)  # the table verify prints without --json
    report.print_verify_table(records, console)
    text = console.export_text()
    assert "llama-tiny zigzag_varlen W=4" in text.replace("\n", " ")
    assert " ".join(text.split()).count("worst parameter gradient grad ") == 2


@pytest.mark.parametrize("model", ["qwen2-tiny", "gpt-oss-tiny"])
def test_model_check_windows_and_sinks_pass_zigzag_llama3_varlen_and_usp(checks, model):
    """Each layer's window (and gpt-oss's sinks, whose gradient reaches the model's sink
    parameters) goes through the variant; loss and every parameter's gradient match the single
    device. llama3_varlen packs the row as one document, so the batch and varlen variants share
    one command."""
    records = checks["by_command"][model]
    assert len(records) == 6 + 2 * (model == "gpt-oss-tiny")
    for variant in ("zigzag", "llama3_varlen", "usp"):
        for world_size in (2, 4):
            record = records[variant, world_size]
            assert record["status"] == "ok" and all(c["passed"] for c in record["checks"]), record["reason"]
            assert record["spec"]["window"] == 40
            assert record["spec"]["sink"] == ("learnable" if model == "gpt-oss-tiny" else "none")
            names = [c["tensor"] for c in record["checks"]]
            assert names[0] == "loss" and "grad lm_head.weight" in names
            assert ("grad model.layers.1.self_attn.sinks" in names) == (model == "gpt-oss-tiny")
            assert ("grad model.layers.1.self_attn.q_proj.bias" in names)  # both architectures have q/k/v biases
    assert records["llama3_varlen", 4]["spec"]["docs"] == "256" and records["usp", 4]["spec"]["ulysses_degree"] == 2
    if model == "gpt-oss-tiny":
        for world_size in (2, 4):
            bad = records["window_off_by_one", world_size]
            assert bad["status"] == "fail" and bad["worst_param"]["ratio"] > 10, bad["reason"]
