"""The value types of options and case fields: how text such as ``128k`` or ``auto`` becomes a
value, once, where it enters.

Each type is typer's ``parser`` hook for the options it reads (typer 0.29 parses through its own
copy of click and takes a ``parser`` callable, not a ``click.ParamType``; these keep that class's
shape: a ``name``, ``convert`` and ``fail``). A refusal is ringbench's one sentence: ``fail``
raises :class:`Refused`, which the CLI's command class prints with exit code 2, instead of a
``ValueError`` that the parser library would wrap in a box of its own. Scenarios and records
read the same types through :meth:`ValueType.parse`, which raises the ``SpecError`` itself.

Torch-free and typer-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ringbench.errors import SpecError


class Refused(Exception):
    """A value refused while the command line is parsed; ``error`` is its ``SpecError``.

    Not a ``ValueError``, so that it passes the parser library unchanged to the command, which
    prints ``str(error)`` and exits 2.
    """

    def __init__(self, error: SpecError):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class ValueType:
    """One kind of value: ``parse`` turns text into it, raising ``SpecError`` in one sentence.

    Attributes:
        name: what the value is, as ``--help`` names it after the option (its metavar: ``INT``,
            ``TOKENS``, ``SECONDS``).
        read: text -> value, raising ``SpecError``.
    """

    name: str
    read: Callable[[str], Any]

    def parse(self, text: str) -> Any:
        """The value of ``text``; a value that is not text is taken as it is (already parsed)."""
        return self.read(text) if isinstance(text, str) else text

    def convert(self, text: Any, param: Any = None, ctx: Any = None) -> Any:
        """:meth:`parse`, refusing through :meth:`fail`."""
        try:
            return self.parse(text)
        except SpecError as exc:
            self.fail(exc)

    def fail(self, error: SpecError, param: Any = None, ctx: Any = None):
        """Refuse the value: :class:`Refused`, printed by the CLI as one sentence, exit code 2."""
        raise Refused(error) from None

    def __call__(self, text: Any) -> Any:  # typer's parser hook
        return self.convert(text)


def whole(name: str, option: str, example: int) -> ValueType:
    """A whole number such as ``--world-size 4``, refused naming ``name``, ``option`` and ``example``."""
    def read(text: str) -> int:
        try:
            return int(text.strip())
        except ValueError:
            raise SpecError(f"{name} {text!r} is not a whole number; pass {option} with an integer, such as "
                            f"{example}") from None
    return ValueType("INT", read)


#: The longest watchdog limit of one case, in seconds: a week (``--timeout``'s own bound).
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _seconds(text: str) -> float:
    try:
        timeout = float(text.strip())
    except ValueError:
        raise SpecError(f"timeout {text!r} is not a number of seconds; pass --timeout with a number, such as "
                        "600") from None
    if not 0 < timeout < MAX_TIMEOUT_S:
        raise SpecError(f"timeout {timeout:g} must be positive and under a week (604800 s); pass --timeout with a "
                        "number of seconds, such as 600")
    return timeout


#: ``--timeout``: seconds, above 0 and under a week.
SECONDS = ValueType("SECONDS", _seconds)
