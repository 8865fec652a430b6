"""ringbench's variants as Hugging Face transformers attention implementations.

``register("zigzag", group=cp_group)`` registers ``ringbench_zigzag`` through transformers'
attention registry (``AttentionInterface``; on releases with ``AttentionMaskInterface`` also a
mask function, so no full-size mask is built). A model set to that implementation runs each
attention layer as the variant over the context-parallel group: every rank feeds its share of
the tokens (``ringbench.adapters.cp.shard_batch``). Works with transformers 4.48 and later;
needs transformers: ``pip install -e '.[hf]'`` in the checkout.

Each layer's own sliding window and sinks reach the variant: the ``sliding_window`` that
transformers passes a layer (Mistral, Qwen2, gpt-oss's banded layers) becomes the variant's
``window``, and gpt-oss's ``s_aux`` (the layer's learnable sink logits) its ``sink``, whose
gradient reaches the model's sink parameter.

With ``register(..., cuda_graph=True)`` each layer's attention replays its forward and backward
from CUDA graphs once a shape repeats (``ringbench/adapters/graphed.py``, which says what that asks
of the training loop); off by default.

Only the training-style forward over whole sharded rows is supported: causal attention, no
padding mask (pack documents instead), no KV cache, no dropout or softcap; each of these, and a
window or sink the variant cannot take, raises ``ValueError`` rather than give a wrong result.
"""

from __future__ import annotations

from typing import Callable

import torch

from ringbench.adapters.cp import ShardedBatch, all_reduce_grads, causal_lm_loss, shard_batch
from ringbench.adapters.graphed import GraphedCalls
from ringbench.variants import get_variant, names
from ringbench.variants.engines import varlen
from ringbench.variants.engines.sinks import apply_sink, local_sink_grad
from ringbench.variants.kernels import as_kernel, get_kernel
from ringbench.variants.kernels.common import window_band
from ringbench.errors import install_hint

__all__ = ["register", "register_single", "register_reference", "use_attention", "shard_batch", "ShardedBatch",
           "causal_lm_loss", "all_reduce_grads", "PREFIX", "implementation_name"]

#: Every implementation this module registers is named by :func:`implementation_name`, after this prefix.
PREFIX = "ringbench_"


def implementation_name(*parts: str) -> str:
    """``ringbench_<parts joined by _>``, with ``flash`` written ``fa``: transformers takes any
    implementation whose name holds "flash" for a FlashAttention build and tries to import one
    (seen with 5.17 and 5.24), so ``torch-flash`` becomes ``torch-fa`` in a name."""
    return PREFIX + "_".join(parts).replace("flash", "fa")
MISSING = f"the Hugging Face adapter needs transformers; install it with {install_hint('hf')}"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(MISSING) from None
    return transformers


def _register(name: str, attention: Callable) -> None:
    """Register ``attention`` (and, where the API exists, a mask function that builds no mask) as ``name``."""
    transformers = _transformers()
    interface = getattr(transformers, "AttentionInterface", None)
    if interface is not None:
        interface.register(name, attention)
    else:  # releases before AttentionInterface keep a plain dict
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS[name] = attention
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is not None:
        masks.register(name, _no_mask)


PADDING = ("attention_mask has padding (zeros), which ringbench attention cannot honour; pack the documents into "
           "one row with cu_seqlens instead of padding")


def _no_mask(*args, attention_mask=None, **kwargs):
    """Mask function: the variants apply the causal and document masks themselves, so no mask is
    built; a padding mask cannot be honoured and is refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(PADDING)
    return None


def _refuse_padding(attention_mask) -> None:
    """Releases without a mask registry hand over a 4-D mask of the local tokens; anything but the
    plain causal one (padding, a custom mask) would be ignored, so it is refused."""
    if attention_mask is None or attention_mask.dim() != 4:
        return
    blocked = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
    rows, cols = (torch.arange(n, device=blocked.device) for n in blocked.shape[-2:])
    causal = cols[None, :] > rows[:, None]  # some releases add key columns past the last query
    if not torch.equal(blocked, causal.expand_as(blocked)):
        raise ValueError(PADDING)


def _refuse_unsupported(module, query, key, dropout, kwargs, attention_mask=None) -> None:
    _refuse_padding(attention_mask)
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"query has {query.shape[2]} tokens and key {key.shape[2]}; ringbench attention runs a "
                         "whole sharded row without a KV cache, so call the model without past_key_values")
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} is not supported by ringbench attention; set the config's "
                         "attention_dropout to 0")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"softcap {kwargs['softcap']} is not supported by ringbench attention; use a model "
                         "without softcap")


def _window(kwargs) -> int:
    """The layer's causal sliding window in keys (transformers' ``sliding_window``: query p sees keys
    p - L + 1 .. p), 0 for a layer without one."""
    window = kwargs.get("sliding_window")
    return int(window) if window else 0


class _GroupShare(torch.autograd.Function):
    """The identity, whose gradient is the incoming one over the group's size.

    A variant returns ``d sink`` summed over the group, the same on every rank; the training
    loop then sums every parameter's gradient over the group (:func:`all_reduce_grads`), so each
    rank hands the sink parameter its 1/W share, and the sum counts the gradient once.
    """

    @staticmethod
    def forward(ctx, sink, size: int):
        ctx.size = size
        return sink.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None


def _causal(module, is_causal) -> bool:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise ValueError("non-causal attention is not wired up in the ringbench adapter; use a causal decoder")
    return True


def _cu_seqlens(kwargs) -> torch.Tensor | None:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    # The same tensor (what ShardedBatch.model_inputs passes) needs no comparison, which would
    # read the device at every layer.
    if cu_q is not None and cu_k is not None and cu_q is not cu_k and not torch.equal(cu_q, cu_k):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ; ringbench attention takes one set of global "
                         "document offsets for both")
    return cu_q if cu_q is not None else cu_k


def register(variant: str, *, group=None, kernel: str = "auto", cuda_graph: bool = False, **options) -> str:
    """Register ``variant`` as the transformers attention implementation ``ringbench_<variant>``.

    The implementation receives query ``[B, Hq, S/W, D]`` and key/value ``[B, Hkv, S/W, D]``
    (this rank's share, in the variant's layout) and returns ``(out [B, S/W, Hq, D], None)``.
    Packed documents (varlen variants, B = 1) come as the forward keyword ``cu_seq_lens_q``:
    the global int32 offsets ``[N + 1]``, the same on every rank (``ShardedBatch.model_inputs``).
    A layer's ``sliding_window`` (an int, keys) is passed as the variant's ``window``, and
    ``s_aux`` (``[Hq]``, gpt-oss's sink logits, a parameter of the layer) as its ``sink``: the
    parameter's gradient on each rank is 1/W of the group's, so summing the gradients over the
    group (:func:`all_reduce_grads`) gives the whole. Registering the same variant again replaces
    the earlier binding.

    With ``cuda_graph=True``, a layer's call in a training step (grad enabled) on CUDA replays
    from graphs made by ``torch.cuda.make_graphed_callables`` on its first call of each shape,
    one pair per layer (``ringbench/adapters/graphed.py``: one forward per backward per layer,
    the graphs' memory held). Where none can be made (off CUDA, a capture that raises) the
    layer runs eagerly and warns once with the reason; the registered function's ``graphs``
    attribute (a ``GraphedCalls``: ``captured``, ``reasons``) says which. Off by default.

    Args:
        variant: a ringbench variant name (``zigzag``, ``llama3_varlen``...).
        group: the context-parallel process group (default: the world).
        kernel: the local attention kernel (``auto``, ``torch-flash``, ``cpu``...).
        cuda_graph: replay each layer's attention from CUDA graphs (above); not for the varlen
            variants, whose documents change from batch to batch while a graph fixes them.
        **options: the variant's options, such as ``layout`` or ``heads_k_stride`` (llama3); not
            ``window``, which each layer brings.

    Returns:
        The name to pass as ``attn_implementation``.

    Raises:
        ValueError: an unknown variant or kernel, an option the variant does not take (``window``
            included), a variant that needs a session around the step (torch_cp), a
            ``cuda_graph`` that is not a bool or is given a varlen variant; at a call, a window or
            sink the variant cannot take.
        ImportError: transformers is not installed.
    """
    v = get_variant(variant)
    if v.session:
        raise ValueError(f"{variant} needs its own context held around the whole training step "
                         f"(forward and backward), which the adapter does not hold; register a ringbench variant "
                         f"such as zigzag")
    if kernel != "auto":
        get_kernel(kernel)
    if "window" in options:
        raise ValueError(f"window {options['window']} is not an option of register, since each layer brings its own "
                         "window (the sliding_window transformers passes it, from the model's config); drop window= "
                         "and set the config's sliding_window")
    allowed = set(v.keywords)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"option {unknown[0]!r} is not one {variant} takes; it takes "
                         f"{', '.join(sorted(allowed)) or 'no options'}")
    if not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph {cuda_graph!r} is not True or False; pass cuda_graph=True to replay each "
                         "layer's attention from CUDA graphs, or leave it out")
    if cuda_graph and v.varlen:
        raise ValueError(f"cuda_graph=True does not go with {variant}: a graph fixes the documents of the batch it "
                         "captured, and packed batches change them; leave cuda_graph out for a varlen variant")
    attention_fn = v.attention
    graphs = GraphedCalls(implementation_name(variant)) if cuda_graph else None

    def attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=None,
                  **kwargs):
        _refuse_unsupported(module, query, key, dropout, kwargs, attention_mask)
        causal = _causal(module, is_causal)
        cu_seqlens = _cu_seqlens(kwargs)
        if v.varlen and cu_seqlens is None:
            raise ValueError(f"{variant} attends packed documents, but the forward got no cu_seq_lens_q; pass "
                             "ShardedBatch.model_inputs(), which carries the global document offsets")
        if not v.varlen and cu_seqlens is not None:
            raise ValueError(f"{variant} is a batch variant and takes no packed documents; register a varlen "
                             "variant such as zigzag_varlen")
        window, sink = _window(kwargs), kwargs.get("s_aux")
        if window and not v.takes_window:
            raise ValueError(f"this layer has a sliding window of {window} keys, which {variant} cannot take; "
                             f"register {names(lambda x: x.takes_window and not x.session)}")
        if sink is not None and not v.sink:
            raise ValueError(f"this layer has attention sinks (s_aux), which {variant} cannot take; register "
                             f"{names(lambda x: x.sink and not x.session)}")
        q, k, val = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        # Every layer gets the same offsets tensor: the first one checks it, the others reuse
        # the prepared documents and their schedules (varlen.prepare).
        extra = {"cu_seqlens": varlen.prepare(cu_seqlens, q.shape[1], group)} if v.varlen else {}
        if window:
            extra["window"] = window
        tensors = (q, k, val)
        if sink is not None:
            tensors += (_GroupShare.apply(sink, torch.distributed.get_world_size(group)),)

        def call(q, k, v, *sink):
            return attention_fn(q, k, v, causal=causal, softmax_scale=scaling, group=group, kernel=kernel,
                                **options, **extra, **({"sink": sink[0]} if sink else {}))[0]

        if graphs is None:
            return call(*tensors), None
        # What the graph fixes besides the tensors' values: their layout and the call's options.
        graph_key = (tuple((t.shape, t.dtype, t.requires_grad) for t in tensors), causal, scaling, window)
        return graphs(module, graph_key, call, *tensors), None

    attention.graphs = graphs
    name = implementation_name(variant)
    _register(name, attention)
    return name


class _KernelAttention(torch.autograd.Function):
    """One kernel over the whole sequence (or packed row), differentiable; no context parallelism.

    Under a sliding window (``band``, the kernels' ``(left, right)``) and with a sink (``[Hq]``
    logits, or ``None``) it is what verify's single device runs: the sink joins each row once
    (``apply_sink``), the kernel's backward takes the row's out and lse with the sink, and
    ``d sink`` is :func:`local_sink_grad`.
    """

    @staticmethod
    def forward(ctx, q, k, v, sink, kernel, causal, scale, cu_seqlens, band):
        kw = {"window": band} if band else {}
        if cu_seqlens is None:
            out, lse = kernel.forward(q, k, v, causal, scale, **kw)
            ctx.varlen = None
        else:
            n = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out, lse = kernel.forward_varlen(q, k, v, cu_seqlens, cu_seqlens, n, n, causal, scale, **kw)
            ctx.varlen = (cu_seqlens, cu_seqlens, n, n)
        if sink is not None:
            out, lse = apply_sink(out, lse, sink.detach())
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.kernel, ctx.causal, ctx.scale, ctx.kw = kernel, causal, scale, kw
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        if ctx.varlen is None:
            dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, **ctx.kw)
        else:
            dq, dk, dv = ctx.kernel.backward_varlen(dout, q, k, v, out, lse, *ctx.varlen, ctx.causal, ctx.scale,
                                                    **ctx.kw)
        dsink = local_sink_grad(dout, out, lse, sink).to(sink.dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None, None, None


def register_single(kernel: str = "auto") -> str:
    """Register whole-sequence attention through one kernel, no context parallelism, as
    ``ringbench_single_<kernel>`` (see :func:`implementation_name`): the single-device side of a model
    check, as verify's single device runs it (:class:`_KernelAttention`; the ground truth is
    :func:`register_reference`). Same contract as :func:`register`, on unsharded rows, each
    layer's window and sinks included.

    Raises:
        ValueError: an unknown kernel.
        ImportError: transformers is not installed.
    """
    if kernel != "auto":
        get_kernel(kernel)

    def attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=None,
                  **kwargs):
        _refuse_unsupported(module, query, key, dropout, kwargs, attention_mask)
        causal = _causal(module, is_causal)
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        cu_seqlens, window = _cu_seqlens(kwargs), _window(kwargs)
        kern = as_kernel(kernel, q.device.type, q.dtype, head_dim=q.shape[-1], varlen=cu_seqlens is not None,
                         window=bool(window))
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        return _KernelAttention.apply(q, k, v, kwargs.get("s_aux"), kern, causal, scale, cu_seqlens,
                                      window_band(window)), None

    name = implementation_name("single", kernel)
    _register(name, attention)
    return name


def register_reference() -> str:
    """Register the ground truth of a model check as ``ringbench_reference``: whole-sequence
    attention through autograd of the ``math`` kernel's plain-torch forward, meant for a float64
    model. A layer's sliding window is the kernel's band, and its sinks (``s_aux``) join each
    row by ``L = logaddexp(lse, s_h)``, ``out * exp(lse - L)``, so neither the kernels' backward
    nor the engines' sink identities (``sinks.py``) enter the gradients it gives. Same contract
    as :func:`register_single`.

    Raises:
        ImportError: transformers is not installed.
    """
    math = get_kernel("math")

    def attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=None,
                  **kwargs):
        _refuse_unsupported(module, query, key, dropout, kwargs, attention_mask)
        causal = _causal(module, is_causal)
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        cu_seqlens, band = _cu_seqlens(kwargs), window_band(_window(kwargs))
        kw = {"window": band} if band else {}
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        if cu_seqlens is None:
            out, lse = math.forward(q, k, v, causal, scale, **kw)
        else:
            n = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out, lse = math.forward_varlen(q, k, v, cu_seqlens, cu_seqlens, n, n, causal, scale, **kw)
        sink = kwargs.get("s_aux")
        if sink is not None:
            total = torch.logaddexp(lse, sink.to(lse.dtype)[None, :, None])
            out = out * torch.exp(lse - total).transpose(1, 2).unsqueeze(-1).to(out.dtype)
        return out, None

    name = implementation_name("reference")
    _register(name, attention)
    return name


def use_attention(model, name: str) -> None:
    """Switch a loaded model to the registered attention implementation ``name``."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older releases read the config at every forward
        model.config._attn_implementation = name
