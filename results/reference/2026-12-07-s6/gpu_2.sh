# 2026-12-07, sixth session, call 2 (.fa4c carried): the second wheel part put in place.
mkdir -p /root/fa4 && cp .fa4c/* /root/fa4/ && ls /root/fa4
nvidia-smi --query-gpu=name --format=csv,noheader
