"""The case fields: :class:`CaseSpec`, whose every attribute carries its :class:`Field` row, the
single home of everything a case field needs.

A row gives the field's help text with its units, how text becomes a value (``128k``), its
default on each device, how a table labels it, whether it is part of ``case_id``, which commands
take it as an option, and its own check; its name and type are the attribute's. Whether it is a
variant option (and which variants take it) is the variants' declaration (``Variant.options``).
Generated from the rows (:data:`FIELDS`, read from ``dataclasses.fields(CaseSpec)``):

- the ``run`` and ``verify`` options (``ringbench.case.options``), each parsed by its type;
- scenario key validation, the variant options, table labels and the error-growth grouping
  key (every case field but the world size);
- the field table of ``docs/contracts.md`` (:func:`markdown_table`, kept equal by a test).

Adding a case field is one attribute here plus its check. Torch-free: a bad value is refused in
milliseconds, before any process starts.
"""

import dataclasses
import hashlib
import json
import math
import re
import typing
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping

from ringbench.case.types import ValueType, whole
from ringbench.errors import SpecError
from ringbench.variants import MAX_SEQLEN, OPTIONS, ROTATE, VARIANTS, get_variant, listed
from ringbench.variants.rules import BIAS_KINDS, BIAS_SHAPES
from ringbench.variants.engines import masks

#: Short dtype names users type, mapped to the ``torch`` attribute they mean.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
#: ``fwd`` times the forward pass; ``fwd_bwd`` the forward and backward pass.
MODES = ("fwd", "fwd_bwd")
TASKS = ("run", "verify")
DEVICES = ("cuda", "cpu")
#: The most hosts a job may span (``--nnodes``).
MAX_NODES = 4096
#: The most ranks a case may have: :data:`MAX_NODES` hosts of 16 ranks (GPUs) each.
MAX_WORLD_SIZE = 16 * MAX_NODES
#: ``sink``: a learnable logit per query head, the off-by-one softmax (0, fixed), or none.
SINKS = ("none", "learnable", "off-by-one")
#: The cuda default of ``world_size``: every visible GPU.
VISIBLE_GPUS = "every visible GPU"

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_SIZE_RE = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)([kKmM]?)")


# --------------------------------------------------------------------------- value parsers

def parse_size(text: str, *, name: str = "seqlen") -> int:
    """Parse a token count such as ``4096``, ``128k`` (131072) or ``1M`` (1048576).

    Args:
        text: digits with an optional ``k`` (x1024) or ``M`` (x1024**2) suffix, either case;
            a decimal such as ``1.5k`` is accepted when it gives a whole count.
        name: the field named in error messages.

    Returns:
        The count in tokens, 1 to :data:`MAX_SEQLEN`.

    Raises:
        SpecError: not a number, not whole, zero or negative, or above :data:`MAX_SEQLEN`.
    """
    raw = str(text).strip()
    match = _SIZE_RE.fullmatch(raw)
    if match is None:
        raise SpecError(f"{name} {raw!r} is not a size; use a whole number with an optional k or M "
                        "suffix, such as 4096 or 128k")
    sign, number, suffix = match.groups()
    value = Fraction(number) * _SUFFIX[suffix.lower()]
    if sign == "-":
        value = -value
    if value.denominator != 1:
        raise SpecError(f"{name} {raw!r} is {float(value):g} tokens, not a whole number; "
                        "use a whole count such as 4096 or 128k")
    count = int(value)
    if count <= 0:
        raise SpecError(f"{name} {raw!r} must be positive; use a size such as 4096 or 128k")
    if count > MAX_SEQLEN:
        raise SpecError(f"{name} {raw!r} is {count} tokens, above the limit of {MAX_SEQLEN} (1024M); "
                        "use a smaller size")
    return count


def format_size(count: int) -> str:
    """Write a token count the short way ``parse_size`` reads: 131072 -> ``128k``."""
    for suffix, unit in (("M", 1024**2), ("k", 1024)):
        if count % unit == 0 and count >= unit:
            return f"{count // unit}{suffix}"
    return str(count)


_DIST_KEYS = {"lognormal": ("mean", "sigma"), "uniform": ("min", "max")}
_DIST_EXAMPLE = "lognormal:mean=4k,sigma=1 or uniform:min=512,max=8k"


def parse_docs(text: str) -> list[int]:
    """Parse document lengths such as ``3000,500,12k`` into ints (``[3000, 500, 12288]``).

    Args:
        text: comma-separated sizes as :func:`parse_size` reads them, or ``0`` (``0k``...) for
            an empty document; spaces around entries are ignored.

    Returns:
        The lengths in tokens, in row order.

    Raises:
        SpecError: an empty list or entry, a negative length, or an entry that is not a size;
            the message names the document by its 1-based position (``document 2``).
    """
    entries = [e.strip() for e in str(text).split(",")]
    if not any(entries):
        raise SpecError(f"docs {text!r} is empty; pass document lengths separated by commas, such as 3000,500,12k")
    docs = []
    for i, entry in enumerate(entries):
        if entry == "":
            raise SpecError(f"docs {text!r} has no length for document {i + 1}; separate lengths by single "
                            "commas, such as 3000,500,12k")
        match = _SIZE_RE.fullmatch(entry)
        if match is not None and Fraction(match.group(2)) == 0:
            docs.append(0)  # an empty document
        elif match is not None and match.group(1) == "-":
            raise SpecError(f"document {i + 1} {entry!r} must be 0 or more tokens; pass lengths such as "
                            "3000,0,12k")
        else:
            docs.append(parse_size(entry, name=f"document {i + 1}"))
    return docs


def parse_doc_dist(text: str) -> tuple[str, dict[str, float]]:
    """Parse a document distribution such as ``lognormal:mean=4k,sigma=1``.

    Args:
        text: ``lognormal:mean=M,sigma=S`` (M a size: the mean document length in tokens; S
            the sigma of the length's logarithm, 0 to 10) or ``uniform:min=A,max=B`` (sizes,
            ``A <= B``, both ends included).

    Returns:
        ``(kind, params)`` with the sizes in tokens and sigma as a float.

    Raises:
        SpecError: an unknown kind, a missing or unknown parameter, or a bad value.
    """
    raw = str(text).strip()
    kind, sep, rest = raw.partition(":")
    if not sep or kind not in _DIST_KEYS:
        raise SpecError(f"doc_dist {raw!r} is not a document distribution; use {_DIST_EXAMPLE}")
    params: dict[str, float] = {}
    for item in rest.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in _DIST_KEYS[kind] or key in params:
            raise SpecError(f"doc_dist {raw!r}: {item.strip()!r} is not one of {kind}'s parameters "
                            f"{' and '.join(_DIST_KEYS[kind])}, each given once; use {_DIST_EXAMPLE}")
        if key == "sigma":
            try:
                sigma = float(value)
            except ValueError:
                sigma = float("nan")
            if not (math.isfinite(sigma) and 0 <= sigma <= 10):
                raise SpecError(f"doc_dist {raw!r}: sigma {value!r} must be a number from 0 to 10; use sigma=1")
            params[key] = sigma
        else:
            params[key] = parse_size(value, name=f"doc_dist {key}")
    missing = [k for k in _DIST_KEYS[kind] if k not in params]
    if missing:
        raise SpecError(f"doc_dist {raw!r} lacks {missing[0]}; use {_DIST_EXAMPLE}")
    if kind == "uniform" and params["min"] > params["max"]:
        raise SpecError(f"doc_dist {raw!r}: min {int(params['min'])} is above max {int(params['max'])}; swap them")
    return kind, params


#: ``ulysses_degree`` auto: one case per factorization of the world size (``sweep`` expands it).
AUTO_DEGREE = -1


def parse_ulysses_degree(text: str) -> int:
    """Parse ``--ulysses-degree``: a whole number, or ``auto`` (:data:`AUTO_DEGREE`).

    Raises:
        SpecError: neither.
    """
    raw = str(text).strip().lower()
    if raw == "auto":
        return AUTO_DEGREE
    try:
        degree = int(raw)
    except ValueError:
        raise SpecError(f"ulysses_degree {text!r} is neither a whole number nor auto; pass --ulysses-degree 2 "
                        "or --ulysses-degree auto") from None
    if degree < 0:  # AUTO_DEGREE is auto's value, not a degree to type
        _refuse_ulysses_degree(degree)
    return degree


def _refuse_ulysses_degree(value: int) -> None:
    raise SpecError(f"ulysses_degree {value} is negative; pass --ulysses-degree with a positive divisor of the "
                    "world size, 0 for the largest the heads allow, or auto")


def _check_ulysses_degree(name: str, value: int) -> None:
    if value < AUTO_DEGREE:
        _refuse_ulysses_degree(value)


# --------------------------------------------------------------------------- checks of one value

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _one_of(choices: Callable[[], tuple[str, ...]]) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value not in choices():
            raise SpecError(f"{name} {value!r} is unknown; pass {_flag(name)} with one of {', '.join(choices())}")
    return check


def _at_least(low: int) -> Callable[[str, Any], None]:
    def check(name: str, value: int) -> None:
        if value < low:
            word = "positive" if low == 1 else "zero or more"
            raise SpecError(f"{name} {value} must be {word}; pass {_flag(name)} {low} or more")
    return check


def _check_variant(name: str, value: str) -> None:
    try:
        get_variant(value)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def _check_kernel_name(name: str, value: str) -> None:
    if not value:
        raise SpecError("kernel '' is empty; pass --kernel with a kernel name or auto")


def _check_seqlen(name: str, value: int) -> None:
    if value > MAX_SEQLEN:
        raise SpecError(f"seqlen {value} is above the limit of {MAX_SEQLEN} tokens; use a smaller size")
    _at_least(1)(name, value)


def _if_set(check: Callable[[str, Any], Any]) -> Callable[[str, Any], None]:
    """A check of a text field that ``""`` (unset) passes."""
    def run(name: str, value: Any) -> None:
        if value:
            check(name, value)
    return run


def _check_bias(name: str, value: str) -> None:
    if value not in BIAS_KINDS:
        raise SpecError(f"{name} {value!r} is not one ringbench takes: alibi, or a learnable tensor of one of "
                        f"TransformerEngine's post-scale shapes {listed(BIAS_SHAPES, 'or')} (b batch, h heads, s seqlen, "
                        f"1 broadcast); pass {_flag(name)} with one of them")


def _rotations() -> tuple[str, ...]:
    return ROTATE


def _check_window(name: str, value: int) -> None:
    if value < 0:
        raise SpecError(f"window {value} must be positive: the keys each query sees, itself included; pass "
                        "--window 4k, or leave it out for none")


def takers(option: str) -> list[str]:
    """The variants that declare ``option`` (``Variant.options``), in registry order."""
    return [n for n, v in VARIANTS.items() if option in v.options]


def _taken_by(name: str) -> str:
    """The help's generated ``; taken by: a, b and c`` of a variant option, else ``""``."""
    if name not in OPTIONS:
        return ""
    found = takers(name)
    return "; taken by: " + listed(found)


def _check_model(name: str, value: str) -> None:
    from ringbench.case.models import load_model

    load_model(value)


# --------------------------------------------------------------------------- the table

#: The metadata key of a CaseSpec attribute's :class:`Field` row.
ROW = "row"
_SIZE = {name: ValueType("TOKENS", lambda text, name=name: parse_size(text, name=name)) for name in ("seqlen", "window")}
#: ``--ulysses-degree``: a whole number or ``auto``.
ULYSSES_DEGREE = ValueType("INT|auto", lambda text: parse_ulysses_degree(text))


def parse_mask(text: str) -> str:
    """``--mask``'s text as its canonical form (``engines/masks.py``: ``window:64,0`` is ``window:64``);
    ``""`` (no mask) stays ``""``.

    Raises:
        SpecError: an unknown family or a malformed parameter, naming the value and the families.
    """
    if not str(text).strip():
        return ""
    try:
        return masks.parse(text)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def read_mask_file(path: str) -> str:
    """A ``--mask-file``'s slices, read once where the option enters, as the ``slices:`` text the
    ``mask`` field holds (so a record carries the mask itself, and its case_id follows the slices,
    not the file's name).

    Raises:
        SpecError: the file cannot be read, or a line breaks the slices' rules.
    """
    try:
        return masks.read_file(path)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


#: The text of a field whose help says ``Default: none`` (--docs, --doc-dist, --bias): ``none`` is the
#: default itself, no value (``""``), so a user who writes what the help shows gets it.
NONE_IS_UNSET = ValueType("TEXT", lambda text: "" if text.strip().lower() == "none" else text)
#: ``--mask``: a family and its parameters; ``--mask-file``: a file of slices.
MASK = ValueType("NAME[:PARAMS]", parse_mask)
MASK_FILE = ValueType("FILE", read_mask_file)


@dataclass(frozen=True)
class Field:
    """One case field: the row a :class:`CaseSpec` attribute carries in its metadata.

    Attributes:
        name, type: the attribute's (filled in from ``CaseSpec``); ``type`` is ``int``, ``str``
            or ``bool``.
        help: what it is, with its units; the options' help adds the defaults. A variant
            option's help ends with the variants that take it (generated, ``; taken by: ...``).
        cuda, cpu: its default on each device (:data:`VISIBLE_GPUS` for cuda's world size);
            ``None``: no default (``task``, ``variant``: every case gives them).
        default_text: how the help states the default when the values alone would not say it.
        label: how a table or progress bar names a value, a format such as ``W={}``;
            ``None``: the value itself.
        in_case_id: part of ``case_id`` (iters, warmup, seed and min_time_ms are not: they do
            not change what is computed or measured, only how often and on which numbers;
            flush_l2 is, as a cold L2 is another measurement).
        optional: added after the first records were written: left out of ``case_id`` at its
            default, so the ids of older records stay what they were.
        commands: the commands that take it as an option.
        flag: the option's name; default ``--`` + name with dashes.
        parse: the type that reads its text (``seqlen``: a size such as ``128k``); ``None``: an
            int field reads a whole number, a text field takes the text.
        check: ``(name, value)`` -> None, raising SpecError: the field's own rule, alone.
        repeatable: the option may be given several times (one case per value).
        metavar: what its option's value is, as ``--help`` names it (``NAME``, ``cuda|cpu``);
            default: its type's name (``TOKENS``, ``INT``), none for a flag.
        file_option: a second option that gives the value from a file (``--mask-file``), read
            by ``file_parse`` into the field's own text where it enters; ``""``: none.
    """

    help: str
    cuda: Any = None
    cpu: Any = None
    default_text: str = ""
    label: str | None = None
    in_case_id: bool = True
    optional: bool = False
    commands: tuple[str, ...] = TASKS
    flag: str = ""
    parse: ValueType | None = None
    check: Callable[[str, Any], None] | None = None
    repeatable: bool = False
    metavar: str = ""
    file_option: str = ""
    file_parse: ValueType | None = None
    file_help: str = ""
    name: str = ""
    type: type = object

    @property
    def option(self) -> str:
        """The command-line option, such as ``--kv-heads``."""
        return self.flag or _flag(self.name)

    @property
    def default(self) -> Any:
        """The value a record written before this field existed holds (optional fields)."""
        return self.cpu

    @property
    def variant_option(self) -> bool:
        """Passed to the variant's ``attention`` as a keyword when set (``rules.OPTIONS``' keywords)."""
        return self.name in OPTIONS and OPTIONS[self.name].keyword

    @property
    def value_type(self) -> ValueType | None:
        """The type its option's text is parsed by where it enters (``None``: plain text or a flag)."""
        if self.parse is not None:
            return self.parse
        if self.type is int:
            return whole(self.name, self.option, self.cpu if isinstance(self.cpu, int) else 1)
        return None

    @property
    def value_name(self) -> str | None:
        """Its option's value as ``--help`` names it (:attr:`metavar`, else its type's name); None
        for a flag (``--causal``)."""
        if self.type is bool:
            return None
        return self.metavar or (self.value_type.name if self.value_type is not None else "TEXT")

    def default_help(self) -> str:
        """``Default: cuda 16k, cpu 4k.`` or ``Default: 1.``, from the row."""
        if self.default_text:
            return f"Default: {self.default_text}."
        show = (lambda v: format_size(v)) if self.name == "seqlen" else str
        if self.cuda == self.cpu:
            return f"Default: {show(self.cuda)}."
        return f"Default: cuda {self.cuda if self.cuda == VISIBLE_GPUS else show(self.cuda)}, cpu {show(self.cpu)}."

    def text(self, value: Any) -> str:
        """The value as a label names it: ``W=2``, ``16k``, ``non-causal``."""
        if self.name == "seqlen" and isinstance(value, int):
            value = format_size(value)
        if self.name == "causal":
            return "causal" if value else "non-causal"
        if self.name == "mask" and value:
            return f"mask={masks.label(value)}"
        return self.label.format(value) if self.label else str(value)


def row(help: str, cuda: Any = None, cpu: Any = None, **kw: Any) -> Any:
    """A :class:`CaseSpec` attribute carrying its :class:`Field` row; an optional one defaults
    to its cpu default (the value older records lack it at)."""
    field = Field(help, cuda, cpu, **kw)
    default = cpu if field.optional else dataclasses.MISSING
    return dataclasses.field(default=default, metadata={ROW: field})


_POSITIVE, _ZERO_OR_MORE = _at_least(1), _at_least(0)

#: ``--cuda-graph``'s values (``ringbench/rank/graphs.py``).
CUDA_GRAPH_CHOICES = ("auto", "on", "off")

#: Seeds run from 0 to 2^63 - 1: torch's generator takes a 64-bit integer, and the ranks' streams are
#: derived from the seed modulo 2^63 (``ringbench.rank.bench.rank_inputs``).
SEED_LIMIT = 2 ** 63


def _check_world_size(name: str, value: int) -> None:
    _POSITIVE(name, value)
    if value > MAX_WORLD_SIZE:
        raise SpecError(f"{name} {value} is above the limit of {MAX_WORLD_SIZE} ranks ({MAX_NODES} hosts of 16); "
                        f"pass {_flag(name)} {MAX_WORLD_SIZE} or fewer")


def _check_seed(name: str, value: int) -> None:
    _ZERO_OR_MORE(name, value)
    if value >= SEED_LIMIT:
        raise SpecError(f"{name} {value} must be below 2^63 = {SEED_LIMIT}, the seeds torch's generator takes; "
                        f"pass {_flag(name)} with a smaller value, such as 0")


@dataclass(frozen=True)
class CaseSpec:
    task: str = row("`run` (measure) or `verify` (compare against single-device attention)",
                    commands=(), check=_one_of(lambda: TASKS))
    variant: str = row("the context-parallel variant, a registry name (`ringbench variants` lists them and says "
                       "which can run here)", repeatable=True, check=_check_variant, metavar="NAME",
                       default_text="none; run needs one or --scenario, verify with neither checks the smoke scenario")
    kernel: str = row("the local attention kernel: flash-attn-4, flash-attn, torch-flash, cudnn, torch-efficient "
                      "(cuda), cpu, flex (FlexAttention, cuda and cpu), math (any device), or auto: the first one "
                      "available here that takes the dtype, head dims and form, flash-attn-4 first on CUDA (never auto once launched)", "auto", "auto",
                      repeatable=True, check=_check_kernel_name, metavar="NAME")
    device: str = row("run on cuda (NCCL, one GPU per rank) or cpu (gloo)",
                      default_text="cuda when a GPU is visible, else cpu; a scenario that names its device (smoke "
                                   "says cpu) keeps it unless this is given", check=_one_of(lambda: DEVICES),
                      metavar="|".join(DEVICES))
    world_size: int = row(f"ranks in the context-parallel group, one process each, 1 to {MAX_WORLD_SIZE}", VISIBLE_GPUS,
                          2, label="W={}", repeatable=True, check=_check_world_size)
    batch: int = row("sequences per batch (B); with --docs on a batch variant every row packs the same documents "
                     "(the varlen variants take 1)", 1, 1, label="B={}", check=_POSITIVE)
    seqlen: int = row("global tokens per sequence (S), split across the ranks; a whole number with an optional k "
                      "(x1024) or M (x1024^2) suffix, such as 4096, 128k or 1M", 16 * 1024, 4 * 1024,
                      parse=_SIZE["seqlen"], repeatable=True, check=_check_seqlen)
    heads: int = row("query heads (Hq)", 32, 4, label="H={}", check=_POSITIVE)
    kv_heads: int = row("key/value heads (Hkv); divides heads, fewer than heads is GQA", 8, 2, label="KV={}",
                        check=_POSITIVE)
    head_dim: int = row("channels per head (D)", 128, 32, label="D={}", check=_POSITIVE)
    dtype: str = row("input dtype: bf16, fp16, fp32 or fp64", "bf16", "fp32", check=_one_of(lambda: tuple(DTYPES)),
                     metavar="|".join(DTYPES))
    causal: bool = row("causal mask (--causal) or every key visible (--no-causal)", True, True,
                       default_text="causal", flag="--causal/--no-causal")
    mode: str = row("what one iteration times: fwd (forward) or fwd_bwd (forward and backward); verify always "
                    "checks both", "fwd_bwd", "fwd_bwd", commands=("run",), check=_one_of(lambda: MODES),
                    metavar="|".join(MODES))
    iters: int = row("timed iterations per case", 20, 10, in_case_id=False, commands=("run",), check=_POSITIVE)
    warmup: int = row("untimed warm-up iterations before timing (0 allowed)", 5, 3, in_case_id=False,
                      commands=("run",), check=_ZERO_OR_MORE)
    seed: int = row("seed of the random inputs (0 to 2^63 - 1)", 0, 0, in_case_id=False, check=_check_seed)
    head_dim_v: int = row("channels per value head (Dv) where they differ from head_dim, as in MLA (192/128); out "
                          "has Dv channels; 0: the same as head_dim. Only some kernels take it (flash-attn-4, flex, math)",
                          0, 0, default_text="head_dim", label="Dv={}", optional=True, check=_ZERO_OR_MORE)
    layout: str = row("the layout of the sequence over the ranks, for variants that take several (llama3: zigzag or "
                      "contiguous; llama3_varlen: contiguous, or balanced: each document cut head-tail, which "
                      "balances the causal mask's work; both take either mask; ring under a --mask: contiguous, "
                      "balanced: the chunks that even that mask's work, or ptrr: PyTorch's processing-time round "
                      "robin of 128-token chunks)", "", "",
                      default_text="the variant's own", optional=True, metavar="NAME")
    heads_k_stride: int = row("K/V heads gathered at a time by all-gather variants; while one group computes, the "
                              "next group's gather is in flight; 0: all of them in one gather", 0, 0,
                              default_text="all K/V heads in one gather", label="stride={}", optional=True,
                              check=_ZERO_OR_MORE)
    docs: str = row("packed documents: lengths in tokens separated by commas (sizes such as 12k, 0 for an empty "
                    "document), in row order, summing to seqlen; ring_varlen needs each a multiple of the world size, "
                    "zigzag_varlen of twice it, llama3_varlen takes any; the batch variants ring, zigzag, stripe, "
                    "llama3, ulysses and usp take any as a document mask over their own layout of the whole row "
                    "(written mask docs:LENGTHS;MASK), every row of --batch packing the same "
                    "lengths", "", "",
                    default_text="none", optional=True, parse=NONE_IS_UNSET,
                    check=_if_set(lambda name, value: parse_docs(value)),
                    metavar="LENGTHS")
    doc_dist: str = row("draw the documents with the seed until they fill seqlen: lognormal:mean=4k,sigma=1 (mean "
                        "length in tokens, sigma of its log) or uniform:min=512,max=8k; lengths are rounded to the "
                        "variant's multiple", "", "", default_text="none", optional=True, parse=NONE_IS_UNSET,
                        check=_if_set(lambda name, value: parse_doc_dist(value)), metavar="DIST")
    doc_pad: int = row("pad every document given by --docs to a multiple of this many tokens, the padding at the "
                       "document's end (so under the causal mask no real token sees it); --docs gives the real "
                       "lengths, seqlen the padded row, FLOPs count real tokens; padding rows' out and gradients are "
                       "zero and their lse is not compared; 0: no padding", 0, 0, default_text="no padding",
                       label="pad={}", optional=True, check=_ZERO_OR_MORE)
    rotate: str = row("how torch_cp (PyTorch's context parallel) moves K/V: allgather (gather once) or alltoall (one "
                      "block per step)", "", "", default_text="allgather, PyTorch's own", optional=True,
                      check=_if_set(_one_of(_rotations)), metavar="|".join(ROTATE))
    sink: str = row("attention sink, one logit per query head joining every softmax row once: learnable (float32 "
                    "logits drawn from the seed; verify checks their gradient too) or off-by-one (0, fixed, no "
                    "gradient)", "none", "none", default_text="none",
                    label="sink={}", optional=True, check=_one_of(lambda: SINKS), metavar="|".join(SINKS))
    window: int = row("a causal sliding window: each query sees this many most recent keys of its sequence or "
                      "document, itself included (query p sees keys p - L + 1 .. p); a size such as 4096 or 4k; on "
                      "the flash-attn-4, flash-attn, torch-flash, cpu and math kernels", 0, 0, default_text="none",
                      label="window={}", optional=True, parse=_SIZE["window"], check=_check_window)
    mask: str = row("any mask, as NAME[:PARAMS] (a family's token counts take sizes such as 4k; slices' positions "
                    "are whole numbers): causal; full; window:L (as "
                    "--window L) or window:L,R (two-sided, non-causal: query p sees keys p - L + 1 .. p + R); "
                    "prefix:P (a bidirectional prompt of P tokens, causal after); shared-prefix:P,answers=A (a "
                    "causal prompt of P tokens, then A equal answers, each seeing the prompt and itself); chunked:C "
                    "(causal inside chunks of C tokens); global:G,window:L (causal: the first G tokens and the last "
                    "L keys); or slices:q0,q1,k0,k1,type;... (MagiAttention's slices, type full, causal, inv-causal "
                    "or bi-causal). causal, full and window:L are written as --causal, --no-causal and --window; "
                    "the others set causal false (the mask alone decides) and take no --causal or --window; with "
                    "--docs it applies inside each document, positions from 0 (slices: over the packed row, cut at "
                    "the documents); FLOPs count the unmasked pairs; partial blocks run on the math kernel's dense mask, as flex's mask_mod, "
                    "or as one window call per slice on a kernel that takes a window (flash-attn-4, flash-attn, torch-flash, cpu)",
                    "", "", default_text="the mask of --causal and "
                    "--window", optional=True, parse=MASK, check=_if_set(lambda name, value: parse_mask(value)),
                    repeatable=True, file_option="--mask-file", file_parse=MASK_FILE,
                    file_help="Read the mask from a file of slices, one a line: q_start q_end k_start k_end type "
                              "(commas or spaces between them, # starts a comment; type full, causal, inv-causal "
                              "or bi-causal, MagiAttention's slice types, over global positions); the same as "
                              "--mask slices:... with them, which records hold. Repeat for several.")
    bias: str = row("an attention bias added to the scaled scores before the softmax: alibi (ALiBi's fixed slopes "
                    "2^(-8(h+1)/H) per head h = 0 .. H-1, interpolated for H not a power of two; the bias is -slope_h * "
                    "|q_pos - k_pos|, so -slope_h * (q_pos - k_pos) under the causal mask; no gradient) or a "
                    "learnable float tensor of TransformerEngine's post-scale shapes 1hss, bhss, 11ss, b1ss or 111s "
                    "(b batch, h heads, s seqlen; 111s is one row of keys broadcast over the queries), drawn from the "
                    "seed (normal * 0.5), whose gradient verify checks too (dbias); composes with --mask, --window and "
                    "--sink; "
                    "FLOPs unchanged; on the flex and math kernels (ALiBi on flash-attn-4 too) and the batch variants ring, "
                    "zigzag, stripe, llama3, ulysses and usp", "", "", default_text="none", label="bias={}", optional=True,
                    parse=NONE_IS_UNSET,
                    check=_if_set(_check_bias), repeatable=True, metavar="|".join(BIAS_KINDS))
    max_logit: bool = row("also return the per-head maximum logit (TransformerEngine's return_max_logit, the "
                          "quantity QK-clip reads): the largest scaled, masked score (bias included, the sink not) "
                          "of each query head over the batch and every unmasked query-key pair, [heads] float32 "
                          "(float64 for fp64); each rank takes it over the blocks it computes, then an all-reduce "
                          "MAX over the group; verify checks it as one more entry, max_logit, by the max rule; on "
                          "the math kernel and the batch variants", False, False, default_text="off",
                          label="max-logit", optional=True, commands=("verify",), flag="--max-logit")
    ulysses_degree: int = row("ranks in each Ulysses group of the Ulysses-ring hybrids, which run a ring of "
                              "world_size / ulysses_degree groups; a divisor of the world size that divides heads "
                              "(and divides kv_heads or is a multiple of it), 0: the largest such divisor, or auto: "
                              "one case per factorization of the world size", 0, 0,
                              default_text="the largest the heads allow; 0 for the other variants", label="U={}",
                              optional=True, parse=ULYSSES_DEGREE, check=_check_ulysses_degree)
    hf_model: str = row("check a whole model instead of attention alone: a randomly initialised model through the "
                        "Hugging Face adapter (llama-tiny, qwen2-tiny with a sliding-window layer, gpt-oss-tiny with "
                        "banded and full layers and learnable sinks: 256 tokens, for CPU; llama-small: 16k tokens, for "
                        "GPUs); it fixes seqlen, batch, heads, kv_heads, head_dim, window and sink; needs the hf "
                        "extra", "", "",
                        default_text="the attention check", optional=True, commands=("verify",), flag="--model",
                        check=_if_set(_check_model), metavar="NAME")
    repeat: int = row("times each case runs in the same launch; above 1, out, lse, dq, dk and dv must be bitwise the "
                      "same in every repeat (a determinism check: the first differing tensor and repeat are "
                      "recorded, and the case fails unless only the gradients differ and its kernel's backward is "
                      "documented as nondeterministic); 1: once, no determinism verdict", 1, 1, in_case_id=False,
                      optional=True, commands=("verify",), check=_POSITIVE)
    require_deterministic: bool = row("fail a case whose repeats differ at all, also where its kernel's backward is "
                                      "documented as nondeterministic (flash-attn, torch-flash, cudnn, "
                                      "torch-efficient); runs at least 2 repeats", False, False, default_text="off",
                                      in_case_id=False, optional=True, commands=("verify",),
                                      flag="--require-deterministic")
    profile: bool = row("after the timed iterations, run --iters more with a span around every kernel call, merge "
                        "and communication wait, per rank and per step (CUDA events, read after the iterations; "
                        "perf_counter on cpu): records gain profile, per_rank_busy_ms and busy_imbalance, the command "
                        "prints a breakdown per rank (kernel, merge, exposed communication, other) and writes "
                        "OUT/profile-<case label>.png", False, False, default_text="off", in_case_id=False,
                        optional=True, commands=("run",), flag="--profile")
    emulate: bool = row("one process on one device plays every rank in turn, every transfer (the ring's, the "
                        "all-gather and reduce-scatter, the all-to-all) replaced by device copies of what each rank "
                        "would receive (drawn from the same seeds): compute-only time per rank and the efficiency "
                        "bound at world_size, in records that say emulated: true; ringbench's own variants (not the "
                        "peers), no process group of world_size ranks needed", False, False,
                        default_text="off", optional=True, commands=("run",), flag="--emulate")
    cuda_graph: str = row("capture each timed iteration (forward and backward: kernels, merges, transfers) as one "
                          "CUDA graph and replay it, which takes the host's launches out of the loop: on (capture, "
                          "else the case runs eagerly and the record says why), off (eager), or auto: capture where "
                          "the host, not the GPU, bounds an iteration, and keep it where it is checked to be faster "
                          "and to give the eager outputs (emulated runs and world size "
                          "1 on cuda; eager on cpu and for NCCL runs); records say cuda_graph true or false with "
                          "the reason", "auto", "auto", optional=True, commands=("run",), metavar="auto|on|off",
                          check=_one_of(lambda: CUDA_GRAPH_CHOICES))
    min_time_ms: int = row("a time budget for the timed loop, in ms: after --iters iterations, go on timing until "
                           "every rank's timed iterations add up to this many ms (the ranks agree on each extension "
                           "by gathering the iterations each still needs and running the most, so all run the same "
                           "count and the same collectives); the reference is timed the same way, and records give "
                           "the counts run (timed_iters, ref_timed_iters); 0: --iters alone", 0, 0,
                           default_text="--iters alone", in_case_id=False, optional=True, commands=("run",),
                           check=_ZERO_OR_MORE)
    flush_l2: bool = row("before every timed iteration of the variant and of the reference, outside the timing, "
                         "write a buffer of twice the GPU's L2 cache (at least 64 MiB), so each iteration starts "
                         "with a cold L2; its bytes are left out of peak_allocated_gib and given as l2_flush_bytes; "
                         "cuda only (refused on cpu)", False, False, default_text="off", optional=True,
                         commands=("run",), flag="--flush-l2")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form records hold, field order as in the table."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CaseSpec":
        """Build a spec from ``to_dict()`` output (or a record's ``spec``), checking each field's type.

        Optional fields a record written before them lacks take their default.

        Raises:
            SpecError: a missing or unknown field, or a value of the wrong type.
        """
        unknown = [k for k in data if k not in BY_NAME]
        if unknown:
            raise SpecError(f"field {unknown[0]!r} is not a case field; use one of {', '.join(NAMES)}")
        missing = [k for k in NAMES if k not in data and k not in OPTIONAL_DEFAULTS]
        if missing:
            raise SpecError(f"field {missing[0]!r} is missing from the case; give every field of "
                            "CaseSpec.to_dict()")
        return cls(**{k: coerce(k, data[k]) for k in NAMES if k in data})

    def case_id(self) -> str:
        """A stable 12-hex-digit sha1 of every field in the case_id (all but iters, warmup and seed).

        Optional fields left at their defaults are left out, so ids stay those of records
        written before the field existed.
        """
        keyed = {k: v for k, v in self.to_dict().items()
                 if k not in NOT_IN_CASE_ID and not (k in OPTIONAL_DEFAULTS and v == OPTIONAL_DEFAULTS[k])}
        if keyed.get("mask"):  # the slices decide, not the name of the file they were read from
            keyed["mask"] = masks.unnamed(keyed["mask"])
        blob = json.dumps(keyed, sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def value_head_dim(self) -> int:
        """The value head dim Dv: ``head_dim_v``, or ``head_dim`` where it is 0."""
        return self.head_dim_v or self.head_dim

    def replace(self, **changes: Any) -> "CaseSpec":
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def _rows() -> tuple[Field, ...]:
    """The rows of CaseSpec's attributes, each with its name, its type and its generated help."""
    hints = typing.get_type_hints(CaseSpec)
    return tuple(dataclasses.replace(f.metadata[ROW], name=f.name, type=hints[f.name],
                                     help=f.metadata[ROW].help + _taken_by(f.name))
                 for f in dataclasses.fields(CaseSpec))


FIELDS: tuple[Field, ...] = _rows()
CaseSpec.__doc__ = "\n".join(
    ["One case: a variant, a kernel and a shape on ``world_size`` ranks.", "",
     "Each attribute carries its :class:`Field` row (``dataclasses.fields(CaseSpec)[i].metadata['row']``).", "",
     "Attributes:"] + [f"    {f.name} ({f.type.__name__}): {f.help}." for f in FIELDS])

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
#: Fields passed to the variant's ``attention`` as keywords when set.
VARIANT_OPTIONS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.variant_option)
#: Fields that make two verify records one problem at several world sizes: every field of
#: ``case_id`` but the world size, and the seed (the same problem on other numbers is another one).
GROWTH_KEY: tuple[str, ...] = tuple(f.name for f in FIELDS if (f.in_case_id or f.name == "seed")
                                    and f.name not in ("task", "world_size"))
#: Fields left out of ``case_id``.
NOT_IN_CASE_ID: tuple[str, ...] = tuple(f.name for f in FIELDS if not f.in_case_id)
#: Optional fields and the default that records written before them hold.
OPTIONAL_DEFAULTS: dict[str, Any] = {f.name: f.default for f in FIELDS if f.optional}

_TYPE_WORDS = {int: "an integer", bool: "true or false", str: "a string"}


def coerce(name: str, value: Any) -> Any:
    """Check one field's type; a field with a parser (``seqlen``) also takes text such as ``128k``.

    Returns:
        The value, parsed where it was text.

    Raises:
        SpecError: an unknown field, a value of the wrong type, or text the parser refuses.
    """
    field = BY_NAME.get(name)
    if field is None:
        raise SpecError(f"field {name!r} is not a case field; use one of {', '.join(NAMES)}")
    if field.parse is not None and isinstance(value, str):
        return field.parse.parse(value)
    ok = isinstance(value, field.type) and not (field.type is int and isinstance(value, bool))
    if not ok:
        kind = type(value).__name__
        raise SpecError(f"{name} {value!r} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, but {name} must be "
                        f"{_TYPE_WORDS[field.type]}; fix its value")
    return value


def check(name: str, value: Any) -> Any:
    """Coerce one field's value and apply its own rule; returns the value.

    Raises:
        SpecError: see :func:`coerce`, or the field's rule, in one sentence with the fix.
    """
    value = coerce(name, value)
    rule = BY_NAME[name].check
    if rule is not None:
        rule(name, value)
    return value


def defaults(device: str, visible_gpus: int) -> dict[str, Any]:
    """Every field with a default, at its default for ``device`` (``world_size`` on cuda: the
    visible GPUs, at least 1); ``device`` itself included.

    Raises:
        SpecError: an unknown device.
    """
    check("device", device)
    out: dict[str, Any] = {"device": device}
    for f in FIELDS:
        value = getattr(f, device)
        if value is None:
            continue
        out[f.name] = max(1, visible_gpus) if value == VISIBLE_GPUS else value
    return out


def variant_options(spec: Any) -> dict[str, Any]:
    """The keyword options a case (a CaseSpec or its dict) passes to its variant's ``attention``."""
    get = spec.get if isinstance(spec, Mapping) else (lambda k, d=None: getattr(spec, k, d))
    return {name: get(name) for name in VARIANT_OPTIONS if get(name)}


def fields_of(command: str) -> tuple[Field, ...]:
    """The fields ``command`` (``run`` or ``verify``) takes as options, in table order."""
    return tuple(f for f in FIELDS if command in f.commands)


def markdown_table() -> str:
    """The field table of ``docs/contracts.md``: field, type, defaults, case_id, option, meaning."""
    rows = ["| field | type | default (cuda / cpu) | in case_id | option | meaning |",
            "|---|---|---|---|---|---|"]
    for f in FIELDS:
        if f.cuda is None:
            default = "none"
        elif f.cuda == f.cpu:
            default = f"`{f.cuda!r}`" if f.type is str else f"`{f.cuda}`"
            default += f" ({f.default_text})" if f.default_text else ""
        else:
            default = f"`{f.cuda}` / `{f.cpu}`" if f.cuda != VISIBLE_GPUS else f"GPUs / `{f.cpu}`"
        in_id = "no" if not f.in_case_id else ("when set" if f.optional else "yes")
        commands = " ".join(f"`{c}`" for c in f.commands) or "-"
        option = f"`{f.option}` ({commands})" if f.commands else "-"
        rows.append(f"| {f.name} | {f.type.__name__} | {default} | {in_id} | {option} | {f.help} |")
    return "\n".join(rows) + "\n"
