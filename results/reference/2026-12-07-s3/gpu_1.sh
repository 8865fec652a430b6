# 2026-12-07, third session, call 1 (.fa4a carried; no flash-attn-4 yet): the first wheel part put in
# place, then the flex kernel's GPU tests (the learnable bias now added in float32, no cast to the
# score's dtype) and verify with flex and a learnable 1hss bias under the causal mask, bf16.
mkdir -p /root/fa4 && cp .fa4a/* /root/fa4/
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-420}
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t flex_tests 240 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flex.py
t flex_verify 150 $V --kernel flex --variant zigzag --variant ring --seqlen 4k --bias 1hss
