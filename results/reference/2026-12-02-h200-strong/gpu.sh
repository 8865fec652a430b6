# GPU call 2 of a flash-attn-4 pair (2026-12-02, one H200), issue 25: the merge kernels' tiles, where an
# emulated rank's time goes kernel by kernel, and the strong-scaling cases with the ring's emulated copies
# overlapped (side stream) and the best merge tile.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
D=results/reference/2026-12-02-h200-strong
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-540} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|records? appended|BEST' $OUT/$name.txt | tail -1)"; }
t mb 150 python3 $D/merge_bench.py $OUT/merge_bench.jsonl
BEST=$(awk '/^BEST/{print $2}' $OUT/mb.txt); echo "best tile: ${BEST:-none}"; grep "^tile" $OUT/mb.txt | head -4
t mix32 90 python3 $D/kernel_mix.py zigzag 32768 flash-attn-4 8 7
[ -n "$BEST" ] && export RINGBENCH_MERGE_TILE=$BEST
R="ringbench run --device cuda --yes --out /tmp/r --kernel flash-attn-4"
t emu32 240 $R --emulate --profile --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t emu128 120 $R --emulate --profile --variant zigzag --world-size 8 --seqlen 128k
cp /tmp/r/runs.jsonl $OUT/runs.jsonl 2>/dev/null
head -30 $OUT/mix32.txt
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl
