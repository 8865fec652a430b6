# 2026-12-07, fourth session, call 3 (.fa4b carried: flash-attn-4 installed here): issue 25's
# strong-scaling cases with every reference replayed: emulated W=8 (zigzag, stripe at 16k and 32k),
# world size 1 baselines, W=8 128k, W=32 64k, W=2.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-500}
t emu8 140 $R $FA --emulate --variant zigzag --variant stripe --world-size 8 --seqlen 16k --seqlen 32k
t w1 100 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
t emu128 100 $R $FA --emulate --variant zigzag --world-size 8 --seqlen 128k
t emu_w32 70 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t emu2 60 $R $FA --emulate --variant zigzag --world-size 2 --seqlen 16k --seqlen 128k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
