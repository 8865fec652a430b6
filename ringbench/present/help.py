"""``--help`` that wraps at any width and never cuts a word.

typer's rich help lays each option out as a table of four name columns, a type and the help;
on a 40-column terminal it cut names and words with an ellipsis (``--vari…``, ``contex…``), and
at 80 a name as long as ``--require-deterministic`` or a value such as
``lognormal:mean=4k,sigma=1`` (issue 27, item 4). Here every option is one term, its names and
the name of its value (``--seqlen TOKENS``, ``--causal/--no-causal``: a flag has none), beside
its help where they leave the help :data:`MIN_HELP` columns, else above it, the help indented
under it. Lines wrap at spaces; a word wider than its whole line is folded onto the next, never
dropped. Rich only: no torch, so ``--help`` stays instant.
"""

from __future__ import annotations

import inspect
from typing import Any

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

#: The columns the help needs beside the terms; below that, each help goes under its term.
MIN_HELP = 30
#: A term is never given more columns than this beside the help; a longer one wraps at its spaces.
MAX_TERM = 30
#: How far a help is indented under its term in the stacked form.
INDENT = 4


def _paragraphs(text: str) -> list[str]:
    """The paragraphs of a help text, each with its line breaks made spaces."""
    return [" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n") if p.strip()]


def value_name(param: Any) -> str | None:
    """The name of the value an option takes as ``--help`` shows it (its ``metavar``: ``INT``,
    ``TOKENS``, ``cuda|cpu``), or None for a flag; an argument's is its own name."""
    if param.param_type_name == "argument":
        name = param.metavar or param.name.upper()
        return name + ("..." if param.nargs != 1 else "")
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    return param.metavar or param.name.upper()


def term(param: Any) -> Text:
    """An option's names and its value's name (``--seqlen TOKENS``), or an argument's name."""
    if param.param_type_name == "argument":
        return Text(value_name(param), style="bold cyan", overflow="fold")
    names = Text(", ".join(param.opts), style="bold cyan", overflow="fold")
    if param.secondary_opts:
        names.append("/" + ", ".join(param.secondary_opts), style="bold magenta")
    value = value_name(param)
    if value:
        names.append(" ")
        names.append(value, style="yellow")
    return names


def _rows_panel(title: str, rows: list[tuple[Text, Text]], width: int) -> Panel:
    """A panel of (term, help) rows: side by side where the help keeps :data:`MIN_HELP` columns,
    else each help under its term."""
    inner = width - 4  # the panel's borders and their padding
    longest_piece = max((len(w) for t, _ in rows for w in t.plain.split()), default=1)
    term_width = max(min(max(len(t.plain) for t, _ in rows), MAX_TERM), longest_piece)
    if inner - term_width - 2 >= MIN_HELP:
        table = Table.grid(padding=(0, 2), expand=True)
        table.add_column(width=term_width, overflow="fold")
        table.add_column(ratio=1, overflow="fold")
        for t, h in rows:
            table.add_row(t, h)
        body: Any = table
    else:
        parts = []
        for t, h in rows:
            parts += [t, Padding(h, (0, 0, 0, INDENT))]
        body = Group(*parts)
    return Panel(body, title=title, title_align="left", border_style="dim")


def _text(text: str) -> Text:
    return Text(text, overflow="fold")


def print_help(command: Any, ctx: Any, console: Console | None = None) -> None:
    """Print ``command``'s help (a click command or group, as typer builds them) on ``console``
    (default: stdout at the terminal's width): usage, its text, its arguments, options and
    subcommands."""
    console = console or Console()
    width = console.width
    usage = " ".join(command.get_usage(ctx).split())
    console.print(Padding(Text(usage, style="bold", overflow="fold"), (1, 1, 0, 1)))
    if command.help:
        for paragraph in _paragraphs(command.help):
            console.print(Padding(_text(paragraph), (1, 1, 0, 1)))
    console.print()
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    for title, kind in (("Arguments", "argument"), ("Options", "option")):
        rows = [(term(p), _text(" ".join((p.help or "").split()))) for p in params if p.param_type_name == kind]
        if rows:
            console.print(_rows_panel(title, rows, width))
    names = getattr(command, "list_commands", lambda ctx: [])(ctx)
    if names:
        rows = []
        for name in names:
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                rows.append((Text(name, style="bold cyan"), _text((_paragraphs(sub.help or "") or [""])[0])))
        console.print(_rows_panel("Commands", rows, width))
