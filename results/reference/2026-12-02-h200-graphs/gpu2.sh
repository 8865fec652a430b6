# GPU call 2 of a second pair (2026-12-02, one H200), issue 25's remaining done-when cases: emulated zigzag
# flash-attn-4 W=8 128k, llama3_varlen and ulysses W=8 64k with a profile, torch-flash zigzag W=8 16k.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-250} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'records? appended' $OUT/$name.txt | tail -1)"; }
R="ringbench run --device cuda --yes --out /tmp/r --emulate --world-size 8"
t tf 60 $R --kernel torch-flash --variant zigzag --seqlen 16k
t z128 120 $R --kernel flash-attn-4 --profile --variant zigzag --seqlen 128k
t uly 60 $R --kernel flash-attn-4 --profile --variant ulysses --seqlen 64k
t l3v 60 $R --kernel flash-attn-4 --profile --variant llama3_varlen --seqlen 64k --docs 32k,16k,8k,8k
cp /tmp/r/runs.jsonl $OUT/runs.jsonl
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl
