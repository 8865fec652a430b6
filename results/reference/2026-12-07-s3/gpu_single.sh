# 2026-12-07, third session: the one call the device time allowed (no flash-attn-4: its wheels take
# three calls). The flex kernel's GPU tests (its learnable bias now added in float32), then the
# coalesced mask slices A/B with torch-flash (a window-taking kernel, as flash-attn-4): emulated W=8
# 64k under shared-prefix:8k,answers=7, first as before coalescing (no_coalesce/sitecustomize.py),
# then as now, each twice, alternating.
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-420}
A="ringbench run --device cuda --yes --kernel torch-flash --emulate --world-size 8 --seqlen 64k --mask shared-prefix:8k,answers=7 --variant stripe --variant zigzag"
NC="env RINGBENCH_PROBE_NO_COALESCE=1 PYTHONPATH=$PWD/results/reference/2026-12-07-s3/no_coalesce:$PYTHONPATH"
t flex_tests 200 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flex.py
t ab_old1 70 $NC $A --out /tmp/r/old
t ab_new1 70 $A --out /tmp/r/new
t ab_old2 70 $NC $A --out /tmp/r/old
t ab_new2 70 $A --out /tmp/r/new
for d in old new; do [ -f /tmp/r/$d/runs.jsonl ] && cp /tmp/r/$d/runs.jsonl $OUT/ab_$d.jsonl; done
grep -h "ms\b" $L/ab_*.txt | head -40
