"""ring with ``--layout balanced`` under real torchrun (gloo, CPU): every rank holds the chunks the mask
planner gives it (``variants/engines/mask_balance.py``) and every block takes its global positions from
that plan; verify holds it to the float64 math kernel under the dense mask (the max rule, the block
decomposition and cp-active), in fp64, whose floor scales with the world size. Every world size is slow
(2 takes 11 s on two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import command_cases, pool_cli_verify, slow_when
from ringbench.case.fields import read_mask_file

DATA = Path(__file__).parent / "data" / "masks"


def _cases(world_size: int) -> list:
    """The cases of ``verify --device cpu --kernel math --dtype fp64 --variant ring --layout balanced`` under two
    masks and a mask file, at ``world_size``."""
    return command_cases("verify", {"device": "cpu", "kernel": "math", "dtype": "fp64", "variant": ["ring"],
                                    "layout": "balanced", "seqlen": 256, "world_size": [world_size],
                                    "mask": ["shared-prefix:64,answers=4", "prefix:96",
                                             read_mask_file(str(DATA / "image_in_text.txt"))]})


# The session's pooled verify command of each world size runs them (helpers.CliVerifyPool).
pool_cli_verify(__name__, lambda world_size: _cases(world_size) if world_size in (2, 4, 8) else [])


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [slow_when(2, True), slow_when(4, True), slow_when(8, True)])  # W=2: 11 s
def test_ring_balanced_verifies_under_masks(cli_verify_pool, world_size):
    got = cli_verify_pool.get(__name__, world_size)
    assert got["result"].returncode == 0, got["result"].stdout
    records = got["records"]
    assert len(records) == 3
    for r in records:
        assert r["status"] == "ok" and r["spec"]["layout"] == "balanced", r["reason"]
        assert r["cp_active"] is True
        assert r["predicted_max_over_mean"] == pytest.approx(r["predicted_max_over_mean_by_layout"]["balanced"])
