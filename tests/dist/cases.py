"""Run a batch of context-parallel attention cases on every rank of a real torchrun job (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node W tests/dist/cases.py \
        --cases CASES.json --results RESULTS.jsonl

``CASES.json`` is a JSON list of case objects (see :func:`run_case` for the fields). Every
rank builds the same global q, k, v and dout from the case's seed, takes its shard with
``ringbench.variants.engines.layouts.shard``, runs the variant's ``attention`` forward and backward,
and all-gathers and unshards out, lse, dq, dk and dv. Rank 0 computes the float64
reference (the tests' one, ``tests/helpers.py``'s ``attention_fp64``) while rank 1 (when there is one) runs the single-device kernel; rank 0 then checks
each tensor with ``ringbench.rank.tolerance.tolerance_check`` (MEASUREMENT.md's rule: the variant's max error
against the float64 reference must stay within twice the same kernel's single-device error
plus a dtype floor) and appends one JSON line per case to ``RESULTS.jsonl`` as soon as the
case ends, so a later hang loses nothing. A case that raises is recorded with
``status: "error"`` and the next case runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

# Under torchrun this script's folder (tests/dist) heads sys.path; the tests' shared helpers sit one up.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from helpers import attention_fp64  # noqa: E402
from ringbench.rank.tolerance import tolerance_check  # noqa: E402
from ringbench.rank.worker import leave  # noqa: E402
from ringbench.records.envinfo import warm_cpu_math  # noqa: E402
from ringbench.variants import get_variant  # noqa: E402
from ringbench.variants.engines import layouts  # noqa: E402
from ringbench.variants.kernels import get_kernel  # noqa: E402

TENSORS = ("out", "lse", "dq", "dk", "dv")
#: The sequence dimension of each gathered tensor: lse is [B, H, S], the others [B, S, H, D].
SEQ_DIM = {"out": 1, "lse": 2, "dq": 1, "dk": 1, "dv": 1}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def global_inputs(case: dict, rank_of_token) -> tuple[torch.Tensor, ...]:
    """The whole-sequence q, k, v, dout of a case, identical on every rank.

    Args:
        case: the case object; ``inputs`` is ``"randn"`` (the default) or ``"big_keys"``.
        rank_of_token: int64 ``[S]``, the rank that holds each global position in the
            variant's layout (used by ``big_keys``).

    Returns:
        q, dout ``[B, S, H, D]`` and k, v ``[B, S, Hkv, D]`` in the case's dtype.

    ``big_keys``: q and every key get their first coordinate replaced, q by ``a`` and the keys
    held by rank ``big_rank`` by ``a`` too (the others by 0), with ``a * a * scale`` equal to
    ``score_gap``. Those keys then score about ``score_gap`` above every other key, for every
    query, so partial lse values that differ by about that much meet in the merge.
    """
    B, S, H, Hkv, D = (case[f] for f in ("batch", "seqlen", "heads", "kv_heads", "head_dim"))
    gen = torch.Generator().manual_seed(case["seed"])
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64)
                     for shape in ((B, S, H, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, H, D)))
    if case.get("inputs", "randn") == "big_keys":
        a = math.sqrt(case["score_gap"] / D ** -0.5)
        big = (rank_of_token == case["big_rank"]).to(torch.float64)
        q[..., 0] = a
        k[..., 0] = a * big[None, :, None]
    dtype = DTYPES[case["dtype"]]
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def _gather(t: torch.Tensor, layout: str, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return layouts.unshard(parts, layout, dim=dim)


def _single(inputs, kernel, causal: bool, scale: float) -> list[torch.Tensor]:
    """The same kernel over the whole sequence on one device: out, lse, dq, dk, dv."""
    q, k, v, dout = inputs
    s_out, s_lse = kernel.forward(q, k, v, causal, scale)
    return [s_out, s_lse, *kernel.backward(dout, q, k, v, s_out, s_lse, causal, scale)]


def _fp64(inputs, causal: bool, scale: float) -> list[torch.Tensor]:
    """The tests' float64 attention (``helpers.attention_fp64``) over the whole sequence, its
    gradients by autograd: out, lse, dq, dk, dv."""
    q64, k64, v64 = (t.double().requires_grad_(True) for t in inputs[:3])
    r_out, r_lse = attention_fp64(q64, k64, v64, causal=causal, scale=scale)
    grads = torch.autograd.grad(r_out, (q64, k64, v64), inputs[3].double())
    return [r_out.detach(), r_lse.detach(), *grads]


def _references(inputs, kernel, causal: bool, scale: float):
    """(single, fp64) on rank 0; rank 1, when there is one, computes single at the same time.

    Returns ``None`` on every rank but 0.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        try:
            return _single(inputs, kernel, causal, scale), _fp64(inputs, causal, scale)
        finally:
            torch.set_num_threads(1)
    if rank == 1:
        dist.send_object_list([_single(inputs, kernel, causal, scale)], dst=0)
        return None
    if rank == 0:
        ref = _fp64(inputs, causal, scale)
        box = [None]
        dist.recv_object_list(box, src=1)
        return box[0], ref
    return None


def run_case(case: dict) -> dict | None:
    """Run one case on this rank; rank 0 returns its record, the others ``None``.

    Case fields: name, variant, kernel, batch, seqlen, heads, kv_heads, head_dim, dtype
    (``bf16``/``fp16``/``fp32``), causal, seed, and optionally inputs (``randn`` or
    ``big_keys`` with ``big_rank`` and ``score_gap``).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    variant = get_variant(case["variant"])
    kernel = get_kernel(case["kernel"])
    causal = bool(case["causal"])
    scale = case["head_dim"] ** -0.5
    S = case["seqlen"]
    refusal = variant.check(seqlen=S, world_size=world_size, causal=causal)
    if refusal is not None:
        raise ValueError(f"[rank {rank}/{world_size}] {refusal}")
    owner = torch.empty(S, dtype=torch.int64)
    for r in range(world_size):
        owner[layouts.token_index(variant.layout, S, r, world_size)] = r
    inputs = global_inputs(case, owner)
    dtype = inputs[0].dtype

    q, k, v, dout = (layouts.shard(t, variant.layout, rank, world_size) for t in inputs)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    t0 = time.perf_counter()
    out, lse = variant.attention(q, k, v, causal=causal, softmax_scale=scale, kernel=kernel)
    out.backward(dout)
    variant_time_s = time.perf_counter() - t0
    local = {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    local_shapes = {n: list(t.shape) for n, t in local.items()}
    local_dtypes = {n: str(t.dtype).replace("torch.", "") for n, t in local.items()}
    gathered = {n: _gather(t, variant.layout, SEQ_DIM[n]) for n, t in local.items()}
    # Rank 0 computes the float64 reference while rank 1 runs the single-device kernel.
    t0 = time.perf_counter()
    refs = _references(inputs, kernel, causal, scale)
    reference_time_s = time.perf_counter() - t0
    if rank != 0:
        return None
    single, ref = refs
    qg, kg = inputs[0], inputs[1]
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    expected = {
        "out": (dtype, tuple(qg.shape)),
        "lse": (lse_dtype, (qg.shape[0], qg.shape[2], qg.shape[1])),
        "dq": (dtype, tuple(qg.shape)),
        "dk": (dtype, tuple(kg.shape)),
        "dv": (dtype, tuple(kg.shape)),
    }
    checks = [tolerance_check(n, gathered[n], s, r, *expected[n]) for n, s, r in zip(TENSORS, single, ref)]
    return {
        "local_shapes": local_shapes,
        "local_dtypes": local_dtypes,
        "ref_lse_max": float(ref[1][torch.isfinite(ref[1])].max()),
        "ref_abs_max": {n: float(r[torch.isfinite(r)].abs().max()) for n, r in zip(TENSORS, ref)},
        "checks": checks,
        "passed": all(c["passed"] for c in checks),
        "variant_time_s": round(variant_time_s, 3),
        "reference_time_s": round(reference_time_s, 3),
    }


def _describe(rec: dict) -> str:
    lines = [f"case {rec['name']} W={rec['world_size']} status={rec['status']} passed={rec['passed']}"]
    for c in rec.get("checks") or []:
        lines.append(f"  {c['tensor']:>3} {c['dtype']:>8} err={c['err']:.3e} mean={c['mean_err']:.3e} "
                     f"single={c['err_single']:.3e} allowed={c['allowed']:.3e} ratio={c['ratio']:.3f} "
                     f"passed={c['passed']}")
    if rec.get("error"):
        lines.append("  error: " + rec["error"].strip().splitlines()[-1])
    return "\n".join(lines)


def drive(doc: str, run: Callable[[dict], dict | None], start: Callable[[dict, int], dict],
          describe: Callable[[dict], str], argv: list[str] | None = None, rank0_threads: int = 1) -> int:
    """The torchrun driver of every case script: parse ``--cases``/``--results``, run each case
    on every rank, and have rank 0 append one JSON line per case as soon as it ends.

    ``doc``: the script's docstring, for ``--help``. ``start(case, world_size)`` gives the record's first fields; ``run(case)`` its outcome. A
    case that raises is recorded with ``status: "error"`` and the rank's traceback, and the next
    case runs. ``rank0_threads``: rank 0 computes references while the others wait.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cases", required=True, help="JSON list of case objects")
    parser.add_argument("--results", required=True, help="JSONL file rank 0 appends one line per case to")
    args = parser.parse_args(argv)

    timeout = dt.timedelta(seconds=float(os.environ.get("CASES_PG_TIMEOUT", "300")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(rank0_threads if rank == 0 else 1)
    warm_cpu_math()  # as ringbench's worker does (pytorch/pytorch#188792)
    with open(args.cases) as fh:
        cases = json.load(fh)
    try:
        for case in cases:
            record = start(case, world_size)
            t0 = time.perf_counter()
            try:
                fields = run(case)
            except Exception:  # recorded, and the next case runs: a raise on every rank is a result
                fields = {"error": f"[rank {rank}/{world_size}] " + traceback.format_exc()}
                record["status"] = "error"
            dist.barrier()
            if rank == 0:
                record.update(fields or {})
                record["case_time_s"] = round(time.perf_counter() - t0, 3)
                with open(args.results, "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                print(describe(record), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def _start(case: dict, world_size: int) -> dict:
    return {"name": case["name"], "world_size": world_size, "variant": case["variant"], "kernel": case["kernel"],
            "dtype": case["dtype"], "causal": case["causal"], "seqlen": case["seqlen"], "status": "ok",
            "passed": False, "error": None}


def main(argv: list[str] | None = None) -> int:
    return drive(__doc__, run_case, _start, _describe, argv)


if __name__ == "__main__":
    leave(main())
