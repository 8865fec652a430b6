# 2026-12-07, sixth session, call 1 (.fa4a carried): the first wheel part put in place.
mkdir -p /root/fa4 && cp .fa4a/* /root/fa4/ && ls /root/fa4
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
