"""``ringbench calibrate``: measure what the model needs on this machine and write a calibration file.

For each kernel and head shape of the grid it times the kernel's forward and its backward alone
on blocks of q query rows against k key rows (``full``: every pair of q x k; ``causal``: square
blocks; ``window``: square blocks under a causal window of w keys), with the timing protocol of
``run`` (``ringbench.rank.bench.time_iterations``: warm-up calls, then CUDA events per call, or
``perf_counter`` on CPU). Each point keeps the median and the 10th and 90th percentile. Then the
per-step overheads: the engine's own ``merge.merge_step`` and ``merge.add_steps`` at three sizes
and a contiguous copy (each a fixed time plus bytes over a bandwidth, the least-squares line
through the points), and the host's time to issue one engine step (``merge_step`` on a tiny
block, timed on the host without waiting for the device).

The default grid (:func:`default_grid`) is small on CPU (under a minute) and covers 256 to 16k
rows on CUDA (under 8 minutes on an H200 for four kernels and three head shapes). Communication
is not measured here yet: predictions take it from the fabric table.

Source: issue 24.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ringbench.model import calibration as cal_mod
from ringbench.model.calibration import Shape


@dataclass(frozen=True)
class Grid:
    """What one calibration measures.

    Attributes:
        sizes: block rows (q and k) of the full points, and the causal points' sides.
        windows: the windows of the window points (each below the point's side).
        shapes: head shapes ``(heads, kv_heads, head_dim, head_dim_v)``.
        dtype: the input dtype's short name.
        iters, warmup: timed and untimed calls per point.
    """

    sizes: tuple[int, ...]
    windows: tuple[int, ...]
    shapes: tuple[tuple[int, int, int, int], ...]
    dtype: str
    iters: int
    warmup: int


def default_grid(device_type: str) -> Grid:
    """The grid ``ringbench calibrate`` measures by default on ``cpu`` or ``cuda`` (module docstring)."""
    if device_type == "cpu":
        return Grid(sizes=(256, 512, 1024), windows=(256,), shapes=((4, 2, 32, 32),), dtype="fp32", iters=3,
                    warmup=1)
    return Grid(sizes=(256, 512, 1024, 2048, 4096, 8192, 16384), windows=(512, 2048, 8192),
                shapes=((32, 8, 128, 128), (64, 8, 128, 128), (16, 16, 64, 64)), dtype="bf16", iters=10, warmup=3)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (pos - lo) * (values[hi] - values[lo])


def _point(times: list[float], **where) -> dict:
    return {**where, "time_ms": statistics.median(times), "lo_ms": _quantile(times, 0.1),
            "hi_ms": _quantile(times, 0.9)}


def measure(*, device: str, kernels: list[str], grid: Grid, say: Callable[[str], None] = lambda s: None) -> dict:
    """Measure ``kernels`` over ``grid`` on ``device`` (``cpu`` or ``cuda``); the calibration's JSON form.

    Raises:
        ValueError: a kernel that cannot run here (``kernels.resolve_kernel``'s sentence).
    """
    import torch

    from ringbench.case.fields import DTYPES
    from ringbench.rank.bench import time_iterations
    from ringbench.records.envinfo import collect
    from ringbench.variants.kernels import resolve_kernel
    from ringbench.variants.kernels.common import accumulation_dtype

    dev = torch.device(device)
    dtype = getattr(torch, DTYPES[grid.dtype])
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dt)

    def timed(fn) -> list[float]:
        return time_iterations(fn, iters=grid.iters, warmup=grid.warmup, device=dev)

    started = time.perf_counter()
    out_kernels = {}
    for name in kernels:
        surfaces = []
        for heads, kv_heads, head_dim, head_dim_v in grid.shapes:
            kernel = resolve_kernel(name, dev.type, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v)
            shape = Shape(1, heads, kv_heads, head_dim, head_dim_v, grid.dtype)
            scale = head_dim ** -0.5
            points = {(m, k): [] for m in cal_mod.MODES for k in cal_mod.MASKS}

            def block(q_rows: int, k_rows: int, causal: bool, window=None):
                q = rand(1, q_rows, heads, head_dim)
                k = rand(1, k_rows, kv_heads, head_dim)
                v = rand(1, k_rows, kv_heads, head_dim_v)
                dout = rand(1, q_rows, heads, head_dim_v)
                kw = {"window": (window - 1, 0)} if window else {}
                with torch.no_grad():
                    fwd = timed(lambda: kernel.forward(q, k, v, causal, scale, **kw))
                    out, lse = kernel.forward(q, k, v, causal, scale, **kw)
                    bwd = timed(lambda: kernel.backward(dout, q, k, v, out, lse, causal, scale, **kw))
                return fwd, bwd

            for a in grid.sizes:
                for b in grid.sizes:
                    fwd, bwd = block(a, b, False)
                    points[("fwd", "full")].append(_point(fwd, q=a, k=b))
                    points[("bwd", "full")].append(_point(bwd, q=a, k=b))
                fwd, bwd = block(a, a, True)
                points[("fwd", "causal")].append(_point(fwd, q=a, k=a))
                points[("bwd", "causal")].append(_point(bwd, q=a, k=a))
                if kernel.takes_window:
                    for w in grid.windows:
                        if w < a:
                            fwd, bwd = block(a, a, False, window=w)
                            points[("fwd", "window")].append(_point(fwd, q=a, k=a, window=w))
                            points[("bwd", "window")].append(_point(bwd, q=a, k=a, window=w))
            surfaces += [cal_mod.surface_dict(m, k, shape, pts) for (m, k), pts in points.items() if pts]
            say(f"{name} {heads}/{kv_heads}x{head_dim}: {sum(len(p) for p in points.values())} points, "
                f"{time.perf_counter() - started:.0f} s so far")
        out_kernels[name] = {"version": kernel.version(), "surfaces": surfaces}
    overheads = _overheads(dev, dtype, accumulation_dtype(dtype), grid, timed, rand)
    env = collect(kernels[0])
    name = env["gpu_name"] if dev.type == "cuda" else "cpu"
    return {"format": cal_mod.FORMAT, "schema_version": cal_mod.SCHEMA_VERSION, "device": name,
            "device_type": dev.type, "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "source": f"measured {_dt.date.today().isoformat()} by ringbench calibrate on {name}",
            "grid": {"sizes": list(grid.sizes), "windows": list(grid.windows), "shapes": [list(s) for s in grid.shapes],
                     "dtype": grid.dtype, "iters": grid.iters, "warmup": grid.warmup},
            "elapsed_s": time.perf_counter() - started, "kernels": out_kernels, "overheads": overheads, "env": env}


def _fit(points: list[tuple[float, float]]) -> dict:
    """``fixed_ms`` and ``gib_s`` of the least-squares line through (bytes, ms) points, the fixed part
    at least 0 and the slope positive (else the largest point's bandwidth, with no fixed part)."""
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((b - mb) ** 2 for b, _ in points)
    slope = sum((b - mb) * (t - mt) for b, t in points) / var if var else 0.0
    fixed = mt - slope * mb
    if slope <= 0 or fixed < 0:
        b, t = max(points)
        slope, fixed = (t / b, 0.0) if slope <= 0 else (mt / mb, 0.0)
    return {"fixed_ms": fixed, "gib_s": 1.0 / (slope * 1e-3 * 1024 ** 3)}


def _overheads(dev, dtype, acc, grid: Grid, timed, rand) -> dict:
    """The merge, add and copy lines and the launch time (module docstring)."""
    import torch

    from ringbench.variants.engines.merge import add_steps, merge_step

    heads, kv_heads, head_dim, head_dim_v = grid.shapes[0]
    esize = torch.empty((), dtype=dtype).element_size()
    rows = (grid.sizes[0] * 4, grid.sizes[len(grid.sizes) // 2] * 4, grid.sizes[-1] * 4)

    def timed(fn, _timed=timed):  # cheap steps: more calls for a steadier median
        return _timed(fn) + _timed(fn) + _timed(fn)

    merge, add, copy, spreads = [], [], [], []
    for n in rows:
        out = rand(1, n, heads, head_dim_v, dt=acc)
        lse = rand(1, heads, n, dt=acc)
        b_out, b_lse = rand(1, n, heads, head_dim_v), rand(1, heads, n, dt=acc)
        t = timed(lambda: merge_step(out, lse, slice(None), b_out, b_lse, into=acc))
        merge.append((n * heads * (head_dim_v * (4 + esize + 4) + 12), statistics.median(t)))
        spreads.append((_quantile(t, 0.1) / statistics.median(t), _quantile(t, 0.9) / statistics.median(t)))
        dq, dk, dv = rand(1, n, heads, head_dim, dt=acc), rand(1, n, kv_heads, head_dim, dt=acc), rand(
            1, n, kv_heads, head_dim_v, dt=acc)
        gq, gk, gv = rand(1, n, heads, head_dim), rand(1, n, kv_heads, head_dim), rand(1, n, kv_heads, head_dim_v)
        jobs = [(a, slice(None), g, acc, a.shape, None) for a, g in ((dq, gq), (dk, gk), (dv, gv))]
        t = timed(lambda: add_steps(jobs))
        add.append((n * (heads * head_dim + kv_heads * (head_dim + head_dim_v)) * (4 + esize + 4), statistics.median(t)))
        src = rand(1, heads, n, head_dim)
        t = timed(lambda: src.transpose(1, 2).contiguous())
        copy.append((2 * src.numel() * esize, statistics.median(t)))
    t_out, t_lse = rand(1, 8, heads, head_dim_v, dt=acc), rand(1, heads, 8, dt=acc)
    t_blk, t_blse = rand(1, 8, heads, head_dim_v), rand(1, heads, 8, dt=acc)
    merge_step(t_out, t_lse, slice(None), t_blk, t_blse, into=acc)  # compiled and cached before the clock
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(200):
        merge_step(t_out, t_lse, slice(None), t_blk, t_blse, into=acc)
    launch_ms = (time.perf_counter() - t0) / 200 * 1e3
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    spread = (min(s[0] for s in spreads), max(s[1] for s in spreads))
    return {"merge": {**_fit(merge), "spread": spread}, "add": {**_fit(add), "spread": spread},
            "copy": {**_fit(copy), "spread": spread}, "launch_ms": launch_ms,
            "points": {"merge": merge, "add": add, "copy": copy}}


def write(calibration: dict, out: Path) -> None:
    """Write a calibration's JSON form to ``out`` (its folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(calibration, indent=1) + "\n", encoding="utf-8")
