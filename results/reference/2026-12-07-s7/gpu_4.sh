# 2026-12-07, seventh session, call 4 (.fa4b carried in case the machine was given back): issue 26's masks
# at 64k on emulated W=8 (balanced ring, zigzag, stripe) and ALiBi there; issue 25's emulated all-gather,
# all-to-all and USP engines with a profile; the validation (a) rows left stale on the H200.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-520}
t probe 200 python3 results/reference/2026-12-07-s7/shifted_probe.py $OUT/probe.jsonl
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
t m_bal 150 $R --emulate $FA $M --variant ring --layout balanced --world-size 8
t m_emu 150 $R --emulate $FA $M --variant zigzag --variant stripe --world-size 8
t alibi_emu 60 $R $FA --emulate --bias alibi --variant zigzag --variant stripe --world-size 8 --seqlen 32k
t emu_uly 50 $R $FA --emulate --profile --world-size 8 --seqlen 64k --seqlen 16k --variant ulysses
t emu_usp 50 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant usp --ulysses-degree 2
t emu_l3v 50 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1
grep -hE "^(zigzag|stripe|ring|ulysses|usp|llama3_varlen) " $L/*.txt | head -40
