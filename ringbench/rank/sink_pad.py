"""Verify's side of attention sinks and padded packed documents (issue 19).

The contract verify holds a variant to:

- **sink** (``spec.sink``): every row's softmax has the head's sink logit in its denominator,
  once. The variant returns ``out_f`` and ``L = logaddexp(lse, s_h)``; a learnable sink's
  gradient (``d sink``, ``[Hq]``) is one more check entry, ``dsink``, judged by the max rule
  (it is computed by the engine from out and dout, not by a kernel call, so it has no
  block-decomposition reference).
- **padding** (``spec.doc_pad``): every document of real length n is padded at its end to a
  multiple of ``doc_pad``, and the variant sees the padded documents (so its layout cuts the
  padded lengths). Under the causal mask no real token sees a padding token. verify zeroes the
  padding rows of the variant's output (:func:`zero_padding`, inside autograd, so every
  gradient that flows from them is zero too): padding rows' out, dq, dk and dv must be 0,
  their lse is don't-care and left out of the lse check.

The float64 reference never sees the padding: it runs on the real tokens alone (documents of
the real lengths) and puts its results back at their padded positions. With a sink it is
autograd through the math kernel's plain-torch forward and ``L = logaddexp(lse, s)``,
``out_f = out * exp(lse - L)``, so its dq, dk, dv and d sink do not rest on the identities the
engines use (``variants/engines/sinks.py``). The single-device run is the case's kernel over the
padded row, with the sink and the padding applied as verify applies them to the variant.

A window or a mask (``spec.window``, ``spec.mask``) reaches both references through
:func:`row_keywords`, as for a case without a sink: the sink joins each row after the mask, once.

- **bias** (``spec.bias``): both references take the case's ``Bias`` over every position (a
  ``PositionBias`` of the whole row, :func:`bias_keywords`). The float64 reference adds it inside
  the math kernel's plain-torch forward and takes ``d bias`` by autograd through it, so the
  kernels' own ``d bias`` (the scores' gradient summed over the bias's broadcast dimensions) is not
  assumed; the single device's ``d bias`` is the case's kernel's. A learnable bias's gradient is
  one more check entry, ``dbias``, judged by the max rule (the engines add it up from the kernels'
  calls and reduce it over the ranks; the block decomposition does not rebuild it).
"""

from __future__ import annotations

import torch

from ringbench.rank.setup import CaseSetup, Results
from ringbench.variants.engines import bands, layouts, masked, masks
from ringbench.variants.kernels import KERNELS
from ringbench.variants.kernels.common import Bias, PositionMask, window_band
from ringbench.variants.engines.sinks import apply_sink, local_sink_grad

Tensor = torch.Tensor


def keep_mask(case: CaseSetup, device) -> Tensor | None:
    """Bool ``[S]`` over the padded packed row: True at real tokens, False at padding; ``None``
    without ``doc_pad``."""
    if not case.spec.doc_pad or case.docs is None:
        return None
    keep = torch.zeros(sum(case.docs), dtype=torch.bool)
    start = 0
    for real, padded in zip(case.real_docs, case.docs):
        keep[start:start + real] = True
        start += padded
    return keep.to(device)


def zero_padding(out: Tensor, keep: Tensor) -> Tensor:
    """``out`` ``[B, S, H, D]`` with the rows where ``keep`` ``[S]`` is False set to 0
    (differentiable: their gradient is 0)."""
    return out * keep.to(out.dtype)[None, :, None, None]


def real_rows(lse: Tensor, keep: Tensor | None) -> Tensor:
    """The real rows of a global ``lse`` ``[B, H, S]`` (all of them without padding; a tensor
    of another length is returned as it is, so its shape check fails)."""
    if keep is None or lse.shape[-1] != keep.shape[0]:
        return lse
    return lse[..., keep]


def band_keywords(window: int | None) -> dict:
    """The kernel keywords of a case's causal sliding window of ``window`` keys (``window_band``), or none."""
    return {"window": window_band(window)} if window else {}


def row_keywords(causal: bool, window: int | None, mask: str, seqlen: int, device,
                 docs: list[int] | None = None) -> tuple[bool, dict]:
    """The ``causal`` flag and kernel keywords of one call over a whole sequence of ``seqlen`` tokens
    under a case's window or mask: the window's band (:func:`band_keywords`), or the mask's dense
    ``[seqlen, seqlen]`` block of every position, from the slices of ``masks.build`` (with packed
    documents, ``masks.documents``: the mask inside each document, its positions re-based to 0,
    and every cross-document pair masked, so the call is the batch form over the packed row; then
    ``causal`` is False: the mask alone decides). The one place verify's whole-row calls get either.

    Args:
        causal: the case's causal flag; window: its window in keys (0 or ``None``: none).
        mask: its mask's canonical text (``""``: none), taken by the mask-taking kernels (math).
        seqlen: the sequence's tokens; device: where the mask's positions live.
        docs: the packed documents' lengths, or ``None`` (batch form).

    Raises:
        ValueError: a mask ``masks.build`` refuses at ``seqlen`` (``masks.documents`` at ``docs``).
    """
    if not mask:
        return causal, band_keywords(window)
    every = torch.arange(seqlen, device=device)
    built = masks.over(mask, seqlen, docs)
    return False, {"mask": PositionMask(every, every, built.allows, mask, dense=masked.dense_mask(built, device))}


def row_kernel(kernel, kw: dict, mask: str, seqlen: int, docs=None) -> tuple:
    """The kernel of a whole-row call under ``mask`` (its text, ``""``: none) and its keywords:
    ``kernel`` and ``kw`` (from :func:`row_keywords`) as they are, or for a kernel that takes
    windows but no mask (``Kernel.by_slices``) ``masked.Sliced`` over the row, the window calls
    of the mask's slices, and no keywords; ``docs`` as in :func:`row_keywords`."""
    if not mask or not kernel.by_slices:
        return kernel, kw
    row = [bands.Run(0, 0, 1, seqlen)]
    return masked.Sliced(kernel, masks.over(mask, seqlen, docs), row, row), {}


def bias_keywords(bias: Bias | None, seqlen: int, device) -> dict:
    """The kernel keyword of a whole-row call under ``bias``: its block over every position, or none."""
    if bias is None:
        return {}
    every = torch.arange(seqlen, device=device)
    return {"bias": bias.at(every, every)}


def single_row(kernel, inputs, cu_seqlens: Tensor | None, causal: bool, scale: float, sink: Tensor | None,
               keep: Tensor | None, window: int = 0, mask: str = "", bias: Bias | None = None) -> Results:
    """out, lse, dq, dk, dv and d sink (or ``None``) of ``kernel`` on one device over the whole
    (padded) row, under the case's sliding window (``window`` keys, 0: none) or mask (``mask``,
    its text: :func:`row_keywords`), the sink and padding applied as verify applies them to the
    variant. Shapes and dtypes are the inputs'; lse is ``[B, Hq, S]`` float32 (float64 for
    float64 inputs); d sink ``[Hq]`` in the sink's dtype; with a learnable ``bias``, d bias in its
    values' shape and dtype."""
    q, k, v, dout = inputs
    docs = None if cu_seqlens is None else [b - a for a, b in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:])]
    causal, kw = row_keywords(causal, window, mask, q.shape[1], q.device, docs if mask else None)
    kernel, kw = row_kernel(kernel, kw, mask, q.shape[1], docs if mask else None)
    if mask:  # the documents are in the mask: the batch form over the packed row
        cu_seqlens = None
    if bias is not None:
        bias = bias.with_values(bias.values.detach())
        kw = {**kw, **bias_keywords(bias, q.shape[1], q.device)}
    if cu_seqlens is None:
        out, lse = kernel.forward(q, k, v, causal, scale, **kw)
    else:
        n = max(b - a for a, b in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:]))
        out, lse = kernel.forward_varlen(q, k, v, cu_seqlens, cu_seqlens, n, n, causal, scale, **kw)
    if sink is not None:
        out, lse = apply_sink(out, lse, sink.detach())
        out = out.to(q.dtype)
    if keep is not None:
        out, dout = zero_padding(out, keep), zero_padding(dout, keep)
    if bias is not None and bias.learnable:
        bias.open_grad(bias.values.dtype)
    if cu_seqlens is None:
        grads = kernel.backward(dout, q, k, v, out, lse, causal, scale, **kw)
    else:
        grads = kernel.backward_varlen(dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, n, n, causal, scale, **kw)
    dsink = None
    if sink is not None and sink.requires_grad:
        dsink = local_sink_grad(dout, out, lse, sink.detach()).to(sink.dtype)
    dbias = bias.close_grad() if bias is not None and bias.learnable else None
    return Results(out, lse, *grads, dsink=dsink, dbias=dbias)


def reference_fp64(inputs, real_docs: list[int] | None, causal: bool, scale: float, sink: Tensor | None,
                   keep: Tensor | None, window: int = 0, mask: str = "", bias: Bias | None = None) -> Results:
    """out, lse, dq, dk, dv and d sink (or ``None``) in float64 on the real tokens alone, put
    back at their padded positions (zeros at padding rows; lse 0 there, never compared).

    Args:
        inputs: the global q, k, v, dout (any float dtype; taken in float64).
        real_docs: the documents' real lengths (varlen), or ``None`` (batch form).
        causal, scale: the mask and the softmax scale.
        sink: ``[Hq]`` sink logits, or ``None``.
        keep: :func:`keep_mask`, or ``None``.
        window: the causal sliding window in keys (0: none), applied within each real document:
            padding sits at a document's end, so a real token's window over the padded document
            holds the same real keys.
        mask: any mask's canonical text (``masks.py``; ``""``: none), as its dense boolean
            ``[S, S]`` block over the batch form (then ``causal`` is ignored); with ``real_docs``,
            applied inside each document over the packed row (``masks.documents``).
        bias: the case's attention bias (``kernels.common.Bias``), or ``None``: added to the
            scores over every position, its gradient (a learnable one's) by autograd.

    Returns:
        :class:`Results` in float64: out ``[B, S, Hq, Dv]``, lse ``[B, Hq, S]`` (with the sink:
        ``logaddexp(lse, s_h)``), dq, dk, dv as q, k, v, d sink ``[Hq]`` for a sink that
        requires grad, and d bias for a learnable bias.

    Raises:
        ValueError: a mask ``masks.build`` refuses at the sequence's length, or
            ``masks.documents`` at the documents.
    """
    math = KERNELS["math"]
    q, k, v, dout = (x.double() for x in inputs)
    if keep is not None:
        q, k, v, dout = (x[:, keep] for x in (q, k, v, dout))
    # With a mask the documents are in it (masks.documents): the batch form over the packed row.
    cu = layouts.cu_seqlens_from_docs(real_docs, device=q.device) if real_docs is not None and not mask else None
    n = max(real_docs) if real_docs is not None else 0
    causal, kw = row_keywords(causal, window, mask, q.shape[1], q.device, real_docs)

    def forward(q, k, v):
        if cu is None:
            return math.forward(q, k, v, causal, scale, **kw)
        return math.forward_varlen(q, k, v, cu, cu, n, n, causal, scale, **kw)

    bias64 = None
    if bias is not None:
        values = bias.values.detach().double().clone().requires_grad_(bias.learnable)
        bias64 = bias.with_values(values)
        kw = {**kw, **bias_keywords(bias64, q.shape[1], q.device)}
    if sink is None and bias is None:
        out, lse = forward(q, k, v)
        grads = (math.backward(dout, q, k, v, out, lse, causal, scale, **kw) if cu is None else
                 math.backward_varlen(dout, q, k, v, out, lse, cu, cu, n, n, causal, scale, **kw))
        found = [out, lse, *grads, None]
    else:
        # Autograd through the plain-torch math forward: no sink or bias identity is assumed.
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out, lse = forward(*leaves)
        big, s = lse, None
        if sink is not None:
            s = sink.detach().double().clone().requires_grad_(sink.requires_grad)
            big = torch.logaddexp(lse, s[None, :, None])
            out = out * torch.exp(lse - big).transpose(1, 2).unsqueeze(-1)
        (out * dout).sum().backward()
        found = [out.detach(), big.detach(), *(x.grad for x in leaves), s.grad if s is not None else None]
        if bias64 is not None and bias64.learnable:
            found.append(bias64.values.grad)
    if keep is None:
        return Results(*found)
    real = keep.nonzero().flatten()
    for i, dim in ((0, 1), (1, 2), (2, 1), (3, 1), (4, 1)):
        t = found[i]
        shape = list(t.shape)
        shape[dim] = keep.shape[0]
        found[i] = torch.zeros(shape, dtype=t.dtype, device=t.device).index_copy_(dim, real, t)
    return Results(*found)


def shadow_with_extras(shadow: Results, terms: list[int], sink: Tensor | None,
                       keep: Tensor | None) -> tuple[Results, list[int]]:
    """The block-decomposition reference with the sink and padding applied as to the variant.

    The sink is one more partial result of each row (``out = 0``, ``lse = s_h``), merged in
    float64, so out and lse count one more term; padding rows of out are zeroed.
    """
    out, lse = shadow.out, shadow.lse
    terms = list(terms)
    if sink is not None:
        out, lse = apply_sink(out, lse, sink.detach().double())
        terms[0] += 1
        terms[1] += 1
    if keep is not None:
        out = zero_padding(out, keep)
    return shadow._replace(out=out, lse=lse), terms


def _dbias_given(inputs, case: CaseSetup, out: Tensor, lse: Tensor, bias: Bias) -> Tensor:
    # The math kernel's d bias, in float64, of q, k, v, dout = inputs given out and lse.
    q, k, v, dout = (x.double() for x in inputs)
    b = bias.with_values(bias.values.detach().double())
    causal, kw = row_keywords(case.causal, case.spec.window, case.spec.mask, q.shape[1], q.device)
    b.open_grad(torch.float64)
    KERNELS["math"].backward(dout, q, k, v, out.double(), lse.double(), causal, case.scale,
                             **kw, **bias_keywords(b, q.shape[1], q.device))
    return b.close_grad()


def dbias_terms(inputs, case: CaseSetup, out: Tensor, lse: Tensor, bias: Bias) -> Tensor:
    """An upper bound, per element of ``d bias``, of the sum of its terms' magnitudes
    ``|p * (dout . v - dout . out)|`` over the broadcast dimensions, in float64: the kernel's
    ``d bias`` of ``|dout|, |v|`` with ``out`` 0 (``sum p |dout| . |v|``) minus that of ``|dout|, |out|``
    with ``v`` 0 (``-sum p |dout| . |out|``), both with the same ``p``."""
    q, k, v, dout = inputs
    dout, v = dout.double().abs(), v.double()
    upper = _dbias_given((q, k, v.abs(), dout), case, torch.zeros_like(out, dtype=torch.float64), lse, bias)
    lower = _dbias_given((q, k, torch.zeros_like(v), dout), case, out.double().abs(), lse, bias)
    return upper - lower


def implied_dbias(inputs, case: CaseSetup, out: Tensor, lse: Tensor, bias: Bias) -> Tensor:
    """The ``d bias`` a result's own ``out`` and ``lse`` imply, in float64: the math kernel's backward
    over every position given them (with a sink, ``out_f`` and ``L``, whose backward is exact as it is
    for dq, dk, dv), the inputs and the bias taken in float64.

    ``d bias`` sums the scores' gradients ``p * (dout . v - dout . out)`` over the bias's broadcast
    dimensions (every query row and head for ``111s``): each one carries the rounding of ``out`` to
    the input dtype, and the variant and the single device round in other orders, so in bf16 the
    two are independent draws that the single device's does not bound. Each is held to what its
    own ``out`` and ``lse`` imply, while the out and lse checks hold those to the float64 reference
    (as ``d sink`` is, :func:`references`).
    """
    return _dbias_given(inputs, case, out, lse, bias)


def references(kernel, inputs, case: CaseSetup, cu_seqlens: Tensor | None, sink: Tensor | None,
               keep: Tensor | None, gathered: Results, shadow, bias: Bias | None = None):
    """verify's single-device run, float64 reference and block-decomposition reference of a case
    with a sink or padding; the lse of each, and of ``gathered``, keeps its real rows only.

    Args:
        kernel: the case's kernel; inputs: the global q, k, v, dout.
        case, cu_seqlens, sink, keep: the case, its padded offsets (or ``None``), its sink
            logits (or ``None``) and :func:`keep_mask`.
        bias: the case's attention bias (``None``: none), for both references.
        gathered: the variant's global :class:`Results`.
        shadow: ``check._shadow``'s :class:`check.Shadow`, its tensors gathered, or ``None``.

    Returns:
        ``(gathered, single, ref, shadow, implied)``: ``gathered`` with its lse's real rows,
        ``single`` and ``ref`` :class:`Results` (with d sink, or ``None``), ``shadow`` with
        the sink and padding applied (or ``None``). ``implied["dsink"]`` (absent without a learnable sink) is
        what ``d sink`` is judged against, since ``d sink = -sum_rows exp(s_h - L) <dout, out_f>``
        sums S * D roundings of ``out_f`` that the variant and the single device make in
        different orders: against float64 each one's error is an independent draw, which the
        single device's draw does not bound (stripe, W=4, bf16, 256 tokens: 2.2x in one seed of
        six, 0.8-1.2x in the others). So each is held to the ``d sink`` its own ``out_f``, ``L``
        and dout imply, computed in float64, while the out and lse checks hold those to the
        float64 reference:

        - ``"variant"``, ``"single"``: ``[Hq]`` float64, implied by the gathered variant's and by
          the single device's out and lse;
        - ``"floor"``: the accumulation's error floor, ``eps`` of the sink's dtype times the
          largest over the heads of the sum of its terms' magnitudes.

        ``implied["dbias"]``, for a learnable bias, holds ``d bias`` the same way
        (:func:`implied_dbias`), its floor ``eps`` of the bias's dtype times the largest sum of
        its terms' magnitudes (:func:`dbias_terms`).
    """
    window, mask = case.spec.window, case.spec.mask
    single = single_row(kernel, inputs, cu_seqlens, case.causal, case.scale, sink, keep, window, mask, bias)
    ref = reference_fp64(inputs, case.real_docs, case.causal, case.scale, sink, keep, window, mask, bias)
    implied = {}
    if ref.dsink is not None:
        rows = slice(None) if keep is None else keep
        dout, s = inputs[3].double()[:, rows], sink.detach().double()

        def grad_of(out, lse):
            return local_sink_grad(dout, out.double()[:, rows], lse.double()[..., rows], s)

        terms = local_sink_grad(dout.abs(), ref.out[:, rows].abs(), ref.lse[..., rows], s).abs()
        implied["dsink"] = {"variant": grad_of(gathered.out, gathered.lse), "single": grad_of(single.out, single.lse),
                            "floor": torch.finfo(sink.dtype).eps * float(terms.max())}
    if ref.dbias is not None:
        implied["dbias"] = {"variant": implied_dbias(inputs, case, gathered.out, gathered.lse, bias),
                            "single": implied_dbias(inputs, case, single.out, single.lse, bias),
                            "floor": torch.finfo(bias.values.dtype).eps
                            * float(dbias_terms(inputs, case, ref.out, ref.lse, bias).max())}
    if shadow is not None:
        tensors, terms = shadow_with_extras(shadow.tensors, shadow.terms, sink, keep)
        shadow = shadow._replace(tensors=tensors._replace(lse=real_rows(tensors.lse, keep)), terms=terms)
    gathered, single, ref = (t._replace(lse=real_rows(t.lse, keep)) for t in (gathered, single, ref))
    return gathered, single, ref, shadow, implied
