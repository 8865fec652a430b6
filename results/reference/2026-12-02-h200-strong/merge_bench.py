"""The merge and add kernels' memory bandwidth on one GPU, per launch tile (issue 25).

python3 results/reference/2026-12-02-h200-strong/merge_bench.py [OUT.jsonl]

Times ``merge_triton.merge_step`` (an fp32 running output, updated in place, and a bf16 block) and
``merge_triton.add_steps`` (a backward step's dq, dk and dv adds: fp32 sums, bf16 gradients) with
``triton.testing.do_bench`` on the shapes an emulated W=8 ring of 32k and 128k tokens issues (4k and
16k rows per rank, all rows or half, 32 q heads and 8 K/V heads of 128), for every tile of
``$RINGBENCH_MERGE_TILE``'s grid, beside torch's ``add_`` of the same bytes. Prints GB/s, appends one
JSON line per point, and last a line ``BEST lanes,warps``: the tile with the least time summed over
every shape, merge and adds.
"""

import itertools
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

from ringbench.variants.engines import merge_triton

dev, H, HKV, D = "cuda", 32, 8, 128
out_path = sys.argv[1] if len(sys.argv) > 1 else None
env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
tiles = list(itertools.product((2048, 4096, 8192, 16384), (2, 4, 8)))
rows_all = []
totals = {t: 0.0 for t in tiles}


def point(**kw):
    kw.update(env)
    rows_all.append(kw)
    print(json.dumps({k: v for k, v in kw.items() if k not in env}))


for n, part in itertools.product((4096, 16384), ("all", "half")):
    nb = n if part == "all" else n // 2
    rows = slice(n - nb, n)
    acc = torch.randn(1, n, H, D, device=dev)
    lse = torch.randn(1, H, n, device=dev)
    blk = torch.randn(1, nb, H, D, device=dev, dtype=torch.bfloat16)
    blse = torch.randn(1, H, nb, device=dev)
    dk, dv = (torch.randn(1, n, HKV, D, device=dev) for _ in range(2))
    gk, gv = (torch.randn(1, nb, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    merge_bytes = nb * H * (D * (4 + 4 + 2) + 4 * 3)
    adds_bytes = nb * D * (H + 2 * HKV) * (4 + 4 + 2)
    ms = do_bench(lambda: acc[:, rows].add_(blk), warmup=25, rep=100)
    point(shape=f"{n} rows, {part}", op="torch add_ (same bytes as merge's data)", ms=ms,
          gb_s=nb * H * D * 10 / ms / 1e6)
    jobs = [(acc, rows, blk, torch.float32, None, None), (dk, rows, gk, torch.float32, None, None),
            (dv, rows, gv, torch.float32, None, None)]
    for tile in tiles:
        os.environ[merge_triton.TILE_ENV] = "%d,%d" % tile
        m = do_bench(lambda: merge_triton.merge_step(acc, lse, rows, blk, blse, into=torch.float32),
                     warmup=25, rep=100)
        a = do_bench(lambda: merge_triton.add_steps(jobs), warmup=25, rep=100)
        totals[tile] += m + a
        point(shape=f"{n} rows, {part}", op="merge", lanes=tile[0], warps=tile[1], ms=m, gb_s=merge_bytes / m / 1e6)
        point(shape=f"{n} rows, {part}", op="adds", lanes=tile[0], warps=tile[1], ms=a, gb_s=adds_bytes / a / 1e6)
    os.environ.pop(merge_triton.TILE_ENV)

if out_path:
    with open(out_path, "a") as f:
        for r in rows_all:
            f.write(json.dumps(r) + "\n")
for tile, t in sorted(totals.items(), key=lambda kv: kv[1]):
    print("tile %5d,%2d: %.3f ms summed" % (*tile, t))
best = min(totals, key=totals.get)
print("BEST %d,%d" % best)
