set -x
bash .fa4b/install-fa4.sh || exit 3
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv
timeout 240 python3 .fa4b/probe.py > $OUT/probe.txt 2>&1; tail -30 $OUT/probe.txt
R="--device cuda --world-size 1 --yes"
timeout 150 ringbench verify $R --kernel flash-attn-4 --variant ring --variant zigzag --variant stripe --variant llama3 --seqlen 8k --out $OUT/v > $OUT/verify_batch.txt 2>&1; tail -5 $OUT/verify_batch.txt
timeout 100 ringbench verify $R --kernel flash-attn-4 --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --seqlen 8k --docs 1k,3k,2k,2k --out $OUT/v > $OUT/verify_varlen.txt 2>&1; tail -5 $OUT/verify_varlen.txt
