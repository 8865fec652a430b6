"""The ring's point-to-point exchange, with byte counters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

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


class RingComm:
    """Send to the next rank and receive from the previous one, in batches.

    Use it as send_recv (any number of times) → commit → wait. The sends and receives of one
    batch go out together through ``batch_isend_irecv``, which cannot deadlock the way
    separately issued isend/irecv pairs can. ``wait`` only orders the
    current stream after the transfers; it never synchronises the device, so compute issued
    between commit and wait overlaps the transfer.

    Raises:
        RuntimeError: on misuse (commit with nothing queued, commit while a batch is in
            flight, wait with nothing in flight).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.world_size) \
            if group is not None else (self.rank + 1) % self.world_size
        self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.world_size) \
            if group is not None else (self.rank - 1) % self.world_size
        self._ops: list[dist.P2POp] = []
        self._requests: list | None = None

    def send_recv(self, send: Tensor, recv: Tensor) -> None:
        """Queue ``send`` to the next rank and a receive into ``recv`` from the previous one."""
        if send.shape != recv.shape or send.dtype != recv.dtype:
            raise RuntimeError(f"send {tuple(send.shape)} {send.dtype} and recv {tuple(recv.shape)} "
                               f"{recv.dtype} must match")
        self._ops.append(dist.P2POp(dist.isend, send, self.next_rank, self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv, self.prev_rank, self.group))
        nbytes = send.numel() * send.element_size()
        TRAFFIC.bytes_sent += nbytes
        TRAFFIC.bytes_received += nbytes

    def commit(self) -> None:
        """Start every queued transfer."""
        if self._requests is not None:
            raise RuntimeError("commit() called while a batch is in flight; call wait() first")
        if not self._ops:
            raise RuntimeError("commit() called with nothing queued; call send_recv() first")
        self._requests = dist.batch_isend_irecv(self._ops)
        self._ops = []

    def wait(self) -> None:
        """Make the current stream wait for the batch in flight."""
        if self._requests is None:
            raise RuntimeError("wait() called with no batch in flight; call commit() first")
        for req in self._requests:
            req.wait()
        self._requests = None
