# GPU call 3 of 3 (after the restructure of issue 23): W=1 and emulated W=2 and 8, with profiles, to hold
# against the numbers of 2026-12-01 (results/reference/2026-12-01-h200-lean/NOTES.md).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
R="ringbench run --device cuda --yes --mode fwd_bwd --out $OUT/r"
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > 500 )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s"; }
t w1_zigzag_fa4 110 $R --world-size 1 --variant zigzag --kernel flash-attn-4 --seqlen 16k --seqlen 128k
t w1_zigzag_cudnn 50 $R --world-size 1 --variant zigzag --kernel cudnn --seqlen 16k
t w1_l3v 90 $R --world-size 1 --variant llama3_varlen --kernel flash-attn-4 --kernel torch-flash --seqlen 64k --doc-dist lognormal:mean=4k,sigma=1
t emu_fa4 150 $R --emulate --profile --iters 5 --warmup 2 --variant zigzag --kernel flash-attn-4 --world-size 2 --world-size 8 --seqlen 16k --seqlen 128k
rm -rf $OUT/r/logs
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/r/runs.jsonl"):
    r = json.loads(line); s = r["spec"]
    print(s["variant"], r["kernel"], "W", s["world_size"], "S", s["seqlen"], "emu", r.get("emulated"), r["status"],
          "tflops", r.get("tflops_per_gpu") and round(r["tflops_per_gpu"], 1), "eff", r.get("efficiency") and round(r["efficiency"], 4),
          "bound", r.get("efficiency_bound") and round(r["efficiency_bound"], 4), "bytes", r.get("bytes_sent"),
          "busy", r.get("per_rank_busy_ms") and [round(x, 2) for x in r["per_rank_busy_ms"]], r.get("reason"))
PY
