"""Scenario files: a sweep of cases declared in TOML.

A scenario has these top-level keys, all optional but that it must declare some case:

- ``description``: one line for listings.
- ``preset``: an attention-shape preset from :data:`SHAPE_PRESETS` (``llama3-8b``, ``llama3-70b``,
  ``qwen2.5-7b``, ``mha-d64``) that sets ``heads``, ``kv_heads`` and ``head_dim``. It is a
  top-level key, not a ``[defaults]`` one, because it names what the whole file is about;
  ``[defaults]`` may then not set those three fields again (which would win is not obvious),
  but a ``[sweep]`` axis or a ``[[case]]`` may, and so may the CLI.
- ``[defaults]``: case fields every case starts from.
- ``[sweep]``: lists whose cartesian product gives cases. The key ``shape`` takes a list of
  tables that are merged into the case together, for values that must go in pairs
  (``shape = [{heads = 32, kv_heads = 32}, {heads = 32, kv_heads = 8}]``).
- ``[[case]]``: explicit extra cases, one table each.

``seqlen`` takes sizes as ints or strings such as ``"128k"``. Any field a scenario leaves out
takes the device's default (:func:`ringbench.case.spec.default_fields`). Precedence, lowest first:
the device's defaults, the shape preset, ``[defaults]``, the sweep axes or the ``[[case]]``,
then the CLI's options.

Packed documents are the case fields ``docs`` (lengths) and ``doc_dist`` (a distribution to
draw them from), so they sweep like any field. Keys that other tools or older files use for
something ringbench names otherwise (:data:`RENAMED_KEYS`) are refused with the name to use.

Every error names the file, the line when it can be found, and the key, e.g.
``scenario s.toml, line 3: [defaults] key 'colour' is not a case field; use one of ...``.

Built-in scenarios ship in the ``ringbench.builtin_scenarios`` package; ``smoke`` is a CPU scenario
(its defaults say ``device = "cpu"``), so it runs on CPU even on a GPU machine.
"""

from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from ringbench.errors import SpecError
from ringbench.case.fields import coerce as coerce_field
from ringbench.case.spec import CaseSpec, default_fields, field_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

_TOP_KEYS = ("description", "preset", "defaults", "sweep", "case")
_SHAPE = "shape"

#: Attention-shape presets: the attention shape of a model, as the case fields it sets.
SHAPE_PRESETS: dict[str, dict[str, int]] = {
    "llama3-8b": {"heads": 32, "kv_heads": 8, "head_dim": 128},
    "llama3-70b": {"heads": 64, "kv_heads": 8, "head_dim": 128},
    "qwen2.5-7b": {"heads": 28, "kv_heads": 4, "head_dim": 128},
    "mha-d64": {"heads": 16, "kv_heads": 16, "head_dim": 64},
}

#: Keys ringbench names otherwise, with what to tell a file that uses them.
RENAMED_KEYS: dict[str, str] = {
    "documents": "is not a case field; packed documents are docs (lengths, such as \"3000,500,12k\") or doc_dist "
                 "(such as \"lognormal:mean=4k,sigma=1\")",
    "model": "is not a key: an attention-shape preset (such as \"llama3-8b\") is the top-level key preset, and "
             "a whole model (such as \"llama-tiny\") is the case field hf_model, as verify --model sets it",
}


@dataclass(frozen=True)
class Scenario:
    """A parsed scenario file.

    Attributes:
        name: the built-in name or the file's stem.
        source: where it was read from, for messages.
        description: one line for listings.
        preset: the shape preset named by the file, or None; its fields are in ``defaults``.
        defaults: fields every case starts from (the preset's included), values type-checked.
        sweep: axis name -> values; ``shape`` values are field tables.
        extra: explicit ``[[case]]`` field tables.
    """

    name: str
    source: str
    description: str = ""
    preset: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    sweep: dict[str, list] = field(default_factory=dict)
    extra: list[dict[str, Any]] = field(default_factory=list)
    has_sweep: bool = False

    def cases(self, task: str, device: str, overrides: Mapping[str, Any] | None = None, *,
              visible_gpus: int = 0) -> list[CaseSpec]:
        """Expand the scenario into cases, in file order, duplicates dropped.

        Precedence, lowest first: the device's defaults, ``[defaults]``, the sweep axes or the
        ``[[case]]`` table, then ``overrides``. A scalar override replaces the field in every
        case. A list override (for example ``{"variant": ["zigzag"]}``) replaces the sweep
        axis of that field, and keeps only those ``[[case]]`` entries whose pinned value is in
        the list, so explicit cases act as filters rather than turning into new shapes.

        Args:
            task: ``run`` or ``verify``.
            device: this machine's device, used where the scenario and overrides name none.
            overrides: field -> value or list of values, usually from the CLI.
            visible_gpus: GPUs here; the cuda default world size.

        Returns:
            The cases; not yet validated (see :func:`ringbench.case.spec.validate`).

        Raises:
            SpecError: an override that is not a case field or has the wrong type, or a case
                missing ``variant``.
        """
        overrides = dict(overrides or {})
        scalars, lists = {}, {}
        for key, value in overrides.items():
            if key == "task" or key not in field_names():
                raise SpecError(f"override {key!r} is not a case field; use one of "
                                f"{', '.join(n for n in field_names() if n != 'task')}")
            if isinstance(value, (list, tuple)):
                lists[key] = [coerce_field(key, v) for v in value]
            else:
                scalars[key] = coerce_field(key, value)

        tables: list[dict[str, Any]] = []
        if self.has_sweep:
            axes = {**self.sweep, **lists}
            names = list(axes)
            for combo in itertools.product(*(axes[n] for n in names)):
                case: dict[str, Any] = {}
                for name, value in zip(names, combo):
                    case.update(value if name == _SHAPE else {name: value})
                tables.append(case)
        for entry in self.extra:
            if any(k in entry and entry[k] not in lists[k] for k in lists):
                continue
            free = [k for k in lists if k not in entry]
            for combo in itertools.product(*(lists[k] for k in free)):
                tables.append({**entry, **dict(zip(free, combo))})

        out: list[CaseSpec] = []
        for table in tables:
            merged = {**self.defaults, **table, **scalars}
            case_device = merged.get("device", device)
            full = {"task": task, **default_fields(case_device, visible_gpus), **merged}
            if "variant" not in full:
                raise SpecError(f"scenario {self.source} gives a case without a variant; add variant to "
                                "[defaults], [sweep] or the [[case]], or pass --variant")
            spec = CaseSpec.from_dict(full)
            if spec not in out:
                out.append(spec)
        return out


def builtin_names() -> list[str]:
    """Names of the scenarios shipped in the ``ringbench.builtin_scenarios`` package."""
    folder = resources.files("ringbench.builtin_scenarios")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_scenario(name_or_path: str) -> Scenario:
    """Read a scenario by built-in name (``smoke``) or by file path.

    Raises:
        SpecError: no such built-in or file, malformed TOML (the message carries the line),
            an unknown key, or a value of the wrong type; the message names the file and key.
    """
    builtin = resources.files("ringbench.builtin_scenarios").joinpath(f"{name_or_path}.toml")
    if "/" not in name_or_path and not name_or_path.endswith(".toml") and builtin.is_file():
        return parse_scenario(builtin.read_text(encoding="utf-8"), name=name_or_path,
                              source=f"{name_or_path} (built-in)")
    path = Path(name_or_path)
    if not path.is_file():
        raise SpecError(f"scenario {name_or_path!r} is neither a built-in ({', '.join(builtin_names())}) "
                        "nor a file; pass a built-in name or the path of a .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"scenario {path} could not be read ({exc}); check the file") from None
    return parse_scenario(text, name=path.stem, source=str(path))


def parse_scenario(text: str, *, name: str, source: str) -> Scenario:
    """Parse a scenario's TOML ``text``; ``source`` names it in messages.

    Raises:
        SpecError: see :func:`load_scenario`.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"scenario {source} is not valid TOML: {exc}; fix the syntax there") from None
    lines = _Lines(text)

    def fail(key: str, problem: str, fix: str, line: int | None = None) -> SpecError:
        where = f"scenario {source}" if line is None else f"scenario {source}, line {line}"
        return SpecError(f"{where}: {key} {problem}; {fix}")

    for key in data:
        if key not in _TOP_KEYS:
            problem = RENAMED_KEYS.get(key, "is not a scenario key")
            raise fail(repr(key), problem, f"use {', '.join(_TOP_KEYS)}", lines.find(None, key))
    description = data.get("description", "")
    if not isinstance(description, str):
        raise fail("description", "must be a string", "quote it", lines.find(None, "description"))

    defaults = _fields(data.get("defaults", {}), "[defaults]", fail, lines, ("defaults", None))
    name_of_preset = data.get("preset")
    if name_of_preset is not None:
        line = lines.find(None, "preset")
        if not isinstance(name_of_preset, str) or name_of_preset not in SHAPE_PRESETS:
            raise fail(f"preset {name_of_preset!r}", "is not a shape preset",
                       f"use one of {', '.join(SHAPE_PRESETS)}, or set heads, kv_heads and head_dim "
                       "in [defaults]", line)
        preset = SHAPE_PRESETS[name_of_preset]
        clash = [k for k in preset if k in defaults]
        if clash:
            raise fail(f"[defaults] key {clash[0]!r}", f"clashes with preset {name_of_preset!r}, which sets "
                       f"{', '.join(preset)}", f"remove {clash[0]} from [defaults], or drop preset",
                       lines.find(("defaults", None), clash[0]))
        defaults = {**preset, **defaults}

    sweep_table = data.get("sweep")
    sweep: dict[str, list] = {}
    if sweep_table is not None:
        if not isinstance(sweep_table, dict):
            raise fail("sweep", "must be a table", "write it as [sweep]", lines.find(None, "sweep"))
        for key, values in sweep_table.items():
            where = f"[sweep] {key}"
            if not isinstance(values, list) or not values:
                raise fail(where, "must be a non-empty list", f"write {key} = [value, ...]",
                           lines.find(("sweep", None), key))
            if key == _SHAPE:
                sweep[key] = [_fields(v, f"{where} item", fail, lines, ("sweep", None), inside=key)
                              for v in values]
            else:
                sweep[key] = [_fields({key: v}, "[sweep]", fail, lines, ("sweep", None))[key] for v in values]

    extra_tables = data.get("case", [])
    if not isinstance(extra_tables, list):
        raise fail("case", "must be an array of tables", "write each one as [[case]]", lines.find(None, "case"))
    extra = [_fields(t, f"[[case]] {i + 1}", fail, lines, ("case", i + 1)) for i, t in enumerate(extra_tables)]
    if sweep_table is None and not extra:
        raise fail("the file", "declares no case", "add a [sweep] table or [[case]] entries")
    return Scenario(name=name, source=source, description=description, preset=name_of_preset, defaults=defaults,
                    sweep=sweep, extra=extra, has_sweep=sweep_table is not None)


def _fields(table: Any, where: str, fail, lines: "_Lines", section: tuple, inside: str | None = None
            ) -> dict[str, Any]:
    """Type-check a table of case fields (``task`` excluded) found at ``where``.

    ``section`` and ``inside`` locate the table in the file for the line of an error
    (see :meth:`_Lines.find`).
    """
    if not isinstance(table, dict):
        raise fail(where, "must be a table of case fields", "write it as {field = value, ...}",
                   lines.find(section, inside or where.split()[-1]))
    allowed = [n for n in field_names() if n != "task"]
    out = {}
    for key, value in table.items():
        line = lines.find(section, key, inside=inside)
        if key in RENAMED_KEYS and key not in allowed:
            raise fail(f"{where} key {key!r}", RENAMED_KEYS[key], "rename it", line)
        if key not in allowed:
            raise fail(f"{where} key {key!r}", "is not a case field", f"use one of {', '.join(allowed)}", line)
        try:
            out[key] = coerce_field(key, value)
        except SpecError as exc:
            # The field's own message already names the rule and the fix.
            raise SpecError(f"{fail(f'{where} key {key!r}', 'is refused', '', line)}".rstrip("; ")
                            + f": {exc}") from None
    return out


_HEADER_RE = re.compile(r"\s*(\[\[?)\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\]?\s*(#.*)?$")


class _Lines:
    """Finds the line of a key in a scenario's text, for error messages.

    tomllib reports lines only for syntax errors, so this scans the text: it tracks the
    current table header (``[defaults]``, ``[sweep]``, the n-th ``[[case]]``) and looks for
    ``key =`` in it. It is a locator for messages, not a parser: when it cannot tell, it
    answers None and the message goes without a line.
    """

    def __init__(self, text: str) -> None:
        self.rows: list[tuple[tuple, int, str]] = []  # (section, 1-based line, text)
        section: tuple = (None, None)
        cases = 0
        for number, line in enumerate(text.splitlines(), start=1):
            header = _HEADER_RE.fullmatch(line)
            if header and not line.lstrip().startswith("#"):
                name = header.group(2).strip().strip("\"'")
                if header.group(1) == "[[":
                    cases += 1 if name == "case" else 0
                    section = (name, cases if name == "case" else None)
                else:
                    section = (name, None)
                self.rows.append(((None, None), number, f"{name} ="))  # the header stands for its key
                continue
            self.rows.append((section, number, line))

    def find(self, section: tuple | None, key: str, *, inside: str | None = None) -> int | None:
        """The line of ``key = ...`` in ``section`` (None: the top level), or of ``key =``
        within the value of ``inside`` (an inline table in a list); None when not found."""
        section = section or (None, None)
        pattern = re.compile(rf"(^|[{{,\s])[\"']?{re.escape(key)}[\"']?\s*=")
        start = re.compile(rf"\s*[\"']?{re.escape(inside or key)}[\"']?\s*=")
        seen_start = False
        for row_section, number, line in self.rows:
            if row_section != section:
                continue
            if inside is None:
                if start.match(line):
                    return number
            elif seen_start or start.match(line):
                seen_start = True
                if pattern.search(line.split("=", 1)[1] if start.match(line) else line):
                    return number
        return None
