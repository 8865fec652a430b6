"""torchrun's own process as ``sweep.launch`` starts it: it dies with the launcher, and it leaves
its workers' failures as data.

    python -m ringbench.sweep.torchrun LAUNCHER_PID FAILURES_JSON -m torch.distributed.run ARGS...

In that order it:

1. on Linux, asks the kernel for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``; torchrun
   then stops its workers itself), and ends at once if the launcher has died already;
2. puts its own pid in ``RINGBENCH_TORCHRUN_PID`` for the workers it starts
   (``rank.lifeline.die_with_torchrun``);
3. runs torchrun's main module in this process, as ``python -m`` would, so the pid that
   ``launch`` watches is torchrun's;
4. when workers failed (torchelastic's ``ChildFailedError``), writes FAILURES_JSON before the
   error goes on up, so torchrun still prints its report to its stderr and exits 1.

FAILURES_JSON holds the facts torchelastic's report is printed from::

    {"root_rank": 1,
     "failures": [{"rank": 1, "local_rank": 1, "exitcode": -9, "pid": 4242, "timestamp": 1764547200}, ...]}

``failures`` is in torchelastic's order; ``exitcode`` is the rank's status as torchrun's wait
returned it (negative: the signal that killed it); ``timestamp`` is in whole seconds since the
epoch; ``root_rank`` is torchelastic's own root cause (``ChildFailedError.get_first_failure``:
the earliest failure). A rank killed by a signal writes no ``error.json``, and its parent,
torchrun, is the only process that learns its exit status: this file carries it out.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
from pathlib import Path

from ringbench.rank.lifeline import TORCHRUN_PID_ENV, signal_on_parent_death


def failures_record(error) -> dict:
    """FAILURES_JSON's content (module docstring) from torchelastic's ``ChildFailedError``."""
    root, _ = error.get_first_failure()
    return {"root_rank": root,
            "failures": [{"rank": rank, "local_rank": f.local_rank, "exitcode": f.exitcode, "pid": f.pid,
                          "timestamp": f.timestamp} for rank, f in error.failures.items()]}


def main(argv: list[str]) -> None:
    """Run torchrun as the module docstring says; ``argv`` is ``sys.argv[1:]``."""
    launcher, failures_path, flag, module, *args = argv
    if flag != "-m":
        sys.exit(f"ringbench: expected -m MODULE after the failures file, got {flag!r}")
    if sys.platform.startswith("linux"):
        signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != int(launcher):
        sys.exit("ringbench: the command that launched torchrun has ended; not starting it")
    os.environ[TORCHRUN_PID_ENV] = str(os.getpid())

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    sys.argv = [sys.argv[0], *args]  # run_module puts the module's path in argv[0]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except ChildFailedError as error:
        Path(failures_path).write_text(json.dumps(failures_record(error)) + "\n")
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
