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
from ringbench.case.fields import DEVICES
from ringbench.case.types import Refused
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
    from ringbench.sweep import build, run as sweep

    with _usage_errors():
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
    from ringbench.present.formatting import compact_table
    from ringbench.case.spec import detect_device
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
    # Names and verdicts never wrap; layouts and kernels wrap between names on a narrow terminal, and
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
        table.add_row(r["variant"], ", ".join(r["layouts"]), r["form"], "both" if len(r["masks"]) == 2 else r["masks"][0],
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
    "The default grid: every implementation (ringbench's variants and the peers) against 18 columns around one base "
    "cell, each changing one thing. Mask: causal, full, sliding window, packed documents; dtype: bf16, fp16, fp32; "
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
