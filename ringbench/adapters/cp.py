"""What a training step needs around a model under context parallelism (torch only).

Every rank holds ``S / W`` tokens of each sequence, in its variant's layout (see
``ringbench.variants.engines.layouts``). The inputs, the position ids and the labels must be cut the
same way, and the labels must be shifted for next-token prediction *before* the cut: a model's
own loss shifts inside each rank's shard, which pairs tokens that are not neighbours once the
sequence is sharded. The loss is then the sum over local tokens divided by the global token
count, and the parameter gradients are summed over the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from ringbench.variants import get_variant
from ringbench.variants.engines import layouts

Tensor = torch.Tensor

#: Label value that the loss skips (PyTorch's and transformers' convention).
IGNORE_INDEX = -100


def _offsets(cu_seqlens: Tensor | Sequence[int], seqlen: int) -> list[int]:
    """The document offsets as ints, checked: from 0 to ``seqlen``, never decreasing."""
    offsets = layouts.offsets_of(cu_seqlens)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != seqlen or any(
            b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens {offsets} are not document offsets of a row of {seqlen} tokens; they must "
                         f"start at 0, never decrease and end at {seqlen}")
    return offsets


def document_positions(cu_seqlens: Tensor | Sequence[int], seqlen: int, device=None) -> Tensor:
    """Position ids that restart at 0 at every document of a packed row.

    Args:
        cu_seqlens: global document offsets, int32 tensor or ints, ``[N + 1]``, ending at ``seqlen``.
        seqlen: tokens in the row (S).

    Returns:
        int64 ``[S]``.

    Raises:
        ValueError: offsets that do not start at 0, decrease, or do not end at ``seqlen``.
    """
    offsets = _offsets(cu_seqlens, seqlen)
    starts = torch.tensor(offsets[:-1], dtype=torch.int64, device=device)
    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], dtype=torch.int64, device=device)
    return torch.arange(seqlen, device=device) - starts.repeat_interleave(lengths)


def shift_labels(labels: Tensor, cu_seqlens: Tensor | Sequence[int] | None = None) -> Tensor:
    """Next-token labels of whole rows: position t gets ``labels[:, t + 1]``.

    The last token of each row, and of each packed document, has no next token in its own
    document and gets :data:`IGNORE_INDEX`.

    Args:
        labels: int64 ``[B, S]``, unsharded.
        cu_seqlens: global document offsets of a packed row (B = 1), or ``None``.

    Returns:
        int64 ``[B, S]``.

    Raises:
        ValueError: bad ``cu_seqlens`` (see :func:`document_positions`).
    """
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if cu_seqlens is not None:
        offsets = _offsets(cu_seqlens, labels.shape[1])
        shifted[:, [b - 1 for a, b in zip(offsets, offsets[1:]) if b > a]] = IGNORE_INDEX
    return shifted


@dataclass(frozen=True)
class ShardedBatch:
    """One rank's share of a batch, in its variant's layout.

    Attributes:
        input_ids: int64 ``[B, S/W]``.
        position_ids: int64 ``[B, S/W]``, the tokens' global positions (restarting at every
            document when packed).
        labels: int64 ``[B, S/W]`` next-token labels, shifted before the cut, or ``None``.
        cu_seqlens: the global int32 document offsets ``[N + 1]`` (the same on every rank), or
            ``None`` for a batch variant.
    """

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor | None
    cu_seqlens: Tensor | None

    def model_inputs(self) -> dict:
        """Keyword arguments for a transformers causal LM's forward: the ids and, when packed,
        ``cu_seq_lens_q``/``cu_seq_lens_k`` (the global offsets that the ringbench attention reads)."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.cu_seqlens is not None:
            inputs.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens)
        return inputs


def check_setup(variant: str, *, seqlen: int, world_size: int, batch: int = 1,
                cu_seqlens: Tensor | Sequence[int] | None = None, layout: str | None = None) -> None:
    """Refuse a combination that cannot give a right result, before anything runs.

    Raises:
        ValueError: an unknown variant or layout; a seqlen the layout cannot cut; packed
            documents given to a batch variant, or none to a varlen one; a packed batch above 1;
            document lengths the variant cannot cut (one sentence with the value and the rule).
    """
    v = get_variant(variant)
    reason = v.check(seqlen=seqlen, world_size=world_size, causal=True, layout=layout)
    if reason:
        raise ValueError(reason)
    if cu_seqlens is None:
        if v.varlen:
            raise ValueError(f"{variant} attends packed documents, but no cu_seqlens was given; pass the global "
                             "int32 document offsets, or use a batch variant such as zigzag")
        return
    offsets = _offsets(cu_seqlens, seqlen)
    reason = v.check_docs([b - a for a, b in zip(offsets, offsets[1:])], world_size)
    if reason:
        raise ValueError(reason)
    if batch != 1:
        raise ValueError(f"batch {batch} is not 1, but {variant} packs the documents into one row; pack them "
                         "into one row")


def shard_batch(input_ids: Tensor, *, variant: str, rank: int, world_size: int, labels: Tensor | None = None,
                cu_seqlens: Tensor | Sequence[int] | None = None, layout: str | None = None,
                ulysses_degree: int | None = None) -> ShardedBatch:
    """Cut whole rows of token ids (and their labels) into ``rank``'s share for ``variant``.

    Args:
        input_ids: int64 ``[B, S]``, the same on every rank.
        variant: a ringbench variant name; its layout (or ``layout``) decides the cut.
        rank, world_size: this rank in the context-parallel group, and the group's size.
        labels: int64 ``[B, S]`` unshifted (usually ``input_ids``), or ``None``.
        cu_seqlens: the global document offsets of a packed row (varlen variants, B = 1).
        layout: for a variant that takes several layouts (llama3), the one its attention uses.
        ulysses_degree: for the Ulysses-ring hybrids (usp, usp_varlen), the degree their attention
            runs with, which composes into the layout (``layouts``); required for them, refused for
            the others.

    Returns:
        A :class:`ShardedBatch` of ``[B, S/W]`` tensors.

    Raises:
        ValueError: see :func:`check_setup`.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}, not [batch, seqlen]; pass a 2-D tensor")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in the group of world_size {world_size}; pass a rank from 0 to "
                         f"{world_size - 1}")
    batch, seqlen = input_ids.shape
    check_setup(variant, seqlen=seqlen, world_size=world_size, batch=batch, cu_seqlens=cu_seqlens, layout=layout)
    v = get_variant(variant)
    layout = layout or v.layout
    if (ulysses_degree is None) == (v.ulysses == "option"):
        raise ValueError(f"{variant}'s layout depends on its Ulysses degree, so pass ulysses_degree=, the one its "
                         "attention runs with" if ulysses_degree is None else
                         f"{variant} takes no ulysses_degree; drop it (only usp and usp_varlen compose one)")
    u = v.layout_degree(world_size, ulysses_degree or 0)
    device = input_ids.device
    if cu_seqlens is None:
        positions = torch.arange(seqlen, device=device).expand(batch, seqlen)
        cu = None

        def cut(x: Tensor) -> Tensor:
            return layouts.shard(x, layout, rank, world_size, ulysses_degree=u)
    else:
        cu = torch.tensor(layouts.offsets_of(cu_seqlens), dtype=torch.int32, device=device)
        positions = document_positions(cu, seqlen, device=device).unsqueeze(0)

        def cut(x: Tensor) -> Tensor:
            return layouts.shard_varlen(x, cu, layout, rank, world_size, by_document=v.shard_by_document,
                                        ulysses_degree=u)
    shifted = shift_labels(labels, cu) if labels is not None else None
    return ShardedBatch(cut(input_ids), cut(positions), cut(shifted) if shifted is not None else None, cu)


class _GroupMean(torch.autograd.Function):
    """Value: the group's sum over its token count; gradient: this rank's sum over that count."""

    @staticmethod
    def forward(ctx, local_sum: Tensor, total: Tensor) -> Tensor:
        ctx.count, ctx.dtype = total[1], local_sum.dtype
        return (total[0] / total[1].clamp_min(1)).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad / ctx.count.clamp_min(1)).to(ctx.dtype), None


def causal_lm_loss(logits: Tensor, labels: Tensor, *, group=None) -> Tensor:
    """Mean next-token cross-entropy over the whole group's tokens, from this rank's share.

    Args:
        logits: ``[B, S/W, V]`` (any float dtype; computed in at least float32).
        labels: int64 ``[B, S/W]``, already shifted (:class:`ShardedBatch`), ``-100`` skipped.
        group: the context-parallel group (default: the world).

    Returns:
        A scalar (float32, or float64 for float64 logits) whose value is the global mean (the
        sums added over the group in float64) and whose gradient is this rank's share only:
        after ``backward()`` on every rank, :func:`all_reduce_grads` gives each rank the
        gradient of the global mean.
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(acc), labels.reshape(-1),
                                                  ignore_index=IGNORE_INDEX, reduction="none")
    # The value is summed in float64, so the group's sum is no less accurate than one device's mean.
    total = torch.stack([per_token.detach().double().sum(), (labels != IGNORE_INDEX).sum().double()])
    dist.all_reduce(total, group=group)
    return _GroupMean.apply(per_token.sum(), total)


def all_reduce_grads(parameters: Iterable[torch.nn.Parameter], *, group=None) -> None:
    """Sum every parameter's gradient over the group, in place (summed in at least float32).

    Args:
        parameters: such as ``model.parameters()``; those without a gradient are skipped.
        group: the context-parallel group (default: the world).
    """
    for p in parameters:
        if p.grad is None:
            continue
        g = p.grad.to(torch.promote_types(p.grad.dtype, torch.float32))
        dist.all_reduce(g, group=group)
        p.grad.copy_(g)
