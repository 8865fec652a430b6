"""The Triton kernels of the ring engine's updates, run on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), where Triton imports; skipped, with the reason, where it does not (CI's
CPU torch has no Triton). On a GPU machine ``tests/test_merge_gpu.py`` checks them compiled.

- ``merge_triton.add_steps``, a backward step's dq, dk and dv adds in one launch, against
  ``merge.add_step`` one at a time (``tests/dist/triton_interpret_adds.py``);
- the engines under real torchrun with ``RINGBENCH_MERGE=triton``, so every merge and add of the
  forward and backward takes the Triton kernels, through ``ringbench verify``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringbench.variants.engines import merge

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed here, so its interpreter cannot run")
INTERPRET = {**os.environ, "TRITON_INTERPRET": "1", merge.MERGE_ENV: "triton"}


def test_add_steps_under_the_interpreter_match_one_add_at_a_time():
    script = Path(__file__).parent / "dist" / "triton_interpret_adds.py"
    proc = subprocess.run([sys.executable, str(script)], env=INTERPRET, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ok, count, worst = proc.stdout.split()
    assert ok == "ok" and int(count) > 60 and float(worst) <= 1.0


@pytest.mark.dist
@pytest.mark.slow
def test_engines_pass_verify_on_the_triton_kernels_under_the_interpreter(tmp_path):
    cases = [["--variant", "zigzag"], ["--variant", "ring_varlen", "--docs", "64,128,64"],
             ["--variant", "zigzag", "--window", "40"], ["--variant", "stripe", "--sink", "learnable"],
             ["--variant", "stripe", "--mask", "shared-prefix:64,answers=3"]]  # window.attend's folds
    for case in cases:
        proc = subprocess.run([sys.executable, "-m", "ringbench.cli", "verify", *case, "--world-size", "4",
                               "--device", "cpu", "--dtype", "bf16", "--seqlen", "256", "--heads", "4",
                               "--kv-heads", "2", "--head-dim", "32", "--out", str(tmp_path), "--json"],
                              env=INTERPRET, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (case, proc.stderr[-3000:])
        (record,) = [json.loads(line) for line in proc.stdout.splitlines()]
        assert record["status"] == "ok" and all(c["passed"] for c in record["checks"]), (case, record["reason"])
        assert record["merge_path"] == "triton", case
