"""What ``predict`` and ``advise`` predict for: the GPU and its calibration, the cluster's shape and links.

:func:`target` settles the options once, before anything is predicted: ``--cluster FILE.toml``
first, then ``--gpu``, ``--gpus-per-node``, ``--nodes`` and ``--fabric INTRA[,INTER]`` over it,
then the GPU's usual links (``gpus.toml``). A link the calibration measured (its ``comm``) stands
in for the fabric row of its class where none was asked for. :func:`world_sizes` turns
``--world-size`` (or ``gpus_per_node x nodes``) into clusters. Every refusal is one sentence.

Torch-free. Source: issue 24.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from ringbench.errors import SpecError
from ringbench.model import calibration as cal_mod
from ringbench.model.calibration import Calibration
from ringbench.model.fabric import Cluster, Link, _row, fabric_table, link, load_cluster
from ringbench.model.gpus import Gpu, calibration_for, runs_none

#: Where a cluster's shape comes from when nothing is given: one node of 8 GPUs.
DEFAULT_GPUS_PER_NODE, DEFAULT_NODES = 8, 1
#: The most ranks predict and advise walk (a 1024-rank ring took about 100 s and 4 GB on one CPU core).
MAX_RANKS = 1024
#: The links of a GPU that ``gpus.toml`` does not know.
DEFAULT_INTRA, DEFAULT_INTER = "nvlink4", "ib-ndr"


@dataclass(frozen=True)
class Target:
    """A settled prediction target.

    Attributes:
        gpu_name: the GPU as given; gpu: its peaks and memory, where known.
        calibration: what prices it (measured, or derived: ``calibration.provenance()``).
        gpus_per_node, nodes: the cluster's shape (``None``: not given).
        intra, inter: the links.
        run_id: one id for every record of the command.
    """

    gpu_name: str
    gpu: Gpu | None
    calibration: Calibration
    gpus_per_node: int | None
    nodes: int | None
    intra: Link
    inter: Link
    run_id: str

    def cluster(self, world_size: int) -> Cluster:
        """The cluster of ``world_size`` ranks: ``gpus_per_node`` per node (fewer on one node)."""
        per = self.gpus_per_node or DEFAULT_GPUS_PER_NODE
        per = min(per, world_size)
        return Cluster(self.gpu_name, per, world_size // per, self.intra, self.inter)

    def kernel_refusal(self, name: str) -> str | None:
        """Why the GPU cannot run kernel ``name`` (its architecture against the kernel's, ``Kernel.min_sm``),
        in one sentence without a fix, or ``None`` (a GPU of no known architecture, a cpu calibration)."""
        arch = self.gpu.datasheet.arch if self.gpu else None
        if arch is None:
            return None
        from ringbench.variants.kernels import KERNELS  # imports torch

        kernel = KERNELS.get(name)
        return kernel.check_arch(arch, f"gpu {self.gpu_name}") if kernel else None

    def kernels(self) -> list[str]:
        """The calibration's kernels that the GPU can run, in the calibration's order."""
        return [name for name in self.calibration.kernels if self.kernel_refusal(name) is None]

    def kernel(self, name: str) -> str:
        """The calibrated kernel a case runs with: ``auto`` is the first of the calibration's that the
        GPU can run.

        Raises:
            SpecError: a kernel the calibration does not hold or the GPU cannot run; ``auto`` where
                the GPU runs none of the calibration's.
        """
        if name == "auto":
            runs = self.kernels()
            if not runs:
                raise SpecError(runs_none(self.gpu_name, self.gpu, self.calibration.kernels))
            return runs[0]
        if name not in self.calibration.kernels:  # its refusal offers only what the GPU runs
            self.calibration.kernel(name, runs=self.kernels(), gpu=self.gpu_name)
        why = self.kernel_refusal(name)
        if why:
            runs = self.kernels()
            fix = f"pass --kernel with one of {', '.join(runs)} or auto" if runs else "pass another --gpu"
            raise SpecError(f"{why}; {fix}")
        return name

    @cached_property
    def _git_commit(self) -> Optional[str]:
        # Asked once per command: it runs git twice, which advise's dozens of records each paid.
        from ringbench.records.envinfo import git_commit

        return git_commit()

    def env(self) -> dict[str, Any]:
        """What a predicted record says about where its figures come from (its ``env``)."""
        return {"predicted": True, "gpu_name": self.calibration.device, "calibration": self.calibration.provenance(),
                "calibration_env": self.calibration.env, "git_commit": self._git_commit}


def _fabric_names(text: str) -> tuple[str, Optional[str]]:
    parts = [p.strip() for p in text.split(",")]
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise SpecError(f"fabric {text!r} is not INTRA or INTRA,INTER; pass --fabric such as nvlink4 or "
                        "nvlink4,ib-ndr")
    return parts[0], (parts[1] if len(parts) == 2 else None)


def target(*, gpu: Optional[str], calibrations: list[Path], cluster_file: Optional[Path],
           gpus_per_node: Optional[int], nodes: Optional[int], fabric: Optional[str], dtype: str) -> Target:
    """Settle the GPU, its calibration and the cluster (module docstring).

    Raises:
        SpecError: a bad cluster file, calibration file, GPU, fabric name or shape; one sentence.
    """
    for key, value in (("gpus-per-node", gpus_per_node), ("nodes", nodes)):
        if value is not None and value < 1:
            raise SpecError(f"{key} {value} must be 1 or more; pass --{key} with a positive number")
    given = load_cluster(cluster_file) if cluster_file is not None else {"table": fabric_table()}
    table = given["table"]
    cals = [cal_mod.load(p) for p in calibrations] + cal_mod.shipped()
    name = gpu or given.get("gpu") or (cals[0].device if calibrations else None)
    if name is None:
        raise SpecError("no GPU was given; pass --gpu with a GPU such as H100 (or a calibration file), or a --cluster "
                        "file whose gpu names one")
    where = f"cluster file {str(cluster_file)!r}" if gpu is None and "gpu" in given else ""
    calibration, info = calibration_for(name, cals, dtype, where)
    intra = inter = None
    if fabric is not None:
        a, b = _fabric_names(fabric)
        intra = link(a, table, link_class="intra-node")
        inter = link(b, table, link_class="inter-node") if b else None
    intra = intra or given.get("intra") or _measured(calibration, "intra-node") or _default(
        info.intra if info and info.intra else None, DEFAULT_INTRA, table, name, "intra-node", cluster_file)
    inter = inter or given.get("inter") or _measured(calibration, "inter-node") or _default(
        info.inter if info and info.inter else None, DEFAULT_INTER, table, name, "inter-node", cluster_file)
    return Target(name, info, calibration, gpus_per_node or given.get("gpus_per_node"),
                  nodes or given.get("nodes"), intra, inter, uuid.uuid4().hex)


def _default(own: Optional[str], fallback: str, table: dict, gpu: str, link_class: str,
             cluster_file: Optional[Path] = None) -> Link:
    """The GPU's own fabric row, or ``fallback``'s, titled as assumed (a cpu calibration has no link).

    Raises:
        SpecError: the row is of another class than ``link_class`` (a cluster file's row of that name
            laid over the shipped one).
    """
    row = link(own or fallback, table)
    if row.link_class != link_class:
        key = "intra" if link_class == "intra-node" else "inter"
        raise SpecError(f"cluster file {str(cluster_file)!r}: fabric row {own or fallback!r}, the {link_class} link of "
                        f"{gpu}, has class {row.link_class!r}; give it class {link_class!r}, or name another row as "
                        f"{key}")
    if own:
        return row
    fix = "--fabric INTRA" if row.link_class == "intra-node" else "--fabric INTRA,INTER"
    return replace(row, title=f"{row.title}, assumed: no {row.link_class} link is known for {gpu}; pass {fix}")


def _measured(cal: Calibration, link_class: str) -> Link | None:
    """The link a calibration measured for ``link_class``, as a fabric row, or ``None`` (a derived
    calibration's links are the other GPU's, so none)."""
    raw = cal.comm.get(link_class) if not cal.derived_from else None
    if not raw:
        return None
    return _row(f"{cal.device} {link_class}, measured", {"class": link_class, "curve": raw["curve"],
                                                        "source": raw.get("source", cal.source),
                                                        "title": f"{link_class} link measured on {cal.device}"},
                "the calibration")


def world_sizes(given: Optional[list[int]], tgt: Target) -> list[int]:
    """The world sizes to predict: ``--world-size`` values, else ``gpus_per_node x nodes``.

    Raises:
        SpecError: a world size above one node that is not a multiple of ``gpus_per_node``, or one
            that disagrees with ``--nodes``.
    """
    per = tgt.gpus_per_node or DEFAULT_GPUS_PER_NODE
    given = list(given or [per * (tgt.nodes or DEFAULT_NODES)])
    for w in given:
        if w > MAX_RANKS:
            raise SpecError(f"world_size {w} is above {MAX_RANKS}, the most ranks the model walks: it steps "
                            "through every rank's plan, whose ring steps grow with the ranks, so time and memory "
                            f"grow with their square (minutes and GBs past {MAX_RANKS}); pass --world-size or "
                            f"--nodes for {MAX_RANKS} GPUs or fewer")
        # --nodes first: a fix of the multiple alone would still disagree with it.
        if tgt.nodes is not None and w != per * tgt.nodes:
            raise SpecError(f"world_size {w} disagrees with nodes {tgt.nodes} x gpus_per_node {per} = "
                            f"{per * tgt.nodes}; pass one of --world-size and --nodes")
        if w > per and w % per:
            raise SpecError(f"world_size {w} is more than one node of {per} GPUs but not a multiple of "
                            f"gpus_per_node {per}, and every node holds gpus_per_node ranks; pass --world-size "
                            f"{(w // per + 1) * per} or another --gpus-per-node")
    return given
