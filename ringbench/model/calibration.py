"""The calibration file: what one device's kernels and per-step work cost, measured, for ``ringbench predict``.

A calibration (JSON, written by ``ringbench calibrate``) is keyed by the device's name, and per
kernel by the kernel's name and version; it records the environment it was measured in
(``records.envinfo.collect``). It holds:

- **kernel rates**, per kernel: *surfaces*, each for one call direction (``fwd``: the kernel's
  forward; ``bwd``: its backward alone), one mask (``full``, ``causal``, ``window``), one dtype
  and one head shape (batch, heads, kv_heads, head_dim, head_dim_v), with measured points
  ``{q, k, window, time_ms, lo_ms, hi_ms}`` (q query rows against k key rows; a ``window``
  point is a square block of q rows under a causal window of ``window`` keys; lo and hi the
  10th and 90th percentile of the timed calls). The rate of a point is its FLOPs (flash-attn
  convention, ``case.work``) over its time; between points it is read bilinearly in log2 of
  the sizes (a surface, not a number), outside them at the nearest edge, and below the
  smallest size the point's time is a floor (launch-bound calls do not get faster), except for
  the keys of one document of a varlen call, which take the edge's rate (the call is one launch);
- **per-step overheads**: ``merge`` (the forward's fold of a block's out/lse, ``merge.merge_step``),
  ``add`` (the backward's gradient adds, ``merge.add_steps``) and ``copy`` (a contiguous copy:
  the Ulysses permutes, the all-gather's unshard), each a fixed ms plus bytes over GiB/s of GPU
  time;
- **host costs** (schema 2): the host's time to issue one call, per kernel and direction
  (``host_ms``: flash-attn-4's Python launch path costs more than PyTorch's C++ one) and per
  overhead, and ``launch_ms``, the host's time to issue any other op (a transfer);
- optionally **communication** measured on the machine: per link class a curve of bytes against
  GiB/s, which replaces that fabric row.

Schema 2 points are GPU time free of the host (``timing``: ``graph``, a CUDA graph of a few
back-to-back calls replayed and divided; ``back-to-back``, many calls between two events where
the capture failed, the host's time where it is the slower; ``cpu-clock`` on CPU). Schema 1
files are still read: their points are one call between two events, the host's issue cost
included (``host-inclusive``), and every op's host cost is their ``launch_ms``.

A call's time: its FLOPs over the rate of the nearest head shape's surface, looked up at
``q * (batch * heads) / (batch_cal * heads_cal)`` rows (the kernels parallelise over batch, heads
and query tiles, so more heads fill the GPU as more rows do) and ``k`` keys; a causal call of fewer
heads than calibrated takes the causal square's rate at its own rows times the occupancy the full
surface loses at the scaled rows (the causal surface has squares only). Among surfaces of one head
dim and GQA ratio, the one nearest the call's batch x heads wins: ``calibrate`` measures causal squares
at the heads a Ulysses rank keeps (``Grid.rank_shapes``), where fewer heads share each K/V head's
loads in cache and run faster than the occupancy rule says (a 4-head 16k call at 600 TFLOP/s
against the 32-head square's 590 on the H200). A varlen call is
priced per document at the call's total query rows and the document's keys.

A GPU without a calibration is *derived* from the nearest calibrated one (:func:`derive`):
kernel rates scaled by the ratio of the datasheet peaks (``ringbench.rank.peaks``), memory-bound
overheads by the ratio of memory bandwidths (``gpus.toml``); the result says so
("derived from H200 by peak ratio").

Torch-free. Source: issue 24.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from ringbench.errors import SpecError, unreadable

FORMAT = "ringbench-calibration"
#: The schema ``ringbench calibrate`` writes; :data:`READS` the ones this ringbench reads.
SCHEMA_VERSION = 2
READS = (1, 2)
#: How a schema 1 file's points were timed: one call between two CUDA events, the host's issue cost included.
HOST_INCLUSIVE = "host-inclusive"
#: How schema 2 points are timed (module docstring).
TIMINGS = ("graph", "back-to-back", "cpu-clock")
GIB = 1024 ** 3
MODES = ("fwd", "bwd")
MASKS = ("full", "causal", "window")
#: Which quantile of a point's timed calls each bound of an interval reads.
QUANTILES = ("lo", "mid", "hi")
_TIME_KEY = {"lo": "lo_ms", "mid": "time_ms", "hi": "hi_ms"}
#: Backward FLOPs over forward FLOPs in the flash-attn convention (fwd_bwd is 3.5 x fwd).
BWD_OVER_FWD = 2.5


class Call(NamedTuple):
    """One kernel call as the model prices it.

    Attributes:
        mode: ``fwd`` or ``bwd``.
        mask: ``full``, ``causal`` (square) or ``window``.
        q, k: query rows and key rows of the call (varlen: their totals).
        pairs: (query, key) pairs attended, per batch row and head.
        window: keys a query sees (``window`` mask), else 0.
        docs: varlen only: ``((lq, lk, pairs), ...)`` per document; empty for a batch call.
    """

    mode: str
    mask: str
    q: int
    k: int
    pairs: float
    window: int = 0
    docs: tuple = ()


class Shape(NamedTuple):
    """The attention shape a call runs at: batch, query heads, K/V heads, head dims, dtype."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype: str


def call_flops(call: Call, shape: Shape, pairs: float | None = None) -> float:
    """FLOPs of ``call`` (or of ``pairs`` of it) at ``shape``: ``4 * pairs * B * Hq * (D + Dv) / 2``
    forward, 2.5 times that backward (the flash-attn convention, ``case.work.attention_flops``)."""
    p = call.pairs if pairs is None else pairs
    fwd = 4.0 * p * shape.batch * shape.heads * (shape.head_dim + shape.head_dim_v) / 2
    return fwd * (BWD_OVER_FWD if call.mode == "bwd" else 1.0)


def point_pairs(mask: str, q: int, k: int, window: int = 0) -> float:
    """Pairs a calibration point's block attends: full ``q * k``; causal square ``q (q + 1) / 2``;
    a square block under a causal window of ``w`` keys ``sum_i min(w, i + 1)``."""
    if mask == "full":
        return float(q) * k
    if mask == "causal":
        return q * (q + 1) / 2
    w = min(window, q)
    return w * (w + 1) / 2 + float(q - w) * w


@dataclass(frozen=True)
class Surface:
    """The measured points of one (mode, mask, dtype, head shape): see the module docstring."""

    mode: str
    mask: str
    shape: Shape
    points: tuple[dict, ...]
    cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def _axis(self, p: dict) -> tuple[float, float]:
        second = p["window"] if self.mask == "window" else p["k"]
        return math.log2(p["q"]), math.log2(second)

    def _grid(self, which: str):
        """(q axis, second axis, log-rate at each measured point, the points) for quantile ``which``; cached."""
        if which not in self.cache:
            key = _TIME_KEY[which]
            pts = [(self._axis(p), math.log(call_flops(Call(self.mode, self.mask, p["q"], p["k"], point_pairs(
                self.mask, p["q"], p["k"], p.get("window", 0))), self.shape) / (p[key] * 1e-3)))
                for p in self.points]
            xs = sorted({a for (a, _), _ in pts})
            ys = sorted({b for (_, b), _ in pts}) if self.mask != "causal" else [0.0]
            if self.mask == "causal":
                pts = [((a, 0.0), r) for (a, _), r in pts]
            self.cache[which] = (xs, ys, dict(pts), pts)
        return self.cache[which]

    def rate(self, q: float, second: float, which: str = "mid", key_floor: bool = True) -> float:
        """FLOP/s at ``q`` query rows (already scaled to this surface's batch x heads) and ``second``
        keys (the window for a ``window`` surface; ignored for ``causal``). ``key_floor=False``: keys
        below the smallest measured size take that size's rate, not its time (one document of a
        varlen call, which is not a launch of its own)."""
        xs, ys, grid, pts = self._grid(which)

        def at(x: float, y: float) -> float:
            if (x, y) in grid:
                return grid[(x, y)]
            # A hole in the grid takes its nearest measured point (log sizes).
            return min(pts, key=lambda t: (t[0][0] - x) ** 2 + (t[0][1] - y) ** 2)[1]

        lq = math.log2(max(q, 1.0))
        lk = math.log2(max(second, 1.0)) if self.mask != "causal" else 0.0
        if self.mask == "causal" and lq > xs[-1] and len(xs) > 1:
            return _causal_beyond(2 ** xs[-2], math.exp(at(xs[-2], 0.0)), 2 ** xs[-1], math.exp(at(xs[-1], 0.0)), q)
        x0, x1, tx = _bracket(xs, min(max(lq, xs[0]), xs[-1]))
        y0, y1, ty = _bracket(ys, min(max(lk, ys[0]), ys[-1]))
        value = ((1 - tx) * (1 - ty) * at(x0, y0) + tx * (1 - ty) * at(x1, y0)
                 + (1 - tx) * ty * at(x0, y1) + tx * ty * at(x1, y1))
        rate = math.exp(value)
        # Below the smallest measured size a call takes at least that size's time.
        if lq < xs[0]:
            rate *= 2 ** (lq - xs[0])
        if lk < ys[0] and key_floor:
            rate *= 2 ** (lk - ys[0])
        return rate


def _causal_beyond(s1: float, r1: float, s2: float, r2: float, s: float) -> float:
    """A causal square's rate at ``s`` rows, past the largest measured ``s2`` (rate ``r2``; ``s1``, ``r1``
    the one before). The diagonal's partly masked tiles are a share ~1/s of the work, so a rate that
    still rose from ``s1`` to ``s2`` follows ``r(s) = r_inf (1 - c / s)`` through both; one that fell
    stays at ``r2``. (Flat, the H200's flash-attn-4 at 64k was priced 4% slow: 590 against 611 TFLOP/s.)"""
    if r2 <= r1:
        return r2
    loss = (r2 - r1) / (1 / s1 - 1 / s2)  # r_inf * c
    return r2 + loss / s2 - loss / s


def _bracket(axis: list[float], x: float) -> tuple[float, float, float]:
    if len(axis) == 1 or x <= axis[0]:
        return axis[0], axis[0], 0.0
    if x >= axis[-1]:
        return axis[-1], axis[-1], 0.0
    i = bisect.bisect_right(axis, x)
    a, b = axis[i - 1], axis[i]
    return a, b, (x - a) / (b - a)


@dataclass(frozen=True)
class Overhead:
    """A memory-bound step: ``fixed_ms + bytes / gib_s``; ``lo`` and ``hi`` scale it for the interval."""

    fixed_ms: float
    gib_s: float
    spread: tuple[float, float] = (1.0, 1.0)

    def ms(self, nbytes: float, which: str = "mid") -> float:
        scale = {"lo": self.spread[0], "mid": 1.0, "hi": self.spread[1]}[which]
        return (self.fixed_ms + nbytes / (self.gib_s * GIB) * 1e3) * scale


@dataclass(frozen=True)
class KernelCalibration:
    """One kernel's surfaces on the calibrated device.

    Attributes:
        host_ms: the host's time to issue one call, ms, per direction (``fwd``, ``bwd``); empty in
            a schema 1 file (the calibration's ``launch_ms`` stands in).
        timing: how the points were timed, per direction (:data:`TIMINGS`, or :data:`HOST_INCLUSIVE`).
    """

    name: str
    version: str | None
    surfaces: tuple[Surface, ...]
    host_ms: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)

    def surface(self, mode: str, mask: str, shape: Shape) -> tuple[Surface, str | None]:
        """The surface for a call, and a note when it is not the call's own mask or dtype."""
        notes = []
        own = [s for s in self.surfaces if s.mode == mode]
        if not own:
            raise SpecError(f"the calibration of kernel {self.name} has no {mode} surface; calibrate it again")
        by_mask = [s for s in own if s.mask == mask]
        if not by_mask:
            for other in {"window": ("full", "causal"), "full": ("causal",), "causal": ("full",)}[mask]:
                by_mask = [s for s in own if s.mask == other]
                if by_mask:
                    notes.append(f"{mask} blocks priced at the {other} rate (no {mask} points)")
                    break
            else:
                by_mask = own
        by_dtype = [s for s in by_mask if s.shape.dtype == shape.dtype] or by_mask
        if by_dtype is by_mask and by_mask[0].shape.dtype != shape.dtype:
            notes.append(f"{shape.dtype} priced at the {by_mask[0].shape.dtype} rate")

        def distance(s: Surface) -> tuple:
            c = s.shape
            return (c.head_dim != shape.head_dim, c.head_dim_v != shape.head_dim_v,
                    abs(c.head_dim - shape.head_dim) + abs(c.head_dim_v - shape.head_dim_v),
                    abs(math.log2(c.heads / c.kv_heads) - math.log2(shape.heads / shape.kv_heads)),
                    abs(math.log2(c.batch * c.heads) - math.log2(shape.batch * shape.heads)))

        best = min(by_dtype, key=distance)
        if best.shape.head_dim != shape.head_dim or best.shape.head_dim_v != shape.head_dim_v:
            notes.append(f"head dim {shape.head_dim}/{shape.head_dim_v} priced at the nearest calibrated "
                         f"{best.shape.head_dim}/{best.shape.head_dim_v}")
        return best, "; ".join(notes) or None

    def time_ms(self, call: Call, shape: Shape, which: str = "mid", scale: float = 1.0) -> float:
        """Milliseconds of ``call`` at ``shape``: its FLOPs over the surface's rate (module docstring),
        the rate times ``scale`` (a derived GPU's peak ratio)."""
        # A window call whose band reaches every key left of the diagonal is a causal call to the kernel
        # (bottom-right aligned, q <= k): a prefix mask's causal rows after the prompt, at 56k x 64k.
        # Priced at the window surface's widest band it came out 8-10% slow at 64k (H100, 2026-12-07).
        mask = "causal" if call.mask == "window" and call.window >= call.k >= call.q else call.mask
        surface, _ = self.surface(call.mode, mask, shape)
        if surface.mask == "causal":
            surface = self._past_squares(surface, call.q)
        fill = shape.batch * shape.heads / (surface.shape.batch * surface.shape.heads)
        if call.docs:
            full = self._full_twin(surface)
            total = 0.0
            for lq, lk, pairs in call.docs:
                if pairs <= 0:
                    continue
                second = call.window if surface.mask == "window" else lk
                # The call's rows set the fill; a short document's keys do not make it a launch of its own.
                rate = surface.rate(call.q * fill, second, which, key_floor=False)
                if surface.mask == "causal" and full is not None:
                    # ... but its diagonal and its short rows are its own: the full rate at the call's rows
                    # (how full the GPU is) times the causal square's share of the full rate at the
                    # document's own rows. (At the call's rate, zigzag_varlen's pieces of 512 to 4k rows
                    # came out 10-19% fast on the H100 and H200.)
                    rate = (full.rate(call.q * fill, call.q * fill, which) * surface.rate(lq, lq, which)
                            / full.rate(lq, lq, which))
                total += call_flops(call, shape, pairs) / (rate * scale)
            return total * 1e3
        # A window call's keys per row: its window, or more where its band is open to the right (a
        # ring step's part past the diagonal, band (0, None), whose window reads 1).
        per_row = call.pairs / max(call.q, 1)
        second = (max(call.window, per_row) if surface.mask == "window" else
                  (per_row if call.mask == "window" else call.k))
        if surface.mask == "causal" and fill < 1:
            return call_flops(call, shape) / (self._few_heads_causal(call, surface, fill, which) * scale) * 1e3
        return call_flops(call, shape) / (surface.rate(call.q * fill, second, which) * scale) * 1e3

    def _full_twin(self, surface: Surface) -> Surface | None:
        """The full surface of ``surface``'s direction and shape, or None."""
        return next((s for s in self.surfaces if s.mode == surface.mode and s.mask == "full"
                     and s.shape == surface.shape), None)

    def _past_squares(self, causal: Surface, q: float) -> Surface:
        """The causal surface that prices ``q`` rows: ``causal`` itself up to its largest square, and past
        it the one of most batch x heads of the same direction, dtype, head dims and GQA ratio. A surface
        of few heads (the rank shapes) rises between its largest squares mostly as it fills the GPU,
        which the diagonal's ``1/s`` extrapolation would carry on past them: a Ulysses rank of 4 heads
        was priced 22% fast at 64k (H100, 2026-12-07). Past its squares such a call fills the GPU as
        the full surface does, whose rise is the diagonal's alone."""
        if q <= max(p["q"] for p in causal.points):
            return causal

        def bh(s: Surface) -> int:
            return s.shape.batch * s.shape.heads

        def kind(s: Surface) -> tuple:
            c = s.shape
            return s.mode, s.mask, c.dtype, c.head_dim, c.head_dim_v, c.heads // c.kv_heads

        peers = [s for s in self.surfaces if kind(s) == kind(causal) and bh(s) > bh(causal)]
        return max(peers, key=bh, default=causal)

    def _few_heads_causal(self, call: Call, causal: Surface, fill: float, which: str) -> float:
        """The rate of a causal call of fewer batch x heads than its surface's (``fill`` < 1): the
        causal square's rate at the call's own rows, times the occupancy the full surface loses
        from ``q`` to ``q * fill`` rows at the call's keys. The causal surface has only squares, and
        looking a Ulysses rank's 16k causal call of 4 heads up as a 2k square of 32 heads prices it
        at short rows it does not have (85% slow on the H200, docs/validation.md)."""
        full = [s for s in self.surfaces if s.mode == call.mode and s.mask == "full" and s.shape == causal.shape]
        if not full:
            return causal.rate(call.q * fill, call.k, which)
        occupancy = full[0].rate(call.q * fill, call.k, which) / full[0].rate(call.q, call.k, which)
        return causal.rate(call.q, call.k, which) * min(1.0, occupancy)


@dataclass(frozen=True)
class Calibration:
    """A device's calibration (module docstring), perhaps derived from another device's.

    Attributes:
        device: the device's name (``NVIDIA H200``, ``cpu``).
        device_type: ``cuda`` or ``cpu``.
        kernels: kernel name -> :class:`KernelCalibration`.
        merge, add, copy: the memory-bound steps (GPU time; schema 1: one call, host included).
        launch_ms: the host's time to issue an op without a measured cost of its own (a transfer;
            schema 1: every op).
        host_ms: the host's time to issue one ``merge``, ``add`` or ``copy``, ms (schema 2).
        schema_version: the file's schema (1: :data:`HOST_INCLUSIVE` points).
        comm: link class -> ``{"curve": [[bytes, GiB/s], ...], "source": str}``, measured links.
        env: the environment it was measured in.
        source: where it came from (a file, a note such as "provisional").
        rate_scale, memory_scale: a derived calibration's peak and memory-bandwidth ratios (1: measured).
        derived_from: the calibrated device's name, for a derived one; else None.
    """

    device: str
    device_type: str
    kernels: dict[str, KernelCalibration]
    merge: Overhead
    add: Overhead
    copy: Overhead
    launch_ms: float
    comm: dict = field(default_factory=dict)
    host_ms: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    env: dict | None = None
    source: str = ""
    created_at: str | None = None
    rate_scale: float = 1.0
    memory_scale: float = 1.0
    derived_from: str | None = None

    def kernel(self, name: str, runs: list[str] | None = None, gpu: str = "") -> KernelCalibration:
        """The calibration of kernel ``name`` (``auto``: the first one in the file); ``runs``: the
        calibrated kernels ``gpu`` can run, which a refusal offers in place of them all.

        Raises:
            SpecError: a kernel the calibration does not hold.
        """
        if name == "auto":
            return next(iter(self.kernels.values()))
        if name not in self.kernels:
            from ringbench.variants.kernels import KERNELS  # imports torch; a refusal only

            offer = runs or list(self.kernels)
            which = f" (those {gpu} runs)" if len(offer) < len(self.kernels) else ""
            kernel = KERNELS.get(name)
            # Only a kernel of the calibration's device can be calibrated into it.
            calibrable = kernel is not None and kernel.device_type in (self.device_type, "any")
            more = f", or calibrate {name} with ringbench calibrate --kernel {name}" if calibrable else ""
            raise SpecError(f"kernel {name!r} is not in the calibration of {self.device}, which holds "
                            f"{', '.join(offer)}{which}; pass --kernel with one of them{more}")
        return self.kernels[name]

    def kernel_ms(self, kernel: str, call: Call, shape: Shape, which: str = "mid") -> float:
        """Milliseconds of one kernel call on this device (a derived one's rate scaled)."""
        return self.kernel(kernel).time_ms(call, shape, which, self.rate_scale)

    def issue_ms(self, kind: str, kernel: str | None = None, mode: str = "fwd") -> float:
        """The host's time to issue one op, ms: a ``kernel`` call of ``kernel`` in ``mode``, a
        ``merge``, ``add`` or ``copy``, or anything else (a transfer): ``launch_ms``, where the
        file measured nothing of its own for it (schema 1)."""
        if kind == "kernel":
            return self.kernel(kernel).host_ms.get(mode, self.launch_ms)
        return self.host_ms.get(kind, self.launch_ms)

    @property
    def host_inclusive(self) -> bool:
        """Whether the points hold the host's issue cost (a schema 1 file)."""
        return self.schema_version == 1

    def overhead_ms(self, kind: str, nbytes: float, which: str = "mid") -> float:
        """Milliseconds of a ``merge``, ``add`` or ``copy`` of ``nbytes`` bytes (a derived one's scaled)."""
        return getattr(self, kind).ms(nbytes, which) / self.memory_scale

    def provenance(self) -> str:
        """One line: measured where and when, or derived from what."""
        if self.derived_from:
            return f"derived from {self.derived_from} by peak ratio ({self.source})"
        if self.host_inclusive:
            return f"{self.source}; schema 1, its points host-inclusive"
        return self.source


# --------------------------------------------------------------------------- reading and writing

def _bad(where: str, what: str) -> SpecError:
    return SpecError(f"calibration {where} {what}; write it again with ringbench calibrate")


def _positive(where: str, what: str, value: Any) -> float:
    if not (isinstance(value, (int, float)) and value >= 0):
        raise _bad(where, f"has {what} {value!r}, which must be a number of ms, 0 or more")
    return float(value)


def from_dict(raw: Any, where: str) -> Calibration:
    """A :class:`Calibration` from its JSON form.

    Raises:
        SpecError: not a calibration, another schema version, or a missing or bad field; one sentence.
    """
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise _bad(where, f"is not a ringbench calibration (its format is not {FORMAT!r})")
    version = raw.get("schema_version")
    if version not in READS:
        raise _bad(where, f"has schema_version {version!r}, but this ringbench reads "
                          f"{' and '.join(map(str, READS))}")
    try:
        kernels = {}
        for name, k in raw["kernels"].items():
            surfaces = []
            for s in k["surfaces"]:
                if s["mode"] not in MODES or s["mask"] not in MASKS:
                    raise _bad(where, f"has a surface of mode {s['mode']!r} and mask {s['mask']!r}; modes are "
                                      f"{', '.join(MODES)} and masks {', '.join(MASKS)}")
                shape = Shape(int(s["batch"]), int(s["heads"]), int(s["kv_heads"]), int(s["head_dim"]),
                              int(s.get("head_dim_v") or s["head_dim"]), str(s["dtype"]))
                points = tuple(dict(p) for p in s["points"])
                if not points or any(not all(p.get(key, 0) > 0 for key in ("q", "k", "time_ms", "lo_ms", "hi_ms"))
                                     for p in points):
                    raise _bad(where, f"has a {name} {s['mode']} {s['mask']} surface without points, or a point "
                                      "whose q, k, time_ms, lo_ms or hi_ms is not positive")
                if s["mask"] == "window" and any(not p.get("window", 0) > 0 for p in points):
                    raise _bad(where, f"has a {name} window point without a positive window")
                surfaces.append(Surface(s["mode"], s["mask"], shape, points))
            missing = [m for m in MODES if not any(s.mode == m for s in surfaces)]
            if missing:
                raise _bad(where, f"has no {missing[0]} surface for kernel {name}")
            host = {} if version == 1 else {m: _positive(where, f"{name} host_ms {m}", k["host_ms"][m]) for m in MODES}
            timing = dict.fromkeys(MODES, HOST_INCLUSIVE) if version == 1 else dict(k.get("timing") or {})
            kernels[name] = KernelCalibration(name, k.get("version"), tuple(surfaces), host, timing)
        over = raw["overheads"]

        def overhead(key: str) -> Overhead:
            o = over[key]
            if not (o["gib_s"] > 0 and o["fixed_ms"] >= 0):
                raise _bad(where, f"has {key} overhead {o!r}, whose gib_s must be positive and fixed_ms 0 or more")
            return Overhead(float(o["fixed_ms"]), float(o["gib_s"]), tuple(o.get("spread", (1.0, 1.0))))

        if not kernels:
            raise _bad(where, "holds no kernel")
        if raw["device_type"] not in ("cuda", "cpu"):
            raise _bad(where, f"has device_type {raw['device_type']!r}, which is neither cuda nor cpu")
        return Calibration(device=str(raw["device"]), device_type=str(raw["device_type"]), kernels=kernels,
                           merge=overhead("merge"), add=overhead("add"), copy=overhead("copy"),
                           launch_ms=_positive(where, "launch_ms", over["launch_ms"]), comm=dict(raw.get("comm") or {}),
                           host_ms={} if version == 1 else {key: _positive(where, f"{key} host_ms", over[key]["host_ms"])
                                                            for key in ("merge", "add", "copy")},
                           schema_version=version, env=raw.get("env"), source=str(raw.get("source") or where),
                           created_at=raw.get("created_at"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise _bad(where, f"lacks or mistypes a field ({type(exc).__name__}: {exc})") from None


def load(path: Path, option: str = "--calibration") -> Calibration:
    """Read a calibration file, given with ``option`` (``--calibration``, or ``--gpu``, which also takes one).

    Raises:
        SpecError: an unreadable file, bad JSON, or :func:`from_dict`'s refusals.
    """
    where = repr(str(path))
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        alternative = "a GPU of the peaks table (H100, A100...) or " if option == "--gpu" else ""
        raise SpecError(f"calibration {where} cannot be read ({unreadable(exc)}); pass "
                        f"{option} with {alternative}a file ringbench calibrate wrote") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"calibration {where} is not JSON ({exc.msg} at line {exc.lineno}); pass a file "
                        "ringbench calibrate wrote") from None
    cal = from_dict(raw, where)
    return cal if cal.source != where else replace(cal, source=str(path))


def shipped() -> list[Calibration]:
    """The calibrations shipped with ringbench (``ringbench/model/calibrations/*.json``), measured ones
    before those marked ``provisional``, so a measured one of the same GPU wins."""
    found = []
    folder = resources.files("ringbench.model").joinpath("calibrations")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            raw = json.loads(entry.read_text(encoding="utf-8"))
            found.append((bool(raw.get("provisional")), from_dict(raw, f"ringbench/model/calibrations/{entry.name}")))
    return [cal for _, cal in sorted(found, key=lambda pc: pc[0])]


def surface_dict(mode: str, mask: str, shape: Shape, points: Iterable[dict]) -> dict:
    """The JSON form of one surface."""
    return {"mode": mode, "mask": mask, "dtype": shape.dtype, "batch": shape.batch, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "head_dim_v": shape.head_dim_v,
            "points": list(points)}


def derive(cal: Calibration, name: str, *, rate_scale: float, memory_scale: float) -> Calibration:
    """``cal`` standing in for GPU ``name``: rates times ``rate_scale`` (the ratio of the datasheet
    peaks, target over calibrated), memory-bound steps times ``memory_scale`` (of the memory
    bandwidths); its provenance says "derived from <device> by peak ratio"."""
    return replace(cal, device=name, rate_scale=cal.rate_scale * rate_scale,
                   memory_scale=cal.memory_scale * memory_scale, derived_from=cal.derived_from or cal.device,
                   comm={})
