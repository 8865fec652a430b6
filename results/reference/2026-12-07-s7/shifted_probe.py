"""Probe: what a stripe step's shifted-causal block costs each kernel against the aligned causal square.

stripe's plan gives a rank, for every source above it, the block q[1:] x k[:-1] under causal (n - 1 rows),
where zigzag and the diagonal give n-row squares. Issue 25 measured stripe with flash-attn-4 at W=8 32k
well below zigzag. This times, per kernel and n, fwd and bwd GPU time (calibrate.gpu_times: a replayed
CUDA graph) of: the causal n x n square; the stripe block as the engine slices it (views q[:, 1:],
k[:, :-1]); the same (n - 1)-row block as fresh contiguous tensors; and the full n x n block.
Run: python3 shifted_probe.py OUT.jsonl (32/8 heads x 128, bf16).
"""
import json
import sys

import torch

from ringbench.model.calibrate import gpu_times
from ringbench.variants.kernels import resolve_kernel

dev = torch.device("cuda")
out = open(sys.argv[1], "a")
H, HK, D = 32, 8, 128
g = torch.Generator(device=dev).manual_seed(0)


def rand(*s):
    return torch.randn(*s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)


for name in ("flash-attn-4", "torch-flash"):
    try:
        kern = resolve_kernel(name, "cuda", dtype=torch.bfloat16, head_dim=D, head_dim_v=D)
    except Exception as e:  # noqa: BLE001
        print(name, "unavailable:", e)
        continue
    for n in (2048, 4096, 8192, 16384):
        q, k, v, do = rand(1, n, H, D), rand(1, n, HK, D), rand(1, n, HK, D), rand(1, n, H, D)
        cases = {
            "causal_square": (q, k, v, do, True),
            "stripe_view": (q[:, 1:], k[:, :-1], v[:, :-1], do[:, 1:], True),
            "stripe_contiguous": tuple(t.contiguous() for t in (q[:, 1:], k[:, :-1], v[:, :-1], do[:, 1:])) + (True,),
            "full_square": (q, k, v, do, False),
        }
        for label, (qq, kk, vv, dd, causal) in cases.items():
            try:
                with torch.no_grad():
                    f, _ = gpu_times(lambda: kern.forward(qq, kk, vv, causal, D ** -0.5), iters=15, warmup=3, device=dev)
                    o, lse = kern.forward(qq, kk, vv, causal, D ** -0.5)
                    b, _ = gpu_times(lambda: kern.backward(dd, qq, kk, vv, o, lse, causal, D ** -0.5), iters=15,
                                     warmup=3, device=dev)
                row = {"kernel": name, "n": n, "block": label, "q": qq.shape[1], "k": kk.shape[1],
                       "fwd_ms": sorted(f)[len(f) // 2], "bwd_ms": sorted(b)[len(b) // 2],
                       "gpu": torch.cuda.get_device_name(), "kernel_version": kern.version()}
            except Exception as e:  # noqa: BLE001
                row = {"kernel": name, "n": n, "block": label, "error": str(e)[:300]}
            print(json.dumps(row))
            out.write(json.dumps(row) + "\n")
            out.flush()
