"""Ulysses and USP (issue 16): the composed layout, the head rules, --ulysses-degree, and verify under torchrun.

The distributed tests run ``ringbench verify --scenario`` (real torchrun, gloo, one launch per
world size) over ulysses, ulysses_varlen, usp and usp_varlen: causal and not, GQA with K/V heads
split and replicated, batch and packed documents, every factorization U x R of W (auto); the
yunchang peers share the world size 4 launch.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import command_cases, pool_cli_run, pool_cli_verify, ringbench_here, scenario_text_cases
from ringbench.case.spec import CaseSpec, default_fields, expand_ulysses_degree
from ringbench.variants import VARIANTS, default_ulysses_degree, factorizations, ulysses_rule
from ringbench.variants.engines import layouts


# --------------------------------------------------------------------------- the composed layout

@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_layouts_composed_round_trip(world_size, layout):
    seqlen = 2 * world_size * 3
    x = torch.arange(seqlen).view(1, seqlen)
    for u in factorizations(world_size):
        parts = [layouts.shard(x, layout, r, world_size, ulysses_degree=u) for r in range(world_size)]
        assert torch.equal(layouts.unshard(parts, layout, ulysses_degree=u), x)
        # A ring group's Ulysses parts, put together, are the ring rank's share at W / U.
        for ring_rank in range(world_size // u):
            whole = torch.cat(parts[ring_rank * u:(ring_rank + 1) * u], dim=1)
            assert torch.equal(whole, layouts.shard(x, layout, ring_rank, world_size // u))
    # U = W is the contiguous layout, whatever the base.
    full = [layouts.shard(x, layout, r, world_size, ulysses_degree=world_size) for r in range(world_size)]
    assert all(torch.equal(p, layouts.shard(x, "contiguous", r, world_size)) for r, p in enumerate(full))


def test_layouts_composed_varlen_round_trip():
    docs = [16, 0, 48, 32]  # multiples of 2 * 8
    cu = layouts.cu_seqlens_from_docs(docs)
    x = torch.arange(sum(docs)).view(1, -1)
    for world_size in (2, 4, 8):
        for u in factorizations(world_size):
            parts = [layouts.shard_varlen(x, cu, "zigzag", r, world_size, by_document=True, ulysses_degree=u)
                     for r in range(world_size)]
            back = layouts.unshard_varlen(parts, cu, "zigzag", by_document=True, ulysses_degree=u)
            assert torch.equal(back, x)
            pieces = [layouts.varlen_local_cu_seqlens(cu, "zigzag", r, world_size, by_document=True,
                                                      ulysses_degree=u)[-1].item() for r in range(world_size)]
            assert pieces == [sum(docs) // world_size] * world_size


# --------------------------------------------------------------------------- the head rule

def test_ulysses_rule_heads():
    assert ulysses_rule(8, 2, 4, "usp") is None  # K/V replicated twice
    assert ulysses_rule(8, 8, 4, "usp") is None
    assert "does not divide heads 6" in ulysses_rule(6, 2, 4, "ulysses")
    assert "neither divides kv_heads 3" in ulysses_rule(12, 3, 2, "usp")
    assert default_ulysses_degree(8, 4, 2) == 4 and default_ulysses_degree(4, 4, 4) == 4


def _spec(**fields):
    return CaseSpec.from_dict({"task": "verify", **default_fields("cpu", 0), **fields})


def test_ulysses_degree_auto_expands_to_factorizations():
    cases = expand_ulysses_degree(_spec(variant="usp", world_size=8, heads=8, kv_heads=2, ulysses_degree=-1))
    assert [c.ulysses_degree for c in cases] == [1, 2, 4, 8]
    # 4 heads: U = 8 cannot split them, so auto leaves it out.
    cases = expand_ulysses_degree(_spec(variant="usp", world_size=8, heads=4, kv_heads=2, ulysses_degree=-1))
    assert [c.ulysses_degree for c in cases] == [1, 2, 4]
    # Unset: the variant's default, written into the case.
    assert expand_ulysses_degree(_spec(variant="usp", world_size=4, heads=4))[0].ulysses_degree == 4
    assert expand_ulysses_degree(_spec(variant="ring", world_size=4))[0].ulysses_degree == 0


@pytest.mark.parametrize("args, message", [
    (["--variant", "ulysses", "--world-size", "4", "--heads", "6", "--kv-heads", "2"],
     "world_size 4 does not divide heads 6"),
    (["--variant", "usp", "--world-size", "4", "--ulysses-degree", "4", "--heads", "12", "--kv-heads", "3"],
     "neither divides kv_heads 3"),
    (["--variant", "usp", "--world-size", "4", "--ulysses-degree", "3"], "does not divide world_size 4"),
    (["--variant", "ring", "--world-size", "2", "--ulysses-degree", "2"], "ring takes no ulysses_degree"),
    (["--variant", "usp", "--ulysses-degree", "two"], "neither a whole number nor auto"),
])
def test_ulysses_refusals_exit_2(tmp_path, args, message):
    proc = ringbench_here("verify", "--device", "cpu", "--seqlen", "256", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()


def test_registry_ulysses_family():
    assert VARIANTS["usp"].ulysses == "option" and "ulysses_degree" in VARIANTS["usp"].options
    assert VARIANTS["ulysses"].ulysses == "world" and "ulysses_degree" not in VARIANTS["ulysses"].options
    assert VARIANTS["usp"].notes(heads=8, kv_heads=2, ulysses_degree=4)[0].startswith("K/V heads replicated 2 times")
    assert VARIANTS["usp"].notes(heads=8, kv_heads=2, ulysses_degree=2) == []


# --------------------------------------------------------------------------- verify under torchrun

def _cases(world_size: int) -> list[dict]:
    """The cases of one world size: heads 8, so every U of W = 1..8 splits them; kv_heads 2, so
    U above 2 replicates K/V."""
    w = world_size
    docs_any = "1,0,129,3,123"  # a one-token, an empty and a straddling document: any boundaries
    docs_2w = ",".join(str(d) for d in (2 * w, 0, 2 * w * ((96 // (2 * w)) or 1)))
    docs_2w += f",{256 - sum(int(d) for d in docs_2w.split(','))}"
    return [
        dict(variant="ulysses", causal=True, kv_heads=8, dtype="bf16"),
        dict(variant="ulysses", causal=False, kv_heads=2, dtype="fp32", batch=2),
        dict(variant="ulysses_varlen", causal=True, kv_heads=2, dtype="bf16", docs=docs_any),
        dict(variant="usp", causal=True, kv_heads=2, dtype="bf16", batch=2, ulysses_degree="auto"),
        # Every factorization causal and batch; at W = 4 and 8 one hybrid (U = 2) for the others,
        # so the W = 8 launch stays near 20 s on two cores.
        dict(variant="usp", causal=False, kv_heads=8, dtype="bf16", ulysses_degree="auto" if w <= 2 else 2),
        dict(variant="usp_varlen", causal=True, kv_heads=2, dtype="fp32", docs=docs_2w,
             ulysses_degree="auto" if w <= 2 else w // 2),
        # Attention sinks (issue 19): each rank's heads' logits join after the ring's last merge.
        dict(variant="usp", causal=True, kv_heads=2, dtype="fp32", sink="learnable", ulysses_degree=max(1, w // 2)),
        dict(variant="ulysses_varlen", causal=False, kv_heads=2, dtype="fp32", docs=docs_any, sink="off-by-one"),
        # float64: K/V replicas' gradients and d sink summed in float64 (they were summed in float32).
        dict(variant="ulysses", causal=True, kv_heads=2, dtype="fp64", kernel="math", sink="learnable"),
    ]


def _scenario(world_size: int) -> str:
    lines = ['description = "ulysses and usp under torchrun"', "[defaults]", 'device = "cpu"', 'kernel = "cpu"',
             f"world_size = {world_size}", "seqlen = 256", "heads = 8", "head_dim = 16", "seed = 3", ""]
    for case in _cases(world_size):
        lines.append("[[case]]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in case.items())
        lines.append("")
    return "\n".join(lines)


def _pooled_cases(world_size: int) -> list:
    """One world size's cases, at W=4 with yunchang's peers beside them (:data:`YC_CASES`)."""
    return scenario_text_cases(_scenario(world_size) + (YC_CASES if world_size == 4 else ""))


pool_cli_verify(__name__, _pooled_cases)


@pytest.fixture(scope="module")
def verified(cli_verify_pool):
    """``verify --scenario`` of one world size's cases (at W=4 with yunchang's peers beside them,
    :data:`YC_CASES`), in the session's pooled command of that world size (``helpers.CliVerifyPool``):
    its exit code, stderr and these cases' records."""
    def get(world_size: int) -> dict:
        got = cli_verify_pool.get(__name__, world_size)
        return {"returncode": got["result"].returncode, "stderr": got["result"].stderr, "records": got["records"]}

    return get


@pytest.mark.dist
@pytest.mark.slow  # 5 s at W=1 to 8 s at W=2 and more beyond, on two cores
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_ulysses_usp_verify_passes(verified, world_size):
    got = verified(world_size)
    assert got["returncode"] == 0, got["stderr"][-2000:]
    records = [r for r in got["records"] if not r["spec"]["variant"].startswith("yc_")]
    n_degrees = len(factorizations(world_size))
    assert len(records) == 6 + n_degrees + (2 * n_degrees if world_size <= 2 else 2)  # auto: one per factorization
    sinks = [r for r in records if r["spec"]["sink"] == "learnable"]
    assert len(sinks) == 2 and all([c["tensor"] for c in r["checks"]][-1] == "dsink" for r in sinks)
    for rec in records:
        assert rec["status"] == "ok", (rec["spec"]["variant"], rec["reason"])
        assert all(c["passed"] for c in rec["checks"])
        assert rec["cp_active"] is (None if world_size == 1 or rec["cp_active_reason"] else True)
    usp = [r for r in records if r["spec"]["variant"] == "usp" and r["spec"]["causal"] and r["spec"]["sink"] == "none"]
    assert sorted(r["spec"]["ulysses_degree"] for r in usp) == factorizations(world_size)
    for rec in records:
        degree = world_size if rec["spec"]["variant"].startswith("ulysses") else rec["spec"]["ulysses_degree"]
        replicated = degree > rec["spec"]["kv_heads"]
        assert any("K/V heads replicated" in n for n in rec.get("notes", [])) is replicated


def _bytes_run_cases() -> list:
    """``run --variant ulysses --device cpu --kernel cpu --world-size 2 --seqlen 256 --heads 4 --kv-heads 4
    --head-dim 16 --iters 1 --warmup 0``'s case, as the command line builds it."""
    return command_cases("run", {"variant": ["ulysses"], "device": "cpu", "kernel": "cpu", "world_size": [2],
                                 "seqlen": 256, "heads": 4, "kv_heads": 4, "head_dim": 16, "iters": 1, "warmup": 0})


# The session's pooled run command (--json) runs it (helpers.CliRunPool).
pool_cli_run(__name__, _bytes_run_cases)


@pytest.mark.dist
@pytest.mark.slow
def test_ulysses_bytes_counted(cli_run_pool):
    """Forward and backward all-to-all q, k, v, out, lse, dout, dq, dk, dv: (W-1)/W of each, per rank."""
    got = cli_run_pool.get(__name__)
    assert got["result"].returncode == 0
    ((rec,),) = got["printed"]  # --json printed the case's record once
    local = 128 * 4 * 16 * 4  # one [1, S/W, H, D] fp32 tensor, bytes
    lse = 128 * 4 * 4
    assert rec["bytes_sent"] == rec["bytes_received"] == (8 * local + lse) // 2


# --------------------------------------------------------------------------- compare marks the best factorization

def _run_record(variant: str, degree: int, seqlen: int, tflops: float) -> dict:
    spec = _spec(variant=variant, world_size=4, seqlen=seqlen, heads=4, kv_heads=2, ulysses_degree=degree,
                 kernel="cpu").replace(task="run")
    return {"schema_version": 1, "task": "run", "run_id": "r", "case_id": spec.case_id(),
            "created_at": "2026-12-01T00:00:00+00:00", "spec": spec.to_dict(), "status": "ok", "reason": None,
            "kernel": "cpu", "time_ms": 1.0, "tflops_per_gpu": tflops, "efficiency": tflops / 100,
            "peak_allocated_gib": None, "env": {"torch": "2.13.0+cpu", "ringbench": "0.1.0", "gpu_name": None}}


def test_compare_marks_best_factorization(tmp_path):
    from typer.testing import CliRunner

    from ringbench.cli import app
    from ringbench.records.store import append_record

    path = tmp_path / "runs.jsonl"
    for rec in (_run_record("usp", 1, 1024, 10.0), _run_record("usp", 2, 1024, 14.0), _run_record("usp", 4, 1024, 12.0),
                _run_record("usp", 1, 2048, 30.0), _run_record("usp", 2, 2048, 20.0),
                _run_record("ring", 0, 1024, 50.0)):
        append_record(path, rec)
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    result = runner.invoke(app, ["compare", str(path), "--json"])
    assert result.exit_code == 0, result.output
    rows = {(r["variant"], r["ulysses_degree"]): r for r in map(json.loads, result.stdout.splitlines())}
    assert rows[("usp", 2)]["best_factorization"] == ["1024"]
    assert rows[("usp", 1)]["best_factorization"] == ["2048"]
    assert rows[("usp", 4)]["best_factorization"] == [] and rows[("ring", 0)]["best_factorization"] == []
    assert rows[("ring", 0)]["best"] == ["1024"]  # the contest across variants still holds
    table = runner.invoke(app, ["compare", str(path)]).stdout
    assert "14.0†" in table and "† best Ulysses x ring factorization" in table


# --------------------------------------------------------------------------- the yunchang peers

#: yunchang's Ulysses, ring and USP at world size 4, as cases of that world size's scenario (its
#: defaults give seqlen 256 and the cpu kernel; seed 0 as they had in a scenario of their own).
YC_CASES = """
[[case]]
variant = "yc_ulysses"
heads = 4
kv_heads = 2
head_dim = 32
dtype = "bf16"
seed = 0
[[case]]
variant = "yc_ring"
heads = 4
kv_heads = 2
head_dim = 32
dtype = "bf16"
seed = 0
causal = false
[[case]]
variant = "yc_usp"
heads = 4
kv_heads = 2
head_dim = 32
dtype = "bf16"
seed = 0
ulysses_degree = "auto"
"""


@pytest.mark.dist
@pytest.mark.slow
def test_yunchang_peers_verify_passes(verified):
    pytest.importorskip("yunchang", reason="yunchang is not installed (the test extra installs it)")
    got = verified(4)
    assert got["returncode"] == 0, got["stderr"][-2000:]
    records = [r for r in got["records"] if r["spec"]["variant"].startswith("yc_")]
    assert sorted((r["spec"]["variant"], r["spec"]["ulysses_degree"]) for r in records) == [
        ("yc_ring", 0), ("yc_ulysses", 0), ("yc_usp", 1), ("yc_usp", 2), ("yc_usp", 4)]
    assert all(r["spec"]["world_size"] == 4 and r["spec"]["head_dim"] == 32 for r in records)
    assert all(r["status"] == "ok" and all(c["passed"] for c in r["checks"]) for r in records)
    assert all(r["cp_active"] for r in records)
