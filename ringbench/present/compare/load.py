"""Records as a pandas frame: read, filtered by ``--where``, the latest record of each case.

Reads the records of docs/contracts.md through :func:`ringbench.records.store.load`; pandas is
imported inside the functions. The frame has one row per record, its columns flattened
(``spec.seqlen``, ``env.torch``), with every ``spec.<field>`` also under its short name
(``seqlen``) and the short names listed in ``frame.attrs["aliases"]``, and a ``predicted``
column (True for a record of ``ringbench predict``, else False).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ringbench.errors import CompareError
from ringbench.case.fields import NOT_IN_CASE_ID, OPTIONAL_DEFAULTS
from ringbench.present.formatting import not_measured
from ringbench.variants import listed, plural

if TYPE_CHECKING:
    import pandas

#: Fields that do not tell cases apart: the task, and those case_id leaves out.
_NOT_CASE_FIELDS = ("task", *NOT_IN_CASE_ID)


@dataclass
class Loaded:
    """Records ready to compare.

    Attributes:
        frame: one row per case (see :func:`load_runs`), flattened, short names added.
        left_out: why other records were left out, as said of one record and of several
            (``("verify record", "verify records")``) -> how many.
        aliases: the short names of the ``spec.<field>`` columns (``seqlen``...).
    """

    frame: "pandas.DataFrame"
    left_out: dict[tuple[str, str], int] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)

    def left_out_text(self) -> str | None:
        """``left out 3 records: 2 with status oom, 1 verify record``, or None."""
        return left_out_text(self.left_out)


def left_out_text(left_out: dict[tuple[str, str], int]) -> str | None:
    """``left out 3 records: 2 with status oom, 1 verify record`` of :attr:`Loaded.left_out`, or None."""
    total = sum(left_out.values())
    if not total:
        return None
    return f"left out {plural(total, 'record')}: " + ", ".join(plural(n, *why) for why, n in left_out.items())


def _same(phrase: str) -> tuple[str, str]:
    """A reason said the same of one record and of several (``with status oom``)."""
    return phrase, phrase


def read_frame(paths: Sequence[Path | str]) -> "pandas.DataFrame":
    """Every record under ``paths`` (files or folders), flattened, with short spec names.

    Records written before an optional field existed hold its default
    (:data:`ringbench.case.fields.OPTIONAL_DEFAULTS`). A damaged line is skipped with one line on
    stderr naming the file and the line (``results.warnings_on_stderr``). A record whose
    ``schema_version`` this ringbench does not know (above ``records.SCHEMA_VERSION``) is left
    out, as its fields may mean something else.

    Returns:
        One row per record; ``attrs["aliases"]``: the short spec names, ``attrs["added"]``:
        those that were added as columns, ``attrs["unknown_schema"]``: ``{version: count}`` of
        the records left out for their schema version.

    Raises:
        CompareError: a path that does not exist, or no record at all.
    """
    from ringbench.records import store as results

    try:
        with results.warnings_on_stderr():
            frame = results.load(list(paths))
    except FileNotFoundError as exc:
        raise CompareError(str(exc)) from None
    if frame.empty:
        raise CompareError(f"no records found in {', '.join(map(str, paths))}; pass .jsonl files or folders "
                           "that `ringbench run` wrote")
    frame, unknown_schema = _known_schema(frame)
    frame = frame.copy()
    # A record of ringbench predict says predicted: true; a measured one holds no such field.
    frame["predicted"] = (frame["predicted"].map(lambda v: str(v) == "True") if "predicted" in frame.columns
                          else False)
    for name, default in OPTIONAL_DEFAULTS.items():
        column = f"spec.{name}"
        frame[column] = frame[column].fillna(default) if column in frame.columns else default
    added = []
    for column in [c for c in frame.columns if c.startswith("spec.")]:
        short = column[len("spec."):]
        if short not in frame.columns:
            frame[short] = frame[column]
            added.append(short)
    frame.attrs["aliases"] = [c[len("spec."):] for c in frame.columns if c.startswith("spec.")]
    frame.attrs["added"] = added
    frame.attrs["unknown_schema"] = unknown_schema
    return frame


def _known_schema(frame: "pandas.DataFrame") -> tuple["pandas.DataFrame", dict[str, int]]:
    """``frame`` without the records of a schema version this ringbench does not know, and
    ``{version text: count}`` of those (a record without the field is kept: see load_runs)."""
    from ringbench.records.build import SCHEMA_VERSION

    if "schema_version" not in frame.columns:
        return frame, {}

    def known(version: Any) -> bool:
        if not_measured(version):
            return True
        return isinstance(version, (int, float)) and not isinstance(version, bool) and \
            float(version).is_integer() and 1 <= version <= SCHEMA_VERSION

    versions = frame["schema_version"]
    mask = versions.map(known).astype(bool)
    unknown: dict[str, int] = {}
    for version in versions[~mask]:
        if isinstance(version, float) and version.is_integer():
            text = str(int(version))
        else:
            text = repr(version) if isinstance(version, str) else str(version)
        unknown[text] = unknown.get(text, 0) + 1
    return frame[mask], unknown


def apply_where(frame: "pandas.DataFrame", where: str | None) -> "pandas.DataFrame":
    """Rows of ``frame`` for which the pandas query ``where`` holds (all when None).

    Raises:
        CompareError: an expression pandas cannot evaluate, or one that is not a condition.
    """
    if not where:
        return frame
    try:
        mask = frame.eval(where)
    except Exception as exc:  # pandas raises SyntaxError, UndefinedVariableError, TypeError, ...
        detail = " ".join(str(exc).split()) or type(exc).__name__
        detail = detail if len(detail) <= 100 else detail[:99] + "…"
        raise CompareError(f"--where {where!r} could not be evaluated ({detail}); write a pandas query on the "
                           "record columns, such as 'world_size == 2 and seqlen >= 16384'") from None
    import pandas as pd

    # Not getattr(mask, "dtype"): the records have a column of that name.
    if not isinstance(mask, pd.Series) or not pd.api.types.is_bool_dtype(mask.dtype):
        raise CompareError(f"--where {where!r} is not a condition on the records; write a comparison such as "
                           "'world_size == 2'")
    return frame[mask.fillna(False).astype(bool)]


def load_runs(paths: Sequence[Path | str], *, where: str | None = None, keep_apart: Iterable[str] = ()
              ) -> Loaded:
    """The ok ``run`` records under ``paths``, filtered by ``where``, one per case.

    Records of other tasks, records with no status and records of an unknown schema version
    are counted as left out. When one case (one ``case_id``) has several records, across files
    or reruns, the latest (``created_at``) stands for it, unless a ``keep_apart`` column that is
    not a spec field tells them apart; a case whose latest record is not ok (error, oom...) is
    left out with its older records, so an old value never shows as current. A predicted record
    (``predicted: true``, from ``ringbench predict --out``) is kept apart from the measured ones
    of its case: each stands beside the other.

    Args:
        paths: ``.jsonl`` files and folders.
        where: a pandas query on the columns (spec fields by their short names), or None.
        keep_apart: columns that are not spec fields but keep two records of one case apart
            (a ``--by source`` column); spec columns among them are ignored.

    Returns:
        A :class:`Loaded`; its frame has at least one row.

    Raises:
        CompareError: no path, no records, a bad ``where`` or ``keep_apart`` column, or no ok
            run record left.
    """
    frame = read_frame(paths)
    left_out: dict[tuple[str, str], int] = {_same(f"with unknown schema version {version}"): n
                                            for version, n in frame.attrs.get("unknown_schema", {}).items()}
    frame = _usable(frame, left_out)
    if frame.empty:  # nothing a column could be asked of: say what the records lack, not that --by is wrong
        raise CompareError(f"no usable run record in {', '.join(map(str, paths))} ({left_out_text(left_out)}); "
                           "pass the results of `ringbench run`")
    check_columns(frame, keep_apart, "--by")
    import pandas as pd

    frame = apply_where(frame, where)
    # The latest record of a case, whatever its status, says what the case is now: an older ok
    # value must not stand in for a case that has since failed.
    # A prediction never stands for a measurement of its case, nor the other way round.
    apart = [k for k in keep_apart if not _is_spec(frame, k) and k != "predicted"] + ["predicted"]
    latest, _ = latest_per_case(frame, apart)
    status = latest["status"] if "status" in latest.columns else None
    failed = status != "ok" if status is not None else pd.Series(False, index=latest.index)
    for value, n in status[failed].value_counts(dropna=False).items() if status is not None else ():
        left_out[_same(f"with status {value}")] = int(n)
    shown = latest[~failed]
    if "case_id" in frame.columns:
        keys = ["case_id", *apart]
        of_failed = frame.set_index(keys).index.isin(latest[failed].set_index(keys).index)
        stale = int(of_failed.sum()) - int(failed.sum())
        if stale:
            left_out[("older record of a case whose latest is not ok",
                      "older records of cases whose latest is not ok")] = stale
        dropped = len(frame) - int(of_failed.sum()) - len(shown)
    else:
        dropped = 0
    if shown.empty:
        left = f" ({left_out_text(left_out)})" if left_out else ""
        matching = f" matches --where {where!r}" if where else ""
        raise CompareError(f"no ok run record in {', '.join(map(str, paths))}{matching}{left}; pass the results "
                           f"of `ringbench run`{' or loosen --where' if where else ''}")
    if dropped:
        left_out[("older record of a case shown with its latest",
                  "older records of cases shown with their latest")] = dropped
    return Loaded(frame=shown, left_out=left_out, aliases=list(shown.attrs.get("aliases", [])))


def _usable(frame: "pandas.DataFrame", left_out: dict[tuple[str, str], int]) -> "pandas.DataFrame":
    """The run records of ``frame`` that have a status and a spec; the others are counted in
    ``left_out`` by what they lack (a line such as ``{}``: ``with no task, status or spec``) or by
    their task (``verify record``)."""
    import pandas as pd

    def present(*columns: str) -> "pandas.Series":
        found = pd.Series(False, index=frame.index)
        for column in (c for c in columns if c in frame.columns):
            found |= frame[column].notna()
        return found

    has = {"task": present("task", "spec.task"), "status": present("status"), "spec": present("spec.variant")}
    lacking = pd.Series([listed([k for k in has if not has[k][i]], "or") for i in frame.index], index=frame.index,
                        dtype=object)
    for phrase, n in lacking[lacking != ""].value_counts().items():
        left_out[_same(f"with no {phrase}")] = int(n)
    frame = frame[lacking == ""]
    tasks = frame["task"] if "task" in frame.columns else pd.Series(None, index=frame.index, dtype=object)
    if "spec.task" in frame.columns:
        tasks = tasks.fillna(frame["spec.task"])
    others = tasks != "run"
    for task, n in tasks[others].value_counts().items():
        left_out[(f"{task} record", f"{task} records")] = int(n)
    return frame[~others]


def latest_records(paths: Sequence[Path | str], where: str | None) -> "pandas.DataFrame":
    """The run records under ``paths`` filtered by ``where``, the latest of each case_id,
    whatever its status (the regression gate's view of one side).

    Raises:
        CompareError: see :func:`read_frame` and :func:`apply_where`; or no run record left.
    """
    frame = read_frame(paths)
    if "task" in frame.columns:
        frame = frame[frame["task"] == "run"]
    frame = apply_where(frame, where)
    if frame.empty or "case_id" not in frame.columns:
        raise CompareError(f"no run record in {', '.join(map(str, paths))}"
                           f"{' matches --where ' + repr(where) if where else ''}; pass the results of "
                           "`ringbench run`")
    return latest_per_case(frame, [])[0]


def _is_spec(frame: "pandas.DataFrame", column: str) -> bool:
    return column.startswith("spec.") or f"spec.{column}" in frame.columns or column == "kernel"


def latest_per_case(frame: "pandas.DataFrame", apart: list[str]) -> tuple["pandas.DataFrame", int]:
    """Keep the latest record (by ``created_at``) of each case_id and ``apart`` value.

    Returns:
        (the kept rows in their first order, how many were dropped).
    """
    if "case_id" not in frame.columns:
        return frame, 0
    keys = ["case_id", *apart]
    ordered = frame.sort_values("created_at", kind="stable") if "created_at" in frame.columns else frame
    kept = ordered.drop_duplicates(subset=keys, keep="last")
    return kept.sort_index(), len(frame) - len(kept)


def check_columns(frame: "pandas.DataFrame", names: Iterable[str], option: str) -> None:
    """Refuse a name in ``names`` that is not a column of ``frame``.

    Raises:
        CompareError: names the option (``--by``) and the spec fields there are.
    """
    aliases = frame.attrs.get("aliases", [])
    for name in names:
        if name not in frame.columns:
            raise CompareError(f"{option} {name!r} is not a record column; use a spec field ({', '.join(aliases)}) "
                               "or a flattened column such as source or env.torch")


def varying_fields(frame: "pandas.DataFrame", exclude: Iterable[str] = ()) -> list[str]:
    """Short spec fields that take more than one value in ``frame``, in spec order; the task
    and the fields that do not tell cases apart (iters, warmup, seed) never count."""
    exclude = set(exclude) | set(_NOT_CASE_FIELDS)
    out = []
    for name in frame.attrs.get("aliases", []):
        if name in exclude or name not in frame.columns:
            continue
        values = frame[name].dropna()
        if values.astype(str).nunique() > 1:
            out.append(name)
    return out


def python_value(value: Any) -> Any:
    """A frame's value as plain Python: numpy scalars to Python ones, NaN to None."""
    item = getattr(value, "item", None)
    if callable(item):
        value = item()
    return None if not_measured(value) else value


def to_parquet(frame: "pandas.DataFrame", path: Path | str) -> None:
    """Write the records (dotted columns, the short aliases left out) to a Parquet file.

    Raises:
        CompareError: neither pyarrow nor fastparquet is installed.
    """
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("pyarrow", "fastparquet")):
        raise CompareError("--to-parquet needs the pyarrow package (or fastparquet), which is not installed "
                           "here; pip install pyarrow, or read the .jsonl with ringbench.records.store.load")
    out = frame.drop(columns=[a for a in frame.attrs.get("added", []) if a in frame.columns])
    out.attrs = {}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    out.to_parquet(path, index=False)
