# 2026-12-07, fifth session, call 1 (.fa4a carried; no flash-attn-4 yet): the first wheel part put in
# place. (Its torch-flash and cudnn runs were dropped: four failed starts left too little device time.)
mkdir -p /root/fa4 && cp .fa4a/* /root/fa4/ && ls /root/fa4
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
