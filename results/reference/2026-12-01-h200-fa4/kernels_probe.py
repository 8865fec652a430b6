"""FA4 and cuDNN native GQA against the float64 math kernel: max errors, lse marks, head_dim_v."""
import torch, math
from ringbench.variants import kernels as K
torch.manual_seed(0)
dev = "cuda"
M = K.KERNELS["math"]
def err(a, b):
    a, b = a.double(), b.double(); f = torch.isfinite(b)
    return (a[f] - b[f]).abs().max().item() if f.any() else 0.0
def batch(name, Hq, Hkv, D, Dv, S, causal, dtype=torch.bfloat16):
    kern = K.KERNELS[name]
    q = torch.randn(2, S, Hq, D, device=dev, dtype=dtype); k = torch.randn(2, S, Hkv, D, device=dev, dtype=dtype)
    v = torch.randn(2, S, Hkv, Dv, device=dev, dtype=dtype); do = torch.randn(2, S, Hq, Dv, device=dev, dtype=dtype)
    sc = D ** -0.5
    o, l = kern.forward(q, k, v, causal, sc); g = kern.backward(do, q, k, v, o, l, causal, sc)
    ro, rl = M.forward(*(t.double() for t in (q, k, v)), causal, sc)
    rg = M.backward(do.double(), q.double(), k.double(), v.double(), ro, rl, causal, sc)
    lo, ll = M.forward(q, k, v, causal, sc); lg = M.backward(do, q, k, v, lo, ll, causal, sc)
    print(f"{name} batch Hq={Hq} Hkv={Hkv} D={D}/{Dv} S={S} causal={causal}: out {err(o,ro):.2e} (math-bf16 {err(lo,ro):.2e}) "
          f"lse {err(l,rl):.2e} dq {err(g[0],rg[0]):.2e} ({err(lg[0],rg[0]):.2e}) dk {err(g[1],rg[1]):.2e} ({err(lg[1],rg[1]):.2e}) "
          f"dv {err(g[2],rg[2]):.2e} ({err(lg[2],rg[2]):.2e}) shapes {tuple(o.shape)} {tuple(g[1].shape)} {tuple(g[2].shape)}", flush=True)
def varlen(name, lq, lk, causal, Hq=8, Hkv=2, D=64, Dv=64, dtype=torch.bfloat16):
    kern = K.KERNELS[name]
    cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    ck = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(1, sum(lq), Hq, D, device=dev, dtype=dtype); k = torch.randn(1, sum(lk), Hkv, D, device=dev, dtype=dtype)
    v = torch.randn(1, sum(lk), Hkv, Dv, device=dev, dtype=dtype); do = torch.randn(1, sum(lq), Hq, Dv, device=dev, dtype=dtype)
    sc = D ** -0.5; mq, mk = max(lq), max(lk)
    o, l = kern.forward_varlen(q, k, v, cq, ck, mq, mk, causal, sc)
    g = kern.backward_varlen(do, q, k, v, o, l, cq, ck, mq, mk, causal, sc)
    ro, rl = M.forward_varlen(*(t.double() for t in (q, k, v)), cq, ck, mq, mk, causal, sc)
    rg = M.backward_varlen(do.double(), q.double(), k.double(), v.double(), ro, rl, cq, ck, mq, mk, causal, sc)
    marks = bool(((l == -math.inf) == (rl == -math.inf)).all())
    print(f"{name} varlen q={lq} k={lk} causal={causal} D={D}/{Dv}: out {err(o,ro):.2e} lse {err(l,rl):.2e} -inf marks equal {marks} "
          f"dq {err(g[0],rg[0]):.2e} dk {err(g[1],rg[1]):.2e} dv {err(g[2],rg[2]):.2e} finite {all(torch.isfinite(t).all().item() for t in (o,*g))}", flush=True)
print("fa4 version", K.KERNELS["flash-attn-4"].version(), "unavailable:", K.KERNELS["flash-attn-4"].unavailable())
for causal in (True, False):
    batch("flash-attn-4", 32, 8, 128, 128, 1024, causal)
batch("flash-attn-4", 16, 16, 192, 128, 1024, True)
batch("flash-attn-4", 16, 4, 192, 128, 1024, False)
for causal in (True, False):
    varlen("flash-attn-4", [97, 257, 1025], [97, 257, 1025], causal)
    varlen("flash-attn-4", [33, 257, 700], [97, 257, 1025], causal)
    varlen("flash-attn-4", [0, 97, 64, 100], [50, 97, 0, 60], causal)
varlen("flash-attn-4", [300, 1], [300, 1], True, D=192, Dv=128)
for causal in (True, False):
    batch("cudnn", 32, 8, 128, 128, 1024, causal)
print("cudnn GQA refused:", K._CUDNN_GQA_REFUSED, "notes:", K.KERNELS["cudnn"].notes())
