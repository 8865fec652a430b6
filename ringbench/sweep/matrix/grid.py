"""The matrix's grid: the implementations, the columns around one base cell, and each cell's case fields."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ringbench.case import fields
from ringbench.errors import SpecError
from ringbench.variants import LAYOUT_CHUNKS, OPTIONS

#: The classes a cell can end in, in the order legends list them.
CLASSES = ("correct", "mismatch", "unsupported", "oom", "timeout", "error")
#: What each class means (docs/matrix.md, the Markdown and ``--help`` say the same).
CLASS_MEANING = {
    "correct": "every check passed: out, lse, dq, dk and dv within verify's tolerance of float64 attention, "
               "and dsink with a learnable sink within it of the gradient the variant's own out and lse imply; "
               "the number is the worst tensor's error over its allowance",
    "mismatch": "a check failed; the cell names the worst tensor and its error over its allowance (×12: twelve "
                "times what is allowed)",
    "unsupported": "the implementation refuses the cell, in its own words (a spec's refusal, a missing library, "
                   "a peer's own exception); never launched, unless a peer raised",
    "oom": "out of memory on some rank",
    "timeout": "the launch passed its watchdog (--timeout)",
    "error": "the implementation raised, or its launch crashed",
}

#: The base cell's global tokens per device (at least 64 per rank at larger world sizes, and a
#: multiple of 2W: :func:`base_seqlen`).
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

@dataclass(frozen=True)
class Column:
    """One column of the matrix: the base cell with one thing changed.

    Attributes:
        axis: ``mask``, ``dtype``, ``shape``, ``sink`` or ``padding``.
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
    Column("mask", "two_sided", "two-sided window"),
    Column("mask", "prefix", "prefix-LM"),
    Column("mask", "shared_prefix", "shared prompt"),
    Column("mask", "chunked", "chunked"),
    Column("mask", "global", "global + window"),
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
    Column("sink", "learnable", "learnable sink"),
    Column("sink", "off_by_one", "off-by-one"),
    Column("padding", "padded", "padded docs"),
)
AXES = ("mask", "dtype", "shape", "sink", "padding")
_BY_KEY = {c.key: c for c in COLUMNS}

@dataclass
class Cell:
    """One cell: an implementation at a world size, under the columns that share its case.

    Attributes:
        implementation: the variant's name.
        world_size: ranks.
        columns: keys of the columns it fills (the base cell fills four).
        case: its ``CaseSpec`` (resolved when it runs; as given when refused), or ``None`` when no
            spec can hold it.
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
    """The base cell's tokens: :data:`BASE_SEQLEN`, at least 64 per rank, rounded up to a multiple
    of 2W, which every layout can cut (zigzag's two chunks per rank), so that no cell at a world
    size such as 3 is refused for a seqlen that ``matrix`` gives the user no option to change."""
    multiple = max(LAYOUT_CHUNKS.values()) * world_size
    return -(-max(BASE_SEQLEN[device], 64 * world_size) // multiple) * multiple


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


def padded_documents(seqlen: int, world_size: int) -> tuple[list[int], int]:
    """The padded column's real document lengths and ``doc_pad``: the base documents 3 tokens
    short each, padded to the first multiple of 2W from 8 up (8 at W=2 and 4, 12 at W=3), so
    every varlen implementation takes it."""
    return [d - 3 for d in documents(seqlen, world_size)], -(-8 // (2 * world_size)) * 2 * world_size


#: The columns of the named masks of ``--mask`` (docs/masks.md), each a ``(seqlen) -> mask`` text.
MASK_COLUMNS = {
    "two_sided": lambda s: f"window:{s // 8},{s // 8}",
    "prefix": lambda s: f"prefix:{s // 4}",
    # Three answers after the prompt, the prompt taking what three equal answers leave of the row.
    "shared_prefix": lambda s: f"shared-prefix:{s - (3 * s // 4) // 3 * 3},answers=3",
    "chunked": lambda s: f"chunked:{s // 4}",
    "global": lambda s: f"global:{max(4, s // 64)},window:{s // 4}",
}


def document_mask(column: str, docs: list[int], seqlen: int) -> str:
    """A mask column's text for a varlen implementation, applied inside each of ``docs``
    (``masks.documents``): the column's own (:data:`MASK_COLUMNS` at ``seqlen``), but for the
    shared prompt, whose three answers must split every document longer than the prompt evenly:
    the shortest prompt from a quarter of the longest document on that does (the documents it
    covers are causal), else the column's own, which the spec then refuses in its sentence."""
    text = MASK_COLUMNS[column](seqlen)
    if column != "shared_prefix":
        return text
    from ringbench.variants.engines import masks

    for p in range(max(1, max(docs) // 4), max(docs) - 2):
        candidate = f"shared-prefix:{p},answers=3"
        if masks.document_rule(candidate, docs) is None:
            return candidate
    return text


def base_columns(varlen: bool) -> list[str]:
    """The keys of the columns the base cell fills."""
    return ["packed" if varlen else "causal", BASE["dtype"], f"d{BASE['head_dim']}", "gqa"]


def cell_fields(variant, column: str, world_size: int, device: str) -> dict[str, Any]:
    """The case fields of one cell.

    Args:
        variant: the ``Variant``.
        column: a key of :data:`COLUMNS`.
        world_size, device: where it runs.
    """
    seqlen = base_seqlen(device, world_size)
    out: dict[str, Any] = {**BASE, "variant": variant.name, "world_size": world_size, "device": device,
                           "seqlen": seqlen}
    # A varlen implementation runs every column with documents (its causal column is its packed one).
    packed, odd = variant.varlen, False
    if column in ("causal", "full", "window", "packed"):
        packed = column == "packed" or variant.varlen
        out["causal"] = column != "full"
        if column == "window":
            out["window"] = seqlen // 4
    elif column in MASK_COLUMNS:  # the mask alone decides, as records of masked cases say (causal false)
        out["mask"], out["causal"] = MASK_COLUMNS[column](seqlen), False
    elif column in ("bf16", "fp16", "fp32"):
        out["dtype"] = column
    elif column in ("d64", "d128", "d256"):
        out["head_dim"] = int(column[1:])
    elif column == "mla":
        out["head_dim"], out["head_dim_v"] = MLA_HEAD_DIMS
    elif column in ("mha", "gqa", "mqa"):
        out["kv_heads"] = {"mha": out["heads"], "gqa": out["heads"] // 4, "mqa": 1}[column]
    elif column == "odd":
        odd = True
        out["seqlen"] = odd_seqlen(seqlen, world_size)
    elif column in ("learnable", "off_by_one"):
        out["sink"] = column.replace("_", "-")
    elif column == "padded":
        real, pad = padded_documents(seqlen, world_size)
        return {**out, "docs": ",".join(map(str, real)), "doc_pad": pad,
                "seqlen": sum(-(-d // pad) * pad for d in real)}
    else:
        raise ValueError(f"column {column!r} is not one of {', '.join(_BY_KEY)}")
    if packed:
        docs = odd_documents(out["seqlen"]) if odd else documents(out["seqlen"], world_size)
        out["docs"] = ",".join(map(str, docs))
        if column in MASK_COLUMNS:  # applied inside each document
            out["mask"] = document_mask(column, docs, out["seqlen"])
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
    from ringbench.case.spec import detect_device
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


def check_runnable(grid: Grid) -> None:
    """Refuse a grid whose every cell is refused: it would launch nothing and verify nothing.

    Raises:
        SpecError: names the cells and the commonest refusal, which carries its fix.
    """
    if not grid.cells or any(c.refusal is None for c in grid.cells):
        return
    reasons: dict[str, int] = {}
    for cell in grid.cells:
        reasons[cell.refusal] = reasons.get(cell.refusal, 0) + 1
    reason, n = max(reasons.items(), key=lambda item: item[1])
    reason = matrix_fix(reason)
    total = len(grid.cells)
    if total == 1:
        raise SpecError(f"nothing to verify: the one cell of this matrix is refused on {grid.device} because {reason}")
    some = "all of them" if n == total else f"{n} of them"
    raise SpecError(f"nothing to verify: every one of the {total} cells of this matrix is refused on {grid.device}, "
                    f"{some} because {reason}")


#: The options of ``ringbench matrix`` that change its cells: a fix may name only these.
MATRIX_OPTIONS = ("--device", "--world-size", "--variant", "--axis")


def matrix_fix(reason: str) -> str:
    """A cell's refusal with the fix that ``matrix`` can take: of the alternatives after its last
    ``; `` (``pass a --world-size that divides 8, such as 2, or --heads a multiple of 3``), those
    that name only :data:`MATRIX_OPTIONS`; where none does, another world size or variant.
    The spec's sentence offers run's and verify's options, and matrix has no ``--heads``."""
    rule, sep, fix = reason.rpartition("; ")
    named = re.findall(r"--[\w-]+", fix)
    if not sep or all(option in MATRIX_OPTIONS for option in named):
        return reason
    verb = fix.split(" ", 1)[0]
    kept = [a for a in re.split(r",? or ", fix) if all(o in MATRIX_OPTIONS for o in re.findall(r"--[\w-]+", a))
            and re.search(r"--[\w-]+", a)]
    if not kept:
        return f"{rule}; pass another --world-size or --variant"
    return f"{rule}; " + " or ".join(a if a.startswith(verb + " ") else f"{verb} {a}" for a in kept)


def _make_cell(variant, column: str, world_size: int, device: str, gpus: int) -> Cell:
    from ringbench.sweep.build import build_cases

    cell = Cell(variant.name, world_size, [column])
    given = cell_fields(variant, column, world_size, device)
    # An option the variant does not declare (a window, a sink) is refused by its declaration,
    # in the sentence the spec's check would give, without building the case.
    cell.refusal = next((r for name in OPTIONS if name in given
                         for r in [variant.option_refusal(name, given[name])] if r), None)
    if cell.refusal:
        cell.case = _refused_spec(given, device, gpus)
        return cell
    try:
        cell.case = build_cases("verify", None, given)[0][0]
    except SpecError as exc:  # Unavailable too: a peer whose library is missing
        cell.refusal = str(exc)
        cell.case = _refused_spec(given, device, gpus)
    return cell


def _refused_spec(given: dict[str, Any], device: str, gpus: int):
    """The spec of a refused cell, for its skipped record; ``None`` when no spec can hold it."""
    from ringbench.case.spec import CaseSpec, canonical, default_fields, resolve_docs

    try:
        return canonical(resolve_docs(CaseSpec.from_dict({"task": "verify", **default_fields(device, gpus),
                                                          **given})))
    except (SpecError, ValueError):
        return None


