"""Text for tables: the missing-value mark, numbers and case fields; and :class:`FitTable`, a rich
table that fits its terminal without splitting a number or a word.

Shared by ``ringbench.present.report`` (record dicts) and ``ringbench.present.compare`` (pandas frames), so
a value reads the same in every table. Torch-free and pandas-free.
"""

from __future__ import annotations

import math
import re
from typing import Any

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
    """Milliseconds with four significant digits (0.1234, 1.234, 12.34, 1234), as the validation
    page writes them, so one column reads at one precision."""
    if not _finite(value):
        return number(value, "g")
    size = abs(value)
    places = 0 if size >= 1000 else 1 if size >= 100 else 2 if size >= 10 else 3 if size >= 1 else 4
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
    many documents counted (:func:`docs_count`), no window (``window`` 0) as ``none``, never 0, a
    mask of slices by its file's name and their count (``image_in_text(5)``, ``masks.label``), a mask
    over packed documents by its mask and their count (``prefix:16 in 3 docs``), and
    ``predicted`` as ``predicted`` or ``measured``."""
    if name == "window" and value in (0, None):
        return "none"
    if name == "mask" and isinstance(value, str) and value.startswith(("slices:", "docs:")):
        from ringbench.variants.engines import masks

        return masks.label(value)
    if name == "predicted":  # a record of ringbench predict, or one that was measured
        return "predicted" if value is True or value == "True" else "measured"
    if name == "docs" and isinstance(value, str) and docs_count(value):
        return docs_count(value)
    return axis_text(name, value)


def mask_column(plain: list[str], any_mask: bool) -> str:
    """What ``ringbench variants`` says a variant takes as a mask: ``any`` (every ``--mask``), else
    the plain ones it runs in ``--mask``'s words (``causal, full``), from ``plain``, its
    ``causal``/``non-causal`` capabilities. Never ``both``, which read as any mask."""
    if any_mask:
        return "any"
    return ", ".join({"non-causal": "full"}.get(m, m) for m in plain)


# --------------------------------------------------------------------------- tables

#: A piece of a word that a line may end after: up to and including a comma, ``/`` or ``:``
#: (``docs=100,``, ``32/``, ``lognormal:``), else the whole word. No line breaks inside a piece.
_PIECE = re.compile(r"[^\s,/:]*[,/:]|[^\s,/:]+")
_WORD = re.compile(r"\S+")
#: Wider than any table: the width to measure a cell at its widest.
_WIDE = 10_000


def break_words(text: Text, width: int) -> Text:
    """``text`` with a line break after a separator (:data:`_PIECE`) inside each word wider than
    ``width``, so that rich, which wraps at spaces, never has to fold a word there."""
    plain, offsets = text.plain, []
    for word in _WORD.finditer(plain):
        start = word.start()
        for piece in _PIECE.finditer(plain, word.start(), word.end()):
            if piece.start() > start and cell_len(plain[start:piece.end()]) > width:
                offsets.append(piece.start())
                start = piece.start()
    return Text("\n").join(text.divide(offsets)) if offsets else text


def _shrink(ranges: list[tuple[int, int]], cells: list[list[int]], room: int) -> list[int]:
    """Column widths from ``(narrowest, widest)`` ranges that sum to at most ``room`` (or their
    narrowest, where that is more): one
    character at a time from the column where that makes the fewest cells (their widths in
    ``cells``) wrap further, the widest of those first; none below its narrowest."""
    widths = [high for _, high in ranges]
    for _ in range(sum(widths) - room):
        narrower = [i for i, (low, _) in enumerate(ranges) if widths[i] > low]
        if not narrower:  # every column at its narrowest: wider than room (a stacked table that must fold)
            break
        i = min(narrower, key=lambda i: (sum(w >= widths[i] for w in cells[i]), -widths[i]))
        widths[i] -= 1
    return widths


class FitTable:
    """A ``rich.table.Table`` that fits the console it is printed on and never splits a number
    or a word across lines.

    Columns and rows are added as to a rich table (``add_column``, ``add_row``). A ``no_wrap``
    column (the numbers) is as wide as its widest cell; any other column wraps at spaces and,
    inside a word too long for it, after a comma, ``/`` or ``:`` (:func:`break_words`), so it is
    never narrower than its longest such piece. When printed, the first of these that fits the
    console's width is shown: the boxed table (``compact=False``) when nothing in it wraps; the
    table without its frame; the same with known names abbreviated (``tflash``, with a dim legend
    under it); one space between columns instead of two; the ``squeeze`` columns wrapping at
    their spaces (``417.8`` over ``×1.29*``). When none fits, each row becomes a block of
    ``header: value`` lines, and a dim line says how wide the table would need to be.

    A column added with ``flow=True`` lets a cell's wrapped lines run down into the empty cells
    under it in the same section (a case label beside its tensors), instead of making its row
    taller.

    Args:
        title: printed above the table, wrapped at the console's width; None for none.
        compact: False: rich's boxed table where it fits unwrapped; True: never a frame.
    """

    def __init__(self, title: str | None = None, *, compact: bool = True) -> None:
        self.title = title
        self.compact = compact
        self.columns: list[tuple[Any, dict[str, Any], bool, bool]] = []  # header, keywords, flow, squeeze
        self.rows: list[tuple[list[Any], bool]] = []  # cells, end_section

    def add_column(self, header: Any = "", *, flow: bool = False, squeeze: bool = False, **kwargs: Any) -> None:
        """A column, with ``rich.table.Table.add_column``'s keywords (``overflow`` is the table's
        to choose), ``flow`` and ``squeeze``."""
        kwargs.pop("overflow", None)
        self.columns.append((header, kwargs, flow, squeeze))

    def add_row(self, *cells: Any, end_section: bool = False) -> None:
        """A row of cells (str or rich renderables), ``end_section`` as in rich."""
        self.rows.append(([*cells, *[""] * (len(self.columns) - len(cells))], end_section))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.title:
            yield Text(self.title, style="table.title")
        stages = [("boxed", False, False)] if not self.compact else []
        stages += [("compact", False, False), ("compact", True, False), ("tight", True, False)]
        stages += [("tight", True, True)] if any(squeeze for *_, squeeze in self.columns) else []
        note = None
        for frame, short, squeeze in stages:
            names = Names(short)
            table, needed = self._layout(console, options, names, frame, squeeze)
            if table is not None:
                break
        else:
            names = Names(True)
            table, widest = self._stacked(console, options, names)
            note = f"one block per row: side by side, this table needs {needed} columns, and has {options.max_width}"
            if widest > options.max_width:
                note += f"; some words are folded: they need {widest} columns to show whole"
        yield table
        for line in (names.legend(), note):
            if line:
                yield Text(line, style="dim")

    def _layout(self, console: Console, options: ConsoleOptions, names: Names, frame: str, squeeze: bool,
                force: bool = False) -> tuple[Table | None, int]:
        """The rich table in ``frame`` (``boxed``, ``compact``, ``tight`` or ``grid``), its names
        written by ``names``, ``squeeze`` columns wrapping when ``squeeze``; None when it does not
        fit ``options.max_width`` with every word whole (unless ``force``); with the width it needs."""
        keywords = [{k: v for k, v in kw.items() if not (squeeze and squeezed and k in ("no_wrap", "min_width"))}
                    for _, kw, _, squeezed in self.columns]
        wraps = [not kw.get("no_wrap", False) for kw in keywords]
        # Cells that wrap become rich text (no markup, as a label is data), measured by their pieces.
        grid = [[console.render_str(c, markup=False, emoji=False) if wrap and isinstance(c, str) else c
                 for c, wrap in zip(map(names.cell, cells), wraps)]
                for cells in ([header for header, *_ in self.columns], *(cells for cells, _ in self.rows))]
        wide = options.update_width(_WIDE)
        ranges, cell_widths = [], []
        for i, kw in enumerate(keywords):
            found = [(c, Measurement.get(console, wide, c)) for c in (row[i] for row in grid)]
            cell_widths.append([m.maximum for _, m in found])
            high = max((m.maximum for _, m in found), default=1)
            low = max((max(map(cell_len, _PIECE.findall(c.plain)), default=0) if isinstance(c, Text) else m.minimum
                       for c, m in found), default=1) if wraps[i] else high
            low = max(low, kw.get("min_width") or 0, 1)
            ranges.append((low, max(low, high if kw.get("max_width") is None else min(high, kw["max_width"]))))
        probe = self._frame(frame)
        for _ in keywords:
            probe.add_column(width=1)
        overhead = Measurement.get(console, wide, probe).maximum - len(keywords)
        room = options.max_width - overhead
        needed = overhead + sum(low for low, _ in ranges)
        if not force and (needed > options.max_width or (frame == "boxed" and sum(h for _, h in ranges) > room)):
            return None, needed
        widths = _shrink(ranges, cell_widths, room)
        body = [[break_words(c, w) if wrap and isinstance(c, Text) else c for c, w, wrap in zip(row, widths, wraps)]
                for row in grid]
        for c, (*_, flow, _) in enumerate(self.columns):
            if flow:
                self._flow(console, body[1:], c, widths[c])
        table = self._frame(frame)
        for header, kw, w, wrap in zip(body[0], keywords, widths, wraps):
            rest = {k: v for k, v in kw.items() if k not in ("width", "min_width", "max_width")}
            # Fold is safe where it wraps: no piece is wider than the column.
            table.add_column(header, width=w, **rest, **({"overflow": "fold"} if wrap else {}))
        for cells, (_, end) in zip(body[1:], self.rows):
            table.add_row(*cells, end_section=end)
        return table, needed

    def _flow(self, console: Console, body: list[list[Any]], c: int, width: int) -> None:
        """Run each cell of column ``c`` down into the empty cells under it, up to the end of its
        section: one wrapped line each, the last one the rest (``body`` is changed in place)."""
        i = 0
        while i < len(body):
            j = i + 1
            while j < len(body) and not self.rows[j - 1][1] and not str(body[j][c]):
                j += 1
            if j > i + 1 and isinstance(body[i][c], Text):
                lines = list(body[i][c].wrap(console, width))
                for k in range(i, j):
                    body[k][c] = Text("\n").join(lines[k - i:] if k == j - 1 else lines[k - i:k - i + 1])
            i = j

    def _stacked(self, console: Console, options: ConsoleOptions, names: Names) -> tuple[Table, int]:
        """Each row as a block of ``header: value`` lines (cells that hold something), a blank
        line between blocks; the headers in a column of their own where the values fit beside
        them, else at the start of each value. With the width its longest piece needs."""
        heads = [" ".join(str(header).split()) + ":" for header, *_ in self.columns]
        blocks = [[(h, c) for h, c in zip(heads, cells) if str(c)] for cells, _ in self.rows]
        beside, under = FitTable(), FitTable()
        beside.add_column(no_wrap=True, style="bold")
        beside.add_column()
        under.add_column()
        for n, block in enumerate(blocks):
            for h, c in block:
                beside.add_row(h, c)
                under.add_row(Text.assemble((h, "bold"), " ", c))
            if n < len(blocks) - 1:
                beside.add_row("", "")
                under.add_row("")
        table, _ = beside._layout(console, options, names, "grid", False)
        if table is not None:
            return table, 0
        table, widest = under._layout(console, options, names, "grid", False, force=True)
        return table, widest

    @staticmethod
    def _frame(frame: str) -> Table:
        """An empty rich table: ``boxed`` (rich's own), ``compact`` (no outer frame, a rule under
        the header, two spaces between columns), ``tight`` (one space) or ``grid`` (no header)."""
        if frame == "boxed":
            return Table()
        if frame == "grid":
            return Table.grid(padding=(0, 1))
        return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
                     padding=(0, 0) if frame == "tight" else (0, 1))


def compact_table(title: str | None) -> FitTable:
    """A table with no frame, so that about 50 columns of numbers fit next to the labels on an
    80-column terminal, and no word split (:class:`FitTable`)."""
    return FitTable(title, compact=True)
