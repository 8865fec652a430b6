"""Context parallelism proven, never assumed: what verify and run say where they cannot prove it.

- verify: where the cp-active check cannot run (world size 1; packed documents none of which
  crosses a rank boundary, so ``Placement.watch`` is None) the record says why
  (``cp_active_reason``) and the table shows ``cp-active n/a`` with a one-word why (``local``).
- run: where the bytes are not counted (``Variant.traffic_counted=False``, torch_cp; here the
  hidden ``uncounted_peer``) the record says ``bytes_counted: false`` and the table shows
  ``not counted`` in the bus column with a pointer to ``ringbench verify``.
"""

from __future__ import annotations

import re

import pytest
import torch
from rich.console import Console

from helpers import read_jsonl, ringbench_here
from ringbench.rank import check, tolerance
from ringbench.present import report
from ringbench.case.spec import CaseSpec, default_fields, resolve
from ringbench.rank.setup import CaseSetup
from ringbench.variants import get_variant
from ringbench.variants.kernels import get_kernel

NO_CROSSING = "no document crosses a rank boundary, so no rank needs another's K/V"


def _placement(variant: str, world_size: int, docs=None, causal=True) -> check.Placement:
    # Rank 0's CaseSetup of the case, built without a process group (case_setup asks the group).
    v = get_variant(variant)
    spec = CaseSpec.from_dict({**default_fields("cpu", 0), "task": "verify", "variant": variant,
                               "world_size": world_size, "causal": causal,
                               **({"seqlen": sum(docs), "docs": ",".join(map(str, docs))} if docs else {})})
    case = CaseSetup(spec=spec, rank=0, world_size=world_size, variant=v, kernel=get_kernel("math"),
                     dtype=torch.float32, causal=causal, scale=spec.head_dim ** -0.5, options={}, layout=v.layout,
                     ulysses_degree=1, docs=docs)
    return check.Placement(case, torch.device("cpu"))


def test_placement_says_why_it_has_no_pair_of_ranks_to_watch():
    kept = _placement("llama3_varlen", 2, docs=[128, 128])  # each document on its own rank
    assert kept.watch is None and kept.unwatched == NO_CROSSING
    crossing = _placement("llama3_varlen", 4, docs=[698, 6])  # the first document spans ranks 0 to 3
    assert crossing.watch == (0, 3) and crossing.unwatched == ""
    assert _placement("zigzag_varlen", 2, docs=[128, 128]).watch is not None  # cut document by document
    batch = _placement("ring", 4)
    assert batch.watch == (0, 3) and batch.unwatched == ""


@pytest.mark.dist
def test_verify_case_at_world_size_one_says_why_cp_active_is_null(solo_group):
    spec = resolve(CaseSpec.from_dict({**default_fields("cpu", 0), "task": "verify", "variant": "zigzag",
                                       "world_size": 1, "seqlen": 128, "heads": 2, "kv_heads": 1,
                                       "head_dim": 16}))
    found = check.verify_case(spec, device=torch.device("cpu"))
    assert found["status"] == "ok" and found["cp_active"] is None
    assert found["cp_active_reason"].startswith("world size 1: ")


def _record(**fields) -> dict:
    spec = {**default_fields("cpu", 0), "task": "verify", "variant": "llama3_varlen", "seqlen": 256,
            "docs": "128,128"}
    checks = [{"tensor": t, "err": 1e-7, "allowed": 1e-6, "ratio": 0.1, "finite": True, "dtype_ok": True,
               "shape_ok": True, "passed": True} for t in tolerance.TENSORS]
    return {"task": "verify", "spec": spec, "status": "ok", "reason": None, "kernel": "cpu", "checks": checks,
            **fields}


def _verify_table(records, width=200) -> str:
    console = Console(record=True, width=width)
    report.print_verify_table(records, console)
    return console.export_text()


def test_verify_table_shows_why_context_parallelism_was_not_proven():
    records = [_record(cp_active=None, cp_active_reason=NO_CROSSING),
               _record(cp_active=False, status="fail", reason="changing one rank's K/V ..."),
               _record(cp_active=True, cp_active_reason=None),
               _record(cp_active=None)]  # a model check, or a record older than the reason: nothing to say
    text = _verify_table(records)
    rows = [line for line in text.splitlines() if re.search(r"\bcp-active\b", line)]
    assert len(rows) == 2, text
    assert [c.strip() for c in rows[0].split("│")[-3:-1]] == ["n/a", "local"]  # short; the record says why
    assert "FAIL" in rows[1] and "left another rank's output unchanged" in rows[1]
    narrow = _verify_table(records, width=80)
    assert "…" not in narrow and max(map(len, narrow.splitlines())) <= 80


def _run_table(records, width=80) -> str:
    console = Console(record=True, width=width)
    report.print_run_table(records, console)
    return console.export_text()


def test_run_table_says_not_counted_where_bytes_are_not_counted():
    spec = {**default_fields("cpu", 0), "task": "run", "variant": "torch_cp", "kernel": "cudnn"}
    base = {"status": "ok", "kernel": "cudnn", "time_ms": 1.5, "imbalance": 1.01, "tflops_per_gpu": 300.0,
            "efficiency": 0.9, "peak_allocated_gib": 1.0}
    uncounted = {**base, "spec": spec, "bytes_sent": None, "bus_gib_s": None, "bytes_counted": False}
    old = {**base, "spec": {**spec, "variant": "zigzag"}, "bus_gib_s": None}  # no bytes_counted: as before
    text = _run_table([uncounted, old])
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    (row,) = [line for line in text.splitlines() if line.startswith("torch_cp")]
    assert row.rstrip().endswith("not counted")
    (zigzag,) = [line for line in text.splitlines() if line.startswith("zigzag")]
    assert zigzag.rstrip().endswith("-")
    assert "`ringbench verify --variant torch_cp` proves" in " ".join(text.split())


# --------------------------------------------------------------------------- under torchrun

@pytest.mark.slow
@pytest.mark.dist
def test_cli_verify_records_why_cp_active_cannot_be_checked(tmp_path):
    """One launch at world size 2: uncounted_peer (its communication proven, as verify proves
    torch_cp's) and llama3_varlen with each document on its own rank (nothing to prove)."""
    scenario = tmp_path / "cp.toml"
    scenario.write_text('[defaults]\ndevice = "cpu"\nworld_size = 2\nseqlen = 256\nheads = 2\nkv_heads = 1\n'
                        'head_dim = 16\n\n[[case]]\nvariant = "uncounted_peer"\n\n'
                        '[[case]]\nvariant = "llama3_varlen"\ndocs = "128,128"\n')
    result = ringbench_here("verify", "--scenario", str(scenario), "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    peer, kept = read_jsonl(tmp_path / "verify.jsonl")
    assert peer["status"] == "ok" and peer["cp_active"] is True and peer["cp_active_reason"] is None
    assert kept["status"] == "ok" and kept["cp_active"] is None and kept["cp_active_reason"] == NO_CROSSING
    # The cp-active row of the llama3_varlen case: n/a, why in one word (the record keeps the sentence).
    assert re.search(r"\bcp-active\b[\s│-]*n/a\s+local\b", result.stdout), result.stdout
    assert result.stdout.count("cp-active") == 1


@pytest.mark.slow
@pytest.mark.dist
def test_cli_run_says_not_counted_for_uncounted_peer(tmp_path):
    result = ringbench_here("run", "--variant", "uncounted_peer", "--variant", "ring", "--device", "cpu",
                            "--world-size", "2", "--seqlen", "256", "--heads", "2", "--kv-heads", "1",
                            "--head-dim", "16", "--iters", "3", "--warmup", "1", "--out", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    peer, ring = read_jsonl(tmp_path / "runs.jsonl")
    assert peer["status"] == "ok" and peer["bytes_counted"] is False
    assert peer["bytes_sent"] is None and peer["bus_gib_s"] is None
    assert ring["bytes_counted"] is True and ring["bytes_sent"] > 0
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("uncounted_peer")]
    assert row.rstrip().endswith("not counted")
    assert "`ringbench verify --variant uncounted_peer` proves that its ranks exchange data" in " ".join(
        result.stdout.split())
