"""``ringbench verify --model llama-tiny`` end to end: real torchrun, gloo, the Hugging Face adapter.

Three launches: the batch variant zigzag beside the hidden ``broken_merge`` (a ring that drops
a block, which the model check must catch) at world sizes 2 and 4, and the packed documents
through zigzag_varlen and llama3_varlen at world size 4. About 55 s on two CPU cores.
"""

from __future__ import annotations

import pytest

from helpers import read_jsonl, ringbench

pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # three launches, about 45 s on two CPU cores

DOCS = "40,96,8,112"  # every length a multiple of 2 * 4, as zigzag_varlen needs at world size 4


def _by_case(records: list[dict]) -> dict[tuple, dict]:
    return {(r["spec"]["variant"], r["spec"]["world_size"]): r for r in records}


def _assert_checked_every_parameter(record: dict) -> None:
    names = [c["tensor"] for c in record["checks"]]
    assert names[0] == "loss" and len(names) == 22  # the loss and 21 parameters of llama-tiny
    assert all(n.startswith("grad model.") or n == "grad lm_head.weight" for n in names[1:])
    worst = max(record["checks"][1:], key=lambda c: c["ratio"])
    assert record["worst_param"] == {"tensor": worst["tensor"], "ratio": worst["ratio"]}


def test_model_check_batch_passes_zigzag_and_catches_a_broken_variant(tmp_path):
    result = ringbench("verify", "--model", "llama-tiny", "--variant", "zigzag", "--variant", "broken_merge",
                       "--world-size", "2", "--world-size", "4", "--json", "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1  # broken_merge fails
    records = _by_case(read_jsonl(tmp_path / "verify.jsonl"))
    assert len(records) == 4 and {r["spec"]["hf_model"] for r in records.values()} == {"llama-tiny"}
    for world_size in (2, 4):
        good, bad = records["zigzag", world_size], records["broken_merge", world_size]
        assert good["status"] == "ok" and all(c["passed"] for c in good["checks"]), good["reason"]
        _assert_checked_every_parameter(good)
        assert bad["status"] == "fail" and bad["reason"].startswith("over the tolerance or malformed: loss")
        assert bad["worst_param"]["ratio"] > 10
    assert result.stdout.count("\n") == 4  # --json: the records and nothing else


def test_model_check_packed_documents_through_varlen_variants(tmp_path):
    result = ringbench("verify", "--model", "llama-tiny", "--variant", "zigzag_varlen", "--variant", "llama3_varlen",
                       "--world-size", "4", "--docs", DOCS, "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0
    records = read_jsonl(tmp_path / "verify.jsonl")
    assert len(records) == 2
    for record in records:
        assert record["status"] == "ok" and record["spec"]["docs"] == DOCS and record["cp_active"] is None
        _assert_checked_every_parameter(record)
    assert "llama-tiny zigzag_varlen W=4" in result.stdout.replace("\n", " ")
    assert " ".join(result.stdout.split()).count("worst parameter gradient grad ") == 2
