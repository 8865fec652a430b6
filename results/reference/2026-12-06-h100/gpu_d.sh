# 2026-12-06, call 2 of a flash-attn-4 pair (one H200): issue 26's masks on flash-attn-4 (each partial block as
# one window call per slice) at 64k on Llama-3-8B attention, W=1 and emulated W=8 (zigzag, stripe, ring with
# the balanced layout), verify with masks at W=1; then issue 24's schema 2 calibration and the run records
# that validation (a) checks it against. Records: $OUT/runs.jsonl, $OUT/verify.jsonl; texts in $OUT/logs.
source results/reference/2026-12-05-h200/common.sh
STOP_S=${STOP_S:-470}
M="--heads 32 --kv-heads 8 --head-dim 128 --seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
t m_w1 70 $R $FA $M --variant zigzag --world-size 1
t m_emu 100 $R --emulate --profile $FA $M --variant zigzag --variant stripe --world-size 8
t m_bal 60 $R --emulate --profile $FA $M --variant ring --layout balanced --world-size 8
t m_verify 60 ringbench verify --device cuda --world-size 1 --yes --out $OUT $FA --heads 32 --kv-heads 8 --head-dim 128 --seqlen 8k --variant ring --variant zigzag --variant llama3 --variant usp --mask prefix:1k --mask shared-prefix:1k,answers=7 --mask chunked:1k --mask global:64,window:1k
t calibrate 150 ringbench calibrate --device cuda $FA --kernel torch-flash --out $OUT/calibration.json
t w1 60 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
t emu_fa4 150 $R --emulate $FA --variant ring --variant zigzag --variant stripe --world-size 2 --world-size 8 --seqlen 32k --seqlen 64k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
