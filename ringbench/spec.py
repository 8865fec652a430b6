"""The case specification: one run of one variant on one shape, and every check on it.

Everything here but :func:`resolve` and :func:`detect_device` is torch-free, so a bad
spec is refused in milliseconds, before any process starts. The kernel checks import
``ringbench.variants.kernels`` (and so torch) only when a concrete kernel is named.

That includes the packed documents of the varlen variants: :func:`resolve_docs` draws a
``doc_dist`` into ``docs`` with the case's seed, and :func:`validate` checks the documents
against the variant's rules (they fill the row, batch 1, the per-document multiple).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping

from ringbench.variants import ROTATE

#: Short dtype names users type, mapped to the ``torch`` attribute they mean.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
#: ``fwd`` times the forward pass; ``fwd_bwd`` the forward and backward pass.
MODES = ("fwd", "fwd_bwd")
TASKS = ("run", "verify")
DEVICES = ("cuda", "cpu")
#: The largest global seqlen accepted, in tokens (1024M).
MAX_SEQLEN = 2**30

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_SIZE_RE = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)([kKmM]?)")


class SpecError(ValueError):
    """A case specification (from the CLI or a scenario) that ringbench refuses.

    The message is one sentence: the field, the value, the rule and the fix.
    """


class Unavailable(SpecError):
    """The case's variant cannot run on this machine (its library is missing); a scenario
    records such cases as skipped, with the reason, instead of refusing the sweep."""


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


def plural(n: int, noun: str) -> str:
    """``1 case``, ``3 cases``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def format_size(count: int) -> str:
    """Write a token count the short way ``parse_size`` reads: 131072 -> ``128k``."""
    for suffix, unit in (("M", 1024**2), ("k", 1024)):
        if count % unit == 0 and count >= unit:
            return f"{count // unit}{suffix}"
    return str(count)


@dataclass(frozen=True)
class CaseSpec:
    """One case: a variant, a kernel and a shape on ``world_size`` ranks.

    Attributes:
        task: ``run`` (measure) or ``verify`` (compare against single-device attention).
        variant: a registry name, see ``ringbench.variants.list_variants``.
        kernel: a kernel name from ``ringbench.variants.kernels.KERNELS``; ``auto`` only
            before :func:`resolve`.
        device: ``cuda`` or ``cpu``.
        world_size: ranks in the context-parallel group.
        batch: sequences per batch (B).
        seqlen: global tokens per sequence (S), split across the ranks.
        heads: query heads (Hq).
        kv_heads: key/value heads (Hkv); divides ``heads`` (fewer than heads: GQA).
        head_dim: channels per head (D).
        dtype: ``bf16``, ``fp16``, ``fp32`` or ``fp64``.
        causal: apply a causal mask.
        mode: ``fwd`` or ``fwd_bwd``.
        iters: timed iterations (run only).
        warmup: untimed iterations before timing (run only).
        seed: seed of the random inputs.
        layout: the variant's layout when it takes more than one (llama3: ``zigzag`` or
            ``contiguous``); ``""`` means the variant's default.
        heads_k_stride: K/V heads gathered at a time by all-gather variants (llama3);
            ``0`` means all of them at once.
        docs: the packed documents of a varlen variant, their lengths in tokens separated by
            commas (sizes such as ``12k`` allowed, ``0`` for an empty document), in row order;
            they must sum to ``seqlen``. ``""``: none (every batch variant). :func:`resolve_docs`
            writes them as plain integers.
        doc_dist: a distribution to draw ``docs`` from with ``seed`` (see :func:`resolve_docs`):
            ``lognormal:mean=4k,sigma=1`` or ``uniform:min=512,max=8k``; ``""``: none.
        rotate: how torch_cp (PyTorch's context parallel) moves K/V: ``allgather`` or
            ``alltoall``; ``""`` means PyTorch's default, allgather.
        hf_model: verify only: a model of ``ringbench.models`` (``llama-tiny``) checked end to end
            through the Hugging Face adapter, loss and every gradient; its config fixes seqlen,
            batch, heads, kv_heads and head_dim. ``""``: the attention check.
    """

    task: str
    variant: str
    kernel: str
    device: str
    world_size: int
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    mode: str
    iters: int
    warmup: int
    seed: int
    layout: str = ""
    heads_k_stride: int = 0
    docs: str = ""
    doc_dist: str = ""
    rotate: str = ""
    hf_model: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the worker reads, field order as declared."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CaseSpec":
        """Build a spec from ``to_dict()`` output, checking each field's type.

        Raises:
            SpecError: a missing or unknown field, or a value of the wrong type.
        """
        names = field_names()
        unknown = [k for k in data if k not in names]
        if unknown:
            raise SpecError(f"field {unknown[0]!r} is not a case field; use one of {', '.join(names)}")
        missing = [k for k in names if k not in data and k not in _DEFAULTED]
        if missing:
            raise SpecError(f"field {missing[0]!r} is missing from the case; give every field of "
                            "CaseSpec.to_dict()")
        return cls(**{k: coerce_field(k, data[k]) for k in names if k in data})

    def case_id(self) -> str:
        """A stable 12-hex-digit sha1 of every field except iters, warmup and seed.

        Optional fields left at their defaults are left out, so ids stay those of records
        written before the field existed.
        """
        keyed = {k: v for k, v in self.to_dict().items()
                 if k not in ("iters", "warmup", "seed") and not (k in _DEFAULTED and v == _DEFAULTED[k])}
        blob = json.dumps(keyed, sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def replace(self, **changes: Any) -> "CaseSpec":
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def field_names() -> tuple[str, ...]:
    """CaseSpec's field names in declaration order."""
    return tuple(f.name for f in dataclasses.fields(CaseSpec))


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(CaseSpec)}
_DEFAULTED = {f.name: f.default for f in dataclasses.fields(CaseSpec)
              if f.default is not dataclasses.MISSING}
_TYPE_WORDS = {"int": "an integer", "bool": "true or false", "str": "a string"}


def coerce_field(name: str, value: Any) -> Any:
    """Check one field's type; ``seqlen`` also takes a size string such as ``128k``.

    Returns:
        The value, with ``seqlen`` turned into an int.

    Raises:
        SpecError: an unknown field, a value of the wrong type, or a bad size string.
    """
    kind = _FIELD_TYPES.get(name)
    if kind is None:
        raise SpecError(f"field {name!r} is not a case field; use one of {', '.join(field_names())}")
    if name == "seqlen" and isinstance(value, str):
        return parse_size(value)
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        raise SpecError(f"{name} {value!r} is a {type(value).__name__}, but {name} must be "
                        f"{_TYPE_WORDS[kind]}; fix its value")
    return value


def optional_field_defaults() -> dict[str, Any]:
    """The fields added after the first records, with the default older records hold."""
    return dict(_DEFAULTED)


def variant_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword options a case passes to its variant's ``attention`` beyond the contract."""
    options: dict[str, Any] = {}
    if spec.get("layout"):
        options["layout"] = spec["layout"]
    if spec.get("heads_k_stride"):
        options["heads_k_stride"] = spec["heads_k_stride"]
    if spec.get("rotate"):
        options["rotate"] = spec["rotate"]
    return options


def layout_of(spec: Mapping[str, Any], variant) -> str:
    """The layout a case's tensors are sharded in: its own, or else the variant's."""
    return spec.get("layout") or variant.layout


# --------------------------------------------------------------------------- defaults

CUDA_DEFAULTS: dict[str, Any] = {
    "batch": 1, "seqlen": 16 * 1024, "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16",
    "causal": True, "mode": "fwd_bwd", "kernel": "auto", "iters": 20, "warmup": 5, "seed": 0,
    "layout": "", "heads_k_stride": 0, "docs": "", "doc_dist": "", "rotate": "", "hf_model": "",
}
CPU_DEFAULTS: dict[str, Any] = {
    "world_size": 2, "batch": 1, "seqlen": 4 * 1024, "heads": 4, "kv_heads": 2, "head_dim": 32,
    "dtype": "fp32", "causal": True, "mode": "fwd_bwd", "kernel": "auto", "iters": 10, "warmup": 3,
    "seed": 0, "layout": "", "heads_k_stride": 0, "docs": "", "doc_dist": "", "rotate": "", "hf_model": "",
}


def default_fields(device: str, visible_gpus: int) -> dict[str, Any]:
    """Every field but ``task`` and ``variant`` at its default for ``device``.

    On cuda: world size = ``visible_gpus`` (at least 1), 32 heads, 8 kv heads, head dim 128,
    bf16, seqlen 16k, 20 iterations after 5 warm-ups. On cpu: world size 2, 4 heads,
    2 kv heads, head dim 32, fp32, seqlen 4k, 10 iterations after 3 warm-ups. Both: batch 1,
    causal, fwd_bwd, kernel auto, seed 0.

    Raises:
        SpecError: an unknown device.
    """
    check_fields({"device": device})
    if device == "cuda":
        return {"device": "cuda", "world_size": max(1, visible_gpus), **CUDA_DEFAULTS}
    return {"device": "cpu", **CPU_DEFAULTS}


def detect_device() -> tuple[str, int]:
    """Return ``("cuda", visible GPU count)`` when torch sees a GPU, else ``("cpu", 0)``.

    Imports torch (about two seconds), so call it only once a command needs it.
    """
    import torch

    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count()
    return "cpu", 0


# --------------------------------------------------------------------------- checks

def _one_of(name: str, value: Any, choices, flag: str) -> None:
    if value not in choices:
        raise SpecError(f"{name} {value!r} is unknown; pass {flag} with one of {', '.join(choices)}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        flag = "--" + name.replace("_", "-")
        word = "positive" if low == 1 else "zero or more"
        raise SpecError(f"{name} {value} must be {word}; pass {flag} {low} or more")


def check_fields(fields: Mapping[str, Any]) -> None:
    """Check each given field on its own, plus the variant's seqlen rule when it can.

    Needs no torch and accepts a partial mapping, so the CLI can refuse a bad option before
    it detects the device. The seqlen rule runs when variant, seqlen and world_size are
    all given.

    Raises:
        SpecError: the first refused field, in one sentence with the fix.
    """
    from ringbench.variants import get_variant

    for name, value in fields.items():
        value = coerce_field(name, value)
        if name == "task":
            _one_of(name, value, TASKS, "a task")
        elif name == "device":
            _one_of(name, value, DEVICES, "--device")
        elif name == "dtype":
            _one_of(name, value, tuple(DTYPES), "--dtype")
        elif name == "mode":
            _one_of(name, value, MODES, "--mode")
        elif name == "variant":
            try:
                get_variant(value)
            except ValueError as exc:
                raise SpecError(str(exc)) from None
        elif name == "seqlen" and value > MAX_SEQLEN:
            raise SpecError(f"seqlen {value} is above the limit of {MAX_SEQLEN} tokens; use a smaller size")
        elif name in ("world_size", "batch", "seqlen", "heads", "kv_heads", "head_dim", "iters"):
            _at_least(name, value, 1)
        elif name in ("warmup", "seed", "heads_k_stride"):
            _at_least(name, value, 0)
        elif name == "kernel" and not value:
            raise SpecError("kernel '' is empty; pass --kernel with a kernel name or auto")
        elif name == "docs" and value:
            parse_docs(value)
        elif name == "doc_dist" and value:
            parse_doc_dist(value)
        elif name == "rotate" and value:
            _one_of(name, value, ROTATE, "--rotate")
        elif name == "hf_model" and value:
            from ringbench.models import load_model

            load_model(value)
    if all(k in fields for k in ("variant", "seqlen", "world_size")):
        reason = get_variant(fields["variant"]).check(
            seqlen=coerce_field("seqlen", fields["seqlen"]), world_size=fields["world_size"],
            causal=fields.get("causal", True), layout=fields.get("layout") or None,
            heads_k_stride=fields.get("heads_k_stride", 0), kv_heads=fields.get("kv_heads"),
            rotate=fields.get("rotate", ""))
        if reason:
            raise SpecError(reason)


def validate(spec: CaseSpec, *, visible_gpus: int) -> None:
    """Refuse a spec that cannot run, before any process starts.

    Checks every field (see :func:`check_fields`), the variant's seqlen and mask rules,
    GQA support, ``heads % kv_heads == 0``, the GPU count on cuda, and, for a named kernel
    (not ``auto``), that it exists, runs on ``spec.device`` and takes the head dim and dtype.
    Whether the kernel is available on this machine is :func:`resolve`'s job.

    Args:
        spec: the case.
        visible_gpus: GPUs visible here; bounds ``world_size`` on cuda.

    Raises:
        SpecError: one sentence with the field, the value, the rule and the fix.
    """
    from ringbench.variants import get_variant

    check_fields(spec.to_dict())
    if spec.heads % spec.kv_heads:
        fit = max(d for d in range(1, spec.kv_heads + 1) if spec.heads % d == 0)
        raise SpecError(f"heads {spec.heads} is not a multiple of kv_heads {spec.kv_heads}; "
                        f"pass --kv-heads with a divisor of {spec.heads}, such as {fit}")
    variant = get_variant(spec.variant)
    for reason in (variant.check_device(spec.device), variant.check_kernel(spec.kernel)):
        if reason:
            raise SpecError(reason)
    _check_docs(spec, variant)
    if spec.hf_model:
        from ringbench.models import check_case

        check_case(spec)
    if spec.kv_heads != spec.heads and not variant.gqa:
        raise SpecError(f"kv_heads {spec.kv_heads} differs from heads {spec.heads}, but {spec.variant} "
                        f"does not support GQA; pass --kv-heads {spec.heads}")
    if spec.device == "cuda":
        if visible_gpus < 1:
            raise SpecError("device cuda needs a visible GPU and none is visible; run on a GPU "
                            "machine or pass --device cpu")
        if spec.world_size > visible_gpus:
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


def _kernels_for(device: str) -> list[str]:
    from ringbench.variants.kernels import KERNELS

    return [n for n, k in KERNELS.items() if k.device_type in (device, "any")]


def _check_kernel(spec: CaseSpec, kernel) -> None:
    """Refuse a kernel that cannot take ``spec``'s device, head dim, dtype or packed documents."""
    from ringbench.variants import get_variant

    if kernel.device_type not in (spec.device, "any"):
        raise SpecError(f"kernel {kernel.name!r} runs on {kernel.device_type}, not {spec.device}; "
                        f"pass --kernel with one of {', '.join(_kernels_for(spec.device))} or auto")
    if get_variant(spec.variant).varlen and kernel.check_varlen():
        raise SpecError(kernel.check_varlen())
    reason = kernel.check_head_dim(spec.head_dim)
    if reason:
        raise SpecError(f"{reason}; pass another --head-dim or --kernel")
    taken = [short for short, long in DTYPES.items() if any(str(d) == f"torch.{long}" for d in kernel.dtypes)]
    if spec.dtype not in taken:
        raise SpecError(f"dtype {spec.dtype} is not supported by the {kernel.name} kernel, which takes "
                        f"{' and '.join(taken) if len(taken) < 3 else ', '.join(taken)}; "
                        f"pass --dtype {taken[0]}")


def canonical(spec: CaseSpec) -> CaseSpec:
    """``spec`` with options that restate a default written as the default (``layout`` equal
    to the variant's own, ``heads_k_stride`` equal to kv_heads, ``rotate`` allgather), so one computation has one
    case_id."""
    from ringbench.variants import get_variant

    changes: dict[str, Any] = {}
    if spec.layout and spec.layout == get_variant(spec.variant).layout:
        changes["layout"] = ""
    if spec.heads_k_stride and spec.heads_k_stride == spec.kv_heads:
        changes["heads_k_stride"] = 0
    if spec.rotate == ROTATE[0]:
        changes["rotate"] = ""
    return spec.replace(**changes) if changes else spec


def resolve(spec: CaseSpec) -> CaseSpec:
    """Pick the concrete kernel for ``spec`` on this machine; imports torch.

    ``auto`` becomes the first kernel in ``variants.kernels.AUTO_ORDER[device]`` that is
    available here and takes the spec's head dim and dtype (and, for a varlen variant, has a
    varlen form). A named kernel must be available here.

    Returns:
        ``spec`` with ``kernel`` set to a concrete name.

    Raises:
        Unavailable: the variant's library is missing here (with the reason).
        SpecError: the named kernel is unavailable (with the reason), or no kernel fits.
    """
    from ringbench.variants import get_variant
    from ringbench.variants.kernels import AUTO_ORDER, resolve_kernel

    variant = get_variant(spec.variant)
    reason = variant.unavailable()
    if reason:
        raise Unavailable(f"variant {spec.variant} is unavailable here: {reason}")

    if spec.kernel != "auto":
        _check_kernel(spec, _named_kernel(spec.kernel))
        try:
            resolve_kernel(spec.kernel, spec.device)
        except ValueError as exc:
            raise SpecError(f"{exc}; pass another --kernel or auto") from None
        return spec
    refusals = []
    for name in AUTO_ORDER[spec.device]:
        if variant.check_kernel(name):
            continue
        try:
            kernel = resolve_kernel(name, spec.device)
            _check_kernel(spec, kernel)
        except ValueError as exc:
            refusals.append(str(exc).split(";")[0])
            continue
        return spec.replace(kernel=kernel.name)
    raise SpecError(f"kernel auto found no kernel on {spec.device} for head_dim {spec.head_dim} and "
                    f"dtype {spec.dtype} ({'; '.join(refusals)}); change --dtype or --head-dim")


# --------------------------------------------------------------------------- packed documents

_DIST_KEYS = {"lognormal": ("mean", "sigma"), "uniform": ("min", "max")}
_DIST_EXAMPLE = "lognormal:mean=4k,sigma=1 or uniform:min=512,max=8k"


def parse_docs(text: str) -> list[int]:
    """Parse document lengths such as ``3000,500,12k`` into ints (``[3000, 500, 12288]``).

    Args:
        text: comma-separated sizes as :func:`parse_size` reads them, or ``0`` for an empty
            document; spaces around entries are ignored.

    Returns:
        The lengths in tokens, in row order.

    Raises:
        SpecError: an empty list or entry, or an entry that is not a size (the message gives
            its position).
    """
    entries = [e.strip() for e in str(text).split(",")]
    if not any(entries):
        raise SpecError(f"docs {text!r} is empty; pass document lengths separated by commas, such as 3000,500,12k")
    docs = []
    for i, entry in enumerate(entries):
        if entry == "":
            raise SpecError(f"docs {text!r} has an empty entry at position {i + 1}; separate lengths by single "
                            "commas, such as 3000,500,12k")
        docs.append(0 if entry == "0" else parse_size(entry, name=f"docs entry {i + 1}"))
    return docs


def parse_doc_dist(text: str) -> tuple[str, dict[str, float]]:
    """Parse a document distribution such as ``lognormal:mean=4k,sigma=1``.

    Args:
        text: ``lognormal:mean=M,sigma=S`` (M a size: the mean document length in tokens; S
            the sigma of the length's logarithm, 0 or more) or ``uniform:min=A,max=B`` (sizes,
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


def _doc_multiple(spec: CaseSpec) -> int:
    """The multiple every document length must be for ``spec``'s variant (1: any length)."""
    from ringbench.variants import VARIANTS, LAYOUT_CHUNKS

    variant = VARIANTS.get(spec.variant)
    if variant is None or not variant.shard_by_document:
        return 1
    return LAYOUT_CHUNKS[variant.layout] * spec.world_size


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


def spec_docs(spec: CaseSpec | Mapping[str, Any]) -> list[int] | None:
    """The document lengths of a case (a spec or its dict), or ``None`` when it has none.

    ``docs`` when given, else ``doc_dist`` drawn as :func:`resolve_docs` does.

    Raises:
        SpecError: a malformed ``docs`` or ``doc_dist``.
    """
    if isinstance(spec, CaseSpec):
        spec_obj = spec
    else:
        spec_obj = CaseSpec.from_dict({k: v for k, v in spec.items() if k in field_names()})
    spec_obj = resolve_docs(spec_obj)
    return parse_docs(spec_obj.docs) if spec_obj.docs else None


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


def _check_docs(spec: CaseSpec, variant) -> None:
    """Refuse documents a case's variant cannot take, or a varlen case without them."""
    docs = spec_docs(spec)
    if not variant.varlen:
        if docs is not None:
            given = "docs" if spec.docs else "doc_dist"
            raise SpecError(f"{given} {getattr(spec, given)!r} is given, but {spec.variant} is a batch variant and "
                            "takes no documents; use ring_varlen, zigzag_varlen or llama3_varlen, or drop "
                            f"--{given.replace('_', '-')}")
        return
    if docs is None:
        raise SpecError(f"{spec.variant} attends packed documents, but the case has none; pass --docs 3000,500,12k "
                        "(lengths that sum to --seqlen) or --doc-dist lognormal:mean=4k,sigma=1")
    if spec.batch != 1:
        raise SpecError(f"batch {spec.batch} is not 1, but {spec.variant} packs the documents into one row; "
                        "pass --batch 1")
    total = sum(docs)
    if total != spec.seqlen:
        raise SpecError(f"documents sum to {total} but seqlen is {spec.seqlen}; the documents must fill the row "
                        f"exactly, so pass --seqlen {total} or documents that sum to {spec.seqlen}")
    reason = variant.check_docs(docs, spec.world_size)
    if reason:
        raise SpecError(reason)
