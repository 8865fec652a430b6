# Every named mask family and three slices files through the six ringbench engines at W=1, 2, 4, 8, bf16 and fp32,
# verified on CPU (gloo, the math kernel) against float64: issue 26's done-when, as records. From the checkout's root:
#   bash results/reference/2026-12-02-cpu-masks/run.sh
set -u
D=results/reference/2026-12-02-cpu-masks
for dtype in bf16 fp32; do
  V="ringbench verify --device cpu --kernel math --yes --out $D --heads 8 --kv-heads 2 --head-dim 16 --dtype $dtype
     --variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp
     --world-size 1 --world-size 2 --world-size 4 --world-size 8"
  $V --seqlen 256 --mask window:9,4 --mask prefix:40 --mask shared-prefix:28,answers=3 --mask chunked:24 \
     --mask global:4,window:24 --mask-file tests/data/masks/two_sided_window.txt \
     --mask-file tests/data/masks/image_in_text.txt > $D/console-256-$dtype.txt 2>&1
  echo "256 $dtype: exit $?"
  $V --seqlen 960 --mask-file tests/data/masks/magi_varlen_block_causal.txt > $D/console-960-$dtype.txt 2>&1
  echo "960 $dtype: exit $?"
done
