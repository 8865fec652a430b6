"""The models that ``ringbench verify --model`` runs end to end, and their cases.

A model is a TOML file under ``scenarios/models/`` (package data, ``ringbench.builtin_scenarios``):
``description``, ``seqlen`` and ``batch`` (the tokens of the check), and ``[config]``, the
keyword arguments of ``transformers.LlamaConfig``. The weights are random (the case's seed), so
nothing is downloaded. Torch-free and transformers-free, so a bad request is refused before
any process starts.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ringbench.errors import SpecError, install_hint

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

#: What the CLI says when transformers is missing: the editable form inside the checkout, where
#: the README installs ringbench (:func:`ringbench.errors.install_hint`).
MISSING_EXTRA = ("verify --model needs transformers, which is not installed; install the hf extra with "
                 f"{install_hint('hf')}")


@dataclass(frozen=True)
class ModelSpec:
    """A model of ``scenarios/models/``.

    Attributes:
        name: its file name without ``.toml`` (``llama-tiny``).
        description: one line.
        seqlen: global tokens per row of the check (S).
        batch: rows (B).
        config: ``transformers.LlamaConfig`` keyword arguments.
    """

    name: str
    description: str
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

    def parameter_count(self) -> int:
        """Parameters of the Llama architecture this config builds (untied embeddings unless tied)."""
        c = self.config
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        attn = hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attn + 3 * hidden * inter + 2 * hidden
        embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
        return c["num_hidden_layers"] * layer + embeddings + hidden


def _folder():
    return resources.files("ringbench.builtin_scenarios").joinpath("models")


def list_models() -> list[str]:
    """Names of the shipped models."""
    return sorted(p.name[:-5] for p in _folder().iterdir() if p.name.endswith(".toml"))


def load_model(name: str) -> ModelSpec:
    """Read the shipped model ``name``.

    Raises:
        SpecError: no such model (the message lists them), or a file without the fields above.
    """
    path = _folder().joinpath(f"{name}.toml")
    if "/" in name or not path.is_file():
        raise SpecError(f"model {name!r} is unknown; pass --model with one of {', '.join(list_models())}")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    try:
        return ModelSpec(name=name, description=str(data.get("description", "")), seqlen=int(data["seqlen"]),
                         batch=int(data.get("batch", 1)), config=dict(data["config"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"model file {name}.toml lacks or mistypes {exc}; give seqlen, batch and [config]") from None


def transformers_missing() -> bool:
    """Whether transformers cannot be imported here (checked without importing it)."""
    try:
        return importlib.util.find_spec("transformers") is None
    except (ImportError, ValueError):
        return True


def case_fields(name: str) -> dict[str, Any]:
    """The case fields a model fixes: ``hf_model``, seqlen, batch, heads, kv_heads, head_dim, causal, mode."""
    m = load_model(name)
    return {"hf_model": name, "seqlen": m.seqlen, "batch": m.batch, "heads": m.heads, "kv_heads": m.kv_heads,
            "head_dim": m.head_dim, "causal": True, "mode": "fwd_bwd"}


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
    single device, context parallel) of ``6 * parameters * tokens`` each, plus attention."""
    m = load_model(spec.hf_model)
    tokens = m.batch * m.seqlen
    attention = 4 * m.batch * m.seqlen ** 2 * m.heads * m.head_dim * 3.5 * m.config["num_hidden_layers"]
    return 3 * (6 * m.parameter_count() * tokens + attention)
