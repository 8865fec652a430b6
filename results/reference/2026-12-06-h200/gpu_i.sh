# 2026-12-06, call 3 (right after gpu_f.sh, same machine; what the remaining device time allowed of
# gpu_g.sh and gpu_h.sh): issue 25's strong-scaling cases, issue 26's masks at 64k, verify at W=1.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-500}
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
t emu32 90 $R $FA --emulate --profile --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t m_emu 110 $R --emulate $FA $M --variant zigzag --variant stripe --world-size 8
t emu_w32 80 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t emu128 75 $R $FA --emulate --variant zigzag --world-size 8 --seqlen 128k
t tf16 45 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t m_w1 60 $R $FA $M --variant zigzag --world-size 1
t verify 80 ringbench verify --device cuda --world-size 1 --yes --out /tmp/r $FA --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k --mask causal --mask prefix:1k
