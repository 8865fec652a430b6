"""ringbench.variants: the context-parallel attention algorithms under test, and their registry.

The registry is plain data and imports no torch, so the harness can refuse a bad spec
before any process starts. A variant's code is imported only when its ``attention`` is used.

Every variant's ``attention(q, k, v, *, causal, softmax_scale, group, kernel, cu_seqlens=None)``
takes this rank's shards ``[B, S/W, H, D]`` in the variant's layout and returns
``(out, lse)``: out in q's dtype and layout, differentiable; lse float32 ``[B, Hq, S/W]``.
The varlen variants (``Variant.varlen``) take packed documents instead: B is 1 and
``cu_seqlens`` is the global int32 document offsets, the same on every rank, or the
``varlen.Documents`` that ``varlen.prepare`` made of them once per batch (then no call checks
or builds anything again); batch variants refuse ``cu_seqlens``. A variant with ``Variant.sink``
also takes ``sink=``, a ``[Hq]`` tensor of sink logits that joins every row once, after the last
merge, with its gradient summed over the group (``sinks.py``); it is never passed to the others.

Peer variants (``torch_cp``, ``rfa_*``) run other projects' implementations through the same
contract, so they are timed and checked by the same harness; each says why it is unavailable
where its library is missing (``Variant.unavailable``).

Two registries: :data:`VARIANTS`, what users, ``ringbench variants`` and scenarios see, and
:data:`TESTING_VARIANTS`, deliberately wrong or instrumented variants for the tests, which
:func:`get_variant` finds only while the environment variable ``RINGBENCH_TEST_VARIANTS`` is
``1`` (the test session sets it, and torchrun's workers inherit it).
"""

from .registry import (TESTING_ENV, TESTING_VARIANTS, VARIANTS, Variant, get_variant, list_variants, names,
                       testing_variants_enabled)
from .rules import (LAYOUT_CHUNKS, MAX_SEQLEN, OPTIONS, ROTATE, Option, default_ulysses_degree, document_rule,
                    factorizations, listed, nearest_multiple, plural, resolve_ulysses_degree, ulysses_rule)

__all__ = ["LAYOUT_CHUNKS", "MAX_SEQLEN", "OPTIONS", "Option", "ROTATE", "TESTING_ENV", "TESTING_VARIANTS", "VARIANTS", "Variant",
           "default_ulysses_degree", "document_rule", "factorizations", "get_variant", "list_variants", "listed",
           "names", "nearest_multiple", "plural", "resolve_ulysses_degree", "testing_variants_enabled", "ulysses_rule"]
