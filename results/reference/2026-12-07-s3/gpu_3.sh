# 2026-12-07, third session, call 3 (.fa4b carried: flash-attn-4 installed here). Masks with the
# coalesced slices (a shared prompt's answers see the prompt through one window call per step):
# seq_probe.py (the model's price of a rank's calls against the same calls replayed alone and back
# to back), the masked cases of results/reference/2026-12-07/h100/ again, verify at W=1 under masks;
# on an H200 also issue 25's W=8 32k cases.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-540}
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
P=results/reference/2026-12-07/h100/runs.jsonl
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t m_emu 110 $R $FA --emulate $M --variant zigzag --variant stripe --world-size 8
t m_bal 100 $R $FA --emulate $M --variant ring --layout balanced --world-size 8
t verify_masks 80 $V $FA --variant zigzag --variant stripe --variant llama3 --seqlen 4k --mask shared-prefix:512,answers=7 --mask prefix:512
t probe_stripe 120 python3 results/reference/2026-12-07-s3/seq_probe.py $P stripe shared
t m_w1 60 $R $FA $M --variant zigzag --world-size 1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  t emu32 90 $R $FA --emulate --variant zigzag --variant stripe --world-size 8 --seqlen 32k
fi
t probe_ring 60 python3 results/reference/2026-12-07-s3/seq_probe.py $P ring shared balanced
cat $L/probe_*.txt > $OUT/probe.txt 2>/dev/null
