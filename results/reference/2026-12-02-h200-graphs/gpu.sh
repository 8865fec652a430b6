# GPU call 2 of a pair (2026-12-02, one H200), issue 25: the replay check of three eager calls per output and
# auto's host-bound rule, measured on the cases that missed (emulated zigzag W=8 32k, stripe W=8 16k and 32k),
# W=1 64k under auto (the early-out), and the GPU tests of graphs, emulation and the HF adapter's graphs.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
python3 -m pip install -q psutil >/dev/null 2>&1 || true
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-540} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|records? appended' $OUT/$name.txt | tail -1)"; }
R="ringbench run --device cuda --yes --out /tmp/r --kernel flash-attn-4"
t emu 200 $R --emulate --profile --variant zigzag --variant stripe --world-size 8 --seqlen 16k --seqlen 32k
t w1 60 $R --world-size 1 --variant zigzag --seqlen 64k
t gputests 200 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_emulation.py tests/test_hf_adapter.py
cp /tmp/r/runs.jsonl $OUT/runs.jsonl
tail -15 $OUT/gputests.txt
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl
