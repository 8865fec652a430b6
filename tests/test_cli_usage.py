"""The CLI: usage errors, help, and the launch loop with stand-in harness modules (no processes)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringbench.cli import app
from ringbench.variants import list_variants

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
#: Every launch here is a stand-in's: the CPU rate is measured once, not before each (conftest.py).
pytestmark = pytest.mark.usefixtures("rate_measured_once")


@dataclass
class FakeLaunchResult:
    returncode: int
    timed_out: bool
    log_dir: Path
    failure: str | None


class FakeLauncher:
    """A launcher the CLI is handed (``app(obj=...)``) in place of torchrun: it writes each case's
    record into the real results file, as the workers would, and records what it was asked.

    ``outcome(case) -> status or None`` decides each case's record; None leaves it unreported.
    """

    def __init__(self, outcome=lambda case: "ok", timed_out=False, failure=None):
        self.launches: list[dict] = []
        self.outcome, self.timed_out, self.failure = outcome, timed_out, failure

    def launch(self, cases, *, world_size, device, results_path, run_id, timeout_s, on_poll=None):
        from ringbench.records import build as records, store as results
        from ringbench.case.spec import CaseSpec

        self.launches.append({"cases": cases, "world_size": world_size, "device": device, "timeout_s": timeout_s})
        for case in cases:
            status = self.outcome(case)
            if status is not None:
                results.append_record(results_path, records.build(CaseSpec.from_dict(case), run_id=run_id,
                                                                  status=status))
            if on_poll is not None:
                on_poll()
        return FakeLaunchResult(1 if self.failure else 0, self.timed_out, Path("logs"), self.failure)


def invoke(args, launcher=None):
    return runner.invoke(app, args, obj=launcher)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def harness(monkeypatch, tmp_path):
    """A launcher, with the working folder moved to an empty one (so a default results/ would show)."""
    monkeypatch.chdir(tmp_path)
    return FakeLauncher()


# --------------------------------------------------------------------------- usage errors

@pytest.mark.parametrize("args, pattern", [
    (["run", "--variant", "nope"], r"^variant 'nope' is unknown; choose one of " + re.escape(", ".join(list_variants())) + "$"),
    (["run", "--variant", "zigzag", "--seqlen", "12q"],
     r"^seqlen '12q' is not a size; use a whole number with an optional k or M suffix, such as 4096 or 128k$"),
    (["run", "--variant", "zigzag", "--seqlen", "3004", "--world-size", "4"],
     r"^seqlen 3004 is not a multiple of 2 \* world_size = 8, which zigzag needs; use 3008$"),
    (["run", "--dtype", "fp8"], r"^dtype 'fp8' is unknown; pass --dtype with one of bf16, fp16, fp32, fp64$"),
    (["run", "--seqlen", "4k"], r"^no variant was given; pass --variant with one of " + re.escape(", ".join(list_variants())) + ", or --scenario$"),
    (["run", "--variant", "ring", "--heads", "6", "--kv-heads", "4"], r"^heads 6 is not a multiple of kv_heads 4"),
    (["run", "--variant", "ring", "--world-size", "0"], r"^world_size 0 must be positive"),
    (["run", "--variant", "ring", "--mode", "bwd"], r"^mode 'bwd' is unknown"),
    (["run", "--variant", "ring", "--timeout", "0"], r"^timeout 0 must be positive"),
    # A seed torch's generator cannot take passed the check, then failed on every rank (issue 27).
    (["run", "--variant", "ring", "--seed", str(2 ** 63)],
     r"^seed 9223372036854775808 must be below 2\^63 = 9223372036854775808, the seeds torch's generator takes; "
     r"pass --seed with a smaller value, such as 0$"),
    (["verify", "--variant", "ring", "--seed", str(10 ** 30)], r"^seed 1000000000000000000000000000000 must be below 2\^63"),
    (["run", "--variant", "ring", "--device", "cpu", "--kernel", "cudnn"], r"^kernel 'cudnn' runs on cuda, not cpu"),
    (["verify", "--scenario", "/nonexistent.toml"], r"^scenario '/nonexistent\.toml' is neither a built-in"),
    (["verify", "--variant", "nope"], r"^variant 'nope' is unknown"),
    (["verify", "--world-size", "3"], r"^scenario smoke \(built-in\) case 1 of \d+ \(ring, world_size 3, seqlen 520, "
                                      r"kernel cpu\): seqlen 520 is not a multiple of world_size = 3"),
    (["compare", "/nonexistent/runs.jsonl"], r"^results path '/nonexistent/runs\.jsonl' does not exist; pass a "
                                             r"\.jsonl file or a folder"),
    (["run", "--variant", "ring", "--seqlen", "-4k"], r"^seqlen '-4k' must be positive"),
    (["run", "--variant", "ring", "--seqlen", "0"], r"^seqlen '0' must be positive"),
    (["run", "--variant", "ring", "--seqlen", "4096M"], r"^seqlen '4096M' is 4294967296 tokens, above the limit"),
    (["run", "--variant", "ring", "--head-dim", "0"], r"^head_dim 0 must be positive; pass --head-dim 1 or more$"),
    (["run", "--variant", "ring", "--device", "cuda"], r"^device cuda needs a visible GPU and none is visible"),
    (["run", "--variant", "ring_varlen", "--seqlen", "4k", "--docs", "1k,1k"],
     r"^documents sum to 2048 but seqlen is 4096; .* pass --seqlen 2048"),
    (["run", "--variant", "ring", "--nnodes", "2", "--rdzv-endpoint", "node001"],
     r"^rdzv-endpoint 'node001' is not HOST:PORT with a port from 1 to 65535; pass --rdzv-endpoint"),
    (["verify", "--nnodes", "2", "--rdzv-endpoint", "node001:70000"], r"^rdzv-endpoint 'node001:70000' is not HOST:PORT"),
    (["run", "--variant", "ring", "--nnodes", "2"], r"^nnodes 2 needs a rendezvous every node can reach; pass "
                                                     r"--rdzv-endpoint HOST:PORT"),
    (["run", "--variant", "ring", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
     r"^node-rank 2 must be from 0 to nnodes - 1 = 1"),
    (["run", "--variant", "ring", "--device", "cpu", "--world-size", "3", "--nnodes", "2", "--rdzv-endpoint", "h:1"],
     r"^world_size 3 is not a multiple of nnodes 2, .*; pass --world-size 4$"),
    (["run", "--variant", "ring", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--resume"],
     r"^--resume reads the records, which only node 0 has"),
    # Peers: where they run, with what, and what they take.
    (["verify", "--variant", "torch_cp"], r"^torch_cp runs on CUDA only, and verify's default scenario, smoke, runs "
                                          r"on CPU; on a GPU machine pass --scenario ci-nightly --variant torch_cp$"),
    (["verify", "--variant", "zigzag", "--rotate", "alltoall"], r"^zigzag takes no rotate; it is an option of torch_cp"),
    (["verify", "--seqlen", "1k"], r"^no variant was given; pass --variant with one of .*, or --scenario; verify with "
                                   r"no case option but --world-size, --kernel, --device, --repeat or --require-deterministic checks "
                                   r"the smoke scenario$"),
    (["verify", "--variant", "zigzag", "--seqlen", "3004", "--world-size", "2", "--world-size", "4"],
     r"^seqlen 3004 is not a multiple of 8, which zigzag needs to cut it at every world size given \(2, 4\); "
     r"use 3008$"),
    (["run", "--variant", "zigzag", "--batch", "two"], r"^batch 'two' is not a whole number; pass --batch with an "
                                                       r"integer, such as 1$"),
    (["verify", "--variant", "zigzag", "--world-size", "x"], r"^world_size 'x' is not a whole number"),
    (["run", "--variant", "zigzag", "--world-size", "3", "--world-size", "4", "--seqlen", "4k"],
     r"^seqlen 4096 is not a multiple of 24, which zigzag needs to cut it at every world size given \(3, 4\); "
     r"use 4104$"),
    (["run", "--variant", "torch_cp", "--device", "cpu"],
     r"^torch_cp cannot run on cpu: PyTorch's context parallel dispatches only its CUDA SDPA backends "
     r"\(flash, efficient, cuDNN\); run it on a machine with a CUDA GPU with --device cuda$"),
    # rfa_* run on CPU (ringbench's kernels serve ring-flash-attn's flash-attn calls), with those kernels only.
    (["run", "--variant", "rfa_zigzag", "--device", "cpu", "--kernel", "cudnn"],
     r"^kernel 'cudnn' is not one rfa_zigzag runs with, since it brings its own attention calls; pass --kernel "
     r"flash-attn, torch-flash, cpu or math$"),
    (["run", "--variant", "rfa_zigzag", "--device", "cpu", "--kernel", "torch-flash"],
     r"^kernel 'torch-flash' runs on cuda, not cpu; pass --kernel with one of cpu, flex, math or auto$"),
    (["verify", "--variant", "rfa_zigzag", "--no-causal", "--seqlen", "1k"],
     r"^rfa_zigzag does not support non-causal attention; pass --causal$"),
    (["run", "--variant", "torch_cp", "--device", "cpu", "--kernel", "cpu"], r"^torch_cp cannot run on cpu"),
    (["run", "--variant", "torch_cp", "--no-causal"], r"^torch_cp does not support non-causal attention; pass --causal$"),
    (["run", "--variant", "torch_cp", "--rotate", "ring"], r"^rotate 'ring' is unknown; pass --rotate with one of "
                                                           r"allgather, alltoall$"),
    (["run", "--variant", "zigzag", "--rotate", "alltoall"], r"^zigzag takes no rotate; it is an option of torch_cp"),
    (["run", "--variant", "fault_unavailable", "--device", "cpu"],
     r"^variant fault_unavailable is unavailable here: test only: its library is never installed$"),
    # An option of one value given twice with different values (click would keep the last).
    (["run", "--variant", "llama3_varlen", "--layout", "balanced", "--layout=contiguous"],
     r"^--layout was given twice \(--layout balanced, then --layout contiguous\); it takes one value, so give it once$"),
    (["verify", "--variant", "zigzag", "--dtype", "bf16", "--heads", "8", "--dtype", "fp32"],
     r"^--dtype was given twice \(--dtype bf16, then --dtype fp32\)"),
    (["verify", "--variant", "zigzag", "--causal", "--no-causal"], r"^--causal and --no-causal were both given; give one$"),
    # Typed options that are not case fields are read by ringbench too: one sentence, not click's box.
    (["matrix", "--world-size", "two"], r"^world_size 'two' is not a whole number; pass --world-size with an "
                                        r"integer, such as 2$"),
    (["matrix", "--timeout", "abc"], r"^timeout 'abc' is not a number of seconds; pass --timeout with a number, "
                                     r"such as 600$"),
    (["run", "--variant", "ring", "--nnodes", "x"], r"^nnodes 'x' is not a whole number; pass --nnodes with an "
                                                    r"integer, such as 1$"),
    (["verify", "--variant", "ring", "--node-rank", "first"], r"^node-rank 'first' is not a whole number; pass "
                                                              r"--node-rank with an integer, such as 0$"),
    (["run", "--variant", "ring", "--timeout", "abc"], r"^timeout 'abc' is not a number of seconds"),
    # heads % kv_heads before the Ulysses degree, whose fix would assume heads the rule refuses.
    (["verify", "--variant", "usp", "--world-size", "4", "--ulysses-degree", "4", "--heads", "8", "--kv-heads", "3"],
     r"^heads 8 is not a multiple of kv_heads 3; pass --kv-heads with a divisor of 8, such as 2$"),
    (["verify", "--variant", "usp", "--ulysses-degree", "-2"],
     r"^ulysses_degree -2 is negative; pass --ulysses-degree with a positive divisor of the world size, 0 for the "
     r"largest the heads allow, or auto$"),
    (["verify", "--variant", "usp", "--ulysses-degree", "-1"], r"^ulysses_degree -1 is negative"),
    # Documents off the per-document multiple are named first, every one, before the seqlen and sum rules.
    (["verify", "--variant", "ring_varlen", "--world-size", "4", "--docs", "102,156", "--seqlen", "258"],
     r"^document 1 has 102 tokens, not a multiple of world_size = 4, which ring_varlen needs for every document; "
     r"pass --docs 104,156 --seqlen 260, or pad the documents with --doc-pad 4 --seqlen 260$"),
    (["verify", "--variant", "ring_varlen", "--world-size", "4", "--docs", "102,154", "--seqlen", "256"],
     r"^documents 1 and 2 have 102 and 154 tokens, not multiples of world_size = 4, which ring_varlen needs for every "
     r"document; pass --docs 104,152, pad the documents with --doc-pad 4 --seqlen 260, or use --variant "
     r"llama3_varlen, which takes any document lengths$"),
    (["run", "--variant", "zigzag_varlen", "--world-size", "2", "--world-size", "4", "--docs", "96,164",
      "--seqlen", "256"],
     r"^document 2 has 164 tokens, not a multiple of 8, which zigzag_varlen needs for every document at every "
     r"world size given \(2, 4\); pass --docs 96,160, "),
])
def test_cli_bad_input_exits_2_with_one_sentence(harness, args, pattern):
    result = invoke(args, harness)
    assert result.exit_code == 2, result.output
    assert re.search(pattern, result.stderr.strip()), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output and result.stdout == ""
    assert harness.launches == [] and not list(Path(".").rglob("*.jsonl"))


def slow(args: list[str]):
    """A parametrize entry of ``args``, marked slow."""
    return pytest.param(args, marks=pytest.mark.slow)


def _follow(args: list[str], fix: str) -> list[str]:
    """``args`` with the options one fix of a refusal names (``pass --docs 104,152 --seqlen 260``)
    set: the value of one given already replaced, the others added."""
    args = list(args)
    for option, value in re.findall(r"(--[\w-]+) (\S+)", fix):
        if option in args:
            args[args.index(option) + 1] = value
        else:
            args += [option, value]
    return args


@pytest.mark.parametrize("args", [
    ["--variant", "ring_varlen", "--world-size", "4", "--docs", "102,156", "--seqlen", "258"],
    ["--variant", "ring_varlen", "--world-size", "4", "--docs", "102,156", "--seqlen", "260"],
    ["--variant", "ring_varlen", "--world-size", "4", "--docs", "102,154", "--seqlen", "256"],
    ["--variant", "ring_varlen", "--world-size", "4", "--docs", "102,154"],
    ["--variant", "ring_varlen", "--world-size", "4", "--docs", "102,154", "--no-causal", "--seqlen", "256"],
    ["--variant", "zigzag_varlen", "--world-size", "4", "--docs", "100,900,3096", "--seqlen", "4096"],
    ["--variant", "zigzag_varlen", "--world-size", "4", "--docs", "5,3,1000", "--seqlen", "1008"],
    ["--variant", "zigzag_varlen", "--world-size", "4", "--docs", "100,300,612", "--doc-pad", "7", "--seqlen", "1024"],
    ["--variant", "usp_varlen", "--world-size", "4", "--heads", "4", "--docs", "102,154", "--seqlen", "256"],
    ["--variant", "zigzag_varlen", "--world-size", "2", "--world-size", "4", "--docs", "96,164", "--seqlen", "256"],
    # The rest are slow (0.6-1.9 s each on two cores; the quick subset keeps one of each refusal's kind above).
    slow(["--variant", "ring_varlen", "--world-size", "3", "--world-size", "4", "--docs", "102,154", "--seqlen", "258"]),
    slow(["--variant", "zigzag_varlen", "--world-size", "4", "--docs", ",".join(["1"] * 64 + ["192"]), "--seqlen",
          "256"]),
    # Under --model, which fixes the seqlen: no fix may need another one (issue 27: --seqlen 704).
    ["--model", "llama-tiny", "--variant", "zigzag_varlen", "--world-size", "4", "--docs",
     ",".join(["1"] * 64 + ["192"])],
    slow(["--model", "llama-tiny", "--variant", "zigzag_varlen", "--world-size", "4", "--docs", "1,255"]),
    slow(["--model", "llama-tiny", "--variant", "zigzag_varlen", "--world-size", "2", "--world-size", "4", "--docs",
          "1,255"]),
    slow(["--model", "qwen2-tiny", "--variant", "usp_varlen", "--world-size", "4", "--docs", "100,156"]),
])
def test_cli_every_fix_a_document_refusal_offers_is_accepted(harness, args):
    """Each fix the sentence offers (--docs, --doc-pad or another variant, with the --seqlen they
    fill) is a case that runs: no advice leads to a refusal of its own (a new user's report: use
    260, then pass --seqlen 258)."""
    result = invoke(["verify", *args], harness)
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert re.match(r"^(doc_pad \d+ pads )?documents? [\d, and]+ (has|have|to) |^64 documents of 1 token are not ",
                    message), message
    assert "--model" not in args or "--seqlen" not in message, message
    offered = message.split("; ", 1)[1].replace(", which takes any document lengths", "")
    fixes = re.split(r", (?:or )?", offered)
    assert all(re.search(r"--[\w-]+ \S", fix) for fix in fixes), fixes
    for fix in fixes:
        followed = _follow(args, fix)
        accepted = invoke(["verify", *followed], harness)
        assert accepted.exit_code == 0, (fix, followed, accepted.output)


def test_cli_scenario_syntax_error_names_the_line(harness, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[sweep]\nvariant = ["ring",\nheads = 4\n')
    result = invoke(["verify", "--scenario", str(path)], harness)
    assert result.exit_code == 2
    assert re.search(r"bad\.toml is not valid TOML: .*line 3", result.stderr)
    assert harness.launches == []


@pytest.mark.parametrize("args, words", [
    (["--help"], ["run", "verify", "compare", "Exit codes"]),
    (["run", "--help"], ["--variant", "--seqlen", "128k", "--world-size", "--batch", "--heads", "--kv-heads",
                         "--head-dim", "--dtype", "--causal", "--no-causal", "--mode", "--kernel", "--iters",
                         "--warmup", "--seed", "--out", "--json", "--timeout", "--resume", "Default"]),
    (["verify", "--help"], ["--variant", "--scenario", "--world-size", "--kernel", "--junit-xml", "--json", "--out",
                            "--timeout", "--resume", "smoke"]),
    (["compare", "--help"], ["--x", "--metric", "--by", "--where", "--plot", "--markdown", "--json", "--to-parquet",
                             "--baseline", "--candidate", "--fail-if", "tflops:-5%"]),
])
def test_cli_help_exits_0_and_lists_options(args, words):
    result = runner.invoke(app, args)
    assert result.exit_code == 0
    for word in words:
        assert word in result.stdout, word


def test_predict_help_says_nothing_of_scenarios_it_does_not_take():
    """predict takes no --scenario; its option texts spoke of one (found when tried as a new user would)."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["predict", "--help"])
    assert result.exit_code == 0
    assert "scenario" not in result.stdout.lower()
    assert "one case per value. Default: none.  " in result.stdout  # --variant: the clause before it stays
    assert "--scenario" in CliRunner(env={"COLUMNS": "200"}).invoke(app, ["run", "--help"]).stdout


def _commands():
    """The click commands of ``ringbench`` and its subcommands, each with a context, as --help sees them."""
    import typer

    group = typer.main.get_command(app)
    out = []
    for name in [None, *group.list_commands(None)]:
        command = group if name is None else group.get_command(None, name)
        out.append((name, command, command.make_context(name or "ringbench", [], resilient_parsing=True)))
    return out


@pytest.mark.parametrize("width", [40, 80])
@pytest.mark.parametrize("name", [None, "run", "verify", "compare", "variants", "matrix"])
def test_cli_help_wraps_every_word_whole_at_narrow_terminals(width, name):
    """At 40 columns typer's table cut names and words with an ellipsis (--vari…, contex…), at 80 it cut
    --require-determinist… and lognormal:mean=4k,sig… (issue 27, item 4): every option's names, the name of
    its value and every word of its help and of the command's text are printed whole, within the width."""
    from collections import Counter

    command, ctx = next((c, x) for n, c, x in _commands() if n == name)
    result = CliRunner(env={"COLUMNS": str(width), "NO_COLOR": "1"}).invoke(app, [*([name] if name else []),
                                                                              "--help"])
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert max(map(len, result.stdout.splitlines())) <= width
    printed = Counter(re.sub(r"[│╭╮╰╯─]", " ", result.stdout).split())
    expected = Counter((command.help or "").split())
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        names = "/".join([", ".join(param.opts), *param.secondary_opts]) if param.param_type_name == "option" else ""
        value = (param.metavar or "") + ("..." if param.param_type_name == "argument" and param.nargs != 1 else "")
        expected.update([*names.split(), *(param.help or "").split(), *([value] if value else [])])
    if name is None:
        for sub in command.list_commands(ctx):
            expected.update([sub, *inspect_first_paragraph(command.get_command(ctx, sub).help)])
    missing = expected - printed
    assert not missing, (dict(missing), result.stdout)


def inspect_first_paragraph(text: str) -> list[str]:
    import inspect

    return inspect.cleandoc(text).split("\n\n")[0].split()


def test_cli_help_names_what_each_value_is():
    """--help showed <str> for integer options (the text their parser reads) and <bool> for flags."""
    result = runner.invoke(app, ["run", "--help"])
    assert result.exit_code == 0
    for shown in ("--world-size INT", "--seqlen TOKENS", "--window TOKENS", "--heads INT", "--timeout SECONDS",
                  "--out FOLDER", "--dtype bf16|fp16|fp32|fp64", "--ulysses-degree INT|auto", "--nnodes INT",
                  "--device cuda|cpu", "--docs LENGTHS", "--rdzv-endpoint HOST:PORT"):
        assert shown in result.stdout, shown
    assert re.search(r"--json {2,}Print", result.stdout) and re.search(r"--causal/--no-causal {2,}Causal", result.stdout)
    assert not re.search(r"<(str|int|float|bool|path|Path|list)\b|\bTEXT\b", result.stdout)
    # A value named INT is read as a whole number, TOKENS as a size: the name says what the parser takes.
    checked = 0
    for name, command, ctx in _commands():
        for param in command.get_params(ctx):
            if param.param_type_name != "option" or param.is_flag:
                continue
            assert param.metavar, (name, param.opts)
            if param.metavar in ("INT", "TOKENS"):
                refused = runner.invoke(app, [name, param.opts[0], "x"])
                assert refused.exit_code == 2, refused.output
                assert re.search(r"'x' is not (a whole number|a size)", refused.stderr), (param.opts, refused.stderr)
                checked += 1
    assert checked > 15


# --------------------------------------------------------------------------- launch loop (stand-ins)

def test_cli_verify_default_runs_smoke_on_cpu_grouped_by_world_size(harness, tmp_path):
    result = invoke(["verify", "--out", str(tmp_path), "--junit-xml", str(tmp_path / "j" / "v.xml")], harness)
    assert result.exit_code == 0, result.output
    assert [(g["world_size"], g["device"]) for g in harness.launches] == [(1, "cpu"), (2, "cpu"), (4, "cpu"), (8, "cpu")]
    cases = [c for g in harness.launches for c in g["cases"]]
    # The cpu kernel, but for the masked cases: math is the kernel that takes a partial block's mask.
    assert len(cases) > 0 and {c["kernel"] for c in cases if not c["mask"]} == {"cpu"}
    assert {c["kernel"] for c in cases if c["mask"]} == {"math"} and {c["task"] for c in cases} == {"verify"}
    assert all(c["world_size"] == g["world_size"] for g in harness.launches for c in g["cases"])
    assert len(lines(tmp_path / "verify.jsonl")) == len(cases)
    assert f"{len(cases)} cases:" in result.stdout
    assert (tmp_path / "j" / "v.xml").exists()


def test_cli_verify_takes_a_shape_without_a_scenario(harness, tmp_path):
    result = invoke(["verify", "--variant", "zigzag", "--seqlen", "3824", "--heads", "5", "--kv-heads", "5",
                     "--head-dim", "128", "--dtype", "bf16", "--world-size", "2", "--world-size", "4",
                     "--out", str(tmp_path), "--json"], harness)
    assert result.exit_code == 0, result.output
    cases = [c for g in harness.launches for c in g["cases"]]
    assert [(c["variant"], c["world_size"], c["seqlen"], c["heads"], c["dtype"]) for c in cases] == [
        ("zigzag", 2, 3824, 5, "bf16"), ("zigzag", 4, 3824, 5, "bf16")]


def test_cli_run_and_verify_take_the_same_case_options():
    from ringbench.case.fields import FIELDS

    import typer.main

    commands = typer.main.get_command(app).commands

    def flags(command):
        given = {opt for p in commands[command].params for opt in p.opts}
        return {f.option.split("/")[0] for f in FIELDS if f.option.split("/")[0] in given}

    only = {c: {f.option.split("/")[0] for f in FIELDS if f.commands == (c,)} for c in ("run", "verify")}
    assert {"--mode", "--iters", "--warmup"} <= only["run"] and {"--model", "--repeat"} <= only["verify"]
    assert flags("run") - only["run"] == flags("verify") - only["verify"]
    assert only["run"] <= flags("run") and only["verify"] <= flags("verify")


def test_cli_run_json_prints_only_records(harness, tmp_path):
    result = invoke(["run", "--variant", "zigzag", "--seqlen", "1k", "--world-size", "2",
                     "--device", "cpu", "--json", "--out", str(tmp_path)], harness)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 1 and records[0]["status"] == "ok"
    assert records[0]["spec"]["seqlen"] == 1024 and records[0]["spec"]["kernel"] == "cpu"
    assert lines(tmp_path / "runs.jsonl") == records


def test_cli_failed_case_exits_1(harness, tmp_path):
    harness.outcome = lambda case: "fail" if case["variant"] == "zigzag" else "ok"
    result = invoke(["verify", "--world-size", "2", "--out", str(tmp_path)], harness)
    assert result.exit_code == 1, result.output


@pytest.mark.parametrize("timed_out, failure, status, reason", [
    (True, None, "timeout", r"the launch timed out after 30 s"),
    (False, "rank 1 raised RuntimeError: boom", "error", r"rank 1 raised RuntimeError: boom"),
    (False, "rank 0 raised torch.OutOfMemoryError: CUDA out of memory", "oom", r"OutOfMemoryError"),
])
def test_cli_unreported_cases_get_records_and_exit_3(tmp_path, timed_out, failure, status, reason):
    fake = FakeLauncher(outcome=lambda case: "ok" if case["variant"] == "ring" else None, timed_out=timed_out,
                        failure=failure)
    result = invoke(["verify", "--world-size", "2", "--out", str(tmp_path), "--json", "--timeout", "30"], fake)
    assert result.exit_code == 3, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    made = [r for r in records if r["spec"]["variant"] == "zigzag"]
    assert made and all(r["status"] == status and re.search(reason, r["reason"]) for r in made)
    assert all(r["schema_version"] == 1 and r["task"] == "verify" and r["kernel"] == ("math" if r["spec"]["mask"] else "cpu")
               for r in made)  # smoke's masked cases run on math, the kernel that takes a partial block's mask
    assert len(lines(tmp_path / "verify.jsonl")) == len(records)
    assert "unreported" in result.stderr


def test_cli_launcher_crash_is_recorded_not_raised(harness, tmp_path):
    def crash(*args, **kwargs):
        raise OSError("torchrun not found")

    harness.launch = crash
    result = invoke(["run", "--variant", "ring", "--device", "cpu", "--out", str(tmp_path), "--json"], harness)
    assert result.exit_code == 3
    (record,) = lines(tmp_path / "runs.jsonl")
    assert record["status"] == "error" and "OSError: torchrun not found" in record["reason"]
    assert record["time_ms"] is None


def test_cli_resume_skips_cases_with_an_ok_record(harness, tmp_path):
    from ringbench.case.spec import CaseSpec

    args = ["verify", "--variant", "ring", "--variant", "zigzag", "--world-size", "2", "--out", str(tmp_path), "--json"]
    assert invoke(args, harness).exit_code == 0
    cases = [CaseSpec.from_dict(c) for c in harness.launches[0]["cases"]]
    assert len(cases) >= 3
    # Keep the first case ok, make the second one's record a failure and the third an ok record
    # with a failing check (which counts as failed), drop the others.
    records = lines(tmp_path / "verify.jsonl")
    for r in records:
        r.update(checks=[{"tensor": "out", "passed": True}])
    records[1]["status"] = "fail"
    records[2]["checks"] = [{"tensor": "out", "passed": False}]
    (tmp_path / "verify.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    harness.launches.clear()
    result = invoke([*args, "--resume"], harness)
    assert result.exit_code == 0, result.output
    rerun = [CaseSpec.from_dict(c).case_id() for c in harness.launches[0]["cases"]]
    assert rerun == [c.case_id() for c in cases[1:]]
    shown = [json.loads(line)["case_id"] for line in result.stdout.splitlines()]
    assert shown == [c.case_id() for c in cases]  # the reused record is shown too
    assert f"--resume: 1 of {len(cases)} cases already has an ok record" in result.stderr
    assert f"{len(cases) - 1} records appended" in result.stderr and "1 reused" in result.stderr


def test_cli_ctrl_c_keeps_records_and_prints_the_resume_command(harness, tmp_path):
    real_launch = harness.launch

    def interrupted(cases, **kwargs):
        real_launch(cases[:1], **kwargs)  # the first case's record is written, then Ctrl-C
        raise KeyboardInterrupt

    harness.launch = interrupted
    result = invoke(["verify", "--variant", "ring", "--world-size", "2", "--out", str(tmp_path)], harness)
    assert result.exit_code == 130
    assert len(lines(tmp_path / "verify.jsonl")) == 1  # kept, and nothing added for the rest
    assert re.search(r"^interrupted: 1 of \d+ cases has a record in .*verify\.jsonl; to run the others: "
                     r"ringbench .*--resume$", result.stderr, re.M), result.stderr


def test_cli_timeout_default_is_each_cases_own(harness, tmp_path):
    from ringbench.case.spec import CaseSpec
    from ringbench.sweep.estimate import CASE_LIMIT_FLOOR_S, case_limit_s

    assert invoke(["run", "--variant", "ring", "--device", "cpu", "--out", str(tmp_path)], harness).exit_code == 0
    assert invoke(["run", "--variant", "ring", "--device", "cpu", "--out", str(tmp_path),
                   "--timeout", "45"], harness).exit_code == 0
    first, second = harness.launches
    limits = [case_limit_s(CaseSpec.from_dict(c)) for c in first["cases"]]
    assert first["timeout_s"] == limits and min(limits) >= CASE_LIMIT_FLOOR_S["cpu"]
    assert second["timeout_s"] == [45] * len(second["cases"])


def test_cli_resume_over_a_damaged_results_file_warns_in_one_sentence(harness, tmp_path):
    (tmp_path / "runs.jsonl").write_text('{"status": "ok"\n')  # a torn line
    result = invoke(["run", "--variant", "ring", "--device", "cpu", "--out", str(tmp_path), "--resume"], harness)
    assert result.exit_code == 0, result.output
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warned and "line 1" in warned[0] and "runs.jsonl" in warned[0], result.stderr
    assert "Warning:" not in result.stderr and "warnings.warn" not in result.stderr


def test_cli_the_same_value_twice_is_one_case(harness, tmp_path):
    # A one-value option or a flag given twice the same way is one value too.
    result = invoke(["run", "--variant", "zigzag", "--variant", "zigzag", "--world-size", "2", "--world-size", "2",
                     "--seqlen", "1k", "--device", "cpu", "--out", str(tmp_path), "--json", "--dtype", "bf16",
                     "--dtype=bf16", "--causal", "--causal"], harness)
    assert result.exit_code == 0, result.output
    assert [len(g["cases"]) for g in harness.launches] == [1]


# --------------------------------------------------------------------------- issue 26: any mask

def test_cli_variants_mask_column_says_any_only_where_mask_is_taken(tmp_path):
    """The mask column said "both" for the varlen variants, which refuse --mask: it now says "any" exactly
    where the variant's own check takes --mask prefix:8, else the plain masks it runs."""
    from helpers import ringbench_here
    from ringbench.case.spec import check_fields
    from ringbench.errors import SpecError

    listing = ringbench_here("variants", "--json", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    rows = [json.loads(line) for line in listing.stdout.splitlines()]
    for row in rows:
        try:
            check_fields({"variant": row["variant"], "mask": "prefix:8", "seqlen": 256, "world_size": 2})
            takes = True
        except SpecError:
            takes = False
        assert row["any_mask"] is takes, row["variant"]
    table = ringbench_here("variants", cwd=tmp_path).stdout
    assert " both " not in table
    for row in rows:
        cells = re.search(rf"^{row['variant']}\s+\S+\s+(batch|varlen)\s+(any|causal, full|causal|full)\s",
                          table, re.M)
        assert cells and (cells.group(2) == "any") is row["any_mask"], (row["variant"], table)


def test_cli_two_mask_files_of_as_many_slices_read_apart_in_tables(harness, tmp_path):
    """Two --mask-file of 3 slices both read slices(3): each is now its file's stem and the count, while the
    record holds the slices and the case_id follows them, not the name."""
    from ringbench.case.spec import CaseSpec
    from ringbench.variants.engines import masks

    bodies = {"alpha": "0 32 0 32 full\n32 64 0 64 causal\n64 96 0 96 causal\n",  # a prompt of 32, not plain causal
              "beta": "0 48 0 48 causal\n48 64 0 64 causal\n64 96 64 96 full\n"}
    for name, body in bodies.items():
        (tmp_path / f"{name}.txt").write_text(body)
    result = invoke(["run", "--device", "cpu", "--variant", "zigzag", "--seqlen", "96", "--mask-file",
                     str(tmp_path / "alpha.txt"), "--mask-file", str(tmp_path / "beta.txt")], harness)
    assert result.exit_code == 0, result.output
    assert "alpha(3)" in result.stdout and "beta(3)" in result.stdout and "slices(3)" not in result.stdout
    records = lines(tmp_path / "results" / "runs.jsonl")
    assert [r["spec"]["mask"].split(";")[0] for r in records] == ["slices:name=alpha", "slices:name=beta"]
    for record in records:
        bare = masks.unnamed(record["spec"]["mask"])
        assert masks.build(bare, 96).slices == masks.build(record["spec"]["mask"], 96).slices
        assert record["case_id"] == CaseSpec.from_dict({**record["spec"], "mask": bare}).case_id()


def test_cli_variants_names_the_kernels_a_varlen_variant_takes(tmp_path):
    """A varlen variant's kernel column read "any", though flex has no varlen form and is refused there: it
    names the kernels with one, and a batch variant of ours still reads any."""
    from helpers import ringbench_here
    from ringbench.variants.kernels import KERNELS

    listing = ringbench_here("variants", "--json", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    rows = {row["variant"]: row for row in map(json.loads, listing.stdout.splitlines())}
    with_varlen = [name for name, kernel in KERNELS.items() if kernel.varlen]
    assert "flex" not in with_varlen and "math" in with_varlen
    for name in ("ring_varlen", "zigzag_varlen", "llama3_varlen", "ulysses_varlen", "usp_varlen"):
        assert rows[name]["kernels"] == with_varlen, rows[name]
    assert rows["zigzag"]["kernels"] is None


def test_predicts_option_help_keeps_ranges_and_ellipses_whole():
    """predict's option texts drop their sentences about --scenario, and the split at full stops took
    "p - L + 1 .. p" and "type;..." for sentence ends, printing "p - L + 1 . p" and "type;."."""
    from ringbench.case import fields, options

    texts = {name: options._option_help(fields.BY_NAME[name], scenario=False) for name in ("mask", "bias", "window")}
    assert "p - L + 1 .. p" in texts["mask"] and "type;..." in texts["mask"] and "scenario" not in texts["mask"]
    assert "h = 0 .. H-1" in texts["bias"]
    assert ". ." not in " ".join(texts.values()) and "...." not in " ".join(texts.values())
