"""The record store: one JSON object per line, appended, never rewritten.

Several processes may append to one file at once (a sweep launched twice, or a verify run
next to a benchmark); each record is written with one ``os.write`` under an exclusive
``flock``, so lines never interleave. Readers skip a damaged line with a warning
(:class:`DamagedLineWarning`, one sentence naming the file and the line) instead of losing the
whole file; :func:`warnings_on_stderr` prints those as one line each, as the CLI shows them.

Non-finite floats: JSON has no NaN or Infinity, and ``json.dumps`` would otherwise write
tokens that strict parsers (jq, JavaScript, pandas' ujson) reject. ``append_record`` writes
``null`` in their place and lists each one in the record's ``nonfinite`` field as
``{"path": ["checks", 0, "err"], "value": "nan"}``. ``read_records`` puts the original values
back, so a record reads back as it was written.

Linux and macOS only (``fcntl``); so is torchrun with NCCL.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, TextIO

if TYPE_CHECKING:
    import pandas

from ringbench.records.build import SCHEMA_VERSION

_NONFINITE_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class DamagedLineWarning(RuntimeWarning):
    """A line of a results file that holds no record (corrupt, truncated, or not an object) was skipped."""


@contextlib.contextmanager
def warnings_on_stderr(stream: TextIO | None = None) -> Iterator[None]:
    """Inside the block, print each :class:`DamagedLineWarning` as one line, ``warning: <its
    sentence>``, on ``stream`` (stderr), instead of Python's warning with a source line; other
    warnings show as they would have.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("always", DamagedLineWarning)  # every damaged line, not the first per place
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, DamagedLineWarning):
                print(f"warning: {message}", file=stream or sys.stderr, flush=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def _nonfinite_text(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


def _to_json_safe(value: Any, path: list, nonfinite: list[dict]) -> Any:
    """Copy ``value`` into plain JSON types, replacing non-finite floats by None."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        nonfinite.append({"path": list(path), "value": _nonfinite_text(value)})
        return None
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"record key {key!r} at {_path_text(path)} is a {type(key).__name__}; "
                    f"JSON keys must be str; convert it with str() before appending")
            out[key] = _to_json_safe(item, [*path, key], nonfinite)
        return out
    if isinstance(value, (list, tuple)):
        return [_to_json_safe(item, [*path, i], nonfinite) for i, item in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    # numpy and torch scalars: a 0-d value with .item() becomes the Python number it holds.
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 0) == 0:
        return _to_json_safe(item(), path, nonfinite)
    raise ValueError(
        f"record field {_path_text(path)} holds a {type(value).__name__} ({value!r:.80}), "
        f"which JSON cannot store; convert it to a number, str, list or dict first")


def _path_text(path: list) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _encode(record: dict) -> bytes:
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a dict, got {type(record).__name__}; "
                         f"pass one dict per case")
    nonfinite: list[dict] = []
    safe = _to_json_safe(record, [], nonfinite)
    safe.pop("nonfinite", None)
    if nonfinite:
        safe["nonfinite"] = nonfinite
    safe.setdefault("schema_version", SCHEMA_VERSION)
    safe.setdefault("created_at", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    line = json.dumps(safe, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    return (line + "\n").encode("utf-8")


def append_record(path: Path | str, record: dict) -> None:
    """Append one record as one JSON line, safely against concurrent writers.

    The parent folders are created. ``schema_version`` (``SCHEMA_VERSION``) and
    ``created_at`` (ISO 8601, UTC) are added when the record lacks them. NaN and
    infinities are stored as null and listed in ``nonfinite`` (see the module docstring).
    ``record`` itself is not modified. The line is written with one ``os.write`` while an
    exclusive ``flock`` is held, then fsynced, so a reader never sees half a record.

    Args:
        path: the ``.jsonl`` file.
        record: a dict of JSON-able values (str, int, float, bool, None, list, tuple, dict;
            numpy/torch 0-d scalars and paths are converted).

    Raises:
        ValueError: when a value cannot be stored as JSON; the message names its field.
        OSError: when the file cannot be opened or written.
    """
    data = _encode(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Read access too: the last byte is checked for a torn line before writing.
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            # A previous writer that died mid-line (disk full) left no newline; start a fresh
            # line so this record is not glued onto the broken one.
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _restore_nonfinite(record: dict) -> None:
    for entry in record.pop("nonfinite", None) or []:
        try:
            *parents, last = entry["path"]
            target = record
            for key in parents:
                target = target[key]
            target[last] = _NONFINITE_TEXT[entry["value"]]
        except (KeyError, IndexError, TypeError, ValueError):
            continue  # a stale entry must not cost the whole record


def read_records(path: Path | str) -> list[dict]:
    """Read every record of one JSON Lines file, in file order.

    A missing file gives ``[]``. Blank lines are ignored. A line that is not a JSON object
    (corrupt or truncated), or a record whose ``spec`` is not an object, is skipped with a :class:`DamagedLineWarning` (a ``RuntimeWarning``)
    naming the file and its 1-based line number. Values listed in ``nonfinite`` are put back as
    NaN or +-inf.

    Args:
        path: the ``.jsonl`` file.

    Returns:
        The records as dicts.

    Raises:
        OSError: when the file exists but cannot be read.
    """
    raw = _read_bytes(Path(path), 0)
    return [] if raw is None else _parse_lines(raw, Path(path))


def read_records_from(path: Path | str, offset: int) -> tuple[list[dict], int]:
    """Read the records appended to a JSON Lines file since byte ``offset``.

    For following a file while a job appends to it: pass the returned offset to the next
    call. Only whole lines are read; a last line without its newline yet is left for the
    next call. Damaged lines are skipped as in :func:`read_records` (the warning gives the
    line number counted from ``offset``, and says so).

    Args:
        path: the ``.jsonl`` file.
        offset: where to start, in bytes; 0 for the whole file, or a value this function
            returned. A file that shrank below it is read from the start.

    Returns:
        ``(records, new_offset)``; ``([], 0)`` when the file does not exist.

    Raises:
        OSError: when the file exists but cannot be read.
    """
    path = Path(path)
    if offset and path.exists() and path.stat().st_size < offset:
        offset = 0
    raw = _read_bytes(path, offset)
    if raw is None:
        return [], 0
    whole = raw.rfind(b"\n") + 1
    return _parse_lines(raw[:whole], path, offset), offset + whole


def _read_bytes(path: Path, offset: int) -> bytes | None:
    """The bytes of ``path`` from ``offset`` on, read under a shared lock; None if missing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # never see a line being appended
        try:
            f.seek(offset)
            return f.read()
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _parse_lines(raw: bytes, path: Path, offset: int = 0) -> list[dict]:
    """Records of ``raw`` JSON Lines (read from byte ``offset`` of ``path``); damaged lines
    skipped with a warning (see read_records)."""
    records = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"line {lineno} of {path}" if not offset else f"line {lineno} after byte {offset} of {path}"
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            warnings.warn(f"skipped {where}, which is not UTF-8 text", DamagedLineWarning, stacklevel=3)
            continue
        except json.JSONDecodeError as exc:
            warnings.warn(f"skipped {where}, which is not a whole JSON record ({exc.msg}: column {exc.colno})",
                          DamagedLineWarning, stacklevel=3)
            continue
        if not isinstance(record, dict):
            warnings.warn(f"skipped {where}, which is a JSON {type(record).__name__}, not a record object",
                          DamagedLineWarning, stacklevel=3)
            continue
        # a record of a case without its spec would show as a phantom row of no case
        spec = record.get("spec")
        if "spec" in record and not isinstance(spec, dict):
            warnings.warn(f"skipped {where}, which has a spec that is a JSON {_json_type(spec)} ({spec!r:.40}), "
                          "not an object of case fields", DamagedLineWarning, stacklevel=3)
            continue
        _restore_nonfinite(record)
        records.append(record)
    return records


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type: string, number, boolean, list."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _jsonl_files(paths: Iterable[Path | str] | Path | str) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("*.jsonl")))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"results path {str(p)!r} does not exist; pass a .jsonl "
                                    f"file or a folder that holds some")
    return files


def load(paths: Iterable[Path | str] | Path | str) -> "pandas.DataFrame":
    """Load records from files and folders into one flat DataFrame.

    Nested dicts become dotted columns (``spec.seqlen``, ``env.torch``); lists such as
    ``checks`` and ``per_rank_time_ms`` stay list-valued cells. A ``source`` column gives
    the file each row came from.

    Args:
        paths: a ``.jsonl`` file, a folder (every ``*.jsonl`` under it, recursively, in
            sorted order), or an iterable of either.

    Returns:
        One row per record, in file order; an empty DataFrame when there are none.

    Raises:
        FileNotFoundError: when a given path does not exist.
    """
    import pandas as pd

    rows = []
    for file in _jsonl_files(paths):
        for record in read_records(file):
            record["source"] = str(file)
            rows.append(record)
    if not rows:
        return pd.DataFrame()
    # max_level=None flattens every dict level; lists are left alone.
    return pd.json_normalize(rows, sep=".")
