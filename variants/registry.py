"""The variant registry: one :class:`Variant` record per context-parallel algorithm, plain data.

See the package docstring (``ringbench.variants``) for the contract every variant's ``attention`` keeps.
"""


from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .offers import SeqlenOffer
from .rules import (BIAS, HEADS_K_STRIDE, LAYOUT_CHUNKS, MASK, MAX_LOGIT, MAX_SEQLEN, OPTIONS, ROTATE_RULE, SINK, ULYSSES_DEGREE, WINDOW,
                    Option, document_rule, layouts, listed, mask_layouts, nearest_multiple, ulysses_rule)


def names(which: Callable[["Variant"], bool]) -> str:
    """The listed variants (test-only ones left out) for which ``which`` holds, as ``a, b or c``."""
    return listed((n for n, v in VARIANTS.items() if which(v)), "or")


@dataclass(frozen=True)
class Variant:
    """A registered context-parallel attention variant.

    Attributes:
        name: what users pass to ``--variant``.
        layout: how the global sequence maps to ranks (``contiguous``, ``zigzag`` or ``stripe``).
        target: ``"module:function"`` of its attention function, relative to this package.
        summary: one line for listings.
        causal, non_causal, gqa, varlen: what it supports; a varlen variant takes packed
            documents (``cu_seqlens``) and nothing else.
        shard_by_document: varlen only: every document is cut in ``layout`` on its own, so
            every document length must be a multiple of ``seqlen_multiple(W)``; otherwise the
            packed row is cut as one sequence and documents may straddle ranks.
        options: the options it takes beyond the common contract, name -> rule
            (``rules.OPTIONS``: ``sink``, ``layout`` with the layouts it takes, ``heads_k_stride``,
            ``rotate``, ``ulysses_degree``, ``window``, ``mask``, ``bias``); :meth:`check` refuses the others when set,
            and ``--help`` and the matrix read it too.
        devices: the device types it runs on; ``devices_reason`` says why not the others.
        kernels: the only kernels it runs with (peers bring their own, or name what serves
            their kernel calls); empty: any kernel.
        availability: ``"module:function"`` returning why it cannot run here, or ``None``
            (imports torch and its library); empty: always available.
        session: ``"module:function"`` taking ``(spec, group, device)`` and returning a context
            manager that the worker holds around a whole case (forward and backward).
        case_notes: ``"module:function"`` returning the notes a record of the case this process
            ran last should carry (rfa_*: what served the peer's kernel calls, noted while its
            ``session`` was held); empty: none.
        model_check: ``"module:function"`` returning why ``verify --model`` cannot check this
            variant here (rfa_*: the package's own Hugging Face adapter), or ``None``; empty:
            ringbench's adapter (``adapters.hf``) checks it, unless it has a ``session``. See
            :meth:`model_refusal`.
        expands_kv: it runs GQA by repeating K/V heads to the query heads; records say so.
        head_dim_v: it takes a value head dim apart from the query/key one (``head_dim_v``;
            then its kernel must too); False for peers whose code assumes one head dim.
        ulysses: ``""`` (no all-to-all), ``"world"`` (Ulysses over the whole group: ulysses,
            yc_ulysses) or ``"option"`` (Ulysses inside groups of ``ulysses_degree`` ranks, a
            ring across them: usp, yc_usp; the degree composes into the layout, see
            ``layouts``). Both refuse heads the degree cannot split (:func:`ulysses_rule`).
        peer: it runs another project's implementation, not ringbench's.
        emulates: one process can play each of its ranks in turn (``run --emulate``,
            ``instruments/emulation.py``): all its communication goes through ringbench's
            communicators (``engines/comm.py``: the ring's exchange, the all-gather,
            reduce-scatter, all-reduce and all-to-all, the Ulysses-ring grid's groups), which
            emulation replaces by device copies. ringbench's own variants do; the peers drive
            ``torch.distributed`` themselves and do not.
        traffic_counted: its bytes go through ringbench's counted communicators
            (``comm``), directly or under a counting ``session``; False where they cannot be
            seen (torch_cp: DTensor and functional collectives): records then say
            ``bytes_sent: null``, and no byte count refuses its timing.
    """

    name: str
    layout: str
    target: str
    summary: str
    causal: bool = True
    non_causal: bool = True
    gqa: bool = True
    varlen: bool = False
    shard_by_document: bool = False
    options: Mapping[str, Option] = field(default_factory=dict, hash=False)
    devices: tuple[str, ...] = ("cpu", "cuda")
    devices_reason: str = ""
    kernels: tuple[str, ...] = ()
    availability: str = ""
    session: str = ""
    case_notes: str = ""
    model_check: str = ""
    expands_kv: bool = False
    head_dim_v: bool = True
    peer: bool = False
    traffic_counted: bool = True
    emulates: bool = False
    ulysses: str = ""

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layouts it takes through its ``layout`` keyword beside its own."""
        return tuple(c for c in self.options["layout"].choices if c != self.layout) if "layout" in self.options else ()

    @property
    def sink(self) -> bool:
        """Its ``attention`` takes ``sink=``, a ``[Hq]`` tensor of sink logits, applied once per row
        with its gradient (``sinks.py``)."""
        return "sink" in self.options

    @property
    def takes_window(self) -> bool:
        """Its ``attention`` takes ``window=L``, a causal sliding window of L keys."""
        return "window" in self.options

    @property
    def keywords(self) -> tuple[str, ...]:
        """The options a caller passes to its ``attention`` as plain keywords (``layout``...)."""
        return tuple(n for n, o in self.options.items() if o.keyword)

    def ulysses_degree(self, world_size: int, degree: int = 0) -> int:
        """The Ulysses degree a case runs with, from its resolved ``ulysses_degree`` (see
        :meth:`resolve`): W (``ulysses="world"``), ``degree`` (``"option"``), else 1 (no all-to-all)."""
        if self.ulysses == "world":
            return world_size
        return degree if self.ulysses == "option" else 1

    def layout_degree(self, world_size: int, degree: int = 0) -> int:
        """The Ulysses degree composed into this variant's layout (``layouts``' ``ulysses_degree``):
        the resolved ``degree`` of an ``"option"`` variant, else 1 (a whole-group Ulysses shards
        contiguously)."""
        return degree if self.ulysses == "option" else 1

    def resolve(self, case: Mapping[str, Any]) -> dict[str, Any]:
        """The options this variant takes, as ``case`` (field -> value) runs them: each by its
        rule's resolver (``ulysses_degree`` 0 becomes the default degree). The one resolution."""
        return {name: rule.resolve(self, case.get(name, rule.unset), case) for name, rule in self.options.items()}

    def option_refusal(self, name: str, value: Any) -> str | None:
        """Why this variant refuses option ``name`` set to ``value`` because it does not declare
        it (``options``), in one sentence, or ``None``."""
        rule = OPTIONS[name]
        if name in self.options or not rule.given(self, value):
            return None
        return rule.refuse(self, value, [n for n, v in VARIANTS.items() if name in v.options])

    def seqlen_multiple(self, world_size: int, layout: str | None = None) -> int:
        """The number the global seqlen must be a multiple of at ``world_size`` (``balanced``: W)."""
        return LAYOUT_CHUNKS.get(layout or self.layout, 1) * world_size

    def check(self, *, seqlen: int, world_size: int, causal: bool, heads: int | None = None,
              kv_heads: int | None = None, **options: Any) -> str | None:
        """Return the one-sentence reason this variant refuses the case, or ``None``.

        ``options``: the case's option fields (``rules.OPTIONS``: ``layout``, ``window``...),
        unset where left out. An option it does not declare is refused when set; then each
        declared one's rule runs (``ulysses_degree`` -1 is ``auto``: one case per
        factorization, expanded by the harness), then the mask and the seqlen rules."""
        case = {"seqlen": seqlen, "world_size": world_size, "causal": causal, "heads": heads, "kv_heads": kv_heads,
                **options}
        for name in OPTIONS:
            reason = self.option_refusal(name, options.get(name, OPTIONS[name].unset))
            if reason:
                return reason
        if self.ulysses == "world" and heads is not None:
            reason = ulysses_rule(heads, kv_heads, world_size, self.name, world_size=world_size, whole=True)
            if reason:
                return reason
        for name in OPTIONS:
            rule = self.options.get(name)
            reason = rule.check(self, options.get(name, rule.unset), case) if rule else None
            if reason:
                return reason
        layout = options.get("layout") or self.layout
        if causal and not self.causal:
            return f"{self.name} does not support causal attention; pass --no-causal"
        if not causal and not self.non_causal:
            return f"{self.name} does not support non-causal attention; pass --causal"
        n = self.seqlen_multiple(world_size, layout)
        if seqlen % n:
            rule = f"2 * world_size = {n}" if LAYOUT_CHUNKS.get(layout, 1) == 2 else f"world_size = {n}"
            near = nearest_multiple(seqlen, n)
            which = self.name if layout == self.layout else f"{self.name} over the {layout} layout"
            refused = f"seqlen {seqlen} is not a multiple of {rule}, which {which} needs"
            if near:
                return SeqlenOffer(refused, lambda s: f"use {s}", near,
                                   "no multiple near it passes the case's other rules, so change one of its options")
            return (f"{refused}; no seqlen up to the limit of {MAX_SEQLEN} tokens is one, so pass a smaller "
                    "--world-size")
        return None

    def check_device(self, device: str) -> str | None:
        """Return why this variant cannot run on ``device`` (``cpu`` or ``cuda``), or ``None``."""
        if device in self.devices:
            return None
        where = "a machine with a CUDA GPU" if self.devices == ("cuda",) else f"device {self.devices[0]}"
        return f"{self.name} cannot run on {device}: {self.devices_reason}; run it on {where} with --device {self.devices[0]}"

    def check_kernel(self, kernel: str) -> str | None:
        """Return why this variant cannot run with the named ``kernel``, or ``None``."""
        if not self.kernels or kernel in self.kernels or kernel == "auto":
            return None
        return (f"kernel {kernel!r} is not one {self.name} runs with, since it brings its own attention calls; "
                f"pass --kernel {', '.join(self.kernels[:-1])} or {self.kernels[-1]}" if len(self.kernels) > 1
                else f"pass --kernel {self.kernels[0]}")

    def unavailable(self) -> str | None:
        """Why this variant cannot run on this machine (its library is missing), or ``None``.

        Imports torch and the variant's library; a failed import is reported, not raised.
        """
        if not self.availability:
            return None
        module, func = self.availability.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), func)()

    def notes(self, *, heads: int, kv_heads: int, ulysses_degree: int = 1) -> list[str]:
        """What a record of this variant should say about how it ran the case (``ulysses_degree``:
        the degree it ran with, :meth:`ulysses_degree`)."""
        notes = []
        if self.expands_kv and kv_heads != heads:
            notes.append(f"K/V expanded from {kv_heads} to {heads} heads before {self.name}, which has no native GQA")
        if self.ulysses and not self.expands_kv and ulysses_degree > kv_heads:
            notes.append(f"K/V heads replicated {ulysses_degree // kv_heads} times, from {kv_heads} to "
                         f"{ulysses_degree}, since the Ulysses degree {ulysses_degree} exceeds kv_heads (as DeepSpeed "
                         "does)")
        if self.case_notes:
            notes.extend(self._load(self.case_notes)())
        return notes

    def model_refusal(self) -> str | None:
        """Why ``verify --model`` cannot check this variant here, in one sentence, or ``None``: its
        ``model_check`` reason, else a ``session`` (torch_cp, the peers), which the adapter cannot hold
        around a training step (imports torch and the variant's library when ``model_check`` is set)."""
        reason = (self._load(self.model_check)() if self.model_check else None) or (
            "it needs its own context held around the whole training step (forward and backward), which the Hugging "
            "Face adapter does not hold" if self.session else None)
        return f"{self.name} cannot be checked with --model: {reason}; check its attention without --model" if reason else None

    def check_docs(self, docs, world_size: int) -> str | None:
        """Return why this variant refuses documents of lengths ``docs`` at ``world_size``, or ``None``.

        Only the per-document rule of document-sharded variants (``ring_varlen``: every length
        a multiple of W; ``zigzag_varlen``: of 2W); the sum and batch rules are the spec's.
        """
        if not self.varlen:
            return f"{self.name} is a batch variant and takes no documents; use a varlen variant or drop the documents"
        if self.shard_by_document:
            return document_rule(docs, world_size, self.layout, self.name)
        return None

    @property
    def attention(self) -> Callable:
        """The variant's attention function (imports its module, and so torch).

        Beyond the common contract it takes ``layout=`` when ``layouts`` is not empty, and
        each keyword named in ``options``.
        """
        return self._load(self.target)

    def open_session(self, spec, group, device):
        """The context manager the worker holds around one case (``contextlib.nullcontext``
        when the variant needs none)."""
        if not self.session:
            return contextlib.nullcontext()
        return self._load(self.session)(spec, group, device)

    def _load(self, target: str):
        module, func = target.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), func)

#: What ringbench's own engines take: a sink applied once per row, and a sliding window.
_OWN: dict[str, Option] = {"sink": SINK, "window": WINDOW}
#: What their batch forms take besides: any mask (``engines/masks.py``) and an attention bias
#: (``kernels.common.Bias``), block by block, and the per-head max logit (``kernels/max_logit.py``).
_BATCH: dict[str, Option] = {**_OWN, "mask": MASK, "bias": BIAS, "max_logit": MAX_LOGIT}
#: And their varlen forms: any mask, applied inside each packed document (``masks.documents``); no bias.
_VARLEN: dict[str, Option] = {**_OWN, "mask": MASK}

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("ring", "contiguous", "engines.ring:ring_attention",
                "basic ring: contiguous chunks, K/V passed around the ring; under a mask, --layout balanced "
                "gives each rank the chunks that even the mask's work (ptrr: PyTorch's processing-time round robin)",
                options={**_BATCH, "layout": mask_layouts("contiguous", "balanced", "ptrr")}, emulates=True),
        Variant("zigzag", "zigzag", "engines.zigzag:zigzag_attention",
                "ring over the zigzag layout, balanced under a causal mask", options=_BATCH, emulates=True),
        Variant("stripe", "stripe", "engines.stripe:stripe_attention",
                "ring over the stripe layout (token t on rank t mod W), balanced under a causal mask",
                options=_BATCH, emulates=True),
        Variant("llama3", "zigzag", "engines.llama3:llama3_attention",
                "all-gather K/V (in head groups), zigzag layout for causal balance",
                options={**_BATCH, "layout": layouts("zigzag", "contiguous"), "heads_k_stride": HEADS_K_STRIDE},
                emulates=True),
        Variant("ring_varlen", "contiguous", "engines.ring_varlen:ring_varlen_attention",
                "packed documents, each cut into W chunks, basic ring", varlen=True, shard_by_document=True,
                options=_VARLEN, emulates=True),
        Variant("zigzag_varlen", "zigzag", "engines.ring_varlen:zigzag_varlen_attention",
                "packed documents, each in the zigzag layout, ring balanced under a causal mask",
                varlen=True, shard_by_document=True, options=_VARLEN, emulates=True),
        Variant("llama3_varlen", "contiguous", "engines.llama3_varlen:llama3_varlen_attention",
                "packed documents, contiguous row (or balanced: each document cut head-tail), all-gather K/V; "
                "any document boundaries", varlen=True,
                options={**_VARLEN, "layout": layouts("contiguous", "balanced"), "heads_k_stride": HEADS_K_STRIDE},
                emulates=True),
        Variant("ulysses", "contiguous", "engines.ulysses:ulysses_attention",
                "DeepSpeed-Ulysses: all-to-all from sequence to head sharding, the kernel over the whole "
                "sequence for H/W heads, all-to-all back", ulysses="world", options=_BATCH, emulates=True),
        Variant("ulysses_varlen", "contiguous", "engines.ulysses:ulysses_varlen_attention",
                "packed documents, contiguous row, Ulysses all-to-all; the kernel takes the global "
                "cu_seqlens, any document boundaries", varlen=True, ulysses="world", options=_VARLEN, emulates=True),
        Variant("usp", "zigzag", "engines.usp:usp_attention",
                "USP: Ulysses inside groups of --ulysses-degree ranks, a zigzag ring across the groups",
                options={**_BATCH, "ulysses_degree": ULYSSES_DEGREE}, ulysses="option", emulates=True),
        Variant("usp_varlen", "zigzag", "engines.usp:usp_varlen_attention",
                "packed documents, each in the zigzag layout over the ring, Ulysses inside groups of "
                "--ulysses-degree ranks", varlen=True, shard_by_document=True, options={**_VARLEN, "ulysses_degree": ULYSSES_DEGREE},
                ulysses="option", emulates=True),
        Variant("torch_cp", "zigzag", "peers.torch_cp:torch_cp_attention",
                "peer: PyTorch's context_parallel around SDPA (head-tail balancing, all-gather or all-to-all "
                "rotation)", non_causal=False, options={"rotate": ROTATE_RULE}, devices=("cuda",),
                devices_reason="PyTorch's context parallel dispatches only its CUDA SDPA backends "
                               "(flash, efficient, cuDNN)",
                kernels=("torch-flash", "cudnn", "torch-efficient"), availability="peers.torch_cp:unavailable_reason",
                session="peers.torch_cp:session", expands_kv=True, peer=True, traffic_counted=False, head_dim_v=False),
        *(Variant(f"rfa_{name}", layout, f"peers.rfa:rfa_{name}_attention",
                  f"peer: ring-flash-attn's {func}; its flash-attn calls are served by the flash-attn package "
                  "where it is installed, else by ringbench's kernel (torch-flash on CUDA, cpu or math)",
                  varlen=varlen, non_causal=non_causal, kernels=("flash-attn", "torch-flash", "cpu", "math"),
                  availability="peers.rfa:varlen_unavailable_reason" if varlen else "peers.rfa:unavailable_reason", peer=True,
                  options={"heads_k_stride": HEADS_K_STRIDE} if varlen else {}, session="peers.rfa:session", case_notes="peers.rfa:served_notes",
                  model_check="peers.rfa:hf_adapter_unavailable_reason", head_dim_v=False)
          for name, layout, func, varlen, non_causal in (
              ("ring", "contiguous", "ring_flash_attn_func", False, True),
              ("zigzag", "zigzag", "zigzag_ring_flash_attn_func", False, False),
              ("stripe", "stripe", "stripe_flash_attn_func", False, False),
              ("llama3_varlen", "contiguous", "llama3_flash_attn_varlen_func", True, True))),
        *(Variant(f"yc_{name}", layout, f"peers.yunchang:yc_{name}_attention",
                  f"peer: yunchang's {what}; its flash-attn calls are served by the flash-attn package where "
                  "it is installed, else by ringbench's kernel (torch-flash on CUDA, cpu or math)",
                  options={"ulysses_degree": ULYSSES_DEGREE} if name == "usp" else {}, ulysses=ulysses,
                  kernels=("flash-attn", "torch-flash", "cpu", "math"), availability="peers.yunchang:unavailable_reason",
                  session="engines.comm:dist_session", head_dim_v=False, peer=True)
          for name, layout, ulysses, what in (
              ("ulysses", "contiguous", "world", "Ulysses all-to-all around its ring function at one rank"),
              ("ring", "zigzag", "", "zigzag ring (its basic ring without a causal mask)"),
              ("usp", "zigzag", "option", "USP (LongContextAttention's all-to-all and zigzag ring)"))),
    )
}

#: The environment variable that makes :func:`get_variant` find :data:`TESTING_VARIANTS`.
TESTING_ENV = "RINGBENCH_TEST_VARIANTS"

#: Test-only variants (``variants/fixtures/broken.py``): never listed, found only under ``TESTING_ENV=1``.
TESTING_VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("broken_merge", "contiguous", "fixtures.broken:broken_merge_attention",
                "test only: a ring whose merge drops the last block"),
        Variant("sink_every_block", "contiguous", "fixtures.broken:sink_every_block_attention",
                "test only: a ring that adds the sink to every block instead of once per row", options={"sink": SINK}),
        Variant("drift_dsink", "contiguous", "fixtures.broken:drift_dsink_attention",
                "test only: a ring whose d sink comes back rounded to the input dtype", options={"sink": SINK}),
        Variant("drift_out", "contiguous", "fixtures.broken:drift_out_attention",
                "test only: a ring that rounds the running output to the input dtype after every merge"),
        Variant("drift_dq", "contiguous", "fixtures.broken:drift_dq_attention",
                "test only: a ring that accumulates dq in the input dtype"),
        Variant("drift_dkv", "contiguous", "fixtures.broken:drift_dkv_attention",
                "test only: a ring whose dK/dV accumulate in the input dtype on their way to their owner"),
        Variant("drift_usp_out", "zigzag", "fixtures.broken:drift_usp_out_attention",
                "test only: USP whose ring rounds the running output to the input dtype after every merge",
                options={"ulysses_degree": ULYSSES_DEGREE}, ulysses="option"),
        Variant("drift_usp_dq", "zigzag", "fixtures.broken:drift_usp_dq_attention",
                "test only: USP whose ring accumulates dq in the input dtype",
                options={"ulysses_degree": ULYSSES_DEGREE}, ulysses="option"),
        Variant("band_one_row", "contiguous", "fixtures.broken:band_one_row_attention",
                "test only: a ring whose window drops every band part of one query row", options={"window": WINDOW}),
        Variant("window_off_by_one", "zigzag", "fixtures.broken:window_off_by_one_attention",
                "test only: zigzag whose window lets every query see one key more than the window", options=_OWN),
        Variant("mask_local_only", "contiguous", "fixtures.broken:mask_local_only_attention",
                "test only: a ring whose mask cuts only its own K/V's blocks and takes received blocks as full",
                options={"mask": MASK}),
        Variant("mask_not_rebased", "contiguous", "fixtures.broken:mask_not_rebased_attention",
                "test only: ring_varlen whose mask is laid over the packed row, cut at the documents but not "
                "re-based to each one's start", varlen=True, shard_by_document=True, options={"mask": MASK}),
        Variant("bias_local_only", "contiguous", "fixtures.broken:bias_local_only_attention",
                "test only: a ring whose calls on received K/V blocks take no bias", options={"bias": BIAS, "mask": MASK}),
        Variant("dbias_unreduced", "contiguous", "fixtures.broken:dbias_unreduced_attention",
                "test only: a ring whose d bias is each rank's share alone, never summed over the ranks",
                options={"bias": BIAS, "mask": MASK}),
        Variant("max_logit_local_only", "contiguous", "fixtures.broken:max_logit_local_only_attention",
                "test only: a ring whose max logit is each rank's own, never reduced over the ranks",
                options={"max_logit": MAX_LOGIT, "mask": MASK, "bias": BIAS}),
        Variant("fault_hang", "contiguous", "fixtures.broken:fault_hang_attention",
                "test only: rank W-1 sleeps forever inside attention"),
        Variant("fault_raise", "contiguous", "fixtures.broken:fault_raise_attention",
                "test only: rank 1 raises RuntimeError"),
        Variant("fault_oom", "contiguous", "fixtures.broken:fault_oom_attention",
                "test only: every rank runs out of memory (simulated on CPU)"),
        Variant("fault_unavailable", "contiguous", "engines.ring:ring_attention",
                "test only: a variant whose library is never available",
                availability="fixtures.broken:never_available"),
        Variant("fault_silent", "contiguous", "fixtures.broken:fault_silent_attention",
                "test only: local attention, never communicates"),
        Variant("plain_dist_peer", "contiguous", "fixtures.broken:plain_dist_attention",
                "test only: a peer-like all-gather through its own torch.distributed calls, counted "
                "by its session", session="engines.comm:dist_session", peer=True),
        Variant("uncounted_peer", "contiguous", "engines.ring:ring_attention",
                "test only: the ring, declared as a peer whose traffic cannot be seen",
                peer=True, traffic_counted=False),
        Variant("jitter_ring", "contiguous", "fixtures.broken:jitter_ring_attention",
                "test only: the ring, whose dq moves by a rounding at every backward (never bitwise repeatable)"),
    )
}


def testing_variants_enabled() -> bool:
    """Whether the test-only variants are reachable (``RINGBENCH_TEST_VARIANTS=1``)."""
    return os.environ.get(TESTING_ENV) == "1"


def get_variant(name: str) -> Variant:
    """Return the variant registered as ``name`` (a test-only one too under ``RINGBENCH_TEST_VARIANTS=1``).

    Raises:
        ValueError: when none is; the message lists the user-facing variants.
    """
    variant = VARIANTS.get(name)
    if variant is None and testing_variants_enabled():
        variant = TESTING_VARIANTS.get(name)
    if variant is None:
        raise ValueError(f"variant {name!r} is unknown; choose one of "
                         f"{', '.join(list_variants())}")
    return variant


def list_variants() -> list[str]:
    """Names of the user-facing variants, in registry order (never the test-only ones)."""
    return list(VARIANTS)
