# Final GPU call 1 of 2: install, GPU tests, verify at W=1 (every variant with flash-attn-4 and the new cases).
export PYTHONPATH=/tmp/site
python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export RINGBENCH_TEST_VARIANTS=0
V="ringbench verify --device cuda --world-size 1 --yes --out $OUT/v"
F="--kernel flash-attn-4 --dtype bf16 --heads 32 --kv-heads 8 --head-dim 128"
START=$(date +%s)
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > 470 )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'cases?:|passed|failed' $OUT/$name.txt | tail -1)"; }
t gputests 120 python3 -m pytest -q -x -m gpu tests/test_profile.py tests/test_window_gpu.py tests/test_merge_gpu.py
t verify_batch 90 $V $F --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k
t verify_varlen 70 $V $F --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --variant ulysses_varlen --variant usp_varlen --seqlen 8k --docs 1k,3k,2k,2k
t verify_mla 60 $V --kernel flash-attn-4 --variant ring --variant zigzag --variant llama3 --seqlen 4k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
t verify_mla_varlen 50 $V --kernel flash-attn-4 --variant zigzag_varlen --variant llama3_varlen --seqlen 4k --docs 1k,3k --heads 16 --kv-heads 4 --head-dim 192 --head-dim-v 128
t verify_sink 70 $V $F --sink learnable --variant zigzag --variant llama3 --seqlen 8k
t verify_sink_pad 60 $V $F --sink learnable --variant zigzag_varlen --variant llama3_varlen --seqlen 4096 --docs 100,900,3088 --doc-pad 8
t verify_window 90 $V --kernel flash-attn-4 --kernel torch-flash --variant ring --variant zigzag --variant stripe --variant llama3 --window 4k --seqlen 16k
t verify_window_varlen 70 $V --kernel flash-attn-4 --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --window 1k --seqlen 16k --doc-dist lognormal:mean=4k,sigma=1
t verify_balanced 50 $V $F --variant llama3_varlen --layout balanced --seqlen 16k --doc-dist lognormal:mean=4k,sigma=1
rm -rf $OUT/v/logs
