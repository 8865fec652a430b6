"""The packed-documents (varlen) variants under real torchrun (gloo, CPU).

Two launches, each run once and cached for the module:

- world size 4, ``tests/dist/varlen_cases.py``'s cases, run by ``tests/dist/verify_cases.py`` in the session's
  pooled launch of four ranks (``helpers.VerifyPool``): verify cases through the harness's own
  ``ringbench.rank.check.verify_case`` (each variant against the float64 math kernel and the same
  kernel's varlen call over the whole packed row, MEASUREMENT.md's rule), and calls with a bad
  ``cu_seqlens`` whose error messages every rank records;
- world size 2, the real worker path (``python -m ringbench.rank.worker``) with a verify case whose
  documents were drawn from a distribution, a verify case with documents that straddle ranks,
  and a timed run case.

The first cases are the issue's: documents 128, 1120 and 2992 at world size 4, every varlen
variant, causal and not; documents 100, 900 and 3096, which llama3_varlen takes. About 70 s
on two CPU cores, most of it the float64 references of the 4240-token cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import pool_verify_batches, run_torchrun
from ringbench.case.spec import CaseSpec, default_fields, resolve_docs, validate

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
PG_TIMEOUT_S = 150
VARLEN = ("ring_varlen", "zigzag_varlen", "llama3_varlen")
ISSUE_DOCS = "128,1120,2992"


def spec(variant: str, docs: str = "", world_size: int = 4, **fields) -> dict:
    """A resolved, validated CPU verify spec (bf16, cpu kernel, GQA 2:1, head dim 16) as the worker gets it."""
    base = {"task": "verify", "variant": variant, **default_fields("cpu", 0), "kernel": "cpu",
            "world_size": world_size, "heads": 2, "kv_heads": 1, "head_dim": 16, "dtype": "bf16", "seed": 5,
            "docs": docs}
    base.update(fields)
    if docs and "seqlen" not in fields:
        base["seqlen"] = sum(int(d) for d in docs.split(","))
    case = resolve_docs(CaseSpec(**base))
    validate(case, visible_gpus=0)
    return case.to_dict()


def _verify_cases() -> list[dict]:
    cases = []
    for variant in VARLEN:
        for causal in (True, False):
            cases.append({"name": f"issue_{variant}_{'causal' if causal else 'full'}",
                          "spec": spec(variant, ISSUE_DOCS, causal=causal)})
    # 100 = 4 * 25 is a multiple of W = 4, so ring_varlen takes these documents at W=4
    # (zigzag_varlen, which needs 2W = 8, does not: see test_varlen_units).
    cases.append({"name": "docs_100_900_3096_llama3_varlen", "spec": spec("llama3_varlen", "100,900,3096")})
    cases.append({"name": "docs_100_900_3096_ring_varlen", "spec": spec("ring_varlen", "100,900,3096")})
    # Rank rows are 16 tokens: empty documents on a rank boundary and inside, one-token documents,
    # a document that ends on a boundary, one that straddles ranks 1 and 2.
    edges = "0,1,15,0,1,1,30,0,16"
    for causal in (True, False):
        cases.append({"name": f"edges_llama3_varlen_{'causal' if causal else 'full'}",
                      "spec": spec("llama3_varlen", edges, causal=causal)})
    cases.append({"name": "one_token_docs_llama3_varlen", "spec": spec("llama3_varlen", ",".join(["1"] * 64))})
    cases.append({"name": "straddle_all_ranks_llama3_varlen_stride1",
                  "spec": spec("llama3_varlen", "3,58,3", heads=4, kv_heads=2, heads_k_stride=1)})
    cases.append({"name": "empty_docs_ring_varlen_math_fp32",
                  "spec": spec("ring_varlen", "0,64,0,192", kernel="math", dtype="fp32")})
    cases.append({"name": "empty_docs_zigzag_varlen", "spec": spec("zigzag_varlen", "0,64,0,192")})
    return [{"kind": "verify", **c} for c in cases]


def _bad_cu_cases() -> list[dict]:
    base = {"kind": "bad_cu", "kernel": "cpu", "seqlen": 64}
    return [
        {**base, "name": "bad_cu_int64", "variant": "llama3_varlen", "cu": [0, 64], "cu_dtype": "int64"},
        {**base, "name": "bad_cu_ends_short", "variant": "ring_varlen", "seqlen": 65536, "cu": [0, 8192]},
        {**base, "name": "bad_cu_not_from_zero", "variant": "llama3_varlen", "cu": [4, 64]},
        {**base, "name": "bad_cu_decreasing", "variant": "zigzag_varlen", "cu": [0, 40, 32, 64]},
        {**base, "name": "bad_cu_differs_between_ranks", "variant": "llama3_varlen",
         "cu_by_rank": [[0, 16, 64]] * 3 + [[0, 32, 64]]},
        {**base, "name": "bad_cu_one_rank_invalid", "variant": "ring_varlen",
         "cu_by_rank": [[0, 64], [0, 64], [0, 60], [0, 64]]},
        {**base, "name": "bad_cu_ring_document_rule", "variant": "ring_varlen", "cu": [0, 30, 64]},
        {**base, "name": "bad_cu_zigzag_document_rule", "variant": "zigzag_varlen", "cu": [0, 4, 64]},
        {**base, "name": "bad_cu_missing", "variant": "zigzag_varlen", "cu": None},
    ]


CASES = _verify_cases() + _bad_cu_cases()
BY_NAME = {c["name"]: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


def _worker_cases() -> list[dict]:
    drawn = spec("zigzag_varlen", world_size=2, seqlen=2048, doc_dist="lognormal:mean=512,sigma=1", seed=3)
    straddle = spec("llama3_varlen", "100,900,1048", world_size=2, causal=True)
    run = spec("ring_varlen", "512,1536", world_size=2, task="run", iters=2, warmup=1, dtype="fp32")
    return [drawn, straddle, run]


WORKER_CASES = _worker_cases()


def _torchrun(world_size: int, args: list[str]) -> tuple[int, bool, str]:
    # A collective that never completes raises (with its traceback in the log) before the launch is killed.
    returncode, timed_out, log = run_torchrun(world_size, args, timeout_s=LAUNCH_TIMEOUT_S, cwd=ROOT,
                                              env={"CASES_PG_TIMEOUT": str(PG_TIMEOUT_S),
                                                   "RINGBENCH_PG_TIMEOUT": str(PG_TIMEOUT_S)})
    return returncode, timed_out, log[-3000:]


def _batches(world_size: int, with_slow: bool) -> dict:
    """Every case in CASES, at world size 4, for the session's pooled launch (its tests are slow):
    ``tests/dist/verify_cases.py`` runs each as ``tests/dist/varlen_cases.py`` does."""
    if world_size != 4 or not with_slow:
        return {}
    return {"w4": ([{**c, "script": "varlen"} for c in CASES], LAUNCH_TIMEOUT_S)}


pool_verify_batches(__name__, _batches)


@pytest.fixture(scope="module")
def w4(verify_pool) -> dict:
    """Every case in CASES at world size 4, in the session's pooled launch of four ranks (``helpers.VerifyPool``);
    records by name, the launch's return code, timeout and log tail."""
    return verify_pool.get(__name__, 4, "w4")


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> dict:
    """The world-size-2 launch of WORKER_CASES through ``python -m ringbench.rank.worker``."""
    folder = tmp_path_factory.mktemp("varlen_worker")
    cases_file, results_file = folder / "cases.json", folder / "results.jsonl"
    cases_file.write_text(json.dumps({"run_id": "varlen-test", "cases": WORKER_CASES}))
    rc, timed_out, log = _torchrun(2, ["-m", "ringbench.rank.worker", "--cases", str(cases_file),
                                       "--results", str(results_file)])
    records = [json.loads(line) for line in results_file.read_text().splitlines()] if results_file.exists() else []
    return {"records": records, "returncode": rc, "timed_out": timed_out, "log_tail": log}


def _record(w4, name: str) -> dict:
    rec = w4["records"].get(name)
    assert rec is not None, (f"no result for {name} (rc={w4['returncode']}, timed out: {w4['timed_out']}); "
                             f"log tail:\n{w4['log_tail']}")
    for c in rec.get("checks") or []:
        print(f"{name} {c['tensor']:>3}: err {c['err']:.3e} (mean {c['mean_err']:.3e}), single {c['err_single']:.3e}, "
              f"allowed {c['allowed']:.3e}, ratio {c['ratio']:.3f}, passed {c['passed']}")
    assert rec["status"] == "ok", f"{name} raised:\n{rec.get('error')}"
    return rec


# --------------------------------------------------------------------------- the launches

@pytest.mark.dist
@pytest.mark.slow
def test_varlen_launch_checks_every_case(w4):
    assert not w4["timed_out"], w4["log_tail"]
    assert w4["returncode"] == 0, w4["log_tail"]
    assert sorted(w4["records"]) == sorted(BY_NAME)
    assert len(CASES) == 23


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in CASES if c["kind"] == "verify"])
def test_varlen_variant_passes_rule(w4, name):
    """Every check passes, and where ranks share a document, changing one rank's K/V moves another's output."""
    rec = _record(w4, name)
    assert [c["tensor"] for c in rec["checks"]] == ["out", "lse", "dq", "dk", "dv"]
    failed = [c["tensor"] for c in rec["checks"] if not c["passed"]]
    assert rec["status"] == "ok" and not failed, f"{name}: {rec['reason']}"
    # One-token documents never span two ranks: no rank sees another's keys, nothing to check.
    assert rec["cp_active"] is (None if name == "one_token_docs_llama3_varlen" else True)


def test_varlen_issue_cases_cover_every_variant_both_masks():
    names = [c["name"] for c in CASES if c["name"].startswith("issue_")]
    assert sorted(names) == sorted(f"issue_{v}_{m}" for v in VARLEN for m in ("causal", "full"))
    assert all(BY_NAME[n]["spec"]["docs"] == ISSUE_DOCS and BY_NAME[n]["spec"]["world_size"] == 4 for n in names)


# --------------------------------------------------------------------------- a bad cu_seqlens

BAD_CU_MESSAGES = {
    "bad_cu_int64": r"cu_seqlens has dtype torch\.int64, but it must be int32",
    "bad_cu_ends_short": r"cu_seqlens ends at 8192 but the packed row holds 65536 tokens",
    "bad_cu_not_from_zero": r"cu_seqlens starts at 4, but it must start at 0",
    "bad_cu_decreasing": r"cu_seqlens decreases from 40 to 32 at index 2",
    "bad_cu_differs_between_ranks": r"cu_seqlens differs between ranks 0 and 3",
    "bad_cu_ring_document_rule": r"document 1 has 30 tokens, not a multiple of world_size = 4, which ring_varlen needs",
    "bad_cu_zigzag_document_rule": (r"document 1 has 4 tokens, not a multiple of 2 \* world_size = 8, which "
                                    r"zigzag_varlen needs; make it 8"),
    "bad_cu_missing": r"zigzag_varlen takes packed documents and needs cu_seqlens",
}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD_CU_MESSAGES))
def test_varlen_bad_cu_seqlens_raises_on_every_rank(w4, name):
    """Every rank raises ValueError, prefixed with its rank, with the same sentence (so none hangs)."""
    import re

    messages = _record(w4, name)["messages"]
    print("\n".join(str(m) for m in messages))
    assert all(m is not None for m in messages), messages
    for rank, m in enumerate(messages):
        assert m.startswith(f"[rank {rank}/4] ")
        assert re.search(BAD_CU_MESSAGES[name], m), m


@pytest.mark.dist
@pytest.mark.slow
def test_varlen_one_invalid_rank_stops_all_ranks(w4):
    """Rank 2's own error names its problem; the others name rank 2, so all four raise together."""
    messages = _record(w4, "bad_cu_one_rank_invalid")["messages"]
    print("\n".join(str(m) for m in messages))
    assert "cu_seqlens ends at 60 but the packed row holds 64 tokens" in messages[2]
    for rank in (0, 1, 3):
        assert f"[rank {rank}/4] rank 2's cu_seqlens is invalid" in messages[rank]


# --------------------------------------------------------------------------- the real worker

@pytest.mark.dist
@pytest.mark.slow  # the worker launch: 5-7 s on two cores
def test_varlen_worker_path_records(worker):
    """``python -m ringbench.rank.worker`` runs varlen verify and run cases and records them ok."""
    assert not worker["timed_out"] and worker["returncode"] == 0, worker["log_tail"]
    recs = worker["records"]
    assert [r["spec"]["variant"] for r in recs] == ["zigzag_varlen", "llama3_varlen", "ring_varlen"]
    for rec in recs:
        print(rec["spec"]["variant"], rec["status"], rec.get("reason"))
        assert rec["status"] == "ok", rec.get("reason")
        assert rec["case_id"] == CaseSpec.from_dict(rec["spec"]).case_id()
    for rec in recs[:2]:
        assert len(rec["checks"]) == 5 and all(c["passed"] for c in rec["checks"])
        assert rec["cp_active"] is True


@pytest.mark.dist
@pytest.mark.slow  # the worker launch: 5-7 s on two cores
def test_varlen_worker_drawn_documents_are_recorded(worker):
    """The documents drawn from --doc-dist travel in the spec: multiples of 2W = 4 that fill 2048."""
    rec = worker["records"][0]
    docs = [int(d) for d in rec["spec"]["docs"].split(",")]
    print(docs)
    assert rec["spec"]["doc_dist"] == "lognormal:mean=512,sigma=1"
    assert sum(docs) == 2048 and len(docs) > 1 and all(d % 4 == 0 and d > 0 for d in docs)


@pytest.mark.dist
@pytest.mark.slow  # the worker launch: 5-7 s on two cores
def test_varlen_worker_run_counts_document_flops(worker):
    """A run record counts varlen FLOPs: sum over documents of 2 * L^2 * Hq * D * 3.5, per GPU."""
    rec = worker["records"][2]
    hq, d = rec["spec"]["heads"], rec["spec"]["head_dim"]
    want = sum(2.0 * L * L * hq * d * 3.5 for L in (512, 1536)) / 2
    print(rec["flops_per_gpu"], want, rec["efficiency"], rec["time_ms"], rec["ref_time_ms"])
    assert rec["flops_per_gpu"] == pytest.approx(want)
    assert rec["bytes_sent"] > 0 and rec["efficiency"] > 0 and rec["time_ms"] > 0
