"""A rank's lifeline: a worker never outlives the torchrun that started it.

``sweep.launch`` runs torchrun inside ``sweep.torchrun``, which puts torchrun's pid in
:data:`TORCHRUN_PID_ENV`; the worker calls :func:`die_with_torchrun` first thing.
"""

from __future__ import annotations

import os
import signal
import sys

#: Set in torchrun's environment by ``sweep.torchrun`` (torchrun's own pid); the workers it
#: starts compare it with their parent's pid (see :func:`die_with_torchrun`).
TORCHRUN_PID_ENV = "RINGBENCH_TORCHRUN_PID"
_PR_SET_PDEATHSIG = 1


def signal_on_parent_death(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only:
    ``prctl(PR_SET_PDEATHSIG)``); the caller then checks that the parent is still there."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_torchrun() -> None:
    """Make this worker die (SIGKILL) when the torchrun that started it dies; call it first.

    Only under this module's launch on Linux (torchrun's pid in ``RINGBENCH_TORCHRUN_PID``);
    elsewhere it does nothing. When torchrun is already gone by the time this runs, the worker
    ends at once (exit status 1) instead of running cases nobody watches.
    """
    expected = os.environ.get(TORCHRUN_PID_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    signal_on_parent_death(signal.SIGKILL)
    if os.getppid() != int(expected):
        sys.stderr.write(f"ringbench: torchrun (pid {expected}) has ended; this rank does not start\n")
        sys.stderr.flush()
        os._exit(1)
