# 2026-12-07, call 4 (right after gpu_a.sh on the same machine): the other engines emulated at W=8 64k
# with a profile (issue 25), issue 26's prefix and shared-prefix masks at 64k (W=1, and W=8 with the
# balanced layout), verify at W=1 for every engine, and the GPU tests of capture against eager.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-560}
M="--seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7"
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r $FA --heads 32 --kv-heads 8 --head-dim 128"
t m_bal 100 $R $FA --emulate $M --variant ring --layout balanced --world-size 8
t m_w1 60 $R $FA $M --variant zigzag --world-size 1
t emu_l3v 70 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant llama3_varlen --doc-dist lognormal:mean=8k,sigma=1
t emu_u 100 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant ulysses
t emu_usp 90 $R $FA --emulate --profile --world-size 8 --seqlen 64k --variant usp --ulysses-degree 2
t verify 80 $V --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k
t verify_varlen 60 $V --variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --variant ulysses_varlen --docs 3k,1k,4k --seqlen 8k
t gputests 120 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_emulation.py

# Last, if the slot allows: a calibration with the causal squares of a Ulysses rank's heads (Grid.rank_shapes).
STOP_S=360 t calib 220 ringbench calibrate --device cuda --kernel flash-attn-4 --out /tmp/r/calibration.json
cp /tmp/r/calibration.json $OUT/ 2>/dev/null
