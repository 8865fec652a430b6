"""Where flash-attn-4's ALiBi backward goes wrong (H100, 2026-12-07): dq against the math kernel in float64,
with GQA 8/2 and without (2/2), with the real slopes and with zero slopes (the score mod then adds nothing)."""
import torch
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import Bias, PositionBias, alibi_slopes

fa4, math_k = KERNELS["flash-attn-4"], KERNELS["math"]
gen = torch.Generator(device="cuda").manual_seed(0)
s, d = 256, 128
for hq, hkv in ((2, 2), (8, 2)):
    q, k, v, do = (torch.randn(1, s, h, d, generator=gen, device="cuda") for h in (hq, hkv, hkv, hq))
    pos = torch.arange(s, device="cuda")
    for name, slopes in (("alibi", torch.tensor(alibi_slopes(hq), device="cuda")), ("zero", torch.zeros(hq, device="cuda"))):
        b = PositionBias(Bias("alibi", slopes), pos, pos)
        res = []
        for kern, dt in ((math_k, torch.float64), (fa4, torch.bfloat16)):
            x = [t.to(dt) for t in (q, k, v, do)]
            o, l = kern.forward(*x[:3], True, d ** -0.5, bias=b)
            res.append((o, l, *kern.backward(x[3], *x[:3], o, l, True, d ** -0.5, bias=b)))
        errs = [f"{n} {(g.double() - r).abs().max().item():.2e}" for n, g, r in zip(("out", "lse", "dq", "dk", "dv"), res[1], res[0])]
        print(f"H={hq}/{hkv} slopes={name}: " + ", ".join(errs), flush=True)
