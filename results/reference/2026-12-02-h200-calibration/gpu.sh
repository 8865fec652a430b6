# GPU call 2 of a pair (2026-12-02, one H200): the measured calibration (issue 24), then, in a separate
# run, the records that validation (a) predicts: W=1 and emulated W=2 and 8 of every ringbench engine.
# Writes $OUT/h200.json, $OUT/runs.jsonl and the console texts.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
python3 -m pip install -q psutil >/dev/null 2>&1 || true
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-540} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|records? appended|wrote' $OUT/$name.txt | tail -1)"; }
t calibrate 300 ringbench calibrate --device cuda --kernel flash-attn-4 --kernel torch-flash --out $OUT/h200.json
R="ringbench run --device cuda --yes --out /tmp/val --kernel flash-attn-4"
E="--variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses"
t val_w1 60 $R --world-size 1 $E --seqlen 16k --seqlen 64k
t val_emu 150 $R --emulate --world-size 2 --world-size 8 $E --seqlen 16k --seqlen 64k
t val_usp 60 $R --emulate --world-size 8 --variant usp --ulysses-degree 2 --seqlen 16k --seqlen 64k
t val_varlen 60 $R --emulate --world-size 2 --world-size 8 --variant ring_varlen --variant llama3_varlen --variant ulysses_varlen --seqlen 64k --docs 32k,16k,8k,8k
cp /tmp/val/runs.jsonl $OUT/runs.jsonl
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -60
