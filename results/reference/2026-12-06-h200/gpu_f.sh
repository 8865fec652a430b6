# 2026-12-06, call 2 of a flash-attn-4 pair (one H200): issue 24's schema 2 calibration (flash-attn-4 and
# torch-flash), then, as separate runs on the same machine, the records that validation (a) predicts:
# W=1 and emulated W=2 and 8 of every ringbench engine that runs on one GPU.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-530}
t calibrate 220 ringbench calibrate --device cuda $FA --kernel torch-flash --out $OUT/calibration.json
E="--variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses"
t val_w1 70 $R $FA --world-size 1 $E --seqlen 16k --seqlen 64k
t val_emu 170 $R $FA --emulate --world-size 2 --world-size 8 $E --seqlen 16k --seqlen 64k
t val_usp 50 $R $FA --emulate --world-size 8 --variant usp --ulysses-degree 2 --seqlen 16k --seqlen 64k
t val_varlen 70 $R $FA --emulate --world-size 2 --world-size 8 --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --variant ulysses_varlen --seqlen 64k --docs 32k,16k,8k,8k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -45
