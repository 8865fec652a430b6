#!/usr/bin/env bash
# Issue 26's CPU verify (2026-12-06): every named mask family and the slices files through every ringbench
# engine, batch and varlen, bf16 and fp32, at W = 1, 2, 4, 8 (gloo, the cpu kernel: partial blocks as window
# calls by slices), with and without packed documents, a learnable sink and head_dim_v (math kernel), and
# MagiAttention's varlen block-causal mask of 960 tokens; then the "mask applied only locally" test variant.
# Run from the checkout's root; records go to $OUT (default results/reference/2026-12-06-cpu-masks).
set -u
OUT=${OUT:-results/reference/2026-12-06-cpu-masks}
V="ringbench verify --device cpu --yes --out $OUT"
S="--heads 8 --kv-heads 2 --head-dim 16"
BATCH="--variant ring --variant zigzag --variant stripe --variant llama3 --variant ulysses --variant usp"
VARLEN="--variant ring_varlen --variant zigzag_varlen --variant llama3_varlen --variant ulysses_varlen --variant usp_varlen"
FAM="--mask window:9,4 --mask prefix:40 --mask shared-prefix:28,answers=3 --mask chunked:24 --mask global:4,window:24"
FILES="--mask-file tests/data/masks/two_sided_window.txt --mask-file tests/data/masks/image_in_text.txt"
W="--world-size 1 --world-size 2 --world-size 4 --world-size 8"
for dt in fp32 bf16; do
  $V --kernel cpu --dtype $dt $S --seqlen 256 $BATCH $FAM $FILES $W
  $V --kernel cpu --dtype $dt $S --seqlen 256 $VARLEN --mask prefix:20 --mask chunked:16 --mask global:4,window:24 \
     --docs 96,32,128 --world-size 1 --world-size 2 --world-size 4
done
$V --kernel cpu --dtype fp32 $S --seqlen 256 $BATCH --mask prefix:40 --mask shared-prefix:28,answers=3 --sink learnable $W
$V --kernel math --dtype fp32 --heads 8 --kv-heads 2 --head-dim 24 --head-dim-v 16 --seqlen 256 $BATCH \
   --mask prefix:40 --mask chunked:24 --world-size 1 --world-size 2 --world-size 4
$V --kernel cpu --dtype fp32 $S --seqlen 960 $BATCH --mask-file tests/data/masks/magi_varlen_block_causal.txt $W
RINGBENCH_TEST_VARIANTS=1 $V --kernel cpu --dtype fp32 $S --seqlen 256 --variant mask_local_only \
   --mask prefix:40 --mask chunked:24 --world-size 2 --world-size 4 --world-size 8
