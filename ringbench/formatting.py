"""Text for tables: the missing-value mark, numbers, case fields, and reading a record's fields.

Shared by ``ringbench.report`` (record dicts) and ``ringbench.compare`` (pandas frames), so
a value reads the same in every table. Torch-free and pandas-free.
"""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.table import Table

from ringbench.fields import OPTIONAL_DEFAULTS, format_size

#: What a table shows where a value is absent.
MISSING = "-"
#: From this many documents on, a label counts them (``7 docs``) instead of listing their lengths.
_MANY_DOCS = 4


# --------------------------------------------------------------------------- numbers

def text(value: Any) -> str:
    """``str(value)``; :data:`MISSING` for None (NaN, a measured value gone wrong, shows as ``nan``)."""
    return MISSING if value is None else str(value)


def number(value: Any, fmt: str) -> str:
    """``value`` in the format spec ``fmt`` (``.3e``); :data:`MISSING` for None, ``str`` for a
    value the spec does not take; NaN and inf as ``nan`` and ``inf``."""
    if value is None:
        return MISSING
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def decimals(value: float, digits: int) -> str:
    """``value`` with ``digits`` decimals, or 3 significant digits when those decimals would
    show a small non-zero value as 0 (a CPU's 0.0153 TFLOP/s)."""
    if value and abs(value) < 10 ** -digits * 10:
        return f"{value:.3g}"
    return f"{value:.{digits}f}"


def rate(value: Any) -> str:
    """A rate such as TFLOP/s or GiB/s: one decimal from 1 up, three significant digits below."""
    return decimals(value, 1) if _finite(value) else number(value, "g")


def milliseconds(value: Any) -> str:
    """Milliseconds with about four significant digits (0.1234, 12.34, 1234)."""
    if not _finite(value):
        return number(value, "g")
    places = 0 if abs(value) >= 1000 else 1 if abs(value) >= 100 else 2 if abs(value) >= 10 else 4
    return f"{value:.{places}f}"


def ratio_text(value: Any) -> str:
    """A ratio such as err / allowed: two decimals, or three significant digits from 1000 up."""
    if _finite(value) and abs(value) >= 1000:
        return f"{value:.3g}"
    return number(value, ".2f")


def not_measured(value: Any) -> bool:
    """Whether a value from a frame is absent: None, or NaN, which pandas holds for a value a
    record lacks."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def plain(value: Any) -> str:
    """A value from a frame: :data:`MISSING` where :func:`not_measured`, whole floats without
    ``.0`` (``2.0`` -> ``2``), anything else as ``str``."""
    if not_measured(value):
        return MISSING
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# --------------------------------------------------------------------------- case fields

def docs_count(docs: Any) -> str | None:
    """``7 docs`` for a ``docs`` field of four or more lengths (``"3000,500,..."``), else None:
    a short list is shown as it is, a long one is in the records."""
    count = str(docs).count(",") + 1
    return f"{count} docs" if count >= _MANY_DOCS else None


def axis_text(name: str, value: Any) -> str:
    """A value of column ``name`` as a column heading: a whole seqlen as ``16k``, others as
    :func:`plain` writes them."""
    if name == "seqlen" and isinstance(value, (int, float)) and float(value).is_integer():
        return format_size(int(value))
    return plain(value)


def cell_text(name: str, value: Any) -> str:
    """A value of field ``name`` in a table cell or a legend: as :func:`axis_text`, with
    many documents counted (:func:`docs_count`)."""
    if name == "docs" and isinstance(value, str) and docs_count(value):
        return docs_count(value)
    return axis_text(name, value)


# --------------------------------------------------------------------------- record fields

def spec_of(record: dict) -> dict:
    """The record's ``spec`` dict; ``{}`` when it has none."""
    spec = record.get("spec")
    return spec if isinstance(spec, dict) else {}


def record_field(record: dict, name: str) -> Any:
    """A case field of a record dict: its spec's value, else the record's own key, else, for an
    optional field a record written before it existed lacks, the field's default (``""``, 0).

    Returns:
        The value; None when the record does not hold a field that has no default.
    """
    spec = spec_of(record)
    if name in spec:
        return spec[name]
    value = record.get(name)
    return OPTIONAL_DEFAULTS.get(name) if value is None else value


def kernel_ran(record: dict) -> Any:
    """The kernel that ran (the record's ``kernel``), else the one its spec asked for."""
    kernel = record.get("kernel")
    return kernel if kernel is not None else spec_of(record).get("kernel")


# --------------------------------------------------------------------------- tables

def compact_table(title: str | None) -> Table:
    """A table with no outer frame and one space of padding, so that about 50 columns of
    numbers fit next to the labels on an 80-column terminal."""
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                 pad_edge=False, collapse_padding=True)
