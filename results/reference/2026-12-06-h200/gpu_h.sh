# 2026-12-06, call 4 (after gpu_g.sh, same machine): issue 26's masks at 64k on Llama-3-8B attention
# (flash-attn-4 by slices, W=1 and emulated W=8: zigzag, stripe, ring with the balanced layout), verify of
# every engine at W=1 with and without masks, then the GPU tests.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-540}
M="--heads 32 --kv-heads 8 --head-dim 128 --seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
t m_w1 70 $R $FA $M --variant zigzag --world-size 1
t m_emu 110 $R --emulate --profile $FA $M --variant zigzag --variant stripe --world-size 8
t m_bal 70 $R --emulate --profile $FA $M --variant ring --layout balanced --world-size 8
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r $FA --heads 32 --kv-heads 8 --head-dim 128"
t verify 80 $V --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k
t verify_varlen 60 $V --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --variant ulysses_varlen --docs 3k,1k,4k --seqlen 8k
t verify_masks 60 $V --seqlen 4k --variant zigzag --variant llama3 --variant usp --mask prefix:512 --mask shared-prefix:512,answers=7 --mask chunked:512
t gputests 120 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_merge_gpu.py tests/test_graphs.py tests/test_timing.py tests/test_profile.py tests/test_emulation.py
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -20
