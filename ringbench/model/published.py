"""Another library's published table of context-parallel efficiencies, predicted by ringbench's model.

The table is a TOML file under ``results/reference/`` that holds the figures as published, their
source, the shape, the GPU, the world size, the fabric row and the kernel to predict them with,
and the documents of the varlen rows (``published-ring-flash-attn-8xh800/table.toml``: 8 x H800,
Llama-3.1-8B attention, 8k tokens per GPU). Each row names the ringbench variant whose schedule
is the library's function's. :func:`predict` predicts every row in each mode the table holds and
reads the prediction as the library reads its own figure: the efficiency is the kernel alone on
one GPU's tokens (``theoretic``: its time times the world size) over the variant's time, summed
over the documents a varlen benchmark cycles through.

Torch-free itself; the cases are built by the caller (``build``), as ``run`` builds them. Source:
issue 24, item 4 (c).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Callable

from ringbench.errors import SpecError
from ringbench.model.predict import predict_case, reference_ms
from ringbench.model.simulate import PARTS

#: The modes a table's rows may hold, in the order they are predicted.
MODES = ("fwd", "fwd_bwd")


def load(path: Path) -> dict:
    """The table of ``path``.

    Raises:
        SpecError: an unreadable file, bad TOML, or one without ``source``, ``gpu``, ``world_size``,
            ``kernel`` and ``shape``.
    """
    try:
        table = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"published table {str(path)!r} cannot be read ({exc}); pass a TOML file such as "
                        "results/reference/published-ring-flash-attn-8xh800/table.toml") from None
    missing = [k for k in ("source", "gpu", "world_size", "kernel", "shape") if k not in table]
    if missing:
        raise SpecError(f"published table {str(path)!r} has no {missing[0]}; every table states its source, GPU, "
                        "world size, kernel and shape")
    return table


def row_cases(table: dict, api: str, row: dict, mode: str) -> tuple[list[dict], list[dict]]:
    """The case fields a row is predicted with in ``mode`` (one per set of documents of a varlen
    row, else one), and the fields of the kernel alone on one GPU's tokens beside each (world size 1:
    ``ring`` for a batch row, ``ring_varlen`` over that GPU's documents for a varlen one)."""
    shape, W = table["shape"], table["world_size"]
    per_gpu = shape["tokens_per_gpu"]
    base = {k: shape[k] for k in ("heads", "kv_heads", "head_dim", "dtype", "causal", "batch")}
    base.update(mode=mode, kernel=table["kernel"])
    own = {"variant": row["variant"], "seqlen": per_gpu * W}
    if row.get("heads_k_stride"):
        own["heads_k_stride"] = row["heads_k_stride"]
    if api == "batch":
        return [{**base, **own}], [{**base, "variant": "ring", "seqlen": per_gpu}]
    cases, references = [], []
    for docs in table[api]["documents_per_gpu"]:
        if sum(docs) != per_gpu:
            raise SpecError(f"published table documents {docs} do not sum to tokens_per_gpu {per_gpu}; fix the table")
        cases.append({**base, **own, "docs": ",".join(str(d * W) for d in docs)})
        references.append({**base, "variant": "ring_varlen", "seqlen": per_gpu, "docs": ",".join(map(str, docs))})
    return cases, references


def predict(table: dict, *, build: Callable[[dict, int], Any], tgt) -> list[dict]:
    """Every row of ``table`` predicted in each mode it holds.

    ``build(fields, world_size) -> CaseSpec`` builds a case as ``run`` would; ``tgt`` is the
    ``model.target.Target`` of the table's GPU and fabric.

    Returns:
        Per row and mode: ``api``, ``function``, ``variant``, ``mode``, ``published`` (the table's
        efficiency), ``predicted`` (the same reading of the prediction), ``time_ms`` and ``ref_ms``
        (summed over the sets of documents), ``path`` (shares of the time in compute, overhead,
        exposed communication and waiting, over the same sum), and ``cases`` (the ``seqlen`` and
        ``docs`` of each case).
    """
    W = table["world_size"]
    out = []
    for api in ("batch", "varlen"):
        for row in table.get(api, {}).get("rows", []):
            for mode in MODES:
                if mode not in row:
                    continue
                cases, references = row_cases(table, api, row, mode)
                time_ms = ref_ms = 0.0
                parts = dict.fromkeys(PARTS, 0.0)
                for fields, ref_fields in zip(cases, references):
                    spec = build(fields, W).replace(kernel=table["kernel"])
                    # The library merges in line, on its compute stream: so is its schedule priced.
                    got = predict_case(spec, calibration=tgt.calibration, kernel=table["kernel"], cluster=tgt.cluster(W),
                                       side=False)
                    time_ms += got["time_ms"]
                    for part in PARTS:
                        parts[part] += got["prediction"]["critical_path_ms"][part]
                    ref_spec = build(ref_fields, 1).replace(kernel=table["kernel"])
                    ref_ms += reference_ms(ref_spec, tgt.calibration, table["kernel"])[0]
                out.append({"api": api, "function": row["function"], "variant": row["variant"], "mode": mode,
                            "published": row[mode]["efficiency"], "predicted": W * ref_ms / time_ms,
                            "time_ms": time_ms, "ref_ms": ref_ms,
                            "path": {part: parts[part] / time_ms for part in PARTS},
                            "cases": [{"seqlen": f["seqlen"], "docs": f.get("docs", "")} for f in cases]})
    return out
