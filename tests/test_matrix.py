"""``ringbench matrix``: the grid, the classes, the Markdown and the picture, and a real CPU matrix.

The unit tests build the grid (no process starts) and classify hand-made records. The ``dist``
test runs the matrix command in-process with real torchrun and gloo on a small grid (the mask
axis of ring, broken_merge and the fault variants at world size 2: every class CPU can give,
20 to 45 s on two shared CPU cores) and then resumes it, which must launch nothing. The slow one
runs every column of the default grid at world size 4 for ringbench's ring-family variants and the
test variants (about a minute); the whole default grid, every implementation at world sizes 2 and
4, is a committed sweep under results/reference/ (``ringbench matrix --out DIR`` regenerates it).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from helpers import CLI_ENV, read_jsonl
from ringbench.errors import SpecError
from ringbench.present import matrix as mx_render
from ringbench.sweep import matrix as mx
from ringbench.cli import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def _variant(name):
    from ringbench.variants import get_variant

    return get_variant(name)


# --------------------------------------------------------------------------- the grid

def test_cell_fields_change_one_thing_from_the_base():
    ring, varlen = _variant("ring"), _variant("zigzag_varlen")
    base = mx.cell_fields(ring, "causal", 2, "cpu")
    assert {k: base[k] for k in ("heads", "kv_heads", "head_dim", "dtype", "causal")} == \
        {"heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "bf16", "causal": True}
    assert base["seqlen"] == 256 and "docs" not in base
    assert mx.cell_fields(ring, "bf16", 2, "cpu") == base
    assert mx.cell_fields(ring, "full", 2, "cpu") == {**base, "causal": False}
    assert mx.cell_fields(ring, "fp16", 2, "cpu") == {**base, "dtype": "fp16"}
    assert mx.cell_fields(ring, "mqa", 2, "cpu") == {**base, "kv_heads": 1}
    assert mx.cell_fields(ring, "d256", 2, "cpu") == {**base, "head_dim": 256}
    for world_size in (1, 2, 4, 8):
        odd = mx.cell_fields(ring, "odd", world_size, "cpu")["seqlen"]
        assert odd % world_size == 0 and (odd // world_size) % 2 == 1
    # Packed documents: multiples of 2W that fill the row, for a batch variant too (it refuses them).
    packed = mx.cell_fields(ring, "packed", 4, "cpu")
    docs = [int(d) for d in packed["docs"].split(",")]
    assert sum(docs) == packed["seqlen"] and all(d % 8 == 0 for d in docs)
    # A varlen implementation's base is packed; its odd column has documents of odd lengths.
    assert mx.cell_fields(varlen, "bf16", 2, "cpu")["docs"]
    odd = mx.cell_fields(varlen, "odd", 2, "cpu")
    odd_docs = [int(d) for d in odd["docs"].split(",")]
    assert sum(odd_docs) == odd["seqlen"] and all(d % 2 for d in odd_docs)
    # Its causal, full and window columns run with the documents too (causal is its packed cell), and a
    # mask column applies the mask inside each document: the shared prompt's chosen so three answers fit.
    assert mx.cell_fields(varlen, "causal", 2, "cpu") == mx.cell_fields(varlen, "packed", 2, "cpu")
    assert mx.cell_fields(varlen, "full", 2, "cpu")["docs"] and mx.cell_fields(varlen, "window", 2, "cpu")["docs"]
    shared = mx.cell_fields(varlen, "shared_prefix", 2, "cpu")
    assert shared["mask"] == "shared-prefix:65,answers=3" and shared["docs"] == "64,16,128,48"


def test_window_and_mla_columns_carry_their_case_fields():
    ring = _variant("ring")
    window, mla = mx.cell_fields(ring, "window", 2, "cpu"), mx.cell_fields(ring, "mla", 2, "cpu")
    assert window["window"] == window["seqlen"] // 4
    assert (mla["head_dim"], mla["head_dim_v"]) == mx.MLA_HEAD_DIMS


def test_a_column_whose_option_a_variant_does_not_declare_is_refused_by_the_declaration():
    """The window and sink columns ask every implementation; one that does not declare the option
    (``Variant.options``) is unsupported in the spec's own sentence, with a spec for its record."""
    grid = mx.build_grid(device="cpu", world_sizes=[2], variants=["ring", "rfa_ring"], axes=["mask", "sink"])
    assert grid.cell("ring", 2, "window").refusal is None
    window = grid.cell("rfa_ring", 2, "window")
    assert window.refusal.startswith("rfa_ring cannot take a sliding window (--window 64); use one of ring, zigzag")
    assert window.case is not None and window.case.window == 64
    sink = grid.cell("rfa_ring", 2, "learnable")
    assert sink.refusal.startswith("rfa_ring takes no attention sink (sink 'learnable')"), sink.refusal
    assert mx_render.refusal_topic(window.refusal) == "window" and mx_render.refusal_topic(sink.refusal) == "sink"


def test_build_grid_refuses_per_cell_in_the_implementations_own_words():
    grid = mx.build_grid(device="cpu", world_sizes=[2], variants=["ring", "ring_varlen", "torch_cp"])
    assert grid.implementations == ["ring", "ring_varlen", "torch_cp"] and grid.world_sizes == [2]
    base = grid.cell("ring", 2, "causal")
    assert sorted(base.columns) == sorted(["causal", "bf16", "d128", "gqa"])  # one case, four columns
    assert base.refusal is None and base.case.kernel == "cpu"  # resolved, ready to launch
    assert all(grid.cell("ring", 2, c.key) is not None for c in mx.COLUMNS)
    packed = grid.cell("ring", 2, "packed")  # the documents become a document mask over ring's batch row
    assert packed.refusal is None and packed.case.mask.startswith("docs:") and not packed.case.docs
    assert grid.cell("ring_varlen", 2, "causal") is grid.cell("ring_varlen", 2, "packed")  # one case, with documents
    assert grid.cell("ring_varlen", 2, "packed").refusal is None
    assert all(grid.cell("ring_varlen", 2, k).refusal is None for k in ("full", "window", "two_sided", "prefix", "shared_prefix", "chunked", "global"))
    assert "torch_cp cannot run on cpu" in grid.cell("torch_cp", 2, "fp16").refusal
    assert "does not support non-causal" in grid.cell("torch_cp", 2, "full").refusal
    window = grid.cell("ring", 2, "window")
    assert window.refusal is None and window.case.window == window.case.seqlen // 4
    ids = [c.case_id for c in grid.cells if c.case is not None]
    assert len(ids) == len(set(ids))


def test_build_grid_narrows_and_refuses_bad_options():
    grid = mx.build_grid(device="cpu", world_sizes=[2], variants=["ring"], axes=["dtype"])
    assert [c.key for c in grid.columns] == ["bf16", "fp16", "fp32"] and len(grid.cells) == 3
    for kwargs, words in (({"axes": ["colour"]}, "axis 'colour' is unknown"),
                          ({"variants": ["nope"]}, "variant 'nope' is unknown"),
                          ({"variants": ["ring", "ring"]}, "given twice"),
                          ({"world_sizes": [0]}, "world_size 0 must be positive"),
                          ({"device": "tpu"}, "device 'tpu' is unknown")):
        with pytest.raises(SpecError, match=words):
            mx.build_grid(**{"device": "cpu", **kwargs})


def test_default_rows_are_ours_then_the_peers_then_the_test_variants(monkeypatch):
    from ringbench.variants import VARIANTS

    monkeypatch.delenv("RINGBENCH_TEST_VARIANTS")
    rows = mx.implementations()
    peers = [n for n in rows if VARIANTS[n].peer]
    assert set(rows) == set(VARIANTS) and rows[-len(peers):] == peers
    monkeypatch.setenv("RINGBENCH_TEST_VARIANTS", "1")
    assert mx.implementations()[-3:] == ["broken_merge", "fault_oom", "fault_raise"]
    assert mx.default_world_sizes("cpu", 0) == [2, 4]
    assert mx.default_world_sizes("cuda", 4) == [2, 4] and mx.default_world_sizes("cuda", 1) == [1]


# --------------------------------------------------------------------------- the classes

def _record(status, *, variant="ring", reason=None, ratios=None):
    checks = [{"tensor": t, "ratio": r, "finite": r == r, "passed": r <= 1}
              for t, r in (ratios or {}).items()]
    return {"status": status, "reason": reason, "checks": checks, "spec": {"variant": variant}}


def test_the_picture_names_what_a_refusal_is_about():
    assert mx_render.refusal_topic("rfa_ring cannot take a sliding window (--window 64); use one of ring") == "window"
    assert mx_render.refusal_topic("seqlen 510 is not a multiple of 2 * world_size = 4, which zigzag needs; use 512") == "length"
    assert mx_render.refusal_topic("document 0 has 129 tokens, not a multiple of world_size = 2, which ring_varlen "
                            "needs; make it 130") == "doc length"
    assert mx_render.refusal_topic("kernel auto found no kernel on cuda for head_dim 128 and dtype fp32 (dtype fp32 is not "
                            "supported by the torch-flash kernel, which takes bf16 and fp16)") == "dtype"
    assert mx_render.refusal_topic("head_dim 256 exceeds 128, the largest the cudnn kernel takes") == "head dim"
    assert mx_render.refusal_topic("RuntimeError: something a peer said") == "n/a"


def test_classify_every_status():
    ok = mx.classify(_record("ok", ratios={"out": 0.3, "lse": 0.5, "dq": 0.4}))
    assert ok == ("correct", None, {"tensor": "lse", "ratio": 0.5, "rule": "max"})
    klass, reason, worst = mx.classify(_record("fail", reason="over the tolerance or malformed: dq, dk",
                                               ratios={"out": 0.5, "dq": 12.5, "dk": 3.0}))
    assert (klass, worst) == ("mismatch", {"tensor": "dq", "ratio": 12.5, "rule": "max"}) and "dq" in reason
    # A tensor within the max rule that fails the block-decomposition rule: its ratio is that rule's.
    drift = _record("fail", reason="drifted", ratios={"out": 0.4, "dq": 0.9})
    drift["checks"][1].update(passed=False, shadow_passed=False, shadow_ratio=28.0)
    assert mx.classify(drift)[2] == {"tensor": "dq", "ratio": 28.0, "rule": "blocks"}
    cell = mx.Cell("ring", 2, ["fp16"], klass="mismatch", worst=mx.classify(drift)[2])
    assert mx_render.cell_text(cell) == "mismatch dq ×28.0 blocks" and mx_render.cell_text(cell, short=True) == "dq ×28.0 blocks"
    assert mx.classify(_record("fail", ratios={"out": float("nan")}))[2]["ratio"] == float("inf")
    cp = mx.classify(_record("fail", reason="context parallelism was not active", ratios={"out": 0.5}))
    assert cp[:2] == ("mismatch", "context parallelism was not active")
    assert mx.classify(_record("skipped", reason="torch_cp cannot run on cpu")) == \
        ("unsupported", "torch_cp cannot run on cpu", None)
    assert mx.classify(_record("oom", reason="[rank 0/2] out of memory"))[0] == "oom"
    assert mx.classify(_record("timeout", reason="timed out after 120 s"))[0] == "timeout"
    raised = "[rank 1/2] RuntimeError: FlashAttention only supports fp16 and bf16\n  File ..."
    assert mx.classify(_record("error", variant="rfa_ring", reason=raised)) == \
        ("unsupported", "RuntimeError: FlashAttention only supports fp16 and bf16", None)
    assert mx.classify(_record("error", variant="ring", reason=raised))[:2] == ("error", raised)
    crashed = "rank 1/2 failed: RuntimeError: boom"
    assert mx.classify(_record("error", variant="rfa_ring", reason=crashed))[0] == "error"


def _classified_grid():
    """A grid with a class in every cell, given by hand (nothing launches)."""
    grid = mx.build_grid(device="cpu", world_sizes=[2, 4], variants=["ring", "zigzag_varlen", "torch_cp"])
    kinds = iter(["mismatch", "oom", "timeout", "error"])
    for cell in grid.cells:
        if cell.refusal is not None:
            cell.klass, cell.reason = "unsupported", cell.refusal
        elif cell.implementation == "ring" and cell.world_size == 4 and cell.columns[0] in ("full", "fp16", "fp32",
                                                                                              "d64"):
            cell.klass = next(kinds)
            cell.reason = f"{cell.klass} | because"
            cell.worst = {"tensor": "dq", "ratio": 12.3} if cell.klass == "mismatch" else None
        else:
            cell.klass, cell.worst = "correct", {"tensor": "lse", "ratio": 0.5}
            cell.record = {"notes": ["served by the cpu kernel"]} if cell.implementation == "zigzag_varlen" else None
    return grid


def test_markdown_png_and_cell_objects(tmp_path):
    grid = _classified_grid()
    env = {"torch": "2.13.0+cpu", "git_commit": "0123456789abcdef-dirty", "cpu": "x86_64"}
    paths = mx_render.write(grid, tmp_path / "m", env)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = paths["md"].read_text()
    assert "torch 2.13.0+cpu · commit 0123456-dirty" in text
    assert "## W=2" in text and "## W=4" in text and text.count("### shape") == 2
    assert "| ring | correct 0.50 | mismatch dq ×12.3 [" in text
    assert "| torch_cp (peer) | unsupported [" in text
    assert "- zigzag_varlen: served by the cpu kernel" in text
    assert "mismatch \\| because" not in text and "mismatch / because" in text  # a | cannot break the table
    cells = [json.loads(line) for line in paths["jsonl"].read_text().splitlines()]
    assert len(cells) == len(grid.cells)
    assert {c["class"] for c in cells} == set(mx.CLASSES)
    base = next(c for c in cells if c["implementation"] == "ring" and c["world_size"] == 2 and "causal" in c["columns"])
    assert base["spec"]["variant"] == "ring" and base["worst_tensor"] == "lse" and base["worst_ratio"] == 0.5
    assert next(c for c in cells if c["implementation"] == "torch_cp")["peer"] is True


def test_matrix_that_no_cell_can_run_says_why_instead_of_case_0_of_0(tmp_path):
    result = runner.invoke(app, ["matrix", "--variant", "torch_cp", "--device", "cpu", "--out", str(tmp_path / "m")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "nothing to verify: every one of the 40 cells of this matrix is refused on cpu, 20 of them because torch_cp "
        "cannot run on cpu: PyTorch's context parallel dispatches only its CUDA SDPA backends (flash, efficient, "
        "cuDNN); run it on a machine with a CUDA GPU with --device cuda")
    assert "case 0 of 0" not in result.output and not (tmp_path / "m").exists()


def test_the_picture_draws_its_legend_under_the_title_not_over_it():
    import matplotlib.pyplot as plt

    grid = mx.build_grid(device="cpu", world_sizes=[2], variants=["zigzag", "llama3_varlen"], axes=["dtype", "sink"])
    for cell in grid.cells:
        cell.klass, cell.worst = "correct", {"tensor": "lse", "ratio": 0.5}
    env = {"torch": "2.13.0+cpu", "git_commit": "0123456789abcdef-dirty", "cpu": "x86_64 (2 cores)"}
    fig = mx_render.figure(grid, env)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        title = fig._suptitle.get_window_extent(renderer)
        legend = fig.legends[0].get_window_extent(renderer)
        panel = fig.axes[0].get_window_extent(renderer)
        assert not title.overlaps(legend), (title, legend)
        assert legend.y1 <= title.y0 and legend.y0 >= panel.y1  # title, legend, panel from the top
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- a real CPU matrix

class CountingLauncher:
    """ringbench.sweep.launch (real torchrun), noting the variants of every launch it is asked for."""

    def __init__(self):
        self.launches: list[list[str]] = []

    def launch(self, cases, **kwargs):
        from ringbench.sweep import launch

        self.launches.append([c["variant"] for c in cases])
        return launch.launch(cases, **kwargs)


@pytest.mark.dist
@pytest.mark.slow  # 10 s on two cores; CI's whole run still has it
def test_cpu_matrix_gives_every_class_writes_its_files_and_resumes_without_launching(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGBENCH_FAULT_WAIT_S", "3")  # fault_raise's rank gives up sooner
    out = tmp_path / "matrix"
    args = ["matrix", "--variant", "ring", "--variant", "broken_merge", "--variant", "fault_oom", "--variant",
            "fault_raise", "--axis", "mask", "--world-size", "2", "--out", str(out), "--json"]
    launcher = CountingLauncher()
    result = runner.invoke(app, args, obj=launcher)
    assert result.exit_code == 0, result.output
    cells = {(c["implementation"], c["columns"][0]): c for c in map(json.loads, result.stdout.splitlines())}
    assert len(cells) == 20  # ring and broken_merge: 9 mask columns; the faults: their base cell
    assert {c["class"] for c in cells.values()} == {"correct", "mismatch", "unsupported", "oom", "error"}
    assert cells["ring", "causal"]["class"] == cells["ring", "full"]["class"] == "correct"
    assert cells["ring", "causal"]["worst_ratio"] <= 1 and cells["ring", "causal"]["kernel"] == "cpu"
    mismatch = cells["broken_merge", "causal"]
    assert mismatch["class"] == "mismatch" and mismatch["worst_ratio"] > 1 and mismatch["worst_tensor"]
    packed = cells["ring", "packed"]
    assert packed["class"] == "correct"  # the documents as a document mask over ring's batch row
    assert cells["ring", "window"]["class"] == "correct"  # ring takes a sliding window (window = S / 4)
    assert "broken_merge cannot take a sliding window" in cells["broken_merge", "window"]["reason"]
    assert cells["fault_oom", "causal"]["class"] == "oom"
    assert cells["fault_raise", "causal"]["class"] == "error"
    assert "injected fault" in cells["fault_raise", "causal"]["reason"]

    # Refused cells are recorded as skipped, never launched; the faults launch apart, last.
    records = read_jsonl(out / "verify.jsonl")
    skipped = {r["case_id"] for r in records if r["status"] == "skipped"}
    assert cells["broken_merge", "packed"]["case_id"] in skipped and packed["case_id"] not in skipped
    launched = [v for launch in launcher.launches for v in launch]
    # ring: causal, full, window, the five named masks and packed (a document mask); broken_merge: causal and
    # full (it takes no window, no mask and so no documents).
    assert sorted(launched) == sorted(["ring"] * 9 + ["broken_merge", "broken_merge", "fault_oom", "fault_raise"])
    assert cells["ring", "prefix"]["class"] == "correct" and cells["ring", "prefix"]["kernel"] == "cpu"  # auto: by slices
    assert "broken_merge cannot take mask prefix:64" in cells["broken_merge", "prefix"]["reason"]
    assert launcher.launches[-1] == ["fault_oom", "fault_raise"]

    text = (out / "matrix.md").read_text()
    assert "## W=2" in text and "| ring | correct" in text and "| broken_merge (test) | mismatch" in text
    assert (out / "matrix.png").read_bytes()[:4] == b"\x89PNG"
    assert len((out / "matrix.jsonl").read_text().splitlines()) == 20

    again = CountingLauncher()
    resumed = runner.invoke(app, [*args, "--resume"], obj=again)
    assert resumed.exit_code == 0, resumed.output
    assert again.launches == []  # every cell has its result already
    assert len(read_jsonl(out / "verify.jsonl")) == len(records)  # and nothing was recorded again
    assert {(c["implementation"], c["columns"][0]): c["class"] for c in map(json.loads, resumed.stdout.splitlines())} \
        == {k: c["class"] for k, c in cells.items()}


#: ringbench's ring-family variants: correct wherever their spec accepts a cell of the default grid.
OURS = ("ring", "zigzag", "stripe", "llama3", "ring_varlen", "zigzag_varlen", "llama3_varlen")


@pytest.mark.dist
@pytest.mark.slow
def test_default_cpu_matrix_with_the_test_variants(tmp_path):
    """Every column of the default grid (all five axes, nothing narrowed) at world size 4, for
    ringbench's ring-family variants and the test variants, as a user runs it (its own process):
    ours are never a mismatch or an error, and the test variants and refusals give every class
    CPU can give. World size 4 is the larger default one (three remote ring steps, zigzag's
    pairing of two chunks a rank); world size 2 of the same variants is checked, column by column
    of the dtype and mask axes, by tests/test_drift.py, and the default world sizes (2 and 4) by
    the unit tests above. The peers' rows add no assertion here; the whole grid, peers and both
    world sizes, is the committed sweep of results/reference/2026-12-05-cpu-matrix (6 minutes)."""
    import os

    env = {**os.environ, **CLI_ENV, "RINGBENCH_TEST_VARIANTS": "1",
           "RINGBENCH_FAULT_WAIT_S": "3"}  # fault_raise's rank gives up sooner; the cell is an error all the same
    rows = [a for name in (*OURS, "broken_merge", "fault_oom", "fault_raise") for a in ("--variant", name)]
    proc = subprocess.run([sys.executable, "-m", "ringbench.cli", "matrix", "--test-variants", *rows,
                           "--world-size", "4", "--out", str(tmp_path), "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {c["world_size"] for c in cells} == {4}
    # Every column of the default grid, for every row asked (the faults: their base cell).
    for name in OURS + ("broken_merge",):
        assert sorted(k for c in cells if c["implementation"] == name for k in c["columns"]) == \
            sorted(c.key for c in mx.COLUMNS), name
    by_class = {k: [c for c in cells if c["class"] == k] for k in mx.CLASSES}
    assert all(by_class[k] for k in ("correct", "mismatch", "unsupported", "oom", "error")), \
        {k: len(v) for k, v in by_class.items()}
    assert not [c for c in by_class["mismatch"] + by_class["error"] if c["implementation"] in OURS]
    # And correct in every cell its spec accepts (a row refused whole would pass the line above).
    accepted = mx.build_grid(device="cpu", world_sizes=[4], variants=list(OURS))
    assert sorted((c["implementation"], k) for c in by_class["correct"] if c["implementation"] in OURS
                  for k in c["columns"]) == \
        sorted((c.implementation, k) for c in accepted.cells if c.refusal is None for k in c.columns)
    assert (tmp_path / "matrix.png").exists() and (tmp_path / "matrix.md").exists()


def test_correct_says_dsink_is_checked_too_and_the_matrix_page_points_at_its_picture(tmp_path):
    """A learnable sink's cells check dsink as well, and the Markdown's legend says so; the matrix
    page shows the committed sweep of today's whole grid, so no sentence need excuse its age."""
    from pathlib import Path

    assert "dsink with a learnable sink" in mx.CLASS_MEANING["correct"]
    text = mx_render.write(_classified_grid(), tmp_path / "m", {})["md"].read_text()
    assert "| correct | every check passed: out, lse, dq, dk and dv" in text and "dsink with a learnable sink" in text
    section = (Path(__file__).parents[1] / "docs" / "matrix.md").read_text(encoding="utf-8")
    assert section.startswith("# The matrix")
    assert "the picture below" not in section and "predates" not in section
    assert "results/reference/2026-12-05-cpu-matrix/matrix.png" in section  # the whole grid of today's columns
