"""A value head dim apart from the query/key one (``--head-dim-v``, MLA shapes such as 192/128).

ringbench's own variants carry v's head dim through the engine (out ``[..., Hq, Dv]``), checked
by ``ringbench verify`` against the float64 math kernel under real torchrun and gloo; kernels and
peers that assume one head dim refuse it before any process starts.
"""

from __future__ import annotations

import pytest

from helpers import pool_cli_verify, ringbench_here, scenario_text_cases, slow_when

from ringbench.errors import SpecError
from ringbench.case.spec import CaseSpec, validate

BATCH = ("ring", "zigzag", "stripe", "llama3")
VARLEN = ("ring_varlen", "zigzag_varlen", "llama3_varlen")


def _scenario(world_size: int) -> str:
    lines = ['description = "head_dim_v through every variant"',
             "[defaults]", 'device = "cpu"', 'kernel = "math"', "heads = 4", "kv_heads = 2", "head_dim = 48",
             "head_dim_v = 32", "seqlen = 256", 'dtype = "fp32"', f"world_size = {world_size}"]
    for variant in BATCH + VARLEN:
        # A window of 40 keys cuts ring steps into several kernel calls, merged at v's head dim.
        for causal, window in (("true", 0), ("false", 0), ("true", 40)):
            lines += ["[[case]]", f'variant = "{variant}"', f"causal = {causal}", f"window = {window}"]
            if variant in VARLEN:
                lines.append('docs = "96,160"')
    return "\n".join(lines) + "\n"


# The session's pooled verify command of each world size runs them (helpers.CliVerifyPool).
pool_cli_verify(__name__, lambda world_size: scenario_text_cases(_scenario(world_size)) if world_size in (2, 4) else [])


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [slow_when(2, True), slow_when(4, True)])  # 6 s and more on two cores
def test_every_variant_passes_verify_with_a_value_head_dim_of_its_own(cli_verify_pool, world_size):
    got = cli_verify_pool.get(__name__, world_size)
    print(got["result"].stdout[-3000:], got["result"].stderr[-2000:])
    assert got["result"].returncode == 0
    records = got["records"]
    assert len(records) == 3 * len(BATCH + VARLEN)
    for rec in records:
        assert rec["spec"]["head_dim_v"] == 32 and rec["status"] == "ok", rec["reason"]
        assert [c["tensor"] for c in rec["checks"]] == ["out", "lse", "dq", "dk", "dv"]
        assert all(c["passed"] and c["shape_ok"] for c in rec["checks"]), rec["spec"]["variant"]


def test_a_kernel_that_takes_one_head_dim_refuses_head_dim_v_before_any_process_starts(tmp_path):
    proc = ringbench_here("verify", "--variant", "ring", "--kernel", "cpu", "--world-size", "2", "--seqlen", "256",
                          "--head-dim", "48", "--head-dim-v", "32", "--device", "cpu", cwd=tmp_path)
    assert proc.returncode == 2
    assert " ".join(proc.stderr.split()) == (
        "head_dim_v 32 differs from head_dim 48, which the cpu kernel cannot take (it needs one head dim for q, k "
        "and v); pass another --head-dim-v, or --kernel with one of flex, math")
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("variant", ["rfa_ring", "rfa_llama3_varlen", "torch_cp"])
def test_a_peer_that_assumes_one_head_dim_refuses_head_dim_v(variant):
    device = "cuda" if variant == "torch_cp" else "cpu"  # torch_cp runs on CUDA only
    spec = CaseSpec("verify", variant, "auto", device, 2, 1, 256, 4, 2, 48, "bf16", True, "fwd_bwd", 3, 1, 0,
                    head_dim_v=32, docs="96,160" if "varlen" in variant else "")
    with pytest.raises(SpecError, match=rf"^head_dim_v 32 differs from head_dim 48, but {variant} assumes one head "
                                        r"dim for q, k and v; drop --head-dim-v or use one of ringbench's own "
                                        r"variants$"):
        validate(spec, visible_gpus=2)
