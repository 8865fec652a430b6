# 2026-12-07, fourth session, A/B call 1 (.fa4a carried): the first wheel part put in place, then
# the fused window folds (window.attend: one merge_step launch a part; attend_backward: one add_steps
# launch a part) against the unfused ones (unfused/sitecustomize.py), torch-flash, emulated W=8 64k
# under shared-prefix:8k,answers=7, alternating old, new, old, new.
mkdir -p /root/fa4 && cp .fa4a/* /root/fa4/
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-240}
U=results/reference/2026-12-07-s4/unfused
A="ringbench run --device cuda --yes --kernel torch-flash --emulate --world-size 8 --seqlen 64k --mask shared-prefix:8k,answers=7 --variant stripe --variant zigzag"
OLD="env RINGBENCH_PROBE_UNFUSED=1 PYTHONPATH=$PWD/$U:$PYTHONPATH"
t tf_old1 70 $OLD $A --out /tmp/r/tf_old
t tf_new1 70 $A --out /tmp/r/tf_new
t tf_old2 70 $OLD $A --out /tmp/r/tf_old
t tf_new2 70 $A --out /tmp/r/tf_new
for d in tf_old tf_new; do [ -f /tmp/r/$d/runs.jsonl ] && cp /tmp/r/$d/runs.jsonl $OUT/ab_$d.jsonl; done
grep -c "folded unfused" $L/tf_old1.txt
grep -hE "^(stripe|zigzag) " $L/tf_*.txt
