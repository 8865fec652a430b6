"""Text for tables: the missing-value mark, numbers and case fields.

Shared by ``ringbench.present.report`` (record dicts) and ``ringbench.present.compare`` (pandas frames), so
a value reads the same in every table. Torch-free and pandas-free.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ringbench.case.fields import format_size
from ringbench.present.names import Names, short_param  # noqa: F401 (short_param: the tables' public names)

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


# --------------------------------------------------------------------------- cells that wrap

#: A piece of a word that may end a line: up to and including a comma, ``/``, ``=`` or ``:``.
_PIECE = re.compile(r"[^,/=:]*[,/=:]|[^,/=:]+")


def _pieces(word: str) -> list[str]:
    return _PIECE.findall(word)


class Wrap:
    """Cell text that wraps at spaces and, inside a word too long for its column, only after a
    comma, ``/``, ``=`` or ``:``: never in the middle of a name or a number.

    Its narrowest width is its longest such piece, so a table laid out by :func:`fit_columns`
    never splits a word. Strings get the console's highlighting, as a string cell would.
    """

    def __init__(self, text: str | Text) -> None:
        self.text = text

    def _rich(self, console: Console) -> Text:
        if isinstance(self.text, Text):
            return self.text
        return console.render_str(self.text, markup=False, emoji=False)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        lines = self._rich(console).plain.split("\n")
        narrowest = max((cell_len(p) for line in lines for word in line.split() for p in _pieces(word)), default=0)
        widest = max((cell_len(line.strip()) for line in lines), default=0)
        return Measurement(narrowest, widest)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        text = self._rich(console)
        width = max(1, options.max_width)
        lines: list[Text] = []
        for line in text.split("\n", allow_blank=True):
            lines += [line[a:b] for a, b in _line_spans(line.plain, width)]
        yield Text("\n").join(lines)


def _line_spans(plain: str, width: int) -> list[tuple[int, int]]:
    """Where the lines of ``plain`` start and end at ``width``: breaks at spaces; a word wider
    than ``width`` breaks after a comma or ``:`` (between list entries, ``mean=8k,``), and a
    part still too wide after ``=`` or ``/``; only a piece wider than ``width`` folds."""
    units: list[tuple[int, int]] = []
    for word in re.finditer(r"\S+", plain):
        units += _split(plain, *word.span(), width, (_COARSE, _PIECE))
    if not units:
        return [(0, 0)]
    spans: list[tuple[int, int]] = []
    first, last = units[0]
    for a, b in units[1:]:
        if cell_len(plain[first:b]) <= width:
            last = b
        else:
            spans.append((first, last))
            first, last = a, b
    spans.append((first, last))
    return spans


#: The coarser break points inside a word: after a comma or ``:``.
_COARSE = re.compile(r"[^,:]*[,:]|[^,:]+")


def _split(plain: str, start: int, end: int, width: int, levels: tuple[re.Pattern, ...]) -> list[tuple[int, int]]:
    """``plain[start:end]`` as units no wider than ``width``, split at the first level's break
    points, a unit still too wide at the next level's, and folded when no level is left."""
    if cell_len(plain[start:end]) <= width:
        return [(start, end)]
    if not levels:
        out, a = [], start
        while a < end:
            b = a + 1
            while b < end and cell_len(plain[a:b + 1]) <= width:
                b += 1
            out.append((a, b))
            a = b
        return out
    out = []
    for piece in levels[0].finditer(plain, start, end):
        out += _split(plain, *piece.span(), width, levels[1:])
    return out


class Fit(NamedTuple):
    """How a table was laid out by :func:`fit_columns`."""

    #: The narrowest width the table takes with every word whole: it fits when that is at most
    #: the width asked for.
    needed: int
    #: About how many lines its rows take (the wrapping columns counted; the header included).
    lines: int


def fit_columns(table: Table, console: Console, options: ConsoleOptions, width: int, *,
                force: bool = False, spans: dict[int, list[int]] | None = None) -> Fit:
    """Give ``table``'s columns widths that fit ``width`` with no word split (see :class:`Wrap`).

    A table that fits with every column at its widest is left as rich lays it out. Otherwise
    each column gets its narrowest width (its longest unbreakable piece; a ``no_wrap`` column its
    widest), and the room left goes, a few characters at a time, where it saves the most lines
    (:class:`_Lines`); what saves none goes to the columns that need the least more first.

    Args:
        force: when even the narrowest widths do not fit, narrow the widest wrapping columns
            further (their longest words fold; the fewest columns that make it fit, none below
            4 characters) instead of leaving the table as it was.
        spans: column -> for each row, how many rows its cell may flow down
            (:meth:`FitTable._spans`), so a label that runs down beside its rows costs no line.
    """
    wide = options.update_width(10_000)
    ranges = []
    for column in table.columns:
        found = [Measurement.get(console, wide, cell) for cell in (column.header, *column.cells) if cell is not None]
        low = max((m.minimum for m in found), default=1)
        high = max((m.maximum for m in found), default=1)
        if column.width is not None or column.no_wrap:
            low = high = column.width if column.width is not None else high
        if column.min_width is not None:
            low, high = max(low, column.min_width), max(high, column.min_width)
        if column.max_width is not None:
            high = max(low, min(high, column.max_width))
        ranges.append((max(low, 1), max(high, 1)))
    saved = [column.width for column in table.columns]
    for column in table.columns:
        column.width = 1
    overhead = Measurement.get(console, wide, table).maximum - len(table.columns)
    for column, before in zip(table.columns, saved):
        column.width = before
    room = width - overhead
    needed = overhead + sum(low for low, _ in ranges)
    lines = _Lines(table, ranges, spans or {})
    if sum(high for _, high in ranges) <= room:
        return Fit(needed, lines.total([high for _, high in ranges]))
    widths = [low for low, _ in ranges]
    if needed > width:
        if not force:
            return Fit(needed, lines.total(widths))
        # Fold as few columns as can be: the widest wrapping column first, down to 4 characters,
        # then the next; the columns of numbers (no_wrap) keep their width.
        wraps = [i for i, column in enumerate(table.columns) if not column.no_wrap and column.width is None]
        for i in sorted(wraps, key=lambda i: -widths[i]):
            widths[i] -= min(max(0, widths[i] - 4), sum(widths) - room)
            if sum(widths) <= room:
                break
    spare = lines.spend(widths, max(0, room - sum(widths)))
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][1] - ranges[i][0]):
        give = min(max(0, ranges[i][1] - widths[i]), spare)
        widths[i] += give
        spare -= give
    for column, w in zip(table.columns, widths):
        column.width = w
    return Fit(needed, lines.total(widths))


class _Lines:
    """Counts the lines a table's rows take at given column widths.

    A row is as tall as its tallest wrapping cell; rows that read the same in every wrapping
    column are counted once, times how often they occur, so a long verify table costs little."""

    def __init__(self, table: Table, ranges: list[tuple[int, int]], spans: dict[int, list[int]]) -> None:
        self.ranges = ranges
        self.wraps = [i for i, column in enumerate(table.columns) if not column.no_wrap]
        # A cell as (its text, how many rows it may flow down); the header never flows.
        texts = [[(_plain(column.header), 1),
                  *zip(map(_plain, column.cells), spans.get(i) or [1] * len(table.rows))]
                 for i, column in ((i, table.columns[i]) for i in self.wraps)]
        self.rows: dict[tuple[tuple[str, int], ...], int] = {}
        for row in zip(*texts):
            self.rows[row] = self.rows.get(row, 0) + 1
        self.memo: dict[tuple[str, int], int] = {}
        self.plain_rows = len(table.rows) + 1 if not self.wraps else 0

    def lines(self, text: str, width: int) -> int:
        if (text, width) not in self.memo:
            self.memo[(text, width)] = sum(len(_line_spans(line, width)) for line in text.split("\n"))
        return self.memo[(text, width)]

    def total(self, widths: list[int]) -> int:
        # A cell that flows down n rows adds lines only past what those rows hold (one each).
        return self.plain_rows + sum(
            count * max(max(1, self.lines(t, widths[i]) - (span - 1)) for (t, span), i in zip(row, self.wraps))
            for row, count in self.rows.items())

    def spend(self, widths: list[int], spare: int) -> int:
        """Hand ``spare`` characters to the wrapping columns where they save the most lines per
        character (``widths`` is changed in place); returns what is left when no character
        saves a line."""
        current = self.total(widths)
        while spare > 0:
            best: tuple[float, int, int, int] | None = None
            for i in self.wraps:
                for k in range(1, min(spare, self.ranges[i][1] - widths[i]) + 1):
                    trial = list(widths)
                    trial[i] += k
                    got = self.total(trial)
                    if got < current:
                        if best is None or (current - got) / k > best[0]:
                            best = ((current - got) / k, i, k, got)
                        break
            if best is None:
                break
            _, i, k, current = best
            widths[i] += k
            spare -= k
        return spare


def _plain(cell: Any) -> str:
    """The text of a cell as it wraps; ``""`` for a cell that does not wrap."""
    if isinstance(cell, Wrap):
        return cell.text.plain if isinstance(cell.text, Text) else cell.text
    return ""


# --------------------------------------------------------------------------- tables

class FitTable:
    """A table that fits the console it is printed on without splitting a word.

    Columns and rows are added as to a ``rich.table.Table`` (``add_column``, ``add_row``). When
    printed, the table is laid out for the console's width: columns that may wrap (every column
    not ``no_wrap``) wrap only at spaces, commas, ``/``, ``=`` and ``:`` (:class:`Wrap`); when
    even that cannot fit, known names are abbreviated (:class:`Names`) and a dim legend under
    the table says what each abbreviation stands for; then a compact table puts one space
    between its columns instead of two. A boxed table (``compact=False``) drops its frame
    (compact, a blank line between sections) before any name is abbreviated, and where the frame
    would make its cells wrap more. ``no_wrap`` columns (the numbers) never wrap, except a
    column added with ``squeeze=True``, which wraps at its spaces when nothing else makes the
    table fit (``417.8`` over ``×1.29*``). Only when even that cannot fit do the
    widest columns fold their longest words, and a dim line under the table says how many
    columns it needs to show every word whole.

    A column added with ``flow=True`` lets a cell's wrapped lines run down into the empty cells
    under it in the same section (a case label beside its tensors), instead of making its row
    taller.

    Args:
        title: the title, above the table on the left; None for none.
        compact: no outer frame and one space of padding (:func:`compact_table`); False: rich's
            boxed table.
    """

    def __init__(self, title: str | None = None, *, compact: bool = True) -> None:
        self.title = title
        self.compact = compact
        self.columns: list[tuple[Any, dict[str, Any]]] = []
        self.flow: list[bool] = []
        self.squeeze: list[bool] = []
        self.needed = 0  # the narrowest width of the last layout with every word whole
        self.rows: list[tuple[list[Any], dict[str, Any]]] = []

    def add_column(self, header: Any = "", *, flow: bool = False, squeeze: bool = False, **kwargs: Any) -> None:
        """A column, with ``rich.table.Table.add_column``'s keywords (``overflow`` is ignored:
        a column either wraps as :class:`Wrap` does or is ``no_wrap``), ``flow`` and ``squeeze``."""
        kwargs.pop("overflow", None)
        self.columns.append((header, kwargs))
        self.flow.append(flow)
        self.squeeze.append(squeeze)

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        """A row, with ``rich.table.Table.add_row``'s keywords (``end_section``...)."""
        self.rows.append((list(cells), kwargs))

    @property
    def row_count(self) -> int:
        return len(self.rows)

    def build(self, names: Names, rows: list[tuple[list[Any], dict[str, Any]]] | None = None, *,
              squeeze: bool = False, style: str | None = None) -> Table:
        """The rich table, its names written by ``names``; ``rows`` instead of the rows added;
        ``squeeze``: the ``squeeze`` columns wrap; ``style``: ``boxed``, ``compact`` or ``tight``
        (compact with one space between columns instead of two); None: the table's own."""
        style = style or ("compact" if self.compact else "boxed")
        if style == "boxed":
            table = Table(title=self.title, title_justify="left")
        else:
            table = Table(title=self.title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                          pad_edge=False, collapse_padding=True, padding=(0, 0) if style == "tight" else (0, 1))
        columns = [(header, {k: v for k, v in kwargs.items() if k not in ("no_wrap", "min_width")})
                   if squeeze and squeezed else (header, kwargs)
                   for (header, kwargs), squeezed in zip(self.columns, self.squeeze)]
        wraps = [not kwargs.get("no_wrap", False) for _, kwargs in columns]
        for (header, kwargs), wrap in zip(columns, wraps):
            header = names.cell(header)
            table.add_column(Wrap(header) if wrap and isinstance(header, (str, Text)) else header, **kwargs)
        for cells, kwargs in self.rows if rows is None else rows:
            shown = [names.cell(c) for c in cells]
            table.add_row(*(Wrap(c) if wrap and isinstance(c, (str, Text)) else c for c, wrap in zip(shown, wraps)),
                          **kwargs)
        return table

    def layout(self, console: Console, options: ConsoleOptions) -> tuple[Table, Names]:
        """The rich table laid out for ``options.max_width``, in full names when they fit, else
        abbreviated; with the :class:`Names` that wrote it (for the legend)."""
        # (short names, style, squeeze): each stage gives up a little more of the look. Whole
        # names come before the frame: a boxed table first goes compact, then abbreviates.
        stages = [(False, "boxed", False)] if not self.compact else []
        stages += [(False, "compact", False), (True, "compact", False), (True, "tight", False)]
        stages += [(True, "tight", True)] if any(self.squeeze) else []
        chosen: tuple[Table, Names, Fit, tuple] | None = None
        for n, stage in enumerate(stages):
            short, style, squeeze = stage
            names = Names(short)
            table = self.build(names, squeeze=squeeze, style=style)
            fit = fit_columns(table, console, options, options.max_width, force=n == len(stages) - 1,
                              spans={c: self._spans(c) for c, flow in enumerate(self.flow) if flow})
            fits = fit.needed <= options.max_width
            if chosen is not None:  # the boxed table fits: this is the same table without its frame
                if fits and fit.lines < chosen[2].lines:
                    chosen = (table, names, fit, stage)
                break
            if fits or n == len(stages) - 1:
                chosen = (table, names, fit, stage)
                if style != "boxed":
                    break
        assert chosen is not None
        table, names, fit, (short, style, squeeze) = chosen
        self.needed = fit.needed
        widths = [column.width for column in table.columns]
        if any(self.flow) and any(w is not None for w in widths):
            table = self.build(names, self._flowed(console, names, widths), squeeze=squeeze, style=style)
            for column, w in zip(table.columns, widths):
                column.width = w
        return table, names

    def _spans(self, c: int) -> list[int]:
        """For each row, how many rows its cell in column ``c`` may flow down: itself and the
        empty cells under it up to the end of its section (1 for an empty cell)."""
        rows, spans, i = self.rows, [1] * len(self.rows), 0
        while i < len(rows):
            below = i + 1
            if isinstance(rows[i][0][c] if c < len(rows[i][0]) else None, (str, Text)) and str(rows[i][0][c]):
                while (below < len(rows) and not rows[below - 1][1].get("end_section")
                       and c < len(rows[below][0]) and rows[below][0][c] == ""):
                    below += 1
                spans[i] = below - i
            i = below
        return spans

    def _flowed(self, console: Console, names: Names, widths: list[int | None]) -> list[tuple[list[Any], dict]]:
        """The rows with each ``flow`` column's wrapped lines moved down into the empty cells
        under them, up to the end of the section; the last cell keeps what is left."""
        rows = [(list(cells), dict(kwargs)) for cells, kwargs in self.rows]
        for c, flow in enumerate(self.flow):
            if not flow or widths[c] is None:
                continue
            for i, slots in enumerate(self._spans(c)):
                if slots == 1 and not (c < len(rows[i][0]) and isinstance(rows[i][0][c], (str, Text))):
                    continue
                cell = rows[i][0][c]
                if not str(cell):
                    continue
                text = names.cell(cell)
                text = text if isinstance(text, Text) else console.render_str(text, markup=False, emoji=False)
                lines = [text[a:b] for line in text.split("\n", allow_blank=True)
                         for a, b in _line_spans(line.plain, widths[c])]
                for k in range(slots):
                    part = lines[k:] if k == slots - 1 else lines[k:k + 1]
                    rows[i + k][0][c] = Text("\n").join(part) if part else ""
        return rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table, names = self.layout(console, options)
        yield table
        legend = names.legend()
        if legend:
            yield Text(legend, style="dim")
        if self.needed > options.max_width:
            yield Text(f"some words are folded: this table needs {self.needed} columns to show them whole, "
                       f"and has {options.max_width}", style="dim")


def compact_table(title: str | None) -> FitTable:
    """A table with no outer frame and one space of padding, so that about 50 columns of
    numbers fit next to the labels on an 80-column terminal; it fits its console without
    splitting a word (:class:`FitTable`)."""
    return FitTable(title, compact=True)

