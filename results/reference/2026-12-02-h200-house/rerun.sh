# GPU call 4: the GPU tests with the time they need, and the MLA cases (call 2 timed the tests out at
# 150 s with no failure printed, and its MLA line mixed --docs with batch variants, which verify refuses).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
V="ringbench verify --device cuda --world-size 1 --yes --out $OUT/v"
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'cases?[: ]|passed|failed' $OUT/$name.txt | tail -1)"; }
t verify_mla 60 $V --kernel flash-attn-4 --variant ring --variant zigzag --variant llama3 --seqlen 4k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
t verify_mla_varlen 50 $V --kernel flash-attn-4 --variant zigzag_varlen --variant llama3_varlen --seqlen 4k --docs 1k,3k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
t gputests 330 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -x -m gpu --durations=15 tests/test_kernels_gpu.py tests/test_profile.py tests/test_window_gpu.py tests/test_merge_gpu.py
rm -rf $OUT/v/logs
