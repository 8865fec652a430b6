# 2026-12-07, fourth session, A/B call 3 (.fa4b carried; call 2 put .fa4c in place): flash-attn-4
# installed, then the fused window folds against the unfused ones with flash-attn-4, emulated W=8
# 64k under both masks (old, new, old, new), the balanced ring, and verify at W=1 under masks with
# the fused folds. Every wheel goes in in one pip call: pip --target --upgrade of the joined wheel
# alone replaced the cutlass package folder the others had filled (no cutlass.cute).
cp .fa4b/big.part.* /root/fa4/ && cat /root/fa4/big.part.* > /root/fa4/$(cat /root/fa4/big.name) && rm /root/fa4/big.part.*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4b/*.whl /root/fa4/*.whl
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/site/sitecustomize.py
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-430}
U=results/reference/2026-12-07-s4/unfused
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
A="ringbench run --device cuda --yes $FA --emulate --world-size 8 $M --variant stripe --variant zigzag"
OLD="env RINGBENCH_PROBE_UNFUSED=1 PYTHONPATH=$PWD/$U:$PYTHONPATH"
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t verify_masks 80 $V $FA --variant zigzag --variant stripe --variant llama3 --seqlen 4k --mask shared-prefix:512,answers=7 --mask prefix:512
t fa_old1 90 $OLD $A --out /tmp/r/fa_old
t fa_new1 90 $A --out /tmp/r/fa_new
t fa_old2 90 $OLD $A --out /tmp/r/fa_old
t fa_new2 90 $A --out /tmp/r/fa_new
t m_bal 80 ringbench run --device cuda --yes $FA --emulate $M --variant ring --layout balanced --world-size 8 --out /tmp/r/fa_new
for d in fa_old fa_new; do [ -f /tmp/r/$d/runs.jsonl ] && cp /tmp/r/$d/runs.jsonl $OUT/ab_$d.jsonl; done
grep -c "folded unfused" $L/fa_old1.txt
grep -hE "^(stripe|zigzag|ring) " $L/fa_*.txt $L/m_bal.txt
