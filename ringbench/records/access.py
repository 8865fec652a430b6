"""Reading a record dict's case fields, for whatever shows or groups records.

A record holds its case under ``spec``; an older record may lack an optional field added since,
which then reads as that field's default. Torch-free and pandas-free.
"""

from __future__ import annotations

from typing import Any

from ringbench.case.fields import OPTIONAL_DEFAULTS


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
