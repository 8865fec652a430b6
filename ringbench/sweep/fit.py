"""A refusal's offered seqlen, held to every rule the command runs.

A rule that refuses a seqlen offers one it accepts itself (``variants.offers.SeqlenOffer``), which
another rule of the same case may refuse: zigzag's multiple of 2W against a shared prompt's equal
answers. Here the offer is checked by the whole validation of the command with that seqlen, and
where it fails, the nearest seqlen that passes takes its place in the sentence.
"""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Any, Callable, Iterator, Optional

from ringbench.errors import SpecError, Unavailable
from ringbench.variants import MAX_SEQLEN
from ringbench.variants.offers import SeqlenOffer

#: How far around an offer the search for a seqlen every rule accepts goes, each way (a few hundred
#: microseconds a candidate), and how many offers of the other rules it follows from there.
SPAN, HOPS = 512, 4


def nearest(offer: int, refusal: Callable[[int], Optional[str]]) -> Optional[int]:
    """The seqlen nearest ``offer`` (itself first, then above before below, within :data:`SPAN`)
    that ``refusal`` has no reason against; where none is, the same around the seqlens the rules
    refusing those candidates offer in turn (a dense limit far below a shared prompt's offer),
    up to :data:`HOPS` searches. ``None``: none found."""
    starts, seen = [offer], []
    while starts and len(seen) < HOPS:
        start = starts.pop(0)
        if any(abs(start - t) <= SPAN for t in seen):  # searched already
            continue
        seen.append(start)
        for d in range(SPAN + 1):
            for seqlen in (start + d, start - d) if d else (start,):
                if not 1 <= seqlen <= MAX_SEQLEN:
                    continue
                reason = refusal(seqlen)
                if reason is None:
                    return seqlen
                if isinstance(reason, SeqlenOffer):
                    starts.append(reason.seqlen)
    return None


def refusal(task: str, given: dict[str, Any], seqlen: int, *, scenario: Optional[str] = None,
            nodes: tuple = (None, None, None, None)) -> Optional[str]:
    """Why ``run``'s or ``verify``'s checks (its options', then every case's) refuse the command's
    options ``given`` with ``--seqlen seqlen`` in place of its own, or ``None``: a refusal that does
    not name the seqlen is another option's, which no seqlen fixes, and counts as none. No kernel
    is resolved, and with ``--device cpu`` torch is not imported."""
    from ringbench.case import options
    from ringbench.sweep import build

    given = {**copy.deepcopy(given), "seqlen": [seqlen]}

    def check() -> None:
        options.check_given(given)
        nnodes, _ = options.check_nodes(*nodes)
        model = given.pop("hf_model", None)
        machine = ("cpu", 0) if given.get("device") == "cpu" else None
        build.cases_for(task, given, scenario=scenario, model=model, nnodes=nnodes, resolve_kernels=False,
                        machine=machine)

    return naming(seqlen, check)


def naming(seqlen: int, check: Callable[[], object]) -> Optional[str]:
    """Why ``check()`` refuses, where its sentence names ``seqlen``, or ``None``: a refusal that does not
    name it is another option's, which no seqlen fixes, and counts as none, as does a case that cannot
    run on this machine."""
    try:
        check()
    except Unavailable:  # not the seqlen's doing
        return None
    except SpecError as exc:
        reason = exc.args[0] if exc.args else str(exc)
        return reason if re.search(rf"\b{seqlen}\b", str(reason)) else None
    return None


def offers_checked(task: str, given: dict[str, Any], *, scenario: Optional[str] = None,
                   nodes: tuple = (None, None, None, None)):
    """Around a command's checks: a refusal offering a seqlen that another of the checks refuses
    is raised again offering the nearest seqlen that every check takes (or, with none near, the
    rule's fix that needs no seqlen). ``given``: the command's case options, copied on entry."""
    before = copy.deepcopy(given)
    return offers_held(lambda s: refusal(task, before, s, scenario=scenario, nodes=nodes))


@contextlib.contextmanager
def offers_held(refused: Callable[[int], Optional[str]]) -> Iterator[None]:
    """Around checks: a refusal offering a seqlen that ``refused(seqlen)`` (every check with that seqlen,
    as :func:`naming` reads it) refuses is raised again offering the :func:`nearest` seqlen that passes."""
    try:
        yield
    except SpecError as exc:
        offer = exc.args[0] if exc.args else None
        if not isinstance(offer, SeqlenOffer):
            raise
        fit = nearest(offer.seqlen, refused)
        if fit == offer.seqlen:
            raise
        raise SpecError(offer.offering(fit)) from None
