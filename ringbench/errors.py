"""ringbench's errors: one base, so a caller can catch what ringbench refuses in one clause.

- :class:`SpecError`: a request ringbench refuses (a case field, a scenario, an option);
  the CLI prints its one sentence and exits 2.
- :class:`Unavailable`: the case's variant or kernel cannot run on this machine; a scenario
  records such a case as skipped.
- :class:`CompareError`: ``ringbench compare`` was given records it cannot compare.

All are ``ValueError``s (bad input), as torchtitan's settings errors are; a failure at run
time inside a worker stays a ``RuntimeError``.
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The one way to install an optional extra, as every message says it: ringbench installs from
    its checkout (README), so ``pip install -e '.[EXTRA]'`` there; ``ringbench[EXTRA]`` is not on an index."""
    return f"pip install -e '.[{extra}]' from the root of the ringbench checkout"


def unreadable(exc: OSError | UnicodeDecodeError) -> str:
    """Why a file could not be read, in a few words for a refusal: the system's reason, or that it is
    not UTF-8 text (a binary file given where a text one goes)."""
    if isinstance(exc, UnicodeDecodeError):
        return "it is not UTF-8 text"
    return exc.strerror or type(exc).__name__


class RingbenchError(ValueError):
    """Anything ringbench refuses. The message is one sentence: what, the value, the rule and the fix."""


class SpecError(RingbenchError):
    """A case specification (from the CLI or a scenario) that ringbench refuses."""


class Unavailable(SpecError):
    """The case's variant cannot run on this machine (its library is missing)."""


class CompareError(RingbenchError):
    """Records that ``ringbench compare`` cannot turn into a table, plot or verdict."""
