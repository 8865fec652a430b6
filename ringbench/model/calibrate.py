"""``ringbench calibrate``: measure what the model needs on this machine and write a calibration file.

For each kernel and head shape of the grid it times the kernel's forward and its backward alone
on blocks of q query rows against k key rows (``full``: every pair of q x k; ``causal``: square
blocks; ``window``: square blocks under a causal window of w keys). Each point is the GPU's time
free of the host (one call between two CUDA events is the host's launch cost for a small block,
not its work): on CUDA a graph of :data:`GRAPH_CALLS` back-to-back calls is captured and each
replay timed with events and divided (``timing: graph``); where the capture fails,
:data:`BACK_TO_BACK` calls between two events (``back-to-back``: still the host's pace where the
host is the slower); on CPU ``perf_counter`` per call (``cpu-clock``). Each point keeps the
median and the 10th and 90th percentile of its timed repeats. Then the per-step overheads, timed
the same way: the engine's own ``merge.merge_step`` and ``merge.add_steps`` at three sizes and a
contiguous copy (each a fixed time plus bytes over a bandwidth, the least-squares line through
the points). Last, the host's time to issue one call (``perf_counter`` over
:data:`ISSUE_CALLS` calls on a small block, without waiting for the device): per kernel and
direction, of merge, add and copy, and ``launch_ms`` (a tiny ``merge_step``) for any other op.

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

#: Calls captured in one CUDA graph, whose replay time divided by them is a point's GPU time.
GRAPH_CALLS = 4
#: Calls between two events where a capture fails.
BACK_TO_BACK = 20
#: Calls the host issues, unwaited, to time one issue.
ISSUE_CALLS = 50


@dataclass(frozen=True)
class Grid:
    """What one calibration measures.

    Attributes:
        sizes: block rows (q and k) of the full points, and the causal points' sides.
        windows: the windows of the window points (each below the point's side).
        shapes: head shapes ``(heads, kv_heads, head_dim, head_dim_v)``.
        rank_shapes: head shapes measured on causal squares only: what a Ulysses or USP rank keeps
            of the first shape (its heads and K/V heads over the Ulysses degree), priced apart since
            fewer heads per call run at another rate (``calibration`` module docstring).
        dtype: the input dtype's short name.
        iters, warmup: timed and untimed calls per point.
    """

    sizes: tuple[int, ...]
    windows: tuple[int, ...]
    shapes: tuple[tuple[int, int, int, int], ...]
    dtype: str
    iters: int
    warmup: int
    rank_shapes: tuple[tuple[int, int, int, int], ...] = ()


def default_grid(device_type: str) -> Grid:
    """The grid ``ringbench calibrate`` measures by default on ``cpu`` or ``cuda`` (module docstring)."""
    if device_type == "cpu":
        return Grid(sizes=(256, 512, 1024), windows=(256,), shapes=((4, 2, 32, 32),), dtype="fp32", iters=3,
                    warmup=1, rank_shapes=((2, 1, 32, 32),))
    return Grid(sizes=(256, 512, 1024, 2048, 4096, 8192, 16384), windows=(512, 2048, 8192),
                shapes=((32, 8, 128, 128), (64, 8, 128, 128), (16, 16, 64, 64)), dtype="bf16", iters=10, warmup=3,
                rank_shapes=((16, 4, 128, 128), (8, 2, 128, 128), (4, 1, 128, 128)))


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
    from ringbench.records.envinfo import collect
    from ringbench.variants.kernels import resolve_kernel
    from ringbench.variants.kernels.common import accumulation_dtype

    dev = torch.device(device)
    dtype = getattr(torch, DTYPES[grid.dtype])
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dt)

    timings: dict[str, set] = {}

    def timed(fn, kind: str = "") -> list[float]:
        times, how = gpu_times(fn, iters=grid.iters, warmup=grid.warmup, device=dev)
        timings.setdefault(kind, set()).add(how)
        return times

    started = time.perf_counter()
    out_kernels = {}
    for name in kernels:
        surfaces = []
        for heads, kv_heads, head_dim, head_dim_v in grid.shapes + grid.rank_shapes:
            causal_only = (heads, kv_heads, head_dim, head_dim_v) not in grid.shapes
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
                    fwd = timed(lambda: kernel.forward(q, k, v, causal, scale, **kw), f"{name} fwd")
                    out, lse = kernel.forward(q, k, v, causal, scale, **kw)
                    bwd = timed(lambda: kernel.backward(dout, q, k, v, out, lse, causal, scale, **kw), f"{name} bwd")
                return fwd, bwd

            for a in grid.sizes:
                for b in () if causal_only else grid.sizes:
                    fwd, bwd = block(a, b, False)
                    points[("fwd", "full")].append(_point(fwd, q=a, k=b))
                    points[("bwd", "full")].append(_point(bwd, q=a, k=b))
                fwd, bwd = block(a, a, True)
                points[("fwd", "causal")].append(_point(fwd, q=a, k=a))
                points[("bwd", "causal")].append(_point(bwd, q=a, k=a))
                if kernel.takes_window and not causal_only:
                    for w in grid.windows:
                        if w < a:
                            fwd, bwd = block(a, a, False, window=w)
                            points[("fwd", "window")].append(_point(fwd, q=a, k=a, window=w))
                            points[("bwd", "window")].append(_point(bwd, q=a, k=a, window=w))
            surfaces += [cal_mod.surface_dict(m, k, shape, pts) for (m, k), pts in points.items() if pts]
            say(f"{name} {heads}/{kv_heads}x{head_dim}: {sum(len(p) for p in points.values())} points, "
                f"{time.perf_counter() - started:.0f} s so far")
        host = _kernel_issue_ms(resolve_kernel(name, dev.type, dtype=dtype, head_dim=grid.shapes[0][2],
                                               head_dim_v=grid.shapes[0][3]), grid, dev, rand)
        out_kernels[name] = {"version": kernel.version(), "surfaces": surfaces, "host_ms": host,
                             "timing": {m: _timing(timings.get(f"{name} {m}", set())) for m in cal_mod.MODES}}
    overheads = _overheads(dev, dtype, accumulation_dtype(dtype), grid, timed, rand)
    env = collect(kernels[0])
    name = env["gpu_name"] if dev.type == "cuda" else "cpu"
    return {"format": cal_mod.FORMAT, "schema_version": cal_mod.SCHEMA_VERSION, "device": name,
            "device_type": dev.type, "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            "source": f"measured {_dt.date.today().isoformat()} by ringbench calibrate on {name}",
            "grid": {"sizes": list(grid.sizes), "windows": list(grid.windows), "shapes": [list(s) for s in grid.shapes],
                     "rank_shapes": [list(s) for s in grid.rank_shapes],
                     "dtype": grid.dtype, "iters": grid.iters, "warmup": grid.warmup},
            "elapsed_s": time.perf_counter() - started, "kernels": out_kernels,
            "overheads": {**overheads, "timing": _timing(timings.get("overheads", set()))}, "env": env}


def _timing(found: set) -> str:
    # A kernel some of whose points could not be captured says so.
    return next((t for t in ("back-to-back", "cpu-clock", "graph") if t in found), "graph")


def gpu_times(fn: Callable[[], object], *, iters: int, warmup: int, device) -> tuple[list[float], str]:
    """``iters`` GPU times of one call of ``fn`` in ms, free of the host's issue cost, and how they
    were timed (module docstring): a CUDA graph of :data:`GRAPH_CALLS` calls replayed
    (``graph``), else :data:`BACK_TO_BACK` calls between two events (``back-to-back``); on CPU
    ``perf_counter`` around each call (``cpu-clock``), after ``warmup`` untimed calls.

    Source: issue 24 (the host's launch cost read as GPU time); PyTorch's CUDA graphs notes.
    """
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times, "cpu-clock"
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph, calls = None, BACK_TO_BACK
    try:
        side = torch.cuda.Stream(device)  # torch.cuda.graph asks for a warm-up on a side stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        graph.replay()  # the first replay uploads the graph
        calls = GRAPH_CALLS
    except Exception:  # noqa: BLE001 - a call that cannot be captured is timed back to back, and the file says so
        graph = None
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(calls):
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return times, "graph" if calls == GRAPH_CALLS else "back-to-back"


def issue_ms(fn: Callable[[], object], device, calls: int = ISSUE_CALLS) -> float:
    """The host's time to issue one call of ``fn``, ms: ``perf_counter`` over ``calls`` calls made
    without waiting for the device, after one call and a synchronisation (on CPU the call itself)."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - t0) / calls * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return took


def _kernel_issue_ms(kernel, grid: Grid, dev, rand) -> dict:
    """The host's time to issue one forward and one backward call of ``kernel`` on the grid's
    smallest full block at its first head shape, ms per direction."""
    import torch

    heads, kv_heads, head_dim, head_dim_v = grid.shapes[0]
    n = grid.sizes[0]
    q, k, v = rand(1, n, heads, head_dim), rand(1, n, kv_heads, head_dim), rand(1, n, kv_heads, head_dim_v)
    dout = rand(1, n, heads, head_dim_v)
    scale = head_dim ** -0.5
    with torch.no_grad():
        out, lse = kernel.forward(q, k, v, False, scale)
        return {"fwd": issue_ms(lambda: kernel.forward(q, k, v, False, scale), dev),
                "bwd": issue_ms(lambda: kernel.backward(dout, q, k, v, out, lse, False, scale), dev)}


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
    """The merge, add and copy lines, their host costs and the launch time (module docstring)."""
    import torch

    from ringbench.variants.engines.merge import add_steps, merge_step

    heads, kv_heads, head_dim, head_dim_v = grid.shapes[0]
    esize = torch.empty((), dtype=dtype).element_size()
    rows = (grid.sizes[0] * 4, grid.sizes[len(grid.sizes) // 2] * 4, grid.sizes[-1] * 4)

    def timed(fn, _timed=timed):  # cheap steps: more calls for a steadier median
        return _timed(fn, "overheads") + _timed(fn, "overheads") + _timed(fn, "overheads")

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
    # The host's issue costs, on the smallest size (merge_step compiled and cached by now).
    n = rows[0]
    out, lse = rand(1, n, heads, head_dim_v, dt=acc), rand(1, heads, n, dt=acc)
    b_out, b_lse = rand(1, n, heads, head_dim_v), rand(1, heads, n, dt=acc)
    grads = [(rand(1, n, h, d, dt=acc), rand(1, n, h, d)) for h, d in ((heads, head_dim), (kv_heads, head_dim),
                                                                        (kv_heads, head_dim_v))]
    src = rand(1, heads, n, head_dim)
    host = {"merge": issue_ms(lambda: merge_step(out, lse, slice(None), b_out, b_lse, into=acc), dev),
            "add": issue_ms(lambda: add_steps([(a, slice(None), g, acc, a.shape, None) for a, g in grads]), dev),
            "copy": issue_ms(lambda: src.transpose(1, 2).contiguous(), dev)}
    t_out, t_lse = rand(1, 8, heads, head_dim_v, dt=acc), rand(1, heads, 8, dt=acc)
    t_blk, t_blse = rand(1, 8, heads, head_dim_v), rand(1, heads, 8, dt=acc)
    launch_ms = issue_ms(lambda: merge_step(t_out, t_lse, slice(None), t_blk, t_blse, into=acc), dev, calls=200)
    spread = (min(s[0] for s in spreads), max(s[1] for s in spreads))
    return {"merge": {**_fit(merge), "spread": spread, "host_ms": host["merge"]},
            "add": {**_fit(add), "spread": spread, "host_ms": host["add"]},
            "copy": {**_fit(copy), "spread": spread, "host_ms": host["copy"]}, "launch_ms": launch_ms,
            "points": {"merge": merge, "add": add, "copy": copy}}


def write(calibration: dict, out: Path) -> None:
    """Write a calibration's JSON form to ``out`` (its folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(calibration, indent=1) + "\n", encoding="utf-8")
