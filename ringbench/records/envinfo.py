"""The environment a record was measured in: versions, device, topology, git commit; and the one
settling of that environment every worker makes first (:func:`warm_cpu_math`)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_commit() -> str | None:
    """The commit of the ringbench checkout this code runs from, ``-dirty`` when modified.

    Where the code runs from a copy without ``.git`` (a GPU machine reached by copying the
    tree), ``RINGBENCH_GIT_COMMIT`` names it.
    """
    if os.environ.get("RINGBENCH_GIT_COMMIT"):
        return os.environ["RINGBENCH_GIT_COMMIT"]
    here = Path(__file__).resolve().parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=here)
    if commit and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here):
        commit += "-dirty"
    return commit


def collect(kernel: str | None = None) -> dict:
    """Describe this machine and software stack as a JSON-ready dict (imports torch)."""
    import torch

    import ringbench

    env = {
        "ringbench": ringbench.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": None,
        "gpu_name": None,
        "gpu_count": 0,
        "topology": None,
        "flash_attn": None,
        "kernel": kernel,
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the SIMD path of CPU kernels: AVX2, AVX512...
        "torch_threads": torch.get_num_threads(),
        "git_commit": git_commit(),
        # Set only to measure the ring's merges in line against beside the kernels (variants/engines/overlap.py).
        "side_merge": os.environ.get("RINGBENCH_SIDE_MERGE"),
    }
    if torch.cuda.is_available():
        env["gpu_name"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL missing from this build
            env["nccl"] = None
        if shutil.which("nvidia-smi"):
            topo = _run(["nvidia-smi", "topo", "-m"])
            env["topology"] = re.sub(r"\x1b\[[0-9;]*m", "", topo) if topo else None
    try:
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    except Exception:  # absent or broken: the record says so by null
        pass
    return env


def warm_cpu_math() -> None:
    """Call torch's CPU float functions once each on a tiny tensor, before any multi-threaded use.

    The first call of a float unary op on CPU can race with itself across threads and return
    low-precision values (pytorch/pytorch#188792, MKL VML's first-call dispatch): with two threads,
    a first ``torch.logsumexp`` over a float64 block was off by 1e-9 in about one process in four,
    enough to fail a float64 check. A call on a tiny tensor runs on one thread and settles it.
    """
    import torch

    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(-2.0, 2.0, 12, dtype=dtype).view(3, 4)
        for fn in (torch.exp, torch.log1p, torch.expm1, torch.sigmoid, torch.tanh):
            fn(x)
        torch.log(x.abs() + 1)
        torch.logsumexp(x, -1), torch.logsumexp(x.t(), -1), torch.softmax(x, -1), torch.logaddexp(x, x)

