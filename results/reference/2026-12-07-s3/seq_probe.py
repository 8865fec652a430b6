"""Do a rank's back-to-back flash-attn-4 calls cost what the calibration says each costs alone?

For one measured case (argv: records.jsonl variant mask-prefix [layout [kernel]]), take the slowest rank's kernel calls from
the model's own programs (ringbench.model.schedule.programs, as predict walks them), then on this GPU:
  singles:  each distinct call replayed alone in a CUDA graph (what `ringbench calibrate` measures), summed
            over the rank's calls;
  sequence: the rank's forward calls, then its backward calls, each replayed as one CUDA graph;
  model:    the shipped calibration's price of every call (Calibration.kernel_ms), summed.
Calls map to the kernel (ringbench's registry; flash-attn-4 unless named) as the model reads them: full (no mask), causal (square), window (a causal
window of `window` keys). Prints one line per phase; milliseconds, medians of 20 replays.
"""
import sys, statistics
import torch
from ringbench.case.fields import CaseSpec
from ringbench.model import schedule
from ringbench.model.calibration import shipped
from ringbench.variants.kernels import KERNELS

import json
path, variant, prefix = sys.argv[1:4]
layout = sys.argv[4] if len(sys.argv) > 4 else ""
KERNEL = sys.argv[5] if len(sys.argv) > 5 else "flash-attn-4"
kern = KERNELS[KERNEL]
rec = next(r for r in map(json.loads, open(path)) if r["status"] == "ok" and r["spec"]["variant"] == variant
           and (r["spec"].get("mask") or "").startswith(prefix) and (r["spec"].get("layout") or "") == layout and r["spec"]["world_size"] > 1)
spec = CaseSpec.from_dict(rec["spec"]).replace(kernel=KERNEL)
W, S, mask = spec.world_size, spec.seqlen, spec.mask
print(f"measured {rec['time_ms']:.3f} ms (cuda_graph {rec.get('cuda_graph')})")
progs, _ = schedule.programs(spec, side=True)
name = torch.cuda.get_device_name()
cal = next(c for c in shipped() if c.device == name)
H, KV, D, dev, dt = 32, 8, 128, "cuda", torch.bfloat16
scale = D ** -0.5


def args(call):
    if call.mask == "full":
        return dict(causal=False)
    if call.mask == "causal":
        return dict(causal=True)
    return dict(causal=True, window=(max(call.window - 1, 0), 0))


tensors = {}


def prepared(call):
    key = (call.q, call.k, call.mask, call.window)
    if key not in tensors:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, call.q, H, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(1, call.k, KV, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(1, call.k, KV, D, device=dev, dtype=dt, generator=g)
        a = args(call)
        out, lse = kern.forward(q, k, v, a.pop("causal"), scale, **a)
        tensors[key] = (q, k, v, out, lse, torch.randn_like(out))
    return tensors[key]


def launch(call):
    q, k, v, out, lse, dout = prepared(call)
    a = args(call)
    causal = a.pop("causal")
    if call.mode == "fwd":
        kern.forward(q, k, v, causal, scale, **a)
    else:
        kern.backward(dout, q, k, v, out, lse, causal, scale, **a)


def replay_ms(calls, reps=20):
    for c in calls:
        launch(c)  # compile and warm
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            launch(c)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            launch(c)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


times = []
for r, prog in enumerate(progs):
    times.append(sum(cal.kernel_ms(KERNEL, op.call, shape) for op, shape in prog
                     if isinstance(op, schedule.Compute) and op.kind == "kernel"))
rank = max(range(W), key=lambda r: times[r])
calls = [op.call for op, _ in progs[rank] if isinstance(op, schedule.Compute) and op.kind == "kernel"]
shape = next(s for op, s in progs[rank] if s is not None)
print(f"{name}: {variant} W={W} S={S} {mask} {layout or ''} rank {rank}: {len(calls)} kernel calls")
single = {}
for phase in ("fwd", "bwd"):
    these = [c for c in calls if c.mode == phase]
    for c in set(these):
        if c not in single:
            single[c] = replay_ms([c])
    model = sum(cal.kernel_ms(KERNEL, c, shape) for c in these)
    singles = sum(single[c] for c in these)
    seq = replay_ms(these, reps=10)
    print(f"  {phase}: {len(these)} calls, {len(set(these))} distinct; model {model:.3f} ms, singles {singles:.3f} ms,"
          f" sequence {seq:.3f} ms")
for c in sorted(single, key=lambda c: (c.mode, -c.q * c.k)):
    print(f"    {c.mode} {c.mask} {c.q}x{c.k} w={c.window} x{calls.count(c)}: alone {single[c]:.4f} ms,"
          f" model {cal.kernel_ms(KERNEL, c, shape):.4f} ms")
