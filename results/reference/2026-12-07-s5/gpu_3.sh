# 2026-12-07, fifth session, call 3 (.fa4b carried; calls 1 and 2 put the other wheel parts in place):
# flash-attn-4 installed (every wheel in one pip call), then flash-attn-4's ALiBi score mod against the
# math kernel in float64 and verify under --bias alibi at W=1; issue 25's strong-scaling cases and issue
# 26's masks at 64k (the H200 targets); the validation (a) rows left stale (ulysses W=8 16k).
cp .fa4b/big.part.* /root/fa4/ && cat /root/fa4/big.part.* > /root/fa4/$(cat /root/fa4/big.name) && rm /root/fa4/big.part.*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4b/*.whl /root/fa4/*.whl
printf 'import site\nsite.addsitedir("/tmp/site")\n' > /tmp/site/sitecustomize.py
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-430}
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t alibi_test 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_bias.py -k flash_attn_4
t alibi_verify 90 $V $FA --bias alibi --seqlen 4k --variant zigzag --variant stripe --variant llama3 --variant ulysses --mask causal --mask prefix:512
t m_bal 60 $R --emulate $FA $M --variant ring --layout balanced --world-size 8
t m_emu 100 $R --emulate $FA $M --variant zigzag --variant stripe --world-size 8
t emu32 60 $R $FA --emulate --profile --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t emu16 40 $R $FA --emulate --profile --variant zigzag --world-size 8 --seqlen 16k
t m_w1 60 $R $FA $M --variant zigzag --world-size 1
t emu128 60 $R $FA --emulate --variant zigzag --world-size 8 --seqlen 128k
t uly16 40 $R $FA --emulate --variant ulysses --world-size 8 --seqlen 16k
t emu_w32 60 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
t w1 60 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
t alibi_emu 60 $R $FA --emulate --bias alibi --variant zigzag --variant stripe --world-size 8 --seqlen 32k
grep -hE "^(zigzag|stripe|ring|ulysses) " $L/*.txt | head -40
