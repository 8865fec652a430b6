# 2026-12-07, the one call the session's device time allowed (no flash-attn-4 install: its wheels take two
# more calls): the flex kernel on CUDA. Its GPU tests, flex_probe.py (FlexAttention's Triton backend; the
# FLASH backend needs flash-attn-4 and says so), verify at W=1 with a mask and ALiBi, and a masked run.
export NO_FA4=1
source results/reference/2026-12-06-h200/common.sh
STOP_S=${STOP_S:-400}
V="ringbench verify --device cuda --world-size 1 --yes --out /tmp/r --heads 32 --kv-heads 8 --head-dim 128"
t flex_tests 150 env RINGBENCH_TEST_VARIANTS=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_flex.py
t flex_probe 100 python3 results/reference/2026-12-07/flex_probe.py 8192
cp $L/flex_probe.txt $OUT/flex_probe.txt
t flex_verify 100 $V --kernel flex --variant zigzag --variant llama3 --seqlen 4k --mask prefix:512 --bias alibi
t flex_run 80 $R --kernel flex --variant zigzag --world-size 1 --seqlen 16k --mask prefix:2k
t tf_mask_run 40 $R --kernel torch-flash --variant zigzag --world-size 1 --seqlen 16k --mask prefix:2k
