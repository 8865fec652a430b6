"""Where one iteration's time goes: torch.profiler over a variant at one shape, on rank 0.

torchrun --nproc-per-node 2 results/reference/profile_step.py zigzag 16384 torch-flash fwd_bwd
Prints the CUDA kernels sorted by total time, and writes a Chrome trace when $OUT is set.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ringbench.variants import get_variant

variant, seqlen, kernel, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rank = int(os.environ["RANK"])
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(device)
dist.init_process_group("nccl", device_id=device)
W = dist.get_world_size()
B, H, Hkv, D = 1, 32, 8, 128
gen = torch.Generator(device=device).manual_seed(rank)
q, dout = (torch.randn(B, seqlen // W, H, D, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
k, v = (torch.randn(B, seqlen // W, Hkv, D, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(2))
attention = get_variant(variant).attention


def step():
    for t in (q, k, v):
        t.requires_grad_(mode == "fwd_bwd")
        t.grad = None
    out, _ = attention(q, k, v, causal=True, group=None, kernel=kernel)
    if mode == "fwd_bwd":
        out.backward(dout)


for _ in range(3):
    step()
torch.cuda.synchronize()
dist.barrier()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
if rank == 0:
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    if os.environ.get("OUT"):
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace-{variant}-{seqlen}-{kernel}.json"))
dist.destroy_process_group()
