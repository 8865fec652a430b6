"""Bytes counted where they are sent: the counters, the byte rules, and the patch of ``torch.distributed``.

Every counted transfer adds its bytes to the :class:`Traffic` of the instrument context open
for the code that makes it (``instruments.open(traffic=True)``, ``context.py``), and to the
counters of every context it is nested in; with none open nothing is counted. ringbench's
communicators (``engines/comm.py``) count what they move through :func:`counted`. A peer that
moves its bytes through its own ``torch.distributed`` calls runs in a context opened with
``count_dist=True``, which, while open, counts the public point-to-point and collective
functions of ``torch.distributed`` (the real call still happens) and puts them back when it
closes. Both follow one set of byte rules, and a byte is counted once: a call made from
inside a counted call (a helper in ``comm`` calling a ``torch.distributed`` function that the
patch wraps) adds nothing.

The rules, per rank and per call, W the ranks of the call's group (under an emulation,
``emulation.py``, the emulated group's, so an emulated rank counts what a real one sends):

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

Not seen: barrier, the object collectives, functions bound before the patch was made
(``from torch.distributed import isend``), and functional collectives and DTensor (PyTorch's
own context parallel): a variant whose bytes go that way says so in the registry
(``Variant.traffic_counted``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from . import context, emulation

Tensor = torch.Tensor


@dataclass(eq=False)
class Traffic:
    """Bytes sent and received by the counted transfers made under one instrument context.

    Attributes:
        bytes_sent, bytes_received: bytes, summed over the context's calls (rules: module docstring).
        outer: the counters of the context this one is nested in, which see these bytes too.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    outer: "Traffic | None" = field(default=None, repr=False)

    def add(self, sent: int, received: int) -> None:
        """Count ``sent`` and ``received`` bytes here and in every enclosing context's counters."""
        t = self
        while t is not None:
            t.bytes_sent += sent
            t.bytes_received += received
            t = t.outer


# --------------------------------------------------------------------------- counting, once

# A thread's mark that a counted call is running, so the calls it makes are not counted again.
_local = threading.local()


@contextlib.contextmanager
def counted(sent: int, received: int, inst: context.Instruments | None = None) -> Iterator[None]:
    """Add ``sent`` and ``received`` bytes to the counters of ``inst`` (default: the context
    current now), unless a counted call is already running on this thread (then the caller
    counted these bytes), and hold the mark while the body runs."""
    if getattr(_local, "inside", False):
        yield
        return
    traffic = (inst or context.current()).traffic
    if traffic is not None:
        traffic.add(sent, received)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = False


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _world(group) -> int:
    return emulation.rank_and_size(group)[1]  # an emulated group's size under an emulation


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
    return nbytes(tensor), 0


def _recv(tensor, *args, **kwargs):
    return 0, nbytes(tensor)


def _batch_isend_irecv(p2p_op_list, *args, **kwargs):
    sent = received = 0
    for op in p2p_op_list:
        if _unwrapped(op.op) is _c10d.isend:
            sent += nbytes(op.tensor)
        else:
            received += nbytes(op.tensor)
    return sent, received


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, *args, **kwargs):
    n = nbytes(input_tensor) * (_world(group) - 1)
    return n, n


def _all_gather(tensor_list, tensor, group=None, *args, **kwargs):
    n = nbytes(tensor) * (_world(group) - 1)
    return n, n


def _reduce_scatter_tensor(output, input, op=None, group=None, *args, **kwargs):
    n = nbytes(output) * (_world(group) - 1)
    return n, n


def _reduce_scatter(output, input_list, op=None, group=None, *args, **kwargs):
    n = nbytes(output) * (_world(group) - 1)
    return n, n


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                       *args, **kwargs):
    rank, world_size = emulation.rank_and_size(group)

    def others(t, splits):
        if not splits:
            return nbytes(t) * (world_size - 1) // world_size
        row = nbytes(t) // max(1, t.shape[0]) if t.dim() else 0
        return row * (sum(splits) - splits[rank])

    return others(input, input_split_sizes), others(output, output_split_sizes)


def _all_to_all(output_tensor_list, input_tensor_list, group=None, *args, **kwargs):
    rank = emulation.rank_and_size(group)[0]
    sent = sum(nbytes(t) for i, t in enumerate(input_tensor_list) if i != rank)
    received = sum(nbytes(t) for i, t in enumerate(output_tensor_list) if i != rank)
    return sent, received


def _all_reduce(tensor, op=None, group=None, *args, **kwargs):
    world_size = _world(group)
    n = 2 * nbytes(tensor) * (world_size - 1) // world_size
    return n, n


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None, **kwargs):
    if _is_root(group, src, group_src):
        return nbytes(tensor) * (_world(group) - 1), 0
    return 0, nbytes(tensor)


def _reduce(tensor, dst=None, op=None, group=None, async_op=False, group_dst=None, **kwargs):
    if _is_root(group, dst, group_dst):
        return 0, nbytes(tensor) * (_world(group) - 1)
    return nbytes(tensor), 0


def _gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None, **kwargs):
    if _is_root(group, dst, group_dst):
        return 0, nbytes(tensor) * (_world(group) - 1)
    return nbytes(tensor), 0


def _scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None, **kwargs):
    if _is_root(group, src, group_src):
        return nbytes(tensor) * (_world(group) - 1), 0
    return 0, nbytes(tensor)


#: The functions of ``torch.distributed`` that the patch (``count_dist=True``) counts, and their rules.
RULES: dict[str, Callable[..., tuple[int, int]]] = {
    "send": _send, "isend": _send, "recv": _recv, "irecv": _recv,
    "batch_isend_irecv": _batch_isend_irecv,
    "all_gather_into_tensor": _all_gather_into_tensor, "all_gather": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter_tensor, "reduce_scatter": _reduce_scatter,
    "all_to_all_single": _all_to_all_single, "all_to_all": _all_to_all,
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce, "gather": _gather,
    "scatter": _scatter,
}


def call_counted(name: str, *args, **kwargs):
    """Count ``torch.distributed.<name>(*args, **kwargs)`` by its rule, then make the call."""
    with counted(*RULES[name](*args, **kwargs)):
        return getattr(dist, name)(*args, **kwargs)


# --------------------------------------------------------------------------- the patch, for a peer's own calls

class _CountedP2POp(_c10d.P2POp):
    """``P2POp`` while the patch is held: takes the counted isend/irecv and stores the real
    ones, which ``P2POp`` and ``batch_isend_irecv`` require."""

    def __new__(cls, op, tensor, *args, **kwargs):
        return super().__new__(cls, _unwrapped(op), tensor, *args, **kwargs)

    def __init__(self, op, tensor, *args, **kwargs):
        super().__init__(_unwrapped(op), tensor, *args, **kwargs)


class _Patch:
    """The one patch of the ``torch.distributed`` module: the real functions it replaced, how
    many contexts hold it, and the outermost of them (where a call from a thread that sees no
    context of its own is counted, at that context's innermost open context)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.saved: dict[str, object] = {}
        self.owner: context.Instruments | None = None

    def counting(self, name: str, real: Callable) -> Callable:
        @functools.wraps(real)
        def counted_call(*args, **kwargs):
            inst = context.current()
            if inst is context.NONE and self.owner is not None:
                # A thread with no context of its own: the autograd engine's device thread
                # running a peer's backward (context.py). Its bytes belong to the case open.
                inst = self.owner.innermost()
            with counted(*RULES[name](*args, **kwargs), inst):
                return real(*args, **kwargs)

        counted_call.__ringbench_counted__ = real
        return counted_call

    @contextlib.contextmanager
    def holding(self, inst: context.Instruments) -> Iterator[None]:
        """Hold the patch while the body runs, ``inst`` being the context that holds it; the
        first hold patches, the last release (even by an exception) puts the originals back."""
        with self.lock:
            if self.held == 0:
                self.saved = {name: getattr(dist, name) for name in (*RULES, "P2POp")}
                for name in RULES:
                    setattr(dist, name, self.counting(name, self.saved[name]))
                dist.P2POp = _CountedP2POp
                self.owner = inst
            self.held += 1
        try:
            yield
        finally:
            with self.lock:
                self.held -= 1
                if self.held == 0:
                    for name, value in self.saved.items():
                        setattr(dist, name, value)
                    self.saved, self.owner = {}, None


_PATCH = _Patch()


def holding_dist_patch(inst: context.Instruments) -> contextlib.AbstractContextManager:
    """While held, every call of ``torch.distributed``'s functions in :data:`RULES` is counted.

    Instrumentation, not a stand-in: each call still runs the real function. Its attributes
    on the ``torch.distributed`` module are replaced for the duration (``P2POp`` too, so that
    it takes the counted isend and irecv), so calls looked up through the module at call
    time (``dist.batch_isend_irecv(...)``, as ring-flash-attn makes them) are counted;
    nested holds are one hold, and calls of ringbench's own helpers are counted once. For
    ``instruments.open(count_dist=True)``, which passes its context as ``inst``.
    """
    return _PATCH.holding(inst)
