"""Case building: a command's options (and a scenario or a model) into validated, resolved cases.

``build_cases`` is what ``run``, ``verify`` and the matrix call; every refusal is a
``SpecError`` naming the value and the rule, raised before any process starts.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

from ringbench.case import fields
from ringbench.errors import SpecError, Unavailable
from ringbench.variants.offers import SeqlenOffer

#: Options that, given to verify without a scenario, still check the smoke scenario (they
#: filter or override its cases); any other case option makes verify check that one shape.
SMOKE_FILTERS = ("variant", "world_size", "kernel", "device", "repeat", "require_deterministic")


def cases_for(task: str, given: dict[str, Any], *, scenario: Optional[str] = None, model: Optional[str] = None,
              nnodes: int = 1, resolve_kernels: bool = True,
              machine: Optional[tuple[str, int]] = None) -> tuple[list, dict[str, str]]:
    """The cases a ``run`` or ``verify`` command asks for, validated and resolved.

    ``given`` holds the case options the command was given (field -> value, or a list of
    values for the repeatable ones, ``variant`` and ``world_size``). With a scenario, they
    override its fields (a list replaces that axis). Without one, ``run`` builds one case
    per variant and world size from the device's defaults; ``verify`` does the same when a
    case option beyond :data:`SMOKE_FILTERS` is given (a shape), and otherwise checks the
    ``smoke`` scenario. With ``model`` (verify only) the model fixes the shape.
    ``resolve_kernels=False`` and ``machine``: as :func:`build_cases` takes them.

    Returns:
        The cases, and ``{case_id: reason}`` of scenario cases that cannot run here (skipped).

    Raises:
        SpecError: the first refused option or case, in one sentence.
    """
    if model is not None:
        return build_model_cases(model, scenario, given, nnodes=nnodes), {}
    if scenario is None:
        if "variant" not in given and (task == "run" or set(given) - set(SMOKE_FILTERS)):
            raise SpecError(_no_variant_message(task))
        if task == "verify" and not set(given) - set(SMOKE_FILTERS):
            _check_smoke_takes(given.get("variant", []))
            scenario = "smoke"
    return build_cases(task, scenario, given, nnodes=nnodes, resolve_kernels=resolve_kernels, machine=machine)


def _product(given: dict[str, Any]) -> list[dict[str, Any]]:
    """One field table per combination of the list values in ``given`` (scalars in every one)."""
    lists = {k: v for k, v in given.items() if isinstance(v, list)}
    scalars = {k: v for k, v in given.items() if k not in lists}
    return [{**scalars, **dict(zip(lists, combo))} for combo in itertools.product(*lists.values())]


def build_cases(task: str, scenario: Optional[str], given: dict[str, Any],
                nnodes: int = 1, *, machine: Optional[tuple[str, int]] = None,
                resolve_kernels: bool = True) -> tuple[list, dict[str, str]]:
    """Expand, validate and resolve the cases; raises SpecError on the first bad one.

    Without a scenario, one case per combination of ``given``'s lists over the device's
    defaults. With ``nnodes`` hosts, world_size is the total over them: it must be a multiple
    of ``nnodes``, and on cuda each host must see ``world_size / nnodes`` GPUs.

    ``machine`` (device type, GPUs) stands for this machine's, and ``resolve_kernels=False``
    leaves ``auto`` and each named kernel unresolved (no availability check): how ``predict``
    and ``advise`` build the cases of a cluster they do not run on.

    Returns:
        The cases, and ``{case_id: reason}`` of those a scenario holds whose variant is
        unavailable here (such as a peer whose library is missing): they are recorded as
        skipped. A variant named with ``--variant`` must be available.
    """
    from ringbench.case.scenarios import load_scenario
    from ringbench.case.spec import (CaseSpec, canonical, default_fields, detect_device, expand_ulysses_degree,
                                     pack_documents, resolve, resolve_docs, resolve_mask, validate,
                                     without_full_window)
    from ringbench.variants import get_variant

    scen = load_scenario(scenario) if scenario is not None else None
    machine, gpus = detect_device() if machine is None else machine
    if scen is None:
        cases = [CaseSpec.from_dict({"task": task, **default_fields(table.get("device", machine), gpus), **table})
                 for table in _product(given)]
    else:
        cases = scen.cases(task, machine, given, visible_gpus=gpus)
        if isinstance(given.get("variant"), list):
            # A --variant list replaces the sweep's variants: keep each variant to the cases of
            # its form (packed documents for the varlen variants, none for the batch ones) and
            # of a mask it takes (torch_cp is causal only).
            cases = [c for c in cases if get_variant(c.variant).varlen == bool(c.docs or c.doc_dist)
                     and (get_variant(c.variant).non_causal or c.causal)]
        if not cases:
            raise SpecError(f"scenario {scen.source} has no case left after the --variant and --world-size "
                            "filters; pass values that its cases use")
    cases = [c for case in cases for c in expand_ulysses_degree(case)]  # --ulysses-degree auto
    resolved, skipped = [], {}
    first: SpecError | None = None  # a scenario's first refused case; the others are counted, not raised
    refused = 0
    for i, case in enumerate(cases):
        try:
            if scen is not None:
                _check_scenario_window(case, given)
            # Before the variant's window rules: a mask the plain fields say, and a window of the whole sequence.
            case = without_full_window(resolve_mask(pack_documents(resolve_docs(case))))
            if case.world_size % nnodes:
                up = (case.world_size // nnodes + 1) * nnodes  # or the one below, where that passes the limit
                fit = up if up <= fields.MAX_WORLD_SIZE else case.world_size - case.world_size % nnodes
                raise SpecError(f"world_size {case.world_size} is not a multiple of nnodes {nnodes}, and every "
                                f"node runs world_size / nnodes ranks; pass --world-size {fit}")
            validate(case, visible_gpus=gpus * nnodes)
            case = canonical(case)
            resolved.append(resolve(case) if resolve_kernels else case)
        except Unavailable as exc:
            if scen is None or "variant" in given:
                raise
            skipped[case.case_id()] = str(exc)
            resolved.append(case)
        except SpecError as exc:
            if scen is None:
                raise
            where = (f"scenario {scen.source} case {i + 1} of {len(cases)} ({case.variant}, world_size "
                     f"{case.world_size}, seqlen {case.seqlen}, kernel {case.kernel}): ")
            reason = exc.args[0] if exc.args else ""
            # An offered seqlen stays one, for sweep.fit to hold to the other rules.
            if isinstance(reason, SeqlenOffer):
                raise SpecError(reason.within(where)) from None
            refused += 1
            first = first or SpecError(where + str(exc))
    if first is not None:
        if refused > 1:  # so that a user who fixes the first does not meet the next one by one
            more = refused - 1
            raise SpecError(f"{first}; {more} more of its {len(cases)} cases {'is' if more == 1 else 'are'} refused "
                            "too, by this rule or another (--variant keeps the ones named)") from None
        raise first
    seen: dict[str, Any] = {}
    for case in resolved:
        other = seen.setdefault(case.case_id(), case)
        if other is not case:
            raise SpecError(f"two cases share case_id {case.case_id()} because they differ only in "
                            f"{', '.join(fields.NOT_IN_CASE_ID)}, so their records could not be told apart; "
                            "sweep other fields")
    return resolved, skipped


def _check_scenario_window(case, given: dict[str, Any]) -> None:
    """Refuse a ``--mask`` the command gives onto a scenario case whose window the scenario sets, naming
    the scenario's window as the other half of the conflict: the user gave only the mask, so
    ``spec.mask_window_rule``'s "pass one of them" would blame them for both."""
    from ringbench.variants.engines import masks

    if case.mask and case.window and given.get("mask") and not given.get("window"):
        raise SpecError(f"the scenario sets window {case.window} on this case, and a window is itself a mask "
                        f"(--window L is the short form of --mask window:L), so --mask {masks.label(case.mask)} cannot "
                        "join it; drop --mask, or give the mask without --scenario")


def build_model_cases(model: str, scenario: Optional[str], given: dict[str, Any], *, nnodes: int = 1) -> list:
    """The cases of ``verify --model``: one per variant and world size, shape from the model's file.

    Default variant: zigzag, or zigzag_varlen with documents; default world size 2. A varlen
    variant without ``docs`` or ``doc_dist`` packs the model's row as one document. The model
    fixes the shape, its sliding layers' window and its sinks, so every refusal here suggests
    a fix the same command takes: a variant or a world size, never another seqlen.

    Raises:
        SpecError: transformers missing or too old for the model's architecture, --scenario
            given, an option the model fixes (--window, --sink among them) or --doc-pad, an
            unknown model, or a case that cannot run (a variant that cannot take the model's
            window or sinks, the documents, the world size, the kernel...).
    """
    from ringbench.case import models
    from ringbench.case.spec import docs_text
    from ringbench.variants import get_variant

    if scenario is not None:
        raise SpecError(f"--scenario {scenario!r} does not go with --model, which fixes the case's shape; drop one")
    if models.transformers_missing():
        raise SpecError(models.MISSING_EXTRA)
    fixed = models.case_fields(model)
    reason = models.architecture_refusal(model)
    if reason:
        raise SpecError(reason)
    given = dict(given)
    clash = [k for k in fixed if k in given and k != "hf_model"]
    if clash:
        raise SpecError(models.clash_refusal(model, clash[0], fields.BY_NAME[clash[0]].option))
    if given.get("doc_pad"):
        raise SpecError(f"--doc-pad {given['doc_pad']} does not go with --model {model}: {models.PADDING}")
    has_docs = "docs" in given or "doc_dist" in given
    variants = given.pop("variant", None) or ["zigzag_varlen" if has_docs else "zigzag"]
    world_sizes = given.pop("world_size", None) or [2]
    seqlen = fixed["seqlen"]
    if "docs" in given and sum(fields.parse_docs(given["docs"])) != seqlen:
        raise SpecError(f"docs {docs_text(given['docs'])} sum to {sum(fields.parse_docs(given['docs']))} tokens, but "
                        f"model {model} has {seqlen}; pass documents that sum to {seqlen}")
    cases = []
    for variant in variants:
        reason = models.variant_refusal(model, variant)
        if reason:
            raise SpecError(reason)
        for world_size in world_sizes:
            # The model fixes seqlen and heads, so the fixes the spec's messages suggest (another
            # seqlen, other heads) are not open here.
            reason = models.world_size_refusal(model, variant, world_size)
            if reason:
                raise SpecError(reason)
            case = dict(given, **fixed, variant=variant, world_size=world_size)
            if get_variant(variant).varlen and not has_docs:
                case["docs"] = str(seqlen)  # the model's row as one document, so batch and varlen variants mix
            cases += build_cases("verify", None, case, nnodes=nnodes)[0]  # one case: nothing is skipped
    return cases


def _no_variant_message(task: str) -> str:
    from ringbench.variants import list_variants

    extra = ("; verify with no case option but --world-size, --kernel, --device, --repeat or "
             "--require-deterministic checks the smoke scenario"
             if task == "verify" else "")
    return (f"no variant was given; pass --variant with one of {', '.join(list_variants())}, "
            f"or --scenario{extra}")


def _check_smoke_takes(variants: list[str]) -> None:
    """Refuse a variant that cannot run on CPU when verify falls back to the CPU scenario smoke."""
    from ringbench.variants import get_variant

    for name in variants:
        try:
            v = get_variant(name)
        except ValueError:
            return  # build_cases names the unknown variant
        if "cpu" not in v.devices:
            raise SpecError(f"{name} runs on CUDA only, and verify's default scenario, smoke, runs on CPU; on a GPU "
                            f"machine pass --scenario ci-nightly --variant {name}")
