# Sourced by gpu_a.sh and gpu_b.sh: the install and the timed-step helper. Texts go to $OUT/logs.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
[ -n "$NO_FA4" ] || python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
L=$OUT/logs; mkdir -p $L
START=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
t() { local name=$1; shift; local t0=$(date +%s); if (( t0 - START > ${STOP_S:-540} )); then echo "$name skipped: out of time"; return; fi; timeout "$@" > $L/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|records? appended|written|cases?:' $L/$name.txt | tail -1)"; }
R="ringbench run --device cuda --yes --out $OUT"
FA="--kernel flash-attn-4"
