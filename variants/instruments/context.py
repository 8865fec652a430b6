"""The instrument context: which instruments are open for the code running now, one ``ContextVar``.

An :class:`Instruments` holds the traffic counters, the observation of kernel calls, the
timeline of spans and the emulated rank, each ``None`` when not open. ``instruments.open``
(the package's ``__init__``) builds one and makes it current for its body; the engines read
:func:`current` (one ``ContextVar.get``), and nothing else carries state between the harness
and the variants. With nothing open, :func:`current` is :data:`NONE`, whose instruments are
all ``None``: the engines then report nothing and count nothing.

A context variable is per thread. PyTorch's autograd engine runs a CUDA graph's backward on a
device thread of its own, which sees none of the calling thread's context variables (seen on
torch 2.11 on an H200: ``ContextVar.get`` in an ``autograd.Function.backward`` of CUDA tensors
gave the default; pytorch/pytorch#191777). So an engine's ``autograd.Function`` calls
:func:`carry` in its forward and decorates its backward with :func:`carried`: the backward
reports to the instruments its forward ran under, on whatever thread it runs. Calls that no
ringbench backward wraps (a peer's own ``torch.distributed`` calls) are found by the patch of
``torch.distributed`` instead (``traffic.py``), through :meth:`Instruments.innermost`.

This module is the leaf of the package: it imports none of its siblings, so each of them
(and the engines) can read :func:`current`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator

# The four instruments' classes are named in annotations only (as strings): their modules
# import this one, so importing them here, even for type checkers, would close a circle.


@dataclass(eq=False)
class Instruments:
    """The instruments open for the code that runs under this context; ``None``: not open.

    Attributes:
        traffic: byte counters (``bytes_sent``, ``bytes_received``, bytes) of every counted
            transfer made under this context (``traffic.py``).
        observation: verify's record of every kernel call of ringbench's engines (``observe.py``).
        timeline: the profile's spans of kernel calls, merges and waits (``timeline.py``).
        emulation: the rank one process plays of a ring of any size (``emulation.py``).
    """

    traffic: "Traffic | None" = None  # noqa: F821 (see the comment on the imports)
    observation: "Observation | None" = None  # noqa: F821
    timeline: "Timeline | None" = None  # noqa: F821
    emulation: "Emulation | None" = None  # noqa: F821
    # The context opened directly inside this one while it is current, or None; a chain from
    # the outermost to the innermost, for threads that see no context of their own (innermost).
    inner: "Instruments | None" = field(default=None, repr=False)

    def innermost(self) -> "Instruments":
        """The innermost context opened inside this one and still open (this one when none is)."""
        inst = self
        while inst.inner is not None:
            inst = inst.inner
        return inst


#: What :func:`current` is while nothing is open: no instrument; the engines report nothing.
NONE = Instruments()

_CURRENT: contextvars.ContextVar[Instruments] = contextvars.ContextVar("ringbench_instruments", default=NONE)


def current() -> Instruments:
    """The instruments open for the code running now (:data:`NONE` when none is open)."""
    return _CURRENT.get()


@contextlib.contextmanager
def nested(inst: Instruments) -> Iterator[Instruments]:
    """Make ``inst``, a context new to this call, current while the body runs, inside the one
    current now (which it is linked beneath, see :meth:`Instruments.innermost`); on exit, even
    by an exception, the outer one is current again."""
    outer = _CURRENT.get()
    token = _CURRENT.set(inst)
    if outer is not NONE:
        held, outer.inner = outer.inner, inst
    try:
        yield inst
    finally:
        _CURRENT.reset(token)
        if outer is not NONE:
            outer.inner = held


def carry(ctx) -> None:
    """In an ``autograd.Function``'s forward: keep the instruments current now on ``ctx``, for
    the backward that :func:`carried` wraps."""
    ctx.instruments = _CURRENT.get()


def carried(backward: Callable) -> Callable:
    """Decorate an ``autograd.Function``'s backward so that it runs under the instruments its
    forward kept with :func:`carry`, on whichever thread autograd runs it (module docstring).
    A backward whose forward kept none runs under :data:`NONE`."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        inst = getattr(ctx, "instruments", NONE)
        if _CURRENT.get() is inst:  # the usual CPU case: the same thread, the same context
            return backward(ctx, *grads)
        token = _CURRENT.set(inst)
        try:
            return backward(ctx, *grads)
        finally:
            _CURRENT.reset(token)
    return run
