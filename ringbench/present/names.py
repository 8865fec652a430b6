"""Names a narrow table writes shorter (``tflash`` for ``torch-flash``, ``L1.in_norm`` for a model
parameter), and the legend that spells out each one it used. Torch-free and pandas-free.
"""

from __future__ import annotations

import re
from typing import Any

from rich.text import Text

#: Known names a table writes shorter when, in full, some word would not fit its column on a
#: narrow terminal; the table's legend spells out each one it used. Field names are shortened
#: as the case labels write them (``W=2``, ``KV=8``, ``D=128``, ``stride=1``).
ABBREVIATIONS: dict[str, str] = {
    "torch-flash": "tflash",
    "torch-efficient": "teff",
    "flash-attn": "fattn",
    "llama3_varlen": "l3_varlen",
    "zigzag_varlen": "zz_varlen",
    "ring_varlen": "r_varlen",
    "rfa_llama3_varlen": "rfa_l3_varlen",
    "world_size": "W",
    "kv_heads": "KV",
    "head_dim": "D",
    "heads_k_stride": "stride",
    "doc_dist": "dist",
    "hf_model": "model",
}
#: Words of model parameter names (``model.layers.1.input_layernorm.weight``) written shorter,
#: beside ``layers.<n>`` -> ``L<n>`` and the leading ``model.`` and trailing ``.weight`` left out
#: (``L1.in_norm``): what tells two parameters apart stays.
PARAM_WORDS: dict[str, str] = {
    "self_attn": "attn",
    "input_layernorm": "in_norm",
    "post_attention_layernorm": "post_norm",
    "embed_tokens": "embed",
}
#: A name in a cell: letters, digits, ``_``, ``.`` and ``-``; only whole names are replaced.
_NAME = re.compile(r"[\w.\-]+")
_PARAM = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


def short_param(name: str) -> str:
    """A model parameter's name the short way (``model.layers.1.input_layernorm.weight`` ->
    ``L1.in_norm``, ``model.layers.0.self_attn.q_proj.weight`` -> ``L0.attn.q_proj``); a name
    that is not a dotted parameter path comes back as it is."""
    return Names(short=True).word(name)


class Names:
    """Writes the names in a table in full or, when ``short``, with :data:`ABBREVIATIONS` and
    short parameter names (:data:`PARAM_WORDS`), and remembers what it shortened for the legend.

    Only whole names are replaced (``torch-flash`` in ``zigzag torch-flash``, not inside a
    longer name), so every name in a table is either whole or a declared abbreviation.
    """

    def __init__(self, short: bool) -> None:
        self.short = short
        self.used: dict[str, str] = {}  # abbreviation -> full name, in order of first use
        self.param_rules: dict[str, None] = {}  # parameter rules used, in order

    def word(self, name: str) -> str:
        """One name, shortened when ``short`` and known."""
        if not self.short:
            return name
        if name in ABBREVIATIONS:
            self.used.setdefault(ABBREVIATIONS[name], name)
            return ABBREVIATIONS[name]
        if not _PARAM.fullmatch(name):
            return name
        parts, out = name.split("."), []
        if parts[0] == "model" and len(parts) > 1:
            parts = parts[1:]
            self.param_rules.setdefault("model. left out")
        if parts[-1] == "weight" and len(parts) > 1:
            parts = parts[:-1]
            self.param_rules.setdefault(".weight left out")
        i = 0
        while i < len(parts):
            if parts[i] == "layers" and i + 1 < len(parts) and parts[i + 1].isdigit():
                out.append(f"L{parts[i + 1]}")
                self.param_rules.setdefault("L<n> = layers.<n>")
                i += 2
                continue
            if parts[i] in PARAM_WORDS:
                self.param_rules.setdefault(f"{PARAM_WORDS[parts[i]]} = {parts[i]}")
            out.append(PARAM_WORDS.get(parts[i], parts[i]))
            i += 1
        return ".".join(out)

    def text(self, value: str) -> str:
        """Every name in ``value`` as :meth:`word` writes it."""
        return _NAME.sub(lambda m: self.word(m.group()), value) if self.short else value

    def cell(self, value: Any) -> Any:
        """A cell or header with its names written as :meth:`text` does; rich text keeps its
        style where a name was shortened in it; other renderables as they are."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Text) and self.short:
            short = self.text(value.plain)
            if short != value.plain:  # the spans no longer line up; the style of the whole stays
                return Text(short, style=value.style, justify=value.justify, no_wrap=value.no_wrap)
        return value

    def legend(self) -> str | None:
        """``abbreviations: tflash = torch-flash, W = world_size; in parameter names: ...``;
        None when nothing was shortened."""
        parts = []
        if self.used:
            parts.append("abbreviations: " + ", ".join(f"{s} = {full}" for s, full in self.used.items()))
        if self.param_rules:
            parts.append("in parameter names: " + ", ".join(self.param_rules))
        return "; ".join(parts) or None
