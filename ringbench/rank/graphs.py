"""CUDA graphs for the timed loop: capture one iteration of a case, replay it, and check it.

At a few thousand tokens per rank a ring's step is short on the GPU and its launches (kernels,
merges, copies, each through Python) take longer than the work they feed (issue 25: at W=8
16k, flash-attn-4 spent 0.6 ms calling a 1k x 1k block worth 0.1 ms). Capturing a whole
iteration, forward and backward, as one ``torch.cuda.CUDAGraph`` and replaying it takes the
host out of the loop: the replay is one launch.

What a capture must keep:

- the same tensors: the step's inputs (q, k, v, dout) are fixed for the case, and its outputs
  (out, and q/k/v's grads, set to None before each call) land in the graph's own memory pool,
  overwritten by every replay;
- no read back to the host inside the step (the engines read nothing back once varlen's
  schedules are prepared outside the timing);
- a warm-up on a side stream before the capture, as ``torch.cuda.graph`` asks (lazy
  initialisation of kernels, cuBLAS handles, autograd's streams).

A replay is checked against three eager calls on the same inputs, output tensor by output
tensor (:func:`compare`): bitwise equal, or, where the eager calls themselves differ (a backward
that adds dq with atomics), within a stated multiple of their own spread. A capture that fails,
or a replay that fails the check, leaves the case eager, and the record says why.

Source: issue 25, item 1; PyTorch's CUDA graphs notes (whole-network capture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Sequence

import torch

Tensor = torch.Tensor
#: ``step() -> outputs``: one iteration of the case, returning the tensors it produced.
Step = Callable[[], Sequence[Tensor]]
#: Eager calls before a capture: their pairwise differences are each output's own spread.
EAGER_CALLS = 3
#: How far a replay may sit from eager, in multiples of eager's own spread (:func:`compare`).
SPREAD_MULTIPLE = 8
#: The names of a step's outputs, in ``bench.iteration``'s order (the reference's too).
OUTPUT_NAMES = ("out", "dq", "dk", "dv", "dsink")


@dataclass(frozen=True)
class Check:
    """:func:`compare`'s verdict.

    Attributes:
        ok: the replay gives what eager gives.
        note: the rule that matched, with the numbers (``"bitwise"``, ``"within 8x eager's own
            spread: dq at 1.00x (out, dk, dv bitwise)"``), or why it failed.
        worst_ratio: the largest replay difference over eager's spread, among the outputs eager
            does not reproduce; 0.0 when every output is bitwise, inf when an output eager
            reproduces is not.
    """

    ok: bool
    note: str
    worst_ratio: float


@dataclass(frozen=True)
class Capture:
    """A captured iteration, or why there is none.

    Attributes:
        replay: runs the captured iteration (one graph launch); None when not captured.
        reason: None when captured and checked; else one clause saying why the case runs eagerly.
        check: how the replay matched eager (:attr:`Check.note`), or None when not captured.
        outputs: the captured step's output tensors, which every replay overwrites.
        worst_ratio: :attr:`Check.worst_ratio` of the replay's check, or None when none ran.
    """

    replay: Callable[[], None] | None
    reason: str | None
    check: str | None = None
    outputs: tuple = ()
    worst_ratio: float | None = None


def _snapshot(outputs: Sequence[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in outputs if t is not None]


def _difference(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


#: The gradients a nondeterministic backward (atomic adds) may change between calls (:func:`compare`).
GRADIENTS = ("dq", "dk", "dv")


def _last_place(calls: Sequence[Tensor]) -> float:
    """One unit in the last place of the largest magnitude among ``calls`` (in their dtype)."""
    top = max(c.float().abs().max().item() for c in calls)
    return torch.finfo(calls[0].dtype).eps * 2.0 ** math.floor(math.log2(top)) if top > 0 else 0.0


def compare(replayed: Sequence[Tensor], eager_runs: Sequence[Sequence[Tensor]],
            names: Sequence[str] = OUTPUT_NAMES, *, nondeterministic: bool = False) -> Check:
    """Whether a replay gives what eager gives, output tensor by output tensor.

    The rule: each output is bitwise equal to every eager call's, or, where the eager calls differ
    among themselves (a backward that adds dq with atomics), no further from any of them than
    ``SPREAD_MULTIPLE`` (8) times the largest difference between two of them; an output that eager
    reproduces bit for bit must be bitwise in the replay too. Why 8: the differences of a bf16
    tensor are whole units in its last place, so the largest one moves by powers of two with
    which elements happen to round apart in a given set of calls. On the H200 one pair of calls
    and 2x failed at emulated W=8 32k, and three calls with 4x reached exactly 4.00x in 4 of the 8
    checks (results/reference/2026-12-02-h200-graphs/); 8 allows three such steps, while a real
    fault, a stale or wrong value, is off by about the value itself: some 256 units of a bf16
    last place, 32 times more.

    With ``nondeterministic`` (the kernel's backward is documented nondeterministic,
    ``Kernel.nondeterministic_backward``), a gradient (dq, dk, dv) on which the eager calls happened
    to agree bit for bit may still differ in the replay: its atomic adds ran in another order. Its
    allowance is then ``SPREAD_MULTIPLE`` units in the last place of its largest magnitude, the
    spread one differing pair of eager calls would show. The same floor holds where the eager calls
    differed by less (a unit in the last place of small elements only): on the H100 (2026-12-06,
    second session) a zigzag W=8 16k reference's dq was 32x such a spread off (1.53e-05 against
    4.77e-07), well within 8 units at its largest magnitude. A reference refused so ran eagerly
    beside a replayed ring, at the host's pace: on the H200 a stripe W=8 16k reference's dq differed
    by 3.81e-06 where three eager calls agreed, and its bound read 1.36.

    Args:
        replayed: the outputs after one replay (any shapes and dtypes).
        eager_runs: the outputs of two or more eager calls on the same inputs, each in the order
            of ``replayed``.
        names: the outputs' names in the note (``output i`` past its end).
        nondeterministic: the backward adds with atomics (above).

    Returns:
        A :class:`Check`.

    Raises:
        ValueError: fewer than two eager calls.

    Source: issue 25 (the replay check of flash-attn-4's backward on the H200).
    """
    if len(eager_runs) < 2:
        raise ValueError(f"{len(eager_runs)} eager call(s) give no spread; pass two or more")
    if any(len(run) != len(replayed) for run in eager_runs):
        counts = sorted({len(run) for run in eager_runs})
        return Check(False, f"the replay gave {len(replayed)} outputs and eager {counts[0]}", math.inf)
    bitwise, spread, worst = [], [], 0.0
    for i, got in enumerate(replayed):
        name, calls = names[i] if i < len(names) else f"output {i}", [run[i] for run in eager_runs]
        if any(c.shape != got.shape or c.dtype != got.dtype for c in calls):
            return Check(False, f"{name} of the replay is {got.dtype} {tuple(got.shape)}, eager's "
                                f"{calls[0].dtype} {tuple(calls[0].shape)}", math.inf)
        if all(torch.equal(got, c) for c in calls):
            bitwise.append(name)
            continue
        eager_spread = max(_difference(a, b) for a, b in combinations(calls, 2))
        off = max(_difference(got, c) for c in calls)
        unit = ""
        if nondeterministic and name in GRADIENTS and got.is_floating_point() and _last_place(calls) > eager_spread:
            eager_spread, unit = _last_place(calls), " of one unit in the last place"
        if eager_spread == 0:
            return Check(False, f"{name} of the replay differs from eager by {off:.3g}, where {len(calls)} eager "
                                "calls agree bit for bit", math.inf)
        ratio = off / eager_spread
        if not ratio <= SPREAD_MULTIPLE:  # NaN fails too
            return Check(False, f"{name} of the replay differs from eager by {off:.3g}, {ratio:.2f}x eager's own "
                                f"spread {eager_spread:.3g} over {len(calls)} calls ({SPREAD_MULTIPLE}x allowed)", ratio)
        spread.append(f"{name} at {ratio:.2f}x{unit}")
        worst = max(worst, ratio)
    if not spread:
        return Check(True, "bitwise", 0.0)
    rest = f" ({', '.join(bitwise)} bitwise)" if bitwise else ""
    return Check(True, f"within {SPREAD_MULTIPLE}x eager's own spread: {', '.join(spread)}{rest}", worst)


def capture(step: Step, *, device: torch.device, warmup: int = 2, nondeterministic: bool = False) -> Capture:
    """Capture ``step`` as a CUDA graph on ``device`` and check one replay against
    ``EAGER_CALLS`` eager calls (:func:`compare`).

    Args:
        step: one iteration, returning its output tensors (out, and the grads in fwd_bwd).
        device: a CUDA device.
        warmup: calls on a side stream before the capture.
        nondeterministic: the kernel's backward adds with atomics (:func:`compare`).

    Returns:
        A :class:`Capture`; its ``reason`` names the failure when the case must run eagerly (the
        capture raised, or the replay's outputs differ from eager's).
    """
    # Outside the timing, once per case; each snapshot holds one iteration's outputs.
    eager_runs = [_snapshot(step()) for _ in range(EAGER_CALLS)]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = step()
    except Exception as exc:  # noqa: BLE001 - any capture failure leaves the case eager, said in the record
        torch.cuda.synchronize(device)
        return Capture(None, f"the capture raised {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    graph.replay()
    torch.cuda.synchronize(device)
    # The graph's own outputs are compared: no replay runs again before the check is done.
    check = compare([t for t in outputs if t is not None], eager_runs, nondeterministic=nondeterministic)
    if not check.ok:
        return Capture(None, f"a replay's outputs differed from eager's on the same inputs: {check.note}",
                       worst_ratio=check.worst_ratio)
    return Capture(graph.replay, None, check.note, tuple(outputs), check.worst_ratio)


def _everyone_agrees(ok: bool, device: torch.device, group) -> bool:
    """Whether every rank of ``group`` captured (one all-reduce; True alone in a process of one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


#: ``auto`` captures only where the host takes at least this share of the GPU's time to issue an
#: iteration: below it the host runs ahead of the GPU, which a replay cannot speed up, and the
#: capture, its check and the two timings would be spent for nothing.
HOST_BOUND = 0.5


def issue_and_run_ms(step: Step, device: torch.device) -> tuple[float, float]:
    """``(host_ms, gpu_ms)`` of one eager call of ``step`` on a CUDA ``device``: the host's time
    to issue it (``time.perf_counter`` around the call, no wait) and the GPU's time to run it
    (CUDA events)."""
    import time

    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    step()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    return host_ms, start.elapsed_time(end)


def for_case(choice: str, step: Step, *, device: torch.device, world_size: int, emulated: bool,
             median_ms: Callable[[Callable[[], object]], float], group=None,
             eager_reason: str | None = None, nondeterministic: bool = False) -> Capture:
    """Whether a case's timed loop replays a graph, and the graph (``spec.cuda_graph``).

    Args:
        choice: ``"on"``, ``"off"`` or ``"auto"`` (``case/fields.py``'s ``cuda_graph``).
        step: one iteration, returning its outputs (``bench.iteration``).
        device: this rank's device.
        world_size: ranks in the case; above 1 and not ``emulated``, a real NCCL run, which
            ``auto`` leaves eager.
        emulated: one process plays every rank (``run --emulate``): its transfers are device copies.
        median_ms: times a callable a few times and gives its median in ms (``auto`` compares
            the eager step with the replay by it).
        group: the process group, so that every rank of a real run agrees (any rank's failure
            leaves them all eager).
        eager_reason: set when the case's iteration cannot be replayed: it runs eagerly with this reason.
        nondeterministic: the kernel's backward adds with atomics (:func:`compare`).

    Returns:
        A :class:`Capture`. With ``auto``, nothing is captured where the host issues an iteration
        in less than :data:`HOST_BOUND` of the GPU's time to run it, and a captured iteration is
        kept only when its replay takes less time than the eager step (``median_ms`` of each);
        else the reason gives both times.
    """
    if choice == "off":
        return Capture(None, "--cuda-graph off")
    if eager_reason:
        return Capture(None, eager_reason)
    if device.type != "cuda":
        return Capture(None, f"{device.type} has no CUDA graphs")
    if choice == "auto" and world_size > 1 and not emulated:
        return Capture(None, "auto leaves a run with NCCL transfers eager (--cuda-graph on captures them)")
    if choice == "auto":
        host_ms, gpu_ms = issue_and_run_ms(step, device)
        if host_ms < HOST_BOUND * gpu_ms:
            return Capture(None, f"auto left it eager: the host issues an iteration in {host_ms:.3f} ms and the GPU "
                                 f"runs it in {gpu_ms:.3f} ms, so a replay could save no GPU time")
    captured = capture(step, device=device, nondeterministic=nondeterministic)
    if not _everyone_agrees(captured.replay is not None, device, group):
        return captured if captured.replay is None else Capture(None, "another rank's capture failed")
    if choice == "auto":
        eager_ms, graph_ms = median_ms(step), median_ms(captured.replay)
        if graph_ms >= eager_ms:
            return Capture(None, f"auto measured the graph no faster ({graph_ms:.3f} ms against {eager_ms:.3f} ms "
                                 "eager)")
    return captured
