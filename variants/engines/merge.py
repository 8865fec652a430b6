"""The numerically stable merge of partial attention results through their lse, and the
fused per-step updates the ring engine makes with it.

The plain in-place fold, ``merge_``, lives with the kernels (``kernels/common.py``), whose
tiled math kernel folds with it too; it is imported here. :func:`merge_step` and :func:`add_step` are what
an engine calls once per ring step: fold a block's out/lse (or add a block's gradient) into
the running result at the block's rows and hand the result back in the dtype the caller asks
for, so that the first block needs no float32 copy and the last step writes the input dtype
directly (no separate cast). On CUDA with Triton importable they run as one Triton kernel each
(``merge_triton.py``, imported only there); elsewhere as torch ops, which are also the
reference the Triton kernels are tested against (``tests/test_merge_gpu.py``).

Precision: every arithmetic step on out and gradients runs in float32 (float64 for float64
inputs); the running lse is float64 for float32 inputs too (``running_lse_dtype``), rounded once
by the engine at the end, so its error does not grow with the number of merges. A running
result may be held in the input dtype only where it is exact: a single partial result (it
came from the kernel in that dtype) or the final sum, rounded once. The engine keeps it in
float32 whenever more terms follow (``ring.py``), so what it computes is what an all-float32
accumulation computes, rounded once at the end.

Set ``RINGBENCH_MERGE=torch`` to take the torch ops on CUDA too (to compare the two paths), and
``RINGBENCH_MERGE=triton`` to take the Triton kernels on CPU tensors too, under Triton's
interpreter (``TRITON_INTERPRET=1``), so their use by the engines can be checked without a GPU.

Source: issue 15 (fused merge and cast), after the 2-GPU profile of zigzag at 16k on
torch-flash, where separate casts, ``lerp_`` and ``add_`` passes took about 0.64 ms of a
14.1 ms iteration.
"""

from __future__ import annotations

import functools
import os

import torch

from ..kernels.common import merge_

Tensor = torch.Tensor

#: The environment variable that picks the torch ops on CUDA too (``torch``), or the Triton
#: kernels on every device where Triton imports (``triton``; on CPU under TRITON_INTERPRET=1);
#: unset or anything else: Triton on CUDA where it imports.
MERGE_ENV = "RINGBENCH_MERGE"


# --------------------------------------------------------------------------- which path

@functools.lru_cache(maxsize=None)
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401  (optional: shipped with CUDA builds of torch)
    except Exception:  # an import failure means the torch path, never a crash
        return False
    return True


def merge_path(device: torch.device | str) -> str:
    """Which implementation :func:`merge_step` and :func:`add_step` take for tensors on ``device``.

    Returns:
        ``"triton"`` on CUDA where Triton imports and ``RINGBENCH_MERGE`` is not ``torch``, and
        on any device with ``RINGBENCH_MERGE=triton`` where Triton imports; ``"torch"``
        otherwise (every CPU by default).
    """
    choice = os.environ.get(MERGE_ENV)
    if choice == "triton":
        return "triton" if _triton_imports() else "torch"
    if torch.device(device).type != "cuda" or choice == "torch":
        return "torch"
    return "triton" if _triton_imports() else "torch"


def _fused(*tensors: Tensor) -> bool:
    t = tensors[0]
    return merge_path(t.device) == "triton" and all(x.dtype != torch.float64 for x in tensors if x is not None)


def _acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


# --------------------------------------------------------------------------- the per-step updates

def merge_step(out: Tensor, lse: Tensor, rows, block_out: Tensor, block_lse: Tensor, *,
               into: torch.dtype, inv: Tensor | None = None) -> Tensor:
    """Fold one block's out/lse into the running result at ``rows``; the result in dtype ``into``.

    The arithmetic is :func:`merge_`'s: ``out``'s in float32 (float64 when ``out`` or ``into``
    is float64), ``lse``'s in ``lse``'s dtype, whatever dtype ``out`` and ``into`` have. When ``out`` already has dtype ``into`` it is
    updated in place (only the block's rows are touched) and returned; otherwise a new tensor
    of dtype ``into`` is returned, every row of ``out`` carried over (cast) and the block's
    rows merged. ``lse`` is always updated in place.

    Args:
        out: ``[B, S, H, D]``, the running output, in the input dtype (it holds exactly one
            kernel result, or nothing: zeros) or float32.
        lse: float32 or float64 ``[B, H, S]``, the running log-sum-exp; ``-inf`` where nothing
            was seen yet. float64 (the engines' running lse for float32 and float64 inputs,
            ``running_lse_dtype``) takes the torch ops on every device.
        rows: where the block's rows sit in ``out``: a slice of ``S`` (step 1) or int64 indices
            ``[n]`` (block row j is row ``rows[j]``).
        block_out: ``[B, n, H, D]`` in the input dtype, the kernel's output for the block.
        block_lse: float32 (float64) ``[B, H, n]``.
        into: the dtype of the returned result: the input dtype on a row's last merge, float32
            while more terms follow.
        inv: with index ``rows``, optionally the inverse map, int ``[S]`` (the block row of each
            row of ``out``, -1 where none); built when needed and not given.

    Returns:
        The running output ``[B, S, H, D]`` in dtype ``into`` (``out`` itself when in place).
    """
    if _fused(out, lse, block_out, block_lse):  # a float64 running lse (fp32 inputs) takes the torch ops
        from . import merge_triton

        return merge_triton.merge_step(out, lse, rows, block_out, block_lse, into=into, inv=inv)
    work = out if out.dtype == _acc_dtype(out.dtype, into) else out.to(_acc_dtype(out.dtype, into))
    if isinstance(rows, slice):
        merge_(work[:, rows], lse[:, :, rows], block_out, block_lse)
    else:
        o, l = work.index_select(1, rows), lse.index_select(2, rows)
        merge_(o, l, block_out, block_lse)
        work.index_copy_(1, rows, o)
        lse.index_copy_(2, rows, l)
    return work if work.dtype == into else work.to(into)


def add_step(acc: Tensor | None, rows, grad: Tensor | None, *, into: torch.dtype,
             shape: tuple[int, ...] | None = None, inv: Tensor | None = None) -> Tensor:
    """Add one block's gradient into a running sum at ``rows``; the sum in dtype ``into``.

    The addition runs in float32 (float64 when a float64 tensor is involved). When ``acc``
    already has dtype ``into`` it is updated in place and returned; otherwise a new tensor of
    dtype ``into`` holds every row of ``acc`` (cast) with the block's rows added. ``acc=None``
    is a sum of zeros (of ``shape``); ``grad=None`` adds nothing (so it only casts).

    Raises:
        ValueError: ``acc`` and ``grad`` both ``None``.

    Args:
        acc: ``[B, S, H, D]`` or ``None``; the input dtype where it holds at most one term,
            else float32.
        rows: where the gradient's rows sit: a slice of ``S`` or int64 indices ``[n]``.
        grad: ``[B, n, H, D]``, the kernel's gradient for the block, or ``None``.
        into: the dtype of the returned sum.
        shape: the shape of the sum, needed when ``acc`` is ``None``.
        inv: with index ``rows``, optionally the inverse map, as in :func:`merge_step`.

    Returns:
        The sum ``[B, S, H, D]`` in dtype ``into``, contiguous when it is a new tensor.
    """
    like = acc if acc is not None else grad
    if like is None:
        raise ValueError("add_step needs a running sum or a gradient; both are None")
    if _fused(like, grad):
        from . import merge_triton

        return merge_triton.add_step(acc, rows, grad, into=into, shape=shape, inv=inv)
    dtypes = [into] + [t.dtype for t in (acc, grad) if t is not None]
    a = _acc_dtype(*dtypes)
    if acc is None:
        if grad is not None and isinstance(rows, slice) and rows == slice(None):
            return grad.to(into).contiguous()  # one term: exact in any dtype
        work = torch.zeros(shape, dtype=a, device=grad.device)
    else:
        work = acc if acc.dtype == a else acc.to(a)
    if grad is not None:
        if isinstance(rows, slice):
            work[:, rows] += grad
        else:
            work.index_add_(1, rows, grad.to(work.dtype))
    return work if work.dtype == into else work.to(into)


def add_steps(jobs) -> list[Tensor]:
    """Several :func:`add_step` calls (at most three, as a backward step's dq, dk and dv), in one
    Triton launch on CUDA; on CPU one after the other. Same arguments and results.

    Args:
        jobs: ``(acc, rows, grad, into, shape, inv)`` tuples, each :func:`add_step`'s arguments;
            every ``acc`` or ``grad`` given on one device, with one batch size.

    Returns:
        The sums, in the order of ``jobs``.

    Raises:
        ValueError: more than three jobs, or a job with ``acc`` and ``grad`` both ``None``.
    """
    if len(jobs) > 3:
        raise ValueError(f"add_steps takes at most 3 adds per launch, not {len(jobs)}")
    for acc, _, grad, *_ in jobs:
        if acc is None and grad is None:
            raise ValueError("add_step needs a running sum or a gradient; both are None")
    tensors = [t for acc, _, grad, *_ in jobs for t in (acc, grad) if t is not None]
    if tensors and _fused(*tensors):
        from . import merge_triton

        return merge_triton.add_steps(list(jobs))
    return [add_step(acc, rows, grad, into=into, shape=shape, inv=inv) for acc, rows, grad, into, shape, inv in jobs]
