"""A refusal whose fix offers a seqlen, kept apart from its sentence so that the harness can hold the
offer to every other rule of the case and, where one refuses it, offer another seqlen in its place
(``ringbench.sweep.fit``). Torch-free, like every rule."""

from __future__ import annotations

from typing import Callable


class SeqlenOffer(str):
    """The sentence ``"{rule}; {fix(seqlen)}"``, a plain ``str`` to every reader, that can be written
    again with another seqlen (:meth:`offering`).

    Attributes:
        rule: the value and the rule it breaks.
        fix: the fix for an offered seqlen, such as ``lambda s: f"pass --seqlen {s}"``.
        seqlen: the seqlen this rule alone offers.
        otherwise: the fix where no seqlen near the offer passes every rule.
    """

    rule: str
    fix: Callable[[int], str]
    seqlen: int
    otherwise: str

    def __new__(cls, rule: str, fix: Callable[[int], str], seqlen: int, otherwise: str) -> "SeqlenOffer":
        self = super().__new__(cls, f"{rule}; {fix(seqlen)}")
        self.rule, self.fix, self.seqlen, self.otherwise = rule, fix, seqlen, otherwise
        return self

    def within(self, prefix: str) -> "SeqlenOffer":
        """The same offer, its sentence after ``prefix`` (such as the scenario case it refuses)."""
        return SeqlenOffer(prefix + self.rule, self.fix, self.seqlen, self.otherwise)

    def offering(self, seqlen: int | None) -> str:
        """The sentence offering ``seqlen`` instead, or, for ``None``, the fix that needs no seqlen."""
        return f"{self.rule}; {self.fix(seqlen) if seqlen is not None else self.otherwise}"
