"""Write ringbench/model/calibrations/h200-provisional.json from committed H200 records (issue 24).

A stand-in until `ringbench calibrate --device cuda` runs on the H200: the kernel points are the
records' own reference timings (``ref_time_ms``: the kernel alone on one rank's share, causal,
32/8 heads x 128, bf16) of results/reference/2026-11-30-h200x2/llama3-8b.jsonl, forward from the
fwd records and backward as fwd_bwd minus fwd at the same size. What the records do not hold is
assumed, and the file says so: full (unmasked) blocks at the causal rate of the same size, no
spread (one median per point), and the merge, add and copy bandwidths read off the --profile
spans of results/reference/2026-12-02-h200-house/runs.jsonl (about 3 TB/s). Run from the
checkout's root: python results/reference/2026-12-02-h200-provisional-calibration/make.py
"""

import json
from pathlib import Path

from ringbench.model import calibration as C

ROOT = Path(__file__).resolve().parents[3]
RECORDS = ROOT / "results/reference/2026-11-30-h200x2/llama3-8b.jsonl"
OUT = ROOT / "ringbench/model/calibrations/h200-provisional.json"

ref = {}
env = None
for line in RECORDS.read_text().splitlines():
    r = json.loads(line)
    if r.get("status") != "ok" or r["spec"]["variant"] != "zigzag":
        continue
    s = r["spec"]
    local = s["seqlen"] // s["world_size"]
    ref[(r["kernel"], s["mode"], local)] = r["ref_time_ms"]
    env = env or r["env"]
shape = C.Shape(1, 32, 8, 128, 128, "bf16")
kernels = {}
for kernel in sorted({k for k, _, _ in ref}):
    sizes = sorted(n for k, m, n in ref if k == kernel and m == "fwd" and (k, "fwd_bwd", n) in ref)
    surfaces = []
    for mode in C.MODES:
        causal, full = [], []
        for n in sizes:
            t = ref[(kernel, "fwd", n)] if mode == "fwd" else ref[(kernel, "fwd_bwd", n)] - ref[(kernel, "fwd", n)]
            causal.append({"q": n, "k": n, "time_ms": t, "lo_ms": t, "hi_ms": t})
            # Not measured: a full block taken at the causal block's rate, so its time scales with its pairs.
            tf = t * C.point_pairs("full", n, n) / C.point_pairs("causal", n, n)
            full.append({"q": n, "k": n, "time_ms": tf, "lo_ms": tf, "hi_ms": tf})
        surfaces += [C.surface_dict(mode, "causal", shape, causal), C.surface_dict(mode, "full", shape, full)]
    kernels[kernel] = {"version": f"torch {env['torch']}" + (f", cuDNN {env['cudnn']}" if kernel == "cudnn" else ""),
                       "surfaces": surfaces}
calibration = {
    "format": C.FORMAT, "schema_version": C.SCHEMA_VERSION, "device": env["gpu_name"], "device_type": "cuda",
    "created_at": "2026-12-02T00:00:00+00:00", "provisional": True,
    "source": ("provisional, from the reference timings of results/reference/2026-11-30-h200x2/llama3-8b.jsonl "
               "(causal only; full blocks assumed at the causal rate; no spread; merge/add/copy from the "
               "--profile spans of 2026-12-02-h200-house); replace with ringbench calibrate --device cuda"),
    "kernels": kernels,
    "overheads": {"merge": {"fixed_ms": 0.005, "gib_s": 3000.0}, "add": {"fixed_ms": 0.005, "gib_s": 3000.0},
                  "copy": {"fixed_ms": 0.005, "gib_s": 3000.0}, "launch_ms": 0.01},
    "env": env,
}
OUT.write_text(json.dumps(calibration, indent=1) + "\n", encoding="utf-8")
print(f"wrote {OUT.relative_to(ROOT)}: kernels {', '.join(kernels)}")
