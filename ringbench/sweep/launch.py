"""Run one torchrun job of the worker: free port, per-rank logs, watchdog and root cause.

The job runs in its own process session with its output in files, so the CLI's terminal
stays clean and a hung job can be killed as a whole. torchrun (2.x) starts each worker in a
session of its own too, so on timeout this module first asks torchrun to stop its workers
(SIGTERM), then kills torchrun's session and every worker it can still find.

No job outlives the process that launched it, however that process ends (``kill -9``, a
closed terminal): torchrun runs inside ``ringbench.sweep.torchrun``, which on Linux sets
``PR_SET_PDEATHSIG`` (SIGTERM: torchrun then stops its workers itself), and each worker calls
``rank.lifeline.die_with_torchrun`` first thing (SIGKILL when torchrun dies). The results file's lease
(``ringbench.sweep.lease``) is passed down to torchrun, so it is held until torchrun has ended.
Torchrun's own output (its failure report included) stays in ``torchrun.stderr.log``; a
failure is told by its root cause only (the first failing rank, its exception or signal), read
from the ranks' ``error.json`` and, for a rank that left none (killed by a signal), from the
exit statuses torchrun saw (``torchrun.failures.json``), never from torchrun's text.

Layout of ``log_dir`` after a launch:

- ``cases.json``: what the worker was given;
- ``torchrun.stdout.log``, ``torchrun.stderr.log``: the launcher's own output;
- ``torchrun.failures.json``: each failed rank's exit status and pid, and the root cause, when
  torchrun ended because ranks failed (``ringbench.sweep.torchrun``);
- ``torchrun/<rdzv_id>_*/attempt_0/<rank>/{stdout.log,stderr.log,error.json}``: per rank;
- ``progress/rank<r>.txt``: the progress marks each rank wrote (last line = latest).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import psutil

from ringbench.rank.lifeline import TORCHRUN_PID_ENV
from ringbench.variants import listed, plural

#: Seconds between SIGTERM and SIGKILL when a job is stopped.
TERM_GRACE_S = 10.0
#: Seconds torchrun waits for its workers after SIGTERM before it kills them itself; kept
#: below TERM_GRACE_S so torchrun usually finishes the job cleanly on its own.
TORCHRUN_SHUTDOWN_S = 5
#: Seconds between two calls of ``launch``'s ``on_poll`` while the job runs.
POLL_S = 0.5
#: Name of the environment variable that tells each rank where to write progress marks.
PROGRESS_ENV = "RINGBENCH_PROGRESS_DIR"

_TRACEBACK_LINES = 12
_STDERR_TAIL_LINES = 20
#: What ``ringbench.sweep.torchrun`` writes when ranks failed (its module docstring).
FAILURES_FILE = "torchrun.failures.json"


@dataclass
class LaunchResult:
    """The outcome of one torchrun job.

    Attributes:
        returncode: torchrun's exit status; non-zero when a rank failed or it was killed.
        timed_out: True when the watchdog stopped the job.
        log_dir: the folder with cases.json, the launcher's and every rank's logs.
        failure: None on success; otherwise a short text naming the failing rank with its
            exception and the last lines of its traceback, or, after a timeout, the case that
            passed its limit, how long it ran, and each rank's last progress mark.
        timed_out_case: after a timeout, the 0-based index of the case that passed its limit;
            None when the job timed out in its start-up, before any case started, or did not.
    """

    returncode: int
    timed_out: bool
    log_dir: Path
    failure: str | None
    timed_out_case: int | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(cases: list[dict], *, world_size: int, device: str, results_path: Path | str,
           run_id: str, timeout_s: float | Sequence[float], log_dir: Path | str | None = None,
           module: str = "ringbench.rank.worker", env: dict[str, str] | None = None,
           on_poll: Callable[[], None] | None = None, nnodes: int = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> LaunchResult:
    """Run ``python -m <module> --cases F --results R`` on ``world_size`` local ranks.

    Blocks until torchrun exits or the watchdog fires. The watchdog is per case: each case's
    clock starts when the slowest rank writes that case's start mark (``case i/n start``, see
    :func:`watched_case`) and stops it after the case's own limit, so a case that starts late
    in a launch never inherits what earlier cases spent. The start-up, before every rank has
    started case 1, runs under case 1's limit from the launch's start. On timeout, and on
    Ctrl-C, the job gets SIGTERM, then after ``TERM_GRACE_S`` seconds SIGKILL, so no process
    outlives it; a KeyboardInterrupt is re-raised after that.

    Args:
        cases: the worker's cases, each a ``CaseSpec.to_dict()``; all share ``world_size``
            and ``device``.
        world_size: ranks to start on this host.
        device: ``cuda`` or ``cpu``, checked against the cases. OMP_NUM_THREADS, when
            unset, becomes the usable cores divided by ``world_size``.
        results_path: the JSONL file rank 0 appends to.
        run_id: the run these cases belong to; names the default log folder.
        timeout_s: the watchdog's wall-clock limit of each case, in seconds: one for every
            case, or a sequence of one per case, in case order.
        log_dir: where cases.json and the logs go; default a fresh
            ``<results_path.parent>/logs/<run_id>/<nnn>-w<world_size>`` folder.
        module: the worker module to run (tests pass a stand-in).
        env: extra environment variables for the job, laid over ``os.environ``.
        on_poll: called every ``POLL_S`` seconds while the job runs, and once after it ends,
            in this thread (the CLI reads the new records there to move its progress bar).
            An exception it raises stops the job like Ctrl-C does, then propagates.
        nnodes: hosts the job spans; ``world_size`` is the total over them, so each host
            starts ``world_size // nnodes`` ranks. Default 1: everything here.
        node_rank: this host's index, 0 to ``nnodes - 1`` (global rank 0, which writes the
            records, lives on node 0).
        rdzv_endpoint: ``HOST:PORT`` of torchrun's c10d rendezvous, the same on every node;
            required when ``nnodes > 1``, else a free port on 127.0.0.1.
        rdzv_id: the rendezvous id every node passes; default ``ringbench`` plus the endpoint.

    Returns:
        A LaunchResult; a failed or timed-out job is reported there, not raised.

    Raises:
        ValueError: on an empty case list, a world_size below 1, an unknown device, a
            non-positive timeout (or a list of another length than the cases), or a case whose
            world_size/device differs.
        KeyboardInterrupt: re-raised after the job has been stopped.
    """
    limits_s = _limits(timeout_s, len(cases))
    _check_args(cases, world_size=world_size, device=device, limits_s=limits_s)
    if nnodes < 1 or world_size % nnodes or not 0 <= node_rank < nnodes:
        raise ValueError(f"nnodes ({nnodes}) must divide world_size ({world_size}) and node_rank ({node_rank}) "
                         "must be in [0, nnodes)")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError("a job over several nodes needs rdzv_endpoint HOST:PORT, the same on every node")
    results_path = Path(results_path)
    log_dir = Path(log_dir) if log_dir is not None else _fresh_log_dir(
        results_path.parent / "logs" / run_id, world_size)
    log_dir.mkdir(parents=True, exist_ok=True)
    progress_dir = log_dir / "progress"
    progress_dir.mkdir(exist_ok=True)
    cases_file = log_dir / "cases.json"
    cases_file.write_text(json.dumps({"run_id": run_id, "cases": cases}, indent=1) + "\n")

    endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
    failures_file = log_dir / FAILURES_FILE
    failures_file.unlink(missing_ok=True)  # a reused log folder's, from an earlier launch
    cmd = [
        # torchrun inside a wrapper that dies with this process and keeps the ranks' exit statuses
        sys.executable, "-m", "ringbench.sweep.torchrun", str(os.getpid()), str(failures_file),
        "-m", "torch.distributed.run",
        "--nnodes", str(nnodes),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(world_size // nnodes),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", rdzv_id or "ringbench-" + endpoint.replace(":", "-"),
        "--log-dir", str(log_dir / "torchrun"),  # may exist; torchrun adds a job subfolder
        "--redirects", "3",  # both streams of every rank to files
        "-m", module,
        "--cases", str(cases_file),
        "--results", str(results_path),
    ]
    child_env = _child_env(world_size // nnodes, progress_dir, env)
    child_env["RINGBENCH_NODE_RANK"] = str(node_rank)  # the worker's record writer lives on node 0
    # Twice the longest case limit: a collective that hangs is the watchdog's to report (with
    # every rank's progress mark), never gloo's own timeout racing it at the same moment.
    child_env.setdefault("RINGBENCH_PG_TIMEOUT", f"{2 * max(limits_s):g}")
    child_env.pop(TORCHRUN_PID_ENV, None)  # the wrapper sets it; a stale one would kill the workers

    from ringbench.sweep import lease  # the results file's lease, held by torchrun too while it lives

    with open(log_dir / "torchrun.stdout.log", "wb") as out, \
            open(log_dir / "torchrun.stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err, start_new_session=True, pass_fds=lease.held_fds())
        timed_out = False
        watch = _Watch(progress_dir, world_size // nnodes, limits_s)
        try:
            returncode = _wait(proc, watch, on_poll)
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = _stop(proc)
        except BaseException:  # Ctrl-C, SIGTERM turned into an exception, or on_poll's error
            _stop(proc)
            raise
        if on_poll is not None:
            on_poll()  # the records of the last cases

    failure = None
    if timed_out:
        failure = _timeout_text(log_dir, world_size, watch)
    elif returncode != 0:
        failure = _failure_text(log_dir, world_size, returncode)
    return LaunchResult(returncode=returncode, timed_out=timed_out, log_dir=log_dir,
                        failure=failure, timed_out_case=watch.case if timed_out else None)


_CASE_MARK = re.compile(r"^\S+ case (\d+)/\d+ (start|raised|done)\b")


def watched_case(marks: dict[int, str | None]) -> int | None:
    """The 0-based case the slowest rank is in, from each rank's last progress mark; None in the start-up.

    A rank is in case i from its ``case i/n start`` mark until its ``case i+1/n start`` (its
    ``done`` mark and the gap after it count with case i). A rank with no case mark yet (none,
    ``init_process_group``, ``ready``, or a mark of another form) is still in the start-up.
    """
    reached = []
    for mark in marks.values():
        m = _CASE_MARK.match(mark or "")
        if m is None:
            return None
        reached.append(int(m.group(1)) - 1)
    return min(reached) if reached else None


class _Watch:
    """The watchdog's clock: which case the slowest rank is in, since when, and its limit."""

    def __init__(self, progress_dir: Path, local_ranks: int, limits_s: list[float], clock=time.monotonic):
        self._progress_dir, self._local_ranks, self._limits, self._clock = progress_dir, local_ranks, limits_s, clock
        self.launch_start = self.since = clock()
        self.case: int | None = None  # None: the start-up, under case 1's limit
        self.fired_s: tuple[float, float] = (0.0, 0.0)  # (the case's, the launch's) seconds when it fired

    def _marks(self) -> dict[int, str | None]:
        """This host's ranks' last marks (files named by global rank), a None for each not written yet."""
        marks: dict[int, str | None] = {}
        for path in self._progress_dir.glob("rank*.txt"):
            tail = _tail(path, 1)
            marks[len(marks)] = tail[0] if tail else None
        while len(marks) < self._local_ranks:
            marks[len(marks)] = None
        return marks

    def poll(self) -> float:
        """Read the progress marks; return the seconds left to the current case (or start-up)."""
        now = self._clock()
        case = watched_case(self._marks())
        if case is not None and (self.case is None or case > self.case):
            self.case, self.since = case, now
        return self.since + self.limit_s - now

    @property
    def limit_s(self) -> float:
        return self._limits[min(self.case or 0, len(self._limits) - 1)]

    def ran_s(self) -> float:
        """Seconds the current case (or the start-up) has run, by this clock."""
        return self._clock() - self.since

    def fire(self) -> None:
        """Note, as the watchdog fires, how long the case and the launch had run (stopping takes more)."""
        self.fired_s = (self.ran_s(), self._clock() - self.launch_start)


def _wait(proc: subprocess.Popen, watch: _Watch, on_poll: Callable[[], None] | None) -> int:
    """Wait for ``proc`` while the watched case is within its limit, calling ``on_poll`` between waits.

    Raises:
        subprocess.TimeoutExpired: the current case (or the start-up) passed its limit with the
            job still running.
    """
    while True:
        left = watch.poll()
        if left <= 0:
            watch.fire()
            raise subprocess.TimeoutExpired(proc.args, watch.limit_s)
        try:
            return proc.wait(timeout=min(POLL_S, left))
        except subprocess.TimeoutExpired:
            pass
        if on_poll is not None:
            on_poll()


def _limits(timeout_s: float | Sequence[float], n_cases: int) -> list[float]:
    """One limit per case from ``launch``'s ``timeout_s``: a number for all, or one per case."""
    if isinstance(timeout_s, (int, float)):
        return [timeout_s] * max(1, n_cases)
    limits = list(timeout_s)
    if len(limits) != n_cases:
        raise ValueError(f"timeout_s has {len(limits)} limits for {n_cases} cases; pass one number, "
                         "or one limit per case")
    return limits


def _check_args(cases: list[dict], *, world_size: int, device: str, limits_s: list[float]) -> None:
    if not cases:
        raise ValueError("launch got no cases; pass at least one CaseSpec.to_dict()")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size ({world_size!r}) must be an int >= 1")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device ({device!r}) must be 'cuda' or 'cpu'")
    for limit in limits_s:
        if not (isinstance(limit, (int, float)) and limit > 0):
            raise ValueError(f"timeout_s ({limit!r}) must be > 0 seconds")
    for i, case in enumerate(cases):
        for key, want in (("world_size", world_size), ("device", device)):
            if key == "world_size" and case.get("emulate"):
                want = case["world_size"] if world_size == 1 else 1  # one process plays every rank
            if key in case and case[key] != want:
                raise ValueError(
                    f"case {i} has {key} {case[key]!r} but this launch uses {want!r}; one "
                    f"launch runs cases of one {key}, so group the cases by it")


def _fresh_log_dir(base: Path, world_size: int) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    n = len(list(base.iterdir()))
    while True:  # mkdir is atomic, so two launches never share a folder
        candidate = base / f"{n:03d}-w{world_size}"
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1


def _child_env(world_size: int, progress_dir: Path, extra: dict[str, str] | None) -> dict:
    env = dict(os.environ)
    env.update(extra or {})
    env[PROGRESS_ENV] = str(progress_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" not in env:
        # torchrun would set 1 and warn; on CPU that starves the kernels, so split the cores.
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS
            cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // world_size))
    # Read by recent torchrun releases (2.13 does); older ones ignore it, and our own
    # SIGKILL after TERM_GRACE_S covers them.
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN_S))
    return env


# --------------------------------------------------------------------------------------
# Stopping a job without orphans


def _descendants(root: int) -> dict[int, psutil.Process]:
    """Every live descendant of ``root`` as {pid: its psutil.Process}; empty when ``root`` is gone.

    A ``psutil.Process`` remembers its process's start time, so it never acts on a reused pid.
    """
    try:
        return {p.pid: p for p in psutil.Process(root).children(recursive=True)}
    except psutil.Error:
        return {}


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` is still the process it was and has not ended (a zombie has)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    if pgid == os.getpgrp():
        return  # never signal our own group (the CLI and the test runner live there)
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_known(procs: dict[int, psutil.Process]) -> None:
    """SIGKILL each remembered process, and its group, if it is still the same process."""
    for proc in procs.values():
        if not _running(proc):
            continue  # gone, or the pid now belongs to someone else
        try:
            _signal_group(os.getpgid(proc.pid), signal.SIGKILL)
            proc.kill()
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass


def _stop(proc: subprocess.Popen) -> int:
    """Stop torchrun and its workers: SIGTERM, grace, SIGKILL. Returns torchrun's status."""
    # Remember the workers now: once torchrun dies they are re-parented and hard to find.
    known = _descendants(proc.pid)
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        known.update(_descendants(proc.pid))
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    # torchrun may have left a stubborn worker behind, or been killed before it could act.
    _kill_known(known)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_running(p) for p in known.values()):
        time.sleep(0.05)
    return proc.returncode


# --------------------------------------------------------------------------------------
# Explaining a failure


def _rank_dirs(log_dir: Path) -> dict[int, Path]:
    """{rank: newest per-rank log folder} under the torchrun log folder."""
    dirs: dict[int, Path] = {}
    for d in sorted((log_dir / "torchrun").glob("*/attempt_*/*"),
                    key=lambda p: p.stat().st_mtime_ns):
        if d.is_dir() and d.name.isdigit():
            dirs[int(d.name)] = d  # single node, so local rank == global rank
    return dirs


def _read_error_file(path: Path) -> tuple[int, str] | None:
    """(mtime in ns, text) of torchelastic's error.json; None when absent or unreadable.

    The mtime orders the ranks' failures: it is when the rank wrote the file, at ns
    resolution, where the file's own timestamp has whole seconds.
    """
    try:
        data = json.loads(path.read_text())
        message = data["message"]
        if isinstance(message, str):
            text = message
        else:
            text = message.get("message", "")
            stack = message.get("extraInfo", {}).get("py_callstack", "").rstrip().splitlines()
            if stack and stack[-1].strip() == text.strip():
                stack.pop()  # the traceback ends with the message we already show
            if stack:
                # The innermost frames carry the cause; the outer ones are the worker's main.
                text += "\n" + "\n".join(stack[-_TRACEBACK_LINES:])
        return path.stat().st_mtime_ns, text
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _tail(path: Path, lines: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return text.rstrip().splitlines()[-lines:]


def _root_cause(dirs: dict[int, Path], world_size: int) -> str | None:
    """The first failure among the ranks' error files, or None when no rank left one."""
    errors = {}
    for rank, d in dirs.items():
        got = _read_error_file(d / "error.json")
        if got:
            errors[rank] = got
    if not errors:
        return None
    # The first rank to fail is the root cause; the others usually fail on its absence.
    rank = min(errors, key=lambda r: (errors[r][0], r))
    others = sorted(set(errors) - {rank})
    also = (f" ({plural(len(others), 'rank', bare=True)} {listed(map(str, others))} failed after it)" if others
            else "")
    return f"rank {rank}/{world_size} failed{also}: {errors[rank][1]}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _exit_text(exitcode: int, pid: int | None = None) -> str:
    """``was killed by SIGKILL (signal 9, pid 12)`` or ``exited with status 3 (pid 12)``."""
    at = f", pid {pid}" if pid else ""
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)} (signal {-exitcode}{at})"
    return f"exited with status {exitcode}" + (f" (pid {pid})" if pid else "")


def _torchrun_failures(log_dir: Path) -> tuple[dict, list[dict]] | None:
    """The ranks torchrun saw fail, from ``torchrun.failures.json``: (the root cause, the others).

    Each is ``{"rank": int, "local_rank": int, "exitcode": int, "pid": int | None}`` (and its
    ``timestamp``), the others in torchelastic's order. None when the file is absent or
    unreadable (torchrun failed before its workers ran, or was killed itself).
    """
    try:
        data = json.loads((log_dir / FAILURES_FILE).read_text())
        failures, root = data["failures"], data["root_rank"]
        (cause,) = [f for f in failures if f["rank"] == root]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cause, [f for f in failures if f["rank"] != root]


def _last_error_line(path: Path) -> str | None:
    """The last line of ``path`` that names an exception or an error, stripped; None when none does."""
    for line in reversed(_tail(path, _STDERR_TAIL_LINES * 5)):
        text = line.strip()
        if text and re.search(r"(Error|Exception|error:|Killed|Segmentation fault|Aborted)", text):
            return text
    return None


def _failure_text(log_dir: Path, world_size: int, returncode: int) -> str:
    """The failed job's root cause, in a few lines: never torchrun's raw report, which stays in its log."""
    dirs = _rank_dirs(log_dir)
    cause = _root_cause(dirs, world_size)
    if cause:
        return cause
    log = log_dir / "torchrun.stderr.log"
    report = _torchrun_failures(log_dir)
    if report is not None:
        first, others = report
        text = f"rank {first['rank']}/{world_size} {_exit_text(first['exitcode'], first['pid'])} and left no error file"
        if first["exitcode"] == -signal.SIGKILL:
            text += ": killed from outside, or by the kernel's out-of-memory killer (see dmesg)"
        stopped = [o["rank"] for o in others if o["exitcode"] == -signal.SIGTERM]
        if stopped:
            text += f"; torchrun then stopped {plural(len(stopped), 'rank', bare=True)} {listed(map(str, stopped))}"
        text += "".join(f"; rank {o['rank']} {_exit_text(o['exitcode'])} after it" for o in others
                        if o["exitcode"] != -signal.SIGTERM)
        local = first["local_rank"]
        tail = _tail(dirs[local] / "stderr.log", _STDERR_TAIL_LINES) if local in dirs else []
        if first["exitcode"] >= 0 and any("Traceback" in ln or "Error" in ln for ln in tail):
            return text + "; end of its stderr:\n" + "\n".join(tail)
        return f"{text}; torchrun's report: {log}"
    for rank in sorted(dirs):
        tail = _tail(dirs[rank] / "stderr.log", _STDERR_TAIL_LINES)
        if any("Traceback" in ln or "Error" in ln for ln in tail):
            return f"rank {rank}/{world_size} failed; end of its stderr:\n" + "\n".join(tail)
    last = _last_error_line(log)
    return (f"torchrun {_exit_text(returncode)} and no rank left an error" + (f": {last}" if last else "")
            + f"; its output: {log}")


def last_progress(log_dir: Path | str, world_size: int) -> dict[int, str | None]:
    """Each rank's latest progress mark in ``log_dir/progress``, None where it wrote none."""
    marks: dict[int, str | None] = {}
    for rank in range(world_size):
        tail = _tail(Path(log_dir) / "progress" / f"rank{rank}.txt", 1)
        marks[rank] = tail[0] if tail else None
    return marks


def _timeout_text(log_dir: Path, world_size: int, watch: _Watch) -> str:
    marks = last_progress(log_dir, world_size)
    if watch.case is None:
        head = (f"timed out after {watch.limit_s:g} s in the start-up, before every rank had started case 1 "
                "(the start-up runs under case 1's limit)")
    else:
        ran_s, launch_s = watch.fired_s
        head = (f"case {watch.case + 1}/{len(watch._limits)} timed out: it ran {ran_s:.0f} s, past its "
                f"limit of {watch.limit_s:g} s (the launch ran {launch_s:.0f} s)")
    lines = [f"{head}; last progress mark of each rank:"]
    lines += [f"  rank {r}: {m if m is not None else '(none written)'}" for r, m in marks.items()]
    cause = _root_cause(_rank_dirs(log_dir), world_size)
    if cause:  # a rank that died first often explains why the others hung
        lines.append(cause)
    lines.append(f"logs: {log_dir}")
    return "\n".join(lines)
