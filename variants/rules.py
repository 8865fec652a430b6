"""The torch-free rules that the registry and the engines share: how many chunks each layout cuts
per rank, which document lengths and Ulysses degrees a variant can take, and the variant options
(:class:`Option`: window, mask, sink, bias, max logit, layout, Ulysses degree...), each with its refusal and its resolver.

Plain data and arithmetic, so the harness can refuse a bad spec before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .engines import masks

#: Chunks per rank of each layout: the global seqlen must be a multiple of this times W.
LAYOUT_CHUNKS = {"contiguous": 1, "zigzag": 2, "stripe": 1}
#: The longest global sequence, in tokens (1024M): the harness refuses more, so no fix offers more.
MAX_SEQLEN = 2**30
#: How torch_cp moves K/V (its ``rotate`` option), PyTorch's default first.
ROTATE = ("allgather", "alltoall")


def nearest_multiple(value: int, n: int) -> int | None:
    """The multiple of ``n`` a refusal offers in place of ``value`` (not one): the next one above,
    or the one below where that passes :data:`MAX_SEQLEN`; ``None`` where no multiple of ``n``
    from ``n`` up is within it, so no seqlen can be offered."""
    up = (value // n + 1) * n
    if up <= MAX_SEQLEN:
        return up
    down = value - value % n
    return down if down >= n else None


def document_rule(docs, world_size: int, layout: str, who: str) -> str | None:
    """Why documents of lengths ``docs`` cannot each be cut in ``layout`` at ``world_size``, or ``None``.

    Every document's length must be a multiple of ``LAYOUT_CHUNKS[layout] * world_size``. The
    sentence names the first offending document (its 1-based position, ``document 1``, as
    ``--docs`` counts them, and its length), the rule, ``who`` needs it, and the fix.
    """
    n = LAYOUT_CHUNKS[layout] * world_size
    rule = f"2 * world_size = {n}" if LAYOUT_CHUNKS[layout] == 2 else f"world_size = {n}"
    for i, length in enumerate(docs):
        if length % n:
            down = f" or {length - length % n}" if length > n else ""
            return (f"document {i + 1} has {plural(length, 'token')}, not a multiple of {rule}, "
                    f"which {who} needs; "
                    f"make it {(length // n + 1) * n}{down} tokens, or use llama3_varlen, which takes any "
                    "document lengths")
    return None


def ulysses_rule(heads: int, kv_heads: int | None, degree: int, who: str, *,
                 world_size: int | None = None, whole: bool = False) -> str | None:
    """Why a Ulysses degree ``degree`` cannot split ``heads`` query and ``kv_heads`` K/V heads, or ``None``.

    The all-to-all gives every rank of the Ulysses group ``heads / degree`` query heads, so the
    degree must divide the query heads. K/V heads are split the same way when the degree divides
    them; when the degree exceeds them and is a multiple of them, each K/V head is replicated
    ``degree / kv_heads`` times first (as DeepSpeed-Ulysses does), so every rank still gets the
    one K/V head its query heads use. Any other pair has no head split. Source: DeepSpeed-Ulysses
    (arXiv 2309.14509), issue 16.

    The sentence ends with a fix that passes this rule: given ``world_size``, a degree that also
    divides it (the hybrids' ``--ulysses-degree``); with ``whole`` (ulysses, whose degree is the
    world size and takes no ``--ulysses-degree``), a ``--world-size`` or ``--heads`` instead.
    """
    def fits(d: int) -> bool:
        return heads % d == 0 and not (kv_heads and kv_heads % d and d % kv_heads)

    if fits(degree):
        return None
    split = heads % degree == 0
    rule = (f"divides {heads}" if not split else
            f"divides kv_heads {kv_heads} or is a multiple of it that divides heads {heads}")
    if whole:
        sizes = [d for d in range(2, heads + 1) if fits(d)]
        size = max([d for d in sizes if d < degree] or sizes or [1])
        if split:
            return (f"world_size {degree} neither divides kv_heads {kv_heads} nor is a multiple of it, so {who}, "
                    "which runs Ulysses over every rank, can neither split the K/V heads nor replicate them evenly; "
                    + (f"pass a --world-size that {rule}, such as {size}, or " if sizes else "pass ")
                    + f"--kv-heads {degree}")
        more = (heads // degree + 1) * degree
        return (f"world_size {degree} does not divide heads {heads}, and {who} runs Ulysses over every rank, giving "
                f"each heads / world_size query heads; pass a --world-size that {rule}, such as {size}, or --heads "
                f"a multiple of {degree}, such as {more}")
    why = (f"neither divides kv_heads {kv_heads} nor is a multiple of it, so {who} can neither split the K/V "
           "heads nor replicate them evenly" if split else
           f"does not divide heads {heads}, and {who} gives every rank of the Ulysses group heads / degree query heads")
    also = f" and world_size {world_size}" if world_size else ""
    fit = max(d for d in range(1, degree) if fits(d) and (not world_size or world_size % d == 0))
    return f"Ulysses degree {degree} {why}; use a degree that {rule}{also}, such as {fit}"


def default_ulysses_degree(world_size: int, heads: int, kv_heads: int | None = None) -> int:
    """The Ulysses degree usp takes when none is given: the largest divisor of ``world_size``
    that :func:`ulysses_rule` accepts for these heads (Ulysses as wide as the heads allow, the
    ring over the rest, as the USP paper, arXiv 2405.07719, advises)."""
    return max(d for d in range(1, world_size + 1)
               if world_size % d == 0 and ulysses_rule(heads, kv_heads, d, "usp") is None)


def factorizations(world_size: int) -> list[int]:
    """The Ulysses degrees U of every factorization ``U x R = world_size``, ascending."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


def resolve_ulysses_degree(degree: int | None, world_size: int, heads: int, kv_heads: int | None = None) -> int:
    """The Ulysses degree a hybrid (usp) runs with: ``degree`` where given (above 0), else
    :func:`default_ulysses_degree`. The one home of "0 means the default"."""
    return degree if degree and degree > 0 else default_ulysses_degree(world_size, heads, kv_heads)


# --------------------------------------------------------------------------- variant options

def listed(items, last: str = "and") -> str:
    """Names as a sentence lists them: ``a``, ``a and b``, ``a, b and c`` (``last="or"``: ``a, b or c``)."""
    items = list(items)
    return ", ".join(items[:-1]) + f" {last} " + items[-1] if len(items) > 1 else "".join(items)


def plural(n: int, one: str, many: str | None = None, *, bare: bool = False) -> str:
    """A count and the word that agrees with it: ``1 case``, ``0 cases``, ``3 launches`` (``many``:
    the plural where it is not ``one`` + s); ``bare``: the word alone, for a verb that agrees
    with ``n`` (``plural(n, "has", "have", bare=True)``). The one home of count-noun agreement."""
    word = one if n == 1 else (many if many is not None else one + "s")
    return word if bare else f"{n} {word}"


def _and(items) -> str:
    return listed(items, "and")


def _or(items) -> str:
    return listed(items, "or")


@dataclass(frozen=True)
class Option:
    """A case field that some variants take and the others refuse, and its rule.

    A variant declares the options it takes in ``Variant.options`` (name -> rule); the harness's
    check, ``--help``'s "taken by" and the matrix read that declaration. An option that is not
    declared is refused with :meth:`refusal` when set.

    Attributes:
        name: the case field (``window``).
        unset: the field's value when not given.
        refuse: ``(variant, value, takers) -> sentence`` for a variant that does not take it;
            ``takers`` are the names of the variants that do.
        keyword: the caller passes it to the variant's ``attention`` as a plain keyword (the
            sink is a tensor the rank makes, not a keyword the case gives).
    """

    name: str
    refuse: Callable[[Any, Any, list], str]
    unset: Any = 0
    keyword: bool = True

    def given(self, variant, value) -> bool:
        """Whether ``value`` asks ``variant`` for something."""
        return value is not None and value != self.unset

    def check(self, variant, value, case: Mapping[str, Any]) -> str | None:
        """The variant's rule for a value it takes, given the rest of the case; ``None``: fine."""
        return None

    def resolve(self, variant, value, case: Mapping[str, Any]):
        """The value a case runs with (the default where unset); most options are themselves."""
        return value


@dataclass(frozen=True)
class Layouts(Option):
    """``layout``: the layouts a variant takes, its own first. A variant that declares none
    takes its own only."""

    choices: tuple[str, ...] = ()

    def given(self, variant, value) -> bool:
        return bool(value) and value != variant.layout

    def check(self, variant, value, case):
        if value and value not in self.choices:
            return self.refuse(variant, value, [])
        return None

    def needs_mask(self, value: str) -> bool:
        """Whether layout ``value`` has nothing to follow without a ``--mask`` (none of these does)."""
        return False


def _refuse_layout(variant, value, takers) -> str:
    if "layout" in variant.options:
        return f"layout {value!r} is not one {variant.name} takes; choose {' or '.join(variant.options['layout'].choices)}"
    # A variant of one layout: choosing it again is no fix, so say what is.
    return (f"layout {value!r} is not one {variant.name} takes, since it lays the sequence out as {variant.layout} "
            f"only; drop --layout{_layout_taker(variant, value)}")


def _layout_taker(variant, value) -> str:
    """``, or use --variant NAME --layout VALUE`` for the first variant of ``variant``'s form (batch or
    varlen, not a peer) that takes layout ``value``, as its own or as an option; ``""`` where none does."""
    from .registry import VARIANTS  # the registry imports these rules; read at refusal time only

    for other in VARIANTS.values():
        if other.peer or other.varlen != variant.varlen or other is variant:
            continue
        if other.layout == value:
            return f", or use --variant {other.name}"
        if value in getattr(other.options.get("layout"), "choices", ()):
            return f", or use --variant {other.name} --layout {value}"
    return ""


@dataclass(frozen=True)
class MaskLayouts(Layouts):
    """``layout`` of a batch variant that takes ``balanced`` (or ``ptrr``): the mask planner's chunks
    (``engines/mask_balance.py``), so it needs a mask the plain cases do not write away, or packed
    documents (the harness writes them as a document mask)."""

    def needs_mask(self, value: str) -> bool:
        return value in ("balanced", "ptrr")

    def check(self, variant, value, case):
        reason = super().check(variant, value, case)
        mask = case.get("mask") or ""
        if case.get("packed"):  # packed documents, which the harness writes as a document mask over the row
            return reason
        if reason is None and self.needs_mask(value) and (not mask or masks.plain_fields(mask) is not None):
            return (f"layout {value!r} of {variant.name} evens a mask's work, and the case has "
                    f"{'mask ' + mask if mask else 'none'}; pass --mask (such as prefix:512), or drop --layout")
        return reason


def layouts(*choices: str) -> Layouts:
    """The ``layout`` option of a variant taking ``choices`` (its own first)."""
    return Layouts("layout", _refuse_layout, unset="", choices=choices)


def mask_layouts(*choices: str) -> MaskLayouts:
    """The ``layout`` option of a batch variant taking ``choices``, ``balanced`` among them (its own first)."""
    return MaskLayouts("layout", _refuse_layout, unset="", choices=choices)


@dataclass(frozen=True)
class HeadsKStride(Option):
    def check(self, variant, value, case):
        kv_heads = case.get("kv_heads")
        if value and kv_heads is not None and not 1 <= value <= kv_heads:
            return (f"heads_k_stride {value} must be between 1 and kv_heads = {kv_heads}; "
                    f"pass --heads-k-stride {kv_heads} or fewer")
        return None


@dataclass(frozen=True)
class UlyssesDegree(Option):
    """``ulysses_degree`` of the Ulysses-ring hybrids: -1 is auto (one case per factorization,
    expanded by the harness), 0 the default (:func:`resolve_ulysses_degree`)."""

    def check(self, variant, value, case):
        world_size, heads = case["world_size"], case.get("heads")
        if value > 0 and world_size % value:
            return (f"ulysses_degree {value} does not divide world_size {world_size}, and {variant.name} "
                    f"runs a ring of world_size / ulysses_degree groups; pass one of "
                    f"{', '.join(map(str, factorizations(world_size)))} or auto")
        if value > 0 and heads is not None:
            return ulysses_rule(heads, case.get("kv_heads"), value, variant.name, world_size=world_size)
        return None

    def resolve(self, variant, value, case):
        if value < 0:  # auto: the harness expands it first
            return value
        return resolve_ulysses_degree(value, case["world_size"], case["heads"], case.get("kv_heads"))


@dataclass(frozen=True)
class Window(Option):
    def check(self, variant, value, case):
        if value and not case.get("causal", True):
            return (f"a sliding window is causal (query p sees keys p - window + 1 .. p), so --window {value} "
                    "needs --causal; drop --no-causal or --window")
        return None


@dataclass(frozen=True)
class MaskOption(Option):
    """``mask``: any mask of ``engines/masks.py`` (its canonical text), by the rule that needs the
    case: a seqlen it fits. A sink composes with any mask (it joins each row once, after the
    row's last merge, whatever the mask left in it), as does ``head_dim_v``.
    A varlen variant applies it inside each packed document (``masks.documents``), by the
    documents' rule (:func:`masks.document_rule`, asked where the case's ``docs`` are given).
    ``causal``, ``full`` and ``window:L`` ask nothing beyond the plain fields they are written as
    (the harness's ``resolve_mask``), so every variant takes them. A mask beside a window is
    :func:`mask_window_rule`'s, for every variant."""

    def given(self, variant, value) -> bool:
        return bool(value) and masks.plain_fields(value) is None

    def check(self, variant, value, case):
        if not value:
            return None
        if variant.varlen or case.get("packed"):
            # Applied per document: the rule is the documents' (masks.document_rule), which the
            # harness asks once it has them (a batch engine's, once they are its docs: mask); the
            # seqlen alone refuses nothing.
            docs = case.get("docs")
            return masks.document_rule(masks.parse(value), docs) if docs else None
        seqlen = case.get("seqlen")
        return masks.rule(masks.parse(value), seqlen) if seqlen else None


def mask_window_rule(mask: str, window: int) -> str | None:
    """Why a mask and a window cannot both be set (``--window L`` is the short form of ``window:L``,
    so the two would say the mask twice), in one sentence, or ``None``."""
    if mask and window:
        return (f"mask {masks.label(mask)} and window {window} do not go together (--window L is the short form of "
                "--mask window:L); pass one of them")
    return None


#: The learnable bias shapes (TransformerEngine's post-scale bias shapes): b batch, h query heads,
#: s the sequence; ``111s`` is one row of keys broadcast over every query.
BIAS_SHAPES = ("1hss", "bhss", "11ss", "111s", "b1ss")
#: Every ``--bias`` value: ALiBi's fixed per-head slopes, or a learnable tensor of one of :data:`BIAS_SHAPES`.
BIAS_KINDS = ("alibi", *BIAS_SHAPES)


SINK = Option("sink", lambda v, value, takers: (
    f"{v.name} takes no attention sink (sink {value!r}), since only ringbench's own engines apply one once per "
    "row; pass --sink none or use a ringbench variant such as zigzag"), unset="none", keyword=False)
HEADS_K_STRIDE = HeadsKStride("heads_k_stride", lambda v, value, takers: (
    f"{v.name} takes no heads_k_stride; it is an option of all-gather variants such as llama3"))
ROTATE_RULE = Option("rotate", lambda v, value, takers: (
    f"{v.name} takes no rotate; it is an option of torch_cp (PyTorch's context parallel)"), unset="")
ULYSSES_DEGREE = UlyssesDegree("ulysses_degree", lambda v, value, takers: (
    f"{v.name} takes no ulysses_degree; it is an option of the Ulysses-ring hybrids ({_or(takers)}), so drop "
    "--ulysses-degree or use one of them"))
WINDOW = Window("window", lambda v, value, takers: (
    f"{v.name} cannot take a sliding window (--window {value}); use one of {', '.join(takers)}"))
MASK = MaskOption("mask", lambda v, value, takers: (
    f"{v.name} cannot take mask {masks.label(value)}, since only ringbench's own engines cut their blocks by a "
    f"mask; use one of {', '.join(takers)}"), unset="")

BIAS = Option("bias", lambda v, value, takers: (
    f"{v.name} cannot take bias {value}, since only ringbench's batch engines add a bias block by block; use one of "
    f"{', '.join(takers)}"), unset="", keyword=False)
MAX_LOGIT = Option("max_logit", lambda v, value, takers: (
    f"{v.name} cannot return the per-head max logit (--max-logit), since only ringbench's batch engines raise it "
    f"block by block and take its maximum over the group; use one of {', '.join(takers)}"), unset=False,
    keyword=False)
#: Every variant option, in the order a case's options are checked.
OPTIONS: dict[str, Option] = {o.name: o for o in (SINK, layouts(), HEADS_K_STRIDE, ROTATE_RULE, ULYSSES_DEGREE,
                                                  WINDOW, MASK, BIAS, MAX_LOGIT)}
