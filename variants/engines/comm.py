"""Where ringbench's variants move bytes, each byte counted where it is sent.

ringbench's own variants communicate only through the helpers here, which count what they
move (``instruments/traffic.py`` holds the counters and the byte rules): :class:`RingComm`
(the ring's batched point-to-point exchange), :func:`all_gather_into_tensor` /
:func:`reduce_scatter_tensor` (the all-gather variants) and :func:`all_to_all_single` (the
Ulysses variants). A peer that moves its bytes through its own ``torch.distributed`` calls
holds :func:`dist_session` around its case, an instrument context that counts those calls
while it is open.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .. import instruments
from ..instruments import emulation, timeline
from ..instruments.traffic import call_counted, counted, nbytes

Tensor = torch.Tensor


# --------------------------------------------------------------------------- ringbench's helpers

def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list:
    """``torch.distributed.batch_isend_irecv``, counted: the sends' tensors sent, the receives' received."""
    return call_counted("batch_isend_irecv", p2p_op_list)


def all_gather_into_tensor(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor``, counted: the local shard ``input`` times
    W - 1, sent and received."""
    return call_counted("all_gather_into_tensor", output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.reduce_scatter_tensor`` (sum), counted: the local shard ``output``
    times W - 1, sent and received."""
    return call_counted("reduce_scatter_tensor", output, input, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_reduce`` (sum), counted as a ring all-reduce: ``2 (W - 1) / W``
    times the tensor, sent and received."""
    return call_counted("all_reduce", tensor, group=group, async_op=async_op)


def all_to_all_single(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_to_all_single`` in equal splits along dim 0, counted: every part
    of ``input`` but this rank's own is sent, and every part of ``output`` but its own received
    (``(W - 1) / W`` of the tensor each way)."""
    return call_counted("all_to_all_single", output, input, group=group, async_op=async_op)


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
            with counted(sum(nbytes(s) for s, _ in self._ops), sum(nbytes(r) for _, r in self._ops)):
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


def dist_session(spec: dict, group, device) -> contextlib.AbstractContextManager:
    """A variant's ``session`` (held around a whole case, forward and backward) that counts
    the variant's own ``torch.distributed`` calls: an instrument context with the patch of
    ``torch.distributed`` (``instruments.open(count_dist=True)``), undone when it closes."""
    return instruments.open(count_dist=True)
