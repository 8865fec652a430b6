"""What every test module shares.

- The helpers of ``tests/helpers.py`` (the CLI run as a user runs it, ``read_jsonl``, live
  process command lines): this folder is put on ``sys.path`` so a test imports them with
  ``from helpers import ...``, under any ``--import-mode``. No test module imports another.
- The markers (registered in pyproject.toml, ``--strict-markers``): ``dist`` starts torchrun or a
  process group, ``slow`` is left out of the quick run (``pytest -m "not slow"``), ``gpu`` needs
  CUDA and is skipped, with the reason, where no CUDA device is visible.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# The test-only variants (broken_merge, fault_*, ...) are found only under this variable;
# the CLI's subprocesses and their torchrun workers inherit it.
os.environ["RINGBENCH_TEST_VARIANTS"] = "1"

# In-process checks settle torch's first-call CPU math as the workers do (pytorch/pytorch#188792).
from ringbench.records.envinfo import warm_cpu_math  # noqa: E402

warm_cpu_math()


@pytest.fixture
def solo_group(tmp_path):
    """A world-size-1 gloo process group on a FileStore, destroyed after the test."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    """Skip every ``gpu`` test, with the reason, on a machine without a visible CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no CUDA device is visible (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def verify_pool(request, tmp_path_factory):
    """The session's pooled ``tests/dist/verify_cases.py`` launches (``helpers.VerifyPool``): one per world size."""
    from helpers import VerifyPool

    return VerifyPool(request.session, tmp_path_factory)


@pytest.fixture(scope="session")
def cli_verify_pool(request, tmp_path_factory):
    """The session's pooled ``ringbench verify`` commands (``helpers.CliVerifyPool``): one per world size."""
    from helpers import CliVerifyPool

    return CliVerifyPool(request.session, tmp_path_factory)


@pytest.fixture
def rate_measured_once(monkeypatch):
    """The CPU's matmul rate measured once in this process, not again before each launch.

    Before each launch the CLI measures the rate again (``sweep.estimate.remeasure``: the watchdog's
    limits under the load of the moment, 0.2 s of matmuls). Where every launch is a stand-in launcher's
    (the CLI's usage, exit-code and output-path tests), the rate measured first serves them all;
    ``tests/test_estimate.py`` checks the measuring again itself.
    """
    from ringbench.sweep import estimate

    monkeypatch.setattr(estimate, "remeasure", lambda: None)


@pytest.fixture(scope="session")
def cli_run_pool(request, tmp_path_factory):
    """The session's pooled ``ringbench run`` command (``helpers.CliRunPool``): one launch per world size."""
    from helpers import CliRunPool

    return CliRunPool(request.session, tmp_path_factory)
