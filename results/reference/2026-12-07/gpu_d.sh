# 2026-12-07 (second session), call 4, right after gpu_c.sh on the same machine: the rest of issue 25's cases
# (W=32, W=2, the collective engines at W=8 64k with a profile) and validation (a)'s varlen and usp records.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-540}
t emu_w32 80 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t emu2 70 $R $FA --emulate --variant zigzag --world-size 2 --seqlen 16k --seqlen 128k
t emu_u 70 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant ulysses
t emu_usp 70 $R $FA --emulate --profile --world-size 8 --seqlen 64k --seqlen 16k --variant usp --ulysses-degree 2
t emu_l3v 70 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1
t varlen 90 $R $FA --emulate --world-size 8 --variant ring_varlen --variant zigzag_varlen --variant ulysses_varlen --seqlen 64k --docs 32k,16k,8k,8k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
