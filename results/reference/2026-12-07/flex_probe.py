"""Probe: PyTorch FlexAttention's backends on this GPU for a prefix-LM mask (issue 26, item 5).

For BACKEND in TRITON and FLASH (FlashAttention-4's CuTe DSL kernels under flex), with a prefix
mask over S tokens, 32/8 heads x 128, bf16: whether forward with lse and a backward that takes
a gradient of the lse run, their error against float32 math on the same mask, and their times
(CUDA events, median of 10 after 3 warm-ups). Prints one JSON line per backend.
"""
import json
import math
import sys

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

S, P, H, HKV, D = int(sys.argv[1]) if len(sys.argv) > 1 else 8192, 1024, 32, 8, 128
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
q, k, v, do = (torch.randn(1, h, S, D, generator=g, device=dev, dtype=torch.bfloat16)
               for h in (H, HKV, HKV, H))
dl = torch.randn(1, H, S, generator=g, device=dev)


def prefix(b, h, i, j):
    return (j <= i) | (j < P)


bm = create_block_mask(prefix, None, None, S, S, device=dev)


def reference():
    x = [t.float().requires_grad_() for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(H // HKV, 1) for t in x[1:])
    s = (x[0] @ kk.transpose(-1, -2)) / math.sqrt(D)
    i = torch.arange(S, device=dev)
    s = s.masked_fill(~prefix(0, 0, i[:, None], i[None, :]), -math.inf)
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vv
    grads = torch.autograd.grad((o, lse), x, (do.float(), dl))
    return o, lse, grads


def timed(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[5]


ref_o, ref_lse, ref_g = reference()
pairs = sum(min(S, max(i + 1, P)) for i in range(S))
for backend in ("TRITON", "FLASH"):
    row = {"backend": backend, "S": S, "mask": f"prefix:{P}", "torch": torch.__version__}
    try:
        fx = torch.compile(flex_attention)
        x = [t.detach().requires_grad_() for t in (q, k, v)]

        def fwd():
            return fx(*x, block_mask=bm, enable_gqa=True, return_aux=AuxRequest(lse=True),
                      kernel_options={"BACKEND": backend})

        o, aux = fwd()
        row["fwd_err"] = (o.float() - ref_o).abs().max().item()
        row["lse_err"] = (aux.lse.float() - ref_lse).abs().max().item()
        grads = torch.autograd.grad((o, aux.lse), x, (do, dl))
        row["grad_err"] = [(a.float() - b).abs().max().item() for a, b in zip(grads, ref_g)]
        row["grad_scale"] = [b.abs().max().item() for b in ref_g]
        fwd_ms = timed(lambda: fwd())
        def both():
            o, aux = fwd()
            torch.autograd.grad((o, aux.lse), x, (do, dl))
        fb_ms = timed(both)
        flops = 4 * pairs * D * H
        row.update(fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms, fwd_tflops=flops / fwd_ms / 1e9,
                   fwd_bwd_tflops=3.5 * flops / fb_ms / 1e9)
    except Exception as exc:  # a backend that cannot run says why
        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    print(json.dumps(row), flush=True)
