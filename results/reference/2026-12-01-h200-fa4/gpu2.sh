set -x
export PYTHONPATH=/tmp/site
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 .fa4b/probe.py 2>&1 | grep -v -i "warn\|exe_args" > $OUT/probe.txt; cat $OUT/probe.txt
R="--device cuda --world-size 1 --yes"
timeout 120 ringbench verify $R --kernel flash-attn-4 --variant ring --variant zigzag --variant llama3 --seqlen 4k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128 --out $OUT/v > $OUT/verify_mla.txt 2>&1; tail -4 $OUT/verify_mla.txt
timeout 80 ringbench verify $R --kernel flash-attn-4 --variant zigzag_varlen --variant llama3_varlen --seqlen 4k --docs 1k,3k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128 --out $OUT/v > $OUT/verify_mla_varlen.txt 2>&1; tail -4 $OUT/verify_mla_varlen.txt
for k in flash-attn-4 torch-flash cudnn; do timeout 150 ringbench run $R --variant zigzag --kernel $k --seqlen 16k --seqlen 128k --out $OUT/r --json > $OUT/run_zigzag_$k.json 2>$OUT/run_zigzag_$k.err; tail -3 $OUT/run_zigzag_$k.err; done
for k in flash-attn-4 torch-flash; do timeout 90 ringbench run $R --variant llama3_varlen --kernel $k --seqlen 64k --doc-dist lognormal:mean=4k,sigma=1 --out $OUT/r --json > $OUT/run_l3v_$k.json 2>$OUT/run_l3v_$k.err; tail -3 $OUT/run_l3v_$k.err; done
python3 - <<'PY'
import json,glob,os
for line in open(os.environ["OUT"]+"/r/runs.jsonl") if os.path.exists(os.environ["OUT"]+"/r/runs.jsonl") else []:
    r=json.loads(line); print(r["spec"]["variant"], r["kernel"], r.get("kernel_version"), r["spec"]["seqlen"], r["status"], r.get("tflops"), r.get("efficiency"), r.get("notes"))
PY
ls $OUT/r
