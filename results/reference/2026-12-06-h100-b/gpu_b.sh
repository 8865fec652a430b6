# 2026-12-06, second session, call 6 (a fresh H100 after the machine of gpu_a.sh went back): after
# graphs.compare gives a nondeterministic backward's gradients a floor of 8 units in the last place
# (a reference had still run eagerly where eager calls differed by less), the strong-scaling cases
# again, the GPU tests, verify at W=1.
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-480}
t emu 110 $R $FA --emulate --variant zigzag --variant stripe --world-size 8 --seqlen 16k --seqlen 32k
t tf16 40 $R --kernel torch-flash --emulate --variant zigzag --world-size 8 --seqlen 16k
t m_bal 75 $R $FA --emulate --seqlen 64k --mask prefix:8k --mask shared-prefix:8k,answers=7 --variant ring --layout balanced --world-size 8
t gputests 150 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_timing.py tests/test_emulation.py tests/test_merge_gpu.py
t verify 80 ringbench verify --device cuda --world-size 1 --yes --out /tmp/r $FA --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp --seqlen 8k --mask causal --mask prefix:1k
t emu_w32 80 $R $FA --emulate --variant zigzag --world-size 32 --seqlen 64k
python3 results/reference/2026-12-02-h200-scaling/summary.py $OUT/runs.jsonl 2>&1 | tail -20
