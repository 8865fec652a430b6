# 2026-12-06, second session, call 3 (after the two wheel calls): the cases of issues 25 and 26 again,
# now that a reference's replay is checked with a nondeterministic backward's allowance (graphs.compare),
# so references replay beside a replayed ring; the ring's merges beside the next kernel
# (variants/engines/overlap.py) against in line (RINGBENCH_SIDE_MERGE=0, records in inline_runs.jsonl);
# issue 26's masks with the balanced layout at W=8 64k.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-520}
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
t side_test 60 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_emulation.py -k "side_stream or fp64_attention"
t emu16_32 100 $R $FA --emulate --profile --variant zigzag --world-size 8 --seqlen 16k --seqlen 32k
t inline 100 env RINGBENCH_SIDE_MERGE=0 ringbench run --device cuda --yes --out /tmp/inline $FA --emulate --variant zigzag --variant stripe --world-size 8 --seqlen 16k --seqlen 32k
cp /tmp/inline/runs.jsonl $OUT/inline_runs.jsonl
t stripe32 45 $R $FA --emulate --variant stripe --world-size 8 --seqlen 32k
t m_bal 90 $R $FA --emulate $M --variant ring --layout balanced --world-size 8
t emu_w32 80 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t tf16 45 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t emu_l3v 60 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1
t w1 70 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/inline_runs.jsonl 2>&1 | tail -8
