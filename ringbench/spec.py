"""The case specification: one run of one variant on one shape, and every check on it.

Everything here but :func:`resolve` and :func:`detect_device` is torch-free, so a bad
spec is refused in milliseconds, before any process starts. The kernel checks import
``ringbench.variants.kernels`` (and so torch) only when a concrete kernel is named.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping

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


def variant_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword options a case passes to its variant's ``attention`` beyond the contract."""
    options: dict[str, Any] = {}
    if spec.get("layout"):
        options["layout"] = spec["layout"]
    if spec.get("heads_k_stride"):
        options["heads_k_stride"] = spec["heads_k_stride"]
    return options


def layout_of(spec: Mapping[str, Any], variant) -> str:
    """The layout a case's tensors are sharded in: its own, or else the variant's."""
    return spec.get("layout") or variant.layout


# --------------------------------------------------------------------------- defaults

CUDA_DEFAULTS: dict[str, Any] = {
    "batch": 1, "seqlen": 16 * 1024, "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16",
    "causal": True, "mode": "fwd_bwd", "kernel": "auto", "iters": 20, "warmup": 5, "seed": 0,
    "layout": "", "heads_k_stride": 0,
}
CPU_DEFAULTS: dict[str, Any] = {
    "world_size": 2, "batch": 1, "seqlen": 4 * 1024, "heads": 4, "kv_heads": 2, "head_dim": 32,
    "dtype": "fp32", "causal": True, "mode": "fwd_bwd", "kernel": "auto", "iters": 10, "warmup": 3,
    "seed": 0, "layout": "", "heads_k_stride": 0,
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
    if all(k in fields for k in ("variant", "seqlen", "world_size")):
        reason = get_variant(fields["variant"]).check(
            seqlen=coerce_field("seqlen", fields["seqlen"]), world_size=fields["world_size"],
            causal=fields.get("causal", True), layout=fields.get("layout") or None,
            heads_k_stride=fields.get("heads_k_stride", 0), kv_heads=fields.get("kv_heads"))
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
    """Refuse a kernel that cannot take ``spec``'s device, head dim or dtype."""
    if kernel.device_type not in (spec.device, "any"):
        raise SpecError(f"kernel {kernel.name!r} runs on {kernel.device_type}, not {spec.device}; "
                        f"pass --kernel with one of {', '.join(_kernels_for(spec.device))} or auto")
    reason = kernel.check_head_dim(spec.head_dim)
    if reason:
        raise SpecError(f"{reason}; pass another --head-dim or --kernel")
    taken = [short for short, long in DTYPES.items() if any(str(d) == f"torch.{long}" for d in kernel.dtypes)]
    if spec.dtype not in taken:
        raise SpecError(f"dtype {spec.dtype} is not supported by the {kernel.name} kernel, which takes "
                        f"{' and '.join(taken) if len(taken) < 3 else ', '.join(taken)}; "
                        f"pass --dtype {taken[0]}")


def resolve(spec: CaseSpec) -> CaseSpec:
    """Pick the concrete kernel for ``spec`` on this machine; imports torch.

    ``auto`` becomes the first kernel in ``variants.kernels.AUTO_ORDER[device]`` that is
    available here and takes the spec's head dim and dtype. A named kernel must be
    available here.

    Returns:
        ``spec`` with ``kernel`` set to a concrete name.

    Raises:
        SpecError: the named kernel is unavailable (with the reason), or no kernel fits.
    """
    from ringbench.variants.kernels import AUTO_ORDER, resolve_kernel

    if spec.kernel != "auto":
        _check_kernel(spec, _named_kernel(spec.kernel))
        try:
            resolve_kernel(spec.kernel, spec.device)
        except ValueError as exc:
            raise SpecError(f"{exc}; pass another --kernel or auto") from None
        return spec
    refusals = []
    for name in AUTO_ORDER[spec.device]:
        try:
            kernel = resolve_kernel(name, spec.device)
            _check_kernel(spec, kernel)
        except ValueError as exc:
            refusals.append(str(exc).split(";")[0])
            continue
        return spec.replace(kernel=kernel.name)
    raise SpecError(f"kernel auto found no kernel on {spec.device} for head_dim {spec.head_dim} and "
                    f"dtype {spec.dtype} ({'; '.join(refusals)}); change --dtype or --head-dim")
