# 2026-12-07, sixth session, call 3 (.fa4b carried; calls 1 and 2 put the other wheel parts in place):
# flash-attn-4 installed (every wheel in one pip call); fa4-alibi.patch applied (flash-attn-4's ALiBi score mod,
# kept off main until its GPU test passes; K/V expanded to the query heads for the Hopper backward under GQA) against the math kernel in float64, and verify --bias alibi at W=1 with and without a
# mask; then issue 25's strong-scaling targets (emulated W=8 at 16k, 32k, 128k; W=32 at 64k; W=1).
cp .fa4b/big.part.* /root/fa4/ && cat /root/fa4/big.part.* > /root/fa4/$(cat /root/fa4/big.name) && rm /root/fa4/big.part.*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4b/*.whl /root/fa4/*.whl
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/site/sitecustomize.py
git apply results/reference/2026-12-07-s6/fa4-alibi.patch 2>/dev/null || patch -p1 < results/reference/2026-12-07-s6/fa4-alibi.patch || exit 5
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-500}
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t alibi_test 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_bias.py -k flash_attn_4
t alibi_verify 120 $V $FA --bias alibi --seqlen 4k --variant zigzag --variant stripe --variant llama3 --variant ulysses --mask causal --mask prefix:512
t emu32 90 $R $FA --emulate --profile --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t emu16 50 $R $FA --emulate --profile --variant zigzag --world-size 8 --seqlen 16k
t tf16 50 $R --kernel torch-flash --emulate --profile --variant zigzag --world-size 8 --seqlen 16k
t emu128 60 $R $FA --emulate --variant zigzag --world-size 8 --seqlen 128k
t emu_w32 60 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t w1 60 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
grep -hE "^(zigzag|stripe|ring|ulysses) " $L/*.txt | head -40
