"""TransformerEngine's 36 context-parallel test configurations as ringbench verify commands.

Each entry below restates one configuration of TransformerEngine's context-parallel tests
(tests/pytorch/attention/test_attention_with_cp.py: its FlashAttention list, its FusedAttention
list and its two head-dim-256 cases) in ringbench's own options, scaled down for CPU by one rule:
seqlen and window widths divided by 16, batch 1 (TE: 2); heads, K/V heads, head dims, mask, bias,
sink and max logit as TE gives them.

    python results/reference/2026-12-05-cpu-te-configs/te_configs.py run     # every command, records here
    python results/reference/2026-12-05-cpu-te-configs/te_configs.py table   # docs/te-configs.md's table

``run`` writes each configuration's records to ``records/<suite>-<name>/verify.jsonl`` (the
per-rank logs are removed); ``table`` rebuilds the table between the markers of docs/te-configs.md
from those records alone. ``run NAME...`` runs only the named ones (``flash-cp_1_0``).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
DOC = ROOT / "docs" / "te-configs.md"
RINGBENCH = [sys.executable, "-m", "ringbench.cli"]
#: TE's p2p, all_gather and a2a, as ringbench's variants, at world sizes 2 and 4 ...
VARIANTS = ("zigzag", "llama3", "ulysses")
WORLD_SIZES = (2, 4)
#: ... and its a2a+p2p on four ranks: usp, Ulysses in groups of 2, a ring of 2 across them.
HYBRID = "--variant usp --world-size 4 --ulysses-degree 2"
SCALE = 16

# (suite, name, TE's shape in words, ringbench shape options, fp8 in TE's sweep)
# TE shape: batch, seqlen, heads, kv heads, head dim (qk/v), mask, window (left, right), bias shape, max logit, softmax.
CONFIGS = [
    ("flash", "cp_1_0", "2, 4096, 12/12, 128, causal", "--heads 12 --kv-heads 12 --head-dim 128 --causal", False),
    ("flash", "cp_1_1", "2, 4096, 12/12, 128, no mask", "--heads 12 --kv-heads 12 --head-dim 128 --no-causal", False),
    ("flash", "cp_1_2", "2, 4096, 12/12, 128, causal, window (512, 0)",
     "--heads 12 --kv-heads 12 --head-dim 128 --causal --window 33", False),
    ("flash", "cp_1_3", "2, 4096, 12/12, 128, no mask, window (512, 512)",
     "--heads 12 --kv-heads 12 --head-dim 128 --mask window:33,32", False),
    ("flash", "cp_2_0", "2, 4096, 32/4, 128, causal", "--heads 32 --kv-heads 4 --head-dim 128 --causal", False),
    ("flash", "cp_2_1", "2, 4096, 12/2, 128, no mask", "--heads 12 --kv-heads 2 --head-dim 128 --no-causal", False),
    ("flash", "cp_2_2", "2, 4096, 32/32, 128, causal, window (128, 0)",
     "--heads 32 --kv-heads 32 --head-dim 128 --causal --window 9", False),
    ("flash", "cp_2_3", "2, 4096, 12/2, 128, no mask, window (512, 512)",
     "--heads 12 --kv-heads 2 --head-dim 128 --mask window:33,32", False),
    ("flash", "cp_3_0", "2, 4096, 128/128, 192/128, causal",
     "--heads 128 --kv-heads 128 --head-dim 192 --head-dim-v 128 --causal", False),
    ("flash", "cp_3_1", "2, 4096, 12/12, 192/128, no mask",
     "--heads 12 --kv-heads 12 --head-dim 192 --head-dim-v 128 --no-causal", False),
    ("flash", "cp_3_2", "2, 4096, 12/12, 192/128, causal, window (512, 0)",
     "--heads 12 --kv-heads 12 --head-dim 192 --head-dim-v 128 --causal --window 33", False),
    ("flash", "cp_3_3", "2, 4096, 12/12, 192/128, no mask, window (512, 512)",
     "--heads 12 --kv-heads 12 --head-dim 192 --head-dim-v 128 --mask window:33,32", False),
    ("fused", "cp_1_0", "2, 4096, 12/12, 128, causal, max logit",
     "--heads 12 --kv-heads 12 --head-dim 128 --causal --max-logit", True),
    ("fused", "cp_1_1", "2, 4096, 12/12, 128, no mask, max logit",
     "--heads 12 --kv-heads 12 --head-dim 128 --no-causal --max-logit", True),
    ("fused", "cp_1_2", "2, 4096, 12/12, 128, causal, bias 1hss",
     "--heads 12 --kv-heads 12 --head-dim 128 --causal --bias 1hss", False),
    ("fused", "cp_1_3", "2, 4096, 12/12, 128, no mask, bias 1hss",
     "--heads 12 --kv-heads 12 --head-dim 128 --no-causal --bias 1hss", False),
    ("fused", "cp_1_4", "2, 4096, 12/12, 128, no mask, bias bhss",
     "--heads 12 --kv-heads 12 --head-dim 128 --no-causal --bias bhss", False),
    ("fused", "cp_1_5", "2, 4096, 12/12, 128, causal, window (512, 512): the causal mask leaves (512, 0)",
     "--heads 12 --kv-heads 12 --head-dim 128 --causal --window 33", True),
    ("fused", "cp_2_0", "2, 4096, 32/4, 128, causal", "--heads 32 --kv-heads 4 --head-dim 128 --causal", True),
    ("fused", "cp_2_1", "2, 4096, 32/32, 128, causal, window (128, 0)",
     "--heads 32 --kv-heads 32 --head-dim 128 --causal --window 9", True),
    ("fused", "cp_2_2", "2, 4096, 12/2, 128, causal, bias 1hss",
     "--heads 12 --kv-heads 2 --head-dim 128 --causal --bias 1hss", False),
    ("fused", "cp_2_3", "2, 4096, 12/2, 128, causal, bias 11ss",
     "--heads 12 --kv-heads 2 --head-dim 128 --causal --bias 11ss", False),
    ("fused", "cp_2_4", "2, 4096, 12/2, 128, causal, bias 111s, max logit",
     "--heads 12 --kv-heads 2 --head-dim 128 --causal --bias 111s --max-logit", False),
    ("fused", "cp_2_5", "2, 4096, 12/2, 128, no mask, bias 1hss",
     "--heads 12 --kv-heads 2 --head-dim 128 --no-causal --bias 1hss", False),
    ("fused", "cp_2_6", "2, 4096, 12/2, 128, causal, window (512, 512): the causal mask leaves (512, 0)",
     "--heads 12 --kv-heads 2 --head-dim 128 --causal --window 33", True),
    ("fused", "cp_3_0", "2, 4096, 12/12, 128/64, causal",
     "--heads 12 --kv-heads 12 --head-dim 128 --head-dim-v 64 --causal", True),
    ("fused", "cp_3_1", "2, 4096, 128/128, 192/128, causal",
     "--heads 128 --kv-heads 128 --head-dim 192 --head-dim-v 128 --causal", True),
    ("fused", "cp_3_2", "2, 4096, 12/12, 128/64, causal, bias 1hss",
     "--heads 12 --kv-heads 12 --head-dim 128 --head-dim-v 64 --causal --bias 1hss", False),
    ("fused", "cp_3_3", "2, 4096, 12/12, 128/64, no mask, bias 1hss",
     "--heads 12 --kv-heads 12 --head-dim 128 --head-dim-v 64 --no-causal --bias 1hss", False),
    ("fused", "cp_3_4", "2, 4096, 12/12, 128/64, no mask, bias b1ss",
     "--heads 12 --kv-heads 12 --head-dim 128 --head-dim-v 64 --no-causal --bias b1ss", False),
    ("fused", "cp_4_0", "2, 4096, 64/8, 64, causal, plain softmax",
     "--heads 64 --kv-heads 8 --head-dim 64 --causal", True),
    ("fused", "cp_4_1", "2, 4096, 64/8, 64, causal, off-by-one softmax",
     "--heads 64 --kv-heads 8 --head-dim 64 --causal --sink off-by-one", True),
    ("fused", "cp_4_2", "2, 4096, 64/8, 64, causal, learnable sink",
     "--heads 64 --kv-heads 8 --head-dim 64 --causal --sink learnable", True),
    ("fused", "cp_4_3", "2, 4096, 64/64, 64, causal, window (128, 0), learnable sink",
     "--heads 64 --kv-heads 64 --head-dim 64 --causal --window 9 --sink learnable", True),
    ("d256", "cp_d256_causal", "2, 1024, 16/16, 256, causal",
     "--heads 16 --kv-heads 16 --head-dim 256 --causal", False),
    ("d256", "cp_d256_causal_swa", "2, 1024, 16/16, 256, causal, window (128, 0)",
     "--heads 16 --kv-heads 16 --head-dim 256 --causal --window 9", False),
]


def seqlen_of(te_shape: str) -> int:
    """The scaled seqlen: TE's (the second number of its shape) divided by :data:`SCALE`."""
    return int(te_shape.split(",")[1]) // SCALE


def commands(te_shape: str, options: str, out: str = "") -> list[str]:
    """The two ringbench verify commands of one configuration (``out``: their ``--out`` folder, or none):
    zigzag, llama3 and ulysses at W = 2 and 4, then usp at W = 4 with Ulysses degree 2."""
    variants = " ".join(f"--variant {v}" for v in VARIANTS)
    sizes = " ".join(f"--world-size {w}" for w in WORLD_SIZES)
    tail = f" --out {out}" if out else ""
    shape = f"--batch 1 --seqlen {seqlen_of(te_shape)} {options} --dtype bf16{tail}"
    return [f"ringbench verify --device cpu --kernel math {variants} {sizes} {shape}",
            f"ringbench verify --device cpu --kernel math {HYBRID} {shape}"]


def folder(suite: str, name: str) -> Path:
    return HERE / "records" / f"{suite}-{name}"


def run(names: list[str]) -> int:
    worst = 0
    for suite, name, shape, options, _ in CONFIGS:
        if names and f"{suite}-{name}" not in names:
            continue
        out = folder(suite, name)
        if out.exists():
            shutil.rmtree(out)
        for text in commands(shape, options, str(out.relative_to(ROOT))):
            start = time.monotonic()
            proc = subprocess.run(RINGBENCH + shlex.split(text)[1:], cwd=ROOT, capture_output=True, text=True)
            shutil.rmtree(out / "logs", ignore_errors=True)
            print(f"{suite}-{name}: exit {proc.returncode} in {time.monotonic() - start:.0f} s; "
                  f"{(proc.stdout.strip().splitlines() or [''])[-1:]}", flush=True)
            if proc.returncode not in (0, 1):
                print(proc.stderr[-2000:], flush=True)
            worst = max(worst, proc.returncode)
    return worst


def _verdict(records: list[dict], world_size: int) -> str:
    """``pass 0.41 (dq)`` / ``fail 3.2 (max_logit)``: every variant at ``world_size``, the worst
    max-rule ratio over them and their checks (and the block decomposition's where it is worse)."""
    found = [r for r in records if r["spec"]["world_size"] == world_size]
    if not found:
        return "not run"
    if any(r["status"] not in ("ok", "fail") for r in found):
        bad = next(r for r in found if r["status"] not in ("ok", "fail"))
        return f"{bad['status']} ({bad['spec']['variant']})"
    ratio, where = -1.0, ""
    shadow, shadow_where = -1.0, ""
    for r in found:
        for c in r["checks"]:
            if c["ratio"] > ratio:
                ratio, where = c["ratio"], f"{c['tensor']}, {r['spec']['variant']}"
            if c.get("shadow_ratio") is not None and c["shadow_ratio"] > shadow:
                shadow, shadow_where = c["shadow_ratio"], f"{c['tensor']}, {r['spec']['variant']}"
    word = "pass" if all(r["status"] == "ok" for r in found) else "fail"
    failed = [r["spec"]["variant"] for r in found if r["status"] != "ok"]
    text = f"{word} {ratio:.2f} ({where}); shadow {shadow:.2f} ({shadow_where})"
    return text + (f"; failed: {', '.join(failed)}" if failed else "")


def table() -> str:
    rows = ["| suite | config | TE's shape: batch, seqlen, heads/kv heads, head dim(s), mask, window, bias, "
            "max logit, softmax | fp8 in TE's sweep | OPTIONS | S | W=2 | W=4 |",
            "|---|---|---|---|---|---|---|---|"]
    for suite, name, shape, options, fp8 in CONFIGS:
        path = folder(suite, name) / "verify.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        fp8_text = "yes (out of scope)" if fp8 else "no"
        rows.append(f"| {suite} | `{name}` | {shape} | {fp8_text} | `{options}` | {seqlen_of(shape)} "
                    f"| {_verdict(records, 2)} | {_verdict(records, 4)} |")
    return "\n".join(rows) + "\n"


def write_table() -> None:
    text = DOC.read_text(encoding="utf-8")
    new = re.sub(r"(<!-- te-configs:begin -->\n).*?(<!-- te-configs:end -->)",
                 lambda m: m.group(1) + table() + m.group(2), text, flags=re.S)
    DOC.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        sys.exit(1 if run(sys.argv[2:]) > 1 else 0)
    if sys.argv[1:2] == ["table"]:
        write_table()
        sys.exit(0)
    print(__doc__)
    sys.exit(2)
