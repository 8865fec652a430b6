"""Peers: the ring-flash-attn package's functions, run through ringbench's contract.

``rfa_ring``, ``rfa_zigzag``, ``rfa_stripe`` and ``rfa_llama3_varlen`` call the package's
``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``, ``stripe_flash_attn_func`` and
``llama3_flash_attn_varlen_func`` on the shards ringbench lays out (its layouts are the same:
contiguous, zigzag chunks r and 2W-1-r, token t on rank t mod W, and a contiguous packed row).
They need the flash-attn package, so the kernel is always ``flash-attn``.

The package moves its bytes through its own ``torch.distributed`` calls (``dist.P2POp`` and
``dist.batch_isend_irecv`` in the rings, ``dist.all_gather_into_tensor`` and
``dist.reduce_scatter_tensor`` in llama3), looked up through the module at call time, so the
variants' session (``comm.dist_session``) counts them, forward and backward, while the
worker holds it around a case.

Only the modules the variants need are imported: the package's ``__init__`` also imports its
Hugging Face adapter, which fails under transformers 5.x (seen with ring-flash-attn 0.1.8), so
the submodules are loaded under a private package name that shares the installed folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from functools import lru_cache

import torch
import torch.distributed as dist

Tensor = torch.Tensor
_ALIAS = "_ringbench_rfa"
_MODULES = {"ring": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn",
            "llama3_varlen": "llama3_flash_attn_varlen"}


@lru_cache(maxsize=None)
def _module(name: str):
    """ring-flash-attn's submodule ``name``, without running the package's ``__init__``."""
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("ring-flash-attn is not installed (pip install ring-flash-attn)")
    if _ALIAS not in sys.modules:
        package = types.ModuleType(_ALIAS)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[_ALIAS] = package
    return importlib.import_module(f"{_ALIAS}.{name}")


def unavailable_reason() -> str | None:
    """Why ring-flash-attn's functions cannot run here, or ``None``."""
    try:
        for name in _MODULES.values():
            _module(name)
    except ModuleNotFoundError as exc:
        return str(exc) if exc.name is None else f"ring-flash-attn needs {exc.name}, which is not installed"
    except Exception as exc:  # any other import failure is the reason, reported, not raised
        return f"ring-flash-attn cannot be imported: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible, and ring-flash-attn runs flash-attn's CUDA kernels"
    return None


def _batch(func_name: str, module: str):
    def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float, group=None,
                  kernel=None, cu_seqlens=None) -> tuple[Tensor, Tensor]:
        if cu_seqlens is not None:
            raise ValueError(f"rfa_{module} is a batch variant and takes no cu_seqlens")
        func = getattr(_module(_MODULES[module]), func_name)
        out, lse, _ = func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True,
                           group=group)
        B, S, H, _ = q.shape
        return out, lse.reshape(B, H, S).float()

    attention.__doc__ = f"""ring-flash-attn's ``{func_name}`` on this rank's shards.

    Args:
        q: ``[B, S/W, Hq, D]`` bf16 or fp16; k, v: ``[B, S/W, Hkv, D]`` (flash-attn takes GQA).
        causal, softmax_scale, group: as in the variant contract; kernel is flash-attn's own.

    Returns:
        out ``[B, S/W, Hq, D]`` in q's dtype, differentiable; lse float32 ``[B, Hq, S/W]``.
    """
    return attention


rfa_ring_attention = _batch("ring_flash_attn_func", "ring")
rfa_zigzag_attention = _batch("zigzag_ring_flash_attn_func", "zigzag")
rfa_stripe_attention = _batch("stripe_flash_attn_func", "stripe")


def rfa_llama3_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float,
                                group=None, kernel=None, cu_seqlens: Tensor | None = None,
                                heads_k_stride: int = 0) -> tuple[Tensor, Tensor]:
    """ring-flash-attn's ``llama3_flash_attn_varlen_func`` on this rank's rows of the packed row.

    Args:
        q: ``[1, S/W, Hq, D]``; k, v: ``[1, S/W, Hkv, D]``; the row cut contiguously.
        cu_seqlens: the global int32 document offsets ``[docs + 1]``, the same on every rank.
        heads_k_stride: K/V heads gathered at a time; 0: all of them.

    Returns:
        out ``[1, S/W, Hq, D]`` in q's dtype, differentiable; lse float32 ``[1, Hq, S/W]``.

    Raises:
        ValueError: no ``cu_seqlens``.
    """
    if cu_seqlens is None:
        raise ValueError("rfa_llama3_varlen takes packed documents: pass cu_seqlens")
    mod = _module(_MODULES["llama3_varlen"])
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    cu_q, cu_k, max_q, max_k, keys = mod.llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank,
                                                                              world_size)
    out, lse, _ = mod.llama3_flash_attn_varlen_func(
        q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, heads_k_stride or k.shape[2], keys,
        softmax_scale=softmax_scale, causal=causal, return_attn_probs=True, group=group)
    H, S = q.shape[2], q.shape[1]
    return out.unsqueeze(0), lse.reshape(H, S).unsqueeze(0).float()
