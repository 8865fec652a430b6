"""What every rank derives from a case before it runs it: one helper for bench, check and the model check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ringbench.case.fields import DTYPES, variant_options
from ringbench.case.spec import CaseSpec, layout_of, padded_docs, spec_docs
from ringbench.variants import Variant, get_variant
from ringbench.variants.instruments import emulation
from ringbench.variants.kernels import Kernel, get_kernel
from ringbench.variants.kernels.common import Bias, Window, alibi_slopes, bias_tensor_shape, window_band


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
        ulysses_degree: the Ulysses degree composed into it (``layouts``; 1: the plain layout),
            read from the resolved case.
        band: the sliding window's band ``(window - 1, 0)`` as the kernels take it, or ``None``.
        docs: the packed documents' lengths in tokens as the layout cuts them (padded to
            ``doc_pad``), or ``None`` (batch form).
        real_docs: their real lengths, before padding (``docs`` without ``doc_pad``).
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
    ulysses_degree: int
    docs: list[int] | None
    real_docs: list[int] | None = None
    band: Window | None = None


def case_setup(spec: CaseSpec, group=None) -> CaseSetup:
    """The :class:`CaseSetup` of ``spec`` on this rank of ``group`` (default: the world); under an
    emulation (``run --emulate``), the emulated rank of the emulated world."""
    variant = get_variant(spec.variant)
    rank, world_size = emulation.rank_and_size(group)
    return CaseSetup(
        spec=spec, rank=rank, world_size=world_size, variant=variant,
        kernel=get_kernel(spec.kernel), dtype=getattr(torch, DTYPES[spec.dtype]), causal=spec.causal,
        scale=spec.head_dim ** -0.5, options=variant_options(spec), layout=layout_of(spec, variant),
        ulysses_degree=variant.layout_degree(spec.world_size, spec.ulysses_degree), band=window_band(spec.window),
        docs=padded_docs(spec) if variant.varlen else None, real_docs=spec_docs(spec) if variant.varlen else None)


def sink_logits(spec: CaseSpec, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The case's sink logits ``[heads]``, the same on every rank, or ``None`` (``sink`` none).

    ``learnable``: drawn from the case's seed, standard normal, a leaf that requires its
    gradient; ``off-by-one``: zeros, fixed. float32, or float64 for float64 inputs (so the
    gradient keeps the precision the case is checked in).
    """
    if spec.sink == "none":
        return None
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if spec.sink == "off-by-one":
        return torch.zeros(spec.heads, dtype=acc, device=device)
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + 19) % 2 ** 63)  # apart from the inputs' stream
    return torch.randn(spec.heads, generator=gen, dtype=torch.float32).to(acc).to(device).requires_grad_(True)


def bias_of(spec: CaseSpec, dtype: torch.dtype, device: torch.device) -> Bias | None:
    """The case's attention bias (``spec.bias``), the same on every rank, or ``None`` (none).

    ``alibi``: ALiBi's slopes ``[heads]`` (``kernels.common.alibi_slopes``), fixed. A learnable
    shape (``1hss``, ``bhss``, ``11ss``, ``111s``, ``b1ss``): ``[b|1, h|1, s|1, s]`` drawn from the
    case's seed (standard normal times 0.5, a stream apart from the inputs' and the sink's), a leaf
    that requires its gradient. float32, or float64 for float64 inputs.
    """
    if not spec.bias:
        return None
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if spec.bias == "alibi":
        return Bias("alibi", torch.tensor(alibi_slopes(spec.heads), dtype=acc, device=device))
    shape = bias_tensor_shape(spec.bias, spec.batch, spec.heads, spec.seqlen)
    gen = torch.Generator().manual_seed((spec.seed * 1_000_003 + 29) % 2 ** 63)
    values = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.5
    return Bias(spec.bias, values.to(acc).to(device).requires_grad_(True))


class Results(NamedTuple):
    """What verify compares: a case's out, lse, dq, dk and dv, and its d sink and d bias.

    The same tensors come from the variant (one rank's shards, or gathered into global
    tensors), the single-device run, the float64 reference and the block-decomposition
    reference. The first five are ``tolerance.TENSORS``, in that order; zip with it to take them.

    Attributes:
        out: ``[B, S, Hq, Dv]``, the input dtype (float64 for the references).
        lse: ``[B, Hq, S]``, float32 (float64 for float64 inputs and the references).
        dq: q's shape, ``[B, S, Hq, D]``; dk: k's, ``[B, S, Hkv, D]``; dv: v's, ``[B, S, Hkv, Dv]``.
        dsink: ``[Hq]``, the sink's dtype, where the case learns a sink; else ``None``.
        dbias: the learnable bias's shape and dtype, where the case learns a bias; else ``None``.

    S is the global length, or ``S / W`` for one rank's shards.
    """

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dsink: torch.Tensor | None = None
    dbias: torch.Tensor | None = None
