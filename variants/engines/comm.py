"""Where ringbench's variants move bytes, each byte counted where it is sent.

ringbench's own variants communicate only through the helpers here, which count what they
move (``instruments/traffic.py`` holds the counters and the byte rules): :class:`RingComm`
(the ring's batched point-to-point exchange), :func:`all_gather_into_tensor` /
:func:`reduce_scatter_tensor` (the all-gather variants), :func:`all_to_all` (the Ulysses
variants), :func:`all_reduce` (a learnable sink's gradient) and :func:`all_gather` (the varlen
``cu_seqlens`` check). A peer that moves its bytes through its own ``torch.distributed`` calls
holds :func:`dist_session` around its case, an instrument context that counts those calls
while it is open.

Under an emulation (``instruments/emulation.py``, ``run --emulate``) every helper here, and
the groups of :func:`new_group`, hands its work to the emulated rank instead of
``torch.distributed``, counted by the same rules; the engines' code runs as it does for real.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from .. import instruments
from ..instruments import emulation, timeline
from ..instruments.traffic import RULES, call_counted, counted, nbytes

Tensor = torch.Tensor


# --------------------------------------------------------------------------- ringbench's helpers

def _collective(name: str, *args, **kwargs):
    """``torch.distributed.<name>``, counted by its rule; the emulated rank's method of that
    name while an emulation is open."""
    emulated = emulation.current()
    if emulated is None:
        return call_counted(name, *args, **kwargs)
    with counted(*RULES[name](*args, **kwargs)):
        return getattr(emulated, name)(*args, **kwargs)


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list:
    """``torch.distributed.batch_isend_irecv``, counted: the sends' tensors sent, the receives' received."""
    return call_counted("batch_isend_irecv", p2p_op_list)


def all_gather_into_tensor(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor``, counted: the local shard ``input`` times
    W - 1, sent and received. ``input`` may be a strided view (llama3's head group); it is
    made contiguous for the call."""
    if emulation.current() is not None:  # the view itself: the emulation knows what it holds
        return _collective("all_gather_into_tensor", output, input, group=group, async_op=async_op)
    return call_counted("all_gather_into_tensor", output, input.contiguous(), group=group, async_op=async_op)


def all_gather(tensor_list: list[Tensor], tensor: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather``, counted: ``tensor`` times W - 1, sent and received."""
    return _collective("all_gather", tensor_list, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.reduce_scatter_tensor`` (sum), counted: the local shard ``output``
    times W - 1, sent and received."""
    return _collective("reduce_scatter_tensor", output, input, group=group, async_op=async_op)


def all_reduce(tensor: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_reduce`` (sum), counted as a ring all-reduce: ``2 (W - 1) / W``
    times the tensor, sent and received."""
    return _collective("all_reduce", tensor, group=group, async_op=async_op)


def all_reduce_max(tensor: Tensor, group=None) -> None:
    """``torch.distributed.all_reduce`` with ``ReduceOp.MAX``, in place (a per-head max logit over
    the group, ``kernels/max_logit.py``), counted as :func:`all_reduce` is. Not emulated: only
    verify asks for the max logit."""
    if emulation.current() is not None:
        raise RuntimeError("the max logit's all-reduce MAX is not emulated; run it under a process group")
    call_counted("all_reduce", tensor, op=dist.ReduceOp.MAX, group=group)


def all_to_all_single(output: Tensor, input: Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_to_all_single`` in equal splits along dim 0, counted: every part
    of ``input`` but this rank's own is sent, and every part of ``output`` but its own received
    (``(W - 1) / W`` of the tensor each way). Not emulated: the engines exchange through
    :func:`all_to_all`."""
    return call_counted("all_to_all_single", output, input, group=group, async_op=async_op)


def all_to_all(parts: Sequence[Tensor], dim: int, group=None) -> Tensor:
    """Send ``parts[u]`` to rank u of ``group`` and return what every rank of the group sent
    this one, concatenated along ``dim`` in group order (the Ulysses exchange).

    Args:
        parts: one tensor per rank of the group, all of one shape; views are fine (they are
            packed into one send buffer, ``[W, *shape]``).
        dim: the dimension the received parts are joined along.
        group: the process group (default: the world).

    Returns:
        A new tensor: ``parts``' shape with ``dim`` W times as long.

    Counted as :func:`all_to_all_single`: every part but this rank's own, sent and received.
    The exchange alone is one ``comm`` span (blocking: all of it exposed communication in
    ``--profile``); the packing and joining copies are not.
    """
    emulated = emulation.current()
    if emulated is not None:
        n = nbytes(parts[0]) * (len(parts) - 1)
        with counted(n, n):
            return emulated.all_to_all(parts, dim, group)
    send = torch.stack(list(parts))
    recv = torch.empty_like(send)
    with timeline.span("comm"):
        all_to_all_single(recv, send, group)
    return torch.cat(recv.unbind(0), dim)


# --------------------------------------------------------------------------- groups

def group_ranks(group=None) -> list[int]:
    """The global ranks of ``group``'s members in group order (``None``: the world); the
    emulated ones under an emulation."""
    emulated = emulation.current()
    if emulated is not None:
        return list(emulated.members(group).ranks)
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def global_rank() -> int:
    """This process's rank in the world; the emulated rank under an emulation."""
    emulated = emulation.current()
    return emulated.rank if emulated is not None else dist.get_rank()


def new_group(split: Sequence[Sequence[int]], member: int):
    """The group of global rank ``member`` among ``split`` (every group of one split of the
    ranks, as global ranks): a new process group made by its ranks alone
    (``use_local_synchronization``, so every rank makes its own, together with its
    members), or the emulated group under an emulation."""
    emulated = emulation.current()
    if emulated is not None:
        return emulated.group(split, member)
    mine = next(list(part) for part in split if member in part)
    return dist.new_group(mine, use_local_synchronization=True)


def collective_device(device: torch.device, group=None) -> torch.device:
    """Where a small tensor now on ``device`` must be for a collective over ``group``: the
    current CUDA device for NCCL, else ``device`` (under an emulation: ``device``)."""
    if emulation.current() is None and dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
    transfers are device copies issued at commit (on CUDA on a side stream, which wait joins, so
    they overlap the compute between as real transfers do), counted the same way.

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
                self._requests = self._emulation.transfer(self._ops, self.prev_rank - self.rank, self.group)
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
