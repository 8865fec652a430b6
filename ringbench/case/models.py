"""The models that ``ringbench verify --model`` runs end to end, and their cases.

A model is a TOML file under ``scenarios/models/`` (package data, ``ringbench.builtin_scenarios``):
``description``, ``architecture`` (a key of :data:`ARCHITECTURES`; ``llama`` when left out),
``seqlen`` and ``batch`` (the tokens of the check), and ``[config]``, the keyword arguments of
the architecture's transformers config class. A model with sliding-window layers names them in
``config.layer_types`` (``"sliding_attention"``, ``"full_attention"``) beside
``config.sliding_window``, so their windows can be read here without transformers. The weights
are random (the case's seed), so nothing is downloaded. Torch-free and transformers-free, so a
bad request is refused before any process starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ringbench.errors import SpecError, install_hint
from ringbench.variants import VARIANTS, get_variant, listed, plural, ulysses_rule

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: What the CLI says when transformers is missing: the editable form inside the checkout, where
#: the README installs ringbench (:func:`ringbench.errors.install_hint`).
MISSING_EXTRA = ("verify --model needs transformers, which is not installed; install the hf extra with "
                 f"{install_hint('hf')}")

@dataclass(frozen=True)
class Architecture:
    """A transformers model family that the model check builds.

    Attributes:
        name: the model file's ``architecture`` (``gpt_oss``).
        config, model: the names of its config class and causal LM class in ``transformers``.
        since: the first transformers release that has both (``"4.55"``).
        sinks: each attention layer has a learnable sink logit per query head (gpt-oss's
            ``sinks``, passed to the attention as ``s_aux``).
        qkv_bias, o_bias: its q, k, v (and o) projections have biases (for the parameter count).
        experts: its MLP is a mixture of experts (gpt-oss: a router, then experts with biases).
    """

    name: str
    config: str
    model: str
    since: str
    sinks: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    experts: bool = False


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "LlamaConfig", "LlamaForCausalLM", "4.48"),
    Architecture("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "4.48", qkv_bias=True),
    Architecture("gpt_oss", "GptOssConfig", "GptOssForCausalLM", "4.55", sinks=True, qkv_bias=True, o_bias=True,
                 experts=True),
)}


@dataclass(frozen=True)
class ModelSpec:
    """A model of ``scenarios/models/``.

    Attributes:
        name: its file name without ``.toml`` (``llama-tiny``).
        description: one line.
        architecture: its :class:`Architecture`.
        seqlen: global tokens per row of the check (S).
        batch: rows (B).
        config: the architecture's config keyword arguments.
    """

    name: str
    description: str
    architecture: Architecture
    seqlen: int
    batch: int
    config: dict

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads", self.heads))

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim", self.config["hidden_size"] // self.heads))

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's causal sliding window in keys (query p sees keys p - L + 1 .. p, transformers'
        ``sliding_window``), 0 for a layer that sees every key before it."""
        types = self.config.get("layer_types") or ["full_attention"] * self.layers
        return tuple(int(self.config["sliding_window"]) if t == "sliding_attention" else 0 for t in types)

    @property
    def window(self) -> int:
        """The sliding layers' window (the case's ``window``), 0 when no layer has one."""
        return max(self.layer_windows)

    @property
    def sink(self) -> str:
        """The case's ``sink``: ``learnable`` for an architecture with sink parameters, else ``none``."""
        return "learnable" if self.architecture.sinks else "none"

    def window_text(self) -> str:
        """``a sliding window of 40 keys on layer 2 of 2`` (or ``on every layer``, ``on layers 1 and 3 of 4``)."""
        sliding = [str(i + 1) for i, w in enumerate(self.layer_windows) if w]
        where = ("every layer" if len(sliding) == self.layers else
                 f"{plural(len(sliding), 'layer', bare=True)} {listed(sliding)} of {self.layers}")
        return f"a sliding window of {self.window} keys on {where}"

    def parameter_count(self) -> int:
        """Parameters of the model this config builds (untied embeddings unless tied)."""
        c, a = self.config, self.architecture
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        qkv = self.head_dim * (self.heads + 2 * self.kv_heads)
        attn = hidden * qkv + self.heads * self.head_dim * hidden + (qkv if a.qkv_bias else 0)
        attn += (hidden if a.o_bias else 0) + (self.heads if a.sinks else 0)
        if a.experts:  # a router (weight and bias), then per expert gate/up and down, each with a bias
            experts = int(c["num_local_experts"])
            mlp = experts * (hidden + 1) + experts * (hidden * 2 * inter + 2 * inter + inter * hidden + hidden)
        else:
            mlp = 3 * hidden * inter
        layer = attn + mlp + 2 * hidden
        embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
        return self.layers * layer + embeddings + hidden


def _folder():
    return resources.files("ringbench.builtin_scenarios").joinpath("models")


def list_models() -> list[str]:
    """Names of the shipped models."""
    return sorted(p.name[:-5] for p in _folder().iterdir() if p.name.endswith(".toml"))


def load_model(name: str) -> ModelSpec:
    """Read the shipped model ``name``.

    Raises:
        SpecError: no such model (the message lists them), or a file without the fields above
            (an unknown architecture; sliding layers without a window, or layer types that do
            not count the layers).
    """
    path = _folder().joinpath(f"{name}.toml")
    if "/" in name or not path.is_file():
        raise SpecError(f"model {name!r} is unknown; pass --model with one of {', '.join(list_models())}")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    arch = str(data.get("architecture", "llama"))
    if arch not in ARCHITECTURES:
        raise SpecError(f"model file {name}.toml names architecture {arch!r}, which the model check does not build; "
                        f"use one of {', '.join(ARCHITECTURES)}")
    try:
        model = ModelSpec(name=name, description=str(data.get("description", "")), architecture=ARCHITECTURES[arch],
                          seqlen=int(data["seqlen"]), batch=int(data.get("batch", 1)), config=dict(data["config"]))
        types = model.config.get("layer_types")
        if types is not None and len(types) != model.layers:
            raise ValueError(f"layer_types lists {len(types)} layers, not num_hidden_layers {model.layers}")
        model.layer_windows  # noqa: B018 (reads sliding_window where a layer slides)
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"model file {name}.toml lacks or mistypes {exc}; give seqlen, batch and [config]") from None
    return model


def transformers_missing() -> bool:
    """Whether transformers cannot be imported here (checked without importing it)."""
    try:
        return importlib.util.find_spec("transformers") is None
    except (ImportError, ValueError):
        return True


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:2])


def architecture_refusal(name: str) -> str | None:
    """Why the installed transformers cannot build model ``name`` (its release predates the
    architecture), in one sentence, or ``None``; read from the package's metadata, not imported."""
    model = load_model(name)
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None  # transformers_missing's refusal
    since = model.architecture.since
    if _release(installed) >= _release(since):
        return None
    return (f"model {name} is a {model.architecture.name} model, which transformers builds from release {since} on, "
            f"but {installed} is installed; upgrade it with pip install -U 'transformers>={since}'")


def case_fields(name: str) -> dict[str, Any]:
    """The case fields a model fixes: ``hf_model``, seqlen, batch, heads, kv_heads, head_dim, causal,
    mode, and its sliding layers' ``window`` and its ``sink``."""
    m = load_model(name)
    return {"hf_model": name, "seqlen": m.seqlen, "batch": m.batch, "heads": m.heads, "kv_heads": m.kv_heads,
            "head_dim": m.head_dim, "causal": True, "mode": "fwd_bwd", "window": m.window, "sink": m.sink}


def clash_refusal(name: str, field: str, option: str) -> str:
    """The sentence refusing ``option`` (the command-line form of ``field``, one the model fixes) under
    ``--model name``."""
    m = load_model(name)
    if field == "window":
        what = f"which has {m.window_text()} from its config" if m.window else "which has no sliding window"
    elif field == "sink":
        what = ("whose attention layers have their own learnable sinks" if m.sink == "learnable" else
                "which has no attention sink")
    else:
        what = f"which fixes {field} at {case_fields(name)[field]!r}"
    return f"{option} does not go with --model {name}, {what}; drop {option}"


#: Why ``doc_pad`` is refused with a model.
PADDING = ("the model check feeds the documents of --docs to the model unpadded, as a training step packs them; "
           "drop --doc-pad, or check padded attention alone without --model")


def _takers(model: ModelSpec) -> list[str]:
    """The variants the model check can run on ``model``: ringbench's adapter takes them, with the
    model's window and sinks."""
    return [n for n, v in VARIANTS.items() if (v.takes_window or not model.window) and (v.sink or model.sink == "none")
            and not v.session and not v.model_check]


def variant_refusal(name: str, variant: str) -> str | None:
    """Why ``verify --model name`` cannot check ``variant``, in one sentence, or ``None``: the
    adapter cannot run it (``Variant.model_refusal``), or it takes no sliding window or no sink
    where the model has one.

    Raises:
        SpecError: an unknown model.
        ValueError: an unknown variant.
    """
    m, v = load_model(name), get_variant(variant)
    reason = v.model_refusal()
    if reason:
        return reason
    lacks = [what for what, needed, has in (
        (m.window_text(), m.window, v.takes_window),
        ("a learnable sink per query head", m.sink != "none", v.sink)) if needed and not has]
    if not lacks:
        return None
    others = listed(_takers(m), "or")
    return (f"{variant} cannot take what model {name}'s attention layers need ({listed(lacks)}); use {others}, or "
            "a model without them such as llama-tiny")


def world_size_refusal(name: str, variant: str, world_size: int) -> str | None:
    """Why ``variant`` cannot check model ``name`` at ``world_size``, in one sentence whose fix is a
    world size that fits, or ``None``: the model's seqlen must be a multiple of the variant's
    ``seqlen_multiple`` there, and a whole-group Ulysses (ulysses) must split its heads over the
    world size (:func:`ringbench.variants.ulysses_rule`). The model fixes the seqlen and heads,
    so a world size is the fix."""
    m, v = load_model(name), get_variant(variant)

    def why(w: int) -> str | None:
        n = v.seqlen_multiple(w)
        if m.seqlen % n:
            return f"its {m.seqlen} tokens are not a multiple of {n}, which {variant} needs at that size"
        if v.ulysses == "world" and ulysses_rule(m.heads, m.kv_heads, w, variant, world_size=w, whole=True):
            return (f"{variant} runs Ulysses over every rank, which needs a world size that divides its {m.heads} "
                    f"query heads and divides its {m.kv_heads} K/V heads or is a multiple of them")
        return None

    reason = why(world_size)
    if reason is None:
        return None
    fits = [w for w in range(2, 65) if why(w) is None][:2]
    fix = f"pass --world-size {' or '.join(map(str, fits))}" if fits else f"check {variant} without --model"
    return f"world_size {world_size} does not fit model {name}: {reason}; {fix}"


def check_case(spec) -> None:
    """Refuse a case whose shape fields disagree with its ``hf_model`` (say, from a scenario file).

    Raises:
        SpecError: an unknown model, a task other than verify, or a field that is not the model's.
    """
    if spec.task != "verify":
        raise SpecError(f"hf_model {spec.hf_model!r} is a verify check; {spec.task} takes no model")
    for key, value in case_fields(spec.hf_model).items():
        if getattr(spec, key) != value:
            raise SpecError(f"{key} {getattr(spec, key)!r} is not model {spec.hf_model}'s {value!r}; leave {key} "
                            "to the model")


def estimated_check_flops(spec) -> float:
    """An estimate of the FLOPs of a model check: three forward and backward passes (float64 reference,
    single device, context parallel) of ``6 * parameters * tokens`` each, plus attention over the
    pairs each layer's window leaves."""
    m = load_model(spec.hf_model)
    tokens = m.batch * m.seqlen
    pairs = sum(m.seqlen ** 2 if not w else min(m.seqlen ** 2, 2 * m.seqlen * w - w * w) for w in m.layer_windows)
    attention = 4 * m.batch * pairs * m.heads * m.head_dim * 3.5
    return 3 * (6 * m.parameter_count() * tokens + attention)
