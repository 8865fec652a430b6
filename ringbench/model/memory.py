"""Peak memory per rank of one attention call (forward, or forward and backward), estimated from shapes.

What the engines hold at their peak, tensor by tensor, in the case's dtype ``e`` bytes and float32
accumulators; S_l = S / W local tokens, ``q`` = S_l * B * Hq * D elements, ``kv`` = S_l * B * Hkv
* (D + Dv), ``o`` = S_l * B * Hq * Dv:

- every variant: q, k, v, out and dout, and in backward dq, dk, dv (``e`` each), and lse (float32);
- ring engine (``ring.py``): two spare K/V buffers and the kept ``kv_last`` (3 kv); the float32
  running out (o); backward: float32 dq, a float32 dK/dV partial and its landing buffer (2 kv at
  4 bytes), and the kernel's gradients of one block (q + kv);
- all-gather (``llama3.py``): every head group's gathered K/V, kept for the backward (W kv); the
  float32 out; backward: one head group's float32 dK/dV over the whole sequence and the cut shards
  for the reduce-scatter (2 x W kv / groups at 4 bytes), float32 dq;
- Ulysses (``ulysses.py``): the head-sharded q, k, v and out kept (as large as the local ones;
  K/V times the replicas), the all-to-all's send and receive buffers (2 x the largest tensor),
  plus the ring engine's terms over the ring shard.

The kernels' own workspace (a few row statistics) is left out. It is an estimate, and the
output says so; ``advise`` uses it to drop what would not fit.

Source: issue 24.
"""

from __future__ import annotations

from ringbench.model.schedule import ELEMENT_BYTES
from ringbench.variants import get_variant

GIB = 1024 ** 3


def peak_gib(spec, *, ulysses_degree: int = 1) -> float:
    """The estimated peak of one rank, GiB (module docstring)."""
    variant = get_variant(spec.variant)
    e = ELEMENT_BYTES[spec.dtype]
    W = spec.world_size
    local = spec.seqlen // W
    B, H, Hkv, D, Dv = spec.batch, spec.heads, spec.kv_heads, spec.head_dim, spec.value_head_dim()
    q, kv, o = local * B * H * D, local * B * Hkv * (D + Dv), local * B * H * Dv
    backward = spec.mode == "fwd_bwd"
    base = (q + kv + 2 * o) * e + local * B * H * 4 + (q + kv) * e * backward

    def ring_terms(q_, kv_, o_) -> float:
        fwd = 3 * kv_ * e + o_ * 4
        bwd = q_ * 4 + 2 * kv_ * 4 + (q_ + kv_) * e
        return fwd + bwd * backward

    if variant.ulysses:
        U = variant.ulysses_degree(W, ulysses_degree or spec.ulysses_degree)
        replicas = max(1, U // Hkv)
        sharded = (q + kv * replicas + o) * e
        a2a = 2 * max(q, kv * replicas, o) * e if U > 1 else 0
        extra = sharded + a2a + ring_terms(q, kv * replicas, o)
    elif spec.variant in ("llama3", "llama3_varlen"):
        stride = spec.heads_k_stride or Hkv
        groups = -(-Hkv // stride)
        extra = W * kv * e + o * 4 + (2 * W * kv / groups * 4 + q * 4) * backward
    else:
        extra = ring_terms(q, kv, o)
    return (base + extra) / GIB
