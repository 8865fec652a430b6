"""End-to-end check of a model under context parallelism: loss and every parameter gradient.

Every rank builds the same randomly initialised model (``ringbench.case.models``, the case's seed)
and the same random tokens. Each attention layer brings its own sliding window and sinks
(transformers passes ``sliding_window`` and gpt-oss's ``s_aux``), which every run below honours.
Three runs on the same tokens:

- reference: float64, no context parallelism, attention through autograd of the ``math``
  kernel's plain-torch forward (``hf.register_reference``);
- single: the case's dtype, no context parallelism, attention through the case's kernel over
  the whole sequence;
- variant: the case's dtype, the variant over the group, through the Hugging Face adapter
  (sharded ids, positions and labels; the group-wide loss; gradients summed over the group).

Each tensor (the loss, then each parameter's gradient) goes through ``tolerance.tolerance_check``, the rule
of every verify case. The references are computed on rank 0 only, independently of the
adapter's sharding helpers (plain next-token cross-entropy over the whole row).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ringbench.adapters import cp, hf
from ringbench.rank.setup import case_setup
from ringbench.rank.tolerance import tolerance_check
from ringbench.case.models import load_model
from ringbench.case.spec import CaseSpec
from ringbench.variants.engines import layouts


def _tokens(spec: CaseSpec, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(spec.seed)
    return torch.randint(vocab, (spec.batch, spec.seqlen), generator=gen)


def build(name: str, seed: int):
    """Model ``name`` of ``scenarios/models/`` with random weights from ``seed``: its architecture's
    causal LM on CPU in float32, the same weights on every rank."""
    import transformers

    model = load_model(name)
    arch = model.architecture
    torch.manual_seed(seed)
    return getattr(transformers, arch.model)(getattr(transformers, arch.config)(**model.config))


def _copy(base, *, device, dtype):
    """``base`` with its parameters in ``dtype`` on ``device``; floating buffers stay float32.

    RoPE's ``inv_freq`` is such a buffer: transformers computes the rotary angles in float32,
    and an ``inv_freq`` rounded to bf16 would be another function at long positions (a bf16
    model from ``from_pretrained`` keeps it in float32 too).
    """
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    for mine, theirs in zip(model.modules(), base.modules()):
        for name, buf in theirs.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(mine, name, buf.to(device))
    return model


def _grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"loss": loss.detach()}
    out.update({f"grad {n}": p.grad.detach() for n, p in model.named_parameters()})
    return out


def _whole_row(base, ids: torch.Tensor, docs: list[int] | None, *, dtype, attention: str, device) -> dict:
    """Loss and gradients of ``base`` (copied to ``dtype``) over whole rows, no context parallelism,
    through the registered attention implementation ``attention``."""
    model = _copy(base, device=device, dtype=dtype)
    hf.use_attention(model, attention)
    batch, seqlen = ids.shape
    inputs = {"input_ids": ids.to(device)}
    keep = torch.ones(batch, seqlen - 1, dtype=torch.bool, device=device)
    if docs is None:
        inputs["position_ids"] = torch.arange(seqlen, device=device).expand(batch, seqlen)
    else:
        inputs["position_ids"] = torch.cat([torch.arange(n, device=device) for n in docs]).unsqueeze(0)
        cu = layouts.cu_seqlens_from_docs(docs, device=device)
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        for end in cu.tolist()[1:-1]:
            if 0 < end < seqlen:
                keep[:, end - 1] = False  # the last token of a document does not predict the next document
    logits = model(**inputs).logits
    acc = torch.promote_types(dtype, torch.float32)
    pred = logits[:, :-1].to(acc)[keep]
    loss = torch.nn.functional.cross_entropy(pred, ids[:, 1:].to(device)[keep])
    loss.backward()
    return _grads(model, loss)


def check_model(spec: CaseSpec, *, device: torch.device, group=None) -> dict:
    """Run one ``hf_model`` verify case; every rank calls it and gets the same fields back.

    Args:
        spec: the case, with ``hf_model`` set and its kernel resolved.
        device: this rank's device.
        group: the context-parallel group (default: the world).

    Returns:
        ``{"status", "reason", "checks", "cp_active": None, "worst_param": {"tensor", "ratio"}}``;
        ``checks`` holds the loss first, then one entry per parameter gradient, named
        ``grad <parameter name>``.
    """
    case = case_setup(spec, group)
    rank, world_size, dtype, docs = case.rank, case.world_size, case.dtype, case.docs
    base = build(spec.hf_model, spec.seed)
    ids = _tokens(spec, base.config.vocab_size)

    model = _copy(base, device=device, dtype=dtype)
    # Each layer's window comes from the model (its sliding_window at every call), not the case's
    # window, which only says that some layers have one.
    options = {k: v for k, v in case.options.items() if k != "window"}
    hf.use_attention(model, hf.register(spec.variant, group=group, kernel=spec.kernel, **options))
    cu = layouts.cu_seqlens_from_docs(docs, device=device) if docs is not None else None
    batch = cp.shard_batch(ids.to(device), variant=spec.variant, rank=rank, world_size=world_size,
                           labels=ids.to(device), cu_seqlens=cu, layout=case.layout,
                           ulysses_degree=case.ulysses_degree if case.variant.ulysses == "option" else None)
    loss = cp.causal_lm_loss(model(**batch.model_inputs()).logits, batch.labels, group=group)
    loss.backward()
    cp.all_reduce_grads(model.parameters(), group=group)
    got = _grads(model, loss)
    del model

    checks = None
    if rank == 0:
        ref = _whole_row(base, ids, docs, dtype=torch.float64, attention=hf.register_reference(), device=device)
        single = _whole_row(base, ids, docs, dtype=dtype, attention=hf.register_single(spec.kernel), device=device)
        # Each gradient is summed over the group's ranks, so its floor counts the world size.
        checks = [tolerance_check(name, got[name], single[name], ref[name], single[name].dtype, tuple(ref[name].shape),
                                  world_size=world_size)
                  for name in ref]
    box = [checks]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    checks = box[0]
    grads = [c for c in checks if c["tensor"] != "loss"]
    worst = max(grads, key=lambda c: c["ratio"])
    failed = [c["tensor"] for c in checks if not c["passed"]]
    reason = ("over the tolerance or malformed: " + ", ".join(failed)) if failed else None
    return {"status": "fail" if failed else "ok", "reason": reason, "checks": checks, "cp_active": None,
            "worst_param": {"tensor": worst["tensor"], "ratio": worst["ratio"]}}
