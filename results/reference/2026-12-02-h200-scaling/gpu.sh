# GPU call 2 (issue 25, strong scaling; issue 27, USP check): install, GPU tests, verify at W=1, then the
# emulated strong-scaling cases with CUDA graphs on (auto) and off. Call 1 copies .fa4a to /root/fa4.
# Run from the repository root; writes to $OUT. RINGBENCH_GIT_COMMIT names the code that ran.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
python3 -m pip install -q psutil >/dev/null 2>&1 || true
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-540} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|cases?:' $OUT/$name.txt | tail -1)"; }
R="ringbench run --device cuda --yes --out $OUT/r"
V="ringbench verify --device cuda --world-size 1 --yes --out $OUT/v"
FA="--kernel flash-attn-4"
t emu_graph 150 $R --emulate --profile $FA --variant zigzag --world-size 8 --seqlen 16k --seqlen 32k --seqlen 128k
t emu_stripe 40 $R --emulate --profile $FA --variant stripe --world-size 8 --seqlen 32k
t emu_w32 60 $R --emulate --profile $FA --variant zigzag --world-size 32 --seqlen 64k
t emu_tf 40 $R --emulate --profile --kernel torch-flash --variant zigzag --world-size 8 --seqlen 16k
t emu_eager 60 $R --emulate --profile $FA --cuda-graph off --variant zigzag --world-size 8 --seqlen 16k --seqlen 32k
t emu_engines 90 $R --emulate --profile $FA --variant llama3 --variant ulysses --world-size 8 --seqlen 64k
t emu_usp 50 $R --emulate --profile $FA --variant usp --ulysses-degree 2 --world-size 8 --seqlen 64k
t emu_l3v 60 $R --emulate --profile $FA --variant llama3_varlen --world-size 8 --seqlen 64k --docs 8k,24k,16k,16k
t w1 90 $R --world-size 1 $FA --variant zigzag --seqlen 16k --seqlen 128k
t w1_cudnn 40 $R --world-size 1 --kernel cudnn --variant zigzag --seqlen 16k
t gputests 150 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_timing.py tests/test_profile.py tests/test_emulation.py tests/test_merge_gpu.py
t verify 90 $V $FA --dtype bf16 --heads 32 --kv-heads 8 --head-dim 128 --variant llama3 --variant ulysses --variant usp --variant zigzag --seqlen 8k
t verify_mla 60 $V $FA --variant llama3 --variant zigzag --seqlen 4k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
rm -rf $OUT/r/logs $OUT/v/logs
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/r/runs.jsonl > $OUT/summary.txt 2>&1; cat $OUT/summary.txt
