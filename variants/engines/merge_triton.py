"""Triton kernels of the ring engine's per-step updates: one launch per forward merge, and one
per backward step's adds (up to three: dq, dk, dv), the cast to the result's dtype included.

Imported where ``merge.merge_path`` picks Triton (CUDA where Triton imports; any device with
``RINGBENCH_MERGE=triton``, CPU under TRITON_INTERPRET=1); :func:`merge_step`, :func:`add_step`
and :func:`add_steps` take the arguments of their torch counterparts in ``merge.py`` and compute
the same thing (float32 arithmetic, one rounding to the result's dtype), which
``tests/test_merge_gpu.py`` checks on many shapes and dtypes on a GPU, and
``tests/test_merge_interpret.py`` under the interpreter.

A launch walks "work rows": the block's rows when the result is updated in place, else every
row of the result (rows outside the block are carried over, cast). Each program takes
``BLOCK_M`` (row, head) pairs of one batch entry and the whole head dim.

Source: issue 15 (fused merge and cast).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor

#: Overrides the launch tile, as ``"LANES,WARPS"``: elements per program (``BLOCK_M`` (row, head)
#: pairs times the head dim padded to a power of two) and warps per program; for measuring other
#: tiles (``results/reference/2026-12-02-h200-strong/merge_bench.py``) without editing the code.
TILE_ENV = "RINGBENCH_MERGE_TILE"
LANES, WARPS = 4096, 4


@triton.jit
def _work_rows(pid, acc_map, blk_map, acc_off, blk_off, blk_len, n_work, H,
               HAS_ACC_MAP: tl.constexpr, HAS_BLK_MAP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program ``pid``'s batch entry and (row, head) pairs: (b, heads, in range, row of the result,
    row of the block, whether the block has that row)."""
    b = tl.program_id(1).to(tl.int64)
    m = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = m < n_work * H
    w = m // H
    h = m % H
    if HAS_ACC_MAP:
        arow = tl.load(acc_map + w, mask=mask, other=0).to(tl.int64)
    else:
        arow = (w + acc_off).to(tl.int64)
    if HAS_BLK_MAP:
        brow = tl.load(blk_map + w, mask=mask, other=-1).to(tl.int64)
    else:
        brow = (w - blk_off).to(tl.int64)
    valid = mask & (brow >= 0) & (brow < blk_len)
    brow = tl.where(valid, brow, 0)
    return b, h, mask, arow, brow, valid


@triton.jit
def _merge_kernel(acc, res, blk, lse, blse,
                  acc_sb, acc_ss, acc_sh, res_sb, res_ss, res_sh, blk_sb, blk_ss, blk_sh,
                  lse_sb, lse_sh, lse_ss, blse_sb, blse_sh, blse_ss,
                  acc_map, blk_map, acc_off, blk_off, blk_len, n_work, H, D,
                  HAS_ACC_MAP: tl.constexpr, HAS_BLK_MAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    b, h, mask, arow, brow, valid = _work_rows(tl.program_id(0), acc_map, blk_map, acc_off, blk_off, blk_len,
                                               n_work, H, HAS_ACC_MAP, HAS_BLK_MAP, BLOCK_M)
    la = tl.load(lse + b * lse_sb + h * lse_sh + arow * lse_ss, mask=mask, other=float("-inf"))
    lb = tl.load(blse + b * blse_sb + h * blse_sh + brow * blse_ss, mask=valid, other=float("-inf"))
    diff = lb - la
    weight = 1.0 / (1.0 + tl.exp(-diff))
    weight = tl.where(diff != diff, 0.0, weight)  # both -inf: the block adds nothing
    hi = tl.maximum(la, lb)
    lo = tl.minimum(la, lb)
    new_lse = tl.where(hi == float("-inf"), float("-inf"), hi + tl.log(1.0 + tl.exp(lo - hi)))
    d = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (d[None, :] < D)
    v2 = valid[:, None] & (d[None, :] < D)
    a = tl.load(acc + b * acc_sb + arow[:, None] * acc_ss + h[:, None] * acc_sh + d[None, :],
                mask=m2, other=0.0).to(tl.float32)
    x = tl.load(blk + b * blk_sb + brow[:, None] * blk_ss + h[:, None] * blk_sh + d[None, :],
                mask=v2, other=0.0).to(tl.float32)
    wt = weight[:, None]
    # torch.lerp's two forms: the one that keeps the nearer end exact.
    merged = tl.where(wt < 0.5, a + wt * (x - a), x - (x - a) * (1.0 - wt))
    out = tl.where(v2, merged, a)
    tl.store(res + b * res_sb + arow[:, None] * res_ss + h[:, None] * res_sh + d[None, :],
             out.to(res.dtype.element_ty), mask=m2)
    tl.store(lse + b * lse_sb + h * lse_sh + arow * lse_ss, new_lse, mask=valid)


@triton.jit
def _add_job(pid, acc, res, g,
             acc_sb, acc_ss, acc_sh, res_sb, res_ss, res_sh, g_sb, g_ss, g_sh,
             acc_map, blk_map, acc_off, blk_off, blk_len, n_work, H, D,
             HAS_ACC: tl.constexpr, HAS_GRAD: tl.constexpr,
             HAS_ACC_MAP: tl.constexpr, HAS_BLK_MAP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``pid`` of one add job: ``res[rows] = acc[rows] + g`` (float32, one rounding)."""
    b, h, mask, arow, brow, valid = _work_rows(pid, acc_map, blk_map, acc_off, blk_off, blk_len, n_work, H,
                                               HAS_ACC_MAP, HAS_BLK_MAP, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m2 = mask[:, None] & (d[None, :] < D)
    total = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if HAS_ACC:
        total += tl.load(acc + b * acc_sb + arow[:, None] * acc_ss + h[:, None] * acc_sh + d[None, :],
                         mask=m2, other=0.0).to(tl.float32)
    if HAS_GRAD:
        v2 = valid[:, None] & (d[None, :] < D)
        total += tl.load(g + b * g_sb + brow[:, None] * g_ss + h[:, None] * g_sh + d[None, :],
                         mask=v2, other=0.0).to(tl.float32)
    tl.store(res + b * res_sb + arow[:, None] * res_ss + h[:, None] * res_sh + d[None, :],
             total.to(res.dtype.element_ty), mask=m2)


# One launch runs up to three add jobs (a backward step's dq, dk and dv). The jobs' programs are laid
# end to end along axis 0 (job 0's first ``P0``, then job 1's ``P1``, then job 2's), so a job with fewer
# rows (dk and dv have the K/V heads) launches no idle programs; a job's arguments are _add_job's
# twenty runtime values and four flags.
@triton.jit
def _adds_kernel(a0, r0, g0, a0_sb, a0_ss, a0_sh, r0_sb, r0_ss, r0_sh, g0_sb, g0_ss, g0_sh,
                 am0, bm0, ao0, bo0, bl0, nw0, H0, D0,
                 a1, r1, g1, a1_sb, a1_ss, a1_sh, r1_sb, r1_ss, r1_sh, g1_sb, g1_ss, g1_sh,
                 am1, bm1, ao1, bo1, bl1, nw1, H1, D1,
                 a2, r2, g2, a2_sb, a2_ss, a2_sh, r2_sb, r2_ss, r2_sh, g2_sb, g2_ss, g2_sh,
                 am2, bm2, ao2, bo2, bl2, nw2, H2, D2, P0, P1,
                 ACC0: tl.constexpr, GRAD0: tl.constexpr, AMAP0: tl.constexpr, BMAP0: tl.constexpr,
                 ACC1: tl.constexpr, GRAD1: tl.constexpr, AMAP1: tl.constexpr, BMAP1: tl.constexpr,
                 ACC2: tl.constexpr, GRAD2: tl.constexpr, AMAP2: tl.constexpr, BMAP2: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    if pid < P0:
        _add_job(pid, a0, r0, g0, a0_sb, a0_ss, a0_sh, r0_sb, r0_ss, r0_sh, g0_sb, g0_ss, g0_sh,
                 am0, bm0, ao0, bo0, bl0, nw0, H0, D0, ACC0, GRAD0, AMAP0, BMAP0, BLOCK_M, BLOCK_D)
    elif pid < P0 + P1:
        _add_job(pid - P0, a1, r1, g1, a1_sb, a1_ss, a1_sh, r1_sb, r1_ss, r1_sh, g1_sb, g1_ss, g1_sh,
                 am1, bm1, ao1, bo1, bl1, nw1, H1, D1, ACC1, GRAD1, AMAP1, BMAP1, BLOCK_M, BLOCK_D)
    else:
        _add_job(pid - P0 - P1, a2, r2, g2, a2_sb, a2_ss, a2_sh, r2_sb, r2_ss, r2_sh, g2_sb, g2_ss, g2_sh,
                 am2, bm2, ao2, bo2, bl2, nw2, H2, D2, ACC2, GRAD2, AMAP2, BMAP2, BLOCK_M, BLOCK_D)


def _dense_last(t: Tensor) -> Tensor:
    # The kernels read the head dim with stride 1.
    return t if t.stride(-1) == 1 else t.contiguous()


def _inverse(rows: Tensor, n_rows: int) -> Tensor:
    inv = torch.full((n_rows,), -1, dtype=torch.int32, device=rows.device)
    inv[rows] = torch.arange(rows.numel(), dtype=torch.int32, device=rows.device)
    return inv


def _work(rows, n_rows: int, n_block: int, in_place: bool, inv: Tensor | None, device):
    """(n_work, acc_map, blk_map, acc_off, blk_off) of a launch; maps are tensors or None."""
    if isinstance(rows, slice):
        start, stop, step = rows.indices(n_rows)
        if step != 1 or stop - start != n_block:
            raise ValueError(f"rows {rows} must be a step-1 slice of {n_block} rows")
        return (n_block, None, None, start, 0) if in_place else (n_rows, None, None, 0, start)
    if in_place:
        return rows.numel(), rows, None, 0, 0
    return n_rows, None, inv if inv is not None else _inverse(rows, n_rows), 0, 0


def _tile(D: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, num_warps)``: the whole head dim and as many (row, head) pairs as fill
    :data:`LANES` elements, on :data:`WARPS` warps (or ``$RINGBENCH_MERGE_TILE``'s)."""
    lanes, warps = LANES, WARPS
    if os.environ.get(TILE_ENV):
        lanes, warps = (int(x) for x in os.environ[TILE_ENV].split(","))
    block_d = triton.next_power_of_2(D)
    return max(1, min(128, lanes // block_d)), block_d, warps


def _dummy(device) -> Tensor:
    return torch.empty(1, dtype=torch.int32, device=device)


def merge_step(out: Tensor, lse: Tensor, rows, block_out: Tensor, block_lse: Tensor, *,
               into: torch.dtype, inv: Tensor | None = None) -> Tensor:
    """``merge.merge_step`` in one Triton launch (same arguments and result)."""
    B, S, H, D = out.shape
    block_out, out = _dense_last(block_out), _dense_last(out)
    in_place = out.dtype == into
    res = out if in_place else torch.empty(out.shape, dtype=into, device=out.device)
    n_block = block_out.shape[1]
    n_work, acc_map, blk_map, acc_off, blk_off = _work(rows, S, n_block, in_place, inv, out.device)
    if n_work == 0:
        return res
    block_m, block_d, warps = _tile(D)
    grid = (triton.cdiv(n_work * H, block_m), B)
    dummy = _dummy(out.device)
    _merge_kernel[grid](
        out, res, block_out, lse, block_lse,
        out.stride(0), out.stride(1), out.stride(2), res.stride(0), res.stride(1), res.stride(2),
        block_out.stride(0), block_out.stride(1), block_out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), block_lse.stride(0), block_lse.stride(1), block_lse.stride(2),
        acc_map if acc_map is not None else dummy, blk_map if blk_map is not None else dummy,
        acc_off, blk_off, n_block, n_work, H, D,
        HAS_ACC_MAP=acc_map is not None, HAS_BLK_MAP=blk_map is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=warps)
    return res


def _add_job_args(acc: Tensor | None, rows, grad: Tensor | None, into: torch.dtype,
                  shape: tuple[int, ...] | None, inv: Tensor | None):
    """``(result, job)`` of one add: ``job`` is ``None`` when no launch is needed (``result``
    is then final), else ``(runtime args, flags, (B, H, D, n_work))`` for :func:`_add_job`."""
    like = acc if acc is not None else grad
    if acc is not None:
        acc = _dense_last(acc)
        shape = tuple(acc.shape)
    if grad is not None:
        grad = _dense_last(grad)
    B, S, H, D = shape
    in_place = acc is not None and acc.dtype == into
    res = acc if in_place else torch.empty(shape, dtype=into, device=like.device)
    if grad is None and in_place:
        return res, None
    n_block = grad.shape[1] if grad is not None else 0
    if grad is None:  # a cast of every row
        n_work, acc_map, blk_map, acc_off, blk_off = S, None, None, 0, 0
    else:
        n_work, acc_map, blk_map, acc_off, blk_off = _work(rows, S, n_block, in_place, inv, like.device)
    if n_work == 0:
        return res, None
    dummy = _dummy(like.device)
    a = acc if acc is not None else res
    g = grad if grad is not None else res
    args = (a, res, g, a.stride(0), a.stride(1), a.stride(2), res.stride(0), res.stride(1), res.stride(2),
            g.stride(0), g.stride(1), g.stride(2),
            acc_map if acc_map is not None else dummy, blk_map if blk_map is not None else dummy,
            acc_off, blk_off, n_block, n_work, H, D)
    flags = (acc is not None, grad is not None, acc_map is not None, blk_map is not None)
    return res, (args, flags, (B, H, D, n_work))


def add_step(acc: Tensor | None, rows, grad: Tensor | None, *, into: torch.dtype,
             shape: tuple[int, ...] | None = None, inv: Tensor | None = None) -> Tensor:
    """``merge.add_step`` in one Triton launch (same arguments and result)."""
    return add_steps([(acc, rows, grad, into, shape, inv)])[0]


def add_steps(jobs) -> list[Tensor]:
    """``merge.add_steps``: up to three adds in one Triton launch (their results, in order)."""
    if len(jobs) > 3:
        raise ValueError(f"add_steps takes at most 3 adds per launch, not {len(jobs)}")
    results, launched = [], []
    for job in jobs:
        res, plan = _add_job_args(*job)
        results.append(res)
        if plan is not None:
            launched.append(plan)
    if not launched:
        return results
    B = launched[0][2][0]
    if any(p[2][0] != B for p in launched):
        raise ValueError("the adds of one launch must share the batch size")
    # The widest job sets the tile; each job masks its own head dim and rows.
    block_m, block_d, warps = _tile(max(p[2][2] for p in launched))
    programs = [triton.cdiv(p[2][3] * p[2][1], block_m) for p in launched]
    # Unused job slots repeat the last job's arguments and get no programs.
    slots = (launched + [launched[-1]] * 3)[:3]
    counts = (programs + [0, 0])[:3]
    args = [a for p in slots for a in p[0]]
    flags = {f"{name}{i}": flag for i, p in enumerate(slots)
             for name, flag in zip(("ACC", "GRAD", "AMAP", "BMAP"), p[1])}
    _adds_kernel[(sum(counts), B)](*args, counts[0], counts[1], **flags, BLOCK_M=block_m, BLOCK_D=block_d,
                                   num_warps=warps)
    return results
