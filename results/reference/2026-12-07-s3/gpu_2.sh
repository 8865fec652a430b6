# 2026-12-07, third session, call 2 (.fa4c carried): the second wheel part put in place, and the cases
# that need no flash-attn-4: emulated zigzag W=8 16k with torch-flash, cudnn at world size 1.
mkdir -p /root/fa4 && cp .fa4c/* /root/fa4/
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-150}
t tf16 60 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t cudnn1 50 $R --kernel cudnn --variant zigzag --world-size 1 --seqlen 16k
