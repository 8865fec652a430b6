"""Helpers the test modules share: the CLI as a user runs it, the records it writes, live processes.

Not a test module (pytest collects only ``test_*.py``), so any test may import it; ``conftest.py``
puts this folder on ``sys.path`` and exposes the same helpers as fixtures. Before it existed,
tests imported these from ``test_cli_e2e``, which made one test module a library of the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

#: Seconds one command may take before it is killed; the CLI's own --timeout is per launch.
COMMAND_TIMEOUT_S = 300

#: The environment a user's command runs in here: an 80-column terminal without colour.
CLI_ENV = {"COLUMNS": "80", "NO_COLOR": "1"}


def ringbench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``ringbench ARGS`` in ``cwd`` on an 80-column terminal and return what it printed.

    The command runs in its own session; past ``COMMAND_TIMEOUT_S`` that session (torchrun
    and the workers too) is killed and the test fails with what it printed.
    """
    env = {**os.environ, **CLI_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "ringbench.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: torchrun and the workers too
        stdout, stderr = proc.communicate()
        pytest.fail(f"ringbench {' '.join(args)} ran past {COMMAND_TIMEOUT_S} s\n{stdout}\n{stderr}")
    print(stdout[-6000:], stderr[-3000:], sep="\n")  # shown when an assert below fails
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


class _PastCommandTimeout(Exception):
    """Raised in the test's thread when an in-process command passes ``COMMAND_TIMEOUT_S``."""


def ringbench_here(*args: str, cwd: Path, launcher=None) -> subprocess.CompletedProcess:
    """``ringbench ARGS`` in this process, in ``cwd`` on an 80-column terminal: what
    :func:`ringbench` returns, without a new interpreter importing torch first.

    The same command line code runs (typer's CliRunner); a launch is still real torchrun, its
    workers real processes. ``launcher`` stands in for ``ringbench.sweep.launch`` (typer's context
    object) where a test counts the launches. For a test of what a separate process sees (signals
    to the CLI, live processes, two nodes, a user's shell) use :func:`ringbench`. Past
    ``COMMAND_TIMEOUT_S`` the command is interrupted (its launch stops its job) and the test fails.
    """
    from typer.testing import CliRunner

    from ringbench.cli import app

    def past_limit(signum, frame):
        raise _PastCommandTimeout

    previous = signal.signal(signal.SIGALRM, past_limit)
    signal.setitimer(signal.ITIMER_REAL, COMMAND_TIMEOUT_S)
    here = os.getcwd()
    try:
        os.chdir(cwd)
        result = CliRunner(env=CLI_ENV).invoke(app, list(args), obj=launcher)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(here)
    if isinstance(result.exception, _PastCommandTimeout):
        pytest.fail(f"ringbench {' '.join(args)} ran past {COMMAND_TIMEOUT_S} s\n{result.stdout}\n{result.stderr}")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a crash shows its own traceback, as the subprocess's stderr would
    print(result.stdout[-6000:], result.stderr[-3000:], sep="\n")  # shown when an assert below fails
    return subprocess.CompletedProcess(["ringbench", *args], result.exit_code, result.stdout, result.stderr)


def not_verified(records: dict, skip=()) -> dict:
    """The records (by case name) that did not run and pass verify, with their error or reason; the
    names in ``skip`` (broken fixtures, meant to fail) left out."""
    return {n: (r.get("error") or r.get("reason")) for n, r in records.items()
            if n not in skip and (r["status"] != "ok" or r.get("verdict") != "ok")}


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def live_cmdlines_with(needle: str) -> list[str]:
    """Command lines of live processes that mention ``needle``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def attention_fp64(q, k, v, *, scale: float, causal: bool = False, window: tuple | None = None,
                   cu_seqlens: list[int] | None = None, cu_seqlens_k: list[int] | None = None,
                   key_bias=None):
    """Softmax attention in float64 through one dense mask: the tests' reference, written apart
    from ringbench's kernels.

    Args:
        q: ``[B, Sq, Hq, D]``, any float dtype (taken in float64).
        k: ``[B, Sk, Hkv, D]``; v: ``[B, Sk, Hkv, Dv]`` (Dv may differ from D: head_dim_v), with
            ``Hq % Hkv == 0`` (GQA: each K/V head repeated ``Hq / Hkv`` times).
        scale: the softmax scale.
        causal: query i of a document of ``lq`` queries and ``lk`` keys sees key j only when
            ``j <= i + lk - lq`` (bottom-right aligned; top-left when ``lq == lk``).
        window: ``(left, right)``: query i sees key j only when
            ``-right <= i + lk - lq - j <= left``; ``None`` on a side: unbounded there. Applied
            with ``causal`` too (which then bounds the right side at 0).
        cu_seqlens: packed documents (``B == 1``): document d is query rows
            ``cu_seqlens[d]:cu_seqlens[d+1]``; ``None``: one document of every row.
        cu_seqlens_k: its key rows, the same number of documents; default ``cu_seqlens``.
        key_bias: float ``[Sk]`` added to every score of that key, or ``None``.

    Returns:
        ``(out, lse)``: out float64 ``[B, Sq, Hq, Dv]`` (0 where a query sees no key) and lse
        float64 ``[B, Hq, Sq]`` (``-inf`` there); differentiable in q, k, v when they require grad.
    """
    import math

    import torch

    sq, sk = q.shape[1], k.shape[1]
    cu_q = cu_seqlens if cu_seqlens is not None else [0, sq]
    cu_k = cu_seqlens_k if cu_seqlens_k is not None else (cu_seqlens if cu_seqlens is not None else [0, sk])
    seen = torch.zeros(sq, sk, dtype=torch.bool)
    for qs, qe, ks, ke in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        # How far key j lies behind query i's diagonal key, in this document.
        behind = torch.arange(qe - qs)[:, None] + (ke - ks) - (qe - qs) - torch.arange(ke - ks)[None, :]
        block = torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if causal:
            block &= behind >= 0
        if window is not None and window[0] is not None:
            block &= behind <= window[0]
        if window is not None and window[1] is not None:
            block &= behind >= -window[1]
        seen[qs:qe, ks:ke] = block
    groups = q.shape[2] // k.shape[2]
    k, v = (t.double().repeat_interleave(groups, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    if key_bias is not None:
        scores = scores + key_bias.double()
    scores = scores.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    # A row that sees no key has lse -inf: clamped, its weights are exp(-inf) = 0, not NaN.
    p = torch.exp(scores - lse[..., None].clamp_min(-1e300))
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def command_cases(task: str, given: dict, *, model: str | None = None) -> list:
    """The cases ``ringbench TASK`` builds from these options (``given``: field -> value, or a list
    for ``variant`` and ``world_size``), as the command line builds them (``sweep.build.cases_for``)."""
    from ringbench.sweep import build

    cases, skipped = build.cases_for(task, dict(given), model=model)
    assert not skipped, skipped
    return cases


def scenario_of(cases: list, description: str) -> str:
    """A scenario file of exactly these cases (each one's fields that differ from the CPU
    defaults), so the cases of several commands run as one command: one launch per world size,
    each rank importing torch once. ``--scenario`` of it builds the same ``case_id`` in the same order."""
    from ringbench.case.spec import default_fields

    defaults = default_fields("cpu", 0)
    lines = [f"description = {json.dumps(description)}"]
    for case in cases:
        lines.append("[[case]]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in case.to_dict().items()
                  if key != "task" and value != defaults.get(key)]
    return "\n".join(lines) + "\n"


def scenario_cases(task: str, path: Path) -> list:
    """The cases ``ringbench TASK --scenario PATH`` builds."""
    from ringbench.sweep import build

    return build.cases_for(task, {}, scenario=str(path))[0]


def slow_when(value, condition: bool):
    """``value`` as a ``parametrize`` entry, marked ``slow`` when ``condition`` holds (same test id)."""
    return pytest.param(value, marks=pytest.mark.slow) if condition else value


#: A sweep of six small CPU cases that runs long enough to be interrupted in the middle (two
#: variants, three seqlens, at world size 2), for the kill and resume tests. The kill lands at the
#: first record, and the five cases after it (what --resume runs again) need only outlast the
#: tests' 0.05 s polls: 2.3 s of them on two cores under a load of 5, where seqlens of 1024, 2048
#: and 3072 took 9.7 s.
SLOW_SWEEP = """
[defaults]
device = "cpu"
kernel = "cpu"
world_size = 2
heads = 4
kv_heads = 2
head_dim = 32
mode = "fwd_bwd"
iters = 3
warmup = 1
[sweep]
variant = ["ring", "zigzag"]
seqlen = [512, 1024, 1536]
"""


def run_torchrun(world_size: int, args: list[str], *, timeout_s: float, env: dict | None = None,
                 cwd: Path | None = None) -> tuple[int, bool, str]:
    """Run ``torchrun`` over ``args`` with ``world_size`` ranks on a free local port, in its own session.

    Returns:
        (return code, whether it passed ``timeout_s`` and was killed with its workers, its output).
    """
    from ringbench.sweep.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world_size),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CASES_PG_TIMEOUT": str(timeout_s), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own session: torchrun and its workers
        log, _ = proc.communicate()
        timed_out = True
    print(log[-4000:])
    return proc.returncode, timed_out, log


def torchrun_cases(script: Path, cases: list[dict], world_size: int, folder: Path, stem: str,
                   timeout_s: float) -> dict:
    """Run a case script of ``tests/dist/`` over ``cases`` in one torchrun launch of ``world_size`` ranks.

    Returns:
        ``{"records": {name: record}, "returncode", "timed_out", "log_tail", "expected": [names]}``;
        each case dict has a ``name``, and the script writes one record per case with it.
    """
    cases_file, results_file = folder / f"{stem}.json", folder / f"{stem}.jsonl"
    cases_file.write_text(json.dumps(cases))
    returncode, timed_out, log = run_torchrun(
        world_size, [str(script), "--cases", str(cases_file), "--results", str(results_file)], timeout_s=timeout_s)
    records = {}
    if results_file.exists():
        for line in results_file.read_text().splitlines():
            rec = json.loads(line)
            records[rec["name"]] = rec
    return {"records": records, "returncode": returncode, "timed_out": timed_out, "log_tail": log[-3000:],
            "expected": [c["name"] for c in cases]}


def cached(make):
    """``get(*key)``: ``make(*key)`` the first time a key is asked for, its result after that (one
    torchrun launch per world size, say, run lazily and shared by a module's tests)."""
    done: dict = {}

    def get(*key):
        if key not in done:
            done[key] = make(*key)
        return done[key]

    return get


def flat_calibration(rate: float, shape, sizes=(8, 16, 32, 64, 128, 256, 512)) -> dict:
    """A cpu calibration (its JSON form) whose every kernel call runs at ``rate`` FLOP/s, at the
    attention ``shape`` (a ``ringbench.model.calibration.Shape``), with no overheads worth a
    rounding: a prediction from it can be computed by hand."""
    from ringbench.model import calibration as C

    surfaces = []
    for mode in C.MODES:
        for mask in ("full", "causal"):
            points = []
            for q in sizes:
                for k in (sizes if mask == "full" else (q,)):
                    t = C.call_flops(C.Call(mode, mask, q, k, C.point_pairs(mask, q, k)), shape) / rate * 1e3
                    points.append({"q": q, "k": k, "time_ms": t, "lo_ms": t, "hi_ms": t})
            surfaces.append(C.surface_dict(mode, mask, shape, points))
    free = {"fixed_ms": 0.0, "gib_s": 1e15, "host_ms": 0.0}
    return {"format": C.FORMAT, "schema_version": C.SCHEMA_VERSION, "device": "cpu", "device_type": "cpu",
            "kernels": {"cpu": {"version": "test", "surfaces": surfaces, "host_ms": {"fwd": 0.0, "bwd": 0.0},
                                "timing": {"fwd": "cpu-clock", "bwd": "cpu-clock"}}},
            "overheads": {"merge": free, "add": free, "copy": free, "launch_ms": 0.0}, "source": "test"}


def batches_launched_together(batches: dict, launch) -> dict:
    """One torchrun launch over the cases of several batches of one world size, seen batch by batch.

    ``batches``: ``{key: [case, ...]}``, each case a dict with a ``name``; a name in two batches must
    carry the same case in both, and runs once. ``launch(cases)`` runs the joined cases (in one
    launch) and returns :func:`torchrun_cases`'s dict. Returns ``{key: dict}``, each as if that batch
    had had the launch to itself: its own records and ``expected`` names, the launch's return code,
    timeout and log tail. Saves the second launch's start (torchrun and every rank importing torch).
    """
    joined: dict = {}
    for cases in batches.values():
        for case in cases:
            assert joined.setdefault(case["name"], case) == case, f"{case['name']} differs between the batches"
    got = launch(list(joined.values()))
    views = {}
    for key, cases in batches.items():
        names = [c["name"] for c in cases]
        views[key] = {**got, "records": {n: r for n, r in got["records"].items() if n in names}, "expected": names}
    return views


#: The modules whose ``tests/dist/verify_cases.py`` launches are pooled (:class:`VerifyPool`): module name ->
#: ``batches(world_size, with_slow)``, the module's batches at that world size, ``{key: ([case, ...], timeout_s)}``;
#: ``with_slow``: whether this session runs the module's slow tests too (else its quick batches alone).
POOLED_VERIFY: dict = {}


def pool_verify_batches(module: str, batches) -> None:
    """Put a module's ``verify_cases.py`` batches in the session's pool (:class:`VerifyPool`), at its import."""
    POOLED_VERIFY[module] = batches


def quick_and_full_batches(launches_at, cases, timeouts: dict):
    """The ``batches(world_size, with_slow)`` of a module whose launches are ``(world size, quick)``
    pairs: at ``world_size``, each pair's ``(cases(world_size, quick), timeouts[world_size])``, the
    quick one alone unless the session runs the slow tests too (then world size 2's quick batch joins
    its full one)."""
    def batches(world_size: int, with_slow: bool) -> dict:
        return {quick: (cases(world_size, quick), timeouts[world_size])
                for w, quick in launches_at if w == world_size and (with_slow or quick)}
    return batches


class VerifyPool:
    """The ``verify_cases.py`` launches of every pooled module in this session: one launch per world size.

    The first batch asked for at a world size launches, at once, the batches every pooled module of the
    session has there (all of them where the session runs the module's slow tests, else its quick ones):
    a launch's start (torchrun and every rank importing torch) is paid once per world size, not once per
    module. ``get(module, world_size, key)`` returns that batch's view of the launch, as
    :func:`batches_launched_together` gives it (its own records and expected names, the launch's return
    code, timeout and log tail) with its ``world_size`` and ``cases`` (name -> spec). Case names are
    prefixed with their module's inside the launch, so two modules may use one name. A case without a
    ``spec`` is a ``tests/dist/cases.py`` case (``tests/test_variants_distributed.py``'s), which the
    script runs as that one does; ``cases`` gives it whole.
    """

    def __init__(self, session, folder):
        self.session, self.folder, self.done = session, folder, {}

    def _with_slow(self, module: str) -> bool | None:
        """Whether the session runs ``module``'s slow tests (None: none of its tests)."""
        items = [item for item in self.session.items if item.module.__name__ == module]
        return any(item.get_closest_marker("slow") for item in items) if items else None

    def get(self, module: str, world_size: int, key) -> dict:
        if (module, world_size, key) not in self.done:
            batches = {}
            for name, batches_of in POOLED_VERIFY.items():
                with_slow = self._with_slow(name)
                if with_slow is not None:
                    batches.update({(name, k): v for k, v in batches_of(world_size, with_slow).items()})
            if (module, key) not in batches:  # asked for outside what the session's selection implies
                batches[(module, key)] = POOLED_VERIFY[module](world_size, True)[key]
            self._launch(world_size, batches)
        return self.done[(module, world_size, key)]

    def _launch(self, world_size: int, batches: dict) -> None:
        timeout_s = sum(max(t for (m, _), (_, t) in batches.items() if m == module)
                        for module in {m for m, _ in batches})
        prefixed = {mk: [{**case, "name": f"{mk[0]}:{case['name']}"} for case in cases]
                    for mk, (cases, _) in batches.items()}
        stem = f"verify_pool_w{world_size}"
        script = Path(__file__).parent / "dist" / "verify_cases.py"
        views = batches_launched_together(prefixed, lambda cases: torchrun_cases(
            script, cases, world_size, self.folder.mktemp(stem), stem, timeout_s))
        for (module, key), got in views.items():
            cut = len(module) + 1
            self.done[(module, world_size, key)] = {
                **got, "records": {n[cut:]: {**r, "name": n[cut:]} for n, r in got["records"].items()},
                "expected": [n[cut:] for n in got["expected"]], "world_size": world_size,
                "cases": {c["name"]: c.get("spec", c) for c in batches[(module, key)][0]}}


#: The floor of the kernel rule (``kernel_rule_problem``), in units in the last place of the largest reference
#: value, by the dtype a tensor comes back in. On an H200 (PyTorch 2.11, cuDNN 9.19) the worst ratio of error to
#: allowance was 0.71 in bf16 and fp16 and 0.51 in float32 (torch-efficient's dq).
FLOOR_ULPS = {"bfloat16": 1, "float16": 1, "float32": 16}


def kernel_rule_problem(label: str, got, low, ref) -> str | None:
    """FlashAttention's test rule (``tests/test_kernels_gpu.py``'s docstring): ``got``'s max error against the
    float64 ``ref`` within twice that of ``low`` (the math kernel in the same low dtype) plus ``FLOOR_ULPS``,
    and ``-inf`` exactly where ``ref`` has it. Prints both errors; returns why ``got`` breaks the rule, or None."""
    import torch

    problems = []
    neg_inf = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(got), neg_inf):
        problems.append(f"-inf at {int((torch.isneginf(got) != neg_inf).sum())} positions that differ from the reference's")
    finite = ~neg_inf
    ref_f = ref[finite]
    diff = (got.double()[finite] - ref_f).abs()
    base = (low.double()[finite] - ref_f).abs()
    if diff.numel() == 0:
        print(f"{label:>4}: no finite reference values")
        return "; ".join(problems) or None
    ulp = torch.finfo(got.dtype).eps * max(float(ref_f.abs().max()), torch.finfo(got.dtype).tiny)
    allowed = 2 * float(base.max()) + FLOOR_ULPS[str(got.dtype).removeprefix("torch.")] * ulp
    err = float(diff.max())  # nan where the kernel gave nan: fails below
    print(f"{label:>4}: max {err:.3e} mean {float(diff.mean()):.3e} | math in {str(low.dtype)[6:]}: "
          f"max {float(base.max()):.3e} mean {float(base.mean()):.3e} | allowed {allowed:.3e} "
          f"(ratio {err / allowed:.2f}) | max|ref| {float(ref_f.abs().max()):.3e}")
    if not err <= allowed:
        problems.append(f"max error {err:.3e} > allowed {allowed:.3e}")
    return f"{label}: " + "; ".join(problems) if problems else None


#: The modules whose ``ringbench verify`` commands are pooled (:class:`CliVerifyPool`): module name (or
#: ``module:part``, where a module pools two sets of cases) ->
#: ``(cases(world_size), exit code)``: the cases that module's commands build at that world size (``[]``: none
#: there), and the exit code its commands give (0: every case passes; 1: some are meant to fail), or a function
#: of the world size that gives it.
POOLED_CLI_VERIFY: dict = {}


def pool_cli_verify(module: str, cases, exit_code: int = 0) -> None:
    """Put a module's ``ringbench verify`` cases in the session's pool (:class:`CliVerifyPool`), at its import."""
    POOLED_CLI_VERIFY[module] = (cases, exit_code)


def scenario_text_cases(text: str, task: str = "verify") -> list:
    """The cases ``ringbench TASK --scenario`` builds from a scenario file of ``text``."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "scenario.toml"
        path.write_text(text)
        return scenario_cases(task, path)


class CliVerifyPool:
    """Every pooled module's ``ringbench verify`` cases of one world size and exit code in one command of this session.

    Modules whose cases all pass (their commands exit 0) share one command, and modules whose commands exit 1
    (some cases meant to fail) another, so each command's exit code is still the one each module's own gave: one
    launch per world size and exit code, not one per module and world size (a launch's start, torchrun and every
    rank importing torch, is most of such a command). The command line still runs in full (``--scenario`` of
    exactly those cases, :func:`scenario_of`; ``--yes``, since the joined sweep's estimate is longer), and the
    cases of modules the session does not run are left out. ``get(module, world_size)``: ``{"result": the
    command's CompletedProcess, "records": that module's records, in its case order (None where one is missing)}``.
    """

    def __init__(self, session, folder):
        self.session, self.folder, self.done = session, folder, {}

    @staticmethod
    def _exit_code(module: str, world_size: int) -> int:
        code = POOLED_CLI_VERIFY[module][1]
        return code(world_size) if callable(code) else code

    def get(self, module: str, world_size: int) -> dict:
        exit_code = self._exit_code(module, world_size)
        if (exit_code, world_size) not in self.done:
            running = {item.module.__name__ for item in self.session.items}
            folder = self.folder.mktemp(f"cli_verify_w{world_size}_exit{exit_code}")
            wanted = {name: cases(world_size) for name, (cases, _) in POOLED_CLI_VERIFY.items()
                      if self._exit_code(name, world_size) == exit_code
                      and (name.split(":")[0] in running or name == module)}
            joined = list({c.case_id(): c for cases in wanted.values() for c in cases}.values())
            scenario = folder / "pool.toml"
            scenario.write_text(scenario_of(joined, f"the pooled verify cases at world size {world_size}"))
            assert [c.case_id() for c in scenario_cases("verify", scenario)] == [c.case_id() for c in joined]
            result = ringbench_here("verify", "--scenario", str(scenario), "--out", str(folder), "--yes", cwd=folder)
            written = folder / "verify.jsonl"
            records = {r["case_id"]: r for r in read_jsonl(written)} if written.exists() else {}
            self.done[exit_code, world_size] = (result, records, wanted)
        result, records, wanted = self.done[exit_code, world_size]
        return {"result": result, "records": [records.get(c.case_id()) for c in wanted[module]]}


#: The modules whose ``ringbench run`` commands are pooled (:class:`CliRunPool`): module name (or ``module:part``)
#: -> ``cases()``: the run cases that module's commands build (each command exits 0, every case ok).
POOLED_CLI_RUN: dict = {}


def pool_cli_run(module: str, cases) -> None:
    """Put a module's ``ringbench run`` cases in the session's pool (:class:`CliRunPool`), at its import."""
    POOLED_CLI_RUN[module] = cases


class CliRunPool:
    """Every pooled module's ``ringbench run`` cases in one ``ringbench run --json`` command of this session.

    The command groups its cases into one launch per world size (an emulated case's launch has one rank), so the
    pooled modules share a launch per world size, not one per command: a launch's start (torchrun and every rank
    importing torch) is most of such a command. The command line still runs in full (``--scenario`` of exactly
    those cases, :func:`scenario_of`, each as the module's own command line builds it; ``--json``, so that stdout
    is the records and nothing else; ``--yes``, since the joined sweep's estimate is longer), and the cases of
    modules the session does not run are left out. Two modules' cases of one ``case_id`` must be the same case
    (it runs once). ``get(module)``: ``{"result": the command's CompletedProcess, "records": that module's records
    from the results file, in its case order (None where one is missing), "printed": the records the command
    printed for those cases, in the same order (the lines of each case_id, each a list)}``.
    """

    def __init__(self, session, folder):
        self.session, self.folder, self.done = session, folder, None

    def get(self, module: str) -> dict:
        if self.done is None:
            running = {item.module.__name__ for item in self.session.items}
            wanted = {name: cases() for name, cases in POOLED_CLI_RUN.items()
                      if name.split(":")[0] in running or name == module}
            joined: dict = {}
            for cases in wanted.values():
                for case in cases:
                    assert joined.setdefault(case.case_id(), case).to_dict() == case.to_dict(), \
                        f"two pooled run cases share case_id {case.case_id()} but differ"
            folder = self.folder.mktemp("cli_run_pool")
            scenario = folder / "pool.toml"
            scenario.write_text(scenario_of(list(joined.values()), "the pooled run cases"))
            assert [c.case_id() for c in scenario_cases("run", scenario)] == list(joined)
            result = ringbench_here("run", "--scenario", str(scenario), "--out", str(folder), "--json", "--yes",
                                    cwd=folder)
            printed = [json.loads(line) for line in result.stdout.splitlines()]  # --json: records, nothing else
            written = folder / "runs.jsonl"
            records = {r["case_id"]: r for r in read_jsonl(written)} if written.exists() else {}
            self.done = (result, records, printed, wanted)
        result, records, printed, wanted = self.done
        cases = wanted[module]
        return {"result": result, "records": [records.get(c.case_id()) for c in cases],
                "printed": [[r for r in printed if r.get("case_id") == c.case_id()] for c in cases]}


# --------------------------------------------------------------------------- emulation against a gloo run

def doc_offsets(docs: list[int]) -> list[int]:
    """The offsets of packed documents of these lengths (cu_seqlens as a list: 0, then each end)."""
    out = [0]
    for d in docs:
        out.append(out[-1] + d)
    return out


class Sharding:
    """How a case's tensors are cut into the ranks' shards and put back (batch or packed documents)."""

    def __init__(self, name: str, world_size: int, ulysses_degree: int, options: dict, docs: list[int] | None):
        from ringbench.variants import get_variant

        self.variant = get_variant(name)
        self.layout = options.get("layout") or self.variant.layout
        self.degree = self.variant.layout_degree(world_size, ulysses_degree)
        self.world_size, self.cu = world_size, doc_offsets(docs) if docs else None

    def cut(self, t, rank: int):
        from ringbench.variants.engines import layouts

        if self.cu is None:
            part = layouts.shard(t, self.layout, rank, self.world_size, ulysses_degree=self.degree)
        else:
            part = layouts.shard_varlen(t, self.cu, self.layout, rank, self.world_size,
                                        by_document=self.variant.shard_by_document, ulysses_degree=self.degree)
        return part.detach().contiguous()

    def join(self, parts: list, dim: int = 1):
        from ringbench.variants.engines import layouts

        if self.cu is None:
            return layouts.unshard(parts, self.layout, dim=dim, ulysses_degree=self.degree)
        moved = [p.movedim(dim, 1) for p in parts]
        return layouts.unshard_varlen(moved, self.cu, self.layout, by_document=self.variant.shard_by_document,
                                      ulysses_degree=self.degree).movedim(1, dim)


#: (name, variant, options, docs): the engines whose collectives emulation replaces, at W = 4.
GLOO_CASES = [
    ("llama3-stride1", "llama3", {"heads_k_stride": 1}, None),
    ("llama3_varlen-balanced", "llama3_varlen", {"layout": "balanced"}, [16, 32, 16]),
    ("ulysses", "ulysses", {}, None),
    ("ulysses_varlen", "ulysses_varlen", {}, [10, 30, 24]),
    ("usp-U2", "usp", {"ulysses_degree": 2}, None),
]


def real_and_emulated(out_dir: str) -> None:
    """This rank of a real gloo run (the default process group) of every GLOO_CASES case, then the same
    rank emulated in the same process; out, lse, dq and the bytes of both go to ``out_dir/rank{rank}.pt``.
    Every rank of the session's pooled launch of four ranks runs it (``tests/dist/verify_cases.py``) for
    ``tests/test_emulation.py``."""
    import torch
    import torch.distributed as dist

    from ringbench.variants import get_variant, instruments

    rank, world_size = dist.get_rank(), dist.get_world_size()
    found = {}
    for key, name, options, docs in GLOO_CASES:
        gen = torch.Generator().manual_seed(5)
        whole = [torch.randn(1, 64, h, 8, generator=gen) for h in (4, 2, 2, 4)]  # fp32 q, k, v, dout
        cut = Sharding(name, world_size, options.get("ulysses_degree", 0), options, docs)
        shards = [[cut.cut(t, r) for t in whole] for r in range(world_size)]
        q, k, v, dout = shards[rank]

        def call():  # a new cu_seqlens tensor each time, so each run checks it (and counts that all-gather)
            cu = {"cu_seqlens": torch.tensor(doc_offsets(docs), dtype=torch.int32)} if docs else {}
            return {**options, **cu}

        with instruments.open(traffic=True) as real:
            for t in (q, k, v):
                t.requires_grad_(True)
            out, lse = get_variant(name).attention(q, k, v, causal=True, kernel="math", **call())
            out.backward(dout)
            dq = q.grad
            for t in (q, k, v):
                t.grad = None
                t.requires_grad_(False)
        with instruments.open(traffic=True) as emulated_bytes, \
                instruments.open(emulation=instruments.Emulation(rank, world_size, shards)):
            for t in (q, k, v):
                t.requires_grad_(True)
            e_out, e_lse = get_variant(name).attention(q, k, v, causal=True, kernel="math", **call())
            e_out.backward(dout)
        found[key] = {"out": out.detach(), "lse": lse, "dq": dq, "emulated_out": e_out.detach(), "emulated_lse": e_lse,
                      "emulated_dq": q.grad,
                      "bytes": real.traffic.bytes_sent, "emulated_bytes": emulated_bytes.traffic.bytes_sent}
    torch.save(found, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
