# Sourced by this day's call scripts (one H200): the flash-attn-4 install, the timed-step helper.
# Records go to /tmp/r and are copied to $OUT after every step (a killed call still returns them);
# console texts go to /tmp/logs and come back as one $OUT/logs.tgz (the device returns at most 8 files).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 COLUMNS=160
[ -n "$NO_FA4" ] || python3 -c "import flash_attn.cute" 2>/dev/null || bash .fa4b/install-fa4.sh >/dev/null || exit 3
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 4
L=/tmp/logs; mkdir -p $L /tmp/r
START=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
t() {
  local name=$1; shift; local t0=$(date +%s)
  if (( t0 - START > ${STOP_S:-520} )); then echo "$name skipped: out of time"; return; fi
  timeout "$@" > $L/$name.txt 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s: $(grep -E 'passed|failed|records? appended|written|cases?:' $L/$name.txt | tail -1)"
  for f in /tmp/r/*.jsonl; do [ -f "$f" ] && cp "$f" $OUT/; done
  tar czf $OUT/logs.tgz -C $L .
}
R="ringbench run --device cuda --yes --out /tmp/r"
FA="--kernel flash-attn-4"
