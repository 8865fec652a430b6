# 2026-12-07, third session, the last call (no flash-attn-4): seq_probe.py with torch-flash on the masked
# cases the model prices 11-18% fast (results/reference/2026-12-07-s3/h100/ab_new.jsonl).
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-150}
P=results/reference/2026-12-07-s3/h100/ab_new.jsonl
t probe_stripe 80 python3 results/reference/2026-12-07-s3/seq_probe.py $P stripe shared "" torch-flash
t probe_zigzag 60 python3 results/reference/2026-12-07-s3/seq_probe.py $P zigzag shared "" torch-flash
cat $L/probe_*.txt
