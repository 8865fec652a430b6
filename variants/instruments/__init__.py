"""What the rank opens around a case and the engines read: one instrument context.

``with instruments.open(traffic=True, observe=..., timeline=..., emulation=...) as inst:``
makes a new :class:`Instruments` current for its body (``context.py``, a ``ContextVar``) and
the outer one current again when the body ends, by an exception too. The harness reads what
it measured from the object it opened: ``inst.traffic.bytes_sent``, ``inst.timeline``'s
spans, ``inst.observation``. The engines read :func:`current`: the traffic counters
(``traffic.py``), verify's observation of kernel calls (``observe.py``), the profile's spans
(``timeline.py``) and one-device emulation (``emulation.py``).

Each instrument asked for is new; each one not asked for is the outer context's, so a
timeline opened inside an emulation still emulates. A new traffic context's bytes are counted
in the outer contexts' counters too. Observations, timelines and emulations do not nest.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch

from . import traffic as _traffic
from .context import NONE, Instruments, carried, carry, current, nested
from .emulation import Emulation
from .observe import Observation
from .timeline import Timeline
from .traffic import Traffic

__all__ = ["Emulation", "Instruments", "NONE", "Observation", "Timeline", "Traffic", "carried", "carry", "current",
           "open"]


@contextlib.contextmanager
def open(*, traffic: bool = False, observe: bool = False, timeline: torch.device | str | None = None,
         emulation: Emulation | None = None, count_dist: bool = False) -> Iterator[Instruments]:
    """Open an instrument context for the body; yield its :class:`Instruments`.

    Args:
        traffic: count the body's bytes in new counters (``inst.traffic``, bytes), which the
            outer contexts' counters also see; False: the outer context's counters, if any.
        observe: record the body's kernel calls in a new ``inst.observation`` (verify).
        timeline: a device: record the body's spans in a new ``inst.timeline`` on it
            (CUDA events on ``cuda``, ``perf_counter`` otherwise).
        emulation: play this emulated rank during the body (``inst.emulation``, see
            :class:`Emulation`).
        count_dist: patch ``torch.distributed``'s point-to-point and collective functions so
            that a peer's own calls are counted (``traffic.py``), from the body's start until
            it ends, by an exception too; then the module's own functions are back.

    Raises:
        RuntimeError: ``observe``, ``timeline`` or ``emulation`` asked for while the outer
            context already has one (they do not nest).
    """
    outer = current()
    for asked, held, what in ((observe, outer.observation, "an observation is already held; observations"),
                              (timeline is not None, outer.timeline, "a timeline is already being recorded; "
                                                                     "recordings"),
                              (emulation is not None, outer.emulation, "an emulation is already held; emulations")):
        if asked and held is not None:
            raise RuntimeError(f"{what} do not nest, so end the first before starting another")
    inst = replace(outer, inner=None)
    if traffic:
        inst.traffic = Traffic(outer=outer.traffic)
    if observe:
        inst.observation = Observation()
    if timeline is not None:
        inst.timeline = Timeline(torch.device(timeline))
    if emulation is not None:
        inst.emulation = emulation
    with nested(inst), (_traffic.holding_dist_patch(inst) if count_dist else contextlib.nullcontext()):
        yield inst

