# 2026-12-06, call 3 (right after gpu_d.sh, same machine): issue 25's remaining cases (llama3_varlen, ulysses and
# usp emulated at W=8 64k with a profile, zigzag at W=32 64k, cudnn at W=1), verify at W=1 on every engine, the GPU tests.
source results/reference/2026-12-05-h200/common.sh
STOP_S=${STOP_S:-540}
t emu_usp 70 $R --emulate --profile $FA --variant usp --ulysses-degree 2 --world-size 8 --seqlen 64k
t emu_uly 60 $R --emulate --profile $FA --variant ulysses --world-size 8 --seqlen 64k
t emu_l3v 60 $R --emulate --profile $FA --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1 --world-size 8 --seqlen 64k
t emu_w32 70 $R --emulate $FA --variant zigzag --world-size 32 --seqlen 64k
t w1_cudnn 40 $R --world-size 1 --kernel cudnn --variant zigzag --seqlen 16k
t verify 80 ringbench verify --device cuda --world-size 1 --yes --out $OUT $FA --heads 32 --kv-heads 8 --head-dim 128 --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k
t verify_varlen 60 ringbench verify --device cuda --world-size 1 --yes --out $OUT $FA --heads 32 --kv-heads 8 --head-dim 128 --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --variant ulysses_varlen --docs 3k,1k,4k --seqlen 8k
t gputests 120 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_merge_gpu.py tests/test_graphs.py tests/test_timing.py tests/test_profile.py
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -20
