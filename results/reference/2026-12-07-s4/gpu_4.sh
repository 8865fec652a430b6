# 2026-12-07, fourth session, call 4 (flash-attn-4 installed by call 3): issue 26's masks with the
# joined slices at W=8 64k (balanced ring, zigzag, stripe), verify at W=1 under masks, seq_probe.py.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-480}
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
P=results/reference/2026-12-07/h100/runs.jsonl
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t m_bal 100 $R $FA --emulate $M --variant ring --layout balanced --world-size 8
t m_emu 110 $R $FA --emulate $M --variant zigzag --variant stripe --world-size 8
t verify_masks 80 $V $FA --variant zigzag --variant stripe --variant llama3 --seqlen 4k --mask shared-prefix:512,answers=7 --mask prefix:512
t m_w1 60 $R $FA $M --variant zigzag --world-size 1
t probe_stripe 100 python3 results/reference/2026-12-07-s3/seq_probe.py $P stripe shared
cat $L/probe_*.txt > $OUT/probe.txt 2>/dev/null; cat $OUT/probe.txt | tail -30
