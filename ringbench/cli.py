"""The ``ringbench`` command line: ``run``, ``verify``, ``compare`` and ``variants``.

Parsing and every check that needs no GPU happen here, before any process starts; a bad
input prints one red sentence on stderr and exits 2. Torch and the harness modules are
imported inside the commands, so ``ringbench --help`` is instant.

Exit codes: 0 every case passed, 1 a case failed (compare: a case regressed), 2 bad usage,
3 a launch failed or timed out, 130/143 interrupted by SIGINT/SIGTERM (the records so far are kept).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer
from rich.console import Console
from rich.text import Text

from ringbench import __version__
from ringbench.spec import SpecError, plural

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUN = 0, 1, 2, 3
#: Statuses that do not fail a command; anything else (fail, oom, error, timeout) does.
PASSING = ("ok", "skipped")
SCHEMA_VERSION = 1

app = typer.Typer(
    name="ringbench",
    help="Run, verify and compare context-parallel (ring) attention variants across ranks.\n\n"
         "Exit codes: 0 all passed, 1 a case failed (compare: regressed), 2 bad usage, 3 a launch failed or "
         "timed out, 130/143 interrupted (rerun with --resume).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


# --------------------------------------------------------------------------- options

_DEV = "Default: cuda {cuda}, cpu {cpu}."
VARIANT_HELP = ("Context-parallel variant to run, as registered in ringbench.variants (ring, zigzag, ...; "
                "`ringbench variants` lists them and says which can run here).")
SEQLEN_HELP = ("Global tokens per sequence, split across ranks; a whole number with an optional k (x1024) "
               "or M (x1024^2) suffix, such as 4096, 128k or 1M. " + _DEV.format(cuda="16k", cpu="4k"))
WORLD_HELP = ("Ranks in the context-parallel group, one process each. Default: cuda every visible GPU, "
              "cpu 2.")
BATCH_HELP = "Sequences per batch (B). Default: 1."
HEADS_HELP = "Query heads (Hq). " + _DEV.format(cuda=32, cpu=4)
KV_HEADS_HELP = ("Key/value heads (Hkv); must divide --heads, fewer than --heads means GQA. "
                 + _DEV.format(cuda=8, cpu=2))
HEAD_DIM_HELP = "Channels per head (D). " + _DEV.format(cuda=128, cpu=32)
DTYPE_HELP = "Input dtype: bf16, fp16, fp32 or fp64. " + _DEV.format(cuda="bf16", cpu="fp32")
CAUSAL_HELP = "Apply a causal mask (--causal, the default) or attend to every key (--no-causal)."
MODE_HELP = "What one iteration times: fwd (forward only) or fwd_bwd (forward and backward). Default: fwd_bwd."
KERNEL_HELP = ("Local attention kernel: flash-attn, torch-flash, cudnn, torch-efficient (cuda), cpu, math (any device), or "
               "auto, the first one available here that takes the dtype and head dim. Default: auto.")
ITERS_HELP = "Timed iterations per case. " + _DEV.format(cuda=20, cpu=10)
WARMUP_HELP = "Untimed warm-up iterations before timing (0 allowed). " + _DEV.format(cuda=5, cpu=3)
SEED_HELP = "Seed of the random inputs (0 or more). Default: 0."
DEVICE_HELP = ("Run on cuda (NCCL, one GPU per rank) or cpu (gloo). Default: cuda when a GPU is visible, "
               "else cpu; a scenario that names its device (smoke says cpu) keeps it unless this is given.")
OUT_HELP = "Folder for the records; run appends to OUT/runs.jsonl, verify to OUT/verify.jsonl. Default: results."
JSON_HELP = "Print one JSON record per line on stdout and nothing else there, instead of the table."
RESUME_HELP = ("Skip the cases that already have a record with status ok in the results file (same case_id: "
               "every field but iters, warmup and seed), so a sweep that was stopped can be finished; the "
               "table and --json still show every case. Default: run every case.")
LAYOUT_HELP = ("Layout of the sequence over the ranks, for variants that take more than one (llama3: zigzag, "
               "the default, balanced under a causal mask, or contiguous). Default: the variant's own.")
DOCS_HELP = ("Packed documents for a varlen variant (ring_varlen, zigzag_varlen, llama3_varlen): lengths "
             "separated by commas, sizes such as 12k allowed, 0 for an empty document; they must sum to "
             "--seqlen. ring_varlen needs each length to be a multiple of the world size, zigzag_varlen of "
             "twice it; llama3_varlen takes any. Default: none.")
DOC_DIST_HELP = ("Draw the documents with --seed until they fill --seqlen: lognormal:mean=4k,sigma=1 (mean "
                 "length in tokens, sigma of its log) or uniform:min=512,max=8k. Lengths are rounded to the "
                 "variant's multiple. Default: none.")
HEADS_K_STRIDE_HELP = ("K/V heads gathered at a time by all-gather variants (llama3); while one group computes, "
                       "the next group's gather is in flight. Default: all K/V heads in one gather.")
ROTATE_HELP = ("How torch_cp (PyTorch's context parallel) moves K/V: allgather (gather once, then compute "
               "block by block) or alltoall (pass one block per step). Default: allgather, PyTorch's own.")
MODEL_HELP = ("Check a whole model instead of attention alone: a randomly initialised Llama-architecture model "
              "(llama-tiny: 256 tokens, for CPU; llama-small: 16k tokens, for GPUs in bf16) through the Hugging "
              "Face adapter, with and without context parallelism on the same tokens; compares the loss and every "
              "parameter gradient. Takes --variant (default zigzag, zigzag_varlen with --docs), --world-size "
              "(default 2), --dtype, --kernel, --device, --docs and --doc-dist. Needs transformers: the hf extra.")
TIMEOUT_HELP = ("Wall-clock seconds one launch (the cases of one world size and device) may take before every "
                "rank is stopped and the running case recorded as timeout; the sweep then goes on with the next "
                "case. Default: scaled to the cases, 120 s of start-up plus, per case, twice its FLOPs per GPU "
                "times (iters + warmup) at 50 TFLOP/s on cuda or 5 GFLOP/s on cpu (verify: four times the "
                "whole sequence's FLOPs); never below 120.")
NNODES_HELP = ("Hosts the job spans, each running this same command with its own --node-rank; --world-size "
               "is the total over them, so each host starts world_size / nnodes ranks (it must divide). Only "
               "node 0, where global rank 0 lives, writes records. Default: 1.")
NODE_RANK_HELP = "This host's index among --nnodes, 0 to nnodes - 1. Default: 0."
RDZV_ENDPOINT_HELP = ("HOST:PORT of torchrun's c10d rendezvous, the same on every node (usually node 0's host "
                      "name and a free port such as 29500); required with --nnodes above 1.")
RDZV_ID_HELP = ("Rendezvous id, the same on every node. Default: derived from --rdzv-endpoint and the command "
                "line, which every node shares.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ringbench {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Run, verify and compare context-parallel (ring) attention variants across ranks."""


# --------------------------------------------------------------------------- commands

@app.command()
def run(
    variant: Optional[str] = typer.Option(None, "--variant", help=VARIANT_HELP + " Required unless --scenario is given."),
    seqlen: Optional[str] = typer.Option(None, "--seqlen", help=SEQLEN_HELP),
    world_size: Optional[int] = typer.Option(None, "--world-size", help=WORLD_HELP),
    batch: Optional[int] = typer.Option(None, "--batch", help=BATCH_HELP),
    heads: Optional[int] = typer.Option(None, "--heads", help=HEADS_HELP),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help=KV_HEADS_HELP),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help=HEAD_DIM_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP),
    causal: Optional[bool] = typer.Option(None, "--causal/--no-causal", help=CAUSAL_HELP, show_default=False),
    mode: Optional[str] = typer.Option(None, "--mode", help=MODE_HELP),
    kernel: Optional[str] = typer.Option(None, "--kernel", help=KERNEL_HELP),
    iters: Optional[int] = typer.Option(None, "--iters", help=ITERS_HELP),
    warmup: Optional[int] = typer.Option(None, "--warmup", help=WARMUP_HELP),
    seed: Optional[int] = typer.Option(None, "--seed", help=SEED_HELP),
    layout: Optional[str] = typer.Option(None, "--layout", help=LAYOUT_HELP),
    heads_k_stride: Optional[int] = typer.Option(None, "--heads-k-stride", help=HEADS_K_STRIDE_HELP),
    rotate: Optional[str] = typer.Option(None, "--rotate", help=ROTATE_HELP),
    docs: Optional[str] = typer.Option(None, "--docs", help=DOCS_HELP),
    doc_dist: Optional[str] = typer.Option(None, "--doc-dist", help=DOC_DIST_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    scenario: Optional[str] = typer.Option(
        None, "--scenario", help="Sweep a scenario instead of one case: a built-in name (smoke, ci-nightly, llama3-8b, peers) or "
                                 "a .toml file; the options above then override its fields."),
    out: Path = typer.Option(Path("results"), "--out", help=OUT_HELP, show_default=False),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    timeout: Optional[float] = typer.Option(None, "--timeout", help=TIMEOUT_HELP, show_default=False),
    resume: bool = typer.Option(False, "--resume", help=RESUME_HELP),
    nnodes: int = typer.Option(1, "--nnodes", help=NNODES_HELP, show_default=False),
    node_rank: int = typer.Option(0, "--node-rank", help=NODE_RANK_HELP, show_default=False),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help=RDZV_ENDPOINT_HELP),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help=RDZV_ID_HELP),
) -> None:
    """Measure a variant's time, throughput and memory on one shape (or a scenario's sweep)."""
    given = {k: v for k, v in dict(
        variant=variant, seqlen=seqlen, world_size=world_size, batch=batch, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, causal=causal, mode=mode, kernel=kernel,
        iters=iters, warmup=warmup, seed=seed, device=device, layout=layout,
        heads_k_stride=heads_k_stride, docs=docs, doc_dist=doc_dist, rotate=rotate).items() if v is not None}
    with _usage_errors():
        _check_given(given, timeout)
        if scenario is None and "variant" not in given:
            raise SpecError(_no_variant_message())
        if scenario is not None:
            # As in verify: these replace the sweep axis and filter the explicit cases.
            given.update({k: [given[k]] for k in ("variant", "world_size") if k in given})
        nodes = _check_nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id)
        if resume and nnodes > 1:
            raise SpecError(f"--resume reads the records, which only node 0 has, so it cannot run over nnodes "
                            f"{nnodes}; rerun the missing cases without --resume")
        cases, skipped = _build_cases("run", scenario, given, nnodes=nnodes)
        _check_out(out, None)
    raise typer.Exit(_execute(cases, task="run", out=out, json_out=json_out, timeout_s=timeout, resume=resume,
                              nodes=nodes, skipped=skipped))


@app.command()
def verify(
    variant: Optional[List[str]] = typer.Option(
        None, "--variant", help="Variant to verify; repeat for several. Replaces the scenario's variant axis and "
                                "keeps only its explicit cases of these variants. Default: with no --scenario, "
                                "every user-facing variant; else the scenario's."),
    scenario: Optional[str] = typer.Option(
        None, "--scenario", help="Built-in scenario name (smoke, ci-nightly, llama3-8b, peers) or a .toml file. Default: smoke, a "
                                 "CPU scenario that runs on CPU even on a GPU machine."),
    world_size: Optional[List[int]] = typer.Option(
        None, "--world-size", help="World size to verify at; repeat for several. Replaces the scenario's world "
                                   "sizes and keeps only its explicit cases at these sizes."),
    kernel: Optional[str] = typer.Option(None, "--kernel", help=KERNEL_HELP.replace("Default: auto.",
                                         "Default: the scenario's kernel, else auto.")),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    rotate: Optional[str] = typer.Option(None, "--rotate", help=ROTATE_HELP),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="With --model: " + DTYPE_HELP),
    docs: Optional[str] = typer.Option(None, "--docs", help="With --model: " + DOCS_HELP),
    doc_dist: Optional[str] = typer.Option(None, "--doc-dist", help="With --model: " + DOC_DIST_HELP),
    junit_xml: Optional[Path] = typer.Option(None, "--junit-xml", help="Also write the results as JUnit XML to "
                                             "this file, one test case per case. Default: no file."),
    out: Path = typer.Option(Path("results"), "--out", help=OUT_HELP, show_default=False),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
    timeout: Optional[float] = typer.Option(None, "--timeout", help=TIMEOUT_HELP, show_default=False),
    resume: bool = typer.Option(False, "--resume", help=RESUME_HELP),
    nnodes: int = typer.Option(1, "--nnodes", help=NNODES_HELP, show_default=False),
    node_rank: int = typer.Option(0, "--node-rank", help=NODE_RANK_HELP, show_default=False),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help=RDZV_ENDPOINT_HELP),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help=RDZV_ID_HELP),
) -> None:
    """Check that variants compute the same attention as one device, within tolerance."""

    given: dict[str, Any] = {}
    if variant:
        given["variant"] = list(variant)
    if world_size:
        given["world_size"] = list(world_size)
    if kernel is not None:
        given["kernel"] = kernel
    if device is not None:
        given["device"] = device
    if dtype is not None:
        given["dtype"] = dtype
    if rotate is not None:
        given["rotate"] = rotate
    with _usage_errors():
        _check_given(given, timeout)
        nodes = _check_nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id)
        if resume and nnodes > 1:
            raise SpecError(f"--resume reads the records, which only node 0 has, so it cannot run over nnodes "
                            f"{nnodes}; rerun the missing cases without --resume")
        if model is not None:
            cases = _build_model_cases(model, scenario, given, docs=docs, doc_dist=doc_dist, nnodes=nnodes)
            skipped: dict[str, str] = {}
        else:
            for flag, value in (("--dtype", dtype), ("--docs", docs), ("--doc-dist", doc_dist)):
                if value is not None:
                    raise SpecError(f"{flag} {value!r} goes with --model; the attention check takes its "
                                    f"{'dtypes' if flag == '--dtype' else 'documents'} from the scenario")
            if scenario is None:
                _check_smoke_takes(variant or [])
            cases, skipped = _build_cases("verify", scenario or "smoke", given, nnodes=nnodes)
        _check_out(out, junit_xml)
    raise typer.Exit(_execute(cases, task="verify", out=out, json_out=json_out, timeout_s=timeout,
                              junit_xml=junit_xml, resume=resume, nodes=nodes, skipped=skipped))


@app.command()
def compare(
    paths: Optional[List[Path]] = typer.Argument(
        None, help="Result files (.jsonl) or folders (every .jsonl under them). Default: results/runs.jsonl.",
        show_default=False),
    x: Optional[str] = typer.Option(None, "--x", help="Column across the table and along the plot's x axis "
                                    "(log2 where positive). Default: seqlen."),
    metric: str = typer.Option("tflops", "--metric", help="What to show: tflops (TFLOP/s per GPU), efficiency "
                               "(against the same kernel on one rank's share), time (ms, slowest rank) or memory "
                               "(peak allocated GiB). Default: tflops.", show_default=False),
    by: Optional[str] = typer.Option(None, "--by", help="Comma-separated fields that name a line of the plot and "
                                     "a row of the table; a non-spec column such as source keeps records of one "
                                     "case apart. Default: variant,kernel."),
    where: Optional[str] = typer.Option(None, "--where", help="Keep the records for which this pandas query holds, "
                                        "such as 'world_size == 2 and seqlen >= 16384'; spec fields go by their "
                                        "short names, other columns as `env.torch` in backticks. Default: all."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw the metric against --x to this .png, .svg "
                                        "or .pdf: one panel per world size and mode, one line per --by value."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the table to this file as "
                                            "Markdown."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per table row (per matched case "
                                  "with --baseline) on stdout instead of the table."),
    to_parquet: Optional[Path] = typer.Option(None, "--to-parquet", help="Also write the loaded records (ok, "
                                              "filtered by --where, latest per case) to this Parquet file; "
                                              "needs pyarrow."),
    baseline: Optional[List[Path]] = typer.Option(None, "--baseline", help="Regression gate: the old results "
                                                  "(file or folder; repeat for several). Needs --candidate."),
    candidate: Optional[List[Path]] = typer.Option(None, "--candidate", help="Regression gate: the new results, "
                                                   "matched to the baseline case by case (case_id)."),
    fail_if: Optional[List[str]] = typer.Option(None, "--fail-if", help="Regression gate rule METRIC:[+-]N%: "
                                                "tflops:-5% fails a case whose TFLOP/s drop more than 5%, "
                                                "time:+5% one whose time grows more than 5%; repeat for several."),
) -> None:
    """Turn results into a pivot table, a plot, or a regression verdict (exit 1 on a regression)."""
    err = Console(stderr=True, soft_wrap=True)
    with _usage_errors():
        cmp = importlib.import_module("ringbench.compare")
        try:
            if baseline or candidate:
                given = [name for name, value in (("result paths", paths), ("--x", x), ("--by", by),
                                                  ("--plot", plot), ("--markdown", markdown),
                                                  ("--to-parquet", to_parquet)) if value]
                if given:
                    raise SpecError(f"{given[0]} does not go with --baseline and --candidate; run the gate "
                                    "and the table as two commands")
                if not (baseline and candidate):
                    raise SpecError("the regression gate needs both --baseline and --candidate; pass both")
                thresholds = [cmp.parse_threshold(t) for t in fail_if or []]
                result = cmp.gate(baseline, candidate, thresholds, metric=metric, where=where)
                if json_out:
                    sys.stdout.write("".join(line + "\n" for line in cmp.gate_json_lines(result)))
                else:
                    cmp.print_gate(result, Console())
                sys.stdout.flush()
                raise typer.Exit(EXIT_FAILED if result.regressions else EXIT_OK)
            if fail_if:
                raise SpecError("--fail-if needs --baseline and --candidate; pass the old and the new results")
            for option, path, suffixes in (("--plot", plot, (".png", ".svg", ".pdf")), ("--markdown", markdown, ()),
                                           ("--to-parquet", to_parquet, ())):
                _check_output(option, path, suffixes)
            columns = [c.strip() for c in (by or "variant,kernel").split(",") if c.strip()]
            if not columns:
                raise SpecError(f"--by {by!r} names no field; pass fields such as variant,kernel")
            loaded = cmp.load_runs(paths or [Path("results") / "runs.jsonl"], where=where, keep_apart=columns)
            table = cmp.pivot(loaded.frame, metric=metric, x=x or "seqlen", by=columns)
            if to_parquet is not None:
                cmp.to_parquet(loaded.frame, to_parquet)
        except cmp.CompareError as exc:
            raise SpecError(str(exc)) from None
    note = loaded.left_out_text()
    if json_out:
        sys.stdout.write("".join(line + "\n" for line in cmp.pivot_json_lines(table)))
    else:
        cmp.print_pivot(table, Console())
    sys.stdout.flush()  # the table before the notes on stderr, where both go to one file
    if note:
        err.print(note, style="dim", markup=False)
    if markdown is not None:
        markdown.write_text(cmp.pivot_markdown(table), encoding="utf-8")
        err.print(f"table written to {markdown}", style="dim", markup=False)
    if plot is not None:
        cmp.plot(table, loaded.frame, plot)
        err.print(f"plot written to {plot}", style="dim", markup=False)
    if to_parquet is not None:
        err.print(f"{len(loaded.frame)} records written to {to_parquet}", style="dim", markup=False)
    raise typer.Exit(EXIT_OK)


@app.command("variants")
def variants_command(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per variant on stdout instead of "
                                  "the table."),
) -> None:
    """List the variants: layout, form, mask, the kernels they take, and whether they can run here (why not)."""
    from ringbench.report import compact_table
    from ringbench.spec import detect_device
    from ringbench.variants import VARIANTS, list_variants

    device, _ = detect_device()
    rows = []
    for name in list_variants():
        v = VARIANTS[name]
        reason = v.unavailable() or v.check_device(device)
        rows.append({"variant": name, "peer": v.peer, "layouts": [v.layout, *v.layouts],
                     "form": "varlen" if v.varlen else "batch",
                     "masks": [m for m, ok in (("causal", v.causal), ("non-causal", v.non_causal)) if ok],
                     "kernels": list(v.kernels) or None, "available": reason is None, "reason": reason,
                     "summary": v.summary})
    if json_out:
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in rows))
        raise typer.Exit(EXIT_OK)
    table = compact_table(f"ringbench variants (here: {device})")
    # Names and verdicts never shrink; layouts and kernels wrap between names on a narrow terminal.
    for header, wrap in (("variant", False), ("layout", True), ("form", False), ("mask", False),
                         ("kernels", True), ("here", False)):
        table.add_column(header, no_wrap=not wrap, overflow="fold" if wrap else "ellipsis")
    reasons: dict[str, int] = {}  # one note per distinct reason
    for r in rows:
        if r["available"]:
            here = Text("yes", style="green")
        else:
            here = Text(f"no [{reasons.setdefault(r['reason'], len(reasons) + 1)}]", style="yellow")
        table.add_row(r["variant"], ", ".join(r["layouts"]), r["form"], "both" if len(r["masks"]) == 2 else r["masks"][0],
                      ", ".join(r["kernels"] or ["any"]), here)
    console = Console()
    console.print(table)
    for reason, i in reasons.items():
        console.print(Text(f"[{i}] {reason}", style="yellow"))
    raise typer.Exit(EXIT_OK)


def _check_output(option: str, path: Optional[Path], suffixes: tuple[str, ...]) -> None:
    """Refuse an output file with a wrong suffix or a folder that cannot be made, before any work."""
    if path is None:
        return
    if suffixes and path.suffix.lower() not in suffixes:
        raise SpecError(f"{option} {str(path)!r} must end in {', '.join(suffixes[:-1])} or {suffixes[-1]}, which "
                        f"names the format; pass a file such as compare{suffixes[0]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"{option} {str(path)!r} has a folder that could not be created ({exc.strerror}); pass "
                        "a writable path") from None


# --------------------------------------------------------------------------- usage checks

def _error(message: str) -> None:
    Console(stderr=True, soft_wrap=True).print(Text(message, style="red"))


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """Turn a SpecError into one red sentence on stderr and exit code 2."""
    try:
        yield
    except SpecError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None


def _no_variant_message() -> str:
    from ringbench.variants import list_variants

    return (f"no variant was given; pass --variant with one of {', '.join(list_variants())}, "
            "or --scenario")


def _check_smoke_takes(variants: list[str]) -> None:
    """Refuse a variant that cannot run on CPU when verify falls back to the CPU scenario smoke."""
    from ringbench.variants import get_variant

    for name in variants:
        try:
            v = get_variant(name)
        except ValueError:
            return  # _build_cases names the unknown variant
        if "cpu" not in v.devices:
            raise SpecError(f"{name} runs on CUDA only, and verify's default scenario, smoke, runs on CPU; on a GPU "
                            f"machine pass --scenario ci-nightly --variant {name}")


def _check_given(given: dict[str, Any], timeout: float) -> None:
    """Refuse bad option values before the (slow, torch-importing) device detection."""
    from ringbench.spec import check_fields, parse_size

    if "seqlen" in given:
        given["seqlen"] = parse_size(given["seqlen"])
    for key, value in given.items():
        for item in value if isinstance(value, list) else [value]:
            check_fields({key: item})
    if all(not isinstance(given.get(k), list) for k in ("variant", "world_size")):
        check_fields(given)
    if timeout is not None and not 0 < timeout < 7 * 24 * 3600:
        raise SpecError(f"timeout {timeout:g} must be positive and under a week (604800 s); pass --timeout with a "
                        "number of seconds, such as 600")


_HOST_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def _check_nodes(nnodes: int, node_rank: int, endpoint: Optional[str], rdzv_id: Optional[str]) -> dict:
    """Refuse bad multi-node options; the keyword arguments ``launch`` takes for them."""
    if not 1 <= nnodes <= 4096:
        raise SpecError(f"nnodes {nnodes} must be from 1 to 4096; pass --nnodes with the number of hosts")
    if not 0 <= node_rank < nnodes:
        raise SpecError(f"node-rank {node_rank} must be from 0 to nnodes - 1 = {nnodes - 1}; pass --node-rank with "
                        "this host's index")
    if endpoint is not None:
        host, sep, port = endpoint.rpartition(":")
        if not (sep and _HOST_RE.fullmatch(host) and port.isdigit() and 1 <= int(port) <= 65535):
            raise SpecError(f"rdzv-endpoint {endpoint!r} is not HOST:PORT with a port from 1 to 65535; pass "
                            "--rdzv-endpoint such as node001:29500")
    elif nnodes > 1:
        raise SpecError(f"nnodes {nnodes} needs a rendezvous every node can reach; pass --rdzv-endpoint HOST:PORT, "
                        "the same on every node, such as node001:29500")
    if nnodes == 1 and node_rank == 0 and endpoint is None:
        return {}
    if rdzv_id is None:
        # Every node runs the same command line but its own --node-rank: leave that out.
        argv, skip = [], False
        for arg in sys.argv[1:]:
            if skip or arg.startswith("--node-rank"):
                skip = arg == "--node-rank"
                continue
            argv.append(arg)
        rdzv_id = "ringbench-" + hashlib.sha1(shlex.join([endpoint or "", *argv]).encode()).hexdigest()[:12]
    return {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": endpoint, "rdzv_id": rdzv_id}


def _writable_folder(folder: Path) -> str | None:
    """Why nothing can be written in ``folder`` (made if missing), or None when a file can be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # A real write, since permission bits say nothing to root about read-only or immutable folders.
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ringbench-probe-"):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _check_out(out: Path, junit_xml: Optional[Path]) -> None:
    reason = _writable_folder(out)
    if reason:
        raise SpecError(f"out {str(out)!r} is not a folder ringbench can write in ({reason}); pass --out with a "
                        "writable folder")
    if junit_xml is not None:
        if junit_xml.is_dir():
            raise SpecError(f"junit-xml {str(junit_xml)!r} is a folder; pass --junit-xml with a file path such "
                            "as results/verify.xml")
        reason = _writable_folder(junit_xml.parent)
        if reason is None and junit_xml.exists() and not os.access(junit_xml, os.W_OK):
            reason = "the file is read-only"
        if reason:
            raise SpecError(f"junit-xml {str(junit_xml)!r} cannot be written ({reason}); pass --junit-xml "
                            "with a writable path")


def _build_cases(task: str, scenario: Optional[str], given: dict[str, Any],
                 nnodes: int = 1) -> tuple[list, dict[str, str]]:
    """Expand, validate and resolve the cases; raises SpecError on the first bad one.

    With ``nnodes`` hosts, world_size is the total over them: it must be a multiple of
    ``nnodes``, and on cuda each host must see ``world_size / nnodes`` GPUs.

    Returns:
        The cases, and ``{case_id: reason}`` of those a scenario holds whose variant is
        unavailable here (such as a peer whose library is missing): they are recorded as
        skipped. A variant named with ``--variant`` must be available.
    """
    from ringbench.scenarios import load_scenario
    from ringbench.spec import (CaseSpec, canonical, default_fields, detect_device, resolve, resolve_docs,
                                Unavailable, validate)
    from ringbench.variants import get_variant

    scen = load_scenario(scenario) if scenario is not None else None
    machine, gpus = detect_device()
    if scen is None:
        device = given.get("device", machine)
        cases = [CaseSpec.from_dict({"task": task, **default_fields(device, gpus), **given})]
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
    resolved, skipped = [], {}
    for i, case in enumerate(cases):
        try:
            case = resolve_docs(case)
            if case.world_size % nnodes:
                raise SpecError(f"world_size {case.world_size} is not a multiple of nnodes {nnodes}, and every "
                                f"node runs world_size / nnodes ranks; pass --world-size "
                                f"{(case.world_size // nnodes + 1) * nnodes}")
            validate(case, visible_gpus=gpus * nnodes)
            case = canonical(case)
            resolved.append(resolve(case))
        except Unavailable as exc:
            if scen is None or "variant" in given:
                raise
            skipped[case.case_id()] = str(exc)
            resolved.append(case)
        except SpecError as exc:
            if scen is None:
                raise
            raise SpecError(f"scenario {scen.source} case {i + 1} of {len(cases)} ({case.variant}, world_size "
                            f"{case.world_size}, seqlen {case.seqlen}, kernel {case.kernel}): {exc}") from None
    seen: dict[str, Any] = {}
    for case in resolved:
        other = seen.setdefault(case.case_id(), case)
        if other is not case:
            raise SpecError(f"two cases share case_id {case.case_id()} because they differ only in iters, warmup "
                            "or seed, so their records could not be told apart; sweep other fields")
    return resolved, skipped


def _build_model_cases(model: str, scenario: Optional[str], given: dict[str, Any], *, docs: Optional[str],
                       doc_dist: Optional[str], nnodes: int = 1) -> list:
    """The cases of ``verify --model``: one per variant and world size, shape from the model's file.

    Default variant: zigzag, or zigzag_varlen with documents; default world size 2.

    Raises:
        SpecError: transformers missing, --scenario given, an unknown model, or a case that
            cannot run (the variant, the documents, the world size, the kernel...).
    """
    from ringbench import models
    from ringbench.spec import parse_docs
    from ringbench.variants import get_variant

    if scenario is not None:
        raise SpecError(f"--scenario {scenario!r} does not go with --model, which fixes the case's shape; drop one")
    if models.transformers_missing():
        raise SpecError(models.MISSING_EXTRA)
    fixed = models.case_fields(model)
    extra = {k: v for k, v in (("docs", docs), ("doc_dist", doc_dist)) if v is not None}
    variants = given.pop("variant", None) or ["zigzag_varlen" if extra else "zigzag"]
    world_sizes = given.pop("world_size", None) or [2]
    seqlen = fixed["seqlen"]
    if docs is not None and sum(parse_docs(docs)) != seqlen:
        raise SpecError(f"docs {docs!r} sum to {sum(parse_docs(docs))} tokens, but model {model} has {seqlen}; pass "
                        f"documents that sum to {seqlen}")
    cases = []
    for variant in variants:
        for world_size in world_sizes:
            # The model fixes seqlen, so the fix the spec's message suggests (another seqlen) is not open here.
            n = get_variant(variant).seqlen_multiple(world_size)
            if seqlen % n:
                fits = [w for w in range(2, 65) if seqlen % get_variant(variant).seqlen_multiple(w) == 0][:2]
                raise SpecError(f"world_size {world_size} does not fit model {model}: its {seqlen} tokens are not a "
                                f"multiple of {n}, which {variant} needs at that size; pass --world-size "
                                f"{' or '.join(map(str, fits))}")
            case = dict(given, **fixed, **extra, variant=variant, world_size=world_size)
            cases += _build_cases("verify", None, case, nnodes=nnodes)[0]  # one case: nothing is skipped
    return cases


# --------------------------------------------------------------------------- execution

def _execute(cases: list, *, task: str, out: Path, json_out: bool, timeout_s: Optional[float],
             junit_xml: Optional[Path] = None, resume: bool = False, nodes: Optional[dict] = None,
             skipped: Optional[dict[str, str]] = None) -> int:
    """Launch the cases, one launch per (world_size, device), and report; returns the exit code.

    The cases in ``skipped`` (case_id -> reason) are not launched; each gets a ``skipped`` record.

    A progress bar on stderr counts cases: it moves as the records appear in the results file
    (read between waits on the job, see ``launch``'s ``on_poll``). Ctrl-C or SIGTERM stops
    the job, keeps every record written so far and returns 130 or 143; ``--resume`` then
    runs the rest.
    """
    # Looked up at call time, so tests can stand in for the harness modules.
    launch_mod = importlib.import_module("ringbench.launch")
    results = importlib.import_module("ringbench.results")
    report = importlib.import_module("ringbench.report")

    err = Console(stderr=True, soft_wrap=True)
    results_path = out / ("runs.jsonl" if task == "run" else "verify.jsonl")
    run_id = uuid.uuid4().hex
    nodes = nodes or {}
    if nodes.get("node_rank", 0) > 0:
        return _follow_node(cases, launch_mod, results_path, run_id, timeout_s, nodes, err)
    by_id: dict[str, dict] = {}
    if resume:
        wanted = {c.case_id() for c in cases}
        for record in results.read_records(results_path):
            if record.get("case_id") in wanted and _done(record):
                by_id[record["case_id"]] = record  # the latest ok record of the case
        err.print(f"--resume: {len(by_id)} of {plural(len(cases), 'case')} already have an ok record in "
                  f"{results_path}; running {len(cases) - len(by_id)}", style="dim", markup=False)
    skipped_now = [c for c in cases if c.case_id() in (skipped or {}) and c.case_id() not in by_id]
    env = _env(skipped_now[0].kernel) if skipped_now else None  # why they were skipped is part of it
    for case in skipped_now:
        record = _missing_record(case, run_id, "skipped", skipped[case.case_id()], env)
        results.append_record(results_path, record)
        by_id[case.case_id()] = record
    todo = [c for c in cases if c.case_id() not in by_id]

    written = 0
    not_run = False
    signum = [signal.SIGINT]
    previous = _raise_on_sigterm(signum)
    try:
        launched, not_run = _launch_all(todo, launch_mod, results, results_path, run_id, timeout_s, by_id, err,
                                        task=task, nodes=nodes)
        written = launched + len(skipped_now)
    except KeyboardInterrupt:
        ids = {c.case_id() for c in cases}
        done = by_id.keys() | {r.get("case_id") for r in results.read_records(results_path)
                               if r.get("run_id") == run_id}
        again = shlex.join(["ringbench", *sys.argv[1:]] + ([] if "--resume" in sys.argv else ["--resume"]))
        _error(f"interrupted: {len(done & ids)} of {plural(len(cases), 'case')} have a record in {results_path}; "
               f"to run the others: {again}")
        return 128 + signum[0]
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    records = [by_id[c.case_id()] for c in cases]
    if json_out:
        for record in records:
            sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    else:
        console = Console()
        if task == "run":
            report.print_run_table(records, console)
            if any(r.get("spec", {}).get("device") == "cpu" for r in records):
                err.print("On CPU the timings show that the harness runs, not how fast a variant is: gloo on "
                          "shared cores, and the CPU kernel's causal pass does not halve its work, so efficiency "
                          "can pass 1.", style="dim", markup=False)
        else:
            report.print_verify_table(records, console)
            report.print_growth_table(records, console)
    if junit_xml is not None:
        report.write_junit(records, junit_xml)
    reused = f"; {len(records) - written} reused (--resume)" if resume else ""
    err.print(f"{plural(written, 'record')} appended to {results_path}{reused}", style="dim", markup=False)
    if not_run:
        return EXIT_NOT_RUN
    if any(r.get("status") not in PASSING for r in records):
        return EXIT_FAILED
    return EXIT_OK


def _done(record: dict) -> bool:
    """Whether ``--resume`` may skip the record's case: status ok and, for verify, checks that
    all passed (an ok verify record with a failing check counts as failed)."""
    if record.get("status") != "ok":
        return False
    if record.get("task") != "verify":
        return True
    checks = record.get("checks") or []
    return bool(checks) and all(c.get("passed") and c.get("finite", True) is not False for c in checks)


def _raise_on_sigterm(signum: list) -> Any:
    """Make SIGTERM raise KeyboardInterrupt (so the job is stopped, not orphaned) and note
    which signal came in ``signum[0]``; returns the previous handler, None off the main thread."""
    def handler(sig, frame):
        signum[0] = sig
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def default_timeout_s(cases: list) -> float:
    """The watchdog's default for one launch of ``cases``, in seconds (see ``--timeout``'s help).

    120 s of start-up, plus per case twice its FLOPs per GPU times (iters + warmup) for run
    (the variant and its reference), or four times the whole sequence's FLOPs for verify, at
    a conservative 50 TFLOP/s on cuda and 5 GFLOP/s on cpu. A model check (``hf_model``) adds
    60 s and its three passes' FLOPs at a tenth of that rate (float64 among them).
    """
    from ringbench.bench import attention_flops
    from ringbench.spec import spec_docs

    total_s = 120.0
    for case in cases:
        flops = attention_flops(batch=case.batch, seqlen=case.seqlen, heads=case.heads, head_dim=case.head_dim,
                                causal=case.causal, mode=case.mode, docs=spec_docs(case) if case.docs else None)
        work = flops / case.world_size * (case.iters + case.warmup) * 2 if case.task == "run" else 4 * flops
        total_s += work / (50e12 if case.device == "cuda" else 5e9)
        if case.hf_model:
            # Importing transformers and building three models, then float64 work at a tenth of the rate.
            from ringbench.models import estimated_check_flops

            total_s += 60 + estimated_check_flops(case) / (5e12 if case.device == "cuda" else 5e8)
    return total_s


def _reached_a_case(log_dir: Optional[Path]) -> bool:
    """Whether some rank of the launch in ``log_dir`` wrote a case's start mark."""
    if log_dir is None:
        return False
    for marks in Path(log_dir).glob("progress/rank*.txt"):
        try:
            if " start " in marks.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def _status_of_failure(timed_out: bool, failure: Optional[str]) -> str:
    if timed_out:
        return "timeout"
    if failure and "OutOfMemoryError" in failure:
        return "oom"
    return "error"


def _follow_node(cases: list, launch_mod, results_path: Path, run_id: str, timeout_s: Optional[float],
                 nodes: dict, err: Console) -> int:
    """Run this host's share of every launch (node rank above 0): no records, node 0 writes them.

    Returns 0 when every launch ended well, else 3.
    """
    groups: dict[tuple[int, str], list] = {}
    for case in cases:
        groups.setdefault((case.world_size, case.device), []).append(case)
    code = EXIT_OK
    for (world_size, device), group in groups.items():
        result = launch_mod.launch([c.to_dict() for c in group], world_size=world_size, device=device,
                                   results_path=results_path, run_id=run_id,
                                   timeout_s=timeout_s or default_timeout_s(group), **nodes)
        if result.timed_out or result.failure:
            _error(f"node {nodes['node_rank']}: launch at world_size {world_size} on {device} "
                   f"{'timed out' if result.timed_out else 'failed'}: {result.failure}")
            code = EXIT_NOT_RUN
    err.print(f"node {nodes['node_rank']} of {nodes['nnodes']}: {plural(len(cases), 'case')} ran; node 0 writes "
              "their records", style="dim", markup=False)
    return code


def _launch_all(todo: list, launch_mod, results, results_path: Path, run_id: str, timeout_s: Optional[float],
                by_id: dict, err: Console, *, task: str, nodes: Optional[dict] = None) -> tuple[int, bool]:
    """Run ``todo`` one launch per (world_size, device) under a progress bar; fill ``by_id``.

    When a launch fails or times out in a case, that case is recorded with status timeout,
    oom or error and its reason, and the cases after it go to a fresh launch (on one node;
    over several, every unreported case is recorded with the failure).

    Returns:
        (records appended, whether some case went unreported by its launch).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    groups: dict[tuple[int, str], list] = {}
    for case in todo:
        groups.setdefault((case.world_size, case.device), []).append(case)
    varying = _varying_fields(todo)
    env: list[dict | None] = []  # collected once, on the first unreported case
    written, not_run = 0, False
    columns = (TextColumn("{task.fields[counter]}"), BarColumn(bar_width=16), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=err) as progress:
        bar = progress.add_task(task, total=len(todo), counter=f"case 0 of {len(todo)}")

        def show(current) -> None:
            """Case i of n: i counts the finished cases and the one running now."""
            done = int(progress.tasks[0].completed)
            if current is None:
                progress.update(bar, counter=f"case {done} of {len(todo)}", description="")
            else:
                progress.update(bar, counter=f"case {done + 1} of {len(todo)}",
                                description=_short_label(current, varying))

        for group in groups.values():
            pending = list(group)
            while pending:
                found, failed, pending = _launch_one(pending, launch_mod, results, results_path, run_id, timeout_s,
                                                     nodes or {}, env, progress, bar, show)
                written += len(found)
                not_run = not_run or failed
                by_id.update(found)
        show(None)
    return written, not_run


def _launch_one(pending: list, launch_mod, results, results_path: Path, run_id: str, timeout_s: Optional[float],
                nodes: dict, env: list, progress, bar, show) -> tuple[dict, bool, list]:
    """One launch of ``pending`` (cases of one world size and device).

    Returns:
        (the records of its cases by case_id, whether a case went unreported, the cases
        left for a fresh launch: those after the one a failed launch was running).
    """
    world_size, device = pending[0].world_size, pending[0].device
    ids = {c.case_id() for c in pending}
    found: dict[str, dict] = {}
    offset = [results_path.stat().st_size if results_path.exists() else 0]

    def poll() -> None:
        new, offset[0] = results.read_records_from(results_path, offset[0])
        for record in new:
            if record.get("run_id") == run_id and record.get("case_id") in ids - found.keys():
                found[record["case_id"]] = record
                progress.advance(bar)
        show(next((c for c in pending if c.case_id() not in found), None))

    show(pending[0])
    limit_s = timeout_s or default_timeout_s(pending)
    try:
        result = launch_mod.launch([c.to_dict() for c in pending], world_size=world_size, device=device,
                                   results_path=results_path, run_id=run_id, timeout_s=limit_s, on_poll=poll,
                                   **nodes)
        timed_out, failure, log_dir = result.timed_out, result.failure, result.log_dir
    except Exception as exc:  # a launcher crash still leaves one record per case
        timed_out, failure, log_dir = False, f"the launcher raised {type(exc).__name__}: {exc}", None
    poll()  # records the hook has not seen (a crashed launcher never called it)
    missing = [c for c in pending if c.case_id() not in found]
    rest: list = []
    if missing and (timed_out or failure) and nodes.get("nnodes", 1) == 1 and _reached_a_case(log_dir):
        # The launch died in its first unreported case: blame that one, give the others a fresh launch.
        missing, rest = missing[:1], missing[1:]
    if missing and not env:
        env.append(_env(missing[0].kernel))
    for case in missing:
        reason = failure or (f"the launch timed out after {limit_s:g} s" if timed_out
                             else "the job ended before this case reported")
        record = _missing_record(case, run_id, _status_of_failure(timed_out, failure), reason, env[0])
        results.append_record(results_path, record)
        found[case.case_id()] = record
        progress.advance(bar)
    if missing or timed_out or failure:
        what = "timed out" if timed_out else f"failed: {failure or 'no reason given'}"
        where = f"; logs in {log_dir}" if log_dir else ""
        again = (f"; {'the case' if len(rest) == 1 else f'the {len(rest)} cases'} after it "
                 f"{'goes' if len(rest) == 1 else 'go'} to a fresh launch" if rest else "")
        progress.console.print(Text(f"launch at world_size {world_size} on {device} {what}; {len(missing)} of "
                                    f"{len(pending)} cases unreported{where}{again}", style="red"))
    return found, bool(missing), rest


#: Spec fields in the order a short case label names them.
_LABEL_FIELDS = ("variant", "kernel", "device", "world_size", "batch", "seqlen", "heads", "kv_heads", "head_dim",
                 "dtype", "causal", "mode")


def _varying_fields(cases: list) -> set[str]:
    """The spec fields that take more than one value among ``cases``."""
    return {f for f in _LABEL_FIELDS if len({getattr(c, f) for c in cases}) > 1}


def _short_label(case, varying: set[str]) -> str:
    """The case named by its variant and kernel and the fields the sweep varies, such as
    ``zigzag cudnn 16k fwd``, for the progress bar."""
    from ringbench.spec import format_size

    words = {
        "variant": case.variant, "kernel": case.kernel, "device": case.device, "world_size": f"W={case.world_size}",
        "batch": f"B={case.batch}", "seqlen": format_size(case.seqlen), "heads": f"H={case.heads}",
        "kv_heads": f"KV={case.kv_heads}", "head_dim": f"D={case.head_dim}", "dtype": case.dtype,
        "causal": "causal" if case.causal else "non-causal", "mode": case.mode,
    }
    return " ".join(words[f] for f in _LABEL_FIELDS if f in ("variant", "kernel") or f in varying)



def _env(kernel: str) -> dict | None:
    try:
        return importlib.import_module("ringbench.envinfo").collect(kernel)
    except Exception:  # the environment is context; its failure must not cost the record
        return None


def _missing_record(case, run_id: str, status: str, reason: str, env: dict | None) -> dict[str, Any]:
    """The record of a case the launched job never reported."""
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "task": case.task,
        "run_id": run_id,
        "case_id": case.case_id(),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "spec": case.to_dict(),
        "status": status,
        "reason": reason,
        "kernel": case.kernel,
        "env": env,
    }
    if case.task == "run":
        record.update(dict.fromkeys((
            "time_ms", "per_rank_time_ms", "imbalance", "flops_per_gpu", "tflops_per_gpu", "ref_time_ms",
            "ref_tflops", "efficiency", "peak_allocated_gib", "peak_reserved_gib", "bytes_sent",
            "bytes_received", "bus_gib_s")))
        record["flops_convention"] = "flash-attn"
    else:
        record.update(checks=[], cp_active=None)
    return record


if __name__ == "__main__":  # python -m ringbench.cli, as the end-to-end tests run it
    app(prog_name="ringbench")
