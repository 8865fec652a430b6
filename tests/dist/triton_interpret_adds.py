"""Run under TRITON_INTERPRET=1 on CPU (``tests/test_merge_interpret.py``): ``merge_triton.add_steps``
(up to three adds in one launch, of different head counts, head dims, row forms and dtypes)
against ``merge.add_step`` one at a time. Prints ``ok <results> <worst ratio>``.

Within 2 units in the last place of the result's dtype, not bitwise: the interpreter converts
float32 to bf16 by truncation, where the GPU and torch round to nearest.
"""

import os
import random

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from ringbench.variants.engines import merge, merge_triton  # noqa: E402


def rows_of(kind: str, S: int):
    if kind == "all":
        return slice(None), S, None
    if kind == "tail":
        return slice(S // 2, None), S - S // 2, None
    idx = torch.randperm(S)[: max(1, S // 2)].sort().values
    inv = None
    if kind == "idx_inv":
        inv = torch.full((S,), -1, dtype=torch.int32)
        inv[idx] = torch.arange(idx.numel(), dtype=torch.int32)
    return idx, idx.numel(), inv


def job(B, S, H, D, dtype, kind, start, into_kind):
    rows, n, inv = rows_of(kind, S)
    acc_dtype = dtype if into_kind != "float32" else torch.float32
    into = {"same": acc_dtype, "float32": torch.float32, "input": dtype}[into_kind]
    acc = None if start == "none" else torch.randn(B, S, H, D).to(acc_dtype)
    grad = None if start == "cast" else torch.randn(B, n, H, D).to(dtype)
    return acc, rows, grad, into, (B, S, H, D), inv


def clone(j):
    return (None if j[0] is None else j[0].clone(), *j[1:])


torch.manual_seed(0)
rng = random.Random(0)
worst, count = 0.0, 0
for trial in range(60):
    dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    S = rng.choice([5, 17, 33])
    jobs = [job(2, S, rng.choice([1, 2, 3, 8]), rng.choice([16, 24, 64, 128]), dtype,
                rng.choice(["all", "tail", "idx", "idx_inv"]), rng.choice(["sum", "none", "cast"]),
                rng.choice(["same", "float32", "input"])) for _ in range(rng.choice([1, 2, 3]))]
    jobs = [j for j in jobs if j[0] is not None or j[2] is not None]
    got = merge_triton.add_steps([clone(j) for j in jobs])
    want = [merge.add_step(*clone(j)[:3], into=j[3], shape=j[4]) for j in jobs]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (trial, g.dtype, w.dtype, g.shape, w.shape)
        diff = (g.double() - w.double()).abs().max().item()
        allowed = 2 * torch.finfo(w.dtype).eps * max(1.0, w.double().abs().max().item())
        assert diff <= allowed, (trial, diff, allowed)
        worst, count = max(worst, diff / allowed), count + 1
print(f"ok {count} {worst:.3f}")
