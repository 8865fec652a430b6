"""Verify's ``max_logit`` entry (``--max-logit``): the per-head maximum logit a variant returns,
held to the max rule against the float64 math kernel and the single-device kernel.

The variant fills a ``MaxLogit`` of ``[Hq]`` (``variants/kernels/max_logit.py``) that every rank
should end with whole (an all-reduce MAX over the group). Every rank's copy is gathered, and per
head the copy farthest from the float64 reference is the one judged, so a rank left with its own
blocks' maximum alone fails even where rank 0 happened to meet the largest score. Both references
are one call of the kernel over the whole sequence with the case's window, mask and bias
(``sink_pad.row_keywords``, ``sink_pad.bias_keywords``): the sink is not a score of q and k, so it
is not in the maximum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringbench.case.spec import CaseSpec
from ringbench.rank import sink_pad as extras
from ringbench.rank.tolerance import no_shadow, tolerance_check
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import Bias, accumulation_dtype
from ringbench.variants.kernels.max_logit import MaxLogit

Tensor = torch.Tensor


def max_logit_of(spec: CaseSpec, dtype: torch.dtype, device: torch.device) -> MaxLogit | None:
    """The accumulator a case passes its variant (``max_logit=``): ``[heads]`` of ``-inf`` in the
    accumulation dtype (float32; float64 for float64 inputs), or ``None`` without ``--max-logit``."""
    if not spec.max_logit:
        return None
    return MaxLogit.empty(spec.heads, accumulation_dtype(dtype), device)


def gather_every_rank(values: Tensor, group) -> Tensor:
    """Every rank's max logit, ``[W, H]``, on every rank."""
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, values.contiguous(), group=group)
    return torch.stack(parts)


def whole_row(kernel, inputs, spec: CaseSpec, causal: bool, scale: float, bias: Bias | None) -> Tensor:
    """The max logit of one ``kernel`` call over the whole sequence, ``[Hq]`` in the accumulation
    dtype of ``inputs``' dtype.

    Args:
        kernel: a kernel that takes ``max_logit`` (math).
        inputs: the whole-sequence ``(q, k, v, ...)``, ``[B, S, H, D]``; float64 for the reference.
        spec: the case (its window and mask); causal, scale: the case's.
        bias: the case's bias, or ``None``; its values are taken in q's accumulation dtype.
    """
    q, k, v = inputs[:3]
    causal, kw = extras.row_keywords(causal, spec.window, spec.mask, q.shape[1], q.device)
    if bias is not None:
        values = bias.values.detach().to(accumulation_dtype(q.dtype))
        kw = {**kw, **extras.bias_keywords(bias.with_values(values), q.shape[1], q.device)}
    peak = MaxLogit.empty(q.shape[2], accumulation_dtype(q.dtype), q.device)
    with torch.no_grad():
        kernel.forward(q, k, v, causal, scale, **kw, max_logit=peak)
    return peak.values


def max_logit_entry(every_rank: Tensor, kernel, inputs, spec: CaseSpec, causal: bool, scale: float,
                    bias: Bias | None, world_size: int) -> dict:
    """The ``max_logit`` check entry (``tolerance.tolerance_check``'s fields, the shadow fields null).

    Args:
        every_rank: ``[W, H]``, each rank's max logit after the variant's forward.
        kernel: the case's kernel (the single-device run); inputs: the whole-sequence inputs.

    Returns:
        The entry; per head the rank farthest from the float64 reference is judged.
    """

    single = whole_row(kernel, inputs, spec, causal, scale, bias)
    ref = whole_row(KERNELS["math"], [x.double() for x in inputs[:3]], spec, causal, scale, bias)
    far = (every_rank.double() - ref.double()).abs().nan_to_num(float("inf")).argmax(0)
    got = every_rank[far, torch.arange(every_rank.shape[1], device=every_rank.device)]
    entry = tolerance_check("max_logit", got, single, ref, accumulation_dtype(inputs[0].dtype), (spec.heads,),
                            world_size=world_size)
    return {**entry, **no_shadow("the max logit is a maximum reduced over the ranks, not a sum of kernel "
                                  "calls' partial results, so only the max rule applies")}
