"""A ring step's merge (forward) and gradient adds (backward) on a side stream, beside the next step's kernel.

A step's merge reads the block's result and the running sums; the next step's kernel reads
neither. On one stream the GPU runs them one after the other: at 4k tokens per rank the merges
and adds, memory-bound, were 6-8% of a zigzag rank's time (issue 25, W=8 32k on an H200). Issued
on a second stream, each can run while the next kernel does, and the kernel is the larger.

:class:`Side` is that stream for one pass of the ring. Every tensor that crosses between the
streams is recorded on the stream that uses it (``Tensor.record_stream``), so the caching
allocator never hands its memory out while the other stream may still read it; the engine
joins the side stream back (:meth:`Side.join`) before it reads what the side stream wrote.
A transfer issued inside :meth:`Side.work` (the backward's dK/dV hop) is ordered after that work,
as NCCL and the emulation's copies order a send after the stream that issued it.

On CPU, under ``--profile`` (whose spans are one stream's, ``instruments/timeline.py``) and with
``RINGBENCH_SIDE_MERGE=0`` everything runs in line, as before.

Source: issue 25 (strong scaling), item 1: cut what each step costs beside its kernel.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..instruments import context

Tensor = torch.Tensor

#: One side stream per CUDA device, made on first use (a graph capture may use it: made outside).
_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def wanted(device: torch.device) -> bool:
    """Whether a ring pass on ``device`` merges on a side stream: CUDA, no profile being recorded,
    and not turned off with ``RINGBENCH_SIDE_MERGE=0``."""
    return (device.type == "cuda" and context.current().timeline is None
            and os.environ.get("RINGBENCH_SIDE_MERGE", "1") != "0")


class Side:
    """The side stream of one ring pass on ``device``, or nothing to do (:func:`wanted`)."""

    def __init__(self, device: torch.device):
        self.stream = None
        self.main = None
        self.used = False  # a join without side work would wait on an event from outside a graph capture
        if wanted(device):
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in _STREAMS:
                _STREAMS[index] = torch.cuda.Stream(device=index)
            self.stream = _STREAMS[index]
            self.main = torch.cuda.current_stream(index)

    @contextlib.contextmanager
    def work(self, *reads):
        """Run the body on the side stream, after the work queued so far on the main stream.

        ``reads``: tensors the body uses that the main stream made or will use (``None`` is skipped).
        """
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(self.main)
        self.used = True
        self.hand(self.stream, *reads)
        with torch.cuda.stream(self.stream):
            yield

    def made(self, *tensors) -> None:
        """``tensors`` made or written by :meth:`work` bodies that the main stream will use."""
        if self.stream is not None:
            self.hand(self.main, *tensors)

    def join(self) -> None:
        """The main stream waits for everything this pass issued on the side stream (nothing to wait
        for where it issued none)."""
        if self.used:
            self.main.wait_stream(self.stream)

    @staticmethod
    def hand(stream, *tensors) -> None:
        for t in tensors:
            if isinstance(t, Tensor) and t.is_cuda:
                t.record_stream(stream)
