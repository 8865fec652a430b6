"""Deliberately wrong variants, registered hidden, that prove the checks can fail."""

from __future__ import annotations

from .ring import Block, contiguous_plan, run_ring


def _drop_last_block(step, source, rank, world_size, seqlen_local, causal) -> Block | None:
    # The bug a verifier must catch: one K/V block never reaches the merge.
    if world_size > 1 and step == world_size - 1:
        return None
    return contiguous_plan(step, source, rank, world_size, seqlen_local, causal)


def broken_merge_attention(q, k, v, *, causal=True, softmax_scale=None, group=None, kernel="auto",
                           cu_seqlens=None):
    """A ring that silently drops the last visiting K/V block (test fixture, never correct)."""
    return run_ring(q, k, v, causal=causal, softmax_scale=softmax_scale, group=group, kernel=kernel,
                    plan=_drop_last_block)
