# Lease 2 of 2026-12-05, call 2 (after the flash-attn-4 wheels): the schema 2 calibration of flash-attn-4 and
# torch-flash, then run records on the same machine for validation (a) (issue 24): world size 1 and emulated
# W = 2, 4, 8. Records: $OUT/runs.jsonl; calibration: $OUT/calibration.json.
source results/reference/2026-12-05-h200/common.sh
t calibrate 170 ringbench calibrate --device cuda $FA --kernel torch-flash --out $OUT/calibration.json
t w1 100 $R $FA --variant zigzag --world-size 1 --seqlen 16k --seqlen 128k
t emu_fa4 260 $R --emulate $FA --variant ring --variant zigzag --variant stripe --world-size 2 --world-size 4 --world-size 8 --seqlen 32k --seqlen 64k
t emu_tf 120 $R --emulate --kernel torch-flash --variant zigzag --variant stripe --world-size 2 --world-size 8 --seqlen 16k --seqlen 64k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -40
