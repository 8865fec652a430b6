"""What a user sees on a narrow terminal and in a plot (issue 14).

Tables at 80 columns never split a word: every word printed is a word of the same table printed
wide, or its declared abbreviation (``formatting.Names``). Plots give a variant one colour in
every figure, a peer dashed lines, and draw no empty panel. Torch-free and fast: the committed
reference records and a few synthetic ones.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ringbench.present import compare, formatting, report
from ringbench.cli import app
from ringbench.present.compare.plot import colour_of
from ringbench.records.store import append_record, read_records
from ringbench.case.spec import CaseSpec

from helpers import slow_when

REFERENCE = Path(__file__).resolve().parents[1] / "results" / "reference"
H200X2 = REFERENCE / "2026-11-30-h200x2"
NARROW, WIDE = 80, 1000
#: A word as a table prints it: what :data:`ringbench.present.formatting._NAME` never splits.
WORD = re.compile(r"[\w.\-]+")


def _render(fn, arg, width: int) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    fn(arg, console)
    return console.export_text()


def _vocabulary(wide: str) -> set[str]:
    """The words of a table printed wide, their abbreviations, and the words of the legend that
    spells those out."""
    words = set(WORD.findall(wide))
    names = formatting.Names(short=True)
    shortened = {names.text(w) for w in words}
    return words | shortened | set(WORD.findall(names.legend() or ""))


def assert_no_split_word(narrow: str, wide: str) -> None:
    lines = narrow.splitlines()
    assert max(map(len, lines)) <= NARROW, narrow
    assert "…" not in narrow, narrow
    known = _vocabulary(wide)
    broken = sorted({w for w in WORD.findall(narrow) if w not in known})
    assert not broken, f"words split or unknown at {NARROW} columns: {broken}\n{narrow}"


def _frame(*names: str):
    return compare.load_runs([H200X2 / n for n in names]).frame


# --------------------------------------------------------------------------- tables at 80 columns

@pytest.mark.parametrize("files, by", [
    (["llama3-8b.jsonl"], ("variant", "kernel")),
    (["peers.jsonl"], ("variant", "kernel")),
    (["varlen.jsonl"], ("variant", "kernel")),
    (["efficient.runs.jsonl"], ("variant", "kernel")),
    (["llama3-8b.jsonl", "varlen.jsonl"], ("variant", "kernel")),
    (["llama3-8b.jsonl"], ("kernel",)),
])
def test_compare_pivot_at_80_columns_splits_no_word(files, by):
    table = compare.pivot(_frame(*files), by=by)
    narrow, wide = _render(compare.print_pivot, table, NARROW), _render(compare.print_pivot, table, WIDE)
    assert_no_split_word(narrow, wide)
    assert "abbreviations:" not in wide and "some words are folded" not in narrow


def test_compare_pivot_too_wide_for_80_columns_says_so():
    # Seven row fields and five columns of "417.8 ×1.29*": 87 columns at the narrowest. It is
    # stacked, a block per row, every word whole, and says how wide it would need to be.
    table = compare.pivot(_frame("llama3-8b.jsonl", "peers.jsonl", "varlen.jsonl"))
    narrow = _render(compare.print_pivot, table, NARROW)
    assert max(map(len, narrow.splitlines())) <= NARROW and "…" not in narrow
    assert re.search(r"one block per row: side by side, this table needs \d+ columns, and has 80",
                     re.sub(r"\s+", " ", narrow)), narrow
    assert "some words are folded" not in narrow
    assert_no_split_word(re.sub(r"one block per row: .*\n", "", narrow), _render(compare.print_pivot, table, WIDE))
    assert "one block per row" not in _render(compare.print_pivot, table, 120)


def test_compare_pivot_abbreviates_with_a_legend_and_markdown_keeps_full_names():
    table = compare.pivot(_frame("llama3-8b.jsonl"))
    narrow = _render(compare.print_pivot, table, NARROW)
    lines = narrow.splitlines()
    assert lines[1].split()[:4] == ["W", "mode", "variant", "kernel"]
    assert "tflash" in narrow and "torch-flash" not in lines[3]
    legend = next(line for line in lines if line.startswith("abbreviations:"))
    assert "W = world_size" in legend and "tflash = torch-flash" in legend
    markdown = compare.pivot_markdown(table)
    assert "| world_size | mode | variant | kernel |" in markdown and "torch-flash" in markdown
    assert "tflash" not in markdown and "abbreviations" not in markdown
    assert all("tflash" not in line for line in compare.pivot_json_lines(table))


def test_compare_cli_at_80_columns_splits_no_word():
    narrow = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1"}).invoke(app, ["compare", str(H200X2 / "peers.jsonl")])
    wide = CliRunner(env={"COLUMNS": "1000", "NO_COLOR": "1"}).invoke(app, ["compare", str(H200X2 / "peers.jsonl")])
    assert narrow.exit_code == 0 and wide.exit_code == 0, narrow.output
    assert_no_split_word(narrow.stdout, wide.stdout)
    # --json is the same whatever the width: full names.
    js = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["compare", str(H200X2 / "peers.jsonl"), "--json"])
    assert '"kernel": "torch-flash"' in js.stdout and "tflash" not in js.stdout


def test_compare_gate_at_80_columns_splits_no_word():
    result = compare.gate([H200X2 / "llama3-8b.first.jsonl"], [H200X2 / "llama3-8b.jsonl"],
                          [compare.parse_threshold("tflops:-5%"), compare.parse_threshold("time:+5%")])
    assert_no_split_word(_render(compare.print_gate, result, NARROW), _render(compare.print_gate, result, WIDE))


@pytest.mark.parametrize("path", [
    H200X2 / "llama-small.verify.jsonl",  # a model check: 37 parameter names
    H200X2 / "efficient.verify.jsonl",  # failures and errors with long reasons
    H200X2 / "ci-nightly-torch_cp.verify.jsonl",
    REFERENCE / "2026-12-01-h200" / "restructure.verify.jsonl",  # documents in the label
])
def test_verify_table_at_80_columns_splits_no_word(path):
    records = read_records(path)
    narrow = _render(report.print_verify_table, records, NARROW)
    assert_no_split_word(narrow, _render(report.print_verify_table, records, WIDE))


def test_verify_table_shortens_parameter_names_keeping_what_tells_them_apart():
    records = read_records(H200X2 / "llama-small.verify.jsonl")
    narrow = _render(report.print_verify_table, records, NARROW)
    for short in ("grad L1.in_norm", "grad L0.attn.q_proj", "grad L3.mlp.down_proj", "grad L2.post_norm",
                  "grad embed", "grad lm_head", "grad norm"):
        assert short in narrow, short
    legend = narrow[narrow.index("abbreviations:"):]
    assert "L<n> = layers.<n>" in legend and "in_norm = input_layernorm" in legend
    # Every parameter name of a case maps to a name of its own.
    tensors = [c["tensor"] for c in records[0]["checks"]]
    assert len({formatting.short_param(t) for t in tensors}) == len(tensors)
    # Wide, nothing is shortened.
    wide = _render(report.print_verify_table, records, WIDE)
    assert "grad model.layers.1.input_layernorm.weight" in wide and "abbreviations" not in wide


@pytest.mark.parametrize("path", [H200X2 / "efficient.runs.jsonl", H200X2 / "peers.jsonl",
                                  H200X2 / "varlen.jsonl"])
def test_run_table_at_80_columns_splits_no_word(path):
    records = read_records(path)
    assert_no_split_word(_render(report.print_run_table, records, NARROW),
                         _render(report.print_run_table, records, WIDE))


def _model_check(world_size: int) -> dict:
    record = read_records(H200X2 / "llama-small.verify.jsonl")[0]
    return {**record, "spec": {**record["spec"], "world_size": world_size}}


def test_growth_table_at_80_columns_splits_no_word():
    records = [_model_check(w) for w in (1, 2, 4, 8)]
    narrow = _render(report.print_growth_table, records, NARROW)
    assert "grad L1.in_norm" in narrow
    assert_no_split_word(narrow, _render(report.print_growth_table, records, WIDE))


@pytest.mark.parametrize("width", [80, 60])
def test_variants_table_splits_no_word(width):
    narrow = CliRunner(env={"COLUMNS": str(width), "NO_COLOR": "1"}).invoke(app, ["variants"])
    wide = CliRunner(env={"COLUMNS": "1000", "NO_COLOR": "1"}).invoke(app, ["variants"])
    assert narrow.exit_code == 0, narrow.output
    # The reasons after the table, and the note of a table laid out a block per row, are prose.
    table = narrow.stdout.split("\n[1]")[0].split("\none block per row")[0]
    assert max(map(len, table.splitlines())) <= width
    known = _vocabulary(wide.stdout)
    assert not sorted({w for w in WORD.findall(table) if w not in known}), table
    if width == 80:
        assert "rfa_llama3_varlen" in table and "abbreviations" not in table


@pytest.mark.parametrize("width", [14, 30, 40, 50, 60, 70])
def test_variants_table_spells_out_every_abbreviation_it_uses(width):
    """A new user saw abbreviations at 40 columns (issue 27, item 4): whenever the table writes a name
    shorter, the legend under it says what it stands for."""
    from ringbench.present.names import ABBREVIATIONS

    result = CliRunner(env={"COLUMNS": str(width), "NO_COLOR": "1"}).invoke(app, ["variants"])
    assert result.exit_code == 0, result.output
    used = {short: full for full, short in ABBREVIATIONS.items() if short in WORD.findall(result.stdout)}
    assert used, result.stdout  # at these widths the table does abbreviate
    legend = "".join(result.stdout.split())  # the legend wraps like any line (and folds a name wider than it)
    for short, full in used.items():
        assert f"{short}={full}" in legend, (short, result.stdout)


def test_variants_at_a_width_no_column_fits_prints_folded_blocks_not_a_traceback():
    """Under 14 columns every column was at its narrowest and the layout's shrink took min() of nothing."""
    result = CliRunner(env={"COLUMNS": "10", "NO_COLOR": "1"}).invoke(app, ["variants"])
    assert result.exit_code == 0, result.output
    assert "somewordsarefolded" in "".join(result.stdout.split()), result.stdout


def test_wrap_breaks_only_after_a_separator():
    from rich.text import Text

    def lines(plain: str, width: int) -> list[str]:
        console = Console(width=width, file=io.StringIO())
        return [line.plain.rstrip() for line in formatting.break_words(Text(plain), width).wrap(console, width)]

    assert lines("zigzag_varlen docs=100,900,3096 lognormal:mean=8k,sigma=1", 15) == [
        "zigzag_varlen", "docs=100,900,", "3096 lognormal:", "mean=8k,sigma=1"]
    # After a / too; never inside a piece, even one wider than the column (no table is that narrow).
    assert lines("W2 16k 32/8×128", 6) == ["W2 16k", "32/", "8×128"]
    assert formatting.break_words(Text("dist:mean=8192,sigma=1"), 6).plain == "dist:\nmean=8192,\nsigma=1"


# --------------------------------------------------------------------------- tables at any width

#: A piece of a token that a table may end a line after (as ``formatting.break_words`` does).
PIECE = re.compile(r"[^\s,/:]*[,/:]|[^\s,/:]+")
STACKED = re.compile(r"one block per row: side by side, this table needs (\d+) columns, and has (\d+)")


RULE = re.compile(r"[\u2500-\u257f]+")  # box drawing: a table's rules and frame


def _pieces(text: str) -> set[str]:
    # A stacked block writes "header:", so a trailing colon is not part of what is compared.
    return {p.rstrip(":") for token in RULE.sub(" ", text).split() for p in PIECE.findall(token)} - {""}


def assert_no_split_token(narrow: str, wide: str, width: int) -> None:
    """Every whitespace token printed at ``width`` is made of whole pieces of the tokens the same
    table prints wide (or of their declared abbreviations, or of the stacked form's note)."""
    lines = narrow.splitlines()
    assert max(map(len, lines)) <= width, narrow
    assert "…" not in narrow, narrow
    names = formatting.Names(short=True)
    known = _pieces(wide) | _pieces(names.text(wide)) | _pieces(names.legend() or "")
    stacked = STACKED.search(re.sub(r"\s+", " ", narrow))
    if stacked:
        known |= _pieces(stacked.group())
    broken = sorted(_pieces(narrow) - known)
    assert not broken, f"tokens split at {width} columns: {broken}\n{narrow}"


def _pivot(*names: str):
    return compare.pivot(_frame(*names))


TABLES = {
    "run efficient": (report.print_run_table, lambda: read_records(H200X2 / "efficient.runs.jsonl")),
    "run peers": (report.print_run_table, lambda: read_records(H200X2 / "peers.jsonl")),
    "verify efficient": (report.print_verify_table, lambda: read_records(H200X2 / "efficient.verify.jsonl")),
    "verify model": (report.print_verify_table, lambda: read_records(H200X2 / "llama-small.verify.jsonl")),
    "verify documents": (report.print_verify_table,
                         lambda: read_records(REFERENCE / "2026-12-01-h200" / "restructure.verify.jsonl")),
    "growth": (report.print_growth_table, lambda: [_model_check(w) for w in (1, 2, 4)]),
    "compare peers": (compare.print_pivot, lambda: _pivot("peers.jsonl")),
    "compare mixed": (compare.print_pivot, lambda: _pivot("llama3-8b.jsonl", "peers.jsonl", "varlen.jsonl")),
    "gate": (compare.print_gate, lambda: compare.gate(
        [H200X2 / "llama3-8b.first.jsonl"], [H200X2 / "llama3-8b.jsonl"],
        [compare.parse_threshold("tflops:-5%"), compare.parse_threshold("time:+5%")])),
}


@pytest.mark.parametrize("width", [30, slow_when(40, True), slow_when(60, True), 80, 120])  # 40, 60: 27 cases, 3 s
@pytest.mark.parametrize("name", list(TABLES))
def test_table_at_any_width_splits_no_number_or_word(name, width):
    fn, data = TABLES[name]
    arg = data()
    # The prose after the table (the numbered reasons, which quote tracebacks and paths, and the
    # worst parameter's full name) is left to the terminal to wrap.
    narrow = re.split(r"^\[1\] |^.*: worst(?: |$)", _render(fn, arg, width), flags=re.M)[0]
    assert_no_split_token(narrow, _render(fn, arg, WIDE), width)
    if width == 120 and name != "compare mixed":
        assert "one block per row" not in narrow  # side by side wherever it can be


def test_table_stacks_each_row_as_header_value_lines_when_too_wide():
    records = read_records(H200X2 / "efficient.runs.jsonl")
    narrow = _render(report.print_run_table, records, 30)
    assert STACKED.search(re.sub(r"\s+", " ", narrow)), narrow
    lines = [line.rstrip() for line in narrow.splitlines()]
    first = lines.index(next(line for line in lines if line.startswith("case:")))
    assert re.fullmatch(r"case: +zigzag", lines[first]) and re.fullmatch(r"ms: +29\.44", lines[first + 6])
    assert lines.count("") >= len(records) - 1  # a blank line between blocks
    assert "abbreviations: teff = torch-efficient" in re.sub(r"\s+", " ", narrow)


@pytest.mark.parametrize("width", [30, 40])
def test_compare_cli_on_a_narrow_terminal_splits_no_number_or_word(width):
    path = str(Path(__file__).parent / "data" / "main-2026-12-01.runs.jsonl")
    narrow = CliRunner(env={"COLUMNS": str(width), "NO_COLOR": "1"}).invoke(app, ["compare", path])
    wide = CliRunner(env={"COLUMNS": "1000", "NO_COLOR": "1"}).invoke(app, ["compare", path])
    assert narrow.exit_code == 0 and wide.exit_code == 0, narrow.output
    assert_no_split_token(narrow.stdout, wide.stdout, width)
    assert "0.000569" in narrow.stdout.split()


# --------------------------------------------------------------------------- verify's verdict last

def _verify(variant: str, world_size: int, err: float, **extra) -> dict:
    spec = CaseSpec(task="verify", variant=variant, kernel="cpu", device="cpu", world_size=world_size, batch=1,
                    seqlen=256, heads=2, kv_heads=1, head_dim=16, dtype="fp32", causal=True, mode="fwd_bwd",
                    iters=1, warmup=0, seed=0)
    checks = [{"tensor": t, "err": err, "allowed": 1e-3, "ratio": err / 1e-3, "passed": err <= 1e-3,
               "finite": True} for t in ("out", "lse", "dq", "dk", "dv")]
    return {"schema_version": 1, "task": "verify", "spec": spec.to_dict(), "status": "ok", "kernel": "cpu",
            "checks": checks, **extra}


def test_verify_summary_is_the_last_line_of_the_table_output():
    records = [_verify("zigzag", 1, 1e-4), _verify("zigzag", 2, 2e-4, notes=["K/V expanded"]),
               {**_model_check(2), "worst_param": {"tensor": "grad model.norm.weight", "ratio": 0.5}},
               {"spec": _verify("ring", 2, 0)["spec"], "status": "timeout", "reason": "no progress for 600 s"}]
    text = _render(report.print_verify_table, records, NARROW)
    assert text.rstrip("\n").splitlines()[-1] == "4 cases: 3 passed, 0 failed, 1 error"
    assert "note: K/V expanded" in text and "[1] no progress for 600 s" in text


def test_verify_command_prints_the_summary_after_the_growth_tables(capsys, monkeypatch):
    from ringbench.cli import _report

    monkeypatch.setenv("COLUMNS", "80")
    records = [_verify(v, w, 1e-4 * w) for v in ("ring", "zigzag") for w in (1, 2, 4)]
    _report("verify", records, json_out=False, junit_xml=None)
    out = capsys.readouterr().out
    assert out.count("error growth:") == 2 and out.index("error growth:") < out.index("ringbench verify")
    assert out.rstrip("\n").splitlines()[-1] == "6 cases: 6 passed, 0 failed, 0 errors"


# --------------------------------------------------------------------------- plots

def _run(variant: str, seqlen: int, tflops: float, *, world_size: int = 2, mode: str = "fwd_bwd",
         kernel: str = "cpu", causal: bool = True) -> dict:
    spec = CaseSpec(task="run", variant=variant, kernel=kernel, device="cpu", world_size=world_size, batch=1,
                    seqlen=seqlen, heads=4, kv_heads=2, head_dim=32, dtype="fp32", causal=causal, mode=mode,
                    iters=3, warmup=1, seed=0)
    return {"schema_version": 1, "task": "run", "case_id": spec.case_id(), "created_at": "2026-12-01T00:00:00+00:00",
            "spec": spec.to_dict(), "status": "ok", "kernel": kernel, "time_ms": 1.0, "tflops_per_gpu": tflops,
            "efficiency": tflops / 100, "env": {"torch": "2.13.0+cpu", "ringbench": "0.1.0"}}


def _figure(tmp_path: Path, name: str, records: list[dict], **pivot_args):
    path = tmp_path / f"{name}.jsonl"
    for r in records:
        append_record(path, r)
    frame = compare.load_runs([path]).frame
    return compare.plot(compare.pivot(frame, **pivot_args), frame)


def _lines(fig) -> dict[str, object]:
    return {line.get_label(): line for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def test_plot_gives_a_variant_the_same_colour_in_every_figure(tmp_path):
    from matplotlib.colors import to_hex

    both = _figure(tmp_path, "a", [_run(v, s, 1.0 + i) for i, v in enumerate(("ring", "stripe", "zigzag"))
                                   for s in (1024, 2048)])
    alone = _figure(tmp_path, "b", [_run("zigzag", s, 2.0) for s in (1024, 2048)])
    colours = {label: to_hex(line.get_color()) for label, line in _lines(both).items()}
    assert to_hex(_lines(alone)["zigzag / cpu"].get_color()) == colours["zigzag / cpu"]
    assert len(set(colours.values())) == 3
    # The committed reference plots: every variant in both has one colour, whatever the kernel.
    peers, llama = (compare.plot(compare.pivot(f), f) for f in (_frame("peers.jsonl"), _frame("llama3-8b.jsonl")))
    by_variant: dict[str, set[str]] = {}
    for fig in (peers, llama):
        for label, line in _lines(fig).items():
            if "rotate=" not in label:  # another option of a variant is a shade of its colour
                by_variant.setdefault(label.split(" / ")[0], set()).add(to_hex(line.get_color()))
    assert {v: len(c) for v, c in by_variant.items()} == {"llama3": 1, "ring": 1, "stripe": 1, "torch_cp": 1,
                                                          "zigzag": 1}
    assert to_hex(_lines(peers)["zigzag / cudnn"].get_color()) == colour_of("zigzag")


def test_plot_draws_a_peer_dashed_with_open_markers_and_a_line_style_per_kernel():
    fig = compare.plot(compare.pivot(_frame("peers.jsonl")), _frame("peers.jsonl"))
    lines = _lines(fig)
    for label, line in lines.items():
        peer = label.startswith("torch_cp")
        assert (line.get_linestyle() == "--") == peer, label
        assert (line.get_markerfacecolor() == "white") == peer, label
    assert lines["zigzag / cudnn"].get_linestyle() != lines["zigzag / torch-flash"].get_linestyle()
    assert lines["zigzag / cudnn"].get_marker() == lines["llama3 / cudnn"].get_marker() == "s"
    assert "peers dashed" in fig.legends[0].get_title().get_text()


def test_plot_leaves_no_panel_empty(tmp_path):
    # World size 1 has only fwd_bwd: three panels in a row, not a 2 x 2 grid with a hole.
    fig = _figure(tmp_path, "mixed", [_run("ring", 1024, 1.0, world_size=1), _run("ring", 1024, 2.0),
                                      _run("ring", 1024, 3.0, mode="fwd")])
    assert sorted(ax.get_title() for ax in fig.axes) == ["world size 1, forward + backward", "world size 2, forward",
                                                         "world size 2, forward + backward"]
    assert {ax.get_subplotspec().get_geometry()[:2] for ax in fig.axes} == {(1, 3)}
    for ax in fig.axes:
        assert any(len(line.get_xdata()) for line in ax.get_lines() if not line.get_label().startswith("_"))
    # The whole reference folder: a world size 1 run and mixed sets; every axis holds data.
    frame = compare.load_runs([REFERENCE]).frame
    for metric in ("tflops", "efficiency", "time", "memory"):
        fig = compare.plot(compare.pivot(frame, metric=metric), frame)
        assert fig.axes
        for ax in fig.axes:
            assert [line for line in ax.get_lines() if not line.get_label().startswith("_")], (metric, ax.get_title())


def test_plot_legend_names_the_fields_it_shows(tmp_path):
    frame = compare.load_runs([Path(__file__).parent / "data" / "main-2026-12-01.runs.jsonl"]).frame
    labels = sorted(_lines(compare.plot(compare.pivot(frame), frame)))
    assert labels == ["llama3 / cpu / kv_heads=2 / layout=contiguous / heads_k_stride=1",
                      "zigzag / cpu / kv_heads=1",  # heads_k_stride 0 is its default: it tells no line apart
                      "zigzag_varlen / cpu / kv_heads=1 / docs=128,64,64"]
    fig = _figure(tmp_path, "causal", [_run("ring", 1024, 1.0), _run("ring", 1024, 2.0, causal=False)],
                  by=("variant", "causal"))
    assert sorted(_lines(fig)) == ["ring / causal=False", "ring / causal=True"]
