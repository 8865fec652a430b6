"""Where the variants move bytes, each byte counted where it is sent.

ringbench's own variants communicate only through the helpers here, which count what they
move: :class:`RingComm` (the ring's batched point-to-point exchange),
:func:`all_gather_into_tensor` / :func:`reduce_scatter_tensor` (the all-gather variants) and
:func:`all_to_all_single` (the Ulysses variants). A
peer that moves its bytes through its own ``torch.distributed`` calls runs under
:func:`counting_dist`, which, while held, counts the public point-to-point and collective
functions of ``torch.distributed`` (the real call still happens). Both follow one set of
byte rules, and a byte is counted once: a call made from inside a counted call (a helper
here calling a ``torch.distributed`` function that :func:`counting_dist` wraps) adds nothing.

The rules, per rank and per call, W the ranks of the call's group:

- send / isend: the tensor handed to the send is sent; recv / irecv: the tensor filled is
  received; ``batch_isend_irecv``: each of its operations so.
- all-gather of a local shard (``all_gather_into_tensor``, ``all_gather``): the shard times
  W - 1, sent and received.
- reduce-scatter to a local shard (``reduce_scatter_tensor``, ``reduce_scatter``): the shard
  times W - 1, sent and received.
- all-to-all: everything but this rank's own part is sent, and received.
- all-reduce: ``2 (W - 1) / W`` of the tensor (a reduce-scatter and an all-gather), both ways.
- broadcast / scatter: the root sends the tensor to W - 1 ranks, every other rank receives
  its part once; reduce / gather: the other way round.

Not seen: barrier, the object collectives, functions bound before :func:`counting_dist` was
entered (``from torch.distributed import isend``), and functional collectives and DTensor
(PyTorch's own context parallel): a variant whose bytes go that way says so in the registry
(``Variant.traffic_counted``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from ..instruments import emulation, timeline

Tensor = torch.Tensor


@dataclass
class Traffic:
    """Bytes this process has sent and received through ringbench's communicators."""

    bytes_sent: int = 0
    bytes_received: int = 0


#: Process-wide counters; the harness resets them around a measured window.
TRAFFIC = Traffic()


def reset_traffic() -> None:
    """Set this process's byte counters back to zero."""
    TRAFFIC.bytes_sent = 0
    TRAFFIC.bytes_received = 0


# --------------------------------------------------------------------------- counting, once

_local = threading.local()


@contextlib.contextmanager
def _counted(sent: int, received: int) -> Iterator[None]:
    """Add ``sent`` and ``received`` to the counters, unless a counted call is already running
    on this thread (then the caller counted these bytes), and hold the mark while the body runs."""
    if getattr(_local, "inside", False):
        yield
        return
    TRAFFIC.bytes_sent += sent
    TRAFFIC.bytes_received += received
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = False


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _world(group) -> int:
    return dist.get_world_size(group)


def _is_root(group, root: int | None, group_root: int | None) -> bool:
    """Whether this rank is the root given as a global rank (``src``/``dst``) or a group rank."""
    if group_root is not None:
        return dist.get_rank(group) == group_root
    return dist.get_rank() == (root or 0)


def _unwrapped(op: Callable) -> Callable:
    return getattr(op, "__ringbench_counted__", op)


# The rules: each takes the arguments of the torch.distributed function of its name and
# returns (bytes sent, bytes received) by this rank (module docstring).

def _send(tensor, *args, **kwargs):
    return _nbytes(tensor), 0


def _recv(tensor, *args, **kwargs):
    return 0, _nbytes(tensor)


def _batch_isend_irecv(p2p_op_list, *args, **kwargs):
    sent = received = 0
    for op in p2p_op_list:
        if _unwrapped(op.op) is _c10d.isend:
            sent += _nbytes(op.tensor)
        else:
            received += _nbytes(op.tensor)
    return sent, received


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, *args, **kwargs):
    n = _nbytes(input_tensor) * (_world(group) - 1)
    return n, n


def _all_gather(tensor_list, tensor, group=None, *args, **kwargs):
    n = _nbytes(tensor) * (_world(group) - 1)
    return n, n


def _reduce_scatter_tensor(output, input, op=None, group=None, *args, **kwargs):
    n = _nbytes(output) * (_world(group) - 1)
    return n, n


def _reduce_scatter(output, input_list, op=None, group=None, *args, **kwargs):
    n = _nbytes(output) * (_world(group) - 1)
    return n, n


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                       *args, **kwargs):
    world_size, rank = _world(group), dist.get_rank(group)

    def others(t, splits):
        if not splits:
            return _nbytes(t) * (world_size - 1) // world_size
        row = _nbytes(t) // max(1, t.shape[0]) if t.dim() else 0
        return row * (sum(splits) - splits[rank])

    return others(input, input_split_sizes), others(output, output_split_sizes)


def _all_to_all(output_tensor_list, input_tensor_list, group=None, *args, **kwargs):
    rank = dist.get_rank(group)
    sent = sum(_nbytes(t) for i, t in enumerate(input_tensor_list) if i != rank)
    received = sum(_nbytes(t) for i, t in enumerate(output_tensor_list) if i != rank)
    return sent, received


def _all_reduce(tensor, op=None, group=None, *args, **kwargs):
    world_size = _world(group)
    n = 2 * _nbytes(tensor) * (world_size - 1) // world_size
    return n, n


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None, **kwargs):
    if _is_root(group, src, group_src):
        return _nbytes(tensor) * (_world(group) - 1), 0
    return 0, _nbytes(tensor)


def _reduce(tensor, dst=None, op=None, group=None, async_op=False, group_dst=None, **kwargs):
    if _is_root(group, dst, group_dst):
        return 0, _nbytes(tensor) * (_world(group) - 1)
    return _nbytes(tensor), 0


def _gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None, **kwargs):
    if _is_root(group, dst, group_dst):
        return 0, _nbytes(tensor) * (_world(group) - 1)
    return _nbytes(tensor), 0


def _scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None, **kwargs):
    if _is_root(group, src, group_src):
        return _nbytes(tensor) * (_world(group) - 1), 0
    return 0, _nbytes(tensor)


#: The functions of ``torch.distributed`` that :func:`counting_dist` counts, and their rules.
RULES: dict[str, Callable[..., tuple[int, int]]] = {
    "send": _send, "isend": _send, "recv": _recv, "irecv": _recv,
    "batch_isend_irecv": _batch_isend_irecv,
    "all_gather_into_tensor": _all_gather_into_tensor, "all_gather": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter_tensor, "reduce_scatter": _reduce_scatter,
    "all_to_all_single": _all_to_all_single, "all_to_all": _all_to_all,
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce, "gather": _gather,
    "scatter": _scatter,
}


def _call_counted(name: str, *args, **kwargs):
    """Count ``torch.distributed.<name>(*args, **kwargs)`` by its rule, then make the call."""
    with _counted(*RULES[name](*args, **kwargs)):
        return getattr(dist, name)(*args, **kwargs)


# --------------------------------------------------------------------------- ringbench's helpers

def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list:
    """``torch.distributed.batch_isend_irecv``, counted: the sends' tensors sent, the receives' received."""
    return _call_counted("batch_isend_irecv", p2p_op_list)


def all_gather_into_tensor(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor``, counted: the local shard ``input`` times
    W - 1, sent and received."""
    return _call_counted("all_gather_into_tensor", output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.reduce_scatter_tensor`` (sum), counted: the local shard ``output``
    times W - 1, sent and received."""
    return _call_counted("reduce_scatter_tensor", output, input, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_reduce`` (sum), counted as a ring all-reduce: ``2 (W - 1) / W``
    times the tensor, sent and received."""
    return _call_counted("all_reduce", tensor, group=group, async_op=async_op)


def all_to_all_single(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_to_all_single`` in equal splits along dim 0, counted: every part
    of ``input`` but this rank's own is sent, and every part of ``output`` but its own received
    (``(W - 1) / W`` of the tensor each way)."""
    return _call_counted("all_to_all_single", output, input, group=group, async_op=async_op)


class RingComm:
    """Send to the next rank and receive from the previous one, in batches.

    With ``reverse=True`` the ring runs the other way: send to the previous rank, receive
    from the next one.

    Use it as send_recv (any number of times) → commit → wait. The sends and receives of one
    batch go out together through ``batch_isend_irecv``, which cannot deadlock the way
    separately issued isend/irecv pairs can. ``wait`` only orders the
    current stream after the transfers; it never synchronises the device, so compute issued
    between commit and wait overlaps the transfer. The bytes are counted when the batch is
    committed (:func:`batch_isend_irecv`). While an emulation is held (``emulation.py``), the
    transfers are device copies made at commit, counted the same way, and wait has nothing to do.

    Raises:
        RuntimeError: on misuse (commit with nothing queued, commit while a batch is in
            flight, wait with nothing in flight).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, reverse: bool = False):
        self.group = group
        self.rank, self.world_size = emulation.rank_and_size(group)
        self._emulation = emulation.current()  # emulated: transfers are device copies (emulation.py)
        # reverse: "next" is rank - 1 (the ring run the other way, as the engine's backward does).
        ahead = -1 if reverse else 1
        nxt, prev = (self.rank + ahead) % self.world_size, (self.rank - ahead) % self.world_size
        real = group is not None and self._emulation is None
        self.next_rank = dist.get_global_rank(group, nxt) if real else nxt
        self.prev_rank = dist.get_global_rank(group, prev) if real else prev
        self._ops: list[dist.P2POp] = []
        self._requests: list | None = None

    def send_recv(self, send: Tensor, recv: Tensor) -> None:
        """Queue ``send`` to the next rank and a receive into ``recv`` from the previous one."""
        if send.shape != recv.shape or send.dtype != recv.dtype:
            raise RuntimeError(f"send {tuple(send.shape)} {send.dtype} and recv {tuple(recv.shape)} "
                               f"{recv.dtype} must match")
        if self._emulation is not None:
            self._ops.append((send, recv))
            return
        self._ops.append(_c10d.P2POp(_c10d.isend, send, self.next_rank, self.group))
        self._ops.append(_c10d.P2POp(_c10d.irecv, recv, self.prev_rank, self.group))

    def commit(self) -> None:
        """Start every queued transfer."""
        if self._requests is not None:
            raise RuntimeError("commit() called while a batch is in flight; call wait() first")
        if not self._ops:
            raise RuntimeError("commit() called with nothing queued; call send_recv() first")
        if self._emulation is not None:
            with _counted(sum(_nbytes(s) for s, _ in self._ops), sum(_nbytes(r) for _, r in self._ops)):
                self._requests = self._emulation.transfer(self._ops, self.prev_rank - self.rank)
        else:
            self._requests = batch_isend_irecv(self._ops)
        self._ops = []

    @timeline.timed("comm")
    def wait(self) -> None:
        """Make the current stream wait for the batch in flight."""
        if self._requests is None:
            raise RuntimeError("wait() called with no batch in flight; call commit() first")
        for req in self._requests:
            req.wait()
        self._requests = None


# --------------------------------------------------------------------------- a peer's own calls

class _CountedP2POp(_c10d.P2POp):
    """``P2POp`` while :func:`counting_dist` is held: takes the counted isend/irecv and stores
    the real ones, which ``P2POp`` and ``batch_isend_irecv`` require."""

    def __new__(cls, op, tensor, *args, **kwargs):
        return super().__new__(cls, _unwrapped(op), tensor, *args, **kwargs)

    def __init__(self, op, tensor, *args, **kwargs):
        super().__init__(_unwrapped(op), tensor, *args, **kwargs)


def _counting(name: str, real: Callable) -> Callable:
    @functools.wraps(real)
    def counted(*args, **kwargs):
        with _counted(*RULES[name](*args, **kwargs)):
            return real(*args, **kwargs)

    counted.__ringbench_counted__ = real
    return counted


_held = 0
_saved: dict[str, object] = {}


@contextlib.contextmanager
def counting_dist() -> Iterator[None]:
    """While held, count every call of ``torch.distributed``'s functions in :data:`RULES`.

    Instrumentation, not a stand-in: each call still runs the real function. Its attributes
    on the ``torch.distributed`` module are replaced for the duration (``P2POp`` too, so that
    it takes the counted isend and irecv), so calls looked up through the module at call
    time (``dist.batch_isend_irecv(...)``, as ring-flash-attn makes them) are counted;
    nested holds are one hold, and calls of ringbench's own helpers are counted once.
    """
    global _held
    if _held == 0:
        _saved.update({name: getattr(dist, name) for name in (*RULES, "P2POp")})
        for name in RULES:
            setattr(dist, name, _counting(name, _saved[name]))
        dist.P2POp = _CountedP2POp
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if _held == 0:
            for name, value in _saved.items():
                setattr(dist, name, value)
            _saved.clear()


def dist_session(spec: dict, group, device) -> contextlib.AbstractContextManager:
    """A variant's ``session`` (held around a whole case, forward and backward) that counts
    the variant's own ``torch.distributed`` calls: :func:`counting_dist`."""
    return counting_dist()
