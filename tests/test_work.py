"""Predicted work per rank (ringbench/case/work.py) where a new user found it wrong: Ulysses shards
heads, not rows, and padded documents (``doc_pad``) count their real tokens under the padded
layout. Counts by hand, no process."""

from __future__ import annotations

import pytest

from ringbench.case import work
from ringbench.case.spec import CaseSpec, default_fields, resolve_docs


def _spec(**changes):
    base = default_fields("cpu", 0) | dict(task="run", variant="ring", seqlen=16, world_size=2)
    return resolve_docs(CaseSpec(**(base | changes)))


@pytest.mark.parametrize("variant, changes", [("ulysses", {}), ("ulysses_varlen", {"docs": "16"})])
def test_ulysses_ranks_share_the_whole_sequences_work_equally(variant, changes):
    """Causal S=16: 1+..+16 = 136 pairs per head; every rank computes heads / W of them for every row."""
    for world_size in (2, 4):
        fields = work.predicted_fields(_spec(variant=variant, world_size=world_size, **changes))
        assert fields["predicted_pairs_per_rank"] == [136 // world_size] * world_size
        assert fields["predicted_max_over_mean"] == 1.0
    # The contiguous row cut would have given rank 1 of 2 the 100 of 136 (1.47); ring keeps it.
    assert work.pairs_per_rank(_spec(variant="ring")) == [36, 100]


def test_padded_documents_count_real_tokens_under_the_padded_layout():
    """zigzag_varlen, W=2, docs 5,8 padded to 4: 8 and 8, each cut in chunks of 2, rank 0 chunks 0 and 3.
    Rank 0: doc 0 positions 0,1 (1+2; 6,7 are pad), doc 1 0,1,6,7 (1+2+7+8): 21. Rank 1: doc 0 2,3,4
    (3+4+5; 5 is pad), doc 1 2..5 (3+4+5+6): 30. Together 15 + 36, the real documents' pairs."""
    spec = _spec(variant="zigzag_varlen", docs="5,8", doc_pad=4)
    assert work.pairs_per_rank(spec) == [21, 30]
    assert work.predicted_fields(spec)["predicted_max_over_mean"] == pytest.approx(30 / 25.5)
    assert work.pairs_per_rank(_spec(variant="zigzag_varlen", docs="8,8")) == [36, 36]  # unpadded: even
