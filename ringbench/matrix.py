"""``ringbench matrix``: which implementation is right for which mask, dtype, shape and world size.

The grid (:func:`build_grid`): every implementation (ringbench's variants, then every peer)
against fifteen columns around one base cell, each column changing one thing from it, at each
world size. The base: causal, bf16, batch 1, 8 query heads over 2 K/V heads (GQA 4:1), head dim
128, :data:`BASE_SEQLEN` tokens (packed into four documents for a varlen implementation, whose
base mask is packed documents). The columns (:data:`COLUMNS`):

- mask: causal, full (no mask), sliding window, packed documents;
- dtype: bf16, fp16, fp32;
- shape: head dim 64, 128, 256; MLA (query/key head dim 192, value head dim 128); MHA 8/8,
  GQA 8/2, MQA 8/1; an odd length (``S = W * c`` with ``c`` odd, so a contiguous share is an odd
  number of tokens; a varlen implementation gets documents of odd lengths instead).

The base cell shows under four columns (causal or packed, bf16, D=128, GQA 8/2): it is one case.
A column whose option ringbench has no case field for yet (``window``, ``head_dim_v``) is
``unsupported`` with that reason for everyone, and fills in once the field exists (the cell's
fields then carry it). Packed documents go to the varlen implementations, the batch masks to the
batch ones; the other way round the spec's own refusal is the cell's reason.

Each cell is one ``verify`` case built as the CLI builds one (``sweep.build_cases``) and
refused per cell: a refusal (``SpecError``, ``Unavailable``) is recorded as a ``skipped`` record
with its sentence and never launched; the others run through ``sweep.run_sweep`` (one torchrun
launch per world size, its watchdog, its records in ``OUT/verify.jsonl``). Every cell is then
classified (:func:`classify`) as one of :data:`CLASSES`, and :func:`write` writes
``OUT/matrix.jsonl`` (one object per cell, :func:`cell_object`), ``OUT/matrix.md`` and
``OUT/matrix.png``.

The test-only variants join under ``RINGBENCH_TEST_VARIANTS=1`` (the CLI's hidden
``--test-variants`` sets it): ``broken_merge`` over every column (a mismatch), ``fault_oom`` and
``fault_raise`` at their base cell only (an oom, an error), in a sweep of their own after the
others, so that the launch ``fault_raise`` crashes holds nothing else.

pandas-free; matplotlib is imported by :func:`plot` alone, torch by the case building.
"""

from __future__ import annotations

import json
import math
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ringbench import fields
from ringbench.errors import SpecError
from ringbench.fields import plural
from ringbench.formatting import ratio_text

#: The classes a cell can end in, in the order legends list them.
CLASSES = ("correct", "mismatch", "unsupported", "oom", "timeout", "error")
#: What each class means (the README, the Markdown and ``--help`` say the same).
CLASS_MEANING = {
    "correct": "every check passed: out, lse, dq, dk and dv within verify's tolerance of float64 attention; "
               "the number is the worst tensor's error over its allowance",
    "mismatch": "a check failed; the cell names the worst tensor and its error over its allowance (×12: twelve "
                "times what is allowed)",
    "unsupported": "the implementation refuses the cell, in its own words (a spec's refusal, a missing library, "
                   "a peer's own exception) or ringbench has no case field for it yet; never launched, unless "
                   "a peer raised",
    "oom": "out of memory on some rank",
    "timeout": "the launch passed its watchdog (--timeout)",
    "error": "the implementation raised, or its launch crashed",
}

#: The base cell's global tokens per device (at least 64 per rank at larger world sizes).
BASE_SEQLEN = {"cpu": 256, "cuda": 4096}
#: The base cell's other fields.
BASE = {"batch": 1, "heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bf16", "causal": True, "seed": 0,
        "kernel": "auto"}
#: MLA's query/key and value head dims (DeepSeek-V2/V3).
MLA_HEAD_DIMS = (192, 128)
#: Shares of the sequence, in sixteenths, of the base cell's four packed documents.
DOC_SHARES = (4, 1, 8, 3)
#: The test-only variants the matrix takes, and the columns each fills (None: every column).
TEST_VARIANTS = {"broken_merge": None, "fault_oom": "base", "fault_raise": "base"}
#: Variants launched apart, after the others (a sweep of their own, in this order): a launch that
#: one of them crashes then holds nothing else.
_LAUNCH_APART = {"fault_oom": 1, "fault_raise": 2}

#: Why a column cannot be asked for yet, while ringbench has no case field for it.
NO_WINDOW = ("ringbench has no window case field yet, so no implementation can be asked for sliding-window "
             "attention; this cell fills in once the field exists")
NO_HEAD_DIM_V = ("ringbench has no head_dim_v case field yet (a value head dim apart from the query/key head dim, "
                 "192/128 in MLA), so no implementation can be asked for MLA's shape; this cell fills in once the "
                 "field exists")


@dataclass(frozen=True)
class Column:
    """One column of the matrix: the base cell with one thing changed.

    Attributes:
        axis: ``mask``, ``dtype`` or ``shape``.
        key: its name in ``--json`` and ``matrix.jsonl`` (``causal``, ``fp16``, ``d256``, ``mqa``...).
        label: its header in the Markdown and the picture.
    """

    axis: str
    key: str
    label: str


COLUMNS: tuple[Column, ...] = (
    Column("mask", "causal", "causal"),
    Column("mask", "full", "full"),
    Column("mask", "window", "sliding window"),
    Column("mask", "packed", "packed docs"),
    Column("dtype", "bf16", "bf16"),
    Column("dtype", "fp16", "fp16"),
    Column("dtype", "fp32", "fp32"),
    Column("shape", "d64", "D=64"),
    Column("shape", "d128", "D=128"),
    Column("shape", "d256", "D=256"),
    Column("shape", "mla", "MLA 192/128"),
    Column("shape", "mha", "MHA 8/8"),
    Column("shape", "gqa", "GQA 8/2"),
    Column("shape", "mqa", "MQA 8/1"),
    Column("shape", "odd", "odd length"),
)
AXES = ("mask", "dtype", "shape")
_BY_KEY = {c.key: c for c in COLUMNS}

@dataclass
class Cell:
    """One cell: an implementation at a world size, under the columns that share its case.

    Attributes:
        implementation: the variant's name.
        world_size: ranks.
        columns: keys of the columns it fills (the base cell fills four).
        case: its ``CaseSpec`` (resolved when it runs; as given when refused), or ``None`` when no
            spec can express it (a column without its case field).
        refusal: why it cannot run (the spec's sentence), or ``None`` when it is launched.
        record: its verify or skipped record, once known.
        klass, reason, worst: its class (:data:`CLASSES`), why (null when correct), and the
            worst tensor's ``{"tensor", "ratio"}`` (error over allowance) when it was checked.
    """

    implementation: str
    world_size: int
    columns: list[str]
    case: Any = None
    refusal: Optional[str] = None
    record: Optional[dict] = None
    klass: Optional[str] = None
    reason: Optional[str] = None
    worst: Optional[dict] = None

    @property
    def case_id(self) -> Optional[str]:
        return self.case.case_id() if self.case is not None else None


@dataclass
class Grid:
    """The matrix: its cells, and the axes they lie on."""

    device: str
    world_sizes: list[int]
    implementations: list[str]
    columns: list[Column] = field(default_factory=lambda: list(COLUMNS))
    cells: list[Cell] = field(default_factory=list)

    @property
    def axes(self) -> list[str]:
        """The axes its columns lie on, in :data:`AXES` order."""
        return [a for a in AXES if any(c.axis == a for c in self.columns)]

    def cell(self, implementation: str, world_size: int, column: str) -> Optional[Cell]:
        """The cell at one place, or ``None`` where the grid has none (a test variant's other columns)."""
        for c in self.cells:
            if c.implementation == implementation and c.world_size == world_size and column in c.columns:
                return c
        return None

    def counts(self, world_size: Optional[int] = None) -> dict[str, int]:
        """Cells per class (each cell once, however many columns it fills)."""
        out = dict.fromkeys(CLASSES, 0)
        for c in self.cells:
            if c.klass and (world_size is None or c.world_size == world_size):
                out[c.klass] += 1
        return out


# --------------------------------------------------------------------------- the grid

def base_seqlen(device: str, world_size: int) -> int:
    """The base cell's tokens: :data:`BASE_SEQLEN`, at least 64 per rank."""
    return max(BASE_SEQLEN[device], 64 * world_size)


def odd_seqlen(seqlen: int, world_size: int) -> int:
    """The odd-length column's tokens: the largest ``W * c`` not above ``seqlen`` with ``c`` odd
    (254 for 256 at W=2: 127 tokens per contiguous share)."""
    share = seqlen // world_size
    return world_size * (share if share % 2 else share - 1)


def documents(seqlen: int, world_size: int) -> list[int]:
    """The base cell's packed documents: shares :data:`DOC_SHARES` of ``seqlen``, each a multiple
    of 2W (every varlen implementation takes them), the last one filling the row."""
    m = 2 * world_size
    docs = [max(m, round(seqlen * s / 16 / m) * m) for s in DOC_SHARES[:-1]]
    return [*docs, seqlen - sum(docs)]


def odd_documents(seqlen: int) -> list[int]:
    """Documents of odd lengths filling an even ``seqlen`` (129, 33, 255, 93 for 510)."""
    docs = [round(seqlen * s / 16) | 1 for s in DOC_SHARES[:-1]]
    return [*docs, seqlen - sum(docs)]


def base_columns(varlen: bool) -> list[str]:
    """The keys of the columns the base cell fills."""
    return ["packed" if varlen else "causal", BASE["dtype"], f"d{BASE['head_dim']}", "gqa"]


def cell_fields(variant, column: str, world_size: int, device: str) -> dict[str, Any] | str:
    """The case fields of one cell, or the reason no spec can express it (a missing case field).

    Args:
        variant: the ``Variant``.
        column: a key of :data:`COLUMNS`.
        world_size, device: where it runs.
    """
    seqlen = base_seqlen(device, world_size)
    out: dict[str, Any] = {**BASE, "variant": variant.name, "world_size": world_size, "device": device,
                           "seqlen": seqlen}
    packed, odd = variant.varlen, False
    if column in ("causal", "full", "window", "packed"):
        packed = column == "packed"
        out["causal"] = column != "full"
        if column == "window":
            if "window" not in fields.BY_NAME:
                return NO_WINDOW
            out["window"] = seqlen // 4
    elif column in ("bf16", "fp16", "fp32"):
        out["dtype"] = column
    elif column in ("d64", "d128", "d256"):
        out["head_dim"] = int(column[1:])
    elif column == "mla":
        if "head_dim_v" not in fields.BY_NAME:
            return NO_HEAD_DIM_V
        out["head_dim"], out["head_dim_v"] = MLA_HEAD_DIMS
    elif column in ("mha", "gqa", "mqa"):
        out["kv_heads"] = {"mha": out["heads"], "gqa": out["heads"] // 4, "mqa": 1}[column]
    elif column == "odd":
        odd = True
        out["seqlen"] = odd_seqlen(seqlen, world_size)
    else:
        raise ValueError(f"column {column!r} is not one of {', '.join(_BY_KEY)}")
    if packed:
        docs = odd_documents(out["seqlen"]) if odd else documents(out["seqlen"], world_size)
        out["docs"] = ",".join(map(str, docs))
    return out


def default_world_sizes(device: str, visible_gpus: int) -> list[int]:
    """2 and 4 on CPU; on CUDA 2, 4 and 8 up to the visible GPUs (1 on a single GPU)."""
    if device == "cpu":
        return [2, 4]
    return [w for w in (2, 4, 8) if w <= visible_gpus] or [1]


def implementations(variants: Optional[list[str]] = None) -> list[str]:
    """The rows: ``variants`` as given, else ringbench's variants, then the peers, then (under
    ``RINGBENCH_TEST_VARIANTS=1``) the test variants of :data:`TEST_VARIANTS`.

    Raises:
        SpecError: an unknown variant, or one named twice.
    """
    from ringbench.variants import VARIANTS, testing_variants_enabled

    if variants:
        for name in variants:
            fields.check("variant", name)
        twice = [n for i, n in enumerate(variants) if n in variants[:i]]
        if twice:
            raise SpecError(f"variant {twice[0]!r} is given twice; pass each --variant once")
        return list(variants)
    names = [n for n, v in VARIANTS.items() if not v.peer] + [n for n, v in VARIANTS.items() if v.peer]
    if testing_variants_enabled():
        names += list(TEST_VARIANTS)
    return names


def build_grid(*, device: Optional[str] = None, world_sizes: Optional[list[int]] = None,
               variants: Optional[list[str]] = None, axes: Optional[list[str]] = None) -> Grid:
    """Every cell of the matrix, each built and checked as the CLI builds one case.

    A cell the spec refuses keeps the refusal's sentence (and, where a spec can express it, the
    spec for its skipped record); none is launched here.

    Args:
        device: ``cpu`` or ``cuda``; default cuda when a GPU is visible, else cpu.
        world_sizes: default :func:`default_world_sizes`.
        variants: narrow the rows (default :func:`implementations`).
        axes: narrow the columns to those of these axes (default all of :data:`AXES`).

    Raises:
        SpecError: a bad device, world size, variant or axis (one sentence).
    """
    from ringbench.spec import detect_device
    from ringbench.variants import get_variant

    if device is not None:
        fields.check("device", device)
    for w in world_sizes or []:
        fields.check("world_size", w)
    for axis in axes or []:
        if axis not in AXES:
            raise SpecError(f"axis {axis!r} is unknown; pass --axis with one of {', '.join(AXES)}")
    names = implementations(variants)
    machine, gpus = detect_device()
    device = device or machine
    if device == "cuda" and gpus < 1:
        raise SpecError("device cuda needs a visible GPU and none is visible; run on a GPU machine or pass "
                        "--device cpu")
    sizes = list(dict.fromkeys(world_sizes)) if world_sizes else default_world_sizes(device, gpus)
    if device == "cuda" and max(sizes) > gpus:
        raise SpecError(f"world_size {max(sizes)} exceeds the {gpus} visible GPUs; pass --world-size {gpus} or "
                        "fewer")
    grid = Grid(device, sizes, names, [c for c in COLUMNS if not axes or c.axis in axes])
    for world_size in sizes:
        for name in names:
            variant = get_variant(name)
            only = base_columns(variant.varlen) if TEST_VARIANTS.get(name) == "base" else None
            by_id: dict[str, Cell] = {}
            for column in grid.columns:
                if only is not None and column.key not in only:
                    continue
                cell = _make_cell(variant, column.key, world_size, device, gpus)
                same = by_id.get(cell.case_id) if cell.case is not None else None
                if same is not None:
                    same.columns.append(column.key)
                    continue
                if cell.case is not None:
                    by_id[cell.case_id] = cell
                grid.cells.append(cell)
    return grid


def _make_cell(variant, column: str, world_size: int, device: str, gpus: int) -> Cell:
    from ringbench.sweep import build_cases

    cell = Cell(variant.name, world_size, [column])
    given = cell_fields(variant, column, world_size, device)
    if isinstance(given, str):
        cell.refusal = given
        return cell
    try:
        cell.case = build_cases("verify", None, given)[0][0]
    except SpecError as exc:  # Unavailable too: a peer whose library is missing
        cell.refusal = str(exc)
        cell.case = _refused_spec(given, device, gpus)
    return cell


def _refused_spec(given: dict[str, Any], device: str, gpus: int):
    """The spec of a refused cell, for its skipped record; ``None`` when no spec can hold it."""
    from ringbench.spec import CaseSpec, canonical, default_fields, resolve_docs

    try:
        return canonical(resolve_docs(CaseSpec.from_dict({"task": "verify", **default_fields(device, gpus),
                                                          **given})))
    except (SpecError, ValueError):
        return None


# --------------------------------------------------------------------------- running it

def run(grid: Grid, *, out: Path, timeout_s: Optional[float] = None, resume: bool = False, launcher=None,
        err=None) -> int:
    """Verify every cell the spec accepts, record the refused ones, and classify every cell.

    The launched cells go to ``sweep.run_sweep`` (its watchdog, one launch per world size, its
    records in ``OUT/verify.jsonl``), the refused ones as its ``skipped`` cases; the variants of
    :data:`_LAUNCH_APART` go to a second sweep of their own. With ``resume``, the sweep's resume
    reuses every ok record, and the matrix reuses a cell's latest mismatch, error, oom or
    timeout record too (a result, not a case left over), and a skipped record that gives the
    same reason; only cells without a record are launched.

    Returns:
        0 once every cell is classified; else the sweep's exit code, and the cells stay
        unclassified: 130 or 143 when it was interrupted, 2 when it refused to start (it printed
        why).
    """
    from rich.console import Console

    from ringbench import records, results, sweep

    err = err or Console(stderr=True, soft_wrap=True)
    earlier: dict[str, dict] = {}
    if resume:
        for record in results.read_records(sweep.results_file(out, "verify")):
            if record.get("case_id"):
                earlier[record["case_id"]] = record  # the latest of each case
    cases, skipped, reused = [], {}, {}
    for cell in grid.cells:
        if cell.case is None:
            continue
        old = earlier.get(cell.case_id)
        if cell.refusal is not None:
            if old is not None and old.get("status") == "skipped" and old.get("reason") == cell.refusal:
                reused[cell.case_id] = old
            else:
                cases.append(cell.case)
                skipped[cell.case_id] = cell.refusal
        elif old is not None and old.get("status") != "skipped" and not records.is_done(old):
            reused[cell.case_id] = old
        else:
            cases.append(cell.case)  # the sweep's --resume reuses an ok record
    if reused:
        err.print(f"--resume: {plural(len(reused), 'cell')} keep their earlier record (a mismatch, error, oom, "
                  f"timeout or refusal is a result); drop --resume to verify them again", style="dim", markup=False)
    found = dict(reused)
    order = {c.case_id(): i for i, c in enumerate(cases)}
    apart = sorted((c for c in cases if c.variant in _LAUNCH_APART),
                   key=lambda c: (c.world_size, _LAUNCH_APART[c.variant], order[c.case_id()]))
    regular = [c for c in cases if c.variant not in _LAUNCH_APART]
    for part in (regular, apart) if apart else (regular,):
        ids = {c.case_id() for c in part}
        outcome = sweep.run_sweep(part, task="verify", out=out, timeout_s=timeout_s, resume=resume,
                                  skipped={k: v for k, v in skipped.items() if k in ids}, launcher=launcher)
        if outcome.exit_code >= 128 or (part and not outcome.records):
            return outcome.exit_code or 3  # interrupted, or refused before it started (it said why)
        found.update((r["case_id"], r) for r in outcome.records)
    for cell in grid.cells:
        cell.record = found.get(cell.case_id) if cell.case is not None else None
        if cell.record is not None:
            cell.klass, cell.reason, cell.worst = classify(cell.record)
        elif cell.refusal is not None:
            cell.klass, cell.reason, cell.worst = "unsupported", cell.refusal, None
        else:  # not expected: the sweep gives every case a record
            cell.klass, cell.reason, cell.worst = "error", "the sweep left no record of this cell", None
    return 0


# --------------------------------------------------------------------------- classes

_RANK_PREFIX = re.compile(r"^\[rank \d+/\d+\] (?:out of memory: [^;]*; )?")


def _ratio(value: Any, finite: Any = True) -> float:
    """A check's ratio as a float: not a number, NaN or a non-finite tensor count as inf."""
    if not isinstance(value, (int, float)) or value != value or finite is False:
        return math.inf
    return float(value)


def _worst(checks: list[dict], *, failing: bool = False) -> Optional[dict]:
    """The check with the largest error over its allowance: ``{"tensor", "ratio", "rule"}``.

    ``rule`` is ``max`` (verify's max rule, ``ratio``) or, among ``failing`` checks, ``blocks``
    where the block-decomposition rule (``shadow_ratio``) is the one the check failed by more.
    """
    def excess(c: dict) -> tuple[float, str]:
        top = (_ratio(c.get("ratio"), c.get("finite", True)), "max")
        if failing and c.get("shadow_passed") is False:
            top = max(top, (_ratio(c.get("shadow_ratio")), "blocks"))
        return top

    if not checks:
        return None
    best = max(checks, key=excess)
    ratio, rule = excess(best)
    return {"tensor": best.get("tensor"), "ratio": ratio, "rule": rule}


def classify(record: dict) -> tuple[str, Optional[str], Optional[dict]]:
    """A cell's class from its record: ``(class, reason, worst)``.

    - ``skipped``: unsupported, with the refusal.
    - ``oom`` and ``timeout``: themselves, with the record's reason.
    - ``error``: a peer (``Variant.peer``) whose rank raised an exception is unsupported, with
      that exception's own text (``RuntimeError: FlashAttention only supports ...``); anything
      else (ringbench's variants, a crashed launch) is an error.
    - ``ok`` with every check passed: correct; worst is the check nearest its allowance.
    - otherwise (``fail``): mismatch, worst the failing check with the largest ratio; a failure
      without a failing tensor (context parallelism not active) keeps the record's reason.
    """
    from ringbench import records
    from ringbench.variants import VARIANTS

    status, reason = record.get("status"), record.get("reason")
    if status == "skipped":
        return "unsupported", reason, None
    if status in ("oom", "timeout"):
        return status, reason, None
    if status == "error":
        variant = VARIANTS.get((record.get("spec") or {}).get("variant"))
        first = (reason or "").splitlines()[0] if reason else ""
        if variant is not None and variant.peer and _RANK_PREFIX.match(first):
            return "unsupported", _RANK_PREFIX.sub("", first), None
        return "error", reason, None
    checks = record.get("checks") or []
    if status == "ok" and checks and all(records.check_passed(c) for c in checks):
        return "correct", None, _worst(checks)
    if status == "ok" and not checks:
        return "error", "the verify record holds no checks", None
    failing = [c for c in checks if not records.check_passed(c)]
    if failing:
        worst = _worst(failing, failing=True)
        return "mismatch", reason or f"{worst['tensor']} failed", worst
    return "mismatch", reason or "verify failed with every tensor within tolerance", _worst(checks)


# --------------------------------------------------------------------------- outputs

def cell_object(cell: Cell) -> dict[str, Any]:
    """One cell as ``--json`` prints it and ``matrix.jsonl`` holds it."""
    record = cell.record or {}
    return {
        "world_size": cell.world_size,
        "implementation": cell.implementation,
        "peer": _is_peer(cell.implementation),
        "columns": cell.columns,
        "class": cell.klass,
        "reason": cell.reason,
        "worst_tensor": (cell.worst or {}).get("tensor"),
        "worst_ratio": _json_number((cell.worst or {}).get("ratio")),
        "worst_rule": (cell.worst or {}).get("rule"),
        "status": record.get("status"),
        "kernel": record.get("kernel"),
        "notes": record.get("notes") or [],
        "case_id": cell.case_id,
        "spec": cell.case.to_dict() if cell.case is not None else None,
    }


def _json_number(value: Any) -> Any:
    """A ratio for strict JSON: inf as the string ``"inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _is_peer(name: str) -> bool:
    from ringbench.variants import VARIANTS

    return bool(getattr(VARIANTS.get(name), "peer", False))


def environment() -> dict[str, Any]:
    """The environment the title names: device, torch, git commit (``envinfo.collect``)."""
    from ringbench import envinfo

    try:
        return envinfo.collect()
    except Exception:  # the title is context; its failure must not cost the matrix
        return {}


def env_title(env: dict, device: str) -> str:
    """``cpu (x86_64, 2 cores) · torch 2.13.0+cpu · commit b9c0afe``."""
    if device == "cuda" and env.get("gpu_name"):
        where = f"{env.get('gpu_count') or 1} x {env['gpu_name']}"
    else:
        where = f"cpu ({env.get('cpu') or 'unknown'}, {os.cpu_count()} cores)"
    commit = env.get("git_commit") or "unknown"
    commit = commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
    return f"{where} · torch {env.get('torch', 'unknown')} · commit {commit}"


def base_text(device: str) -> str:
    """What the base cell is, in one sentence."""
    return (f"Base cell: causal, bf16, {BASE['heads']} query heads over {BASE['kv_heads']} K/V heads, head dim "
            f"{BASE['head_dim']}, {BASE_SEQLEN[device]} tokens (varlen implementations: packed into four "
            "documents); each column changes one thing from it.")


def cell_text(cell: Optional[Cell], *, short: bool = False) -> str:
    """How a cell reads: ``correct 0.50``, ``mismatch dq ×12``, ``unsupported``...; ``short``: the
    picture's text (``0.50``, ``dq ×12``, what an unsupported cell's refusal is about)."""
    if cell is None or cell.klass is None:
        return "" if short else "-"
    if cell.klass == "correct":
        ratio = ratio_text(cell.worst["ratio"]) if cell.worst else ""
        return ratio if short else f"correct {ratio}".strip()
    if cell.klass == "mismatch":
        ratio = (cell.worst or {}).get("ratio")
        what = f"{cell.worst['tensor']} ×{_times(ratio)}" if ratio is not None and ratio > 1 else "failed"
        if ratio is not None and ratio > 1 and cell.worst.get("rule") == "blocks":
            what += " blocks"  # over the block-decomposition rule's allowance, not the max rule's
        return what if short else f"mismatch {what}"
    if short:
        return refusal_topic(cell.reason) if cell.klass == "unsupported" else cell.klass
    return cell.klass


#: What an unsupported cell's refusal is about, by a phrase of its sentence (first match wins).
_TOPICS = (
    ("case field yet", "no field"),
    ("cannot run on", "device"),
    ("is unavailable here", "library"),
    ("takes no documents", "form"),
    ("attends packed documents", "form"),
    ("document ", "doc length"),
    ("non-causal", "mask"),
    ("causal attention", "mask"),
    ("is not supported by the", "dtype"),
    ("seqlen ", "length"),
    ("GQA", "GQA"),
    ("head_dim", "head dim"),
    ("dtype", "dtype"),
    ("kernel", "kernel"),
)


def refusal_topic(reason: Optional[str]) -> str:
    """A word or two for the picture on what a refusal is about (``length``, ``device``...);
    ``n/a`` when no phrase of :data:`_TOPICS` is in it (a peer's own exception)."""
    for phrase, topic in _TOPICS:
        if phrase in (reason or ""):
            return topic
    return "n/a"


def _times(ratio: float) -> str:
    """A ratio above 1, short: ``1.9``, ``12.3``, ``456``, ``8e4``."""
    if not math.isfinite(ratio):
        return "inf"
    if ratio < 1000:
        return f"{ratio:.1f}" if ratio < 100 else f"{ratio:.0f}"
    mantissa, exponent = f"{ratio:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _one_line(text: str) -> str:
    return " ".join((text or "").split())


def _first_line(text: str, limit: int = 400) -> str:
    """The first line of a reason (a traceback's follows it), at most ``limit`` characters."""
    line = _one_line((text or "").splitlines()[0] if text else "")
    return line if len(line) <= limit else line[:limit - 1] + "…"


def markdown(grid: Grid, env: dict) -> str:
    """The matrix as Markdown: per world size one table per axis (rows: implementations), then
    the numbered reasons of every cell that is not correct."""
    notes: dict[str, int] = {}

    def entry(cell: Optional[Cell]) -> str:
        text = cell_text(cell)
        if cell is not None and cell.klass not in (None, "correct") and cell.reason:
            text += f" [{notes.setdefault(_first_line(cell.reason), len(notes) + 1)}]"
        return text.replace("|", "\\|")

    lines = ["# ringbench matrix", "", env_title(env, grid.device), "",
             base_text(grid.device) + " One `ringbench verify` case per cell, against float64 attention; "
             "the classes:", "", "| class | means |", "|---|---|"]
    lines += [f"| {k} | {CLASS_MEANING[k]} |" for k in CLASSES]
    for world_size in grid.world_sizes:
        counts = ", ".join(f"{n} {k}" for k, n in grid.counts(world_size).items() if n)
        lines += ["", f"## W={world_size}", "", f"{plural(sum(grid.counts(world_size).values()), 'cell')}: {counts}."]
        for axis in grid.axes:
            cols = [c for c in grid.columns if c.axis == axis]
            lines += ["", f"### {axis}", "", "| implementation | " + " | ".join(c.label for c in cols) + " |",
                      "|---|" + "---|" * len(cols)]
            for name in grid.implementations:
                row = [entry(grid.cell(name, world_size, c.key)) for c in cols]
                lines.append(f"| {_row_label(name)} | " + " | ".join(row) + " |")
    ran = notes_by_text(grid)
    if ran:
        lines += ["", "How they ran, as their records say:", ""]
        lines += [f"- {', '.join(names)}: {note}" for note, names in ran.items()]
    if notes:
        lines += ["", "## Reasons", ""]
        lines += [f"{i}. {text.replace('|', '/')}" for text, i in notes.items()]
    return "\n".join(lines) + "\n"


def notes_by_text(grid: Grid) -> dict[str, list[str]]:
    """Each distinct note the records carry (how a peer ran: ``ring-flash-attn's flash-attn calls
    served by ringbench's cpu kernel``), with the implementations whose records carry it."""
    out: dict[str, list[str]] = {}
    for cell in grid.cells:
        for note in (cell.record or {}).get("notes") or []:
            names = out.setdefault(note, [])
            if cell.implementation not in names:
                names.append(cell.implementation)
    return out


def _row_label(name: str) -> str:
    if _is_peer(name):
        return f"{name} (peer)"
    if name in TEST_VARIANTS:
        return f"{name} (test)"
    return name


_COLOURS = {"correct": "#43a047", "mismatch": "#e53935", "unsupported": "#d7d7d7", "oom": "#8e24aa",
            "timeout": "#fb8c00", "error": "#263238"}
_DARK = ("mismatch", "oom", "error")


def plot(grid: Grid, env: dict, path: Path) -> None:
    """The heatmap: one panel per world size, rows implementations, columns :data:`COLUMNS`
    grouped by axis, colour the class; the text a correct cell's worst ratio, a mismatch's worst
    tensor and ratio. The environment is in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    rows, cols = grid.implementations, grid.columns
    cmap = ListedColormap([_COLOURS[k] for k in CLASSES]).with_extremes(bad="white")
    norm = BoundaryNorm(np.arange(len(CLASSES) + 1) - 0.5, len(CLASSES))
    caption = (base_text(grid.device) + "\nGreen: the worst tensor's error over verify's allowance (twice one "
               "device's error plus a rounding), so 0.50 is as close to float64 as one device; red: the worst tensor, "
               "×N its allowance.\nGrey: what the implementation's refusal is about (the sentences are in matrix.md). "
               "Blank: not in the grid (a test variant's other columns)."
               + "".join(f"\n{', '.join(names)}: {note}." for note, names in notes_by_text(grid).items()))
    width = max(10.0, 2.0 + 0.82 * len(cols))  # inches; the legend and the title need 10
    caption = "\n".join(textwrap.fill(line, int(width * 15)) for line in caption.splitlines())
    caption_h = 0.2 + 0.15 * (caption.count("\n") + 1)
    panel_h = 0.36 * len(rows) + 1.3
    height = panel_h * len(grid.world_sizes) + 0.6 + caption_h
    fig, axes = plt.subplots(len(grid.world_sizes), 1, squeeze=False, figsize=(width, height))
    for ax, world_size in zip(axes[:, 0], grid.world_sizes):
        data = np.full((len(rows), len(cols)), np.nan)
        for i, name in enumerate(rows):
            for j, col in enumerate(cols):
                cell = grid.cell(name, world_size, col.key)
                if cell is None or cell.klass is None:
                    continue
                data[i, j] = CLASSES.index(cell.klass)
                ax.text(j, i, cell_text(cell, short=True), ha="center", va="center", fontsize=7.5,
                        color="white" if cell.klass in _DARK else "#202020")
        ax.imshow(np.ma.masked_invalid(data), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(cols)), [c.label for c in cols], rotation=35, ha="right", fontsize=8.5)
        ax.set_yticks(range(len(rows)), [_row_label(n) for n in rows], fontsize=8.5)
        ax.set_xticks(np.arange(len(cols) + 1) - 0.5, minor=True)
        ax.set_yticks(np.arange(len(rows) + 1) - 0.5, minor=True)
        ax.grid(which="minor", color="white", linewidth=1.2)
        ax.tick_params(which="both", length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        start = 0
        for axis in grid.axes:
            n = sum(1 for c in cols if c.axis == axis)
            if start:
                ax.axvline(start - 0.5, color="white", linewidth=5)
            ax.annotate(axis, xy=(start + n / 2 - 0.5, 1), xycoords=("data", "axes fraction"), xytext=(0, 4),
                        textcoords="offset points", ha="center", va="bottom", fontsize=9, fontweight="bold")
            start += n
        counts = ", ".join(f"{n} {k}" for k, n in grid.counts(world_size).items() if n)
        ax.set_title(f"world size {world_size}   ({counts})", loc="left", fontsize=10, pad=20)
    fig.suptitle(f"ringbench matrix: {env_title(env, grid.device)}", fontsize=12, fontweight="bold", x=0.01,
                 ha="left")
    fig.text(0.01, 0.1 / height, caption, fontsize=8, ha="left", va="bottom")
    fig.legend(handles=[Patch(color=_COLOURS[k], label=k) for k in CLASSES], loc="upper right", ncol=len(CLASSES),
               fontsize=8.5, frameon=False, bbox_to_anchor=(0.99, 1.0))
    fig.tight_layout(rect=(0, caption_h / height, 1, 1 - 0.45 / height))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write(grid: Grid, out: Path, env: Optional[dict] = None) -> dict[str, Path]:
    """Write ``matrix.jsonl`` (one object per cell), ``matrix.md`` and ``matrix.png`` to ``out``."""
    env = environment() if env is None else env
    out.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": out / "matrix.jsonl", "md": out / "matrix.md", "png": out / "matrix.png"}
    paths["jsonl"].write_text("".join(json.dumps(cell_object(c)) + "\n" for c in grid.cells), encoding="utf-8")
    paths["md"].write_text(markdown(grid, env), encoding="utf-8")
    plot(grid, env, paths["png"])
    return paths


def print_summary(grid: Grid, console) -> None:
    """Per world size, the cells per class; then every cell that is not correct or unsupported."""
    from rich.text import Text

    for world_size in grid.world_sizes:
        counts = ", ".join(f"{n} {k}" for k, n in grid.counts(world_size).items() if n)
        console.print(Text(f"W={world_size}: {counts}"))
    for cell in grid.cells:
        if cell.klass in ("correct", "unsupported", None):
            continue
        where = ", ".join(_BY_KEY[k].label for k in cell.columns)
        line = f"  W={cell.world_size} {cell.implementation} ({where}): {cell_text(cell)}"
        if cell.klass != "mismatch" and cell.reason:
            line += f": {_first_line(cell.reason, 100)}"
        console.print(Text(line, style="red"))
