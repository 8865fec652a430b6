"""Where an emulated rank's iteration goes, kernel by kernel (issue 25).

python3 results/reference/2026-12-02-h200-strong/kernel_mix.py VARIANT SEQLEN KERNEL WORLD_SIZE RANK

Plays rank RANK of an emulated group of WORLD_SIZE (``run --emulate``'s device copies) at 32/8 heads of
128, bf16, causal, fwd_bwd, and prints torch.profiler's CUDA kernels of two eager iterations, by
total GPU time: the kernels, the merges and adds, the emulated transfers' copies.
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from ringbench.variants import get_variant, instruments

variant, seqlen, kernel, W, rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
dev = torch.device("cuda")
B, H, HKV, D, n = 1, 32, 8, 128, seqlen // W
shards = []
for r in range(W):
    g = torch.Generator(device=dev).manual_seed(r)
    q, dout = (torch.randn(B, n, H, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, n, HKV, D, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2))
    shards.append((q, k, v, dout))
attention = get_variant(variant).attention
q, k, v, dout = shards[rank]
for t in (q, k, v):
    t.requires_grad_(True)


def step():
    with instruments.open(emulation=instruments.Emulation(rank, W, shards)):
        for t in (q, k, v):
            t.grad = None
        out, _ = attention(q, k, v, causal=True, group=None, kernel=kernel)
        out.backward(dout)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
print(f"{variant} {kernel} W={W} S={seqlen} rank {rank}: two iterations")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
