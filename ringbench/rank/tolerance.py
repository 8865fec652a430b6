"""Verify's rules for one tensor: the max rule, the kernel rule and the block-decomposition rule.

For each tensor T in (out, lse, dq, dk, dv), with T_fp64 the math kernel in float64 and
T_single the same kernel on one device over the whole sequence:

- **the max rule** (:func:`tolerance_check`): ``max|T_variant - T_fp64| <= 2 * max|T_single - T_fp64|
  + floor(T)`` (:func:`floor_for`: one rounding of the dtype at T's largest magnitude in bf16 and
  fp16, two per partial result in fp32 and fp64); NaN or Inf fails, and so does a dtype or shape
  that differs from the input's;
- **the kernel rule** (:func:`kernel_check`): in bf16 and fp16, ``max|T_single - T_fp64|`` at most
  :data:`KERNEL_UNITS` eps of the dtype at T's largest magnitude, since the max rule scales with
  that error and so cannot catch a kernel wrong the same way on one device and in the ring;
- **the block-decomposition rule** (:func:`shadow_check`): every element within one ulp and the
  float32 merge's roundings of the variant's own kernel calls merged in float64.

``check.verify_case`` runs the case and applies them; docs/verify.md says why each is there, with
its calibration.
"""

from __future__ import annotations

import math

import torch

from ringbench.variants.kernels.common import accumulation_dtype

TENSORS = ("out", "lse", "dq", "dk", "dv")
ERR_FACTOR = 2.0
#: The block-decomposition rule (:func:`shadow_check`): ulps of the tensor's dtype at each element,
#: and eps of the accumulation dtype per partial result at the largest magnitude.
SHADOW_ULPS = 1.0
SHADOW_EPS_PER_TERM = 4.0
#: The kernel rule (:func:`kernel_check`): the most the case's kernel alone, on one device, may be off
#: float64, in eps of the case's dtype (bf16, fp16) at the tensor's largest magnitude. Correct kernels in
#: every verify record through 2026-12-07 reached about 2 at 8 query heads a K/V head or fewer (cpu's dv,
#: CPU) and 1.0 (torch-flash, cudnn, torch-efficient, flash-attn-4 and flex on an H200 or H100, up to 16k);
#: flash-attn-4's ALiBi score mod with a wrong GQA backward read 14044 on dq
#: (results/reference/2026-12-07-s5/h100/verify.jsonl).
KERNEL_UNITS = 8.0
#: The kernel rule leaves out a tensor whose float64 value stays below this at its largest: verify's inputs
#: are drawn at unit scale, so such a tensor cancels analytically (dq and dk where every document is one
#: token: 1e-17 in float64) and its kernel errors are roundings of terms with no scale of its own.
KERNEL_MIN_SCALE = 1e-3
#: The shadow fields of a check entry, null where the block-decomposition check does not apply.
SHADOW_FIELDS = ("shadow_err", "shadow_allowed", "shadow_ratio", "shadow_mean_ratio", "shadow_terms",
                 "shadow_passed")


def floor_for(dtype: torch.dtype, ref_max: float, world_size: int = 1, terms: int | None = None) -> float:
    """The error floor of a tensor of ``dtype`` whose largest |value| is ``ref_max``.

    bf16 and fp16: one rounding, ``0.5 * eps * ref_max`` (the blocks are merged in the finer
    float32 and rounded once). fp32 and fp64: the merge accumulates in the input's own precision,
    so each of the ``n`` partial results met in one element (``terms``, at least ``2 * world_size``,
    two blocks a rank) may add a rounding of that precision, twice (once in its kernel, once in
    the sum): ``2 * n * eps * ref_max``. In float64 the single-device reference has no error at
    all, and in float32 its error is a few ulps, so a tighter floor fails correct variants by
    chance (zigzag with a shared-prefix mask at W=2, seed 0, read 1.25); a dropped or mis-masked
    block is orders of magnitude above it."""
    eps = torch.finfo(dtype).eps
    if dtype in (torch.float32, torch.float64):
        return 2 * max(terms or 0, 2 * world_size) * eps * ref_max
    return 0.5 * eps * ref_max


def tolerance_check(name: str, got: torch.Tensor, single: torch.Tensor, ref: torch.Tensor,
                    expected_dtype: torch.dtype, expected_shape: tuple, world_size: int = 1,
                    floor: float = 0.0, single_ref: torch.Tensor | None = None,
                    terms: int | None = None, kernel_rule: tuple[torch.dtype, int] | None = None) -> dict:
    """Apply the tolerance rule to one tensor and return its check entry (docs/contracts.md).

    A result of the wrong shape is a failed check with infinite error, not an exception.
    ``floor`` raises the error floor to at least that; ``single_ref`` is what ``single`` is
    measured against where that is not ``ref`` (``d sink``: each against what its own out and
    lse imply, see ``sink_pad_check.references``); ``terms`` the most partial results met in one
    element (:func:`floor_for`); ``kernel_rule``: the case's dtype and query heads a K/V head, to
    apply :func:`kernel_check` too (its fields added, ``passed`` only if it passes).
    """
    dtype_ok = got.dtype == expected_dtype
    shape_ok = tuple(got.shape) == tuple(expected_shape) == tuple(ref.shape)
    if not shape_ok:
        inf = float("inf")
        return {"tensor": name, "err": inf, "err_single": inf, "floor": 0.0, "allowed": 0.0,
                "ratio": inf, "mean_err": inf, "mean_err_single": inf, "finite": False,
                "dtype_ok": dtype_ok, "shape_ok": False, "passed": False,
                "dtype": str(got.dtype).replace("torch.", "")}
    ref = ref.double()
    finite_ref = torch.isfinite(ref)
    got_d, single_d = got.double(), single.double()
    # Where the reference is -inf (lse of a row that sees no key) the variant must match exactly.
    finite = bool(torch.isfinite(got_d[finite_ref]).all()) and bool(
        (got_d[~finite_ref] == ref[~finite_ref]).all())
    diff = (got_d - ref)[finite_ref].abs()
    diff_single = (single_d - (ref if single_ref is None else single_ref.double()))[finite_ref].abs()
    err = float(diff.max()) if diff.numel() else 0.0
    err_single = float(diff_single.max()) if diff_single.numel() else 0.0
    ref_max = float(ref[finite_ref].abs().max()) if finite_ref.any() else 0.0
    floor = max(floor, floor_for(expected_dtype, ref_max, world_size, terms))
    allowed = ERR_FACTOR * err_single + floor
    ok_err = err == err and err <= allowed  # err == err is False for nan
    entry = {
        "tensor": name,
        "err": err,
        "err_single": err_single,
        "floor": floor,
        "allowed": allowed,
        "ratio": err / allowed if allowed > 0 else (0.0 if err == 0 else float("inf")),
        "mean_err": float(diff.mean()) if diff.numel() else 0.0,
        "mean_err_single": float(diff_single.mean()) if diff_single.numel() else 0.0,
        "finite": finite,
        "dtype_ok": dtype_ok,
        "shape_ok": shape_ok,
        "passed": bool(ok_err and finite and dtype_ok and shape_ok),
        "dtype": str(got.dtype).replace("torch.", ""),
    }
    if kernel_rule is not None:
        entry.update(kernel_check(name, err_single, ref_max, *kernel_rule))
        entry["passed"] = entry["passed"] and entry["kernel_passed"] is not False
    return entry


def kernel_limit(tensor: str, groups: int = 1) -> float:
    """The kernel rule's bound for ``tensor``, eps of the dtype at its scale: :data:`KERNEL_UNITS`, and for
    dk and dv ``KERNEL_UNITS * sqrt(groups)``, since a GQA call's dK/dV sum the ``groups`` query heads of a
    K/V head and a kernel may round each before the sum (PyTorch's CPU flash op: dk at 0.6, 1.5, 4.2 and
    7.6 eps in bf16 at 1, 8, 32 and 128 query heads a K/V head, 12.6 in fp16 at 128: about sqrt(groups))."""
    return KERNEL_UNITS * (math.sqrt(groups) if tensor in ("dk", "dv") else 1.0)


def kernel_check(tensor: str, err_single: float, ref_max: float, dtype: torch.dtype, groups: int = 1) -> dict:
    """The kernel rule for one attention tensor (docs/verify.md): the single run's error ``err_single``
    against float64, in eps of the case's ``dtype`` at ``ref_max`` (the float64 tensor's largest finite
    magnitude), at most :func:`kernel_limit` (``groups``: query heads a K/V head). The max rule scales with
    that error, so a kernel that is wrong the same way on one device and in the ring passes it; this bound
    does not move with the kernel. bf16 and fp16 only: in fp32 the sums over the keys carry roundings that
    grow with the sequence (a correct kernel read up to 346 eps), and fp64 is the reference's own precision.

    Returns:
        ``{"kernel_units": float | None, "kernel_limit": float | None, "kernel_passed": bool | None}``
        (the error and its bound in eps), None where the rule does not apply (fp32, fp64, or a tensor
        below :data:`KERNEL_MIN_SCALE`).
    """
    if dtype not in (torch.bfloat16, torch.float16) or ref_max < KERNEL_MIN_SCALE:
        return {"kernel_units": None, "kernel_limit": None, "kernel_passed": None}
    units = err_single / (torch.finfo(dtype).eps * ref_max)
    limit = kernel_limit(tensor, groups)
    return {"kernel_units": units, "kernel_limit": limit, "kernel_passed": bool(units <= limit)}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype``'s numbers at each |x| (a float64 tensor of x's shape).

    ``eps(dtype) * 2**floor(log2|x|)`` for a normal |x|; below the smallest normal number, the
    subnormal spacing ``eps * tiny``. Rounding x to ``dtype`` moves it by at most half of this.
    """
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.double().abs().clamp_min(info.tiny))  # |x| = m * 2**e, m in [0.5, 1)
    return torch.ldexp(torch.full_like(x, info.eps / 2, dtype=torch.float64), exponent)


def max_rule_passed(check: dict) -> bool:
    """Whether a check entry passed the max rule (and was well formed), whatever its shadow says."""
    return bool(check["err"] <= check["allowed"] and check["finite"] and check["dtype_ok"] and check["shape_ok"])


def no_shadow(reason: str) -> dict:
    return {**dict.fromkeys(SHADOW_FIELDS), "shadow_reason": reason}


def shadow_check(got: torch.Tensor, shadow: torch.Tensor, dtype: torch.dtype, *, terms: int,
                 scale: float) -> dict:
    """Judge one tensor against its block-decomposition reference and return the shadow fields.

    ``shadow`` is the float64 result rebuilt from the variant's own kernel calls (each block's
    out and lse as the kernel returned them, merged in float64; partial gradients summed in
    float64 at their owner). A correct variant differs from it by its float32 merge or sum and
    one rounding to ``dtype``, so for every element::

        |T - T_shadow| <= SHADOW_ULPS * ulp_dtype(T_shadow) + SHADOW_EPS_PER_TERM * terms * eps_acc * scale

    with ``eps_acc`` the eps of the accumulation dtype (float32; float64 for float64 inputs),
    ``terms`` the most partial results that met in one element, and ``scale`` the largest
    magnitude among the shadow and its partial results. Where the shadow is not finite (the lse
    of a row that sees no key) the variant must match it exactly.

    Args:
        got: the variant's gathered tensor.
        shadow: the float64 reference of the same shape.
        dtype: the dtype whose ulp applies (the input dtype; lse: its own, float32 or float64).
        terms: the most partial results of one element, over every rank.
        scale: the largest magnitude among the shadow and its partial results.

    Returns:
        ``shadow_err`` (max |T - T_shadow|), ``shadow_ratio`` (max over elements of the
        difference over its allowance; pass needs <= 1), ``shadow_allowed`` (the allowance at
        that element), ``shadow_mean_ratio`` (the mean of that ratio over the elements),
        ``shadow_terms``, ``shadow_passed`` and ``shadow_reason`` (null).
    """
    if tuple(got.shape) != tuple(shadow.shape):
        inf = float("inf")
        return {"shadow_err": inf, "shadow_allowed": 0.0, "shadow_ratio": inf, "shadow_mean_ratio": inf,
                "shadow_terms": terms, "shadow_passed": False, "shadow_reason": None}
    got_d = got.double()
    finite = torch.isfinite(shadow)
    exact = bool((got_d[~finite] == shadow[~finite]).all())
    diff = (got_d - shadow)[finite].abs()
    eps_acc = torch.finfo(accumulation_dtype(dtype)).eps
    allowed = SHADOW_ULPS * ulp(shadow[finite], dtype) + SHADOW_EPS_PER_TERM * terms * eps_acc * scale
    if not diff.numel():
        ratio, mean_ratio, err, at = 0.0, 0.0, 0.0, 0.0
    else:
        ratios = diff / allowed
        worst = int(torch.argmax(torch.nan_to_num(ratios, nan=float("inf"))))
        ratio, mean_ratio = float(ratios[worst]), float(ratios.mean())
        err, at = float(diff.max()), float(allowed[worst])
    if not exact:
        ratio = float("inf")
    return {"shadow_err": err, "shadow_allowed": at, "shadow_ratio": ratio, "shadow_mean_ratio": mean_ratio,
            "shadow_terms": terms, "shadow_passed": bool(ratio <= 1.0), "shadow_reason": None}
