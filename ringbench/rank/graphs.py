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

A replay is checked against an eager call on the same inputs (:func:`compare`): bitwise equal,
or, where the eager path itself differs from call to call (a backward that adds dq with
atomics), no further from eager than two eager calls are from each other. A capture that fails,
or a replay that fails the check, leaves the case eager, and the record says why.

Source: issue 25, item 1; PyTorch's CUDA graphs notes (whole-network capture).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

Tensor = torch.Tensor
#: ``step() -> outputs``: one iteration of the case, returning the tensors it produced.
Step = Callable[[], Sequence[Tensor]]


@dataclass(frozen=True)
class Capture:
    """A captured iteration, or why there is none.

    Attributes:
        replay: runs the captured iteration (one graph launch); None when not captured.
        reason: None when captured and checked; else one clause saying why the case runs eagerly.
        check: how the replay matched eager (``"bitwise"``, ``"within eager's own spread"``),
            or None when not captured.
        outputs: the captured step's output tensors, which every replay overwrites.
    """

    replay: Callable[[], None] | None
    reason: str | None
    check: str | None = None
    outputs: tuple = ()


def _snapshot(outputs: Sequence[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in outputs if t is not None]


def _max_difference(a: list[Tensor], b: list[Tensor]) -> float:
    return max(((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)), default=0.0)


def compare(replayed: list[Tensor], eager: list[Tensor], eager_again: list[Tensor]) -> str | None:
    """How a replay's outputs match eager's: ``"bitwise"``, ``"within eager's own spread"``, or
    None when they do not match.

    Args:
        replayed: the outputs after one replay.
        eager, eager_again: the outputs of two eager calls on the same inputs.
    """
    if len(replayed) != len(eager):
        return None
    if all(torch.equal(x, y) for x, y in zip(replayed, eager)):
        return "bitwise"
    spread = _max_difference(eager, eager_again)
    if spread > 0 and _max_difference(replayed, eager) <= 2 * spread:
        return "within eager's own spread"
    return None


def capture(step: Step, *, device: torch.device, warmup: int = 2) -> Capture:
    """Capture ``step`` as a CUDA graph on ``device`` and check one replay against eager calls.

    Args:
        step: one iteration, returning its output tensors (out, and the grads in fwd_bwd).
        device: a CUDA device.
        warmup: calls on a side stream before the capture.

    Returns:
        A :class:`Capture`; its ``reason`` names the failure when the case must run eagerly (the
        capture raised, or the replay's outputs differ from eager's).
    """
    eager = _snapshot(step())
    eager_again = _snapshot(step())
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
    check = compare(_snapshot(outputs), eager, eager_again)
    if check is None:
        return Capture(None, "a replay's outputs differed from an eager call's on the same inputs")
    return Capture(graph.replay, None, check, tuple(outputs))


def _everyone_agrees(ok: bool, device: torch.device, group) -> bool:
    """Whether every rank of ``group`` captured (one all-reduce; True alone in a process of one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def for_case(choice: str, step: Step, *, device: torch.device, world_size: int, emulated: bool,
             median_ms: Callable[[Callable[[], object]], float], group=None) -> Capture:
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

    Returns:
        A :class:`Capture`. With ``auto``, a captured iteration is kept only when its replay takes
        less time than the eager step (``median_ms`` of each); else its reason gives both times.
    """
    if choice == "off":
        return Capture(None, "--cuda-graph off")
    if device.type != "cuda":
        return Capture(None, f"{device.type} has no CUDA graphs")
    if choice == "auto" and world_size > 1 and not emulated:
        return Capture(None, "auto leaves a run with NCCL transfers eager (--cuda-graph on captures them)")
    captured = capture(step, device=device)
    if not _everyone_agrees(captured.replay is not None, device, group):
        return captured if captured.replay is None else Capture(None, "another rank's capture failed")
    if choice == "auto":
        eager_ms, graph_ms = median_ms(step), median_ms(captured.replay)
        if graph_ms >= eager_ms:
            return Capture(None, f"auto measured the graph no faster ({graph_ms:.3f} ms against {eager_ms:.3f} ms "
                                 "eager)")
    return captured
