"""The fabric table and the cluster: what a transfer between two ranks costs, by link class.

A :class:`Link` is one row of ``fabrics.toml`` (package data): a datasheet's bandwidth per
direction with an assumed latency, or a measured bandwidth-against-size curve read in log size.
A :class:`Cluster` places ranks on hosts (``gpus_per_node`` consecutive ranks per node, as
torchrun numbers them) and answers which link joins two ranks: ``intra-node`` inside a host,
``inter-node`` between hosts (one NIC per GPU). ``--cluster FILE.toml`` describes one:

.. code-block:: toml

    gpu = "H100"            # a peaks-table name or a calibration file
    gpus_per_node = 8
    nodes = 4
    intra = "nvlink4"       # rows of the fabric table, or of [fabric.NAME] below
    inter = "ib-ndr"

    [fabric.my-ib]          # optional rows, the fabric table's keys; a name of the table replaces its row
    class = "inter-node"
    gb_s = 45.0
    latency_us = 8.0
    source = "measured 2026-12-01 with nccl-tests on our cluster"

Torch-free. Every refusal is a :class:`~ringbench.errors.SpecError`: one sentence naming the
file, the key, the value and the rule.

Source: issue 24 (the fabric rows it lists, and the H200 NVLink points it gives).
"""

from __future__ import annotations

import bisect
import math
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from ringbench.errors import SpecError, unreadable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

GIB = 1024 ** 3
#: The link classes a fabric row can have.
CLASSES = ("intra-node", "inter-node")
_ROW_KEYS = {"title", "class", "gb_s", "latency_us", "curve", "source"}
_CLUSTER_KEYS = {"gpu", "gpus_per_node", "nodes", "intra", "inter", "fabric"}


@dataclass(frozen=True)
class Link:
    """One fabric row: the cost of a transfer over one link, per direction.

    Attributes:
        name: the row's key (``nvlink4``).
        title: what it is, for tables.
        link_class: ``intra-node`` or ``inter-node``.
        gb_s: datasheet bandwidth per direction, GB/s (10^9 B/s); ``None`` for a measured curve.
        latency_us: fixed cost per transfer, µs (added to ``gb_s`` rows only).
        curve: measured ``((bytes, GiB/s), ...)`` ascending by size; empty for a datasheet row.
        source: the datasheet, or ``measured YYYY-MM-DD`` and where.
    """

    name: str
    title: str
    link_class: str
    gb_s: float | None
    latency_us: float
    curve: tuple[tuple[float, float], ...]
    source: str

    def gib_s(self, nbytes: float) -> float:
        """The bandwidth one transfer of ``nbytes`` bytes sees, GiB/s (latency included for a curve)."""
        if not self.curve:
            return self.gb_s * 1e9 / GIB
        sizes = [s for s, _ in self.curve]
        if nbytes <= sizes[0]:  # below the smallest point its time is the floor: bandwidth falls with size
            return self.curve[0][1] * max(nbytes, 1.0) / sizes[0]
        if nbytes >= sizes[-1]:
            return self.curve[-1][1]
        i = bisect.bisect_right(sizes, nbytes)
        (s0, b0), (s1, b1) = self.curve[i - 1], self.curve[i]
        t = (math.log(nbytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return b0 + t * (b1 - b0)

    def seconds(self, nbytes: float) -> float:
        """Seconds one transfer of ``nbytes`` bytes takes in one direction (0 for no bytes)."""
        if nbytes <= 0:
            return 0.0
        if self.curve:
            return nbytes / (self.gib_s(nbytes) * GIB)
        return self.latency_us * 1e-6 + nbytes / (self.gb_s * 1e9)

    def describe(self) -> str:
        """``NVLink 4 (...): 450 GB/s per direction, 5 µs`` for tables."""
        if self.curve:
            return f"{self.title}: measured curve, {self.curve[0][1]:g} to {self.curve[-1][1]:g} GiB/s"
        return f"{self.title}: {self.gb_s * 1e9 / 2 ** 30:.4g} GiB/s per direction, {self.latency_us:g} µs"


def _row(name: str, raw: Any, where: str) -> Link:
    """A fabric row from its TOML table; ``where`` names the file for messages."""
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: fabric row {name!r} is not a table; write [fabric.{name}] with class, gb_s, "
                        "latency_us and source")
    unknown = sorted(set(raw) - _ROW_KEYS)
    if unknown:
        raise SpecError(f"{where}: fabric row {name!r} has key {unknown[0]!r}, which is not one of "
                        f"{', '.join(sorted(_ROW_KEYS))}; drop it")
    cls = raw.get("class")
    if cls not in CLASSES:
        raise SpecError(f"{where}: fabric row {name!r} has class {cls!r}, but a link is {' or '.join(CLASSES)}; "
                        "set class to one of them")
    source = raw.get("source")
    if not isinstance(source, str) or not source.strip():
        raise SpecError(f"{where}: fabric row {name!r} has no source; every row says where its figures come from "
                        "(a datasheet, or \"measured YYYY-MM-DD\")")
    curve = raw.get("curve")
    if curve is not None:
        ok = (isinstance(curve, list) and len(curve) >= 2 and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p)
            for p in curve))
        if not ok or [p[0] for p in curve] != sorted({p[0] for p in curve}):
            raise SpecError(f"{where}: fabric row {name!r} has curve {curve!r}, which must be two or more "
                            "[bytes, GiB/s] pairs of positive numbers, ascending by bytes; fix the curve")
        if "gb_s" in raw:
            raise SpecError(f"{where}: fabric row {name!r} has both curve and gb_s; a row is measured (curve) or "
                            "from a datasheet (gb_s), so keep one")
        pairs = tuple((float(s), float(b)) for s, b in curve)
        return Link(name, str(raw.get("title", name)), cls, None, 0.0, pairs, source)
    for key in ("gb_s", "latency_us"):
        value = raw.get(key)
        if value is None:
            raise SpecError(f"{where}: fabric row {name!r} has no {key}; write {key} (or a measured curve in place "
                            "of gb_s and latency_us)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                value > 0 if key == "gb_s" else value >= 0) or not math.isfinite(value):
            rule = "a positive number of GB/s per direction" if key == "gb_s" else "0 or more microseconds"
            raise SpecError(f"{where}: fabric row {name!r} has {key} {value!r}, which must be {rule}; fix {key}")
    return Link(name, str(raw.get("title", name)), cls, float(raw["gb_s"]), float(raw["latency_us"]), (), source)


def _read_toml(text: str, where: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{where} is not valid TOML ({exc}); fix the file") from None


def fabric_table() -> dict[str, Link]:
    """The shipped fabric rows (``fabrics.toml``), name -> :class:`Link`."""
    text = resources.files("ringbench.model").joinpath("fabrics.toml").read_text(encoding="utf-8")
    return {name: _row(name, raw, "fabrics.toml") for name, raw in _read_toml(text, "fabrics.toml").items()}


def link(name: str, table: Mapping[str, Link] | None = None, *, link_class: str | None = None) -> Link:
    """The row ``name`` of ``table`` (default: the shipped one).

    Raises:
        SpecError: an unknown name, or a row of another class than ``link_class`` where given.
    """
    table = fabric_table() if table is None else table
    row = table.get(name)
    if row is None:
        raise SpecError(f"fabric {name!r} is not in the fabric table; choose one of {', '.join(table)}")
    if link_class is not None and row.link_class != link_class:
        fit = [n for n, r in table.items() if r.link_class == link_class]
        raise SpecError(f"fabric {name!r} is an {row.link_class} link, but it was given as the {link_class} one; "
                        f"choose one of {', '.join(fit)}")
    return row


@dataclass(frozen=True)
class Cluster:
    """Ranks on hosts: ``gpus_per_node`` consecutive ranks per node, ``nodes`` nodes.

    Attributes:
        gpu: the GPU's name as given (``--gpu``).
        gpus_per_node, nodes: the shape; ``world_size`` is their product.
        intra, inter: the links inside a host and between hosts (per GPU).
    """

    gpu: str
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def node(self, rank: int) -> int:
        """The host of ``rank``."""
        return rank // self.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        """The link between ranks ``a`` and ``b``."""
        return self.intra if self.node(a) == self.node(b) else self.inter

    def describe(self) -> str:
        """``8 x 8 H100 (NVLink 4 ... / InfiniBand NDR ...)`` for headers."""
        where = f"{self.intra.title}" + (f"; between nodes {self.inter.title}" if self.nodes > 1 else "")
        return f"{self.nodes} x {self.gpus_per_node} {self.gpu} ({where})"


def _positive(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: {key} {value!r} must be a whole number of 1 or more; fix {key}")
    return value


def load_cluster(path: Path) -> dict[str, Any]:
    """Read a ``--cluster`` file into ``{gpu, gpus_per_node, nodes, intra, inter, table}`` (the keys it
    gives; ``table`` the fabric rows with its own ``[fabric.NAME]`` rows laid over the shipped ones).

    Raises:
        SpecError: a missing or unreadable file, bad TOML, an unknown key, a bad value or row, or a
            link name that is in neither table; one sentence naming the file.
    """
    where = f"cluster file {str(path)!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{where} cannot be read ({unreadable(exc)}); pass --cluster with a readable TOML file"
                        ) from None
    raw = _read_toml(text, where)
    unknown = sorted(set(raw) - _CLUSTER_KEYS)
    if unknown:
        raise SpecError(f"{where} has key {unknown[0]!r}, which is not one of {', '.join(sorted(_CLUSTER_KEYS))}; "
                        "drop it")
    table = dict(fabric_table())
    rows = raw.get("fabric", {})
    if not isinstance(rows, dict):
        raise SpecError(f"{where}: fabric is not a table of rows; write [fabric.NAME] tables")
    for name, row in rows.items():
        table[name] = _row(name, row, where)
    out: dict[str, Any] = {"table": table}
    if "gpu" in raw:
        if not isinstance(raw["gpu"], str) or not raw["gpu"].strip():
            raise SpecError(f"{where}: gpu {raw['gpu']!r} must name a GPU (such as \"H100\") or a calibration file")
        out["gpu"] = raw["gpu"]
    for key in ("gpus_per_node", "nodes"):
        if key in raw:
            out[key] = _positive(raw[key], key, where)
    for key, cls in (("intra", "intra-node"), ("inter", "inter-node")):
        if key in raw:
            if not isinstance(raw[key], str):
                raise SpecError(f"{where}: {key} {raw[key]!r} must name a fabric row, such as "
                                f"{'nvlink4' if key == 'intra' else 'ib-ndr'}")
            try:
                out[key] = link(raw[key], table, link_class=cls)
            except SpecError as exc:
                raise SpecError(f"{where}: {exc}") from None
    return out
