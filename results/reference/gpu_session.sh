#!/usr/bin/env bash
# The GPU session behind results/reference/: install offline, check correctness, benchmark.
# Run from the repository root on a machine with 2 GPUs: bash results/reference/gpu_session.sh
# Writes into $OUT (default ./gpu-out): records (*.jsonl), the JUnit file and the console logs.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
RES=/tmp/ringbench-gpu
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} COLUMNS=200
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 1; }
{ nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.backends.cudnn.version())'; } >"$OUT/machine.txt" 2>&1
step() { echo "== $*"; "$@"; echo "== exit $?"; }
{
  # Correctness first, small: both kernels, world sizes 1 and 2, causal and not, GQA.
  step ringbench verify --device cuda --scenario ci-nightly --variant ring --variant zigzag \
      --world-size 2 --out "$RES" --timeout 300 ${VERIFY_ARGS:-}
  # The published comparison's shape.
  step ringbench run --scenario llama3-8b --out "$RES" --timeout 900 ${RUN_ARGS:-}
} 2>&1 | tee "$OUT/console.txt"
cp "$RES"/*.jsonl "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$RES" logs 2>/dev/null
