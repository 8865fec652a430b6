# One call, no flash-attn-4 (its wheels need two calls, and machines came back between them today): the schema 2
# calibration of torch-flash and cudnn, then on the same machine the records for validation (a) (issue 24), issue 25's
# other engines emulated at W=8 64k with a profile, verify at W=1, and the GPU tests. Records: $OUT/runs.jsonl.
NO_FA4=1 source results/reference/2026-12-05-h200/common.sh
STOP_S=${STOP_S:-420}
TF="--kernel torch-flash"
t calibrate 150 ringbench calibrate --device cuda $TF --kernel cudnn --out $OUT/calibration.json
t w1 60 $R $TF --kernel cudnn --variant zigzag --world-size 1 --seqlen 16k --seqlen 64k
t emu_tf 150 $R --emulate $TF --variant ring --variant zigzag --variant stripe --world-size 2 --world-size 4 --world-size 8 --seqlen 32k --seqlen 64k
t emu_usp 50 $R --emulate --profile $TF --variant usp --ulysses-degree 2 --world-size 8 --seqlen 64k
t emu_uly 40 $R --emulate --profile $TF --variant ulysses --world-size 8 --seqlen 64k
t emu_l3v 40 $R --emulate --profile $TF --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1 --world-size 8 --seqlen 64k
t verify 60 ringbench verify --device cuda --world-size 1 --yes --out $OUT $TF --heads 32 --kv-heads 8 --head-dim 128 --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k
t gputests 120 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_merge_gpu.py tests/test_graphs.py
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -40
