"""The tables of ``docs/`` that are generated from the registries, and the command that rewrites them.

Each generated table sits in its page between two markers, ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->``, so a page keeps its own prose around it:

- ``fields`` in ``docs/contracts.md``: :func:`ringbench.case.fields.markdown_table`, the case fields;
- ``variants`` in ``docs/variants-and-kernels.md``: :func:`variants_table`, from
  :data:`ringbench.variants.VARIANTS`;
- ``kernels`` in ``docs/variants-and-kernels.md``: :func:`kernels_table`, from the kernel registry
  (:data:`ringbench.variants.kernels.KERNELS` and its ``AUTO_ORDER``);
- ``fabrics`` in ``docs/predict.md``: :func:`fabrics_table`, the fabric table of ``ringbench predict``.

``tests/test_docs.py`` fails when a page's table differs from what these functions give;
``python -m ringbench.present.doc_tables`` (from the checkout's root) writes them in place.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

#: The checkout's docs/ folder (this file is ringbench/present/doc_tables.py).
DOCS = Path(__file__).resolve().parents[2] / "docs"

#: The command that rewrites every generated table, as the stale-table message names it.
REGENERATE = "python -m ringbench.present.doc_tables"


def _fields_table() -> str:
    from ringbench.case import fields

    return fields.markdown_table()


def _takes(variant) -> str:
    """What a variant takes, in words and options: its form, its masks, the options it reads."""
    from ringbench.case import fields

    took = ["packed documents" if variant.varlen else "batch"]
    if not variant.non_causal:
        took.append("causal only")
    elif not variant.causal:
        took.append("non-causal only")
    else:
        took.append("causal and non-causal")
    # The declared options, read from the one declaration (``Variant.options``).
    options = [fields.BY_NAME[name].option for name in variant.options]
    options += ["--head-dim-v"] * variant.head_dim_v + ["--emulate"] * variant.emulates
    took += [f"`{option}`" for option in options]
    if variant.expands_kv:
        took.append("GQA through K/V expanded to the query heads")
    if tuple(variant.devices) != ("cpu", "cuda"):
        took.append(f"{' and '.join(variant.devices)} only")
    if variant.kernels:
        took.append(f"kernels {', '.join(variant.kernels)}")
    return "; ".join(took)


def variants_table() -> str:
    """The variant table of ``docs/variants-and-kernels.md``: name, layout, what it takes, summary.

    One row per user-facing variant (:data:`ringbench.variants.VARIANTS`, never the test-only
    ones), in registry order. The layout column lists the variant's own layout first, then the
    others ``--layout`` may pick.
    """
    from ringbench.variants import VARIANTS

    rows = ["| variant | layout | takes | summary |", "|---|---|---|---|"]
    for name, variant in VARIANTS.items():
        layouts = " or ".join(f"`{layout}`" for layout in (variant.layout, *variant.layouts))
        rows.append(f"| `{name}` | {layouts} | {_takes(variant)} | {variant.summary} |")
    return "\n".join(rows) + "\n"


def _ordinal(n: int) -> str:
    return f"{n}{'st' if n == 1 else 'nd' if n == 2 else 'rd' if n == 3 else 'th'}"


def kernels_table() -> str:
    """The kernel table of ``docs/variants-and-kernels.md``: what each kernel declares in the registry.

    Columns: the kernel, its device type, the input dtypes it takes, its head-dim rule, whether it
    has the packed-documents form, takes a sliding window, how it takes a mask (``--mask``: one call
    per partial block with the block's mask, ``takes_mask``; one window call per slice,
    ``by_slices``; or not), takes a bias (``--bias``), takes a value head dim apart from the
    query/key one (``--head-dim-v``), returns the per-head max logit (``--max-logit``), whether its
    backward is bitwise repeatable as ringbench calls it, and where ``auto`` tries it on each device
    (``-``: never).
    """
    from ringbench.variants.kernels import AUTO_ORDER, DTYPE_NAMES, KERNELS

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    rows = ["| kernel | device | dtypes | head dim | packed documents | `--window` | `--mask` | `--bias` "
            "| `--head-dim-v` | `--max-logit` | bitwise repeatable backward | `auto` tries it |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, kernel in KERNELS.items():
        dtypes = ", ".join(short for dtype, short in DTYPE_NAMES.items() if dtype in kernel.dtypes)
        rule = [f"up to {kernel.max_head_dim}"] if kernel.max_head_dim else []
        rule += [f"a multiple of {kernel.head_dim_multiple}"] if kernel.head_dim_multiple > 1 else []
        mask = "one call per block" if kernel.takes_mask else "one call per slice" if kernel.by_slices else "no"
        auto = [f"{_ordinal(order.index(name) + 1)} on {device}" for device, order in AUTO_ORDER.items()
                if name in order]
        rows.append(f"| `{name}` | {kernel.device_type} | {dtypes} | {', '.join(rule) or 'any'} "
                    f"| {yes(kernel.varlen)} | {yes(kernel.takes_window)} | {mask} "
                    f"| {', '.join(kernel.bias_kinds) if kernel.bias_kinds else yes(kernel.takes_bias)} | {yes(kernel.head_dim_v)} "
                    f"| {yes(kernel.takes_max_logit)} | {yes(not kernel.nondeterministic_backward)} | {', '.join(auto) or '-'} |")
    return "\n".join(rows) + "\n"


def fabrics_table() -> str:
    """The fabric table of ``ringbench predict`` (``ringbench/model/fabrics.toml``): name, link, class,
    bandwidth per direction, latency, source."""
    from ringbench.model.fabric import fabric_table

    rows = ["| name | link | class | per direction | latency | source |", "|---|---|---|---|---|---|"]
    for name, link in fabric_table().items():
        bandwidth = (f"{link.curve[0][1]:g} to {link.curve[-1][1]:g} GiB/s, {link.curve[0][0] / 2 ** 20:g} to "
                     f"{link.curve[-1][0] / 2 ** 20:g} MiB" if link.curve else f"{link.gb_s * 1e9 / 2 ** 30:.4g} GiB/s")
        latency = "in the curve" if link.curve else f"{link.latency_us:g} µs"
        rows.append(f"| `{name}` | {link.title} | {link.link_class} | {bandwidth} | {latency} | {link.source} |")
    return "\n".join(rows) + "\n"


#: page (relative to docs/) -> its generated tables, as (marker name, generator).
TABLES: dict[str, tuple[tuple[str, Callable[[], str]], ...]] = {
    "contracts.md": (("fields", _fields_table),),
    "variants-and-kernels.md": (("variants", variants_table), ("kernels", kernels_table)),
    "predict.md": (("fabrics", fabrics_table),),
}


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {name}:begin -->\n)(.*?)(<!-- {name}:end -->)", re.S)


def current(text: str, name: str) -> str | None:
    """The table between ``name``'s markers in a page's ``text``, or ``None`` where the markers are missing."""
    found = _block(name).search(text)
    return found.group(2) if found else None


def refresh(text: str, name: str, table: str) -> str:
    """``text`` with the block between ``name``'s markers replaced by ``table``.

    Raises:
        ValueError: the page has no ``name:begin``/``name:end`` markers.
    """
    if current(text, name) is None:
        raise ValueError(f"the page has no <!-- {name}:begin --> and <!-- {name}:end --> markers; "
                         "add them where the table belongs")
    return _block(name).sub(lambda m: m.group(1) + table + m.group(3), text, count=1)


def main(argv: list[str] | None = None) -> int:
    """Rewrite every generated table under the docs folder (``argv[0]``, default :data:`DOCS`).

    Prints one line per page it changed; returns 0.
    """
    args = sys.argv[1:] if argv is None else argv
    docs = Path(args[0]) if args else DOCS
    for page, tables in TABLES.items():
        path = docs / page
        text = path.read_text(encoding="utf-8")
        new = text
        for name, generate in tables:
            new = refresh(new, name, generate())
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote the generated tables of {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
