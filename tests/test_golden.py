"""Golden records: the same specs give the same records before and after a restructure.

``tests/data/golden/make.py`` ran a few cheap cases through the CLI (its ``COMMANDS``: verify over
``verify.toml``, 8 cases at world sizes 1, 2 and 4; run over 8 cases at world size 4) and stored
their records beside it. These tests run the same commands again and compare each new record
with the stored one of the same ``case_id``, field by field. They use only the CLI and json, so
they need no change when modules move.

Left out (``VARIES``), the keys that differed between two runs of each command on one machine,
and the ones that describe the machine or the commit rather than the case:

- ``run_id``, ``created_at``: a fresh id and date per command; ``elapsed_s``: wall seconds.
- ``time_ms``, ``per_rank_time_ms``, ``ref_time_ms`` and their p20 and p80 (``time_ms_p20``...):
  timings; ``imbalance``, ``tflops_per_gpu``, ``ref_tflops``, ``efficiency`` and ``bus_gib_s`` are
  computed from them.
- ``peak_tflops``: on CPU a matmul rate measured in each launch.
- ``env``: hostname, platform, python, torch and ringbench versions, git_commit (which the
  restructure itself changes); its ``kernel`` repeats the record's compared ``kernel``.

Fields the records gained after the golden ones were made (``ADDED``) may be missing from a
stored record, and must then hold the value that says these cases did not use them: the spec's
``min_time_ms`` 0, ``flush_l2`` false and ``mask`` empty, ``--iters`` iterations timed, no flush buffer, and
``cuda_graph`` auto, which on CPU runs eagerly and says so.

Everything else is compared exactly: the spec, status, FLOPs, bytes sent, predicted pairs, memory
(null on CPU), each check's pass. The floats of the checks (verify's errors and allowances per
tensor) need only agree within a factor of ``FLOAT_FACTOR``: they repeat bit for bit on one machine,
but two machines of the same kind, same torch build, SIMD path (AVX512) and thread count gave
floats up to 1.6x apart (the CPU kernels' reduction order differs), so bitwise comparison failed
a clean clone. A dropped block or a wrong mask moves an error by orders of magnitude, and flips a
check's ``passed``, which is compared exactly.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from helpers import ringbench_here

GOLDEN = Path(__file__).parent / "data" / "golden"
_spec = importlib.util.spec_from_file_location("golden_make", GOLDEN / "make.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

VARIES = {"run_id", "created_at", "elapsed_s", "time_ms", "per_rank_time_ms", "ref_time_ms", "imbalance",
          "tflops_per_gpu", "ref_tflops", "efficiency", "bus_gib_s", "peak_tflops", "env",
          "time_ms_p20", "time_ms_p80", "per_rank_time_ms_p20", "per_rank_time_ms_p80", "ref_time_ms_p20", "per_rank_ref_time_ms",
          "ref_time_ms_p80"}
#: Flattened fields added since the golden records were made (issue 25's timing protocol), and
#: the value each new record must hold where the stored one lacks it, from the new record.
ADDED = {
    "spec.min_time_ms": lambda record: 0,
    "spec.flush_l2": lambda record: False,
    "timed_iters": lambda record: record["spec"]["iters"],
    "ref_timed_iters": lambda record: record["spec"]["iters"],
    "l2_flush_bytes": lambda record: None,
    "spec.cuda_graph": lambda record: "auto",
    "cuda_graph": lambda record: False,
    "cuda_graph_note": lambda record: "cpu has no CUDA graphs",
    "spec.mask": lambda record: "",  # issue 26: no mask beyond --causal and --window
    "spec.bias": lambda record: "",  # issue 26, item 3: no attention bias
    "spec.max_logit": lambda record: False,  # issue 26, item 2: no max logit returned
    # verify's kernel rule, null in fp32 (every golden verify command is fp32)
    **{f"checks[{t}].{field}": (lambda record: None) for t in ("out", "lse", "dq", "dk", "dv", "dsink")
       for field in ("kernel_units", "kernel_limit", "kernel_passed")},
}


#: How far a check's float may move between machines (see the module's docstring).
FLOAT_FACTOR = 2.0


def _close(a: float, b: float) -> bool:
    """Within ``FLOAT_FACTOR`` of each other, of the same sign (zero only with zero)."""
    if a == 0 or b == 0:
        return a == b
    return (a > 0) == (b > 0) and max(a / b, b / a) <= FLOAT_FACTOR


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _label(record: dict) -> str:
    spec = record.get("spec") or {}
    return (f"{spec.get('task')} {spec.get('variant')} W={spec.get('world_size')} S={spec.get('seqlen')}"
            f" (case_id {record.get('case_id')})")


def _flat(value, path: str = "") -> dict:
    """``{"checks[out].err": 4.3e-07, ...}``: list items named by their ``tensor`` where they have one."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{path}.{key}" if path else key).items()}
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return {k: v for i, item in enumerate(value)
                for k, v in _flat(item, f"{path}[{item.get('tensor', i) if isinstance(item, dict) else i}]").items()}
    return {path: value}


def _differences(old: dict, new: dict) -> list[str]:
    record = new
    old = _flat({k: v for k, v in old.items() if k not in VARIES})
    new = _flat({k: v for k, v in new.items() if k not in VARIES})
    missing = object()
    lines = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key, missing), new.get(key, missing)
        if a is missing and key in ADDED and b is not missing:
            a = ADDED[key](record)  # what a record of the time would have said
        if a is missing or b is missing:
            lines.append(f"{key} {'added' if a is missing else 'removed'}: {b if a is missing else a!r}")
        elif (a != b or type(a) is not type(b)) and not (a != a and b != b):  # 1 is not 1.0; NaN is NaN
            if type(a) is float and type(b) is float and _close(a, b):
                continue
            lines.append(f"{key} changed: {a!r} -> {b!r}")
    return lines


def _ringbench(args: list, out: Path, *extra: str):
    """``make.ringbench`` (``ringbench ARGS --out OUT EXTRA`` in ``out``, failing unless it exits 0), with
    the command line run in this process: the launches are still real torchrun."""
    out.mkdir(parents=True, exist_ok=True)
    done = ringbench_here(*args, "--out", str(out), *extra, cwd=out)
    assert done.returncode == 0, f"ringbench {' '.join(args)} exited {done.returncode}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", list(make.COMMANDS))
def test_golden_same_commands_give_the_same_records(tmp_path, name):
    import torch  # only to name the build the stored floats came from

    stored = _read(GOLDEN / name)
    if stored[0]["env"]["torch"] != torch.__version__:
        pytest.skip(f"{name} was made with torch {stored[0]['env']['torch']}, not {torch.__version__}: "
                    "regenerate it on main first (tests/data/golden/make.py)")
    out = tmp_path / "out"
    _ringbench(make.COMMANDS[name], out)
    fresh = _read(out / name)

    old, new = {r["case_id"]: r for r in stored}, {r["case_id"]: r for r in fresh}
    problems = [f"stored case with no new record: {_label(old[c])}" for c in old.keys() - new.keys()]
    problems += [f"new record with no stored case: {_label(new[c])}" for c in new.keys() - old.keys()]
    if problems and len(stored) == len(fresh):  # say what moved in the spec, pairing by position
        for i, (a, b) in enumerate(zip(stored, fresh)):
            if a["case_id"] != b["case_id"]:
                problems += [f"{_label(a)} at position {i}: {line}"
                             for line in _differences({"spec": a["spec"]}, {"spec": b["spec"]})]
    problems += [f"{_label(old[c])}: {line}" for c in old.keys() & new.keys() for line in _differences(old[c], new[c])]
    assert not problems, f"{name}: {len(problems)} differences from the golden records\n" + "\n".join(problems)


@pytest.mark.parametrize("name", list(make.COMMANDS))
def test_golden_records_of_main_load_and_resume_runs_nothing(tmp_path, name):
    """Records written by today's main load, and --resume takes each of their cases as done."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(GOLDEN / name, out / name)
    stored = _read(GOLDEN / name)
    shown = _ringbench(make.COMMANDS[name], out, "--resume", "--json").stdout
    ran = _read(out / name)[len(stored):]
    assert not ran, f"--resume ran {len(ran)} cases of {name} again: " + "; ".join(map(_label, ran))
    assert [json.loads(line) for line in shown.splitlines()] == stored  # printed as reused, unchanged


def test_golden_floats_agree_within_the_factor_and_everything_else_exactly():
    old = {"status": "ok", "checks": [{"tensor": "dq", "err": 1.0e-6, "passed": True}]}
    moved = {"status": "ok", "checks": [{"tensor": "dq", "err": 1.5e-6, "passed": True}]}
    assert _differences(old, moved) == []
    far = {"status": "ok", "checks": [{"tensor": "dq", "err": 2.5e-6, "passed": True}]}
    assert _differences(old, far) == ["checks[dq].err changed: 1e-06 -> 2.5e-06"]
    assert _differences(old, {**moved, "status": "fail"}) == ["status changed: 'ok' -> 'fail'"]
    flipped = {"status": "ok", "checks": [{"tensor": "dq", "err": 1.0e-6, "passed": False}]}
    assert _differences(old, flipped) == ["checks[dq].passed changed: True -> False"]
