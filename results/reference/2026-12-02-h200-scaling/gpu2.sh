# GPU call 2 of the second pair (2026-12-02): after the reference is replayed with the loop. The emulated
# strong-scaling cases, W=1 cudnn, the GPU tests and verify at W=1. Writes $OUT/runs.jsonl and the texts.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
python3 -m pip install -q psutil >/dev/null 2>&1 || true
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-500} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|cases?:' $OUT/$name.txt | tail -1)"; }
R="ringbench run --device cuda --yes --out /tmp/r"
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/v"
FA="--kernel flash-attn-4"
t emu_16k_32k 150 $R --emulate --profile $FA --variant zigzag --world-size 8 --seqlen 16k --seqlen 32k
t emu_stripe 60 $R --emulate $FA --variant stripe --world-size 8 --seqlen 32k
t emu_tf 40 $R --emulate --kernel torch-flash --variant zigzag --world-size 8 --seqlen 16k
t emu_w32 90 $R --emulate $FA --variant zigzag --world-size 32 --seqlen 64k
t emu_usp 80 $R --emulate --profile $FA --variant usp --ulysses-degree 2 --world-size 8 --seqlen 64k
t gputests 120 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_timing.py tests/test_profile.py
t verify 80 $V $FA --dtype bf16 --heads 32 --kv-heads 8 --head-dim 128 --variant llama3 --variant ulysses --variant usp --variant zigzag --seqlen 8k
t verify_mla 50 $V $FA --variant llama3 --seqlen 4k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
t w1_cudnn 40 $R --world-size 1 --kernel cudnn --variant zigzag --seqlen 16k
cp /tmp/r/runs.jsonl $OUT/runs.jsonl; cp /tmp/v/verify.jsonl $OUT/verify.jsonl 2>/dev/null
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl
