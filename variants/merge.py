"""The numerically stable merge of partial attention results through their lse."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def merge_(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's partial attention into the running result, in place.

    The result is the attention over the union of both key sets. With
    ``w = sigmoid(block_lse - lse)`` it is ``out + w * (block_out - out)`` and
    ``logaddexp(lse, block_lse)``: no exponential of a positive number is ever taken, so a gap
    of any size between the two lse values neither overflows nor loses the larger term. An lse
    of ``-inf`` (a row that saw no key) contributes nothing, on either side.

    Args:
        out: float32 (or float64) ``[B, S, H, D]``, the running output; updated in place.
        lse: same float dtype, ``[B, H, S]``, the running log-sum-exp; updated in place.
        block_out: ``[B, S, H, D]`` in any float dtype, the block's output.
        block_lse: ``[B, H, S]``, the block's log-sum-exp.

    Source: the online-softmax rescaling of Milakov and Gimelshein, "Online normalizer
    calculation for softmax" (2018), written in sigmoid/logaddexp form because the naive
    ``lse + log(1 + exp(block_lse - lse))`` overflows in float32 once the gap passes ~88, a
    failure users of ring attention have reported.
    """
    diff = block_lse - lse
    # Both -inf: nan; neither side has anything, so the block adds nothing.
    weight = torch.sigmoid(diff).nan_to_num_(nan=0.0)
    out.lerp_(block_out.to(out.dtype), weight.transpose(1, 2).unsqueeze(-1))
    torch.logaddexp(lse, block_lse, out=lse)
