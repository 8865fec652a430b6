# 2026-12-07 (second session), call 3 (after the wheel calls, .fa4b carried): issue 24's calibration with the
# rank shapes (causal squares of fewer heads, for Ulysses' ranks), then, as separate runs in the same lease,
# issue 25's strong-scaling cases, which are also validation (a)'s records: emulated W=8 of every batch
# engine at 16k and 32k, zigzag at 128k, and world size 1.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-540}
t calibrate 240 ringbench calibrate --device cuda $FA --kernel torch-flash --out $OUT/calibration.json
t emu8 150 $R $FA --emulate --world-size 8 --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --seqlen 16k --seqlen 32k
t emu128 80 $R $FA --emulate --variant zigzag --world-size 8 --seqlen 128k
t w1 110 $R $FA --world-size 1 --variant zigzag --seqlen 16k --seqlen 128k
t w1b 60 $R $FA --world-size 1 --variant ring --variant stripe --variant llama3 --variant ulysses --seqlen 16k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -30
