"""The case specification: one run of one variant on one shape, and every check on it.

Everything here but :func:`resolve` and :func:`detect_device` is torch-free, so a bad
spec is refused in milliseconds, before any process starts. The kernel checks import
``ringbench.variants.kernels`` (and so torch) only when a concrete kernel is named.

That includes the packed documents of the varlen variants: :func:`resolve_docs` draws a
``doc_dist`` into ``docs`` with the case's seed, and :func:`validate` checks the documents
against the variant's rules (they fill the row, batch 1, the per-document multiple).
"""

from __future__ import annotations

import math
import random
from typing import Any, Mapping

from ringbench.case import fields
from ringbench.case.fields import (DEVICES, DTYPES, MAX_SEQLEN, MODES, TASKS, CaseSpec, format_size,  # noqa: F401
                                   parse_doc_dist, parse_docs, parse_size, variant_options)
from ringbench.errors import SpecError, Unavailable
from ringbench.variants import (OPTIONS, ROTATE, VARIANTS, factorizations, get_variant, listed, names, plural,
                                ulysses_rule)
from ringbench.variants.engines import masks
from ringbench.variants.offers import SeqlenOffer
from ringbench.variants.rules import BIAS_SHAPES, mask_window_rule


def field_names() -> tuple[str, ...]:
    """CaseSpec's field names in table order."""
    return fields.NAMES


def layout_of(spec, variant) -> str:
    """The layout a case's tensors are sharded in: its own, or else the variant's."""
    return spec.layout or variant.layout


def resolve_options(spec: CaseSpec) -> CaseSpec:
    """``spec`` with the options its variant takes as they run (``Variant.resolve``, each
    option's own resolver: ``ulysses_degree`` 0 becomes the variant's default degree), so
    records name what ran and the ranks read it, never resolving again."""
    variant = VARIANTS.get(spec.variant)
    if variant is None:
        return spec
    changes = {k: v for k, v in variant.resolve(spec.to_dict()).items() if v != getattr(spec, k)}
    return spec.replace(**changes) if changes else spec


def expand_ulysses_degree(spec: CaseSpec) -> list[CaseSpec]:
    """The cases ``spec`` stands for, each with its options resolved (:func:`resolve_options`):
    ``ulysses_degree`` auto becomes one case per factorization U x R of the world size whose U
    the heads allow (``variants.ulysses_rule``), ascending; unset (0) becomes the variant's
    default. Other variants' cases are returned as they are (``validate`` refuses a degree they
    do not take)."""
    variant = VARIANTS.get(spec.variant)
    if variant is not None and "ulysses_degree" in variant.options and spec.ulysses_degree == fields.AUTO_DEGREE:
        return [spec.replace(ulysses_degree=u) for u in factorizations(spec.world_size)
                if ulysses_rule(spec.heads, spec.kv_heads, u, spec.variant) is None]
    return [resolve_options(spec)]


def default_fields(device: str, visible_gpus: int) -> dict[str, Any]:
    """Every field but ``task`` and ``variant`` at its default for ``device`` (the table's
    ``cuda`` and ``cpu`` columns; on cuda the world size is the visible GPUs, at least 1).

    Raises:
        SpecError: an unknown device.
    """
    return fields.defaults(device, visible_gpus)


def detect_device() -> tuple[str, int]:
    """Return ``("cuda", visible GPU count)`` when torch sees a GPU, else ``("cpu", 0)``.

    Imports torch (about two seconds), so call it only once a command needs it.
    """
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return "cpu", 0


# --------------------------------------------------------------------------- checks

def check_fields(given: Mapping[str, Any]) -> None:
    """Check each given field on its own (its row's rule), then the rules across fields that
    the given ones allow, in an order where each refusal's fix passes the rules before it:
    a mask beside a window, ``heads % kv_heads``, the padding's (:func:`_check_padding`), the documents' per-document
    multiple (:func:`document_refusal`), then the variant's rules (its Ulysses degree, its
    seqlen multiple...).

    Needs no torch and accepts a partial mapping, so the CLI can refuse a bad option before
    it detects the device. Each rule runs once the fields it reads are given (the variant's
    when variant, seqlen and world_size are).

    Raises:
        SpecError: the first refused field, in one sentence with the fix.
    """
    for name, value in given.items():
        fields.check(name, value)
    reason = mask_window_rule(given.get("mask") or "", given.get("window") or 0)
    if reason:
        raise SpecError(reason)
    # Every variant's, the plain masks' too (window:L at L >= S); with documents the mask applies per
    # document, and the variant's rule asks the documents' (masks.document_rule) instead.
    if given.get("mask") and given.get("seqlen") and not (given.get("docs") or given.get("doc_dist")):
        reason = masks.rule(masks.parse(given["mask"]), fields.coerce("seqlen", given["seqlen"]))
        if reason:
            raise SpecError(reason)
    heads, kv_heads = given.get("heads"), given.get("kv_heads")
    if heads and kv_heads and heads % kv_heads:
        fit = max(d for d in range(1, kv_heads + 1) if heads % d == 0)
        raise SpecError(f"heads {heads} is not a multiple of kv_heads {kv_heads}; "
                        f"pass --kv-heads with a divisor of {heads}, such as {fit}")
    _check_padding(given)
    reason = document_refusal(given)
    if reason:
        raise SpecError(reason)
    if all(k in given for k in ("variant", "seqlen", "world_size")):
        reason = get_variant(given["variant"]).check(
            seqlen=fields.coerce("seqlen", given["seqlen"]), world_size=given["world_size"],
            causal=given.get("causal", True), heads=given.get("heads"), kv_heads=given.get("kv_heads"),
            packed=bool(given.get("docs") or given.get("doc_dist")),
            **{name: given[name] for name in OPTIONS if name in given})
        if reason:
            raise SpecError(reason)


def mask_refusal(given: Mapping[str, Any]) -> str | None:
    """Why a command's ``--mask`` contradicts its ``--causal``/``--no-causal``, in one sentence, or
    ``None``: ``causal`` is ``--causal``, ``full`` and ``window:L,R`` with R above 0 are
    ``--no-causal``... (:func:`resolve_mask`), and the other masks decide alone, so they take
    neither. ``given``: the options the command was given (one value each), never a whole case."""
    text, causal = given.get("mask"), given.get("causal")
    if not text or causal is None:
        return None
    plain = masks.plain_fields(text)
    flag = "--causal" if causal else "--no-causal"
    if plain is None:
        return (f"mask {masks.label(text)} says alone which keys each query sees, so it takes no {flag}; drop "
                f"{flag}")
    if plain["causal"] != causal:
        return f"mask {text} is {'--causal' if plain['causal'] else '--no-causal'}, which {flag} contradicts; drop {flag}"
    return None


def resolve_mask(spec: CaseSpec) -> CaseSpec:
    """``spec`` with its mask written as the plain fields where they say it (``causal`` as
    ``causal: true``, ``full`` as ``causal: false``, ``window:L`` as ``window: L``; mask then
    empty), so one computation has one case_id and runs the engines' own path; any other mask
    with ``causal: false`` (the mask alone decides). A mask beside a window is left for
    :func:`validate` to refuse."""
    if not spec.mask or spec.window:
        return spec
    plain = masks.plain_fields(spec.mask)
    if plain is None:
        return spec.replace(causal=False) if spec.causal else spec
    return spec.replace(mask="", **plain)


def masks_documents(variant) -> bool:
    """Whether ``variant`` is a batch engine that takes packed documents as a document mask over its
    row (:func:`pack_documents`): one that takes any mask (ring, zigzag, stripe, llama3, ulysses, usp)."""
    return not variant.varlen and not variant.peer and "mask" in variant.options


def packs_documents(spec, variant) -> bool:
    """Whether ``variant`` takes a case's packed documents as a mask over its batch row
    (:func:`pack_documents`): a batch engine that takes any mask, with documents, no ``doc_pad``
    (which needs the varlen engines' causal mask) and no ``hf_model`` (whose layers fix their masks)."""
    return masks_documents(variant) and bool(spec.docs or spec.doc_dist) and not spec.doc_pad and not spec.hf_model


def pack_documents(spec: CaseSpec) -> CaseSpec:
    """``spec`` with the packed documents of a batch engine (ring, zigzag, stripe, llama3, ulysses,
    usp) written as its mask: ``docs:LENGTHS;MASK`` (``masks.packed``), the case's mask (or
    ``causal``/``full``, ``window:L`` from ``--window``) applied inside each document, every pair
    of two documents masked. The layout stays the engine's own over the whole row (zigzag's
    head-tail), so a document may straddle ranks; every row of a batch packs the same lengths.
    ``docs`` and ``doc_dist`` are emptied (the mask holds the drawn lengths), so the case is one
    masked batch case from here on: verify's references, FLOPs and the predicted work read the
    mask. Other cases are returned as they are. Idempotent; call after :func:`resolve_docs`."""
    try:
        variant = get_variant(spec.variant)
    except ValueError:  # validate names the unknown variant
        return spec
    if not packs_documents(spec, variant):
        return spec
    docs = spec_docs(spec)
    inner = spec.mask or (f"window:{spec.window}" if spec.window else "causal" if spec.causal else "full")
    try:
        text = masks.packed(docs, inner)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    return spec.replace(mask=text, docs="", doc_dist="", window=0, causal=False)


def emulation_refusal(spec: CaseSpec) -> str | None:
    """Why ``spec`` cannot be emulated (``run --emulate``, ``emulation.py``), in one sentence with
    the fix, or ``None`` (also when not emulated)."""
    if not spec.emulate:
        return None

    if spec.task != "run":
        return ("emulate is a run measurement and verify checks a real distributed run; drop emulate from the "
                "verify case")
    variant = get_variant(spec.variant)
    if variant.emulates:
        return None
    if variant.peer:
        why = "it is a peer whose own code drives torch.distributed, which one process cannot play"
    else:
        why = "it is not one of the variants whose communication emulation replaces (Variant.emulates)"
    return (f"{spec.variant} cannot run with --emulate: {why}; emulate {names(lambda v: v.emulates)}, or run "
            f"{spec.variant} without --emulate")


def validate(spec: CaseSpec, *, visible_gpus: int) -> None:
    """Refuse a spec that cannot run, before any process starts.

    Checks every field and the rules across them (see :func:`check_fields`: ``heads % kv_heads
    == 0``, the padding, the per-document multiple, the variant's seqlen, head and mask rules),
    the rest of the documents' rules, GQA support, ``flush_l2`` on cuda only, the GPU count on
    cuda, and, for a named kernel (not ``auto``), that it exists, runs on ``spec.device`` and
    takes the head dim and dtype.
    Whether the kernel is available on this machine is :func:`resolve`'s job.

    Args:
        spec: the case.
        visible_gpus: GPUs visible here; bounds ``world_size`` on cuda.

    Raises:
        SpecError: one sentence with the field, the value, the rule and the fix.
    """
    check_fields(spec.to_dict())
    variant = get_variant(spec.variant)
    for reason in (variant.check_device(spec.device), variant.check_kernel(spec.kernel)):
        if reason:
            raise SpecError(reason)
    _check_docs(spec, variant)
    if emulation_refusal(spec):
        raise SpecError(emulation_refusal(spec))
    if spec.cuda_graph == "on" and spec.device != "cuda":
        raise SpecError(f"cuda_graph 'on' needs --device cuda, and this case runs on {spec.device}; pass "
                        "--cuda-graph auto or off")
    if spec.flush_l2 and spec.device != "cuda":
        raise SpecError(f"flush_l2 writes a buffer larger than a GPU's L2 cache between timed iterations, and device "
                        f"{spec.device} has no L2 that ringbench flushes; drop --flush-l2 or pass --device cuda")
    if spec.mask and spec.hf_model:
        raise SpecError(f"mask {masks.label(spec.mask)} does not go with hf_model {spec.hf_model}, whose layers fix "
                        "their own masks; drop --mask")
    if spec.mask and spec.task == "verify" and spec.seqlen > masks.DENSE_LIMIT:
        raise SpecError(SeqlenOffer(
            f"seqlen {spec.seqlen} is above {masks.DENSE_LIMIT} tokens, the longest sequence whose mask verify builds "
            f"as a dense [S, S] boolean reference (1 GiB), and mask {masks.label(spec.mask)} needs one",
            lambda s: f"pass --seqlen {s}" + (" or less" if s == masks.DENSE_LIMIT else ""), masks.DENSE_LIMIT,
            "pass a shorter --seqlen that the mask takes"))
    if spec.max_logit and spec.hf_model:
        raise SpecError(f"max_logit does not go with hf_model {spec.hf_model}, whose check compares a whole model's "
                        "loss and gradients; drop --max-logit")
    if spec.bias and spec.hf_model:
        raise SpecError(f"bias {spec.bias} does not go with hf_model {spec.hf_model}, whose layers fix their own "
                        "scores; drop --bias")
    if spec.bias in BIAS_SHAPES and spec.seqlen > masks.DENSE_LIMIT:
        raise SpecError(SeqlenOffer(
            f"seqlen {spec.seqlen} is above {masks.DENSE_LIMIT} tokens, the longest sequence over which a learnable "
            f"bias {spec.bias} is held as a dense [.., S, S] tensor on every rank",
            lambda s: f"pass --seqlen {s}" + (" or less" if s == masks.DENSE_LIMIT else ""), masks.DENSE_LIMIT,
            "pass a shorter --seqlen, or --bias alibi"))
    if spec.hf_model:
        from ringbench.case import models

        if spec.doc_pad:
            raise SpecError(f"doc_pad {spec.doc_pad} does not go with hf_model {spec.hf_model}: {models.PADDING}")
        models.check_case(spec)
        # A variant the adapter cannot run (a peer), or one without the model's window or sinks.
        reason = models.variant_refusal(spec.hf_model, spec.variant)
        if reason:
            raise SpecError(reason)
    if spec.value_head_dim() != spec.head_dim and not variant.head_dim_v:
        raise SpecError(f"head_dim_v {spec.head_dim_v} differs from head_dim {spec.head_dim}, but {spec.variant} "
                        "assumes one head dim for q, k and v; drop --head-dim-v or use one of ringbench's own "
                        "variants")
    if spec.kv_heads != spec.heads and not variant.gqa:
        raise SpecError(f"kv_heads {spec.kv_heads} differs from heads {spec.heads}, but {spec.variant} "
                        f"does not support GQA; pass --kv-heads {spec.heads}")
    if spec.device == "cuda":
        if visible_gpus < 1:
            raise SpecError("device cuda needs a visible GPU and none is visible; run on a GPU "
                            "machine or pass --device cpu")
        if spec.world_size > visible_gpus and not spec.emulate:  # emulated: one GPU plays every rank
            raise SpecError(f"world_size {spec.world_size} exceeds the {visible_gpus} visible GPUs; "
                            f"pass --world-size {visible_gpus} or fewer")
    if spec.kernel != "auto":
        _check_kernel(spec, _named_kernel(spec.kernel))


def _named_kernel(name: str):
    from ringbench.variants.kernels import get_kernel

    try:
        return get_kernel(name)
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def kernel_refusal(spec: CaseSpec, name: str, kernels=None) -> str | None:
    """Why the kernel ``name`` cannot take ``spec``'s device, head dim, dtype, packed documents, window,
    mask, bias or max logit (``variants.kernels.check_kernel``'s rules, the ones ``auto`` resolves
    by), in one sentence, or None. ``kernels``: the registry its fix names kernels from (default
    every kernel; predict passes the calibration's)."""
    import torch

    from ringbench.variants.kernels import check_kernel

    return check_kernel(_named_kernel(name), spec.device, dtype=getattr(torch, DTYPES[spec.dtype]),
                        head_dim=spec.head_dim, head_dim_v=spec.value_head_dim(),
                        varlen=get_variant(spec.variant).varlen, window=bool(spec.window),
                        mask=masks.label(spec.mask) if spec.mask else "", bias=spec.bias, max_logit=spec.max_logit,
                        kernels=kernels)


def _check_kernel(spec: CaseSpec, kernel) -> None:
    """Refuse a kernel that cannot take ``spec`` (:func:`kernel_refusal`'s rules)."""
    reason = kernel_refusal(spec, kernel.name)
    if reason:
        raise SpecError(reason)


def without_full_window(spec: CaseSpec) -> CaseSpec:
    """``spec`` with a window at or above its seqlen written as no window (0): each query then sees
    every key before it, the causal mask itself, so the two are one case with one case_id."""
    return spec.replace(window=0) if spec.window and spec.window >= spec.seqlen else spec


def canonical(spec: CaseSpec) -> CaseSpec:
    """``spec`` with options that restate a default written as the default (``layout`` equal
    to the variant's own, ``heads_k_stride`` equal to kv_heads, ``rotate`` allgather, ``head_dim_v`` equal to
    head_dim), so one computation has one
    case_id."""
    spec = without_full_window(spec)
    changes: dict[str, Any] = {}
    if spec.layout and spec.layout == get_variant(spec.variant).layout:
        changes["layout"] = ""
    if spec.heads_k_stride and spec.heads_k_stride == spec.kv_heads:
        changes["heads_k_stride"] = 0
    if spec.rotate == ROTATE[0]:
        changes["rotate"] = ""
    if spec.head_dim_v == spec.head_dim:
        changes["head_dim_v"] = 0
    return spec.replace(**changes) if changes else spec


def resolve(spec: CaseSpec) -> CaseSpec:
    """Pick the concrete kernel for ``spec`` on this machine; imports torch.

    ``variants.kernels.resolve_kernel`` decides, the one resolution the variants use too:
    ``auto`` becomes the first kernel in ``AUTO_ORDER[device]`` (among the variant's own
    kernels, for a peer) that is available here and takes the spec's head dim and dtype
    (and, for a varlen variant, has a varlen form). A named kernel must be available here.

    Returns:
        ``spec`` with ``kernel`` set to a concrete name.

    Raises:
        Unavailable: the variant's library is missing here (with the reason).
        SpecError: the named kernel is unavailable (with the reason), or no kernel fits.
    """
    import torch

    from ringbench.variants.kernels import resolve_kernel

    variant = get_variant(spec.variant)
    reason = variant.unavailable()
    if reason:
        raise Unavailable(f"variant {spec.variant} is unavailable here: {reason}")
    try:
        kernel = resolve_kernel(spec.kernel, spec.device, dtype=getattr(torch, DTYPES[spec.dtype]),
                                head_dim=spec.head_dim, head_dim_v=spec.value_head_dim(), varlen=variant.varlen,
                                window=bool(spec.window), mask=masks.label(spec.mask) if spec.mask else "",
                                bias=spec.bias, max_logit=spec.max_logit, among=variant.kernels)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    return spec if kernel.name == spec.kernel else spec.replace(kernel=kernel.name)


# --------------------------------------------------------------------------- packed documents

def _doc_multiple(spec: CaseSpec) -> int:
    """The multiple every document length must be for ``spec``'s variant (1: any length)."""
    variant = VARIANTS.get(spec.variant)
    if variant is None or not variant.shard_by_document:
        return 1
    return variant.seqlen_multiple(spec.world_size)


def draw_docs(kind: str, params: Mapping[str, float], seqlen: int, seed: int, multiple: int = 1) -> list[int]:
    """Draw document lengths that fill ``seqlen`` tokens exactly.

    Lengths are drawn one after another from a ``random.Random(seed)`` until they reach
    ``seqlen``; each draw is rounded to the nearest multiple of ``multiple`` (at least
    ``multiple``, so at least 1), and the last document is cut so that the lengths sum to
    ``seqlen``. With ``seqlen`` a multiple of ``multiple``, the cut one is a multiple too.

    Args:
        kind, params: from :func:`parse_doc_dist`. ``lognormal``: the length is
            ``exp(N(mu, sigma))`` with ``mu = ln(mean) - sigma**2 / 2``, so its mean is
            ``mean`` tokens. ``uniform``: an integer from min to max, both included.
        seqlen: tokens to fill.
        seed: the seed; the same arguments always give the same lengths.
        multiple: every length's required multiple (W for ring_varlen, 2W for zigzag_varlen).

    Returns:
        Positive lengths summing to ``seqlen``.
    """
    rng = random.Random(seed)
    docs: list[int] = []
    total = 0
    while total < seqlen:
        if kind == "lognormal":
            x = rng.lognormvariate(math.log(params["mean"]) - params["sigma"] ** 2 / 2, params["sigma"])
        else:
            x = rng.randint(int(params["min"]), int(params["max"]))
        length = max(multiple, multiple * round(x / multiple))
        length = min(length, seqlen - total)
        docs.append(length)
        total += length
    return docs


def spec_docs(spec: CaseSpec) -> list[int] | None:
    """The document lengths of a case, or ``None`` when it has none.

    ``docs`` when given, else ``doc_dist`` drawn as :func:`resolve_docs` does.

    Raises:
        SpecError: a malformed ``docs`` or ``doc_dist``.
    """
    spec = resolve_docs(spec)
    return parse_docs(spec.docs) if spec.docs else None


def resolve_docs(spec: CaseSpec) -> CaseSpec:
    """Turn a case's documents into plain ``docs``, ready for :func:`validate` and the worker.

    ``docs`` is rewritten as comma-separated integers (``12k`` becomes ``12288``), so equal
    documents give equal case ids. A ``doc_dist`` is drawn with the case's ``seed`` (see
    :func:`draw_docs`) into ``docs`` and kept for the record; for ``ring_varlen`` and
    ``zigzag_varlen`` each drawn length is rounded to the nearest multiple of W or 2W (at
    least that multiple) and the last one cut to fill ``seqlen``, so the draw obeys their
    per-document rule whenever ``seqlen`` does (otherwise lengths are rounded to whole tokens
    and :func:`validate` refuses the seqlen). Idempotent; pure (no torch, no I/O).

    Returns:
        The spec with ``docs`` resolved, or ``spec`` itself when it has no documents.

    Raises:
        SpecError: a malformed ``docs`` or ``doc_dist``, or both given with different lengths.
    """
    drawn = None
    if spec.doc_dist:
        kind, params = parse_doc_dist(spec.doc_dist)
        multiple = _doc_multiple(spec)
        drawn = draw_docs(kind, params, spec.seqlen, spec.seed, multiple if spec.seqlen % multiple == 0 else 1)
    if spec.docs:
        given = parse_docs(spec.docs)
        if drawn is not None and given != drawn:
            raise SpecError(f"docs {spec.docs!r} and doc_dist {spec.doc_dist!r} are both given and disagree; pass "
                            "--docs or --doc-dist, not both")
        drawn = given
    if drawn is None:
        return spec
    return spec.replace(docs=",".join(str(d) for d in drawn))


def padded_docs(spec: CaseSpec) -> list[int] | None:
    """The document lengths a case's layout cuts: each of :func:`spec_docs`'s real lengths
    rounded up to a multiple of ``doc_pad`` (the lengths themselves when it is 0), or ``None``.

    Raises:
        SpecError: a malformed ``docs`` or ``doc_dist``.
    """
    docs = spec_docs(spec)
    if docs is None or not spec.doc_pad:
        return docs
    return [-(-d // spec.doc_pad) * spec.doc_pad for d in docs]


def _check_padding(given: Mapping[str, Any]) -> None:
    """Refuse ``doc_pad`` where it cannot apply: no ``docs`` to pad, or no causal mask to hide it.

    ``given`` may be partial (the CLI's options before the device is known): a rule runs only
    once the fields it reads are given (``docs``, ``causal``).
    """
    pad = given.get("doc_pad") or 0
    if not pad:
        return
    if given.get("doc_dist") or ("docs" in given and not given["docs"]):
        why = "--doc-dist draws documents that fill seqlen" if given.get("doc_dist") else "the case has none"
        raise SpecError(f"doc_pad {pad} pads the documents --docs gives, but {why}; pass --docs with "
                        "the real lengths, or drop --doc-pad")
    mask = given.get("mask") or ""
    if mask and masks.plain_fields(mask) is None:
        raise SpecError(f"doc_pad {pad} needs the causal mask, which keeps every real token from the padding at its "
                        f"document's end, and mask {masks.label(mask)} decides alone which keys each query sees; "
                        "drop --doc-pad (the mask applies inside each document of --docs as given)")
    if given.get("causal", True) is False:
        raise SpecError(f"doc_pad {pad} needs the causal mask, which keeps every real token from the "
                        "padding at its document's end (ringbench's kernels take no key mask); pass --causal or "
                        "drop --doc-pad")




def _round_to_multiples(docs: list[int], n: int, total: int | None) -> list[int]:
    """``docs`` with every length that is not a multiple of ``n`` moved to a multiple of ``n`` next
    to it: the nearer one (above on a tie, and above where below is 0), then, where ``total`` is
    given and moving some of them to their other neighbour reaches it, so that they sum to ``total``."""
    low = {i: d - d % n for i, d in enumerate(docs) if d % n}
    out = list(docs)
    for i, below in low.items():
        out[i] = below + n if 2 * (docs[i] % n) >= n or below == 0 else below
    if total is not None and total % n == 0:
        steps = (total - sum(out)) // n
        if steps > 0:  # up the ones rounded down, the nearest to the multiple above first
            movable = sorted((i for i in low if out[i] == low[i]), key=lambda i: (-(docs[i] % n), -docs[i]))
        else:  # down the ones rounded up (never to 0), the nearest to the multiple below first
            movable = sorted((i for i in low if out[i] > low[i] and low[i]), key=lambda i: (docs[i] % n, -docs[i]))
        if abs(steps) <= len(movable):
            for i in movable[:abs(steps)]:
                out[i] += n if steps > 0 else -n
    return out


#: Above this many documents, a refusal summarises them (:func:`docs_text`, :func:`_documents_phrase`).
LISTED_DOCS = 4


def docs_text(text: str) -> str:
    """``--docs`` as a refusal quotes it: whole (``'100,156'``) up to a few documents, else its
    first and last lengths and its count (``'1,1,1,...,192' (65 documents)``)."""
    entries = str(text).split(",")
    if len(entries) <= 2 * LISTED_DOCS:
        return repr(text)
    return f"'{','.join(entries[:3])},...,{entries[-1]}' ({len(entries)} documents)"


def _documents_phrase(lengths: list[int], bad: list[int], pad: int = 0) -> str:
    """The documents ``bad`` (0-based) of ``lengths`` (padded by ``pad``, where set) that a
    refusal's rule follows: up to :data:`LISTED_DOCS`, by position (``document 3 has 7 tokens,
    not a multiple``, ``documents 1 and 2 have 1 and 1023 tokens, not multiples``, ``doc_pad 7
    pads documents 1 and 2 to 7 and 14 tokens, not multiples``); more, by length (``64 documents
    of 1 token and 2 of 7 tokens are not multiples``, with more than three lengths ``70 documents
    of 1 to 1023 tokens are not multiples``, after ``with doc_pad 7,`` where padded)."""
    if len(bad) <= LISTED_DOCS:
        which = f"document {bad[0] + 1}" if len(bad) == 1 else f"documents {listed([str(i + 1) for i in bad])}"
        sizes = [lengths[i] for i in bad]
        tokens = listed(map(str, sizes)) + (" token" if sizes == [1] else " tokens")
        multiple = "a multiple" if len(bad) == 1 else "multiples"
        if pad:
            return f"doc_pad {pad} pads {which} to {tokens}, not {multiple}"
        return f"{which} {'has' if len(bad) == 1 else 'have'} {tokens}, not {multiple}"
    return (f"with doc_pad {pad}, " if pad else "") + _by_length(lengths, bad) + " are not multiples"


def _by_length(lengths: list[int], bad: list[int]) -> str:
    """``64 documents of 1 token and 2 of 7 tokens``; ``70 documents of 1 to 1023 tokens`` past three lengths."""
    counts: dict[int, int] = {}
    for i in bad:
        counts[lengths[i]] = counts.get(lengths[i], 0) + 1
    if len(counts) > 3:
        return f"{len(bad)} documents of {min(counts)} to {plural(max(counts), 'token')}"
    groups = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    parts = [f"{plural(c, 'document') if i == 0 else c} of {plural(n, 'token')}" for i, (n, c) in enumerate(groups)]
    return listed(parts)


def document_refusal(given: Mapping[str, Any], world_sizes: list[int] | None = None) -> str | None:
    """Why a document-sharded variant (``ring_varlen``, ``zigzag_varlen``, ``usp_varlen``) cannot cut
    the documents ``--docs`` gives, padded by ``doc_pad`` where set, or ``None``.

    Every (padded) document must be a multiple of the variant's ``seqlen_multiple`` at the world
    size (at each of ``world_sizes``, where given: their least common multiple). The sentence
    names every document that is not, and a fix that passes this rule, the documents' sum and
    the seqlen rule at once: ``--docs`` with each offending length moved to a multiple next to
    it, summing to the given seqlen where that can be done (else with the ``--seqlen`` they
    fill), padding them with ``--doc-pad`` under a causal mask, or llama3_varlen. With
    ``hf_model`` (``verify --model``, which fixes the seqlen and takes no padding) only the fixes
    that keep the seqlen are offered. Checked before the seqlen rule, whose fix alone cannot make
    the documents fit. Drawn documents (``doc_dist``) are left to the seqlen rule: they are drawn
    to the multiple once it holds. More than :data:`LISTED_DOCS` offending documents are
    summarised by length (:func:`_documents_phrase`).

    ``given`` may be partial: nothing is refused until variant, docs and world_size are given.
    """
    sizes = world_sizes or ([given["world_size"]] if "world_size" in given else [])
    if not given.get("variant") or not given.get("docs") or given.get("doc_dist") or not sizes:
        return None
    variant = get_variant(given["variant"])
    if not variant.shard_by_document:
        return None
    n = math.lcm(*(variant.seqlen_multiple(w) for w in sizes))
    if len(sizes) > 1:
        rule = (f"{n}, which {variant.name} needs for every document at every world size given "
                f"({', '.join(map(str, sizes))})")
    else:
        twice = "2 * " if variant.seqlen_multiple(1) == 2 else ""
        rule = f"{twice}world_size = {n}, which {variant.name} needs for every document"
    seqlen = fields.coerce("seqlen", given["seqlen"]) if isinstance(given.get("seqlen"), (int, str)) else None
    model = given.get("hf_model")
    if model and seqlen is None:  # the command's options before the model's fields join them
        from ringbench.case.models import load_model

        seqlen = load_model(model).seqlen
    real, pad = parse_docs(given["docs"]), given.get("doc_pad") or 0

    def padded(to: int) -> list[int]:
        return [-(-d // to) * to for d in real] if to else list(real)

    def fill(lengths: list[int]) -> str:  # the --seqlen they need, where the given one is not it
        return "" if sum(lengths) == seqlen else f" --seqlen {sum(lengths)}"

    lengths = padded(pad)
    bad = [i for i, d in enumerate(lengths) if d % n]
    if not bad:
        return None
    head = _documents_phrase(lengths, bad, pad)
    fixes = []  # (the fix, the --seqlen it needs or "", what follows it)
    if pad:
        fit = -(-pad // n) * n
        fixes.append((f"pass --doc-pad {fit}", fill(padded(fit)), ""))
    else:
        moved = _round_to_multiples(real, n, seqlen)
        fixes.append((f"pass --docs {','.join(map(str, moved))}", fill(moved), ""))
        if given.get("causal", True) is not False and not model:
            fixes.append((f"pad the documents with --doc-pad {n}", fill(padded(n)), ""))
    anywhere = get_variant("llama3_varlen")  # cuts the row, not each document: any lengths
    if sum(lengths) % math.lcm(*(anywhere.seqlen_multiple(w) for w in sizes)) == 0:
        fixes.append((f"use --variant {anywhere.name}", fill(lengths), ", which takes any document lengths"))
    # --model fixes the seqlen: a fix that needs another one is no fix there.
    offered = [fix + need + after for fix, need, after in fixes if not (model and need)]
    if not offered:
        offered = [f"check these documents without --model {model}"]
    return f"{head} of {rule}; {', '.join(offered[:-1])}{', or ' if len(offered) > 1 else ''}{offered[-1]}"


def _no_docs_message(spec: CaseSpec, variant) -> str:
    """The refusal of a varlen case without documents, its example documents filling the case's seqlen
    (the model's, under --model), each a multiple of what the variant needs."""
    n = variant.seqlen_multiple(spec.world_size)
    first = max(n, spec.seqlen // 4 // n * n)
    example = (f"{format_size(first)},{format_size(spec.seqlen - first)}" if first < spec.seqlen
               else format_size(spec.seqlen))
    whose = f"model {spec.hf_model}'s" if spec.hf_model else "seqlen"
    mean = max(n, spec.seqlen // 4) if spec.hf_model else max(n, min(4096, spec.seqlen // 4))
    return (f"{spec.variant} attends packed documents, but the case has none; pass --docs such as {example} "
            f"(lengths that sum to {whose} {spec.seqlen} tokens) or --doc-dist "
            f"lognormal:mean={format_size(mean)},sigma=1")


def _check_docs(spec: CaseSpec, variant) -> None:
    """Refuse documents a case's variant cannot take, or a varlen case without them (the padding
    and the per-document multiple of the documents --docs gives are :func:`check_fields`'s)."""
    docs = padded_docs(spec)
    if not variant.varlen:
        if docs is not None:
            given = "docs" if spec.docs else "doc_dist"
            # Only the varlen variants that take these documents at this shape (and, under --model,
            # that --model takes: not a peer whose adapter cannot run here).
            def takes(v) -> bool:
                return (v.varlen and v.check_docs(docs, spec.world_size) is None
                        and v.check(seqlen=spec.seqlen, world_size=spec.world_size, causal=spec.causal,
                                    heads=spec.heads, kv_heads=spec.kv_heads) is None
                        and not (spec.hf_model and v.model_refusal()))
            value = docs_text(spec.docs) if spec.docs else repr(spec.doc_dist)
            if spec.doc_pad and masks_documents(variant) and not spec.hf_model:
                raise SpecError(f"{spec.variant} is a batch variant and takes no documents padded by --doc-pad "
                                f"{spec.doc_pad} (it takes {given} {value} as a document mask over its batch row, "
                                "which needs no padding); drop --doc-pad, or use a varlen variant such as "
                                "zigzag_varlen")
            if spec.hf_model and masks_documents(variant):
                others = names(takes)
                raise SpecError(f"{given} {value} does not go with --model {spec.hf_model} on {spec.variant}, which "
                                "takes documents as a document mask and the model's layers fix their own masks; "
                                f"{f'use {others}, or ' if others else ''}drop --{given.replace('_', '-')}")
            # Without --model, the batch engines that take any mask take the documents as one.
            def packs(v) -> bool:
                return (masks_documents(v) and not spec.hf_model
                        and v.check(seqlen=spec.seqlen, world_size=spec.world_size, causal=spec.causal,
                                    heads=spec.heads, kv_heads=spec.kv_heads) is None)

            others = names(lambda v: takes(v) or packs(v))
            raise SpecError(f"{given} {value} is given, but {spec.variant} is a batch variant and "
                            f"takes no documents; {f'use {others}, or ' if others else ''}drop "
                            f"--{given.replace('_', '-')}")
        return
    if docs is None:
        raise SpecError(_no_docs_message(spec, variant))
    if spec.batch != 1:
        packers = names(masks_documents)
        raise SpecError(f"batch {spec.batch} is not 1, but {spec.variant} packs the documents into one row; "
                        f"pass --batch 1, or use a batch variant ({packers}) with --docs, which packs the same "
                        "documents into every row of the batch")
    total = sum(docs)
    if total != spec.seqlen and spec.doc_pad:
        raise SpecError(f"documents sum to {sum(spec_docs(spec))} tokens, {total} once each is padded to a "
                        f"multiple of doc_pad {spec.doc_pad}, but seqlen is {spec.seqlen}; the padded documents "
                        f"must fill the row, so pass --seqlen {total}")
    if total != spec.seqlen:
        raise SpecError(f"documents sum to {total} but seqlen is {spec.seqlen}; the documents must fill the row "
                        f"exactly, so pass --seqlen {total} or documents that sum to {spec.seqlen}")
    reason = variant.check_docs(docs, spec.world_size)
    if reason:
        raise SpecError(reason)
    if spec.mask and "mask" in variant.options:  # applied per document: the documents' rule
        reason = variant.options["mask"].check(variant, spec.mask, {"docs": docs, "layout": spec.layout})
        if reason:
            raise SpecError(reason)


def launch_world_size(case) -> int:
    """The processes a case's launch starts: 1 for an emulated case, else its world size."""
    return 1 if getattr(case, "emulate", False) else case.world_size
