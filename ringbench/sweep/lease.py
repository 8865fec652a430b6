"""The lease a sweep holds on its results file, so that ``--resume`` never runs beside it.

``--resume`` reads the records once and runs the cases without an ok record; a sweep still
writing that file at the same time would run some of those cases too, and both would record
them (duplicates with contended timings). So every sweep holds a lease on
``OUT/.<results name>.lock`` for as long as it writes the results file:

- an ordinary sweep holds it shared: two of them may append to one file at once;
- ``--resume`` holds it exclusive: it starts only when no other sweep holds the file, and
  while it runs no other sweep starts on that file.

The lease is an ``flock`` on the lock file, so the kernel drops it when the last process
holding it ends, however it ends: a lock file left by a dead sweep is simply taken over, and
there is no stale state to clean. The lock's open file is passed to torchrun too
(:func:`held_fds`, read by ``ringbench.sweep.launch``), so a sweep whose CLI was killed holds the
file until its torchrun has stopped its workers; the workers die with torchrun
(``launch.die_with_torchrun``), and torchrun with the CLI.

Each holder writes one JSON line (pid, process start time in seconds since the epoch as
``psutil`` gives it, host, command, mode) into the lock file, so a refusal can name the sweep that holds it. When every holder named there has ended
but the lock is still held (the killed CLI's torchrun is stopping its workers), the newcomer
waits up to :data:`STOPPING_WAIT_S` seconds for it, then refuses naming the processes that
still hold the file.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

import psutil

from ringbench.errors import RingbenchError

#: Seconds a sweep waits for the processes of a sweep whose CLI has ended to let the lock go
#: (torchrun gives its workers 5 s after SIGTERM before it kills them).
STOPPING_WAIT_S = 20.0
_POLL_S = 0.1

#: File descriptors of the leases this process holds; ``launch`` passes them to torchrun.
_HELD: set[int] = set()


class LeaseHeld(RingbenchError):
    """Another live sweep holds the results file; the message names it and the file."""


def lock_path(results_path: Path) -> Path:
    """``OUT/.runs.jsonl.lock`` for ``OUT/runs.jsonl``: hidden, and no ``.jsonl`` that compare would read."""
    results_path = Path(results_path)
    return results_path.with_name(f".{results_path.name}.lock")


def held_fds() -> tuple[int, ...]:
    """The lock files' descriptors this process holds, for a child that must hold them too."""
    return tuple(sorted(_HELD))


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (``psutil``); None if it is gone.

    The start time tells a pid from its reuse.
    """
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(holder: dict) -> bool:
    """Whether the process a lock line names is still running (another host's: assumed so)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() == holder.get("start")
    except psutil.AccessDenied:
        return True  # it exists, and it is not ours to inspect
    except psutil.Error:
        return False


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()
    except psutil.Error:
        return ""


def _openers(path: Path) -> list[int]:
    """Pids of this host's processes (other than this one) that have ``path`` open."""
    target = os.path.realpath(path)
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if any(f.path == target for f in proc.open_files()):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def _holders(fd: int) -> list[dict]:
    try:
        text = os.pread(fd, 1 << 20, 0).decode("utf-8", "replace")
    except OSError:
        return []
    holders = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            holders.append(item)
    return holders


def _describe(holder: dict) -> str:
    where = "" if holder.get("host") == socket.gethostname() else f" on {holder.get('host')}"
    return (f"pid {holder.get('pid')}{where}, `{holder.get('command', '?')}`, "
            f"since {holder.get('since', '?')}")


class Lease:
    """A held lease; :meth:`release` (or leaving the ``with`` block) lets it go."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd in _HELD:
            _HELD.discard(self.fd)
            os.close(self.fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(results_path: Path, *, exclusive: bool, on_wait=None) -> Lease:
    """Take the lease of ``results_path``: exclusive for ``--resume``, shared otherwise.

    Args:
        results_path: the results file the sweep appends to (its folder exists).
        exclusive: True for a sweep that decides what to run from the records (``--resume``).
        on_wait: called once, with a sentence, when the holders have ended and this call waits
            for their processes to let the lock go.

    Raises:
        LeaseHeld: a live sweep holds the file (or, after the wait, its leftover processes do);
            one sentence naming its pid and the file.
    """
    results_path = Path(results_path)
    path = lock_path(results_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    deadline = None
    try:
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
            holders = _holders(fd)
            live = [h for h in holders if _alive(h)]
            if live or (deadline is not None and time.monotonic() > deadline):
                raise LeaseHeld(_refusal(results_path, path, exclusive, live, holders))
            if deadline is None:
                deadline = time.monotonic() + STOPPING_WAIT_S
                if on_wait is not None:
                    ended = ", ".join(str(h.get("pid")) for h in holders) or "unknown"
                    on_wait(f"the sweep that held {results_path} (pid {ended}) has ended; waiting up to "
                            f"{STOPPING_WAIT_S:g} s for its processes to stop")
            time.sleep(_POLL_S)
        me = {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(),
              "mode": "resume" if exclusive else "run",
              "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join(["ringbench", *sys.argv[1:]])}
        line = (json.dumps(me) + "\n").encode()
        if exclusive:  # no other holder is left: the old lines are history
            os.ftruncate(fd, 0)
            os.pwrite(fd, line, 0)
        else:
            os.lseek(fd, 0, os.SEEK_END)
            os.write(fd, line)
    except BaseException:
        os.close(fd)
        raise
    _HELD.add(fd)
    return Lease(fd, path)


def _refusal(results_path: Path, path: Path, exclusive: bool, live: list[dict], holders: list[dict]) -> str:
    if live:
        holder = live[-1]
        who = _describe(holder)
        if exclusive:
            return (f"another sweep ({who}) is writing to {results_path}, so --resume would run some of its cases "
                    f"a second time; wait for it to end or stop it (kill {holder.get('pid')}), then run --resume "
                    "again")
        return (f"a --resume sweep ({who}) is writing to {results_path} and chose its cases from the records it "
                f"read; wait for it to end, or pass another --out")
    openers = _openers(path)
    named = "; ".join(f"pid {p} `{_cmdline(p)[:120]}`" for p in openers) or "none found on this host"
    ended = ", ".join(str(h.get("pid")) for h in holders) or "unknown"
    return (f"the sweep that wrote to {results_path} (pid {ended}) has ended, but processes it started still hold "
            f"{path} after {STOPPING_WAIT_S:g} s ({named}); stop them, then run the command again")
