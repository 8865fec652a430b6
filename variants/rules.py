"""The torch-free rules that the registry and the engines share: how many chunks each layout cuts
per rank, and which document lengths and Ulysses degrees a variant can take.

Plain data and arithmetic, so the harness can refuse a bad spec before any process starts.
"""

from __future__ import annotations

#: Chunks per rank of each layout: the global seqlen must be a multiple of this times W.
LAYOUT_CHUNKS = {"contiguous": 1, "zigzag": 2, "stripe": 1}
#: How torch_cp moves K/V (its ``rotate`` option), PyTorch's default first.
ROTATE = ("allgather", "alltoall")


def document_rule(docs, world_size: int, layout: str, who: str) -> str | None:
    """Why documents of lengths ``docs`` cannot each be cut in ``layout`` at ``world_size``, or ``None``.

    Every document's length must be a multiple of ``LAYOUT_CHUNKS[layout] * world_size``. The
    sentence names the first offending document (its 1-based position, ``document 1``, as
    ``--docs`` counts them, and its length), the rule, ``who`` needs it, and the fix.
    """
    n = LAYOUT_CHUNKS[layout] * world_size
    rule = f"2 * world_size = {n}" if LAYOUT_CHUNKS[layout] == 2 else f"world_size = {n}"
    for i, length in enumerate(docs):
        if length % n:
            down = f" or {length - length % n}" if length > n else ""
            return (f"document {i + 1} has {length} token{'' if length == 1 else 's'}, not a multiple of {rule}, "
                    f"which {who} needs; "
                    f"make it {(length // n + 1) * n}{down} tokens, or use llama3_varlen, which takes any "
                    "document lengths")
    return None


def ulysses_rule(heads: int, kv_heads: int | None, degree: int, who: str, *,
                 world_size: int | None = None, whole: bool = False) -> str | None:
    """Why a Ulysses degree ``degree`` cannot split ``heads`` query and ``kv_heads`` K/V heads, or ``None``.

    The all-to-all gives every rank of the Ulysses group ``heads / degree`` query heads, so the
    degree must divide the query heads. K/V heads are split the same way when the degree divides
    them; when the degree exceeds them and is a multiple of them, each K/V head is replicated
    ``degree / kv_heads`` times first (as DeepSpeed-Ulysses does), so every rank still gets the
    one K/V head its query heads use. Any other pair has no head split. Source: DeepSpeed-Ulysses
    (arXiv 2309.14509), issue 16.

    The sentence ends with a fix that passes this rule: given ``world_size``, a degree that also
    divides it (the hybrids' ``--ulysses-degree``); with ``whole`` (ulysses, whose degree is the
    world size and takes no ``--ulysses-degree``), a ``--world-size`` or ``--heads`` instead.
    """
    def fits(d: int) -> bool:
        return heads % d == 0 and not (kv_heads and kv_heads % d and d % kv_heads)

    if fits(degree):
        return None
    split = heads % degree == 0
    rule = (f"divides {heads}" if not split else
            f"divides kv_heads {kv_heads} or is a multiple of it that divides heads {heads}")
    if whole:
        sizes = [d for d in range(2, heads + 1) if fits(d)]
        size = max([d for d in sizes if d < degree] or sizes or [1])
        if split:
            return (f"world_size {degree} neither divides kv_heads {kv_heads} nor is a multiple of it, so {who}, "
                    "which runs Ulysses over every rank, can neither split the K/V heads nor replicate them evenly; "
                    + (f"pass a --world-size that {rule}, such as {size}, or " if sizes else "pass ")
                    + f"--kv-heads {degree}")
        more = (heads // degree + 1) * degree
        return (f"world_size {degree} does not divide heads {heads}, and {who} runs Ulysses over every rank, giving "
                f"each heads / world_size query heads; pass a --world-size that {rule}, such as {size}, or --heads "
                f"a multiple of {degree}, such as {more}")
    why = (f"neither divides kv_heads {kv_heads} nor is a multiple of it, so {who} can neither split the K/V "
           "heads nor replicate them evenly" if split else
           f"does not divide heads {heads}, and {who} gives every rank of the Ulysses group heads / degree query heads")
    also = f" and world_size {world_size}" if world_size else ""
    fit = max(d for d in range(1, degree) if fits(d) and (not world_size or world_size % d == 0))
    return f"Ulysses degree {degree} {why}; use a degree that {rule}{also}, such as {fit}"


def default_ulysses_degree(world_size: int, heads: int, kv_heads: int | None = None) -> int:
    """The Ulysses degree usp takes when none is given: the largest divisor of ``world_size``
    that :func:`ulysses_rule` accepts for these heads (Ulysses as wide as the heads allow, the
    ring over the rest, as the USP paper, arXiv 2405.07719, advises)."""
    return max(d for d in range(1, world_size + 1)
               if world_size % d == 0 and ulysses_rule(heads, kv_heads, d, "usp") is None)


def factorizations(world_size: int) -> list[int]:
    """The Ulysses degrees U of every factorization ``U x R = world_size``, ascending."""
    return [d for d in range(1, world_size + 1) if world_size % d == 0]
