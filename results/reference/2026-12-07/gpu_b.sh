# 2026-12-07, call 4 (right after gpu_a.sh on the same machine; not run this session): flex_probe.py
# over FlexAttention's Triton and FlashAttention-4 backends (flash-attn-4 installed here),
# issue 26's prefix and shared-prefix masks at 64k (W=8 with the balanced layout, and W=1), verify at
# W=1 for every engine.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-520}
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t m_bal 100 $R $FA --emulate $M --variant ring --layout balanced --world-size 8
t m_w1 50 $R $FA $M --variant zigzag --world-size 1
t verify 80 $V $FA --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k
t flex_probe 100 python3 results/reference/2026-12-07/flex_probe.py 8192
cp $L/flex_probe.txt $OUT/flex_probe.txt
