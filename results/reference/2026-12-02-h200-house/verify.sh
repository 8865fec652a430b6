# GPU call 2 of 3 (after the restructure of issue 23): install, the GPU tests, verify at W=1 with flash-attn-4.
# Call 1 copies .fa4a to /root/fa4 (shared/gpu/fa4-wheels.sh). Run from the repository root; writes to $OUT.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
python3 -m pip install -q psutil >/dev/null 2>&1 || python3 -c "import psutil" || echo "psutil missing"
V="ringbench verify --device cuda --world-size 1 --yes --out $OUT/v"
F="--kernel flash-attn-4 --dtype bf16 --heads 32 --kv-heads 8 --head-dim 128"
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > 500 )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'cases?[: ]|passed|failed' $OUT/$name.txt | tail -1)"; }
t gputests ${GPUTESTS_S:-150} env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_profile.py tests/test_window_gpu.py tests/test_merge_gpu.py
t verify_batch 90 $V $F --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k
t verify_varlen 70 $V $F --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --variant ulysses_varlen --variant usp_varlen --seqlen 8k --docs 1k,3k,2k,2k
t verify_mla 60 $V --kernel flash-attn-4 --variant ring --variant zigzag --variant llama3 --seqlen 4k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
t verify_mla_varlen 50 $V --kernel flash-attn-4 --variant zigzag_varlen --variant llama3_varlen --seqlen 4k --docs 1k,3k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
t verify_sink 60 $V $F --sink learnable --variant zigzag --variant llama3 --seqlen 8k
t verify_window 80 $V --kernel flash-attn-4 --kernel torch-flash --variant ring --variant zigzag --variant stripe --variant llama3 --window 4k --seqlen 16k
rm -rf $OUT/v/logs
