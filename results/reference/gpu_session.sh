#!/usr/bin/env bash
# The GPU runs behind results/reference/: install offline, benchmark, verify.
# Run from the repository root on a machine with 2 GPUs:
#   RINGBENCH_GIT_COMMIT=$(git rev-parse HEAD) bash results/reference/gpu_session.sh bench|verify|peers|model
# Writes into $OUT (default ./gpu-out): the records (*.jsonl), the JUnit file, the consoles.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
RES=/tmp/ringbench-gpu
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} COLUMNS=160
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 1; }
case "${1:-bench}" in
  bench)
    { nvidia-smi; nvidia-smi topo -m; } >"$OUT/machine.txt" 2>&1
    # The published comparison's shape, every batch variant, both kernels, 8k..128k.
    ringbench run --scenario llama3-8b --out "$RES" --timeout 560 ${RUN_ARGS:-} >"$OUT/llama3-8b.console.txt" 2>&1
    echo "run exit $?"
    cp "$RES/runs.jsonl" "$OUT/llama3-8b.runs.jsonl"
    ;;
  verify)
    # The nightly matrix for the variants that joined after the first nightly run.
    ringbench verify --device cuda --scenario ci-nightly ${VERIFY_ARGS:-} --out "$RES" --timeout 540 \
        --junit-xml "$OUT/ci-nightly.junit.xml" >"$OUT/ci-nightly.console.txt" 2>&1
    echo "verify exit $?"
    cp "$RES/verify.jsonl" "$OUT/ci-nightly.verify.jsonl"
    ;;
  peers)
    { nvidia-smi; nvidia-smi topo -m; } >"$OUT/machine.txt" 2>&1
    ringbench variants >"$OUT/variants.txt" 2>&1
    # PyTorch's context parallel through the nightly matrix (its causal half), then the sweep.
    ringbench verify --device cuda --scenario ci-nightly --variant torch_cp --out "$RES" --timeout 240 \
        --junit-xml "$OUT/ci-nightly-torch_cp.junit.xml" >"$OUT/ci-nightly-torch_cp.console.txt" 2>&1
    echo "verify exit $?"
    cp "$RES/verify.jsonl" "$OUT/ci-nightly-torch_cp.verify.jsonl"
    ringbench run --scenario peers --out "$RES" --timeout 480 >"$OUT/peers.console.txt" 2>&1
    echo "run exit $?"
    cp "$RES/runs.jsonl" "$OUT/peers.jsonl"
    for mode in fwd_bwd fwd; do
      ringbench compare "$OUT/peers.jsonl" --where "mode == '$mode'" --plot "$OUT/peers-$mode.png" \
          --markdown "$OUT/peers-$mode.md" >>"$OUT/peers.compare.txt" 2>&1
    done
    ;;
  model|model-only)
    # Every step saves what it made into one archive, so a cut-off call still brings it back.
    save() { tar czf "$OUT/gpu.tgz" -C "$RES" . ; }
    cp -r results/reference/efficient.toml "$RES/"
    # Issue 8: llama-small (4 layers, 32/8 heads, 16k tokens) with and without context parallelism.
    ringbench verify --model llama-small --device cuda --world-size 2 --dtype bf16 --kernel torch-flash \
        --variant zigzag --out "$RES/model" --timeout 240 --junit-xml "$RES/llama-small.junit.xml" \
        >"$RES/llama-small.console.txt" 2>&1; echo "model exit $?"; save
    ringbench verify --model llama-small --device cuda --world-size 2 --dtype bf16 --kernel torch-flash \
        --variant zigzag_varlen --variant llama3_varlen --docs 4096,1024,7168,4096 --out "$RES/model" \
        --timeout 240 --junit-xml "$RES/llama-small-packed.junit.xml" >"$RES/llama-small-packed.console.txt" 2>&1
    echo "packed exit $?"; save
    [ "$1" = model-only ] && exit 0
    # The torch-efficient kernel: verify under four variants, then time zigzag and torch_cp with it.
    ringbench verify --device cuda --scenario "$RES/efficient.toml" --out "$RES/efficient" --timeout 150 \
        --junit-xml "$RES/efficient.junit.xml" >"$RES/efficient.console.txt" 2>&1; echo "efficient exit $?"; save
    for v in zigzag torch_cp; do for s in 16k 128k; do
      ringbench run --variant $v --kernel torch-efficient --seqlen $s --out "$RES/efficient" --timeout 120 \
          >>"$RES/efficient-run.console.txt" 2>&1; echo "run $v $s exit $?"
    done; done; save
    # The nightly cases of stripe and llama3 that the first GPU session did not reach.
    ringbench verify --device cuda --scenario ci-nightly --variant stripe --variant llama3 --out "$RES/nightly" \
        --timeout 170 --junit-xml "$RES/ci-nightly-stripe-llama3.junit.xml" \
        >"$RES/ci-nightly-stripe-llama3.console.txt" 2>&1; echo "nightly exit $?"; save
    ;;
esac
tail -5 "$OUT"/*.console.txt
