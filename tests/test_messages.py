"""The CLI's one-sentence messages of issue 14: warnings on damaged results files, records compare
leaves out, --fail-if with an unknown metric, document numbers and lengths, the hf extra."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringbench.cli import app
from ringbench.records.store import append_record
from ringbench.case.spec import CaseSpec

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def _record(tflops: float = 10.0) -> dict:
    spec = CaseSpec(task="run", variant="ring", kernel="cpu", device="cpu", world_size=2, batch=1, seqlen=1024,
                    heads=4, kv_heads=2, head_dim=32, dtype="fp32", causal=True, mode="fwd", iters=3, warmup=1,
                    seed=0)
    return {"schema_version": 1, "task": "run", "run_id": "r", "case_id": spec.case_id(),
            "created_at": "2026-12-01T00:00:00+00:00", "spec": spec.to_dict(), "status": "ok", "reason": None,
            "kernel": "cpu", "time_ms": 1.0, "tflops_per_gpu": tflops, "efficiency": 0.5, "peak_allocated_gib": None}


@pytest.fixture
def damaged(tmp_path) -> Path:
    path = tmp_path / "runs.jsonl"
    append_record(path, _record())
    with open(path, "a") as f:
        f.write('{"task": "run", "trunc\n')           # line 2: cut short
        f.write("[1, 2]\n")                            # line 3: JSON, not a record
        f.write("{}\n")                                # line 4: a record with nothing in it
        f.write('{"schema_version": 99, "task": "run", "status": "ok"}\n')  # line 5: from a later ringbench
    return path


def test_compare_prints_each_damaged_line_as_one_sentence_without_python_source(damaged):
    result = runner.invoke(app, ["compare", str(damaged)])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: skipped line 2 of {damaged}, which is not a whole JSON record (Unterminated string starting "
        "at: column 17)",
        f"warning: skipped line 3 of {damaged}, which is a JSON list, not a record object",
    ]
    assert "RuntimeWarning" not in result.stderr and ".py:" not in result.stderr
    assert "read_records" not in result.stderr  # no source line under a warning


def test_compare_counts_empty_and_unknown_schema_records_as_what_they_are(damaged):
    result = runner.invoke(app, ["compare", str(damaged), "--json"])
    assert result.exit_code == 0, result.output
    assert "left out 2 records: 1 with unknown schema version 99, 1 with no task, status or spec" in result.stderr
    assert "nan" not in result.stderr
    assert len(result.stdout.splitlines()) == 1  # the schema-99 "ok" record is not a row


def test_compare_fail_if_with_an_unknown_metric_blames_fail_if_and_lists_the_metrics(damaged):
    result = runner.invoke(app, ["compare", "--baseline", str(damaged), "--candidate", str(damaged),
                                 "--fail-if", "speed:+10%"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("--fail-if 'speed:+10%' names the metric 'speed', which is unknown; use one of "
                                     "tflops, efficiency, time, memory, such as tflops:-5% or time:+5%")


VARLEN = ["verify", "--variant", "zigzag_varlen", "--world-size", "2", "--device", "cpu", "--seqlen", "4096"]


@pytest.mark.parametrize("docs, message", [
    ("-4,4100", "document 1 '-4' must be 0 or more tokens; pass lengths such as 3000,0,12k"),
    ("100,abc,3996", "document 2 'abc' is not a size; use a whole number with an optional k or M suffix, such as "
                     "4096 or 128k"),
    # The same position in --docs is the same number in the layout's rule (1-based in both); every
    # document off the multiple is named, and the --docs offered still fill --seqlen 4096.
    ("100,102,3894", "documents 2 and 3 have 102 and 3894 tokens, not multiples of 2 * world_size = 4, which "
                     "zigzag_varlen needs for every document; pass --docs 100,104,3892, pad the documents with "
                     "--doc-pad 4 --seqlen 4100, or use --variant llama3_varlen, which takes any document lengths"),
    ("102,3994", "documents 1 and 2 have 102 and 3994 tokens, not multiples of 2 * world_size = 4, which "
                 "zigzag_varlen needs for every document; pass --docs 104,3992, pad the documents with --doc-pad 4 "
                 "--seqlen 4100, or use --variant llama3_varlen, which takes any document lengths"),
    # One document of 1 token, then two of which one has 1: "token" only for the one alone.
    ("1,4092", "document 1 has 1 token, not a multiple of 2 * world_size = 4, which zigzag_varlen needs for every "
               "document; pass --docs 4,4092, or pad the documents with --doc-pad 4"),
    ("1,4092,3", "documents 1 and 3 have 1 and 3 tokens, not multiples of 2 * world_size = 4, which zigzag_varlen "
                 "needs for every document; pass --docs 4,4092,4 --seqlen 4100, pad the documents with --doc-pad 4 "
                 "--seqlen 4100, or use --variant llama3_varlen, which takes any document lengths"),
    ("1,1023,3072", "documents 1 and 2 have 1 and 1023 tokens, not multiples of 2 * world_size = 4, which "
                    "zigzag_varlen needs for every document; pass --docs 4,1020,3072, pad the documents with "
                    "--doc-pad 4 --seqlen 4100, or use --variant llama3_varlen, which takes any document lengths"),
    # More than four documents off the multiple are counted by length, not listed one by one.
    ("1,1,1,2,2,4089", "3 documents of 1 token, 2 of 2 tokens and 1 of 4089 tokens are not multiples of 2 * "
                       "world_size = 4, which zigzag_varlen needs for every document; pass --docs 4,4,4,4,4,4088 "
                       "--seqlen 4108, pad the documents with --doc-pad 4 --seqlen 4112, or use --variant "
                       "llama3_varlen, which takes any document lengths"),
    ("1,2,3,5,4085", "5 documents of 1 to 4085 tokens are not multiples of 2 * world_size = 4, which zigzag_varlen "
                     "needs for every document; pass --docs 4,4,4,4,4084 --seqlen 4100, pad the documents with "
                     "--doc-pad 4 --seqlen 4108, or use --variant llama3_varlen, which takes any document lengths"),
    # Named before the sum is refused (4098, not 4096), with documents that fill the --seqlen given.
    ("100,3998", "document 2 has 3998 tokens, not a multiple of 2 * world_size = 4, which zigzag_varlen needs for "
                 "every document; pass --docs 100,3996, pad the documents with --doc-pad 4 --seqlen 4100, or use "
                 "--variant llama3_varlen --seqlen 4098, which takes any document lengths"),
])
def test_docs_messages_count_documents_from_1(docs, message):
    result = runner.invoke(app, [*VARLEN, "--docs", docs])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == message


def test_docs_take_empty_documents():
    from ringbench.case.fields import parse_docs

    assert parse_docs("0,4096,0k") == [0, 4096, 0]


def test_verify_model_without_transformers_names_the_one_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    result = runner.invoke(app, ["verify", "--model", "llama-tiny"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "verify --model needs transformers, which is not installed; install the hf extra with pip install -e "
        "'.[hf]' from the root of the ringbench checkout")
    assert re.fullmatch(r"[^\n]+", result.stderr.strip())  # one line


def test_install_hints_are_one_and_the_same(monkeypatch):
    """A peer's missing library said `pip install ring-flash-attn`, yunchang's `pip install 'ringbench[peers]'`
    (issue 27): both now give the checkout's `pip install -e '.[peers]'`, and no source says otherwise."""
    import importlib.util
    from pathlib import Path

    from ringbench.variants.peers import rfa, yunchang

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ring_flash_attn" else real_find_spec(name, *a))
    with pytest.raises(ModuleNotFoundError) as got:
        rfa._locations()
    assert str(got.value) == "ring-flash-attn is not installed (pip install -e '.[peers]' from the root of the " \
                             "ringbench checkout)"
    monkeypatch.setitem(sys.modules, "yunchang", None)  # as if it were not installed
    assert yunchang.unavailable_reason().endswith("; pip install -e '.[peers]' from the root of the ringbench checkout")
    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("ringbench", "variants") for p in (root / d).rglob("*.py")]
    assert len(sources) > 20
    for path in sources:
        text = path.read_text()
        for wrong in ("pip install ring-flash-attn", "pip install yunchang", "pip install 'ringbench["):
            assert wrong not in text, f"{path}: {wrong}"


# --------------------------------------------------------------------------- issue 27, item 4: a new user's leftovers

def test_plural_agrees_with_every_count():
    from ringbench.variants import plural

    assert [plural(n, "case") for n in (0, 1, 2)] == ["0 cases", "1 case", "2 cases"]
    assert plural(1, "launch", "launches") == "1 launch" and plural(3, "launch", "launches") == "3 launches"
    assert [plural(n, "has", "have", bare=True) for n in (0, 1, 2)] == ["have", "has", "have"]


def test_verify_summary_says_1_error_not_1_errors():
    from ringbench.present.report import summary_line

    assert summary_line([{"task": "verify", "status": "error"}]).plain == "1 case: 0 passed, 0 failed, 1 error"
    assert summary_line([{"task": "verify", "status": "oom"}] * 2).plain == "2 cases: 0 passed, 0 failed, 2 errors"


def test_compare_left_out_counts_agree_with_their_nouns():
    from ringbench.present.compare.load import left_out_text

    assert left_out_text({("older record of a case shown with its latest",
                           "older records of cases shown with their latest"): 1,
                          ("verify record", "verify records"): 2}) == (
        "left out 3 records: 1 older record of a case shown with its latest, 2 verify records")


def test_no_message_pluralises_a_count_by_hand():
    """Count-noun agreement has one home (variants.rules.plural): '1 older records', '1 errors' and
    '0 of 1 case have' came from f-strings that wrote the noun, or its s, themselves."""
    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("ringbench", "variants") for p in (root / d).rglob("*.py")]
    assert len(sources) > 20
    by_hand = re.compile(r"""\{['"](s|es)['"] if |else ['"](s|es)['"]\}|['"]s['"] if [\w()\[\]'". ]+ != 1""")
    found = [f"{p.relative_to(root)}:{i}" for p in sources for i, line in enumerate(p.read_text().splitlines(), 1)
             if by_hand.search(line)]
    assert found == []


@pytest.mark.parametrize("lines, lacking", [
    (["{}"], "1 with no task, status or spec"),
    (["{}", "{}"], "2 with no task, status or spec"),
    (['{"task": "run"}'], "1 with no status or spec"),
    (['{"status": "ok"}'], "1 with no task or spec"),
])
def test_compare_on_records_without_fields_names_the_file_and_what_they_lack(tmp_path, lines, lacking):
    """`compare` on a file of `{}` blamed --by ('variant' is not a record column), an option the user never gave."""
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    for by in ([], ["--by", "variant"]):
        result = runner.invoke(app, ["compare", str(path), *by])
        assert result.exit_code == 2, result.output
        total = f"{len(lines)} record{'' if len(lines) == 1 else 's'}"
        assert result.stderr.strip() == (f"no usable run record in {path} (left out {total}: {lacking}); pass the "
                                         "results of `ringbench run`")


def test_compare_still_blames_a_by_column_that_usable_records_lack(damaged):
    result = runner.invoke(app, ["compare", str(damaged), "--by", "colour"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1].startswith("--by 'colour' is not a record column")


def test_memory_is_said_in_binary_units():
    """MEASUREMENT.md: memory in GiB (and MiB), computed as such; the estimate's refusal said GB and MB."""
    root = Path(__file__).resolve().parent.parent
    sources = [p for d in ("ringbench", "variants") for p in (root / d).rglob("*.py")]
    decimal = re.compile(r"\}\s?[kKMGT]B\b|/ ?1e[369]\b[^\n]*[kKMGT]B\b")
    found = [f"{p.relative_to(root)}:{i}" for p in sources for i, line in enumerate(p.read_text().splitlines(), 1)
             if decimal.search(line)]
    assert found == []
