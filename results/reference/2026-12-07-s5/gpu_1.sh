# 2026-12-07, fifth session, call 1 (.fa4a carried; no flash-attn-4 yet): the first wheel part put in
# place, then what needs no flash-attn-4: issue 25's torch-flash zigzag at W=8 16k and cudnn at W=1 16k.
mkdir -p /root/fa4 && cp .fa4a/* /root/fa4/
NO_FA4=1 source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-100}
t tf16 60 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t w1_cudnn 40 $R --kernel cudnn --variant zigzag --world-size 1 --seqlen 16k
grep -hE "^(zigzag) " $L/*.txt
