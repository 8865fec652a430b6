# GPU call 2 of a flash-attn-4 pair (2026-12-05, one H200): the GPU tests of the merge after the adds'
# launch change, the strong-scaling cases of issue 25's done-when list, then, as a separate run, the
# schema 2 calibration (issue 24), which validation (a) checks against those records.
# Console texts go in $OUT/logs.tar.gz; records in $OUT/runs.jsonl; the calibration in $OUT/calibration.json.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
L=/tmp/logs; mkdir -p $L
START=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-480} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $L/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|records? appended|written|BEST' $L/$name.txt | tail -1)"; }
t gputests 90 python3 -m pytest -q -m gpu tests/test_merge_gpu.py -x
t calibrate 150 ringbench calibrate --device cuda --kernel flash-attn-4 --out $OUT/calibration.json
R="ringbench run --device cuda --yes --out /tmp/r --emulate"
F="$R --kernel flash-attn-4"
t emu32 100 $F --profile --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t emu128 80 $F --profile --variant zigzag --world-size 8 --seqlen 128k
t emu16 45 $F --variant zigzag --world-size 8 --seqlen 16k
t emu16tf 45 $R --kernel torch-flash --variant zigzag --world-size 8 --seqlen 16k
cp /tmp/r/runs.jsonl $OUT/runs.jsonl 2>/dev/null
tar czf $OUT/logs.tar.gz -C $L .
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
