"""ring with ``--layout balanced`` under real torchrun (gloo, CPU): every rank holds the chunks the mask
planner gives it (``variants/engines/mask_balance.py``) and every block takes its global positions from
that plan; verify holds it to the float64 math kernel under the dense mask (the max rule, the block
decomposition and cp-active), in fp64, whose floor scales with the world size. Every world size is slow
(2 takes 11 s on two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import read_jsonl, ringbench_here, slow_when

DATA = Path(__file__).parent / "data" / "masks"


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [slow_when(2, True), slow_when(4, True), slow_when(8, True)])  # W=2: 11 s
def test_ring_balanced_verifies_under_masks(tmp_path, world_size):
    out = tmp_path / "out"
    proc = ringbench_here("verify", "--device", "cpu", "--kernel", "math", "--dtype", "fp64", "--variant", "ring",
                          "--layout", "balanced", "--mask", "shared-prefix:64,answers=4", "--mask", "prefix:96",
                          "--mask-file", str(DATA / "image_in_text.txt"), "--seqlen", "256",
                          "--world-size", str(world_size), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    records = read_jsonl(out / "verify.jsonl")
    assert len(records) == 3
    for r in records:
        assert r["status"] == "ok" and r["spec"]["layout"] == "balanced", r["reason"]
        assert r["cp_active"] is True
        assert r["predicted_max_over_mean"] == pytest.approx(r["predicted_max_over_mean_by_layout"]["balanced"])
