# 2026-12-07, fourth session, call 1 (.fa4a carried; no flash-attn-4 yet): the first wheel part put in
# place, then what needs no flash-attn-4: torch-flash emulated zigzag W=8 16k, cudnn at world size 1,
# and seq_probe.py with torch-flash on the masked cases the model prices 11-18% fast.
mkdir -p /root/fa4 && cp .fa4a/* /root/fa4/
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-240}
P=results/reference/2026-12-07-s3/h100/ab_new.jsonl
t tf16 60 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t cudnn1 50 $R --kernel cudnn --variant zigzag --world-size 1 --seqlen 16k
t probe_stripe 80 python3 results/reference/2026-12-07-s3/seq_probe.py $P stripe shared "" torch-flash
t probe_zigzag 60 python3 results/reference/2026-12-07-s3/seq_probe.py $P zigzag shared "" torch-flash
cat $L/probe_*.txt > $OUT/probe_tf.txt 2>/dev/null; cat $OUT/probe_tf.txt
