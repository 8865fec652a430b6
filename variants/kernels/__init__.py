"""Local attention backends behind one contract.

Every backend takes q ``[B, Sq, Hq, D]`` and k, v ``[B, Sk, Hkv, D]`` (``Hq % Hkv == 0``) and
returns ``out`` with q's shape and dtype and ``lse`` as float32 ``[B, Hq, Sq]`` (float64 for
float64 inputs, which only the math, cpu and flex kernels take): the natural
log-sum-exp of each query row's scaled scores, ``-inf`` for a row that sees no key.
Backends differ in their own lse layout and in how they mark empty rows; each backend's module
converts at the boundary, so variants only ever see ringbench's layout.

A causal call requires ``Sq == Sk`` (the mask is ``key <= query``); backends disagree on how
to align a causal mask of a rectangular block, so ringbench never asks for one.

The varlen (packed documents) form, on the kernels that have one (``Kernel.varlen``), takes
q ``[1, Sq, Hq, D]`` and k, v ``[1, Sk, Hkv, D]``, each a row of documents packed end to end,
plus int32 ``cu_seqlens_q`` and ``cu_seqlens_k`` of the same length N + 1: document i's queries
are rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and its keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``.
Attention stays inside each document. Its causal mask is aligned bottom-right, document by
document: with ``lq`` queries and ``lk`` keys, query i sees key j iff ``j <= i + lk - lq``, so a
block of queries can be the last ``lq`` tokens of a document whose keys start earlier (the
FlashAttention-2 varlen convention). Documents may be empty on either side; a query that sees
no key gets out 0 and lse ``-inf``. lse comes back as ``[1, Hq, Sq]``, as in the batch form.

A sliding window (``window=(left, right)``, on the kernels with ``Kernel.takes_window``) is
flash-attn's convention, aligned bottom-right: with ``m`` queries and ``n`` keys (per document
in the varlen form), query i sees key j iff ``i + (n - m) - left <= j <= i + (n - m) + right``;
``None`` on a side is unbounded there. With ``causal`` the right side is 0 (flash-attn's rule),
and a window call may be rectangular. ringbench's variants pass ``causal=False`` with both
sides given. ``window=None`` (the default) is the mask of ``causal`` alone.

A mask (``mask=``, a ``common.PositionMask``, on the kernels with ``Kernel.takes_mask``, batch form
only) gives every query row's and key row's global position and the predicate that says which pairs
are seen; the call then passes ``causal=False`` and no window, and may be rectangular. A row that
sees no key gets out 0 and lse ``-inf``. The math kernel reads the mask's dense boolean block; the
flex kernel (FlexAttention) makes its ``mask_mod`` of the same positions and predicate,
``allows(q_pos[i], k_pos[j])``, and its ``BlockMask`` once per mask object. A kernel that takes a
window but no mask (flash-attn-4, flash-attn, torch-flash, cpu) gets a mask's partial blocks from
the engines as window calls instead, one per slice of the mask (``Kernel.by_slices``).

A bias (``bias=``, a ``common.PositionBias``, on the kernels with ``Kernel.takes_bias``, batch form
only: math, flex as a ``score_mod``, and flash-attn-4 for ALiBi alone, as its own score mod) gives the global positions of the call's rows and keys and
the whole-sequence ``common.Bias`` (ALiBi's slopes, or a learnable tensor of TransformerEngine's
post-scale shapes ``1hss``, ``bhss``, ``11ss``, ``111s``, ``b1ss``); its block is added to the
scaled scores before the softmax, with causal, a window or a mask alike. Backward adds the call's
``d bias`` (the gradient of the scores, summed over the bias's broadcast dimensions) into the bias's
open gradient (``Bias.open_grad``), which the engine reduces over its ranks.

This module holds :class:`Kernel`, the registry (:data:`KERNELS`, :data:`AUTO_ORDER`) and the one
resolution of kernel names (:func:`check_kernel`, :func:`resolve_kernel`, :func:`as_kernel`). The
backends are in ``reference.py`` (math, cpu), ``torch_cuda.py`` (torch-flash, cudnn,
torch-efficient), ``flash_attn.py`` (flash-attn, flash-attn-4 over ``fa4.py``) and ``flex.py``
(flex: PyTorch's FlexAttention, on CUDA and CPU, taking a mask and a bias; its backward recomputes
the block and is given the global out and lse through the merge identity); what they share in
``common.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from . import fa4
from .common import _cuda_unavailable, device_arch
from .flex import _flex_backward, _flex_forward, _flex_unavailable
from .flex import notes as _flex_notes
from .flash_attn import (_fa4_backward, _fa4_backward_varlen, _fa4_forward, _fa4_forward_varlen, _fa4_version,
                         _flash_attn_backward, _flash_attn_backward_varlen, _flash_attn_forward,
                         _flash_attn_forward_varlen, _flash_attn_unavailable, _flash_attn_version)
from .reference import (_cpu_backward, _cpu_backward_varlen, _cpu_forward, _cpu_forward_varlen, _math_backward,
                        _math_backward_varlen, _math_forward, _math_forward_varlen)
from .torch_cuda import (_cudnn_backward, _cudnn_forward, _cudnn_notes, _cudnn_unavailable, _efficient_backward,
                         _efficient_forward, _torch_flash_backward, _torch_flash_backward_varlen,
                         _torch_flash_forward, _torch_flash_forward_varlen, _torch_flash_unavailable)

Tensor = torch.Tensor

#: Order in which ``auto`` picks a kernel on each device type.
#: flex is named, never picked: on CUDA it compiles each block shape on its first call (tens of seconds) and
#: one of its GPU tests fails (a learnable bias in bf16 under a causal mask, tests/test_flex.py); on CPU it is
#: an unfused fallback, no faster than math.
AUTO_ORDER = {"cuda": ("flash-attn-4", "flash-attn", "torch-flash", "cudnn", "math"), "cpu": ("cpu", "math")}


@dataclass(frozen=True)
class Kernel:
    """One local attention backend.

    Attributes:
        name: the name users pass to ``--kernel``.
        device_type: ``"cuda"`` or ``"cpu"``; ``"any"`` for the math kernel.
        dtypes: input dtypes the backend accepts.
        max_head_dim: the largest head dim the backend takes (``None``: no limit).
        head_dim_multiple: head dims must be a multiple of this.
        forward: ``(q, k, v, causal, softmax_scale) -> (out, lse)``.
        backward: ``(dout, q, k, v, out, lse, causal, softmax_scale) -> (dq, dk, dv)``;
            gradients in the input dtype (math: float32 or float64).
        unavailable: a function returning why the backend cannot run here, or ``None``.
        forward_varlen: ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal, softmax_scale) -> (out, lse)``, the packed-documents form (module
            docstring), or ``None`` when the kernel has none.
        backward_varlen: ``(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, causal, softmax_scale) -> (dq, dk, dv)``, or ``None``.
        no_varlen: why there is no varlen form, when there is none.
        takes_window: forward and backward (both forms) take ``window=(left, right)`` (module
            docstring); ``no_window`` says why a kernel does not.
        takes_mask: forward and backward (batch form) take ``mask=``, a ``common.PositionMask``
            (module docstring). A kernel that takes a window but no mask still serves every mask:
            the engines cut each partial block into one window call per slice of the mask
            (``engines/masked.py``, :attr:`by_slices`).
        takes_bias: forward and backward (batch form) take ``bias=``, a ``common.PositionBias``
            (module docstring); ``no_bias`` says why a kernel does not.
        bias_kinds: the biases it takes where it takes only some (``("alibi",)``: flash-attn-4,
            whose backward gives no gradient for a bias tensor); empty: every one, where
            ``takes_bias``. ``no_bias`` then says why the others do not run.
        takes_max_logit: forward (batch form) takes ``max_logit=``, a ``max_logit.MaxLogit`` it
            raises to each head's largest scaled, masked, biased score (math only);
            ``no_max_logit`` says why a kernel does not.
        head_dim_v: whether it takes a value head dim apart from the query/key one (v
            ``[..., Dv]``, out ``[..., Hq, Dv]``: MLA shapes such as 192/128).
        version: a function naming what serves the calls and its version, for the records
            (``"flash-attn-4 4.0.0b36"``); ``None`` where unknown.
        notes: a function returning what records should say about how the kernel ran the
            calls of this process (cudnn: K/V expanded because the op refused native GQA).
        nondeterministic_backward: why the backward pass, as ringbench calls it, is not bitwise
            repeatable, with the source that documents it; empty where it is (``cpu``, ``math``).
            ``verify --repeat`` records it and does not fail gradients (dq, dk, dv) that differ
            between repeats for it, unless ``--require-deterministic``; out or lse that differ fail.
        min_sm: the oldest NVIDIA architecture it runs on, as ``sm<major><minor>`` reads (90: compute
            capability 9.0, Hopper); such a kernel runs on no AMD GPU. ``None``: no architecture rule.
        arch_rule: where ``min_sm`` comes from, for the sentence that refuses a GPU below it.
    """

    name: str
    device_type: str
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int | None
    head_dim_multiple: int
    forward: Callable[..., tuple[Tensor, Tensor]] = field(repr=False)
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]] = field(repr=False)
    unavailable: Callable[[], str | None] = field(repr=False, default=lambda: None)
    forward_varlen: Callable[..., tuple[Tensor, Tensor]] | None = field(repr=False, default=None)
    backward_varlen: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = field(repr=False, default=None)
    no_varlen: str = ""
    nondeterministic_backward: str = ""
    head_dim_v: bool = False
    version: Callable[[], str | None] = field(repr=False, default=lambda: f"torch {torch.__version__}")
    notes: Callable[[], list[str]] = field(repr=False, default=lambda: [])
    takes_window: bool = False
    no_window: str = ""
    takes_mask: bool = False
    takes_bias: bool = False
    bias_kinds: tuple[str, ...] = ()
    no_bias: str = "ringbench calls it without an additive score bias"
    takes_max_logit: bool = False
    no_max_logit: str = "its op returns out and lse only, never the scores' maximum"
    min_sm: int | None = None
    arch_rule: str = ""

    def check_arch(self, arch: str, gpu: str = "this GPU") -> str | None:
        """Why the kernel cannot run on ``gpu``, whose architecture is ``arch`` (``sm90``, ``gfx942``:
        ``ringbench.rank.peaks.Datasheet.arch``), in one sentence without a fix, or ``None`` when it can."""
        if self.min_sm is None:
            return None
        if arch.startswith("sm") and arch[2:].isdigit() and int(arch[2:]) >= self.min_sm:
            return None
        return (f"{gpu} ({arch}) cannot run the {self.name} kernel, which runs on NVIDIA GPUs of sm{self.min_sm} "
                f"or newer only ({self.arch_rule})")

    def why_unavailable(self) -> str | None:
        """Why the kernel cannot run on this machine (the visible GPU's architecture against
        :attr:`min_sm`, then :attr:`unavailable`), or ``None`` when it can."""
        arch = device_arch() if self.min_sm is not None else None
        return (self.check_arch(arch) if arch else None) or self.unavailable()

    @property
    def any_mask(self) -> bool:
        """Whether any mask of ``masks.py`` can run on it: as a dense block (``takes_mask``) or as
        window calls, one per slice (``takes_window``)."""
        return self.takes_mask or self.takes_window

    @property
    def by_slices(self) -> bool:
        """Whether the engines give it a mask's partial blocks as window calls, one per slice."""
        return self.takes_window and not self.takes_mask

    def takes(self, bias: str) -> bool:
        """Whether it takes the bias ``bias`` (``alibi`` or a learnable shape, such as ``1hss``)."""
        return self.takes_bias and (not self.bias_kinds or bias in self.bias_kinds)

    @property
    def varlen(self) -> bool:
        """Whether the kernel has the packed-documents form."""
        return self.forward_varlen is not None

    def check_varlen(self) -> str | None:
        """Return why this kernel cannot run packed documents, or ``None`` when it can."""
        if self.varlen:
            return None
        names = ", ".join(n for n, k in KERNELS.items() if k.varlen and k.device_type in (self.device_type, "any"))
        return (f"the {self.name} kernel has no varlen form in ringbench ({self.no_varlen}); "
                f"pass --kernel with one of {names} or auto")

    def check_head_dim(self, head_dim: int, head_dim_v: int | None = None) -> str | None:
        """Return why ``head_dim`` (and the value head dim ``head_dim_v``, when given) is refused by
        this kernel, or ``None`` when it is fine."""
        if head_dim_v is not None and head_dim_v != head_dim:
            if not self.head_dim_v:
                return (f"head_dim_v {head_dim_v} differs from head_dim {head_dim}, which the {self.name} kernel "
                        "cannot take (it needs one head dim for q, k and v)")
            reason = self.check_head_dim(head_dim_v)
            if reason:
                return reason.replace("head_dim", "head_dim_v", 1)
        if head_dim <= 0:
            return f"head_dim {head_dim} must be positive"
        if self.max_head_dim is not None and head_dim > self.max_head_dim:
            return f"head_dim {head_dim} exceeds {self.max_head_dim}, the largest the {self.name} kernel takes"
        if head_dim % self.head_dim_multiple:
            return (f"head_dim {head_dim} is not a multiple of {self.head_dim_multiple}, "
                    f"which the {self.name} kernel needs")
        return None


_HALF = (torch.float16, torch.bfloat16)

# Where the CUDA kernels' backward passes are documented as nondeterministic (Kernel.nondeterministic_backward).
_NONDET_FLASH_ATTN = ("flash-attn's backward is deterministic only when called with deterministic=True, which "
                      "ringbench does not pass (flash_attn_interface.py: 'deterministic: bool. Whether to use the "
                      "deterministic implementation of the backward pass ... The forward pass is always "
                      "deterministic.')")
_NONDET_FA4 = ("flash-attn-4's backward accumulates dq with atomic adds unless called with deterministic=True, "
               "which ringbench does not pass (flash_attn/cute/interface.py, _flash_attn_bwd's deterministic "
               "argument, default False)")
_NONDET_TORCH = ("PyTorch's {op} warns that '{name} defaults to a non-deterministic algorithm' "
                 "(aten/src/ATen/native/transformers/cuda/attention_backward.cu); ringbench does not call "
                 "torch.use_deterministic_algorithms(True)")

# Where the CUDA kernels' oldest architecture is stated (Kernel.min_sm).
_ARCH_FA4 = ("flash-attn-4's package description: 'a CuTeDSL-based implementation of FlashAttention for Hopper "
             "and Blackwell GPUs'")
_ARCH_FA2 = "flash-attn's README: FlashAttention-2 supports Ampere, Ada and Hopper GPUs"
_ARCH_TORCH = "PyTorch's {check} in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp"

KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel("flash-attn-4", "cuda", _HALF, 256, 8, _fa4_forward, _fa4_backward, fa4.unavailable,
               _fa4_forward_varlen, _fa4_backward_varlen, nondeterministic_backward=_NONDET_FA4, head_dim_v=True,
               takes_window=True, takes_bias=True, bias_kinds=("alibi",), no_bias=fa4.NO_BIAS, min_sm=90,
               arch_rule=_ARCH_FA4, version=_fa4_version, notes=fa4.notes),
        Kernel("flash-attn", "cuda", _HALF, 256, 8, _flash_attn_forward, _flash_attn_backward,
               _flash_attn_unavailable, _flash_attn_forward_varlen, _flash_attn_backward_varlen,
               nondeterministic_backward=_NONDET_FLASH_ATTN, version=_flash_attn_version, takes_window=True,
               min_sm=80, arch_rule=_ARCH_FA2),
        Kernel("torch-flash", "cuda", _HALF, 256, 8, _torch_flash_forward, _torch_flash_backward,
               _torch_flash_unavailable, _torch_flash_forward_varlen, _torch_flash_backward_varlen,
               nondeterministic_backward=_NONDET_TORCH.format(name="Flash Attention", op="_flash_attention_backward"),
               takes_window=True, min_sm=80,
               arch_rule=_ARCH_TORCH.format(check="check_flash_attention_hardware_support")),
        Kernel("cudnn", "cuda", _HALF, 128, 8, _cudnn_forward, _cudnn_backward, _cudnn_unavailable,
               no_varlen="cuDNN's ragged-offset attention is not wired up or verified",
               nondeterministic_backward=_NONDET_TORCH.format(name="cuDNN Attention", op="_cudnn_attention_backward"),
               version=lambda: f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
               notes=_cudnn_notes, no_window="PyTorch's cuDNN attention op takes no window size",
               min_sm=80, arch_rule=_ARCH_TORCH.format(check="check_cudnn_hardware_support")),
        Kernel("torch-efficient", "cuda", (*_HALF, torch.float32), 128, 8, _efficient_forward, _efficient_backward,
               _cuda_unavailable, no_varlen="the memory-efficient op's varlen form is not wired up or verified",
               nondeterministic_backward=_NONDET_TORCH.format(name="Memory Efficient attention",
                                                              op="_efficient_attention_backward"),
               no_window="PyTorch's memory-efficient attention op takes no window size"),
        Kernel("cpu", "cpu", (torch.float32, torch.float64, torch.bfloat16, torch.float16), None, 1,
               _cpu_forward, _cpu_backward, forward_varlen=_cpu_forward_varlen,
               backward_varlen=_cpu_backward_varlen, takes_window=True),
        Kernel("flex", "any", (*_HALF, torch.float32, torch.float64), 256, 8, _flex_forward, _flex_backward,
               _flex_unavailable,
               no_varlen="its packed-documents form (a document mask_mod) is not wired up or verified",
               head_dim_v=True, takes_mask=True, takes_bias=True, notes=_flex_notes,
               no_window="it takes masks by position, and a one-sided window (--window L, --mask window:L) runs as window calls; window:L,R and global:G,window:L run on it",
               no_max_logit="ringbench does not read FlexAttention's max_scores, which this torch returns on "
                            "CUDA only"),
        Kernel("math", "any", (torch.float64, torch.float32, torch.bfloat16, torch.float16), None, 1,
               _math_forward, _math_backward, forward_varlen=_math_forward_varlen,
               backward_varlen=_math_backward_varlen, head_dim_v=True, takes_window=True, takes_mask=True,
               takes_bias=True, takes_max_logit=True),
    )
}


def get_kernel(name: str) -> Kernel:
    """Return the kernel registered as ``name``.

    Raises:
        ValueError: when no kernel has that name; the message lists the valid ones.
    """
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"kernel {name!r} is unknown; choose one of {', '.join(KERNELS)} or auto") from None


#: The short names of the input dtypes (the CLI's ``--dtype`` values), in the order messages list them.
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def kernels_for(device_type: str, kernels: Mapping[str, Kernel] | None = None) -> list[str]:
    """Names of the kernels that run on ``device_type`` (its own and the ``any`` ones), in registry order."""
    registry = KERNELS if kernels is None else kernels
    return [n for n, k in registry.items() if k.device_type in (device_type, "any")]


def check_kernel(kernel: Kernel, device_type: str, *, dtype: torch.dtype | None = None,
                 head_dim: int | None = None, varlen: bool = False, head_dim_v: int | None = None,
                 window: bool = False, mask: str = "", bias: str = "", max_logit: bool = False,
                 kernels: Mapping[str, Kernel] | None = None) -> str | None:
    """Why ``kernel`` cannot take a call on ``device_type``, or ``None`` when it can.

    The rules, in order: a varlen call (packed documents) needs a kernel with a varlen form;
    a sliding window (``window``) one that takes a window; a mask (``mask``, its text, such as
    ``prefix:512``) one that takes a mask; a bias (``bias``, its text, such as ``alibi`` or
    ``1hss``) one that takes a bias; the per-head max logit (``max_logit``) one that returns it; the kernel must run on ``device_type``; it must take ``head_dim`` and ``dtype`` (each
    checked when given; ``head_dim_v``, the value head dim, with it). Availability on this
    machine is :func:`resolve_kernel`'s last rule.
    The reason is one sentence naming the value, the rule and the fix.

    Args:
        kernels: the registry the fixes name kernels from (default :data:`KERNELS`).
    """
    registry = KERNELS if kernels is None else kernels
    if varlen and not kernel.varlen:
        names = [n for n in kernels_for(device_type, registry) if registry[n].varlen]
        return (f"the {kernel.name} kernel has no varlen form in ringbench ({kernel.no_varlen}); "
                f"pass --kernel with one of {', '.join(names)} or auto")
    if window and not kernel.takes_window:
        names = [n for n in kernels_for(device_type, registry) if registry[n].takes_window]
        return (f"the {kernel.name} kernel cannot take a sliding window ({kernel.no_window}); "
                f"pass --kernel with one of {', '.join(names)} or auto")
    if mask and not kernel.any_mask:
        names = [n for n in kernels_for(device_type, registry) if registry[n].any_mask]
        return (f"the {kernel.name} kernel cannot take mask {mask} (a mask runs as a dense block or as one window "
                f"call per slice, and {kernel.no_window}); pass --kernel with one of {', '.join(names)} or auto")
    if bias and not kernel.takes(bias):
        names = [n for n in kernels_for(device_type, registry) if registry[n].takes(bias)]
        return (f"the {kernel.name} kernel cannot take bias {bias} ({kernel.no_bias}); "
                f"pass --kernel with one of {', '.join(names)} or auto")
    if max_logit and not kernel.takes_max_logit:
        names = [n for n in kernels_for(device_type, registry) if registry[n].takes_max_logit]
        return (f"the {kernel.name} kernel cannot return the per-head max logit ({kernel.no_max_logit}), which "
                f"--max-logit needs; pass --kernel {' or '.join(names) or 'math'}")
    if kernel.device_type not in (device_type, "any"):
        # Only kernels of this device that take the rest of the case: one that refuses it would be refused next.
        takers = [n for n in kernels_for(device_type, registry) if check_kernel(
            registry[n], device_type, dtype=dtype, head_dim=head_dim, varlen=varlen, head_dim_v=head_dim_v,
            window=window, mask=mask, bias=bias, max_logit=max_logit, kernels=registry) is None]
        return (f"kernel {kernel.name!r} runs on {kernel.device_type}, not {device_type}; "
                + (f"pass --kernel with one of {', '.join(takers)} or auto" if takers else "pass --kernel auto"))
    if head_dim is not None:
        reason = kernel.check_head_dim(head_dim, head_dim_v)
        if reason:
            takers = [n for n in kernels_for(device_type, registry)
                      if n != kernel.name and registry[n].check_head_dim(head_dim, head_dim_v) is None]
            return (f"{reason}; pass another --head-dim{'-v' if 'head_dim_v' in reason else ''}"
                    + (f", or --kernel {takers[0]}" if len(takers) == 1 else
                       f", or --kernel with one of {', '.join(takers)}" if takers else ""))
    if dtype is not None and dtype not in kernel.dtypes:
        taken = [short for d, short in DTYPE_NAMES.items() if d in kernel.dtypes]
        return (f"dtype {DTYPE_NAMES.get(dtype, dtype)} is not supported by the {kernel.name} kernel, which takes "
                f"{' and '.join(taken) if len(taken) < 3 else ', '.join(taken)}; pass --dtype {taken[0]}")
    return None


def _unavailable(kernel: Kernel) -> str | None:
    reason = kernel.why_unavailable()
    return f"kernel {kernel.name!r} is unavailable here: {reason}; pass another --kernel or auto" if reason else None


def resolve_kernel(name: str, device_type: str, *, dtype: torch.dtype | None = None, head_dim: int | None = None,
                   varlen: bool = False, among: tuple[str, ...] = (), head_dim_v: int | None = None,
                   window: bool = False, mask: str = "", bias: str = "", max_logit: bool = False,
                   kernels: Mapping[str, Kernel] | None = None) -> Kernel:
    """The kernel a call on ``device_type`` runs with: the one named, or for ``auto`` the first of
    ``AUTO_ORDER[device_type]`` that passes every rule of :func:`check_kernel` for ``dtype``,
    ``head_dim`` and ``varlen`` and is available here.

    The one resolution of kernel names: the variants (through :func:`as_kernel`) and the
    harness's spec resolution both call it.

    Args:
        name: a kernel name or ``auto``.
        device_type: ``cpu`` or ``cuda``.
        dtype, head_dim: the call's input dtype and head dim; ``None``: not checked.
        head_dim_v: the value head dim where it differs (``None``: the same as ``head_dim``).
        varlen: the call takes packed documents, so the kernel needs a varlen form.
        window: the call has a sliding window, so the kernel must take one.
        mask: the call's mask (its text; empty: none), so the kernel must take a mask.
        bias: the call's bias (its text, ``alibi`` or a shape; empty: none), so the kernel must take one.
        max_logit: the call returns the per-head max logit, so the kernel must compute it.
        among: for ``auto``, the only kernels it may pick (a peer's own); empty: any.
        kernels: the registry to resolve in (default :data:`KERNELS`); a test passes stand-ins.

    Raises:
        ValueError: an unknown name, a named kernel that breaks a rule or is unavailable here,
            or no kernel for ``auto``: one sentence with the value, the rule and the fix.
    """
    registry = KERNELS if kernels is None else kernels
    rules = dict(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, varlen=varlen, window=window, mask=mask,
                 bias=bias, max_logit=max_logit, kernels=registry)
    if name != "auto":
        if name not in registry:
            raise ValueError(f"kernel {name!r} is unknown; choose one of {', '.join(registry)} or auto")
        kern = registry[name]
        reason = check_kernel(kern, device_type, **rules) or _unavailable(kern)
        if reason:
            raise ValueError(reason)
        return kern
    if device_type not in AUTO_ORDER:
        raise ValueError(f"kernel auto has no kernels for device type {device_type!r}; run on "
                         f"{' or '.join(AUTO_ORDER)}")
    refusals = []
    for candidate in AUTO_ORDER[device_type]:
        if candidate not in registry or (among and candidate not in among):
            continue
        kern = registry[candidate]
        reason = check_kernel(kern, device_type, **rules) or _unavailable(kern)
        if reason is None:
            return kern
        refusals.append(reason.split(";")[0])
    wanted = [w for w in ("packed documents" if varlen else "", "a sliding window" if window else "",
                          f"mask {mask}" if mask else "", f"bias {bias}" if bias else "",
                          "the max logit" if max_logit else "",
                          f"head_dim {head_dim}" if head_dim is not None else "",
                          f"head_dim_v {head_dim_v}" if head_dim_v not in (None, head_dim) else "",
                          f"dtype {DTYPE_NAMES.get(dtype, dtype)}" if dtype is not None else "") if w]
    what = f" for {', '.join(wanted[:-1])} and {wanted[-1]}" if len(wanted) > 1 else "".join(f" for {w}" for w in wanted)
    raise ValueError(f"kernel auto found no kernel on {device_type}{what} ({'; '.join(refusals)}); "
                     f"change --dtype or --head-dim{'-v' if head_dim_v not in (None, head_dim) else ''}")


def as_kernel(kernel: "Kernel | str", device_type: str, dtype: torch.dtype | None = None, *,
              head_dim: int | None = None, varlen: bool = False, head_dim_v: int | None = None,
              window: bool = False, mask: str = "", bias: str = "", max_logit: bool = False) -> Kernel:
    """The kernel object a variant calls: a name (or ``auto``) resolved by :func:`resolve_kernel`
    for the call's device type, dtype, head dim and form; a :class:`Kernel` checked by the same
    rules (:func:`check_kernel`) but for availability, which its caller has settled.

    Raises:
        ValueError: as :func:`resolve_kernel`.
    """
    if isinstance(kernel, Kernel):
        reason = check_kernel(kernel, device_type, dtype=dtype, head_dim=head_dim, varlen=varlen,
                              head_dim_v=head_dim_v, window=window, mask=mask, bias=bias, max_logit=max_logit)
        if reason:
            raise ValueError(reason)
        return kernel
    return resolve_kernel(kernel, device_type, dtype=dtype, head_dim=head_dim, varlen=varlen, head_dim_v=head_dim_v,
                          window=window, mask=mask, bias=bias, max_logit=max_logit)
