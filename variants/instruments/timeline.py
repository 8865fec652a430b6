"""Time spans of a ring's kernel calls, merges and communication waits, per step (``run --profile``).

While an instrument context with a timeline is open (``instruments.open(timeline=device)``,
``context.py``), the functions the ring engine (``ring.py``) and its
communicator (``comm.py``) wrap with :func:`timed`, and the all-gather engines' (``llama3.py``,
``llama3_varlen.py``) :func:`span` blocks and the Ulysses exchange (``comm.all_to_all``),
record one span each: its kind, the phase
(``fwd`` or ``bwd``) and ring step the engine last announced with :func:`step`, and its start
and end marks. On CUDA a mark is a CUDA event recorded on the current stream, so nothing waits
for the device while the iterations run; the spans are read after them (:meth:`Timeline.resolve`,
one synchronise). On CPU a mark is ``time.perf_counter()``.

The kinds:

- ``kernel``: a local attention call (forward or backward);
- ``merge``: folding a block's out/lse into the running result, adding a block's gradient to
  an accumulator, and the accumulator casts;
- ``comm``: waiting for a transfer (``RingComm.wait``; the all-gather engines: the K/V gather's
  wait and the dK/dV reduce-scatter; Ulysses: each all-to-all). On CUDA that is the time the compute
  stream stalls for the transfer, the exposed communication; on CPU the time the host blocks.
  Under emulation (``emulation.py``) it is the device copies that stand in for the transfers:
  on CUDA the ring's wait for its copies made on a side stream (the exposed part, as for real
  transfers), and each collective's copies in line.

The host gap (CUDA only): when a span starts, the mark that ended the previous span (or began
the iteration) is asked, without waiting, whether the device has reached it. If it has, the
device ran dry before the host issued this span's work, and the time between that mark and this
span's start is a gap in which the GPU waited for the host (launches, Python). If it has not,
the device still had queued work, and the time between is device work outside the spans.

Spans do not nest: a span opened inside another is not recorded, so the parts of one
iteration never overlap on one stream and their sum stays within its wall time. When nothing
is recorded, :func:`timed` costs one context-variable read per call; :func:`step` too.
Recordings do not nest.

Source: issue 15, item 7 (where each rank's time goes); issue 25, item 2 (the host gap).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Iterator

import torch

from . import context

class Timeline:
    """The marks of every iteration recorded while its instrument context was open.

    Args:
        device: where the timed work runs; CUDA events on ``cuda``, ``perf_counter`` otherwise.
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.phase, self.step = "fwd", 0
        self._iterations: list[tuple[object, object, list]] = []
        self._spans: list | None = None
        self._begin = None
        self._last = None  # the mark that ended the latest span, or began the iteration
        self._open = False

    def mark(self):
        """A point in time on this device: a recorded CUDA event, or seconds from ``perf_counter``."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin_iteration(self) -> None:
        """Start one iteration: spans recorded from now on belong to it."""
        self.phase, self.step = "fwd", 0
        self._spans, self._begin = [], self.mark()
        self._last = self._begin

    def end_iteration(self) -> None:
        """End the iteration :meth:`begin_iteration` started."""
        self._iterations.append((self._begin, self.mark(), self._spans))
        self._spans = None

    def _elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def ran_dry(self) -> bool:
        """Whether the device has already reached the latest span's end mark (CUDA; never waits)."""
        return self.cuda and self._last is not None and self._last.query()

    def resolve(self) -> list[dict]:
        """Every recorded iteration: ``{"wall_ms", "host_gap_ms", "spans": [(kind, phase, step, ms), ...]}``.

        ``host_gap_ms`` sums, over the iteration's spans, the time the device waited for the
        host before each (module docstring); 0 off CUDA. On CUDA it synchronises the device
        once, after the iterations.
        """
        if self.cuda:
            torch.cuda.synchronize()
        return [{"wall_ms": self._elapsed_ms(begin, end),
                 "host_gap_ms": sum(self._elapsed_ms(before, s) for _, _, _, s, _, before in spans if before is not None),
                 "spans": [(kind, phase, step, self._elapsed_ms(s, e)) for kind, phase, step, s, e, _ in spans]}
                for begin, end, spans in self._iterations]


def current() -> Timeline | None:
    """The timeline open for the code running now, or ``None``."""
    return context.current().timeline


def step(phase: str, index: int) -> None:
    """Announce the ring step the engine starts now (``phase`` ``fwd`` or ``bwd``); the spans
    that follow carry it. Nothing happens unless a timeline is recorded."""
    tl = context.current().timeline
    if tl is not None:
        tl.phase, tl.step = phase, index


@contextlib.contextmanager
def _span(tl: Timeline | None, kind: str) -> Iterator[None]:
    if tl is None or tl._spans is None or tl._open:
        yield
        return
    tl._open = True
    before = tl._last if tl.ran_dry() else None  # the device waited for the host since that mark
    start = tl.mark()
    try:
        yield
    finally:
        tl._last = tl.mark()
        tl._spans.append((kind, tl.phase, tl.step, start, tl._last, before))
        tl._open = False


def span(kind: str) -> contextlib.AbstractContextManager:
    """The body is one span of ``kind`` while a timeline is recorded inside an iteration (and no
    other span is open); otherwise nothing is recorded."""
    return _span(context.current().timeline, kind)


def timed(kind: str) -> Callable[[Callable], Callable]:
    """Decorate a function so that each call is one :func:`span` of ``kind``; when nothing is
    recorded the call goes straight through."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            tl = context.current().timeline  # the one context read of the call
            if tl is None:
                return fn(*args, **kwargs)
            with _span(tl, kind):
                return fn(*args, **kwargs)
        return run
    return wrap
