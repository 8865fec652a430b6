"""Attention calls replayed from CUDA graphs, for the Hugging Face adapter (``hf.register(..., cuda_graph=True)``).

A model calls each attention layer with the same shapes step after step, and at a few thousand
tokens per rank a ring's launches cost more than the GPU work they feed (issue 25). PyTorch's
``torch.cuda.make_graphed_callables`` captures one call's forward and backward as two CUDA graphs
and gives back a drop-in callable whose forward and backward replay them. :class:`GraphedCalls`
keeps one such callable per layer and shape, made on the first call of that shape, and runs the
call eagerly, saying why once (a ``RuntimeWarning`` and :attr:`GraphedCalls.reasons`), where
none can be made: off CUDA, or where the capture raises.

What a graphed layer asks of the training loop:

- one forward per backward, per layer: a replay overwrites the output and the saved state of the
  layer's previous forward, which its backward still needs (no two forwards of a layer before
  one backward; activation checkpointing's recompute is such a second forward);
- every rank of the group calls the same layers in the same order, as a training step does: the
  capture's warm-up calls and every replay communicate;
- memory: each layer's graphs keep their own pool (the call's activations and buffers) for as
  long as the model lives.

Source: issue 25, item 1 (replay in the HF adapter when the shapes repeat); PyTorch's CUDA
graphs notes (partial-network capture, ``make_graphed_callables``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, Hashable

import torch

Tensor = torch.Tensor


class GraphedCalls:
    """One graphed callable per (layer, key), or the reason the calls of that key run eagerly.

    Args:
        label: names the calls in a warning (the implementation's name).

    Attributes:
        reasons: why calls ran eagerly, each once, in the order first met.
    """

    def __init__(self, label: str):
        self.label = label
        self.reasons: list[str] = []
        # layer -> {key: the graphed callable, or why there is none}; a layer's graphs go with it.
        self._by_layer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def captured(self) -> int:
        """How many (layer, key) calls replay from graphs."""
        return sum(not isinstance(g, str) for per in self._by_layer.values() for g in per.values())

    def __call__(self, layer: object, key: Hashable, fn: Callable[..., Tensor], *args: Tensor) -> Tensor:
        """``fn(*args)``, replayed from the graphs of ``(layer, key)`` where they can be made.

        Args:
            layer: the calling module (any weak-referenceable object): each layer has its own
                graphs, since a replay overwrites the state its last forward saved.
            key: everything of the call that is not a tensor of ``args`` (shapes, dtypes,
                ``requires_grad``, the call's options): a new key captures anew.
            fn: the call, ``fn(*args) -> out``; differentiable in ``args``.
            args: its tensors, on one device.

        Returns:
            ``out``, which a replay backs with the graph's memory (the next forward of this
            layer and key overwrites it).
        """
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in args)):
            return fn(*args)  # no backward to replay: evaluation or inference runs eagerly
        if args[0].device.type != "cuda":
            return self._eager(f"{args[0].device.type} has no CUDA graphs", fn, args)
        graphs = self._by_layer.setdefault(layer, {})
        if key not in graphs:
            graphs[key] = _capture(fn, args)
        graphed = graphs[key]
        return self._eager(graphed, fn, args) if isinstance(graphed, str) else graphed(*args)

    def _eager(self, reason: str, fn: Callable[..., Tensor], args: tuple) -> Tensor:
        if reason not in self.reasons:
            self.reasons.append(reason)
            warnings.warn(f"{self.label} runs its attention eagerly: {reason}", RuntimeWarning, stacklevel=3)
        return fn(*args)


def _capture(fn: Callable[..., Tensor], args: tuple) -> Callable[..., Tensor] | str:
    """``make_graphed_callables`` on copies of ``args`` (the sample inputs it keeps as its
    static ones), or why it raised."""
    samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in args)
    try:
        return torch.cuda.make_graphed_callables(fn, samples)
    except Exception as exc:  # noqa: BLE001 - any capture failure leaves the calls eager, with the reason
        torch.cuda.synchronize()
        return f"the capture raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
