"""Attention sinks: a per-head logit that joins every softmax row once, whatever the world size.

With a sink ``s_h`` for query head h, every row's softmax is
``p_j = exp(x_j) / (exp(s_h) + sum_k exp(x_k))``: the sink takes weight but has no value
vector (gpt-oss's learnable sinks; ``s_h = 0`` fixed is the off-by-one softmax). Under
context parallelism it belongs to the row, not to a block: it must enter after the last
merge, exactly once. Given a row's final merged ``out`` and ``lse`` (the attention over
every key, without the sink)::

    L     = logaddexp(lse, s_h)
    out_f = out * exp(lse - L) = out * sigmoid(lse - s_h)

which is the merge of one more partial result, ``(out = 0, lse = s_h)``. Backward needs no
new kernel: the kernels' ordinary backward given ``(out_f, L)`` instead of ``(out, lse)``
gives the exact dq, dk and dv (its ``D = <dout, out_f>`` is still the row's
``sum_j p_j dP_j``, since the sink has no value), and

    d s_h = -sum over rows r and batch of exp(s_h - L_r) * <dout_r, out_f_r>

summed over every rank of the context-parallel group (:func:`sink_grad` all-reduces it).

How an engine wires it (ring, llama3, llama3_varlen here; any engine that produces the final
out and lse of its rows, such as an all-to-all one):

1. forward: ``out, lse = apply_sink(out_acc, lse, sink)`` once, on the final merged result
   (float32 accumulators), then cast ``out`` to the input dtype and return it and ``L``;
2. save that ``out`` and ``L`` for backward, and run the kernels' backward with them;
3. backward: return ``sink_grad(dout, out, L, sink, group)`` as the sink's gradient
   (``None`` when ``sink`` needs none).

An engine that holds whole rows of only some heads (after an all-to-all) passes those heads'
slice of ``sink`` and reduces ``d sink`` over the group that shares heads.

Source: ringbench issue 19; Miller, "Attention is off by one" (2023); the learnable sinks of
OpenAI's gpt-oss (2025) and FlashAttention-4's ``learnable_sink``.
"""

from __future__ import annotations

import torch

from . import comm
from ..instruments import emulation, timeline

Tensor = torch.Tensor


def check_sink(sink: Tensor, heads: int, prefix: str = "") -> None:
    """Refuse a sink that is not one float value per query head.

    Raises:
        ValueError: ``sink`` is not a floating tensor of shape ``[heads]`` (message starts with ``prefix``).
    """
    if not isinstance(sink, Tensor) or sink.dim() != 1 or sink.shape[0] != heads or not sink.is_floating_point():
        shape = tuple(sink.shape) if isinstance(sink, Tensor) else type(sink).__name__
        raise ValueError(f"{prefix}sink {shape} must be a float tensor [Hq] = [{heads}], one logit per query "
                         "head; pass torch.zeros(heads) for the off-by-one softmax")


def apply_sink(out: Tensor, lse: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """Fold the sink into a row's final attention result, once.

    Args:
        out: ``[B, S, Hq, D]``, the final merged output over every key (any float dtype;
            the engines pass their float32 accumulator).
        lse: ``[B, Hq, S]`` float32 (float64 for float64 inputs), its log-sum-exp; ``-inf``
            for a row that sees no key (its ``out_f`` is 0 and its ``L`` is ``s_h``).
        sink: ``[Hq]``, the sink logits, on the scale of the scaled scores.

    Returns:
        ``(out_f, L)``: ``out * sigmoid(lse - s_h)`` and ``logaddexp(lse, s_h)``, both in
        ``lse``'s dtype (the accumulation dtype: the caller casts ``out_f`` once), ``L`` in
        ``lse``'s layout.
    """
    s = sink.to(device=lse.device, dtype=lse.dtype)[None, :, None]
    weight = torch.sigmoid(lse - s)  # exp(lse - L) without an exponential of a positive number
    return out.to(lse.dtype) * weight.transpose(1, 2).unsqueeze(-1), torch.logaddexp(lse, s)


def local_sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """This rank's share of ``d sink``: :func:`sink_grad` without the reduction over the group
    (one device holding every row, as verify's single-device run does).

    Returns:
        ``[Hq]`` in ``lse``'s dtype.
    """
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [B, S, Hq]: <dout, out_f> per row
    weight = torch.exp(sink.to(device=lse.device, dtype=acc)[None, :, None] - lse)  # [B, Hq, S]
    return -(weight * delta.transpose(1, 2)).sum(dim=(0, 2))


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor, group=None) -> Tensor:
    """The gradient of the sink logits, summed over this rank's rows and then over the group.

    Args:
        dout: ``[B, S/W, Hq, D]``, the gradient of this rank's output rows.
        out: ``[B, S/W, Hq, D]``, the output with the sink (``apply_sink``'s ``out_f``).
        lse: ``[B, Hq, S/W]``, ``apply_sink``'s ``L``.
        sink: ``[Hq]``, the sink logits.
        group: the process group whose ranks hold the other rows (default: the world); every
            rank of it must call this (an all-reduce, counted by ``comm``).

    Returns:
        ``d sink`` ``[Hq]`` in ``sink``'s dtype, the same on every rank, computed in float32
        (float64 when ``lse`` is).
    """
    grad = local_sink_grad(dout, out, lse, sink)
    if emulation.rank_and_size(group)[1] > 1:
        with timeline.span("comm"):  # a blocking all-reduce: exposed communication in --profile
            comm.all_reduce(grad, group=group)
    return grad.to(sink.dtype)
