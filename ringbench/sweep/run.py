"""The sweep: one launch per world size and device, resume, signals, and the records of cases
that no launch reported.

``run_sweep`` takes the cases that ``sweep.build.build_cases`` made, launches them through a
*launcher* (``ringbench.sweep.launch`` unless a test passes another object with the same
``launch`` function), follows the records as they are appended, and gives every case a record
whatever happens to its launch (``ringbench.records.build``).

Exit codes (:class:`Outcome`, the table in docs/operations.md): 0 every case passed, 1 a case failed
(fail, oom, error) and every case reported its own record, 3 a launch failed or timed out
before some case reported (a rank died or was killed, or the watchdog fired; the sweep recorded
that case as error, oom or timeout), whatever else failed, 130/143 interrupted by
SIGINT/SIGTERM (the records so far are kept).
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import ProgressColumn
from rich.text import Text

from ringbench.case import fields
from ringbench.records import build as records, store as results
from ringbench.case.spec import launch_world_size
from ringbench.variants import plural

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUN = 0, 1, 2, 3


# --------------------------------------------------------------------------- execution

@dataclass
class Outcome:
    """What a sweep left: every case's record (in case order), how many records it appended,
    and the command's exit code."""

    records: list[dict]
    written: int
    exit_code: int

def results_file(out: Path, task: str) -> Path:
    """Where a command's records go: ``OUT/runs.jsonl`` for run, ``OUT/verify.jsonl`` for verify."""
    return out / ("runs.jsonl" if task == "run" else "verify.jsonl")


def run_sweep(cases: list, *, task: str, out: Path, timeout_s: Optional[float] = None, resume: bool = False,
              nodes: Optional[dict] = None, skipped: Optional[dict[str, str]] = None, launcher=None,
              yes: bool = False) -> Outcome:
    """Launch the cases, one launch per (world_size, device), and give every case a record.

    The cases in ``skipped`` (case_id -> reason) are not launched; each gets a ``skipped`` record.
    A progress bar on stderr counts cases: it moves as the records appear in the results file
    (read between waits on the job, see ``launch``'s ``on_poll``), with an ETA from the
    estimate (``ringbench.sweep.estimate``) from the first case on. Ctrl-C or SIGTERM stops
    the job and keeps every record written so far (exit 130 or 143, no records in the
    outcome); ``--resume`` then runs the rest.

    Before anything starts, the cases to run are estimated (one line on stderr) and, unless
    ``yes``, refused on CPU when the sweep would pass 30 minutes or its ranks do not fit the
    machine's cores or memory. The sweep holds the results file's lease (``ringbench.sweep.lease``)
    while it runs: shared, or exclusive with ``resume``, which therefore never starts beside
    another live sweep of that file. A refusal prints one red sentence and gives exit code 2
    with no records.

    Args:
        cases: resolved ``CaseSpec``s (see :func:`build_cases`).
        task: ``run`` or ``verify``.
        out: the results folder (see :func:`results_file`).
        timeout_s: the watchdog's limit of each case, seconds, from that case's start; ``None``:
            each case's own (:func:`case_limits_s`).
        resume: skip cases that already have a done record (``records.is_done``).
        nodes: multi-node rendezvous keywords for ``launch`` (node rank above 0: launch only).
        skipped: case_id -> why the case cannot run here.
        launcher: an object with ``launch(cases, *, world_size, device, results_path, run_id,
            timeout_s, on_poll, **nodes) -> LaunchResult``; default ``ringbench.sweep.launch``.
        yes: start what the estimate would refuse (``--yes``).
    """
    from ringbench.sweep import estimate, lease
    from ringbench.errors import RingbenchError

    if launcher is None:
        from ringbench.sweep import launch as launcher
    err = Console(stderr=True, soft_wrap=True)
    results_path = results_file(out, task)
    run_id = uuid.uuid4().hex
    nodes = nodes or {}
    skipped = skipped or {}
    follower = nodes.get("node_rank", 0) > 0
    held = None
    try:
        by_id: dict[str, dict] = {}
        if resume:
            # Held before the records are read: no other sweep may append while this one decides.
            held = lease.acquire(results_path, exclusive=True,
                                 on_wait=lambda text: err.print(text, style="dim", markup=False))
            wanted = {c.case_id() for c in cases}
            for record in results.read_records(results_path):
                if record.get("case_id") in wanted and records.is_done(record):
                    by_id[record["case_id"]] = record  # the latest ok record of the case
            err.print(f"--resume: {len(by_id)} of {plural(len(cases), 'case')} already "
                      f"{plural(len(by_id), 'has', 'have', bare=True)} an ok record in {results_path}; running "
                      f"{len(cases) - len(by_id)}", style="dim", markup=False)
        to_launch = [c for c in cases if c.case_id() not in by_id and c.case_id() not in skipped]
        est = estimate.estimate(to_launch) if to_launch else None
        if est is not None:
            estimate.check(to_launch, est, yes=yes)
        if not resume and not follower:
            held = lease.acquire(results_path, exclusive=False)
    except RingbenchError as exc:  # another sweep holds the file, or the estimate refused the sweep
        if held is not None:
            held.release()
        err.print(Text(str(exc), style="red"))
        return Outcome([], 0, EXIT_USAGE)
    except KeyboardInterrupt:  # Ctrl-C while waiting for a stopped sweep's processes: nothing ran
        if held is not None:
            held.release()
        return Outcome([], 0, 128 + signal.SIGINT)
    if est is not None:
        err.print(estimate.summary(to_launch, est), style="dim", markup=False)
    eta = _Eta(to_launch, est) if est is not None else None
    try:
        if follower:
            return Outcome([], 0, _follow_node(cases, launcher, results_path, run_id, timeout_s, nodes, err))
        return _sweep_all(cases, task=task, results_path=results_path, run_id=run_id, timeout_s=timeout_s,
                          nodes=nodes, skipped=skipped, launcher=launcher, by_id=by_id, err=err, eta=eta)
    finally:
        if held is not None:
            held.release()


def _sweep_all(cases: list, *, task: str, results_path: Path, run_id: str, timeout_s: Optional[float],
               nodes: dict, skipped: dict[str, str], launcher, by_id: dict, err: Console,
               eta: Optional["_Eta"]) -> Outcome:
    """Record the skipped cases, launch the others, and turn the records into the outcome."""
    skipped_now = [c for c in cases if c.case_id() in skipped and c.case_id() not in by_id]
    env = _env(skipped_now[0].kernel) if skipped_now else None  # why they were skipped is part of it
    for case in skipped_now:
        record = records.build(case, run_id=run_id, status="skipped", reason=skipped[case.case_id()], env=env)
        results.append_record(results_path, record)
        by_id[case.case_id()] = record
    todo = [c for c in cases if c.case_id() not in by_id]

    signum = [signal.SIGINT]
    previous = _raise_on_sigterm(signum)
    try:
        launched, not_run = _launch_all(todo, launcher, results_path, run_id, timeout_s, by_id, err,
                                        task=task, nodes=nodes, eta=eta)
    except KeyboardInterrupt:
        ids = {c.case_id() for c in cases}
        done = by_id.keys() | {r.get("case_id") for r in results.read_records(results_path)
                               if r.get("run_id") == run_id}
        again = shlex.join(["ringbench", *sys.argv[1:]] + ([] if "--resume" in sys.argv else ["--resume"]))
        err.print(Text(f"interrupted: {len(done & ids)} of {plural(len(cases), 'case')} "
                       f"{plural(len(done & ids), 'has', 'have', bare=True)} a record in "
                       f"{results_path}; to run the others: {again}", style="red"))
        return Outcome([], len(done & ids), 128 + signum[0])
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    found = [by_id[c.case_id()] for c in cases]
    if not_run:
        code = EXIT_NOT_RUN
    elif all(records.passed(r) for r in found):
        code = EXIT_OK
    else:
        code = EXIT_FAILED
    return Outcome(found, launched + len(skipped_now), code)


def _raise_on_sigterm(signum: list) -> Any:
    """Make SIGTERM raise KeyboardInterrupt (so the job is stopped, not orphaned) and note
    which signal came in ``signum[0]``; returns the previous handler, None off the main thread."""
    def handler(sig, frame):
        signum[0] = sig
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def case_limits_s(cases: list, timeout_s: Optional[float]) -> list[float]:
    """The watchdog's limit of each case, seconds: ``timeout_s`` (``--timeout``) for every case,
    or, when it is None, each case's own (``estimate.case_limit_s``) at the CPU rate measured now,
    under the load of the moment (each launch measures it again)."""
    from ringbench.sweep import estimate

    if not timeout_s and any(c.device == "cpu" for c in cases):
        estimate.remeasure()
    return [timeout_s if timeout_s else estimate.case_limit_s(c) for c in cases]


def _reached_a_case(log_dir: Optional[Path]) -> bool:
    """Whether some rank of the launch in ``log_dir`` wrote a case's start mark."""
    if log_dir is None:
        return False
    for marks in Path(log_dir).glob("progress/rank*.txt"):
        try:
            if " start " in marks.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _follow_node(cases: list, launcher, results_path: Path, run_id: str, timeout_s: Optional[float],
                 nodes: dict, err: Console) -> int:
    """Run this host's share of every launch (node rank above 0): no records, node 0 writes them.

    Returns 0 when every launch ended well, else 3.
    """
    groups: dict[tuple[int, str], list] = {}
    for case in cases:
        groups.setdefault((launch_world_size(case), case.device), []).append(case)
    code = EXIT_OK
    for (world_size, device), group in groups.items():
        result = launcher.launch([c.to_dict() for c in group], world_size=world_size, device=device,
                                   results_path=results_path, run_id=run_id,
                                   timeout_s=case_limits_s(group, timeout_s), **nodes)
        if result.timed_out or result.failure:
            err.print(Text(f"node {nodes['node_rank']}: launch at world_size {world_size} on {device} "
                           f"{'timed out' if result.timed_out else 'failed'}: {result.failure}", style="red"))
            code = EXIT_NOT_RUN
    err.print(f"node {nodes['node_rank']} of {nodes['nnodes']}: {plural(len(cases), 'case')} ran; node 0 writes "
              "their records", style="dim", markup=False)
    return code


#: The ETA's pace (seconds taken per estimated second) is kept within [1/this, this].
_ETA_FACTOR_MAX = 100.0


class _Eta:
    """The progress bar's ETA, from the estimate: the estimated seconds of the cases left, scaled
    by the pace measured as cases finish (how long the finished ones took against theirs, and at
    least the pace the running case would give if it ended now). Each launch's start-up counts with its
    first case, so the ETA shows from the first case on, before any case has finished."""

    def __init__(self, cases: list, est, clock=time.monotonic):
        self._clock = clock
        self._left: dict[str, float] = {}
        first_of: set[tuple[int, str]] = set()
        for case, seconds in zip(cases, est.case_s):
            key = (case.world_size, case.device)
            if key not in first_of:
                first_of.add(key)
                seconds += est.launch_s[key]
            self._left[case.case_id()] = seconds
        self._started = self._last = clock()
        self._done_est = 0.0
        self._current: Optional[str] = None

    def running(self, case_id: Optional[str]) -> None:
        self._current = case_id

    def finished(self, case_id: str) -> None:
        if case_id in self._left:
            self._done_est += self._left.pop(case_id)
            self._last = self._clock()

    def seconds_left(self) -> float:
        now = self._clock()
        factor = 1.0
        if self._done_est > 0:  # the pace so far: seconds taken per estimated second
            factor = (self._last - self._started) / self._done_est
        current = self._left.get(self._current, 0.0)
        if current > 0:  # the pace is at least what it would be if the running case ended now
            factor = max(factor, (now - self._started) / (self._done_est + current))
        # Wide bounds: shared cores have run a sweep 20x its estimate (issue 27).
        factor = min(_ETA_FACTOR_MAX, max(1 / _ETA_FACTOR_MAX, factor))
        left = sum(self._left.values())
        after_current = left - current
        # Never below the cases after the one running, however long that one takes.
        return max(factor * after_current, factor * left - (now - self._last), 0.0)


class _EtaColumn(ProgressColumn):
    """``ETA 0:12:34`` from :class:`_Eta`; rich's own ETA shows nothing until a case has finished."""

    def __init__(self, eta: Optional[_Eta]):
        super().__init__()
        self._eta = eta

    def render(self, task) -> Text:
        if self._eta is None or task.finished:
            left = 0.0 if task.finished else None
        else:
            left = self._eta.seconds_left()
        if left is None:
            return Text("ETA -:--:--", style="progress.remaining")
        whole = int(round(left))
        return Text(f"ETA {whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}", style="progress.remaining")


def _launch_all(todo: list, launcher, results_path: Path, run_id: str, timeout_s: Optional[float],
                by_id: dict, err: Console, *, task: str, nodes: Optional[dict] = None,
                eta: Optional[_Eta] = None) -> tuple[int, bool]:
    """Run ``todo`` one launch per (world_size, device) under a progress bar; fill ``by_id``.

    When a launch fails or times out in a case, that case is recorded with status timeout,
    oom or error and its reason, and the cases after it go to a fresh launch (on one node;
    over several, every unreported case is recorded with the failure).

    Returns:
        (records appended, whether some case went unreported by its launch).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    groups: dict[tuple[int, str], list] = {}
    for case in todo:
        groups.setdefault((launch_world_size(case), case.device), []).append(case)
    varying = _varying_fields(todo)
    env: list[dict | None] = []  # collected once, on the first unreported case
    written, not_run = 0, False
    columns = (TextColumn("{task.fields[counter]}"), BarColumn(bar_width=16), TimeElapsedColumn(),
               _EtaColumn(eta), TextColumn("{task.description}"))
    with Progress(*columns, console=err) as progress:
        bar = progress.add_task(task, total=len(todo), counter=f"case 0 of {len(todo)}")

        def show(current) -> None:
            """Case i of n: i counts the finished cases and the one running now."""
            done = int(progress.tasks[0].completed)
            if eta is not None:
                eta.running(None if current is None else current.case_id())
            if current is None:
                progress.update(bar, counter=f"case {done} of {len(todo)}", description="")
            else:
                progress.update(bar, counter=f"case {done + 1} of {len(todo)}",
                                description=_short_label(current, varying))

        for group in groups.values():
            pending = list(group)
            while pending:
                found, failed, pending = _launch_one(pending, launcher, results_path, run_id, timeout_s,
                                                     nodes or {}, env, progress, bar, show, eta)
                written += len(found)
                not_run = not_run or failed
                by_id.update(found)
        show(None)
    return written, not_run


def _launch_one(pending: list, launcher, results_path: Path, run_id: str, timeout_s: Optional[float],
                nodes: dict, env: list, progress, bar, show, eta: Optional[_Eta] = None) -> tuple[dict, bool, list]:
    """One launch of ``pending`` (cases of one world size and device).

    Returns:
        (the records of its cases by case_id, whether a case went unreported, the cases
        left for a fresh launch: those after the one a failed launch was running).
    """
    world_size, device = launch_world_size(pending[0]), pending[0].device
    ids = {c.case_id() for c in pending}
    found: dict[str, dict] = {}
    offset = [results_path.stat().st_size if results_path.exists() else 0]

    def poll() -> None:
        new, offset[0] = results.read_records_from(results_path, offset[0])
        for record in new:
            if record.get("run_id") == run_id and record.get("case_id") in ids - found.keys():
                found[record["case_id"]] = record
                if eta is not None:
                    eta.finished(record["case_id"])
                progress.advance(bar)
        show(next((c for c in pending if c.case_id() not in found), None))

    show(pending[0])
    limits_s = case_limits_s(pending, timeout_s)
    try:
        result = launcher.launch([c.to_dict() for c in pending], world_size=world_size, device=device,
                                   results_path=results_path, run_id=run_id, timeout_s=limits_s, on_poll=poll,
                                   **nodes)
        timed_out, failure, log_dir = result.timed_out, result.failure, result.log_dir
    except Exception as exc:  # a launcher crash still leaves one record per case
        timed_out, failure, log_dir = False, f"the launcher raised {type(exc).__name__}: {exc}", None
    poll()  # records the hook has not seen (a crashed launcher never called it)
    missing = [c for c in pending if c.case_id() not in found]
    rest: list = []
    if missing and (timed_out or failure) and nodes.get("nnodes", 1) == 1 and _reached_a_case(log_dir):
        # The launch died in its first unreported case: blame that one, give the others a fresh launch.
        missing, rest = missing[:1], missing[1:]
    if missing and not env:
        env.append(_env(missing[0].kernel))
    for case in missing:
        limit_s = limits_s[pending.index(case)]
        reason = failure or (f"the launch timed out after {limit_s:g} s, this case's limit" if timed_out
                             else "the job ended before this case reported")
        record = records.build(case, run_id=run_id, status=records.status_of_failure(timed_out, failure), reason=reason,
                               env=env[0])
        results.append_record(results_path, record)
        found[case.case_id()] = record
        if eta is not None:
            eta.finished(case.case_id())
        progress.advance(bar)
    if missing or timed_out or failure:
        what = "timed out" if timed_out else f"failed: {failure or 'no reason given'}"
        where = f"; logs in {log_dir}" if log_dir else ""
        again = (f"; {'the case' if len(rest) == 1 else f'the {len(rest)} cases'} after it "
                 f"{plural(len(rest), 'goes', 'go', bare=True)} to a fresh launch" if rest else "")
        progress.console.print(Text(f"launch at world_size {world_size} on {device} {what}; {len(missing)} of "
                                    f"{plural(len(pending), 'case')} unreported{where}{again}", style="red"))
    return found, bool(missing), rest


#: Spec fields a short case label may name, in table order.
_LABEL_FIELDS = tuple(f.name for f in fields.FIELDS if f.in_case_id and f.name != "task")


def _varying_fields(cases: list) -> set[str]:
    """The spec fields that take more than one value among ``cases``."""
    return {f for f in _LABEL_FIELDS if len({getattr(c, f) for c in cases}) > 1}


def _short_label(case, varying: set[str]) -> str:
    """The case named by its variant and kernel and the fields the sweep varies, such as
    ``zigzag cudnn 16k fwd``, for the progress bar."""
    return " ".join(fields.BY_NAME[f].text(getattr(case, f)) for f in _LABEL_FIELDS
                    if f in ("variant", "kernel") or f in varying)

def _env(kernel: str) -> dict | None:
    from ringbench.records import envinfo

    try:
        return envinfo.collect(kernel)
    except Exception:  # the environment is context; its failure must not cost the record
        return None
