"""ringbench's kernels in the place of flash-attn 2, for ring-flash-attn's modules only.

ring-flash-attn's modules import four functions from ``flash_attn.flash_attn_interface``:
``_flash_attn_forward``, ``_flash_attn_backward`` (the rings) and ``_flash_attn_varlen_forward``,
``_flash_attn_varlen_backward`` (llama3). Where the flash-attn package is not installed,
:func:`interface` builds a module object holding those four names, served by one of
ringbench's kernels (``variants/kernels/__init__.py``), and :func:`scoped_builtins` gives the modules
that ``rfa.py`` loads an ``__import__`` that hands them that object for ``flash_attn`` and
``flash_attn.flash_attn_interface``. The object is never put in ``sys.modules``, so no other
code can import a ``flash_attn``; where flash-attn is installed none of this is used.

What ring-flash-attn 0.1.8 expects of the functions, read from its code, and what the
stand-ins do (the flash-attn 2.7 forms, the ones whose forward returns four values):

- It builds each call's keyword arguments from the function's own signature
  (``utils.get_default_args``: every parameter, ``softcap`` set to 0.0), then sets q, k, v,
  dropout_p, softmax_scale, causal, alibi_slopes, return_softmax (the backward: dout, out,
  softmax_lse, dq, dk, dv, deterministic), and ``window_size_left``/``window_size_right``
  because the signature has no ``window_size``. It passes dropout 0, window (-1, -1), no
  alibi slopes, softcap 0 and ``return_softmax`` False from ringbench's calls; anything
  else is refused here with the argument named, since ringbench's kernels have none of it.
  ``deterministic`` is taken: the cpu and math kernels are deterministic; torch-flash's
  backward is PyTorch's (atomic adds), and ``deterministic=True`` is refused there.
- Forward: it reads ``(out, softmax_lse, S_dmask, rng_state)`` (a 4-tuple; the 8-tuple of
  flash-attn < 2.7 is the other form it takes). The batch form's lse is float32
  ``[B, H, S]``, ringbench's own layout; the varlen form takes ``[total, H, D]`` rows and its
  lse is packed ``[H, total_q]`` (its backward also takes the padded ``[N, H, max_q]`` of older
  builds; the stand-in gives the packed form). flash-attn marks a row that sees no key with
  lse ``+inf``, ringbench with ``-inf``: converted both ways.
- Backward: it reads nothing back; the gradients are written into the ``dq``, ``dk``, ``dv``
  it passes (views into its buffers, in the input dtype), so the stand-ins copy into them
  and return ``None``.

Causal blocks: the rings ask for square causal blocks only (the kernel contract's rule);
llama3's varlen calls align the causal mask bottom-right, as ringbench's varlen form does.
"""

from __future__ import annotations

import builtins
import importlib.util
import math
import types
from typing import Callable

import torch

from ..kernels import common as _common
from .. import kernels as _kernels

Tensor = torch.Tensor

#: The module names ring-flash-attn imports from flash-attn.
FLASH_ATTN_NAMES = ("flash_attn", "flash_attn.flash_attn_interface")
#: ringbench's kernels whose backward is bitwise repeatable, so they take ``deterministic=True``.
DETERMINISTIC = ("cpu", "math")


def flash_attn_installed() -> bool:
    """Whether the real flash-attn package is installed (found, not imported): then it serves
    ring-flash-attn's calls and the stand-in is never used."""
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def _refuse_unsupported(kernel: _kernels.Kernel, *, dropout_p, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax=False, deterministic=False, **others) -> None:
    asked = {"dropout_p": (dropout_p, 0), "window_size": ((window_size_left, window_size_right), (-1, -1)),
             "softcap": (softcap, 0), "alibi_slopes": (alibi_slopes, None),
             "return_softmax": (bool(return_softmax), False)}
    asked.update({name: (value, None) for name, value in others.items()})
    for name, (value, default) in asked.items():
        if value != default if default is not None else value is not None:
            raise ValueError(f"ring-flash-attn asked for {name}={value!r}, which ringbench's {kernel.name} kernel, "
                             f"serving its flash-attn calls, does not take; pass {name}={default!r}")
    if deterministic and kernel.name not in DETERMINISTIC:
        raise ValueError(f"ring-flash-attn asked for deterministic=True, and the backward of ringbench's "
                         f"{kernel.name} kernel, serving its flash-attn calls, is not deterministic; pass "
                         f"deterministic=False or a kernel of {', '.join(DETERMINISTIC)}")


def _to_fa_lse(lse: Tensor) -> Tensor:
    # float32 always (flash-attn's lse), +inf where a row sees no key.
    lse = lse.float()
    return lse.masked_fill(lse == -math.inf, math.inf)


def _from_fa_lse(lse: Tensor, dtype: torch.dtype) -> Tensor:
    # The kernel's own lse dtype (float64 for float64 inputs), -inf where a row sees no key.
    return lse.masked_fill(lse == math.inf, -math.inf).to(_common.accumulation_dtype(dtype))


def interface(kernel: _kernels.Kernel) -> types.ModuleType:
    """A module object standing for ``flash_attn.flash_attn_interface``, its four functions
    served by ``kernel`` (never registered in ``sys.modules``)."""

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                            softcap=0.0, alibi_slopes=None, return_softmax=False):
        _refuse_unsupported(kernel, dropout_p=dropout_p, window_size_left=window_size_left,
                            window_size_right=window_size_right, softcap=softcap, alibi_slopes=alibi_slopes,
                            return_softmax=return_softmax)
        out, lse = kernel.forward(q, k, v, causal, softmax_scale)
        return out, _to_fa_lse(lse), None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                             deterministic=False, rng_state=None):
        _refuse_unsupported(kernel, dropout_p=dropout_p, window_size_left=window_size_left,
                            window_size_right=window_size_right, softcap=softcap, alibi_slopes=alibi_slopes,
                            deterministic=deterministic)
        grads = kernel.backward(dout, q, k, v, out, _from_fa_lse(softmax_lse, q.dtype), causal, softmax_scale)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad)
        return None

    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                   seqused_k=None):
        _refuse_unsupported(kernel, dropout_p=dropout_p, window_size_left=window_size_left,
                            window_size_right=window_size_right, softcap=softcap, alibi_slopes=alibi_slopes,
                            return_softmax=return_softmax, block_table=block_table, leftpad_k=leftpad_k,
                            seqused_k=seqused_k)
        out, lse = kernel.forward_varlen(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        return out[0], _to_fa_lse(lse[0]), None, None

    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                    deterministic=False, rng_state=None):
        _refuse_unsupported(kernel, dropout_p=dropout_p, window_size_left=window_size_left,
                            window_size_right=window_size_right, softcap=softcap, alibi_slopes=alibi_slopes,
                            deterministic=deterministic)
        if softmax_lse.dim() == 3:  # the padded [N, H, max_q] of older builds, should a caller pass it
            doc, pos = _common._packed_positions(cu_seqlens_q, q.shape[0])
            softmax_lse = softmax_lse[doc, :, pos].transpose(0, 1)
        grads = kernel.backward_varlen(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       out.unsqueeze(0), _from_fa_lse(softmax_lse, q.dtype).unsqueeze(0),
                                       cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer.copy_(grad[0])
        return None

    module = types.ModuleType("flash_attn.flash_attn_interface",
                              f"ringbench's {kernel.name} kernel in the place of flash-attn's interface, for "
                              "ring-flash-attn only")
    for fn in (_flash_attn_forward, _flash_attn_backward, _flash_attn_varlen_forward, _flash_attn_varlen_backward):
        fn.__qualname__ = fn.__name__
        fn.__module__ = f"{__name__}[{kernel.name}]"
        setattr(module, fn.__name__, fn)
    module.served_by = kernel.name
    return module


def scoped_builtins(interface_module: types.ModuleType,
                    load_relative: Callable[[str], object]) -> dict:
    """A ``__builtins__`` for one of ring-flash-attn's modules: ``import flash_attn...`` there
    gets ``interface_module``; a relative import is loaded first by ``load_relative(absolute
    name)`` (so the package's own modules get these builtins too); anything else is the real
    import."""
    package = types.ModuleType("flash_attn", "ringbench's stand-in for flash-attn, for ring-flash-attn only")
    package.flash_attn_interface = interface_module
    real_import = builtins.__import__

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name in FLASH_ATTN_NAMES:
            return interface_module if fromlist and name == FLASH_ATTN_NAMES[1] else package
        if level > 0 and globals is not None:
            base = importlib.util.resolve_name("." * level + name, globals["__package__"])
            if name:
                load_relative(base)
            for item in fromlist or ():
                if not name:
                    load_relative(f"{base}.{item}")
        return real_import(name, globals, locals, fromlist, level)

    scoped = dict(vars(builtins))
    scoped["__import__"] = scoped_import
    return scoped
