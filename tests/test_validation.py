"""The model checked against what was measured (issue 24, item 4): ``predict --against``, the
validation page, and predicted records beside measured ones in compare and advise.

``--against`` runs on a file holding every kind of line the committed results hold (ok records,
an emulated one, a peer's, a verify record, a failed run, a prediction, a damaged line, an ok
record without a time), priced by a flat calibration, so each record's error is known: it must
count what it leaves out, say why it cannot predict the peer, and pass or fail each part of the
bound. The validation page must be what its command writes today.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import flat_calibration, ringbench_here
from ringbench.case.spec import CaseSpec, default_fields
from ringbench.model import against
from ringbench.model import calibration as C

SHAPE = C.Shape(1, 2, 1, 16, 16, "fp32")
#: Each ok record of the file, and the error its measured time is made to have.
MEASURED = (({"variant": "zigzag", "world_size": 2, "seqlen": 512}, 0.10),
            ({"variant": "ring", "world_size": 2, "seqlen": 1024}, -0.02),
            ({"variant": "zigzag", "world_size": 4, "seqlen": 1024, "emulate": True}, 0.04))


def _spec(**kw) -> CaseSpec:
    world_size = kw["world_size"]
    return CaseSpec.from_dict({**default_fields("cpu", world_size), "task": "run", "heads": SHAPE.heads,
                               "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim, "dtype": "fp32",
                               "kernel": "cpu", "mode": "fwd_bwd", **kw})


def _target(cal_path: Path):
    from ringbench.model.target import target

    return target(gpu=None, calibrations=[cal_path], cluster_file=None, gpus_per_node=None, nodes=None, fabric=None,
                  dtype="fp32")


def _record(spec: CaseSpec, time_ms, status: str = "ok", **extra) -> dict:
    from ringbench.records.build import build

    fields = {"time_ms": time_ms, "tflops_per_gpu": 1.0} if status == "ok" else None
    return {**build(spec, run_id="test", status=status, fields=fields, env={"gpu_name": None}), **extra}


@pytest.fixture
def measured_file(tmp_path):
    """A .jsonl of every kind of line, the calibration file, and the three ok records' predicted ms."""
    from ringbench.model.predict import predict_case

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(flat_calibration(1e12, SHAPE)), encoding="utf-8")
    tgt = _target(cal)
    lines, predicted = [], []
    for given, error in MEASURED:
        spec = _spec(**given)
        fields = predict_case(spec, calibration=tgt.calibration, kernel="cpu", cluster=tgt.cluster(spec.world_size))
        ms = fields["prediction"]["compute_only_ms"] if spec.emulate else fields["time_ms"]
        predicted.append(ms)
        lines.append(json.dumps(_record(spec, ms / (1 + error), emulated=spec.emulate)))
    peer = _spec(variant="rfa_zigzag", world_size=2, seqlen=512)
    lines += [json.dumps(_record(peer, 1.0)),
              json.dumps({**_record(_spec(variant="zigzag", world_size=2, seqlen=512), None, status="oom")}),
              json.dumps({**_record(_spec(variant="zigzag", world_size=2, seqlen=512), 2.0), "predicted": True}),
              json.dumps({**_record(_spec(variant="zigzag", world_size=2, seqlen=512), None)}),
              json.dumps({"task": "verify", "status": "ok", "spec": {"task": "verify", "variant": "zigzag"}}),
              '{"task": "run", "status": "ok", "time_',
              ""]
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, cal, predicted


def test_against_counts_what_it_leaves_out_and_says_why_it_cannot_predict(measured_file):
    path, cal, predicted = measured_file
    measured = against.measured_records([path])
    assert [r["spec"]["variant"] for r in measured.records] == ["zigzag", "ring", "zigzag", "rfa_zigzag"]
    assert measured.left_out_text() == ("left out 5 lines: 1 with status oom, 1 predicted record, 1 ok record "
                                        "without a time, 1 verify record, 1 damaged line")
    tgt = _target(cal)
    rows = against.compare(measured.records, target_of=lambda rec: tgt)
    errors = [r.get("error") for r in rows]
    assert errors[:3] == pytest.approx([e for _, e in MEASURED], rel=1e-9)
    assert [r["predicted_ms"] for r in rows[:3]] == pytest.approx(predicted, rel=1e-12)
    assert len(set(predicted)) == 3  # each record predicted on its own case
    assert rows[3]["refused"] and "rfa_zigzag is a peer" in rows[3]["reason"], rows[3]
    assert rows[2]["emulated"] and not rows[0]["emulated"]


def test_latest_checks_each_case_on_its_last_record_and_counts_the_others(measured_file, tmp_path):
    """``--latest``: a case measured again in a later file (the engine changed) is checked on that record
    alone; the earlier ones are counted as left out, and cases measured once stay."""
    path, cal, _ = measured_file
    again = json.loads(path.read_text(encoding="utf-8").splitlines()[0])  # the first zigzag, measured again
    again["time_ms"] *= 2
    later = tmp_path / "later.jsonl"
    later.write_text(json.dumps(again) + "\n", encoding="utf-8")
    measured = against.latest(against.measured_records([path, later]))
    assert [r["spec"]["variant"] for r in measured.records] == ["ring", "zigzag", "rfa_zigzag", "zigzag"]
    assert measured.records[-1]["time_ms"] == again["time_ms"] and measured.records[-1]["_source"] == str(later)
    assert measured.left_out_text().endswith("1 record measured again later")
    assert against.latest(against.measured_records([path])).records == against.measured_records([path]).records


@pytest.mark.parametrize("bound,passed,failures", [
    (against.Bound(0.12), True, []),
    (against.Bound(0.08), False, ["the worst error, 10.0%, is past 8%"]),
    (against.Bound(0.12, median=0.03), False, ["the median error, 4.0%, is past 3%"]),
    (against.Bound(0.12, min_records=4), False, ["3 records predicted, fewer than 4"]),
], ids=["within", "worst", "median", "too-few"])
def test_against_summary_fails_each_part_of_the_bound(measured_file, bound, passed, failures):
    path, cal, _ = measured_file
    tgt = _target(cal)
    rows = against.compare(against.measured_records([path]).records, target_of=lambda rec: tgt)
    got = against.summary(rows, bound)
    assert (got["count"], got["refused"]) == (3, 1)
    assert got["median"] == pytest.approx(0.04) and got["worst"] == pytest.approx(0.10)
    assert got["passed"] is passed and got["failures"] == failures


@pytest.mark.slow
def test_against_cli_prints_each_error_and_exits_1_past_the_bound(measured_file):
    """Through the CLI: every record's error, the peer listed with its reason, the lines left out, the
    median and worst; exit 1 past --median-bound, 0 within the bounds (the JSON summary says so)."""
    path, cal, _ = measured_file
    res = ringbench_here("predict", "--against", str(path), "--calibration", str(cal), "--bound", "12%",
                         "--median-bound", "3%", cwd=path.parent)
    assert res.returncode == 1, res.stderr
    text = " ".join(res.stdout.split())
    for words in ("+10.0%", "-2.0%", "+4.0%", "(emulated)", "not predicted [1]",
                  "not predicted [1] (1 record): rfa_zigzag is a peer", "left out 5 lines: 1 with status oom",
                  "3 records predicted: median error 4.0%, worst 10.0%",
                  "past the bound: worst <= 12%, median <= 3%; the median error, 4.0%, is past 3%"):
        assert words in text, words
    res = ringbench_here("predict", "--against", str(path), "--against", str(path), "--calibration", str(cal),
                         "--bound", "12%", "--json", cwd=path.parent)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(lines) == 9 and lines[-1]["summary"]["passed"] is True and lines[-1]["summary"]["count"] == 6
    assert lines[-1]["summary"]["left_out"].startswith("left out 10 lines")


@pytest.mark.parametrize("args,words", [
    (["--variant", "zigzag", "--gpu", "H100", "--median-bound", "3%"], "--median-bound bounds the check of --against"),
    (["--variant", "zigzag", "--gpu", "H100", "--min-records", "30"], "--min-records bounds the check of --against"),
    (["--variant", "zigzag", "--gpu", "H100", "--latest"], "--latest bounds the check of --against"),
    (["--variant", "zigzag", "--gpu", "H100", "--out", "p.json"], "must end in .jsonl"),
    (["--against", "runs.jsonl", "--out", "p.jsonl"], "--out does not go with --against"),
    (["--against", "runs.jsonl", "--min-records", "0"], "min-records 0 must be 1 or more"),
    (["--against", "runs.jsonl", "--median-bound", "three"], "is not a percentage"),
    (["--against", "runs.jsonl", "--median-bound", "0%"],
     "median-bound '0%' is not a percentage above 0, such as 3%; pass --median-bound 3%"),
    (["--variant", "zigzag", "--gpu", "H100", "--bound", "5%"], "--bound bounds the check of --against"),
    (["--variant", "zigzag", "--variant", "stripe", "--gpu", "H100", "--placement", "ring-inner"],
     "--placement ring-inner places the Ulysses and ring groups of a hybrid such as usp, and zigzag and stripe have "
     "none; drop --placement"),
], ids=["median-alone", "min-alone", "latest-alone", "out-suffix", "out-against", "min-zero", "median-word",
        "median-zero", "bound-alone", "placement-no-hybrid"])
def test_predict_refuses_bad_against_and_out_options_in_one_sentence(tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    res = _invoke("predict", *args)
    message = " ".join(res.output.split())
    assert res.exit_code == 2 and words in message, message
    assert "Traceback" not in res.output and not (tmp_path / "p.jsonl").exists()


def test_against_refuses_files_without_a_record_to_check(tmp_path):
    path = tmp_path / "verify.jsonl"
    path.write_text(json.dumps({"task": "verify", "status": "ok", "spec": {"task": "verify"}}) + "\n"
                    + json.dumps({"task": "run", "status": "skipped", "spec": {"task": "run"}}) + "\n", encoding="utf-8")
    with pytest.raises(Exception, match=r"holds no ok run record with a time to check \(left out 2 lines: 1 verify "
                                        r"record, 1 with status skipped\)"):
        against.measured_records([path])


@pytest.mark.parametrize("change", [{"time_ms": "NaN"}, {"time_ms": -3.0}, {"time_ms": float("inf")}, {"env": "x"}])
def test_against_leaves_out_records_with_an_impossible_time_or_a_damaged_env(tmp_path, change):
    """A time of -3 was checked (error -273%), a text time or a text env came out as a traceback (exit 1)."""
    from ringbench.present.validation import CHECK_A, ROOT

    good = next(json.loads(line) for line in (ROOT / CHECK_A.files[0]).read_text().splitlines()
                if json.loads(line).get("status") == "ok")
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, **change}) + "\n", encoding="utf-8")
    measured = against.measured_records([path])
    assert len(measured.records) == 1 and "left out 1 line" in measured.left_out_text()


def test_against_with_nothing_the_model_can_predict_exits_2_in_one_sentence(tmp_path, monkeypatch):
    """A file whose ok run records are all refused by the model (here a peer's and a CPU record with no GPU)
    exited 1, as if the model had missed its bound: it is bad input, refused with exit 2, saying why."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(_record(_spec(variant="rfa_zigzag", world_size=2, seqlen=512), 1.0)) + "\n"
                    + json.dumps(_record(_spec(variant="zigzag", world_size=2, seqlen=512), 1.0)) + "\n",
                    encoding="utf-8")
    res = _invoke("predict", "--against", str(path))
    message = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert message.startswith(f"against {str(path)!r}: the model can predict none of its 2 ok run records; the "
                              "first, "), message
    assert "rfa_zigzag is a peer" in message and "Traceback" not in res.output
    assert message.count(". ") == 0 and len(res.output.strip().splitlines()) <= 4, message  # one sentence


def test_against_reads_every_committed_results_file():
    """Each .jsonl under results/reference/ is read without a crash: its records are checked, or counted as
    left out, and a file with nothing to check is refused in one sentence."""
    from ringbench.errors import SpecError

    files = sorted((Path(__file__).resolve().parents[1] / "results" / "reference").rglob("*.jsonl"))
    assert len(files) >= 20, files
    checked = 0
    for path in files:
        try:
            found = against.measured_records([path])
        except SpecError as exc:
            assert "holds no ok run record" in str(exc) and str(exc).count(". ") == 0, exc
            continue
        checked += len(found.records)
        assert all(r["status"] == "ok" and r["time_ms"] for r in found.records)
    assert checked >= 150


# --------------------------------------------------------------------------- predicted records in compare

def _invoke(*args: str):
    from typer.testing import CliRunner

    from ringbench.cli import app

    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, list(args))


@pytest.fixture
def predicted_and_measured(tmp_path):
    """``predict --out`` of zigzag and ring at W=2, 512 and 1024 tokens (a flat calibration), and a file of
    'measured' records of the same cases (the predictions with predicted dropped and half the TFLOP/s)."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(flat_calibration(1e12, SHAPE)), encoding="utf-8")
    out = tmp_path / "predicted.jsonl"
    res = _invoke("predict", "--variant", "zigzag", "--variant", "ring", "--world-size", "2", "--seqlen", "512",
                  "--seqlen", "1024", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp32",
                  "--calibration", str(cal), "--out", str(out))
    assert res.exit_code == 0, res.output
    predicted = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(predicted) == 4 and all(r["predicted"] is True for r in predicted)
    measured = tmp_path / "measured.jsonl"
    measured.write_text("".join(json.dumps({k: v for k, v in {**r, "tflops_per_gpu": r["tflops_per_gpu"] / 2}.items()
                                            if k not in ("predicted", "prediction")}) + "\n" for r in predicted),
                        encoding="utf-8")
    return out, measured, predicted


def test_compare_shows_a_prediction_beside_the_measurement_of_its_case(predicted_and_measured):
    out, measured, predicted = predicted_and_measured
    res = _invoke("compare", str(out), str(measured), "--json")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["variant"], r["predicted"]) for r in rows] == [("ring", False), ("ring", True), ("zigzag", False),
                                                              ("zigzag", True)], rows
    by = {(r["variant"], r["predicted"]): r["values"] for r in rows}
    for rec in predicted:
        seqlen = str(rec["spec"]["seqlen"])
        assert by[(rec["spec"]["variant"], True)][seqlen] == pytest.approx(rec["tflops_per_gpu"], rel=1e-3)
        assert by[(rec["spec"]["variant"], False)][seqlen] == pytest.approx(rec["tflops_per_gpu"] / 2, rel=1e-3)
    assert "older record" not in res.stderr  # neither stands in for the other
    table = _invoke("compare", str(out), str(measured))
    header, *lines = [line.split() for line in table.stdout.splitlines()[1:] if line.strip() and "─" not in line]
    assert "predicted" in header and {"predicted", "measured"} <= {w for line in lines for w in line}


def test_compare_of_predictions_alone_says_so_in_its_title(predicted_and_measured):
    out, _, _ = predicted_and_measured
    res = _invoke("compare", str(out))
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[0].strip() == "TFLOP/s per GPU by seqlen, predicted (not measured)"
    assert "measured " not in res.stdout.split("\n", 1)[1]


def test_compare_plot_draws_predictions_dashed_beside_solid_measurements(predicted_and_measured):
    from ringbench.present import compare

    out, measured, _ = predicted_and_measured
    loaded = compare.load_runs([out, measured])
    p = compare.pivot(loaded.frame, metric="tflops")
    fig = compare.plot(p, loaded.frame)
    styles = {line.get_label(): line.get_linestyle() for ax in fig.axes for line in ax.get_lines()
              if not line.get_label().startswith("_")}
    assert styles == {"ring / cpu / measured": "-", "ring / cpu / predicted": "--", "zigzag / cpu / measured": "-",
                      "zigzag / cpu / predicted": "--"}, styles
    assert "predicted long-dashed" in fig.legends[0].get_title().get_text()


# --------------------------------------------------------------------------- advise --plot

@pytest.mark.parametrize("world_size,per,expected", [(64, 8, [1, 2, 4, 8, 16, 32, 64]), (24, 8, [1, 2, 4, 8, 16, 24]),
                                                     (6, 8, [1, 2, 4, 6]), (1, 8, [1])])
def test_advise_plot_world_sizes_are_powers_of_two_and_whole_nodes(world_size, per, expected):
    from ringbench.model.advise import plot_world_sizes

    assert plot_world_sizes(world_size, per) == expected


def test_advise_plot_predicts_each_leader_at_each_world_size(tmp_path):
    """advise --plot through the CLI writes the figure; the series under it hold, per leading variant,
    the prediction of its own case at each world size, and a refusal where the rules refuse it
    (usp's Ulysses degree above the world size)."""
    from ringbench.model import advise as adv
    from ringbench.model.predict import predict_case
    from ringbench.present.advise_plot import plot_scaling
    from ringbench.sweep import build

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(flat_calibration(1e12, SHAPE)), encoding="utf-8")
    png = tmp_path / "advise.png"
    res = _invoke("advise", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "fp32", "--seqlen", "2k",
                  "--mode", "fwd", "--calibration", str(cal), "--gpus-per-node", "4", "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert png.stat().st_size > 10_000 and "leading variants against world size written to" in res.output
    shape = {"heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "fp32", "seqlen": 2048, "mode": "fwd"}
    tgt = _target(cal)

    def build_at(fields, w):
        return build.build_cases("run", None, {**fields, "world_size": [w], "device": "cpu"}, machine=("cpu", w),
                                 resolve_kernels=False)[0][0]

    usp = adv.Candidate({**shape, "variant": "usp", "kernel": "cpu", "ulysses_degree": 2})
    zigzag = adv.Candidate({**shape, "variant": "zigzag", "kernel": "cpu"})
    series = adv.scaling([zigzag, usp], build=build_at, tgt=tgt, world_sizes=[1, 2, 4], memory_gib=None)
    assert [s["label"] for s in series] == ["zigzag, cpu", "usp U=2, cpu"]
    for s, c in zip(series, (zigzag, usp)):
        for point in s["points"]:
            if "refused" in point:
                continue
            w = point["world_size"]
            spec = build_at(c.fields, w).replace(kernel="cpu")
            expected = predict_case(spec, calibration=tgt.calibration, kernel="cpu", cluster=tgt.cluster(w))["time_ms"]
            assert point["time_ms"] == pytest.approx(expected, rel=1e-12)
    assert [("refused" in p) for p in series[1]["points"]] == [True, False, False], series[1]
    zig = [p["time_ms"] for p in series[0]["points"]]
    assert zig[0] > zig[1] > zig[2]  # the same sequence over more ranks
    fig = plot_scaling([{**series[0], "points": [{**p, "fits": p["world_size"] > 1} for p in series[0]["points"]]},
                        series[1]], None, title="t", subtitle="s")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["zigzag, cpu", "usp U=2, cpu"]
    assert "open markers: would not fit" in fig.legends[0].get_title().get_text()


# --------------------------------------------------------------------------- a published table, and the page

def _table(tmp_path, cal_device: str = "cpu") -> dict:
    """A published table of the shape of ring-flash-attn's, at world size 2 with 256 tokens per GPU."""
    from ringbench.model import published

    path = tmp_path / "table.toml"
    path.write_text(f'''source = "test"
gpu = "{cal_device}"
world_size = 2
fabric = "nvlink4"
kernel = "cpu"
[shape]
heads = 2
kv_heads = 1
head_dim = 16
dtype = "fp32"
causal = true
batch = 1
tokens_per_gpu = 256
[[batch.rows]]
function = "zigzag_func"
variant = "zigzag"
fwd_bwd = {{ efficiency = 0.9 }}
[varlen]
documents_per_gpu = [[256], [64, 192]]
[[varlen.rows]]
function = "llama3_varlen_func"
variant = "llama3_varlen"
heads_k_stride = 1
fwd = {{ efficiency = 0.5 }}
''', encoding="utf-8")
    return published.load(path)


def _build_cpu(fields, w):
    from ringbench.sweep import build

    return build.build_cases("run", None, {**fields, "world_size": [w], "device": "cpu"}, machine=("cpu", w),
                             resolve_kernels=False)[0][0]


def test_published_table_cases_scale_the_documents_and_keep_the_per_gpu_reference(tmp_path):
    from ringbench.model import published

    table = _table(tmp_path)
    cases, refs = published.row_cases(table, "varlen", table["varlen"]["rows"][0], "fwd")
    assert [(c["variant"], c["seqlen"], c["docs"], c["heads_k_stride"]) for c in cases] == [
        ("llama3_varlen", 512, "512", 1), ("llama3_varlen", 512, "128,384", 1)]
    assert [(r["variant"], r["seqlen"], r["docs"]) for r in refs] == [("ring_varlen", 256, "256"),
                                                                      ("ring_varlen", 256, "64,192")]
    assert all("heads_k_stride" not in r for r in refs)


def test_published_table_reads_the_prediction_as_the_library_reads_its_figure(tmp_path):
    """A batch row's reading (world size x the kernel on one GPU's tokens, over the variant's time) is
    the predicted record's own efficiency; a varlen row's sums the times over its sets of documents."""
    from ringbench.model import published
    from ringbench.model.predict import predict_case, reference_ms

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(flat_calibration(1e12, SHAPE)), encoding="utf-8")
    tgt = _target(cal)
    table = _table(tmp_path)
    rows = published.predict(table, build=_build_cpu, tgt=tgt)
    assert [(r["api"], r["variant"], r["mode"], r["published"]) for r in rows] == [
        ("batch", "zigzag", "fwd_bwd", 0.9), ("varlen", "llama3_varlen", "fwd", 0.5)]
    spec = _build_cpu({"variant": "zigzag", "seqlen": 512, "heads": 2, "kv_heads": 1, "head_dim": 16,
                       "dtype": "fp32", "kernel": "cpu", "mode": "fwd_bwd"}, 2)
    record = predict_case(spec, calibration=tgt.calibration, kernel="cpu", cluster=tgt.cluster(2))
    assert rows[0]["predicted"] == pytest.approx(record["efficiency"], rel=1e-9)
    assert sum(rows[0]["path"].values()) == pytest.approx(1.0)
    times, refs = 0.0, 0.0
    for docs, local in (("512", "256"), ("128,384", "64,192")):
        fields = {"seqlen": 512, "heads": 2, "kv_heads": 1, "head_dim": 16, "dtype": "fp32", "kernel": "cpu",
                  "mode": "fwd"}
        case = _build_cpu({**fields, "variant": "llama3_varlen", "docs": docs, "heads_k_stride": 1}, 2)
        times += predict_case(case, calibration=tgt.calibration, kernel="cpu", cluster=tgt.cluster(2))["time_ms"]
        ref = _build_cpu({**fields, "variant": "ring_varlen", "seqlen": 256, "docs": local}, 1)
        refs += reference_ms(ref, tgt.calibration, "cpu")[0]
    assert rows[1]["predicted"] == pytest.approx(2 * refs / times, rel=1e-9)
    assert rows[1]["cases"] == [{"seqlen": 512, "docs": "512"}, {"seqlen": 512, "docs": "128,384"}]


def test_published_ring_flash_attn_table_holds_the_readme_figures():
    """The committed table says where its figures come from, and they are the README's (8 x H800)."""
    from ringbench.model import published
    from ringbench.present import validation

    table = published.load(validation.ROOT / validation.PUBLISHED)
    assert table["source"].startswith("https://github.com/zhuzilin/ring-flash-attention/blob/")
    figures = {(api, r["variant"]): r["fwd_bwd"]["efficiency"] for api in ("batch", "varlen")
               for r in table[api]["rows"]}
    assert figures == {("batch", "ring"): 0.539, ("batch", "zigzag"): 0.902, ("batch", "stripe"): 0.829,
                       ("varlen", "ring_varlen"): 0.511, ("varlen", "zigzag_varlen"): 0.759,
                       ("varlen", "llama3_varlen"): 0.581}
    for api in ("batch", "varlen"):  # each figure is its iter/s over the theoretic one, as published
        theoretic = table[api]["theoretic"]
        for r in table[api]["rows"]:
            for mode in ("fwd", "fwd_bwd"):
                assert r[mode]["iter_s"] / theoretic[mode][1] == pytest.approx(r[mode]["efficiency"], abs=2e-3)


@pytest.mark.parametrize("worst,passed,failures", [
    (0.12, False, ["2 records predicted slower than measured"]),
    (0.08, False, ["1 record off by more than 8%", "2 records predicted slower than measured"]),
])
def test_validation_one_sided_check_fails_a_prediction_slower_than_the_measurement(measured_file, worst, passed,
                                                                                  failures):
    """Check (b)'s band: within its width and at or above the measurement; the zigzag records (+10%, +4%)
    are slower than measured, the ring one (-2%) is not bounded (the check bounds zigzag only here)."""
    from ringbench.present import validation

    path, cal, _ = measured_file
    tgt = _target(cal)
    check = validation.RecordCheck("b", "test", (path.name,), against.Bound(worst),
                                   bounded=lambda row: row["variant"] == "zigzag", one_sided=True)
    result = validation.run_records(check, root=path.parent, target_of=lambda rec: tgt)
    assert result["passed"] is passed and result["failures"] == failures
    assert [(r["variant"], r["bounded"], r.get("within")) for r in result["rows"]] == [
        ("zigzag", True, False), ("ring", False, None), ("zigzag", True, False), ("rfa_zigzag", False, None)]
    ring_only = validation.RecordCheck("b", "test", (path.name,), against.Bound(worst),
                                       bounded=lambda row: row["variant"] == "ring", one_sided=True)
    assert validation.run_records(ring_only, root=path.parent, target_of=lambda rec: tgt)["passed"] is True


@pytest.mark.slow
def test_validation_page_is_what_its_command_writes_now():
    """docs/validation.md's tables are what ``python -m ringbench.present.validation`` gives today: a
    change to the model, a shipped calibration or a committed record must be written to the page."""
    from ringbench.present import doc_tables, validation

    text = validation.PAGE.read_text(encoding="utf-8")
    found = doc_tables.current(text, validation.MARKER)
    assert found is not None, "docs/validation.md lost its <!-- validation:begin --> / <!-- validation:end --> markers"
    results = validation.run_all()
    generated = validation.generate(results=results) + "\n"
    assert validation.VALIDATED.read_text(encoding="utf-8") == validation.validated(
            (validation.CHECK_A, results[0]), (validation.CHECK_A_H100, results[1])), (
        f"ringbench/model/validated.json is stale; regenerate it with `{validation.REGENERATE}`")
    assert found == generated, (f"docs/validation.md is stale; regenerate it with `{validation.REGENERATE}` from the "
                                "checkout's root")
    for check in ("(a)", "(b)", "(c)"):  # each check states its bound and its verdict
        row = next(line for line in generated.splitlines() if line.startswith(f"| {check}"))
        assert "**pass**" in row or "**fail**" in row, row


def test_validation_command_says_the_page_is_up_to_date_when_nothing_changed(tmp_path, monkeypatch, capsys):
    """``python -m ringbench.present.validation`` printed nothing when it changed nothing, which reads as
    if it had not run."""
    from ringbench.present import validation

    monkeypatch.setattr(validation, "run_all", lambda: (None, None))
    monkeypatch.setattr(validation, "generate", lambda results: "| (a) | table |")
    monkeypatch.setattr(validation, "validated", lambda *checks: "{}")
    page = tmp_path / "validation.md"
    page.write_text("# page\n<!-- validation:begin -->\nold\n<!-- validation:end -->\n", encoding="utf-8")
    assert validation.main([str(page)]) == 0
    assert capsys.readouterr().out.startswith(f"rewrote the validation tables of {page}")
    assert validation.main([str(page)]) == 0
    assert capsys.readouterr().out.strip() == (f"{page} is up to date: its validation tables are what the checks "
                                               "give now")


@pytest.mark.parametrize("mask, seqlen", [
    (["--mask-file", str(Path(__file__).parent / "data" / "masks" / "image_in_text.txt")], "1k"),  # blind rows at 1k
    (["--mask", "shared-prefix:40,answers=5"], "1k"),  # 984 tokens do not split into 5 answers
    (["--mask", "prefix:100"], "1k"),
])
def test_predict_says_a_mask_is_not_priced_on_an_engine_before_any_seqlen_it_would_offer(tmp_path, monkeypatch, mask,
                                                                                         seqlen):
    """predict with a mask on an engine whose masked blocks the model does not walk (ring_varlen) offered a
    --seqlen first (the mask's own rule), then said the mask is not priced there: that sentence comes
    first, since no seqlen helps."""
    monkeypatch.chdir(tmp_path)
    res = _invoke("predict", "--variant", "ring_varlen", "--gpu", "H100", "--world-size", "2", "--seqlen", seqlen, *mask)
    message = " ".join(res.output.split())
    assert res.exit_code == 2, message
    assert re.fullmatch(r"mask \S+ is priced on ring, zigzag, stripe, llama3, ulysses, usp only, not on ring_varlen "
                        r"\(the model does not walk its masked blocks yet\); predict one of those, or measure "
                        r"ring_varlen under the mask with ringbench run", message), message
    assert "--seqlen" not in message


def test_predict_prices_a_mask_on_the_ring_engines_from_its_window_calls(tmp_path, monkeypatch):
    """Under a mask the ring engines' partial blocks are window calls, one per slice: the model walks
    them, so a mask with less to attend is predicted faster than causal, and its FLOPs count only the
    mask's pairs."""
    monkeypatch.chdir(tmp_path)
    base = ("predict", "--variant", "zigzag", "--gpu", "H100", "--world-size", "4", "--seqlen", "16k", "--json")
    found = {}
    for mask in ("causal", "chunked:1k", "prefix:2k"):
        res = _invoke(*base, "--mask", mask)
        assert res.exit_code == 0, res.output
        (rec,) = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
        found[mask] = rec
    causal, chunked, prefix = found["causal"], found["chunked:1k"], found["prefix:2k"]
    assert chunked["time_ms"] < causal["time_ms"]  # 1/16 of causal's pairs, in many small calls
    assert chunked["flops_per_gpu"] == pytest.approx(causal["flops_per_gpu"] * 1025 / 16384, rel=1e-9)  # flash-attn: causal S^2/2
    assert prefix["flops_per_gpu"] > causal["flops_per_gpu"]
    assert prefix["time_ms"] > causal["time_ms"]


@pytest.mark.parametrize("mask", ["window:4k", "window:4k,4k", "global:64,window:4k", "chunked:8k"])
def test_predict_never_prices_a_window_or_mask_of_fewer_pairs_above_causal(tmp_path, monkeypatch, mask):
    """A case with an eighth of causal's pairs or fewer is never predicted slower than causal on the ring
    engines. A ring step's part past the diagonal has the band (0, None), a window of 1 as its call
    reads it: priced at that window's rate it made zigzag at W=8 64k under a 4k window take 1772 ms."""
    monkeypatch.chdir(tmp_path)
    base = ("predict", "--variant", "zigzag", "--variant", "ring", "--variant", "stripe", "--gpu", "H200",
            "--world-size", "8", "--seqlen", "64k", "--json")
    times = {}
    for given in ("causal", mask):
        res = _invoke(*base, "--mask", given)
        assert res.exit_code == 0, res.output
        for line in res.output.splitlines():
            if line.startswith("{"):
                rec = json.loads(line)
                times[(given, rec["spec"]["variant"])] = rec["time_ms"]
    for variant in ("zigzag", "ring", "stripe"):
        assert times[(mask, variant)] < times[("causal", variant)], (variant, times)


def test_predict_intervals_hold_their_point_in_order(tmp_path, monkeypatch):
    """Each interval runs low to high and holds the figure it brackets (usp at W=8 64k gave a time of
    28.10 ms with an interval of 27.26-28.07, and an efficiency interval upside down)."""
    monkeypatch.chdir(tmp_path)
    res = _invoke("predict", "--variant", "usp", "--variant", "stripe", "--variant", "zigzag", "--gpu", "H200",
                  "--world-size", "8", "--seqlen", "64k", "--json")
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    assert len(recs) >= 3
    for rec in recs:
        band = rec["prediction"]["interval"]
        for key, point in (("time_ms", rec["time_ms"]), ("tflops_per_gpu", rec["tflops_per_gpu"]),
                           ("efficiency", rec["efficiency"])):
            lo, hi = band[key]
            assert lo <= point * (1 + 1e-12) and point <= hi * (1 + 1e-12), (rec["spec"]["variant"], key, band[key], point)


def test_predict_predicts_what_it_can_and_names_what_it_refused(tmp_path, monkeypatch):
    """One variant the model cannot walk under the mask does not stop the others: they are predicted,
    and the refused one is named with its reason; where every variant is refused, exit 2."""
    monkeypatch.chdir(tmp_path)
    both = ("predict", "--variant", "zigzag", "--variant", "ring_varlen", "--gpu", "H200", "--world-size", "8",
            "--seqlen", "64k", "--docs", "32k,32k", "--mask", "prefix:8k")
    res = _invoke(*both, "--json")
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in res.output.splitlines() if line.startswith("{")]
    assert [r["spec"]["variant"] for r in recs] == ["zigzag"]
    assert "not predicted: mask prefix:8192 is priced on ring, zigzag" in " ".join(res.output.split())
    alone = _invoke("predict", "--variant", "ring_varlen", "--gpu", "H200", "--world-size", "8", "--seqlen", "64k",
                    "--docs", "32k,32k", "--mask", "prefix:8k")
    assert alone.exit_code == 2 and "not on ring_varlen" in " ".join(alone.output.split())


def test_predict_refuses_a_mask_of_more_slices_than_it_walks(tmp_path, monkeypatch):
    """chunked:3 over 64k tokens is 21846 slices, each a window call of every block it meets: the model
    walked it for minutes; it is refused at once, in one sentence."""
    monkeypatch.chdir(tmp_path)
    res = _invoke("predict", "--variant", "zigzag", "--gpu", "H200", "--world-size", "8", "--seqlen", "64k",
                  "--mask", "chunked:3")
    message = " ".join(res.output.split())
    assert res.exit_code == 2, message
    assert message == ("mask chunked:3 cuts 65536 tokens into 21846 slices, more than the 4096 the model walks (each "
                       "a window call of every block it meets); predict a coarser mask, or measure this one with "
                       "ringbench run"), message


def test_advise_lists_usp_at_one_ulysses_rank_once_as_zigzag(tmp_path, monkeypatch):
    """usp at U=1 is its zigzag ring: the model walks zigzag's schedule for it, so advise ranks zigzag
    and no second row that could only tie with it; usp's other factorizations stay."""
    monkeypatch.chdir(tmp_path)
    res = _invoke("advise", "--preset", "llama3-8b", "--seqlen", "64k", "--gpu", "H200", "--nodes", "1", "--json")
    assert res.exit_code == 0, res.output
    names = [json.loads(line)["candidate"] for line in res.output.splitlines() if line.startswith("{")]
    assert any(n.startswith("zigzag,") for n in names) and any(n.startswith("usp U=2,") for n in names), names
    assert not any(n.startswith("usp U=1,") for n in names), names


def test_predict_help_leaves_out_how_to_measure():
    """predict measures nothing: --iters, --warmup, --emulate, --profile, --min-time-ms and --flush-l2
    are not in its help (run's still lists them), and --emulate given anyway is refused in a sentence."""
    shown = " ".join(_invoke("predict", "--help").output.split())
    for option in ("--iters", "--warmup", "--emulate", "--profile", "--min-time-ms", "--flush-l2"):
        assert option not in shown, option
        assert option in " ".join(_invoke("run", "--help").output.split()), option
    assert "--mask" in shown and "--gpu" in shown
