"""Peers: the ring-flash-attn package's functions, run through ringbench's contract.

``rfa_ring``, ``rfa_zigzag``, ``rfa_stripe`` and ``rfa_llama3_varlen`` call the package's
``ring_flash_attn_func``, ``zigzag_ring_flash_attn_func``, ``stripe_flash_attn_func`` and
``llama3_flash_attn_varlen_func`` on the shards ringbench lays out (its layouts are the same:
contiguous, zigzag chunks r and 2W-1-r, token t on rank t mod W, and a contiguous packed row).

What serves the package's flash-attn calls (``_flash_attn_forward``/``_backward`` and their
varlen pair): the flash-attn package where it is installed (then the case's kernel must be
``flash-attn``, on CUDA); where it is not, the case's ringbench kernel (``torch-flash`` on
CUDA, ``cpu`` or ``math`` on CPU) through ``rfa_standin``, which converts ringbench's kernel
contract to the flash-attn 2 forms the package reads. The stand-in is handed to the package's
modules only (their own ``__import__``), never put in ``sys.modules``. The package's modules are
loaded once per serving kernel, each copy bound to its kernel, so a forward and its backward
are always served by the same one. Every call notes what served it; :func:`session` (the
variants' session, held by the worker around a case) starts the list afresh and
:func:`served_notes` gives the records' notes.

The package moves its bytes through its own ``torch.distributed`` calls (``dist.P2POp`` and
``dist.batch_isend_irecv`` in the rings, ``dist.all_gather_into_tensor`` and
``dist.reduce_scatter_tensor`` in llama3), looked up through the module at call time, so the
session, which holds ``comm.dist_session``, counts them, forward and backward.

Only the modules the variants need are loaded: the package's ``__init__`` also imports its
Hugging Face adapter, which fails under transformers 5.x (seen with ring-flash-attn 0.1.8), so
the submodules are loaded under private package names that share the installed folder.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import sys
import types
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist

from ..engines import comm
from .. import kernels as _kernels
from . import rfa_standin
from ringbench.errors import install_hint

Tensor = torch.Tensor
_ALIAS = "_ringbench_rfa"
_MODULES = {"ring": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn",
            "llama3_varlen": "llama3_flash_attn_varlen"}
#: The flash-attn package, as the records name it when it serves the calls.
FLASH_ATTN = "flash-attn"
#: ringbench's kernels that serve the package's flash-attn calls where flash-attn is not installed.
STANDIN_KERNELS = ("torch-flash", "cpu", "math")
#: What served the flash-attn calls of the rfa variants since the session began, in order.
_SERVED: list[str] = []


def _locations() -> list[str]:
    spec = importlib.util.find_spec("ring_flash_attn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"ring-flash-attn is not installed ({install_hint('peers')})")
    return list(spec.submodule_search_locations)


def _bare_package(name: str, locations: list[str]) -> types.ModuleType:
    """The private package ``name`` over the installed folder, its ``__init__`` never run."""
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = locations
        package.__package__ = name
        sys.modules[name] = package
    return sys.modules[name]


@lru_cache(maxsize=None)
def _scoped_builtins(kernel_name: str) -> dict:
    """The builtins the package's modules served by ``kernel_name`` are run with."""
    kernel = _kernels.get_kernel(kernel_name)
    return rfa_standin.scoped_builtins(rfa_standin.interface(kernel), lambda full: _load_scoped(full, kernel_name))


def _package_for(kernel_name: str) -> str:
    return f"{_ALIAS}_{kernel_name.replace('-', '_')}"


def _load_scoped(full: str, kernel_name: str):
    """Module ``full`` of the private package for ``kernel_name``, run with its scoped builtins;
    ``None`` where ``full`` is no module of the package (``from . import name`` of an attribute)."""
    if full in sys.modules:
        return sys.modules[full]
    package, _, leaf = full.rpartition(".")
    parent = sys.modules[package]
    path = Path(parent.__path__[0]) / leaf
    if path.is_dir():  # a subpackage (adapters): bare, as the top one
        module = _bare_package(full, [str(path)])
    elif path.with_suffix(".py").is_file():
        spec = importlib.util.spec_from_file_location(full, path.with_suffix(".py"))
        module = importlib.util.module_from_spec(spec)
        module.__dict__["__builtins__"] = _scoped_builtins(kernel_name)
        sys.modules[full] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[full]
            raise
    else:
        return None
    setattr(parent, leaf, module)
    return module


@lru_cache(maxsize=None)
def _module(name: str, kernel_name: str = FLASH_ATTN):
    """ring-flash-attn's submodule ``name`` (dotted below the package), its flash-attn calls
    served by ``kernel_name``: the flash-attn package (``flash-attn``) or a ringbench kernel."""
    locations = _locations()
    if kernel_name == FLASH_ATTN:
        _bare_package(_ALIAS, locations)
        return importlib.import_module(f"{_ALIAS}.{name}")
    package = _package_for(kernel_name)
    _bare_package(package, locations)
    for i in range(1, name.count(".") + 2):
        module = _load_scoped(f"{package}.{'.'.join(name.split('.')[:i])}", kernel_name)
    return module


def serving(kernel, q: Tensor, *, varlen: bool) -> str:
    """What serves ring-flash-attn's flash-attn calls for a call on ``q`` with ``kernel`` (a
    :class:`~kernels.Kernel`, a name or ``auto``): ``flash-attn`` where the package is
    installed, else the name of the ringbench kernel.

    Raises:
        ValueError: flash-attn is installed and another kernel is asked for; or it is not, and
            the kernel is ``flash-attn`` or breaks a kernel rule (one sentence with the fix).
    """
    name = getattr(kernel, "name", kernel) or "auto"
    if rfa_standin.flash_attn_installed():
        if name not in (FLASH_ATTN, "auto"):
            raise ValueError(f"the flash-attn package is installed, so it serves ring-flash-attn's flash-attn "
                             f"calls, not ringbench's {name} kernel; pass --kernel flash-attn")
        return FLASH_ATTN
    if name == FLASH_ATTN:
        raise ValueError("the flash-attn package is not installed, so ringbench's kernels serve ring-flash-attn's "
                         f"flash-attn calls; pass --kernel with one of {', '.join(STANDIN_KERNELS)} or auto")
    device_type, head_dim = q.device.type, q.shape[-1]
    if isinstance(kernel, _kernels.Kernel):
        return _kernels.as_kernel(kernel, device_type, q.dtype, head_dim=head_dim, varlen=varlen).name
    return _kernels.resolve_kernel(name, device_type, dtype=q.dtype, head_dim=head_dim, varlen=varlen,
                                   among=STANDIN_KERNELS).name


def _served(module_name: str, kernel, q: Tensor, *, varlen: bool):
    """The package's module ``module_name`` bound to what serves this call, noted in the session."""
    name = serving(kernel, q, varlen=varlen)
    if name not in _SERVED:
        _SERVED.append(name)
    return _module(module_name, name)


def served_notes() -> list[str]:
    """What served ring-flash-attn's flash-attn calls since the session began, as record notes."""
    return [f"ring-flash-attn's flash-attn calls served by {_served_by(name)}" for name in _SERVED]


def _served_by(name: str) -> str:
    return "the flash-attn package" if name == FLASH_ATTN else f"ringbench's {name} kernel"


def session(spec: dict, group, device) -> contextlib.AbstractContextManager:
    """The rfa variants' session: what serves the calls is noted afresh, and the package's own
    ``torch.distributed`` calls are counted (``comm.dist_session``)."""
    _SERVED.clear()
    return comm.dist_session(spec, group, device)


def _import_reason(exc: Exception) -> str:
    if isinstance(exc, ModuleNotFoundError):
        return str(exc) if exc.name is None else f"ring-flash-attn needs {exc.name}, which is not installed"
    return f"ring-flash-attn cannot be imported: {type(exc).__name__}: {exc}"


def unavailable_reason() -> str | None:
    """Why ring-flash-attn's functions cannot run here, or ``None``: ring-flash-attn must
    import, with flash-attn's calls served by the flash-attn package where it is installed
    (which needs CUDA), else by ringbench's kernels (the math kernel's copy is the check)."""
    real = rfa_standin.flash_attn_installed()
    try:
        for name in _MODULES.values():
            _module(name, FLASH_ATTN if real else "math")
    except Exception as exc:  # any import failure is the reason, reported, not raised
        return _import_reason(exc)
    if real and not torch.cuda.is_available():
        return ("the flash-attn package is installed, so it serves ring-flash-attn's flash-attn calls, and it "
                "runs on CUDA only: no CUDA device is visible")
    return None


def varlen_unavailable_reason() -> str | None:
    """:func:`unavailable_reason`, and where flash-attn is installed the reason the varlen peer
    cannot name it as its kernel: ringbench's flash-attn kernel has no varlen form."""
    reason = unavailable_reason()
    if reason is None and rfa_standin.flash_attn_installed():
        return ("the flash-attn package is installed, so it would serve ring-flash-attn's varlen calls, and "
                f"ringbench's flash-attn kernel, which records would name, has no varlen form "
                f"({_kernels.KERNELS[FLASH_ATTN].no_varlen})")
    return reason


def hf_adapter_unavailable_reason() -> str:
    """Why ring-flash-attn's own Hugging Face adapter (``substitute_hf_flash_attn``) cannot
    check a model here: where it does not import (transformers 5.x), the import error; where it
    does, that ringbench's model check does not drive it (it replaces transformers'
    ``flash_attention_2`` with ``llama3_flash_attn_varlen_func`` whatever the variant, and needs
    the offsets set through ``update_ring_flash_attn_params``). It is loaded as the variants'
    modules are, so a stand-in serves its flash-attn calls where flash-attn is absent."""
    real = rfa_standin.flash_attn_installed()
    try:
        module = _module("adapters.hf_adapter", FLASH_ATTN if real else "math")
    except Exception as exc:
        import transformers  # the adapter's first import; where it is missing the harness says so first

        cause = str(exc).replace(f" ({exc.path})", "") if getattr(exc, "path", None) else str(exc)
        return (f"ring-flash-attn's Hugging Face adapter (substitute_hf_flash_attn) does not import under "
                f"transformers {transformers.__version__} ({type(exc).__name__}: {cause.splitlines()[0]})")
    if not hasattr(module, "substitute_hf_flash_attn"):
        return "ring-flash-attn's Hugging Face adapter has no substitute_hf_flash_attn"
    return ("ring-flash-attn's Hugging Face adapter (substitute_hf_flash_attn) imports, but ringbench's model "
            "check does not drive it: it runs llama3_flash_attn_varlen_func in place of transformers' "
            "flash_attention_2 whatever the variant")


def _lse_to_ringbench(lse: Tensor, shape: tuple[int, ...]) -> Tensor:
    # float32 [.., H, S]; flash-attn's +inf for a row that sees no key is ringbench's -inf.
    lse = lse.reshape(shape).float()
    return lse.masked_fill(lse == math.inf, -math.inf)


def _batch(func_name: str, module: str):
    def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float, group=None,
                  kernel="auto", cu_seqlens=None) -> tuple[Tensor, Tensor]:
        if cu_seqlens is not None:
            raise ValueError(f"rfa_{module} is a batch variant and takes no cu_seqlens")
        func = getattr(_served(_MODULES[module], kernel, q, varlen=False), func_name)
        out, lse, _ = func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_attn_probs=True,
                           group=group)
        B, S, H, _ = q.shape
        return out, _lse_to_ringbench(lse, (B, H, S))

    attention.__doc__ = f"""ring-flash-attn's ``{func_name}`` on this rank's shards.

    Args:
        q: ``[B, S/W, Hq, D]``; k, v: ``[B, S/W, Hkv, D]`` (GQA as the kernel takes it).
        causal, softmax_scale, group: as in the variant contract.
        kernel: what serves the package's flash-attn calls: ``flash-attn`` (installed), or a
            ringbench kernel (``torch-flash``, ``cpu``, ``math``; ``auto``: the first that fits).

    Returns:
        out ``[B, S/W, Hq, D]`` in q's dtype, differentiable; lse float32 ``[B, Hq, S/W]``.
    """
    return attention


rfa_ring_attention = _batch("ring_flash_attn_func", "ring")
rfa_zigzag_attention = _batch("zigzag_ring_flash_attn_func", "zigzag")
rfa_stripe_attention = _batch("stripe_flash_attn_func", "stripe")


def rfa_llama3_varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float,
                                group=None, kernel="auto", cu_seqlens: Tensor | None = None,
                                heads_k_stride: int = 0) -> tuple[Tensor, Tensor]:
    """ring-flash-attn's ``llama3_flash_attn_varlen_func`` on this rank's rows of the packed row.

    Args:
        q: ``[1, S/W, Hq, D]``; k, v: ``[1, S/W, Hkv, D]``; the row cut contiguously.
        kernel: what serves the package's flash-attn calls, as for the batch peers (a varlen form).
        cu_seqlens: the global int32 document offsets ``[docs + 1]``, the same on every rank.
        heads_k_stride: K/V heads gathered at a time; 0: all of them.

    Returns:
        out ``[1, S/W, Hq, D]`` in q's dtype, differentiable; lse float32 ``[1, Hq, S/W]``.

    Raises:
        ValueError: no ``cu_seqlens``.
    """
    if cu_seqlens is None:
        raise ValueError("rfa_llama3_varlen takes packed documents: pass cu_seqlens")
    mod = _served(_MODULES["llama3_varlen"], kernel, q, varlen=True)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    cu_q, cu_k, max_q, max_k, keys = mod.llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank,
                                                                              world_size)
    out, lse, _ = mod.llama3_flash_attn_varlen_func(
        q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, heads_k_stride or k.shape[2], keys,
        softmax_scale=softmax_scale, causal=causal, return_attn_probs=True, group=group)
    H, S = q.shape[2], q.shape[1]
    return out.unsqueeze(0), _lse_to_ringbench(lse, (H, S)).unsqueeze(0)
