"""What every rank derives from a case before it runs it: one helper for bench, check and the model check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringbench.fields import DTYPES, variant_options
from ringbench.spec import CaseSpec, layout_of, spec_docs
from ringbench.variants import Variant, get_variant
from ringbench.variants.kernels import Kernel, get_kernel


@dataclass(frozen=True)
class CaseSetup:
    """One case as this rank runs it.

    Attributes:
        spec: the case.
        rank, world_size: this rank in the context-parallel group, and the group's size.
        variant, kernel: the registry entries the case names (the kernel already resolved).
        dtype: the input dtype, a ``torch.dtype``.
        causal: the mask.
        scale: the softmax scale, ``head_dim ** -0.5``.
        options: the variant's keyword options the case sets (``layout``, ``heads_k_stride``...).
        layout: the layout the tensors are sharded in.
        docs: the packed documents' lengths in tokens, or ``None`` (batch form).
    """

    spec: CaseSpec
    rank: int
    world_size: int
    variant: Variant
    kernel: Kernel
    dtype: torch.dtype
    causal: bool
    scale: float
    options: dict[str, Any]
    layout: str
    docs: list[int] | None


def case_setup(spec: CaseSpec, group=None) -> CaseSetup:
    """The :class:`CaseSetup` of ``spec`` on this rank of ``group`` (default: the world)."""
    variant = get_variant(spec.variant)
    return CaseSetup(
        spec=spec, rank=dist.get_rank(group), world_size=dist.get_world_size(group), variant=variant,
        kernel=get_kernel(spec.kernel), dtype=getattr(torch, DTYPES[spec.dtype]), causal=spec.causal,
        scale=spec.head_dim ** -0.5, options=variant_options(spec), layout=layout_of(spec, variant),
        docs=spec_docs(spec) if variant.varlen else None)
