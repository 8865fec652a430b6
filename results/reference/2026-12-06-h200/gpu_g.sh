# 2026-12-06, call 3 (right after gpu_f.sh, same machine): issue 25's strong-scaling cases on the H200
# (emulated zigzag/stripe W=8 16k-128k and W=32 64k, torch-flash W=8 16k, W=1 baselines, cudnn, ulysses,
# usp 2x4 and llama3_varlen with a profile), then verify of every engine at W=1.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-540}
t emu32 90 $R $FA --emulate --profile --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t emu_w32 80 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t emu128 80 $R $FA --emulate --profile --variant zigzag --world-size 8 --seqlen 128k
t tf16 45 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t w1 70 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
t w1_cudnn 40 $R --kernel cudnn --variant zigzag --world-size 1 --seqlen 16k
t emu_uly 60 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant ulysses
t emu_usp 70 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant usp --ulysses-degree 2
t emu_l3v 60 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
