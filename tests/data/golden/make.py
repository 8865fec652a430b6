"""The golden records of tests/test_golden.py: the CLI's records for fixed specs, kept to prove
that a restructure leaves them the same.

Regenerate (about 35 s on two CPU cores) only when a change to the records is meant, and say so
in the commit; never to make the golden test pass again:

    python tests/data/golden/make.py

Standalone on purpose: it uses only the CLI, so the test that imports it survives module moves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: One CLI invocation per records file (few launches: each costs seconds on CPU). verify's cases
#: differ in options a command line cannot sweep (window, sink, docs, ...), so they come from a
#: scenario file; run's from the command line's own product (4 variants x 2 seqlens, one launch).
COMMANDS = {
    "verify.jsonl": ["verify", "--device", "cpu", "--scenario", str(HERE / "verify.toml")],
    "runs.jsonl": ["run", "--device", "cpu", "--kernel", "cpu",
                   "--variant", "ring", "--variant", "zigzag", "--variant", "llama3", "--variant", "usp",
                   "--world-size", "4", "--seqlen", "256", "--seqlen", "512",
                   "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--iters", "2", "--warmup", "1"],
}
TIMEOUT_S = 300


def ringbench(args: list[str], out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m ringbench.cli ARGS --out OUT EXTRA``; raises with its output if it fails."""
    cmd = [sys.executable, "-m", "ringbench.cli", *args, "--out", str(out), *extra]
    out.mkdir(parents=True, exist_ok=True)
    # Its own session, so that a timeout kills torchrun's workers too.
    proc = subprocess.Popen(cmd, cwd=out, env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in COMMANDS.items():
            out = Path(tmp) / args[0]  # the task: run or verify
            ringbench(args, out)
            shutil.copy(out / name, HERE / name)
            print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
