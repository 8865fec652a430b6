"""The kernels that need no GPU library: ``math`` (ringbench's own torch ops, on any device and in
float64 too, the reference the other kernels are checked against) and ``cpu`` (PyTorch's CPU
flash op), each in the batch and the varlen (packed documents) form of the contract in :mod:`kernels`.

Under a window both work in tiles of query rows (:func:`band_tile`), each against only the keys
its band reaches (:func:`band_keys`), so a windowed call costs about its band, not its block.
The math kernel also takes a :class:`~.common.PositionMask` (``mask=``): its dense boolean block,
applied tile by tile; and a :class:`~.common.PositionBias` (``bias=``): its dense block added to
the scaled scores tile by tile, its backward adding the gradient of the scores, summed over the
bias's broadcast dimensions, into the bias's open gradient (``Bias.open_grad``).
"""

from __future__ import annotations

import math

import torch

from .max_logit import MaxLogit
from .common import (PositionBias, PositionMask, Window, _check_shapes, _check_varlen, accumulation_dtype, band_mask,
                     band_of, check_bias, check_mask, merge_)

Tensor = torch.Tensor


# --------------------------------------------------------------------------- math

def _bias_block(bias: PositionBias | None, q: Tensor, k: Tensor) -> Tensor | None:
    # [Bb, Hkv or 1, G or 1, Sq or 1, Sk] in the accumulation dtype: the grouped heads' layout of the scores.
    if bias is None:
        return None
    check_bias(bias, q, k)
    block = bias.dense(accumulation_dtype(q.dtype)).to(q.device)
    if block.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"the bias has batch {block.shape[0]}, but the call has {q.shape[0]}; pass a bias of "
                         "batch 1 or the call's")
    Hkv = k.shape[2]
    if block.shape[1] == 1:
        return block.unsqueeze(2)
    return block.unflatten(1, (Hkv, q.shape[2] // Hkv))


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                  chunk: int = 1024, *, window=None, mask: PositionMask | None = None,
                  bias: PositionBias | None = None, max_logit: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    # max_logit: raised to each head's largest scaled, masked, biased score of this call (max_logit.py).
    added = _bias_block(bias, q, k)
    if mask is not None:
        _check_shapes(q, k, v, False)
        check_mask(mask, q, k, causal, window)
        return _math_forward_core(q, k, v, False, softmax_scale, chunk, seen=mask.dense(), added=added,
                                  peak=max_logit)
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    return _math_forward_core(q, k, v, causal, softmax_scale, chunk, band=band, added=added, peak=max_logit)


def _math_forward_core(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                       chunk: int = 1024, causal_offset: int = 0, band: Window | None = None,
                       seen: Tensor | None = None, added: Tensor | None = None,
                       peak: MaxLogit | None = None) -> tuple[Tensor, Tensor]:
    # causal: query row i sees key j iff j <= i + causal_offset (0: the square mask).
    # band (window): the mask is the band alone, aligned bottom-right (the docstring of kernels.py).
    # seen: bool [Sq, Sk], the mask alone (a PositionMask's dense block).
    # added: [Bb, Hkv|1, G|1, Sq|1, Sk], a bias added to the scaled scores (_bias_block).
    # peak: a MaxLogit of the call's Hq heads, raised by every tile's masked scores.
    B, Sq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    G = Hq // Hkv
    acc = accumulation_dtype(q.dtype)
    # [B, Hkv, G, S, D]: GQA without repeating K/V.
    qg = q.to(acc).reshape(B, Sq, Hkv, G, D).permute(0, 2, 3, 1, 4)
    kf = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    vf = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    out = torch.empty(B, Hkv, G, Sq, Dv, dtype=acc, device=q.device)
    lse = torch.empty(B, Hkv, G, Sq, dtype=acc, device=q.device)
    Sk = k.shape[1]
    for s, e, j0, j1 in _tiles(Sq, Sk, chunk, causal, causal_offset, band):
        scores = (qg[:, :, :, s:e] @ kf[:, :, :, j0:j1].transpose(-1, -2)) * softmax_scale
        if added is not None:
            scores = scores + _bias_tile(added, s, e, j0, j1)
        scores = _masked(scores, s, e, j0, j1, Sq, Sk, causal, causal_offset, band, seen)
        if peak is not None:
            peak.meet(scores)
        lse_c = torch.logsumexp(scores, dim=-1)  # -inf for a row that sees no key (none at all: j0 == j1)
        p = torch.exp(scores - lse_c.unsqueeze(-1).clamp_min(torch.finfo(acc).min))
        out[:, :, :, s:e] = p @ vf[:, :, :, j0:j1]
        lse[:, :, :, s:e] = lse_c
    out = out.permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, Dv).to(q.dtype)
    return out, lse.reshape(B, Hq, Sq)


def band_keys(s: int, e: int, sq: int, sk: int, band: Window) -> tuple[int, int]:
    """The keys ``(first, end)`` that query rows ``s .. e-1`` of a call of ``sq`` rows over ``sk``
    keys can see under ``band`` (bottom-right aligned: row i's diagonal key is ``i + sk - sq``);
    ``first == end`` when they see none."""
    left, right = band
    j0 = 0 if left is None else min(sk, max(0, s + sk - sq - left))
    j1 = sk if right is None else min(sk, max(0, e + sk - sq + right))
    return j0, max(j0, j1)


def band_tile(band: Window, chunk: int) -> int:
    """Query rows per tile under ``band``: half the window's width, so a tile meets about 1.5
    times the keys its rows need rather than the whole block (64 at least, ``chunk`` at most;
    on two CPU cores half the width ran faster than the whole width or a quarter)."""
    return chunk if band[0] is None else max(64, min(chunk, (band[0] + 1) // 2))


def _tiles(Sq: int, Sk: int, chunk: int, causal: bool, causal_offset: int, band: Window | None):
    """``(s, e, j0, j1)``: query rows s..e-1 and the only keys j0..j1-1 they can see, tile by tile;
    under a band in tiles of :func:`band_tile` rows, else in ``chunk`` rows."""
    tile = band_tile(band, chunk) if band is not None else chunk
    for s in range(0, Sq, tile):
        e = min(s + tile, Sq)
        if band is not None:
            yield (s, e, *band_keys(s, e, Sq, Sk, band))
        elif causal:  # the chunk's rows see no key past e - 1 + causal_offset
            yield s, e, 0, min(Sk, max(0, e + causal_offset))
        else:
            yield s, e, 0, Sk


def _bias_tile(added: Tensor, s: int, e: int, j0: int, j1: int) -> Tensor:
    # The bias of query rows s..e-1 against keys j0..j1-1 (its one row, broadcast, for a 111s bias).
    return added[..., j0:j1] if added.shape[-2] == 1 else added[..., s:e, j0:j1]


def _masked(scores: Tensor, s: int, e: int, j0: int, j1: int, Sq: int, Sk: int, causal: bool, causal_offset: int,
            band: Window | None, seen: Tensor | None = None) -> Tensor:
    """A tile's scores (query rows s..e-1 of Sq against keys j0..j1-1 of Sk) under the window
    ``band`` (aligned bottom-right), the causal mask shifted by ``causal_offset``, or the dense
    mask ``seen`` (bool ``[Sq, Sk]``)."""
    if seen is not None:
        return scores.masked_fill(~seen[s:e, j0:j1], -math.inf)
    if band is not None:
        seen = band_mask(e - s, j1 - j0, band, scores.device, row0=s + Sk - Sq - j0)
        return scores.masked_fill(~seen, -math.inf)
    if causal:
        rows = torch.arange(s, e, device=scores.device) + causal_offset
        keys = torch.arange(j0, j1, device=scores.device)
        return scores.masked_fill(keys[None, :] > rows[:, None], -math.inf)
    return scores


def _math_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   causal: bool, softmax_scale: float, chunk: int = 1024, *,
                   window=None, mask: PositionMask | None = None,
                   bias: PositionBias | None = None) -> tuple[Tensor, Tensor, Tensor]:
    added = _bias_block(bias, q, k)
    if mask is not None:
        _check_shapes(q, k, v, False)
        check_mask(mask, q, k, causal, window)
        grads = _math_backward_core(dout, q, k, v, out, lse, False, softmax_scale, chunk, seen=mask.dense(),
                                    added=added, learn=bias is not None and bias.bias.grad is not None)
    else:
        band = band_of(window, causal)
        _check_shapes(q, k, v, causal and band is None)
        grads = _math_backward_core(dout, q, k, v, out, lse, causal, softmax_scale, chunk, band=band, added=added,
                                    learn=bias is not None and bias.bias.grad is not None)
    if len(grads) == 4:  # d bias of this call, in the bias's own [Bb, Hb, Sq|1, Sk]
        dbias = grads[3]
        bias.add_grad(dbias.flatten(1, 2) if dbias.shape[1] * dbias.shape[2] > 1 else dbias.squeeze(2))
    return grads[:3]


def _math_backward_core(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        causal: bool, softmax_scale: float, chunk: int = 1024,
                        causal_offset: int = 0, band: Window | None = None,
                        seen: Tensor | None = None, added: Tensor | None = None, learn: bool = False) -> tuple:
    # added: the bias block (_math_forward_core); learn: also return its gradient, the scores'
    # gradient summed over the bias's broadcast dimensions, as a fourth tensor of added's shape.
    B, Sq, Hq, D = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    G = Hq // Hkv
    acc = accumulation_dtype(q.dtype)

    def grouped(x: Tensor) -> Tensor:
        return x.to(acc).reshape(B, x.shape[1], Hkv, G, x.shape[3]).permute(0, 2, 3, 1, 4)

    qg, dog, og = grouped(q), grouped(dout), grouped(out)
    lseg = lse.to(acc).reshape(B, Hkv, G, Sq)
    kf = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    vf = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    delta = (dog * og).sum(-1)  # [B, Hkv, G, Sq]
    dq = torch.empty_like(qg)
    dk = torch.zeros(B, Hkv, k.shape[1], D, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, k.shape[1], Dv, dtype=acc, device=q.device)
    Sk = k.shape[1]
    dadded = torch.zeros(added.shape, dtype=acc, device=q.device) if learn and added is not None else None
    for s, e, j0, j1 in _tiles(Sq, Sk, chunk, causal, causal_offset, band):
        kn, vn = kf[:, :, :, j0:j1], vf[:, :, :, j0:j1]
        scores = (qg[:, :, :, s:e] @ kn.transpose(-1, -2)) * softmax_scale
        if added is not None:
            scores = scores + _bias_tile(added, s, e, j0, j1)
        scores = _masked(scores, s, e, j0, j1, Sq, Sk, causal, causal_offset, band, seen)
        lse_c = lseg[:, :, :, s:e].unsqueeze(-1)
        p = torch.exp(scores - lse_c.clamp_min(torch.finfo(acc).min))
        dp = dog[:, :, :, s:e] @ vn.transpose(-1, -2)
        dscores = p * (dp - delta[:, :, :, s:e].unsqueeze(-1))  # the gradient of the biased scaled scores
        if dadded is not None:
            # Summed over the dimensions the bias broadcasts (batch, heads, query rows for 111s).
            dims = tuple(d for d in range(3) if dadded.shape[d] == 1 and dscores.shape[d] > 1)
            tile = dscores.sum(dims, keepdim=True) if dims else dscores
            if dadded.shape[-2] == 1:
                dadded[..., j0:j1] += tile.sum(-2, keepdim=True)
            else:
                dadded[..., s:e, j0:j1] += tile
        ds = dscores * softmax_scale
        dq[:, :, :, s:e] = ds @ kn
        dk[:, :, j0:j1] += (ds.transpose(-1, -2) @ qg[:, :, :, s:e]).sum(2)
        dv[:, :, j0:j1] += (p.transpose(-1, -2) @ dog[:, :, :, s:e]).sum(2)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(B, Sq, Hq, D)
    grads = dq.to(q.dtype), dk.permute(0, 2, 1, 3).to(k.dtype), dv.permute(0, 2, 1, 3).to(v.dtype)
    return grads if dadded is None else (*grads, dadded)


# --------------------------------------------------------------------------- cpu

def _cpu_mask(seen: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    # The CPU op takes an additive mask in q's dtype; it gives a row that sees no key out 0
    # and lse 0, so those rows are returned too, to be set to ringbench's -inf.
    mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, -math.inf)
    return mask, ~seen.any(-1)


def _cpu_op_forward(q, k, v, causal, softmax_scale, mask=None):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=softmax_scale)
    return out.transpose(1, 2), lse if q.dtype == torch.float64 else lse.float()


def _cpu_forward(q, k, v, causal, softmax_scale, *, window=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    if band is None:
        return _cpu_op_forward(q, k, v, causal, softmax_scale)
    # Under a window each tile of query rows meets only the keys its band reaches (band_keys),
    # so the work follows the window rather than the whole block.
    sq, sk = q.shape[1], k.shape[1]
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    lse = torch.full((q.shape[0], q.shape[2], sq), -math.inf, dtype=accumulation_dtype(q.dtype), device=q.device)
    for s in range(0, sq, band_tile(band, _CPU_TILE)):
        e = min(s + band_tile(band, _CPU_TILE), sq)
        j0, j1 = band_keys(s, e, sq, sk, band)
        if j1 == j0:
            continue  # rows that see no key: out 0, lse -inf
        mask, empty = _cpu_mask(band_mask(e - s, j1 - j0, band, q.device, row0=s + sk - sq - j0), q.dtype)
        o, l = _cpu_op_forward(q[:, s:e], k[:, j0:j1], v[:, j0:j1], False, softmax_scale, mask)
        if empty.any():
            o, l = o.masked_fill(empty[None, :, None, None], 0), l.masked_fill(empty, -math.inf)
        out[:, s:e], lse[:, :, s:e] = o, l
    return out, lse


def _cpu_op_backward(dout, q, k, v, out, lse, causal, softmax_scale, mask=None):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.transpose(1, 2), lse.contiguous(), 0.0, causal, attn_mask=mask, scale=softmax_scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _cpu_backward(dout, q, k, v, out, lse, causal, softmax_scale, *, window=None):
    band = band_of(window, causal)
    _check_shapes(q, k, v, causal and band is None)
    if band is None:
        return _cpu_op_backward(dout, q, k, v, out, lse, causal, softmax_scale)
    # The forward's tiles: a tile's dq whole, its dK/dV summed over the tiles that meet those keys.
    sq, sk = q.shape[1], k.shape[1]
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for s in range(0, sq, band_tile(band, _CPU_TILE)):
        e = min(s + band_tile(band, _CPU_TILE), sq)
        j0, j1 = band_keys(s, e, sq, sk, band)
        if j1 == j0:
            continue  # rows that see no key have no gradient
        mask, empty = _cpu_mask(band_mask(e - s, j1 - j0, band, q.device, row0=s + sk - sq - j0), q.dtype)
        tile_lse = lse[:, :, s:e].masked_fill(empty, math.inf)  # exp(-inf - inf) = 0 for the rows that see nothing
        g = _cpu_op_backward(dout[:, s:e], q[:, s:e], k[:, j0:j1], v[:, j0:j1], out[:, s:e], tile_lse, False,
                             softmax_scale, mask)
        dq[:, s:e] = g[0]
        dk[:, j0:j1] += g[1]
        dv[:, j0:j1] += g[2]
    return dq, dk.to(k.dtype), dv.to(v.dtype)


#: Query rows per tile of a windowed cpu call at most (band_tile takes about the window's width).
_CPU_TILE = 1024


# --------------------------------------------------------------------------- varlen

def _documents(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqlen_q: int,
               seqlen_k: int) -> list[tuple[int, int, int, int]]:
    """(first query row, end, first key row, end) of every document, the offsets checked."""
    bounds = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, seqlen_q), ("cu_seqlens_k", cu_seqlens_k, seqlen_k)):
        offsets = cu.tolist()
        if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"{name} {offsets[:4]}{'...' if len(offsets) > 4 else ''} ending at {offsets[-1]} "
                             f"does not run from 0, non-decreasing, to the {total} packed tokens; "
                             "fix the offsets")
        bounds.append(offsets)
    cq, ck = bounds
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _math_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    lse = torch.full((1, q.shape[2], q.shape[1]), -math.inf, dtype=accumulation_dtype(q.dtype), device=q.device)
    for qs, qe, ks, ke in _documents(cu_seqlens_q, cu_seqlens_k, q.shape[1], k.shape[1]):
        if qe > qs and ke > ks:
            o, l = _math_forward_core(q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], causal, softmax_scale,
                                      causal_offset=(ke - ks) - (qe - qs), band=band)
            out[:, qs:qe] = o
            lse[:, :, qs:qe] = l
    return out, lse


def _math_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal, softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, qe, ks, ke in _documents(cu_seqlens_q, cu_seqlens_k, q.shape[1], k.shape[1]):
        if qe > qs and ke > ks:
            g = _math_backward_core(dout[:, qs:qe], q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], out[:, qs:qe],
                                    lse[:, :, qs:qe], causal, softmax_scale,
                                    causal_offset=(ke - ks) - (qe - qs), band=band)
            dq[:, qs:qe], dk[:, ks:ke], dv[:, ks:ke] = g
    return dq, dk, dv


def _square_parts(lq: int, lk: int, causal: bool) -> list[tuple[slice, slice, bool]]:
    """One document's bottom-right-aligned attention as calls a square-causal kernel can make:
    (query rows, key rows, causal) with every causal part square."""
    if not causal:
        return [(slice(0, lq), slice(0, lk), False)]
    offset = lk - lq
    if offset < 0:  # the first -offset queries precede every key: no call, out 0, lse -inf
        return [(slice(-offset, lq), slice(0, lk), True)]
    parts = [(slice(0, lq), slice(offset, lk), True)]
    if offset:
        parts.append((slice(0, lq), slice(0, offset), False))  # keys before the query block: all seen
    return parts


def _cpu_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros_like(q)
    lse = torch.full((1, q.shape[2], q.shape[1]), -math.inf, dtype=acc, device=q.device)
    for qs, qe, ks, ke in _documents(cu_seqlens_q, cu_seqlens_k, q.shape[1], k.shape[1]):
        lq, lk = qe - qs, ke - ks
        if not (lq and lk):
            continue
        if band is not None:  # the window's mask takes a rectangular document as it is
            out[:, qs:qe], lse[:, :, qs:qe] = _cpu_forward(q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], False, softmax_scale,
                                                           window=band)
            continue
        parts = _square_parts(lq, lk, causal)
        qd, kd, vd = q[:, qs:qe], k[:, ks:ke], v[:, ks:ke]
        if len(parts) == 1 and parts[0][0] == slice(0, lq):
            out[:, qs:qe], lse[:, :, qs:qe] = _cpu_forward(qd, kd, vd, parts[0][2], softmax_scale)
            continue
        o_acc = torch.zeros(qd.shape, dtype=acc, device=q.device)
        l_acc = torch.full((1, q.shape[2], lq), -math.inf, dtype=acc, device=q.device)
        for rows, keys, c in parts:
            o, l = _cpu_forward(qd[:, rows], kd[:, keys], vd[:, keys], c, softmax_scale)
            merge_(o_acc[:, rows], l_acc[:, :, rows], o, l)
        out[:, qs:qe], lse[:, :, qs:qe] = o_acc, l_acc
    return out, lse


def _cpu_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         causal, softmax_scale, *, window=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    band = band_of(window, causal)
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for qs, qe, ks, ke in _documents(cu_seqlens_q, cu_seqlens_k, q.shape[1], k.shape[1]):
        if not (qe > qs and ke > ks):
            continue
        parts = _square_parts(qe - qs, ke - ks, causal) if band is None else [(slice(0, qe - qs), slice(0, ke - ks),
                                                                                False)]
        for rows, keys, c in parts:
            r = slice(qs + rows.start, qs + rows.stop)
            kk = slice(ks + keys.start, ks + keys.stop)
            g = _cpu_backward(dout[:, r], q[:, r], k[:, kk], v[:, kk], out[:, r], lse[:, :, r], c, softmax_scale,
                              window=band)
            dq[:, r] += g[0]
            dk[:, kk] += g[1]
            dv[:, kk] += g[2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
