# 2026-12-07, call 3 (after the wheel calls; not run this session, no H200 started): issue 25's strong-scaling cases on the card
# with the side-stream merges and every reference replayed: world size 1 baselines, emulated W=8
# (zigzag 16k/32k/128k, stripe 32k, torch-flash 16k), W=32 64k, W=2, and the other engines at W=8 64k
# with a profile.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-500}
t emu8 130 $R $FA --emulate --variant zigzag --variant stripe --world-size 8 --seqlen 16k --seqlen 32k
t w1 100 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
t cudnn1 45 $R --kernel cudnn --variant zigzag --world-size 1 --seqlen 16k
t emu128 100 $R $FA --emulate --variant zigzag --world-size 8 --seqlen 128k
t emu_w32 70 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t tf16 40 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t emu_u 80 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant ulysses
t emu_usp 80 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant usp --ulysses-degree 2
t emu_l3v 60 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1
t emu2 60 $R $FA --emulate --variant zigzag --world-size 2 --seqlen 16k --seqlen 128k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
