"""The ``ringbench`` command line: ``run``, ``verify``, ``compare``, ``matrix`` and ``variants``.

The commands only: their case options come from the field table (``ringbench.case.options``),
case building and the sweep from ``ringbench.sweep.run``, tables from ``ringbench.present.report`` and
``ringbench.present.compare``. Every check that needs no GPU happens before any process starts; a
bad input prints one red sentence on stderr and exits 2. Torch and the harness modules are
imported inside the commands, so ``ringbench --help`` is instant.

Exit codes: 0 every case passed, 1 a case failed (compare: a case regressed), 2 bad usage,
3 a launch failed or timed out, 130/143 interrupted by SIGINT/SIGTERM (the records so far are kept).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import sys
from pathlib import Path
from typing import Any, Iterator, List, Optional

import typer
from rich.console import Console
from rich.text import Text

from ringbench import __version__
from ringbench.case import options
from ringbench.errors import RingbenchError, SpecError
from ringbench.variants import plural
from ringbench.case.fields import BY_NAME as FIELD_ROWS, DEVICES
from ringbench.case.types import Refused
from ringbench.model.target import MAX_RANKS
from ringbench.case.options import (JSON_HELP, JUNIT_HELP, NNODES_HELP, NODE_RANK_HELP, OUT_HELP, RDZV_ENDPOINT_HELP,
                                    RDZV_ID_HELP, RESUME_HELP, SCENARIO_HELP, TIMEOUT_HELP, YES_HELP)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

class _Group(typer.core.TyperGroup):
    """``ringbench``: its help wraps at any width (``ringbench.present.help``)."""

    def format_help(self, ctx, formatter) -> None:
        from ringbench.present.help import print_help

        print_help(self, ctx)


class _OnceCommand(typer.core.TyperCommand):
    """A command that refuses an option of one value given twice with different values, or both
    sides of an on/off flag (``--causal --no-causal``), which click would otherwise settle
    silently by keeping the last (``--layout a --layout b``). Its help wraps at any width,
    naming each option's value (``--seqlen TOKENS``; ``ringbench.present.help``)."""

    def format_help(self, ctx, formatter) -> None:
        from ringbench.present.help import print_help

        print_help(self, ctx)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        self._refuse_twice(args)
        try:
            return super().parse_args(ctx, args)
        except Refused as exc:  # a value its type refused: ringbench's one sentence, exit 2
            _error(str(exc.error))
            raise typer.Exit(EXIT_USAGE) from None

    def _refuse_twice(self, args: list[str]) -> None:
        options = [p for p in self.params if p.param_type_name == "option" and not p.multiple and not p.count]
        single = {name: p for p in options if not p.is_flag for name in p.opts}
        pairs = {name: p for p in options if p.is_flag and p.secondary_opts for name in (*p.opts, *p.secondary_opts)}
        seen: dict[str, tuple[str, str, str]] = {}  # param -> (option, value, value as shown)
        tokens = iter(args)
        for token in tokens:
            if token == "--":
                break
            name, eq, value = token.partition("=")
            if name in pairs:
                param, value, shown = pairs[name], name, ""
            elif name in single:
                param = single[name]
                if not eq:
                    value = next(tokens, "")
                shown = f" {value}"
            else:
                continue
            if param.name in seen and seen[param.name][1] != value:
                first, _, before = seen[param.name]
                _error(f"{first} and {name} were both given; give one" if param.is_flag else
                       f"{name} was given twice ({first}{before}, then {name}{shown}); it takes one value, so "
                       "give it once")
                raise typer.Exit(EXIT_USAGE)
            seen[param.name] = (name, value, shown)


app = typer.Typer(
    name="ringbench",
    cls=_Group,
    help="Run, verify and compare context-parallel (ring) attention variants across ranks.\n\n"
         "Exit codes: 0 all passed, 1 a case failed (compare: regressed), 2 bad usage, 3 a launch failed or "
         "timed out, 130/143 interrupted (rerun with --resume).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ringbench {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Run, verify and compare context-parallel (ring) attention variants across ranks."""


# --------------------------------------------------------------------------- run and verify

def _sweep_command(task: str, doc: str, *, junit: bool) -> None:
    """Register ``run`` or ``verify``: every case option of ``task``, then the options of a sweep,
    which both share (``--junit-xml`` is verify's alone)."""
    def command(
        ctx: typer.Context,
        case: dict,
        scenario: Optional[str] = typer.Option(None, "--scenario", help=SCENARIO_HELP, metavar="NAME|FILE"),
        junit_xml: Optional[Path] = typer.Option(None, "--junit-xml", help=JUNIT_HELP, metavar="FILE"),
        out: Path = typer.Option(Path("results"), "--out", help=OUT_HELP, show_default=False,
                                 metavar=options.OUT.name, parser=options.OUT),
        json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
        timeout: Optional[float] = typer.Option(None, "--timeout", help=TIMEOUT_HELP, show_default=False,
                                              metavar=options.TIMEOUT.name, parser=options.TIMEOUT),
        resume: bool = typer.Option(False, "--resume", help=RESUME_HELP),
        yes: bool = typer.Option(False, "--yes", help=YES_HELP),
        nnodes: Optional[int] = typer.Option(None, "--nnodes", help=NNODES_HELP, show_default=False,
                                             metavar=options.NNODES.name, parser=options.NNODES),
        node_rank: Optional[int] = typer.Option(None, "--node-rank", help=NODE_RANK_HELP, show_default=False,
                                                metavar=options.NODE_RANK.name, parser=options.NODE_RANK),
        rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help=RDZV_ENDPOINT_HELP,
                                                    metavar="HOST:PORT"),
        rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help=RDZV_ID_HELP, metavar="ID"),
    ) -> None:
        _sweep(task, case, ctx.obj, scenario=scenario, out=out, json_out=json_out, timeout=timeout, resume=resume,
               nodes=(nnodes, node_rank, rdzv_endpoint, rdzv_id), junit_xml=junit_xml if junit else None, yes=yes)

    if not junit:  # run has no --junit-xml: typer never passes it, so its default (an OptionInfo) is ignored
        sig = inspect.signature(command)
        command.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != "junit_xml"])
    command.__name__, command.__qualname__, command.__doc__ = task, task, doc
    app.command(cls=_OnceCommand)(options.with_case_options(task)(command))


_sweep_command("run", "Measure a variant's time, throughput and memory on one shape (or a scenario's sweep).",
               junit=False)
_sweep_command("verify", """Check that variants compute the same attention as one device, within tolerance.

    With no --scenario and no shape option, it checks the smoke scenario (every variant that
    runs on CPU); a shape option (--seqlen, --heads, --docs...) checks that one shape.
    """, junit=True)


def _sweep(task: str, case: dict[str, Any], launcher: Any, *, scenario: Optional[str], out: Path, json_out: bool,
           timeout: Optional[float], resume: bool, nodes: tuple, junit_xml: Optional[Path] = None,
           yes: bool = False) -> None:
    """Build the cases of a run or verify command, sweep them, print the tables; exits.

    ``launcher`` is the typer context's object: ``None`` (``ringbench.sweep.launch``, torchrun) unless
    a caller such as a test passes another one (``app(obj=...)``).
    """
    from ringbench.sweep import build, fit, run as sweep

    with _usage_errors(), fit.offers_checked(task, case, scenario=scenario, nodes=nodes):
        options.check_given(case)
        nnodes, node_args = options.check_nodes(*nodes)
        if resume and nnodes > 1:
            raise SpecError(f"--resume reads the records, which only node 0 has, so it cannot run over nnodes "
                            f"{nnodes}; rerun the missing cases without --resume")
        model = case.pop("hf_model", None)
        cases, skipped = build.cases_for(task, case, scenario=scenario, model=model, nnodes=nnodes)
        if case.get("window") and any(not c.window for c in cases):
            short = sorted({c.seqlen for c in cases if not c.window})
            _note(f"window {case['window']} is at or above seqlen {', '.join(map(str, short))}, so each query sees "
                  "every key before it: the same case as no window, which it is run and recorded as")
        options.check_out(out, junit_xml, files=(sweep.results_file(out, task).name,))
    from ringbench.records.store import warnings_on_stderr

    with warnings_on_stderr():  # a damaged line of the results file: one sentence, no Python source
        outcome = sweep.run_sweep(cases, task=task, out=out, timeout_s=timeout, resume=resume, nodes=node_args,
                                  skipped=skipped, launcher=launcher, yes=yes)
    if outcome.records:
        _report(task, outcome.records, json_out=json_out, junit_xml=junit_xml)
        _profiles(outcome.records, out, json_out=json_out)
        reused = f"; {len(outcome.records) - outcome.written} reused (--resume)" if resume else ""
        _note(f"{plural(outcome.written, 'record')} appended to {sweep.results_file(out, task)}{reused}")
    raise typer.Exit(outcome.exit_code)


def _profiles(found: list[dict], out: Path, *, json_out: bool) -> None:
    """After a ``run --profile``: the breakdown tables (not with --json, whose records hold them) and a
    stacked-bar plot per profiled case next to the results (ringbench/rank/profile.py)."""
    from ringbench.present import profile

    if not profile.profiled(found):
        return
    if not json_out:
        profile.print_tables(found, Console())
    for path in profile.write_plots(found, out):
        _note(f"profile plot written to {path}")


def _report(task: str, found: list[dict], *, json_out: bool, junit_xml: Optional[Path]) -> None:
    from ringbench.present import report

    if json_out:
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in found))
        sys.stdout.flush()
    elif task == "run":
        report.print_run_table(found, Console())
        if any(r.get("spec", {}).get("device") == "cpu" for r in found):
            _note("On CPU the timings show that the harness runs, not how fast a variant is: gloo on shared "
                  "cores, and the CPU kernel's causal pass does not halve its work, so efficiency can pass 1.")
    else:
        # The error-growth tables first, so that the verify table's summary, the verdict, is the
        # last line a user sees.
        console = Console()
        report.print_growth_table(found, console)
        report.print_verify_table(found, console)
    if junit_xml is not None:
        report.write_junit(found, junit_xml)


# --------------------------------------------------------------------------- compare and variants

@app.command(cls=_OnceCommand)
def compare(
    paths: Optional[List[Path]] = typer.Argument(
        None, help="Result files (.jsonl) or folders (every .jsonl under them). Default: results/runs.jsonl.",
        show_default=False, metavar="PATHS"),
    x: Optional[str] = typer.Option(None, "--x", help="Column across the table and along the plot's x axis "
                                    "(log2 where positive). Default: seqlen.", metavar="FIELD"),
    metric: str = typer.Option("tflops", "--metric", help="What to show: tflops (TFLOP/s per GPU), efficiency "
                               "(against the same kernel on one rank's share), time (ms, slowest rank) or memory "
                               "(peak allocated GiB). Default: tflops.", show_default=False, metavar="METRIC"),
    by: Optional[str] = typer.Option(None, "--by", help="Comma-separated fields that name a line of the plot and "
                                     "a row of the table; a non-spec column such as source keeps records of one "
                                     "case apart. Default: variant,kernel.", metavar="FIELDS"),
    where: Optional[str] = typer.Option(None, "--where", help="Keep the records for which this pandas query holds, "
                                        "such as 'world_size == 2 and seqlen >= 16384'; spec fields go by their "
                                        "short names, other columns as `env.torch` in backticks. Default: all.",
                                        metavar="QUERY"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw the metric against --x to this .png, .svg "
                                        "or .pdf: one panel per world size and mode, one line per --by value.",
                                        metavar="FILE"),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the table to this file as "
                                            "Markdown.", metavar="FILE"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per table row (per matched case "
                                  "with --baseline) on stdout instead of the table."),
    to_parquet: Optional[Path] = typer.Option(None, "--to-parquet", help="Also write the loaded records (ok, "
                                              "filtered by --where, latest per case) to this Parquet file; "
                                              "needs pyarrow.", metavar="FILE"),
    baseline: Optional[List[Path]] = typer.Option(None, "--baseline", help="Regression gate: the old results "
                                                  "(file or folder; repeat for several). Needs --candidate.",
                                                  metavar="PATH"),
    candidate: Optional[List[Path]] = typer.Option(None, "--candidate", help="Regression gate: the new results, "
                                                   "matched to the baseline case by case (case_id).", metavar="PATH"),
    fail_if: Optional[List[str]] = typer.Option(None, "--fail-if", help="Regression gate rule METRIC:[+-]N%: "
                                                "tflops:-5% fails a case whose TFLOP/s drop more than 5%, "
                                                "time:+5% one whose time grows more than 5%; repeat for several.",
                                                metavar="METRIC:[+-]N%"),
    beyond_spread: bool = typer.Option(False, "--beyond-spread", help="Regression gate: a crossed --fail-if rule "
                                       "fails a case only where the candidate's p20-p80 range of the metric lies "
                                       "wholly beyond the baseline's, on the worse side (else the verdict is 'ok "
                                       "(within spread)'); for tflops and time, from records that hold the "
                                       "quantiles (time_ms_p20, time_ms_p80); other cases are judged by the rule "
                                       "alone. Default: the rule alone."),
) -> None:
    """Turn results into a pivot table, a plot, or a regression verdict (exit 1 on a regression)."""
    err = Console(stderr=True, soft_wrap=True)
    with _usage_errors():
        from ringbench.present import compare as cmp
        if baseline or candidate:
            given = [name for name, value in (("result paths", paths), ("--x", x), ("--by", by),
                                              ("--plot", plot), ("--markdown", markdown),
                                              ("--to-parquet", to_parquet)) if value]
            if given:
                verb = "do" if given[0] == "result paths" else "does"  # the paths are plural, an option one
                raise SpecError(f"{given[0]} {verb} not go with --baseline and --candidate; run the gate "
                                "and the table as two commands")
            if not (baseline and candidate):
                raise SpecError("the regression gate needs both --baseline and --candidate; pass both")
            thresholds = [cmp.parse_threshold(t) for t in fail_if or []]
            if beyond_spread and not thresholds:
                raise SpecError("--beyond-spread qualifies a --fail-if rule, and none was given; pass a rule such as "
                                "--fail-if time:+5%")
            result = cmp.gate(baseline, candidate, thresholds, metric=metric, where=where,
                              beyond_spread=beyond_spread)
            if json_out:
                sys.stdout.write("".join(line + "\n" for line in cmp.gate_json_lines(result)))
            else:
                cmp.print_gate(result, Console())
            sys.stdout.flush()
            raise typer.Exit(EXIT_FAILED if result.regressions else EXIT_OK)
        if fail_if or beyond_spread:
            given = "--fail-if" if fail_if else "--beyond-spread"
            raise SpecError(f"{given} needs --baseline and --candidate; pass the old and the new results")
        for option, path, suffixes in (("--plot", plot, (".png", ".svg", ".pdf")), ("--markdown", markdown, ()),
                                       ("--to-parquet", to_parquet, ())):
            options.check_output(option, path, suffixes)
        columns = [c.strip() for c in (by or "variant,kernel").split(",") if c.strip()]
        if not columns:
            raise SpecError(f"--by {by!r} names no field; pass fields such as variant,kernel")
        loaded = cmp.load_runs(paths or [Path("results") / "runs.jsonl"], where=where, keep_apart=columns)
        table = cmp.pivot(loaded.frame, metric=metric, x=x or "seqlen", by=columns)
        if to_parquet is not None:
            cmp.to_parquet(loaded.frame, to_parquet)
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
        err.print(f"{plural(len(loaded.frame), 'record')} written to {to_parquet}", style="dim", markup=False)
    raise typer.Exit(EXIT_OK)


@app.command("variants", cls=_OnceCommand)
def variants_command(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per variant on stdout instead of "
                                  "the table."),
) -> None:
    """List the variants: layout, form, mask, the kernels they take, and whether they can run here (why not)."""
    from ringbench.present.formatting import compact_table, mask_column
    from ringbench.case.spec import detect_device
    from ringbench.variants import VARIANTS, list_variants
    from ringbench.variants.kernels import KERNELS

    device, _ = detect_device()
    # A varlen variant takes any kernel with a varlen form, so its column names them (flex has none).
    varlen_kernels = [name for name, k in KERNELS.items() if k.varlen]
    rows = []
    for name in list_variants():
        v = VARIANTS[name]
        reason = v.unavailable() or v.check_device(device)
        rows.append({"variant": name, "peer": v.peer, "layouts": [v.layout, *v.layouts],
                     "form": "varlen" if v.varlen else "batch",
                     "masks": [m for m, ok in (("causal", v.causal), ("non-causal", v.non_causal)) if ok],
                     "any_mask": "mask" in v.options,
                     "kernels": list(v.kernels) or (varlen_kernels if v.varlen else None),
                     "available": reason is None, "reason": reason,
                     "summary": v.summary})
    if json_out:
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in rows))
        raise typer.Exit(EXIT_OK)
    table = compact_table(f"ringbench variants (here: {device})")
    # Names, masks and verdicts never wrap; layouts and kernels wrap between names on a narrow terminal, and
    # where that is not enough the table abbreviates known names, with a legend (formatting.FitTable).
    for header, wrap in (("variant", False), ("layout", True), ("form", False), ("mask", False),
                         ("kernels", True), ("here", False)):
        table.add_column(header, no_wrap=not wrap)
    reasons: dict[str, int] = {}  # one note per distinct reason
    for r in rows:
        if r["available"]:
            here = Text("yes", style="green")
        else:
            here = Text(f"no [{reasons.setdefault(r['reason'], len(reasons) + 1)}]", style="yellow")
        table.add_row(r["variant"], ", ".join(r["layouts"]), r["form"], mask_column(r["masks"], r["any_mask"]),
                      ", ".join(r["kernels"] or ["any"]), here)
    console = Console()
    console.print(table)
    for reason, i in reasons.items():
        console.print(Text(f"[{i}] {reason}", style="yellow"))
    if any(r["peer"] and r["kernels"] for r in rows):
        console.print(Text("A peer's kernels are those that can serve its own attention calls (ring-flash-attn's "
                           "flash-attn calls: the flash-attn package where it imports, else ringbench's kernel); "
                           "auto takes the first one available here, and every record names the one that served.",
                           style="dim"))
    raise typer.Exit(EXIT_OK)


# --------------------------------------------------------------------------- matrix

MATRIX_HELP = (
    "Verify every implementation on every mask, dtype and shape, and publish what each gets right.\n\n"
    "Each cell is one verify case against float64 attention, classified as correct, mismatch (the worst tensor and "
    "its error over the allowance), unsupported (the implementation's own reason; never launched), oom, timeout or "
    "error; written as OUT/matrix.md, OUT/matrix.png (one panel per world size) and OUT/matrix.jsonl. Exit 0 once "
    "they are written, whatever the classes.\n\n"
    "The default grid: every implementation (ringbench's variants and the peers) against 23 columns around one base "
    "cell, each changing one thing. Mask: causal, full, sliding window, packed documents, and the named masks of "
    "--mask (a two-sided window, prefix-LM, a shared prompt, chunked, global tokens beside a window); dtype: bf16, fp16, fp32; "
    "shape: head dim 64, 128, 256, MLA 192/128, MHA 8/8, GQA 8/2, MQA 8/1, an odd length (S/W odd); sink: "
    "learnable, off-by-one; padding: padded documents. Base: causal, "
    "bf16, 8 query heads over 2 K/V heads, head dim 128, 256 tokens on cpu or 4096 on cuda (at least 64 per rank, a "
    "multiple of 2W; packed into four "
    "documents for the varlen implementations); world sizes 2 and 4 on cpu. The sliding-window column runs "
    "window = S / 4 and the MLA column head_dim 192 with head_dim_v 128, wherever the implementation takes them.")


@app.command("matrix", cls=_OnceCommand, help=MATRIX_HELP)
def matrix_command(
    ctx: typer.Context,
    device: Optional[str] = typer.Option(None, "--device", help="cuda or cpu. Default: cuda when a GPU is "
                                         "visible, else cpu.", show_default=False, metavar="|".join(DEVICES)),
    world_size: Optional[List[int]] = typer.Option(None, "--world-size", help="A world size (one panel each); "
                                                   "repeat for several. Default: 2 and 4 on cpu; 2, 4 and 8 up "
                                                   "to the visible GPUs on cuda.", show_default=False,
                                                   metavar=options.WORLD_SIZE.name, parser=options.WORLD_SIZE),
    variant: Optional[List[str]] = typer.Option(None, "--variant", help="Keep only this implementation's row; "
                                                "repeat for several. Default: every variant and peer.",
                                                show_default=False, metavar="NAME"),
    axis: Optional[List[str]] = typer.Option(None, "--axis", help="Keep only this axis's columns: mask, dtype, "
                                             "shape, sink or padding; repeat for several. Default: all five.",
                                             show_default=False, metavar="AXIS"),
    out: Path = typer.Option(Path("results/matrix"), "--out", help="Folder for matrix.jsonl (one object per "
                             "cell), matrix.md, matrix.png and the verify records (verify.jsonl). Default: "
                             "results/matrix.", show_default=False, metavar=options.OUT.name, parser=options.OUT),
    timeout: Optional[float] = typer.Option(None, "--timeout", help=TIMEOUT_HELP, show_default=False,
                                          metavar=options.TIMEOUT.name, parser=options.TIMEOUT),
    resume: bool = typer.Option(False, "--resume", help="Reuse every cell that already has a record in "
                                "OUT/verify.jsonl (a mismatch, error or refusal is a result too) and verify only "
                                "the others. Default: verify every cell."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per cell on stdout instead of "
                                  "the summary."),
    yes: bool = typer.Option(False, "--yes", help=YES_HELP),
    test_variants: bool = typer.Option(False, "--test-variants", hidden=True,
                                       help="Add the test-only variants (broken_merge, fault_oom, fault_raise)."),
) -> None:
    """Verify every implementation on every mask, dtype and shape, and publish what each gets right."""
    import os

    from ringbench.present import matrix as mx_render
    from ringbench.sweep import matrix as mx

    if test_variants:
        os.environ["RINGBENCH_TEST_VARIANTS"] = "1"  # torchrun's workers inherit it
    with _usage_errors():
        grid = mx.build_grid(device=device, world_sizes=world_size or None, variants=variant, axes=axis)
        mx.check_runnable(grid)
        options.check_out(out, None, files=("verify.jsonl", "matrix.jsonl", "matrix.md", "matrix.png"))
    code = mx.run(grid, out=out, timeout_s=timeout, resume=resume, launcher=ctx.obj, yes=yes)
    if code:
        raise typer.Exit(code)
    paths = mx_render.write(grid, out)
    if json_out:
        sys.stdout.write("".join(json.dumps(mx_render.cell_object(c)) + "\n" for c in grid.cells))
        sys.stdout.flush()
    else:
        mx_render.print_summary(grid, Console())
    _note(f"{plural(len(grid.cells), 'cell')} written to {paths['md']}, {paths['png']} and {paths['jsonl']}")
    raise typer.Exit(EXIT_OK)


# --------------------------------------------------------------------------- predict, advise, calibrate

GPU_HELP = ("The GPU to predict for: a name of the peaks table (H100, H200, H800, B200, A100...) or a calibration "
            "file (.json); a GPU without a calibration is derived from the nearest calibrated one by the ratio of "
            "their peaks, and the output says so. Default: the --cluster file's gpu, else the first --calibration's "
            "device.")
GPUS_PER_NODE_HELP = "GPUs per node; consecutive ranks share a node. Default: the --cluster file's, else 8."
NODES_HELP = "Nodes of the cluster; world size = gpus-per-node x nodes unless --world-size is given. Default: 1."
WORLD_SIZE_HELP = ("The ranks of the cluster, one per GPU: one node of that many where it fits gpus-per-node, else "
                   "whole nodes of gpus-per-node. Default: gpus-per-node x nodes.")
FABRIC_HELP = ("The links: INTRA or INTRA,INTER, rows of the fabric table (inside a node: nvlink4, h800-nvlink, "
               "nvlink5, nvlink3, a800-nvlink, pcie4, pcie5, h200-nvlink-measured; between nodes: ib-ndr, ib-hdr, "
               "roce-400g). Default: the --cluster file's, else the GPU's usual ones.")
CLUSTER_HELP = ("A cluster file (TOML: gpu, gpus_per_node, nodes, intra, inter, and [fabric.NAME] rows of its "
                "own); the options above override it. Default: none.")
CALIBRATION_HELP = ("A calibration file written by ringbench calibrate, searched before the shipped ones; repeat "
                    "for several. Default: the shipped calibrations.")
PLACEMENT_HELP = ("Where a usp grid's groups sit on a multi-node cluster: ulysses-inner (the Ulysses group of "
                  "consecutive ranks, inside a node: the grid ringbench runs) or ring-inner (the ring's ranks "
                  "consecutive, for comparison). Default: ulysses-inner.")
PLACEMENTS = ("ulysses-inner", "ring-inner")


def _placement(value: str) -> str:
    if value not in PLACEMENTS:
        raise SpecError(f"placement {value!r} is not {' or '.join(PLACEMENTS)}; pass --placement ulysses-inner")
    return value


def _percent(option: str, example: str):
    """The parser of a percentage option such as ``--bound``, whose refusal names it."""
    def read(text: str) -> float:
        raw = text.strip().rstrip("%")
        try:
            value = float(raw) / 100
        except ValueError:
            value = -1.0
        if not 0 < value < 10:
            raise SpecError(f"{option.lstrip('-')} {text!r} is not a percentage above 0, such as {example}; pass "
                            f"{option} {example}")
        return value
    return read


def _prediction_target(case: dict, *, gpu, calibration, cluster, gpus_per_node, nodes, fabric):
    from ringbench.case.fields import BY_NAME
    from ringbench.model.target import target

    dtype = case.get("dtype") or BY_NAME["dtype"].cuda
    return target(gpu=gpu, calibrations=list(calibration or []), cluster_file=cluster, gpus_per_node=gpus_per_node,
                  nodes=nodes, fabric=fabric, dtype=dtype)


#: The case options of how a run measures: predict, which measures nothing, refuses them.
MEASURING = ("emulate", "profile", "iters", "warmup", "min_time_ms", "flush_l2")


def _listed(case: dict, key: str) -> list:
    """A case option's values as a list (a repeatable option gives one, a single one its value; none: [])."""
    given = case.get(key) or []
    return given if isinstance(given, list) else [given]


def _predicted_cases(case: dict, tgt) -> tuple[list, list[str]]:
    """The cases of predict's options at every world size asked, built as run builds them, for the
    target, and the model's refusals of the others (``schedule.refusal``: a peer, a mask an engine's
    steps are not walked under), one sentence each; every case refused is refused with the first."""
    from ringbench.model import schedule
    from ringbench.model.target import world_sizes
    from ringbench.sweep import build

    for name in MEASURING:
        if case.get(name) is not None and case[name] is not False:  # 0 too: --warmup 0 still measures
            option = f"--{name.replace('_', '-')}"
            raise SpecError(f"{option} is a way to measure, and predict measures nothing; drop {option}")
    device = tgt.calibration.device_type
    if case.get("device", device) != device:
        raise SpecError(f"device {case['device']!r} is not the calibration's ({device}, {tgt.calibration.source}); "
                        "drop --device, or pass a calibration of that device (ringbench calibrate --device "
                        f"{case['device']} --out FILE there, then --calibration FILE)")
    if "variant" not in case:
        raise SpecError(build._no_variant_message("run").split(", or --scenario")[0])
    biases = [b for b in _listed(case, "bias") if b]  # "" (or none): no bias
    if biases:  # before the cases are built, so that no rule of the bias's own speaks first
        raise SpecError(schedule.bias_refusal(biases[0]))
    for name in _listed(case, "kernel"):  # the calibration's rule first: its fix offers only what it can price
        tgt.kernel(name)
    # Built with auto, then each kernel asked for held to the kernels' rules with the calibration's kernels as
    # the fixes' choices: a fix naming a kernel the calibration lacks would only be refused next.
    kernels = _listed(case, "kernel") or ["auto"]
    cases = []
    for w in world_sizes(case.pop("world_size", None), tgt):
        given = {**case, "kernel": ["auto"], "world_size": [w], "device": device}
        built, _ = build.build_cases("run", None, given, machine=(device, w), resolve_kernels=False)
        for spec in built:
            for name in kernels:
                if name != "auto":
                    reason = _calibrated_refusal(spec, name, tgt)
                    if reason:
                        raise SpecError(reason)
                cases.append(spec.replace(kernel=name))
    kept, refused = [], []
    for spec in cases:
        reason = schedule.refusal(spec)
        if reason:
            refused.append(reason)
            continue
        tgt.kernel(spec.kernel)  # a kernel the calibration lacks or the GPU cannot run is refused here
        if spec.kernel == "auto":
            # auto: the first calibrated kernel that the GPU runs and that takes the case, as run's auto takes
            # the first available one.
            reasons = {name: _calibrated_refusal(spec, name, tgt) for name in tgt.kernels()}
            takes = [name for name, why in reasons.items() if why is None]
            if not takes:
                refused.append(next(iter(reasons.values())))
                continue
            spec = spec.replace(kernel=takes[0])
        kept.append(spec)
    if not kept:
        raise SpecError(refused[0])
    return kept, list(dict.fromkeys(refused))


def _calibrated_refusal(spec, name: str, tgt) -> Optional[str]:
    """Why kernel ``name`` cannot take ``spec`` (its variant's rule, then the kernels'), in one sentence whose
    fix names only the calibration's kernels (a kernel it lacks would be refused next), or ``None``."""
    from ringbench.case.spec import kernel_refusal
    from ringbench.variants import get_variant
    from ringbench.variants.kernels import KERNELS

    calibrated = {n: KERNELS[n] for n in tgt.kernels() if n in KERNELS}
    return get_variant(spec.variant).check_kernel(name) or kernel_refusal(spec, name, calibrated)


def _predict_record(spec, tgt, placement: str) -> dict:
    from ringbench.model.predict import predict_case
    from ringbench.records.build import build as build_record

    spec = spec.replace(kernel=tgt.kernel(spec.kernel))
    fields = predict_case(spec, calibration=tgt.calibration, kernel=spec.kernel, cluster=tgt.cluster(spec.world_size),
                          place=placement)
    return build_record(spec, run_id=tgt.run_id, status="ok", fields=fields, env=tgt.env())


#: The cluster options predict and advise share (one declaration serves both commands).
_GPU = typer.Option(None, "--gpu", metavar="NAME|FILE", help=GPU_HELP)
_GPUS_PER_NODE = typer.Option(None, "--gpus-per-node", help=GPUS_PER_NODE_HELP, show_default=False, metavar="INT",
                              parser=options.whole("gpus-per-node", "--gpus-per-node", 8))
_NODES = typer.Option(None, "--nodes", help=NODES_HELP, show_default=False, metavar="INT",
                      parser=options.whole("nodes", "--nodes", 1))
# predict takes --world-size with the case options (repeatable); advise takes this one, read as the
# case field reads it and settled against --gpus-per-node and --nodes by the same target.world_sizes.
_WORLD_SIZE = typer.Option(None, "--world-size", help=WORLD_SIZE_HELP, show_default=False,
                           metavar=options.WORLD_SIZE.name, parser=options.WORLD_SIZE)
_FABRIC = typer.Option(None, "--fabric", metavar="NAME", help=FABRIC_HELP)
_CLUSTER = typer.Option(None, "--cluster", metavar="FILE", help=CLUSTER_HELP)
_CALIBRATION = typer.Option(None, "--calibration", metavar="FILE", help=CALIBRATION_HELP)


#: predict's own texts for the case options that mean something else in a prediction than in a run.
PREDICT_CASE_HELPS = {
    "device": ("The device type of the calibration that prices the case, cuda or cpu; a prediction runs nothing, "
               "and a device the calibration was not measured on is refused. Default: the calibration's."),
    "world_size": WORLD_SIZE_HELP.replace(" Default:", f" Repeat for several: one case per value; above {MAX_RANKS} "
                                          "ranks (the most the model walks) it is refused. Default:"),
    "cuda_graph": ("Price each iteration replayed as one CUDA graph (on: no host cost after its one launch), eager "
                   "(off), or as run's auto would choose (auto: replayed only at world size 1, where the host is the "
                   "slower and the replay is predicted faster); records say which in cuda_graph and "
                   "cuda_graph_note. Default: auto."),
    "seed": ("The seed that draws the documents of --doc-dist (0 to 2^63 - 1); a prediction draws no other "
             "input, so without --doc-dist it changes nothing. Default: 0."),
    "kernel": ("The kernel each case is priced with: one the calibration measured (ringbench calibrate --kernel "
               "adds one), or auto: the first calibrated kernel the GPU runs (flash-attn-4 on Hopper, torch-flash "
               "on an A100). Repeat for several: one case per value. Default: auto."),
    "mask": ("The mask each case is priced under, as NAME[:PARAMS]: causal; full; window:L or window:L,R; prefix:P; "
             "shared-prefix:P,answers=A; chunked:C; global:G,window:L; or slices:q0,q1,k0,k1,type;... (each "
             "described in ringbench run --help). Priced on ring, zigzag, stripe, llama3, ulysses and usp, as the "
             "window calls a window-taking kernel makes (one per slice of each partial block); a varlen variant "
             "under a mask is refused. Repeat for several: one case per value. Default: the mask of --causal and "
             "--window."),
}

#: Case options a prediction cannot take at all: left out of predict's --help, and refused, each with
#: its reason, if given (a bias: no calibration rates a kernel call with one; --rotate: torch_cp's).
PREDICT_HIDDEN = ("bias", "rotate")


# predict measures nothing: the options of how to measure stay out of its help, and each is refused in
# a sentence of its own (MEASURING); --seed stays, since it draws --doc-dist's documents.
@options.with_case_options("run", hidden=MEASURING + PREDICT_HIDDEN, scenario=False, helps=PREDICT_CASE_HELPS)
def predict(
    case: dict,
    gpu: Optional[str] = _GPU,
    gpus_per_node: Optional[int] = _GPUS_PER_NODE,
    nodes: Optional[int] = _NODES,
    fabric: Optional[str] = _FABRIC,
    cluster: Optional[Path] = _CLUSTER,
    calibration: Optional[List[Path]] = _CALIBRATION,
    placement: Optional[str] = typer.Option(None, "--placement", metavar="ulysses-inner|ring-inner",
                                            help=PLACEMENT_HELP, show_default=False,
                                            parser=options.ValueType("text", _placement)),
    json_out: bool = typer.Option(False, "--json", help="Print one predicted record per line (predicted: true) on "
                                  "stdout instead of the table."),
    against: Optional[List[Path]] = typer.Option(None, "--against", metavar="FILE", help="Predict every measured run record "
                                                 "of this .jsonl file (ok, with a time) on its own world size and GPU, "
                                                 "and print each one's error, with the median and the worst; repeat "
                                                 "for several files. Other lines are counted as left out, and records "
                                                 "the model cannot predict (peers...) are listed with the reason. The "
                                                 "case options are not taken with it. Exit 1 past the bounds."),
    bound: Optional[float] = typer.Option(None, "--bound", metavar="PERCENT", help="With --against: the largest error "
                                          "allowed for any record, a percentage such as 8%. Default: 8%.",
                                          show_default=False,
                                          parser=options.ValueType("percent", _percent("--bound", "8%"))),
    median_bound: Optional[float] = typer.Option(None, "--median-bound", metavar="PERCENT", help="With --against: the "
                                                 "largest median error allowed, such as 3%. Default: none.",
                                                 show_default=False,
                                                 parser=options.ValueType("percent", _percent("--median-bound", "3%"))),
    min_records: Optional[int] = typer.Option(None, "--min-records", metavar="INT", help="With --against: the fewest "
                                              "records that must be predicted for the check to pass. Default: one.",
                                              show_default=False,
                                              parser=options.whole("min-records", "--min-records", 30)),
    latest: bool = typer.Option(False, "--latest", help="With --against: check each case (case_id) on its last "
                                "record alone, in the order the files are given, where it was measured again (after "
                                "the engine changed, say); the earlier records are counted as left out. Default: every "
                                "record."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="FILE", help="Also append the predicted records "
                                       "(predicted: true) to this .jsonl file, which ringbench compare reads beside "
                                       "measured ones. Default: none.", show_default=False),
) -> None:
    """Predict a variant's time, throughput, memory and traffic on a cluster, from a calibration; runs nothing."""
    from ringbench.model.against import Bound
    from ringbench.sweep import fit
    from ringbench.variants import get_variant

    targets: dict = {}

    def target_of(given: dict):
        # Settled once per dtype (the one case option it reads): the seqlens an offer tries all share it, and
        # each settling reads the calibration and cluster files again.
        key = repr(given.get("dtype"))
        if key not in targets:
            targets[key] = _prediction_target(given, gpu=gpu, calibration=calibration, cluster=cluster,
                                              gpus_per_node=gpus_per_node, nodes=nodes, fabric=fabric)
        return targets[key]

    before = copy.deepcopy(case)

    def offer_refused(seqlen: int) -> Optional[str]:
        """Why predict's checks refuse its options with ``--seqlen seqlen`` (``fit.naming``), so that a
        seqlen a rule offers is held to every rule of the case, as run's and verify's are."""
        at = {**copy.deepcopy(before), "seqlen": [seqlen]}

        def check() -> None:
            options.check_given(at)
            _predicted_cases(at, target_of(at))

        return fit.naming(seqlen, check)

    with _usage_errors():
        if case.get("rotate") and not against:  # before check_given, which would point at torch_cp
            raise SpecError("--rotate is how torch_cp (PyTorch's context parallel, a peer) moves K/V, and predict "
                            "prices ringbench's own engines only; drop --rotate")
        if not against:  # before the masks' own rules: no seqlen they offer makes a mask priced
            from ringbench.model.schedule import engine_mask_refusal

            for text in _listed(case, "mask"):  # refused here only where no variant given prices it
                reasons = [engine_mask_refusal(text, v) for v in _listed(case, "variant")]
                if reasons and all(reasons):
                    raise SpecError(reasons[0])
        with fit.offers_held(offer_refused):
            options.check_given(case)
        if against:
            if out is not None:
                raise SpecError("--out does not go with --against, which writes no records; drop --out")
            _against(against, case, bound=Bound(0.08 if bound is None else bound, median_bound, min_records),
                     gpu=gpu, calibration=calibration, cluster=cluster, gpus_per_node=gpus_per_node, nodes=nodes,
                     fabric=fabric, json_out=json_out, latest=latest)
        for name, value in (("bound", bound), ("median-bound", median_bound), ("min-records", min_records),
                            ("latest", latest or None)):
            if value is not None:
                raise SpecError(f"--{name} bounds the check of --against, which is not given; drop --{name}")
        if out is not None:
            if out.suffix.lower() != ".jsonl":
                raise SpecError(f"--out {str(out)!r} must end in .jsonl, the records' format; pass --out such as "
                                "results/predicted.jsonl")
            options.check_output("--out", out, (), example="results/predicted.jsonl")
        with fit.offers_held(offer_refused):
            tgt = target_of(case)
            cases, refused = _predicted_cases(case, tgt)
        if placement is not None and not any(get_variant(spec.variant).ulysses == "option" for spec in cases):
            from ringbench.variants.rules import listed

            names = list(dict.fromkeys(spec.variant for spec in cases))
            raise SpecError(f"--placement {placement} places the Ulysses and ring groups of a hybrid such as usp, and "
                            f"{listed(names)} {'has' if len(names) == 1 else 'have'} none; drop --placement")
    records = [_predict_record(spec, tgt, placement or PLACEMENTS[0]) for spec in cases]
    if out is not None:
        from ringbench.records.store import append_record

        for record in records:
            append_record(out, record)
    if json_out:
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in records))
    else:
        from ringbench.present.predict import print_predict_table

        print_predict_table(records, Console())
    for reason in refused:
        _note(f"not predicted: {reason}")
    if out is not None:
        _note(f"{plural(len(records), 'predicted record')} appended to {out}")
    raise typer.Exit(EXIT_OK)


def _against(paths: List[Path], case: dict, *, bound, gpu, calibration, cluster, gpus_per_node, nodes, fabric,
             json_out: bool, latest: bool = False) -> None:
    """``predict --against``: every measured record of ``paths`` predicted; exits 0, or 1 past ``bound``."""
    from ringbench.model import against as check

    if case:
        raise SpecError(f"--{sorted(case)[0].replace('_', '-')} does not go with --against, which takes each "
                        "record's own case; drop it")
    if bound.min_records is not None and bound.min_records < 1:
        raise SpecError(f"min-records {bound.min_records} must be 1 or more; pass --min-records such as 30")
    measured = check.measured_records(paths)
    if latest:
        measured = check.latest(measured)
    from ringbench.present.predict import labelled, print_against

    rows = labelled(measured.records, check.compare(measured.records, target_of=lambda rec: check.record_target(
        rec, gpu=gpu, calibrations=calibration or (), cluster_file=cluster, gpus_per_node=gpus_per_node, nodes=nodes,
        fabric=fabric)))
    reason = check.none_predicted(rows, paths)
    if reason:
        raise SpecError(reason)
    summary = {**check.summary(rows, bound), "left_out": measured.left_out_text(),
               "other_gpu": check.other_gpu_note(rows)}
    if json_out:
        sys.stdout.write("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"summary": summary}) + "\n")
    else:
        print_against(rows, summary, Console())
    if summary["other_gpu"]:  # after the table, beside the summary it qualifies
        _note(summary["other_gpu"])
    raise typer.Exit(EXIT_OK if summary["passed"] else EXIT_FAILED)


app.command("predict", cls=_OnceCommand)(predict)


@app.command("advise", cls=_OnceCommand)
def advise_command(
    preset: Optional[str] = typer.Option(None, "--preset", metavar="NAME", help="An attention-shape preset (llama3-8b, llama3-70b, "
                                         "qwen2.5-7b, mha-d64) for heads, kv-heads and head-dim."),
    heads: Optional[int] = typer.Option(None, "--heads", help="Query heads, where no --preset gives them.",
                                        show_default=False, metavar="INT",
                                        parser=options.whole("heads", "--heads", 32)),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="K/V heads, where no --preset gives them.",
                                           show_default=False, metavar="INT",
                                           parser=options.whole("kv-heads", "--kv-heads", 8)),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Channels per head, where no --preset gives "
                                           "them.", show_default=False, metavar="INT",
                                           parser=options.whole("head-dim", "--head-dim", 128)),
    head_dim_v: Optional[int] = typer.Option(None, "--head-dim-v", help="Channels per value head where they "
                                             "differ (MLA). Default: head-dim.", show_default=False,
                                             metavar="INT", parser=options.whole("head-dim-v", "--head-dim-v", 128)),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", metavar="TOKENS", help="Global tokens per sequence, such as "
                                         "128k or 1M.", parser=FIELD_ROWS["seqlen"].value_type),
    docs: Optional[str] = typer.Option(None, "--docs", metavar="LENGTHS", help="Packed documents (lengths summing to --seqlen): "
                                       "advise the varlen variants."),
    doc_dist: Optional[str] = typer.Option(None, "--doc-dist", metavar="DIST", help="A document distribution such as "
                                           "lognormal:mean=4k,sigma=1 instead of --docs."),
    window: Optional[int] = typer.Option(None, "--window", metavar="TOKENS", help="A causal sliding window of this many "
                                         "keys.", parser=FIELD_ROWS["window"].value_type),
    sink: Optional[str] = typer.Option(None, "--sink", metavar="learnable|off-by-one", help="An attention sink: learnable or off-by-one."),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar="bf16|fp16|fp32", help="bf16, fp16 or fp32: one "
                                        "that a kernel of the calibration takes (the GPU kernels: bf16 and fp16; "
                                        "the cpu kernel: fp32), else it is refused. Default: bf16."),
    mode: Optional[str] = typer.Option(None, "--mode", metavar="fwd|fwd_bwd", help="fwd or fwd_bwd. Default: fwd_bwd."),
    kernel: Optional[List[str]] = typer.Option(None, "--kernel", metavar="NAME", help="Only this kernel; repeat for several. "
                                               "Default: every kernel of the calibration that takes the shape."),
    gpu: Optional[str] = _GPU,
    gpus_per_node: Optional[int] = _GPUS_PER_NODE,
    nodes: Optional[int] = _NODES,
    world_size: Optional[int] = _WORLD_SIZE,
    fabric: Optional[str] = _FABRIC,
    cluster: Optional[Path] = _CLUSTER,
    calibration: Optional[List[Path]] = _CALIBRATION,
    both_placements: bool = typer.Option(False, "--both-placements", help="Also rank each usp factorization "
                                         "with its groups placed the other way round (the ring's ranks inside a "
                                         "node), for comparison. Default: the grid's own placement only."),
    top: int = typer.Option(5, "--top", help="How many of the ranked candidates the table shows. Default: 5.",
                            show_default=False, metavar="INT", parser=options.whole("top", "--top", 5)),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object per candidate (ranked, then those "
                                  "that do not fit, then the refused ones) with its prediction and commands."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE", help="Also draw the predicted time against "
                                        "world size (every power of two up to the cluster's, the same sequence) of "
                                        "the best candidate of each of the leading variants, to this .png, .svg or "
                                        ".pdf. Default: none.", show_default=False),
) -> None:
    """Rank every variant, layout, Ulysses factorization and kernel for a model, a sequence and a cluster."""
    from ringbench.case.scenarios import SHAPE_PRESETS

    with _usage_errors():
        if preset is not None and preset not in SHAPE_PRESETS:
            raise SpecError(f"preset {preset!r} is not a shape preset; choose one of {', '.join(SHAPE_PRESETS)}")
        shape = dict(SHAPE_PRESETS.get(preset, {}))
        for key, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if value is not None:
                if preset is not None:
                    raise SpecError(f"--{key.replace('_', '-')} does not go with --preset {preset}, which sets it; "
                                    "drop one")
                shape[key] = value
        missing = [k for k in ("heads", "kv_heads", "head_dim") if k not in shape]
        if missing:
            raise SpecError(f"the model's {missing[0].replace('_', ' ')} are not given; pass --preset (such as "
                            f"llama3-70b) or --{missing[0].replace('_', '-')}")
        if seqlen is None:
            raise SpecError("no sequence length was given; pass --seqlen, such as 1M")
        for key, value in (("head_dim_v", head_dim_v), ("seqlen", seqlen), ("docs", docs), ("doc_dist", doc_dist),
                           ("window", window), ("sink", sink), ("dtype", dtype), ("mode", mode)):
            if value is not None:
                shape[key] = value
        from ringbench.case.spec import check_fields
        from ringbench.case.fields import coerce

        shape = {k: coerce(k, v) for k, v in shape.items()}
        check_fields(shape)
        if world_size is not None:
            check_fields({"world_size": world_size})
        options.check_output("--plot", plot, (".png", ".svg", ".pdf"))
        if top < 1:
            raise SpecError(f"top {top} must be 1 or more: it is how many ranked candidates the table shows; pass "
                            "--top 5, say")
        tgt = _prediction_target(shape, gpu=gpu, calibration=calibration, cluster=cluster,
                                 gpus_per_node=gpus_per_node, nodes=nodes, fabric=fabric)
        kernels = list(dict.fromkeys(kernel or tgt.calibration.kernels))
        for name in kernels:  # one the GPU cannot run is listed as refused, with the reason
            tgt.calibration.kernel(name)
        from ringbench.model import advise as adv

        reason = adv.dtype_refusal(shape.get("dtype"), kernels)
        if reason:
            raise SpecError(reason)
        from ringbench.model.target import world_sizes
        from ringbench.sweep import build

        (world_size,) = world_sizes([world_size] if world_size is not None else None, tgt)
        nodes_n = tgt.cluster(world_size).nodes
        device = tgt.calibration.device_type

        def build_at(fields: dict, w: int):
            # Built with auto, then the candidate's kernel held to the kernels' rules among the calibration's.
            cases, _ = build.build_cases("run", None, {**fields, "kernel": "auto", "world_size": [w],
                                                       "device": device}, machine=(device, w), resolve_kernels=False)
            kernel = fields.get("kernel") or "auto"
            reason = _calibrated_refusal(cases[0], kernel, tgt) if kernel != "auto" else None
            if reason:
                raise SpecError(reason)
            return cases[0].replace(kernel=kernel)

        cands = adv.candidates(shape, world_size=world_size, nodes=nodes_n, kernels=kernels, device=device,
                               both_placements=both_placements)
    memory_gib = tgt.gpu.memory_gib if tgt.gpu else None
    with _candidates_progress(len(cands)) as shown:
        ranked = adv.advise(cands, build=lambda fields: build_at(fields, world_size), tgt=tgt,
                            world_size=world_size, memory_gib=memory_gib, progress=shown)
    if ranked and all(c.refusal for c in ranked):  # a refusal: no table, no note on a model that priced nothing
        from ringbench.present.predict import refusal_lines

        if json_out:  # the refused candidates as the help says, then the refusal on stderr
            sys.stdout.write("".join(json.dumps(adv.entry(c, None)) + "\n" for c in ranked))
        else:
            for line in refusal_lines(ranked):
                _note(line)
        _error(f"every one of the {plural(len(ranked), 'candidate')} is refused at this shape and cluster, so "
               "nothing was ranked; change what the refusals " + ("on stdout" if json_out else "above") + " name")
        raise typer.Exit(EXIT_USAGE)
    if json_out:
        order = {id(c): i + 1 for i, c in enumerate(c for c in ranked if c.record and c.fits)}
        sys.stdout.write("".join(json.dumps(adv.entry(c, order.get(id(c)))) + "\n" for c in ranked))
    else:
        from ringbench.present.predict import print_advice

        print_advice(ranked, Console(), top=top, cluster=tgt.cluster(world_size).describe(),
                     calibration=tgt.calibration.provenance())
    if plot is not None:
        _advise_plot(plot, ranked, shape, tgt, world_size, build_at, memory_gib)
    raise typer.Exit(EXIT_OK)


@contextlib.contextmanager
def _candidates_progress(total: int):
    """A progress bar on stderr over advise's candidates, gone when they are done; none where stderr is not
    a terminal (a script reads stdout alone). Yields ``shown(i, candidate)``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    columns = (TextColumn("candidate {task.fields[at]} of {task.total:.0f}"), BarColumn(bar_width=16),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("", total=total, at=0)

        def shown(i: int, candidate) -> None:
            bar.update(task, completed=i, at=i + 1, description=candidate.label)  # the finished ones and this

        yield shown


def _advise_plot(path: Path, ranked: list, shape: dict, tgt, world_size: int, build_at, memory_gib) -> None:
    """``advise --plot``: the leading variants predicted at every plotted world size, drawn to ``path``."""
    from ringbench.case.fields import format_size
    from ringbench.model import advise as adv
    from ringbench.present.advise_plot import plot_scaling

    leaders = adv.leaders(ranked)
    if not leaders:
        _note(f"no plot written to {path}: no candidate fits in the GPU's memory")
        return
    per = tgt.cluster(world_size).gpus_per_node
    series = adv.scaling(leaders, build=build_at, tgt=tgt, world_sizes=adv.plot_world_sizes(world_size, per),
                         memory_gib=memory_gib)
    heads = f"{shape['heads']}/{shape['kv_heads']} heads x {shape['head_dim']}"
    title = f"ringbench advise: {heads}, seqlen {format_size(shape['seqlen'])}, {shape.get('mode') or 'fwd_bwd'}"
    calibration = tgt.calibration.provenance().split(" (")[0]  # its first words: measured or derived, from what
    plot_scaling(series, path, title=title, subtitle=f"{tgt.gpu_name}, {per} per node; calibration: {calibration}")
    _note(f"plot of {plural(len(series), 'leading variant')} against world size written to {path}")


@app.command("calibrate", cls=_OnceCommand)
def calibrate_command(
    device: Optional[str] = typer.Option(None, "--device", metavar="cuda|cpu", help="cuda or cpu. Default: cuda when a GPU is visible, "
                                         "else cpu.", show_default=False),
    kernel: Optional[List[str]] = typer.Option(None, "--kernel", metavar="NAME", help="A kernel to calibrate; repeat for several. "
                                               "Default: every kernel available here (cuda: flash-attn-4, flash-attn, "
                                               "torch-flash, cudnn where they import; cpu: cpu)."),
    out: Path = typer.Option(Path("results/calibration.json"), "--out", metavar="FILE", help="The calibration file to write. "
                             "Default: results/calibration.json.", show_default=False),
) -> None:
    """Measure the kernels' rates and the per-step overheads on this machine and write a calibration file."""
    with _usage_errors():
        if device not in (None, "cpu", "cuda"):
            raise SpecError(f"device {device!r} is not cuda or cpu; pass --device cuda or --device cpu")
        if out.suffix.lower() != ".json":
            raise SpecError(f"--out {str(out)!r} must end in .json, the calibration's format; pass --out such as "
                            "results/calibration.json")
        options.check_output("--out", out, (), example="results/calibration.json")
        from ringbench.case.spec import detect_device
        from ringbench.model import calibrate
        from ringbench.variants.kernels import AUTO_ORDER, KERNELS, resolve_kernel

        machine, _ = detect_device()
        device = device or machine
        if device == "cuda" and machine != "cuda":
            raise SpecError("device cuda needs a visible GPU and none is visible; run on a GPU machine or pass "
                            "--device cpu")
        grid = calibrate.default_grid(device)
        # By default the kernels auto may pick but math (the reference); flex, which auto never picks, is named.
        names = list(dict.fromkeys(kernel or [])) or [
            n for n in AUTO_ORDER[device] if n != "math" and KERNELS[n].why_unavailable() is None]
        for name in names:
            try:
                resolve_kernel(name, device)
            except ValueError as exc:
                raise SpecError(str(exc)) from None
    result = calibrate.measure(device=device, kernels=names, grid=grid, say=_note)
    calibrate.write(result, out)
    _note(f"calibration of {result['device']} ({', '.join(names)}) written to {out} in {result['elapsed_s']:.0f} s")
    raise typer.Exit(EXIT_OK)


# --------------------------------------------------------------------------- messages

def _note(message: str) -> None:
    Console(stderr=True, soft_wrap=True).print(message, style="dim", markup=False)


def _error(message: str) -> None:
    Console(stderr=True, soft_wrap=True).print(Text(message, style="red"))


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """Turn what ringbench refuses (a RingbenchError) into one red sentence on stderr and exit code 2."""
    try:
        yield
    except RingbenchError as exc:
        _error(str(exc))
        raise typer.Exit(EXIT_USAGE) from None


if __name__ == "__main__":  # python -m ringbench.cli, as the end-to-end tests run it
    app(prog_name="ringbench")
