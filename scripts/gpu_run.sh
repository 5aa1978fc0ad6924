#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the benchmark, and named measurement scripts.
# Usage: scripts/gpu_run.sh [tests] [bench] [scripts] [-- OPS...]; results go under $OUT.
# Env: TESTS (pytest paths, default tests) or LANES (pytest arguments a lane, '|' between
#      lanes), TEST_TIMEOUT (seconds a lane), OPS (bench ops/families, default all),
#      SCRIPTS (scripts to run, e.g. "benchmarks/tune_table.py scripts/gpu_ir.py"; default
#      scripts/gpu_ir.py), BENCH_ARGS (extra tkit bench args). The bench stage appends its rows
#      to $OUT/<device>.jsonl: append those to benchmarks/results/<device>.jsonl when committing.
#      TKIT_GIT_SHA (the commit measured): the GPU machine's copy of .git may be stale.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OUT
stages=${*:-tests bench scripts}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  | tee "$OUT/gpu_state.txt"
status=0
if [[ $stages == *tests* ]]; then
  # Autotuning off: hundreds of fuzzed shapes would otherwise be spent tuning. The benchmark
  # below verifies the tuned configs at benchmark sizes. LANES="a.py b.py|c.py|..." runs one
  # pytest a lane, at once (compiles are the cost: the host has 16 cores); -v prints each
  # test's verdict as it ends, so a lane cut at TEST_TIMEOUT still names its failures.
  # Children of a cut lane are killed before the benchmark (they would skew its timings).
  IFS='|' read -ra lanes <<< "${LANES:-${TESTS:-tests}}"
  i=0
  for lane in "${lanes[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    (TKIT_NO_AUTOTUNE=1 setsid timeout -k 5 ${TEST_TIMEOUT:-240} python3 -m pytest $lane -v \
      ${PYTEST_ARGS:-} -p no:cacheprovider -rf --tb=short > "/tmp/lane$i.log" 2>&1) &
  done
  wait
  pkill -f "pytest" 2>/dev/null || true
  for j in $(seq 1 $i); do
    { echo "=== lane $j: ${lanes[$((j - 1))]}"; cat "/tmp/lane$j.log"; echo; } >> "$OUT/tests.log"
  done
  grep -hE "(FAILED|ERROR)( |$)|^=+ .*(passed|failed)" /tmp/lane*.log | sort -u | tail -60
  grep -q -E " FAILED| ERROR" /tmp/lane*.log && status=1
fi
if [[ $stages == *bench* ]]; then
  python3 -m tkit.cli bench ${OPS:-} --out "$OUT" --stem bench --plot ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | tail -80
  status=$(( status | ${PIPESTATUS[0]} ))
fi
if [[ $stages == *scripts* ]]; then
  for s in ${SCRIPTS:-scripts/gpu_ir.py}; do
    [[ -f $s ]] || continue
    echo "== $s"
    timeout ${SCRIPT_TIMEOUT:-180} python3 "$s" 2>&1 | tee "$OUT/$(basename "$s" .py).log" | tail -40
  done
fi
exit $status
