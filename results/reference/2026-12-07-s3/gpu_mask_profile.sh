# 2026-12-07, third session (flash-attn-4 installed by .fa4b): why the model prices the emulated masked
# rows at W=8 64k 8-20% fast. The same cases as the committed records, with --profile (every step's
# kernel, merge and host-gap spans) and then replayed and eager without it.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-540}
M="--seqlen 64k --mask shared-prefix:8k,answers=7 --mask prefix:8k"
t mp_zz 120 $R $FA --emulate --profile --world-size 8 $M --variant zigzag --variant stripe
t mp_bal 80 $R $FA --emulate --profile --world-size 8 $M --variant ring --layout balanced
t mg_on 90 $R $FA --emulate --cuda-graph on --world-size 8 $M --variant zigzag --variant stripe
t mg_off 90 $R $FA --emulate --cuda-graph off --world-size 8 $M --variant zigzag --variant stripe
t mw1 60 $R $FA --profile --world-size 1 --seqlen 64k --mask shared-prefix:8k,answers=7 --variant zigzag
