"""Why a verify record's ``cp_active`` is null: the sentence the record holds (``cp_active_reason``),
written here for every case that cannot show context parallelism, and the short form verify's table
shows in its note column, which at 80 columns may be a few characters wide. Torch-free, so the
rank that writes a reason and the table that shortens it read the same words."""

from __future__ import annotations

#: A single rank: nothing to exchange.
SINGLE_RANK = "world size 1: a single rank, so no K/V is exchanged"
#: The end every reason of a layout that keeps each query's keys on its own rank shares.
_LOCAL_END = "so no rank needs another's K/V"
#: The short forms: the table's note for each kind of reason.
SHORT_SINGLE, SHORT_LOCAL = "W=1", "local"


def no_document_crossing() -> str:
    """Packed documents none of which crosses a rank boundary."""
    return f"no document crosses a rank boundary, {_LOCAL_END}"


def no_key_crossing(what: str) -> str:
    """A window or mask (``what``: ``window 64``, ``mask chunked:32``) under which no query sees a
    key another rank holds."""
    return f"under {what} no query sees a key of another rank, {_LOCAL_END}"


def short(reason: str) -> str:
    """``reason`` as the table says it, one word that a narrow note column keeps whole: ``W=1``, or
    ``local`` (each rank needs only its own K/V), for the sentences above; else its first clause
    (words this module did not write)."""
    if reason == SINGLE_RANK:
        return SHORT_SINGLE
    if reason.endswith(_LOCAL_END):
        return SHORT_LOCAL
    return reason.split(":")[0].split(", ")[0]
