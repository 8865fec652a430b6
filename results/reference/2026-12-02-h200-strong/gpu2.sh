# GPU call 2 of a second flash-attn-4 pair (2026-12-02, one H200), issue 25: the merge bench and kernel mix
# again after the adds' launch change, then every strong-scaling case of the issue's done-when list with
# the ring's emulated copies overlapped and the default merge tile.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
D=results/reference/2026-12-02-h200-strong
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-540} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|records? appended|BEST' $OUT/$name.txt | tail -1)"; }
t mb2 150 python3 $D/merge_bench.py $OUT/merge_bench2.jsonl
grep "^tile" $OUT/mb2.txt | head -3
t mix32b 90 python3 $D/kernel_mix.py zigzag 32768 flash-attn-4 8 7
R="ringbench run --device cuda --yes --out /tmp/r --emulate"
F="$R --kernel flash-attn-4"
t emu32 150 $F --profile --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t emu128 120 $F --profile --variant zigzag --world-size 8 --seqlen 128k
t emu16 90 $F --variant zigzag --world-size 8 --seqlen 16k
t emu16tf 90 $R --kernel torch-flash --variant zigzag --world-size 8 --seqlen 16k
t emu_w32 120 $F --variant zigzag --world-size 32 --seqlen 64k
t emu_uly 90 $F --profile --world-size 8 --seqlen 64k --variant ulysses
t emu_vl 120 $F --profile --world-size 8 --seqlen 64k --variant llama3_varlen --docs 8k,24k,16k,16k
t emu_usp 90 $F --profile --world-size 8 --seqlen 64k --variant usp --ulysses-degree 2
cp /tmp/r/runs.jsonl $OUT/runs.jsonl 2>/dev/null
head -16 $OUT/mix32b.txt | cut -c1-80,150-200
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl
