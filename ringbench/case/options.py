"""The command-line options of ``run`` and ``verify``: the case options, generated from the field
table (``ringbench.case.fields``), the sweep's own options, and the checks of the options that are
not case fields. Torch-free, so ``--help`` and a bad option answer at once.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import math
import os
import re
import shlex
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from ringbench.case import fields
from ringbench.case.types import SECONDS, ValueType, whole
from ringbench.errors import SpecError

OUT_HELP = "Folder for the records; run appends to OUT/runs.jsonl, verify to OUT/verify.jsonl. Default: results."
JSON_HELP = "Print one JSON record per line on stdout and nothing else there, instead of the table."
RESUME_HELP = ("Skip the cases that already have a record with status ok in the results file (same case_id: "
               f"every field but {', '.join(fields.NOT_IN_CASE_ID[:-1])} and {fields.NOT_IN_CASE_ID[-1]}), so a "
               "sweep that was stopped can be finished; the "
               "table and --json still show every case. Default: run every case.")
TIMEOUT_HELP = ("Wall-clock seconds each case may run, from its own start (the slowest rank's start mark), before "
                "every rank of its launch is stopped and the case recorded as timeout; the sweep then goes on with "
                "the next case in a fresh launch. A launch's start-up runs under its first case's limit. Default: "
                "each case's own, 10 times its estimate (printed before the sweep) plus 300 s on cpu or 120 s on "
                "cuda.")
YES_HELP = ("Start the sweep even where ringbench would ask first: on CPU, a sweep estimated over 30 minutes, or a "
            "world size with more ranks than 4 per core or than the memory here holds (the estimate is printed "
            "before every sweep). Default: refuse those with exit code 2.")
NNODES_HELP = ("Hosts the job spans, each running this same command with its own --node-rank; --world-size "
               "is the total over them, so each host starts world_size / nnodes ranks (it must divide). Only "
               "node 0, where global rank 0 lives, writes records. Default: 1.")
NODE_RANK_HELP = "This host's index among --nnodes, 0 to nnodes - 1. Default: 0."
RDZV_ENDPOINT_HELP = ("HOST:PORT of torchrun's c10d rendezvous, the same on every node (usually node 0's host "
                      "name and a free port such as 29500); required with --nnodes above 1.")
RDZV_ID_HELP = ("Rendezvous id, the same on every node. Default: derived from --rdzv-endpoint and the command "
                "line, which every node shares.")

SCENARIO_HELP = ("Sweep a scenario instead of one shape: a built-in name (smoke, ci-nightly, llama3-8b, peers, "
                 "hybrids, masks) or a "
                 ".toml file; the case options then override its fields, and a repeated --variant, --world-size, --seqlen or --kernel "
                 "replaces its axis. verify's default: the smoke scenario (CPU), unless a shape option is given.")
JUNIT_HELP = "Also write the results as JUnit XML to this file, one test case per case. Default: no file."


def _option_help(field: fields.Field, scenario: bool = True) -> str:
    """The option's help; without ``scenario`` (a command that takes no --scenario, as predict),
    its sentences about scenarios are left out."""
    text = field.help[0].upper() + field.help[1:] + "."
    if field.repeatable:
        text += " Repeat for several: one case per value" + (" (with --scenario: replaces its axis)." if scenario
                                                              else ".")
    text = f"{text} {field.default_help()}"
    if not scenario:
        # Clauses (after "; ") or whole sentences about scenarios; "Default: none; run needs one or
        # --scenario" keeps "Default: none."
        kept = []
        # A sentence ends at one full stop before a capital ("p - L + 1 .. p" and "type;..." stay whole).
        for sentence in re.split(r"(?<=[^.]\.) (?=[A-Z])", text):
            stop = sentence.endswith(".") and not sentence.endswith("..")
            clauses = [c for c in (sentence[:-1] if stop else sentence).split("; ") if "scenario" not in c]
            if clauses:
                kept.append("; ".join(clauses) + ("." if stop else ""))
        text = " ".join(kept)
    return text


def _file_name(field: fields.Field) -> str:
    """The parameter name of a field's file option (``mask`` -> ``mask_file``)."""
    return f"{field.name}_file"


def _case_parameters(command: str, hidden: tuple[str, ...] = (), scenario: bool = True,
                     helps: dict[str, str] | None = None) -> list[inspect.Parameter]:
    """One typer option per field that ``command`` takes, in table order (a field with a
    ``file_option`` has that one too, right after its own); the fields named in ``hidden`` are
    left out of ``--help`` (still parsed, so the command can refuse them in its own sentence);
    ``scenario``: whether the command takes --scenario (``_option_help``); ``helps``: field ->
    the command's own help text, where the field means something else there (predict's --device)."""
    helps = helps or {}
    params = []
    for f in fields.fields_of(command):
        # A typed field's text is parsed once, here, by its type (fields.Field.value_type), whose
        # refusal is ringbench's one sentence, not the parser's box; the help shows the text.
        kind = str if f.value_type is not None else f.type
        annotation = Optional[List[kind]] if f.repeatable else Optional[kind]
        option = typer.Option(None, *f.option.split(" "), help=helps.get(f.name) or _option_help(f, scenario),
                              show_default=False,
                              parser=f.value_type, metavar=f.value_name, hidden=f.name in hidden)
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=annotation))
        if f.file_option:
            from_file = typer.Option(None, f.file_option, help=f.file_help, show_default=False, parser=f.file_parse,
                                     metavar=f.file_parse.name)
            params.append(inspect.Parameter(_file_name(f), inspect.Parameter.KEYWORD_ONLY, default=from_file,
                                            annotation=Optional[List[str]] if f.repeatable else Optional[str]))
    return params


def _with_files(case: dict[str, Any]) -> dict[str, Any]:
    """``case`` with each file option's values (already read into the field's text) joined to
    its field's: after them in a repeatable field's list; a single field given both ways is refused."""
    for f in fields.FIELDS:
        if not f.file_option:
            continue
        read = case.pop(_file_name(f), None)
        if read is None or read == []:
            continue
        if f.repeatable:
            case[f.name] = [*(case.get(f.name) or []), *read]
        elif f.name in case:
            raise SpecError(f"{f.option} and {f.file_option} both give {f.name}; pass one of them")
        else:
            case[f.name] = read
    return case


def with_case_options(command: str, hidden: tuple[str, ...] = (), scenario: bool = True,
                      helps: dict[str, str] | None = None) -> Callable:
    """Give a typer command every case option of ``command`` (``run`` or ``verify``), those of the
    fields in ``hidden`` left out of its ``--help``; ``scenario=False`` for a command without
    --scenario, whose option texts then say nothing of scenarios; ``helps``: field -> the command's
    own text for the options whose meaning or default differ there (predict's --world-size).

    The decorated function takes ``case``: the options given, field -> value (a list for the
    repeatable ones), the others left out; then its own parameters.
    """
    def decorate(func: Callable) -> Callable:
        hints = typing.get_type_hints(func)
        own = [p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(func).parameters.values() if p.name != "case"]
        case_params = _case_parameters(command, hidden, scenario, helps)
        names = [p.name for p in case_params]

        @functools.wraps(func)
        def command_fn(**kwargs: Any) -> Any:
            case = _with_files({n: kwargs.pop(n) for n in names})
            return func(case={k: v for k, v in case.items() if v is not None and v != []}, **kwargs)

        params = case_params + own
        command_fn.__signature__ = inspect.Signature(params)  # what typer reads
        command_fn.__annotations__ = {p.name: p.annotation for p in params}
        return command_fn
    return decorate


# --------------------------------------------------------------------------- checks of options

#: ``matrix --world-size`` reads its values as the case field does.
WORLD_SIZE = fields.BY_NAME["world_size"].value_type
#: The types of ``--timeout``, ``--nnodes`` and ``--node-rank``.
TIMEOUT, NNODES, NODE_RANK = SECONDS, whole("nnodes", "--nnodes", 1), whole("node-rank", "--node-rank", 0)


def check_given(given: dict[str, Any]) -> None:
    """Refuse bad case option values (already parsed into their types) before the (slow,
    torch-importing) device detection."""
    from ringbench.case.spec import check_fields, document_refusal, mask_refusal

    for key, value in given.items():
        for item in value if isinstance(value, list) else [value]:
            check_fields({key: item})
    for key, value in list(given.items()):
        if isinstance(value, list):  # the same value twice is one case, not two
            given[key] = list(dict.fromkeys(value))
    lists = {k: v for k, v in given.items() if isinstance(v, list)}
    combos = [{**given, **dict(zip(lists, combo))} for combo in itertools.product(*lists.values())]
    sizes = given.get("world_size") or []
    for combo in combos if len(sizes) > 1 else []:  # documents that every world size given can cut
        reason = document_refusal(combo, world_sizes=sizes)
        if reason:
            raise SpecError(reason)
    _check_seqlen_fits_every_world_size(given)
    for combo in combos:  # the variant's seqlen rule, at every world size
        reason = mask_refusal(combo)
        if reason:
            raise SpecError(reason)
        check_fields(combo)


def _check_seqlen_fits_every_world_size(given: dict[str, Any]) -> None:
    """Refuse a seqlen that some of several world sizes cannot cut, naming one that fits them all."""
    from ringbench.variants import MAX_SEQLEN, get_variant, nearest_multiple
    from ringbench.variants.offers import SeqlenOffer

    sizes = given.get("world_size") or []
    if "seqlen" not in given or len(sizes) < 2:
        return
    seqlens = given["seqlen"] if isinstance(given["seqlen"], list) else [given["seqlen"]]
    for name in given.get("variant") or []:
        variant = get_variant(name)
        layout = given.get("layout") or None
        need = math.lcm(*(variant.seqlen_multiple(w, layout) for w in sizes))
        for seqlen in seqlens:
            if seqlen % need:
                near = nearest_multiple(seqlen, need)
                refused = (f"seqlen {seqlen} is not a multiple of {need}, which {name} needs to cut it at every "
                           f"world size given ({', '.join(map(str, sizes))})")
                if near:
                    raise SpecError(SeqlenOffer(refused, lambda s: f"use {s}", near, "no multiple near it passes "
                                                "the case's other rules, so run these world sizes in separate "
                                                "commands"))
                raise SpecError(f"{refused}; no seqlen up to the limit of {MAX_SEQLEN} tokens is one, so run these "
                                "world sizes in separate commands")


_HOST_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def check_nodes(nnodes: Optional[int], node_rank: Optional[int], endpoint: Optional[str],
                rdzv_id: Optional[str]) -> tuple[int, dict]:
    """Refuse bad multi-node options (``--nnodes`` and ``--node-rank`` as parsed, or ``None``
    for the defaults 1 and 0); the number of nodes, and the keyword arguments ``launch`` takes
    for them."""
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    if not 1 <= nnodes <= fields.MAX_NODES:
        raise SpecError(f"nnodes {nnodes} must be from 1 to {fields.MAX_NODES}; pass --nnodes with the number of hosts")
    if not 0 <= node_rank < nnodes:
        raise SpecError(f"node-rank {node_rank} must be from 0 to nnodes - 1 = {nnodes - 1}; pass --node-rank with "
                        "this host's index")
    if endpoint is not None:
        host, sep, port = endpoint.rpartition(":")
        if not (sep and _HOST_RE.fullmatch(host) and port.isdigit() and 1 <= int(port) <= 65535):
            raise SpecError(f"rdzv-endpoint {endpoint!r} is not HOST:PORT with a port from 1 to 65535; pass "
                            "--rdzv-endpoint such as node001:29500")
    elif nnodes > 1:
        raise SpecError(f"nnodes {nnodes} needs a rendezvous every node can reach; pass --rdzv-endpoint HOST:PORT, "
                        "the same on every node, such as node001:29500")
    if nnodes == 1 and node_rank == 0 and endpoint is None:
        return nnodes, {}
    if rdzv_id is None:
        # Every node runs the same command line but its own --node-rank: leave that out.
        argv, skip = [], False
        for arg in sys.argv[1:]:
            if skip or arg.startswith("--node-rank"):
                skip = arg == "--node-rank"
                continue
            argv.append(arg)
        rdzv_id = "ringbench-" + hashlib.sha1(shlex.join([endpoint or "", *argv]).encode()).hexdigest()[:12]
    return nnodes, {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": endpoint, "rdzv_id": rdzv_id}


def _read_only(path: Path) -> bool:
    """Whether ``path`` (which exists) is read-only: no write permission for this user, or no write
    bit for anyone (refused for root too, whom the bits do not stop, so that a marked file is kept)."""
    return not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222


def _writable_folder(folder: Path) -> str | None:
    """Why nothing can be written in ``folder`` (made if missing), or None when a file can be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if _read_only(folder):
            return "the folder is read-only"
        # A real write, since permission bits say nothing to root about read-only or immutable folders.
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ringbench-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _unwritable_file(path: Path) -> str | None:
    """Why the file ``path`` cannot be written or appended to, or None when it can (made if missing)."""
    if path.is_dir():
        return "it is a folder"
    reason = _writable_folder(path.parent)
    if reason is None and path.exists() and _read_only(path):
        reason = "the file is read-only"
    return reason


def _out_folder(text: str) -> Path:
    if not text.strip():
        raise SpecError(f"out {text!r} names no folder; pass --out with a folder, such as results")
    return Path(text)


#: ``--out``: a folder; empty text, which would write in the working folder unasked, is refused.
OUT = ValueType("FOLDER", _out_folder)


def check_out(out: Path, junit_xml: Optional[Path], files: tuple[str, ...] = ()) -> None:
    """Refuse, before any process starts, an ``out`` folder, one of the ``files`` in it (the results
    file, such as ``runs.jsonl``) or a ``junit_xml`` file that could not be written once the work is done.

    Raises:
        SpecError: the folder cannot be made or written in, or a file is a folder or read-only.
    """
    reason = _writable_folder(out)
    if reason:
        raise SpecError(f"out {str(out)!r} is not a folder ringbench can write in ({reason}); pass --out with a "
                        "writable folder")
    for name in files:
        reason = _unwritable_file(out / name)
        if reason:
            raise SpecError(f"out {str(out)!r} holds {name}, which ringbench cannot append to ({reason}); pass "
                            "--out with another folder")
    if junit_xml is not None:
        reason = _unwritable_file(junit_xml)
        if reason:
            raise SpecError(f"junit-xml {str(junit_xml)!r} cannot be written ({reason}); pass --junit-xml "
                            "with a writable file path, such as results/verify.xml")


def check_output(option: str, path: Optional[Path], suffixes: tuple[str, ...], example: str = "") -> None:
    """Refuse an output file with a wrong suffix, or one that could not be written (a folder, a
    read-only file, a folder that cannot be made or written in), before any work. ``example``: the
    file the fix offers (default: compare's, ``compare`` with the first suffix).

    Raises:
        SpecError: one sentence naming the option, the path and the rule."""
    if path is None:
        return
    if suffixes and path.suffix.lower() not in suffixes:
        raise SpecError(f"{option} {str(path)!r} must end in {', '.join(suffixes[:-1])} or {suffixes[-1]}, which "
                        f"names the format; pass a file such as {example or 'compare' + suffixes[0]}")
    reason = _unwritable_file(path)
    if reason:
        example = example or "compare" + (suffixes[0] if suffixes else {"--to-parquet": ".parquet"}.get(option, ".md"))
        raise SpecError(f"{option} {str(path)!r} cannot be written ({reason}); pass {option} with a writable file "
                        f"path, such as {example}")
