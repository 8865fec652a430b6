"""Where a ring variant's fp32 dq error comes from (issue 26), on one verify case's inputs.

    python -m torch.distributed.run --nproc-per-node 8 results/reference/2026-12-02-cpu-masks/dq_probe.py \
        zigzag prefix:40 [--seed 0]

Runs the variant under gloo on verify's inputs (S=256, 8/2 heads of 16, fp32, the math kernel) and splits
its dq error against float64 into the part its forward brings (the exact float64 backward of its own
out and lse, against the reference) and the part its backward arithmetic adds, beside the same split of
the single-device run. MASK is a ``--mask`` value, ``causal``, or ``@FILE`` for a slices file.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ringbench.rank.check import global_inputs
from ringbench.case.spec import CaseSpec, default_fields
from ringbench.variants.engines import layouts, masks
from ringbench.variants.engines.ring import ring_attention
from ringbench.variants.engines.stripe import stripe_attention
from ringbench.variants.engines.zigzag import zigzag_attention
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import PositionMask

VARIANTS = {"ring": (ring_attention, "contiguous"), "zigzag": (zigzag_attention, "zigzag"),
            "stripe": (stripe_attention, "stripe")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=sorted(VARIANTS))
    ap.add_argument("mask")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    mask = masks.read_file(args.mask[1:]) if args.mask.startswith("@") else args.mask
    causal, mask = mask == "causal", None if mask == "causal" else mask
    attention, layout = VARIANTS[args.variant]
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spec = CaseSpec(**{**default_fields("cpu", 0), "task": "verify", "variant": args.variant, "seqlen": 256, "heads": 8, "kv_heads": 2, "head_dim": 16,
                       "seed": args.seed})
    inputs = global_inputs(spec, torch.float32, torch.device("cpu"))
    scale = spec.head_dim ** -0.5
    q, k, v, dout = (layouts.shard(x, layout, rank, world_size) for x in inputs)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = attention(q, k, v, causal=causal, softmax_scale=scale, kernel="math", mask=mask)
    out.backward(dout)
    got = []
    for t, dim in ((out.detach(), 1), (lse, 2), (q.grad, 1)):
        parts = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(parts, t.contiguous())
        got.append(layouts.unshard(parts, layout, dim=dim))
    if rank == 0:
        report(args.variant, world_size, args.mask, inputs, *got, causal, mask, scale)
    dist.destroy_process_group()


def report(variant, world_size, mask_arg, inputs, out_v, lse_v, dq_v, causal, mask, scale) -> None:
    math = KERNELS["math"]
    S = inputs[0].shape[1]
    every = torch.arange(S)
    kw = {} if mask is None else {"mask": PositionMask(every, every, masks.build(mask, S).allows, mask)}
    x64 = [x.double() for x in inputs]

    def backward(x, o, l):
        return math.backward(x[3], *x[:3], o, l, causal, scale, **kw)[0]

    o_ref, l_ref = math.forward(*x64[:3], causal, scale, **kw)
    dq_ref = backward(x64, o_ref, l_ref)
    o_s, l_s = math.forward(*inputs[:3], causal, scale, **kw)
    dq_s = backward(inputs, o_s, l_s)
    own_v, own_s = backward(x64, out_v.double(), lse_v.double()), backward(x64, o_s.double(), l_s.double())
    lse_only = backward(x64, o_ref, lse_v.double())

    def err(a, b):
        return (a.double() - b).abs()

    ev, es = err(dq_v, dq_ref), err(dq_s, dq_ref)
    allowed = 2 * es.max() + 0.5 * torch.finfo(torch.float32).eps * dq_ref.abs().max()
    print(f"{variant} W={world_size} {mask_arg[:30]}: dq err {ev.max():.3e}, allowed {allowed:.3e} "
          f"(ratio {ev.max() / allowed:.3f}); lse err {err(lse_v, l_ref).max():.3e}, single {err(l_s, l_ref).max():.3e}")
    print(f"  from the forward: variant {err(own_v, dq_ref).max():.3e} (its lse alone {err(lse_only, dq_ref).max():.3e}), "
          f"single {err(own_s, dq_ref).max():.3e}; backward arithmetic: variant {err(dq_v, own_v).max():.3e}, "
          f"single {err(dq_s, own_s).max():.3e}")
    _, s, h, d = (int(i) for i in torch.unravel_index(ev.argmax(), ev.shape))
    print(f"  worst: token {s}, head {h}, dim {d}, dq {dq_ref[0, s, h, d]:.4f}; its lse err {lse_v[0, h, s] - l_ref[0, h, s]:.3e} "
          f"(single {l_s[0, h, s] - l_ref[0, h, s]:.3e}, lse {l_ref[0, h, s]:.3f})")


if __name__ == "__main__":
    main()
