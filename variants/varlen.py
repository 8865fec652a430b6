"""Checks shared by the packed-documents (varlen) variants.

A ``cu_seqlens`` that does not end at the token count makes flash-attn's varlen kernels read
and write past the row instead of raising, and one that differs between
ranks makes the ranks disagree on the ring's steps, which hangs or silently mixes documents.
So every varlen variant checks it, on every rank, before any transfer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor

#: Moduli of the two polynomial fingerprints ranks compare (Mersenne primes, so every
#: intermediate product fits Python's ints and the result fits int64).
_MOD = (2**61 - 1, 2**31 - 1)
_BASE = (1_000_003, 65_537)


def _fingerprint(offsets: list[int]) -> list[int]:
    out = []
    for mod, base in zip(_MOD, _BASE):
        h = 0
        for c in offsets:
            h = (h * base + c + 1) % mod
        out.append(h)
    return out


def _local_problem(cu_seqlens, total: int) -> str | None:
    """Why ``cu_seqlens`` is not valid offsets of a row of ``total`` tokens on this rank, or ``None``."""
    if not isinstance(cu_seqlens, Tensor):
        return (f"cu_seqlens is a {type(cu_seqlens).__name__}, but it must be a 1-D int32 tensor of "
                "document offsets; pass torch.tensor(offsets, dtype=torch.int32)")
    if cu_seqlens.dtype != torch.int32:
        return (f"cu_seqlens has dtype {cu_seqlens.dtype}, but it must be int32, as the varlen kernels "
                "read it; pass cu_seqlens.to(torch.int32)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        return (f"cu_seqlens has shape {tuple(cu_seqlens.shape)}, but it must be 1-D with at least 2 offsets "
                "(0 and the token count); pass [0, ..., seqlen]")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        return f"cu_seqlens starts at {offsets[0]}, but it must start at 0; put 0 first"
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        if b < a:
            return (f"cu_seqlens decreases from {a} to {b} at index {i + 1}, but offsets must be "
                    "non-decreasing (one per document boundary); sort them or fix the lengths")
    if offsets[-1] != total:
        return (f"cu_seqlens ends at {offsets[-1]} but the packed row holds {total} tokens; the last offset "
                "must equal the token count, or the kernels read past the row, so pass offsets ending at "
                f"{total}")
    return None


def check_cu_seqlens(cu_seqlens: Tensor, seqlen_local: int, group=None) -> list[int]:
    """Check the global ``cu_seqlens`` on every rank and return its offsets as host ints.

    Every rank gathers every rank's verdict and fingerprint first, so all ranks raise together
    (one rank raising alone would leave the others waiting in a collective).

    Args:
        cu_seqlens: int32 ``[N + 1]``, the global document offsets: 0 first, non-decreasing,
            ``seqlen_local * W`` last; the same on every rank. Any device.
        seqlen_local: this rank's tokens; every rank must hold the same number.
        group: the context-parallel process group (default: the world).

    Returns:
        The offsets, a list of N + 1 ints.

    Raises:
        ValueError: (on every rank, starting ``[rank r/W]``) a cu_seqlens of the wrong dtype or
            shape, not starting at 0, decreasing, not ending at the token count, or differing
            between ranks; or ranks holding different numbers of tokens.

    Source: the cu_seqlens contract of flash-attn's varlen functions, and ring-flash-attn's
    varlen variants, which take the global cu_seqlens on every rank.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    total = seqlen_local * world_size
    problem = _local_problem(cu_seqlens, total)
    offsets = cu_seqlens.tolist() if problem is None else []
    mine = [0 if problem is None else 1, seqlen_local, len(offsets), *_fingerprint(offsets)]
    device = cu_seqlens.device if isinstance(cu_seqlens, Tensor) else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    parts = [torch.empty(len(mine), dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(parts, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    rows = [p.tolist() for p in parts]
    prefix = f"[rank {rank}/{world_size}]"
    if problem is not None:
        raise ValueError(f"{prefix} {problem}")
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        raise ValueError(f"{prefix} rank {bad[0]}'s cu_seqlens is invalid (its own error says why); every rank "
                         "must pass the same valid global cu_seqlens")
    sizes = {row[1] for row in rows}
    if len(sizes) > 1:
        raise ValueError(f"{prefix} ranks hold different numbers of tokens ({', '.join(str(r[1]) for r in rows)}); "
                         "every rank must hold seqlen / world_size tokens of the packed row")
    for r, row in enumerate(rows):
        if row[2:] != rows[0][2:]:
            raise ValueError(f"{prefix} cu_seqlens differs between ranks 0 and {r} ({rows[0][2]} and {row[2]} "
                             "offsets); pass the same global cu_seqlens on every rank")
    return offsets
