#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the benchmark, and named measurement scripts.
# Usage: scripts/gpu_run.sh [tests] [bench] [scripts] [-- OPS...]; results go under $OUT.
# Env: TESTS (pytest paths, default tests), OPS (bench ops/families, default all),
#      SCRIPTS (scripts to run, e.g. "benchmarks/tune_table.py scripts/gpu_ir.py"; default
#      scripts/gpu_ir.py), BENCH_ARGS (extra tkit bench args). The bench stage appends its rows
#      to $OUT/<device>.jsonl: append those to benchmarks/results/<device>.jsonl when committing.
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
  # below verifies the tuned configs at benchmark sizes.
  TKIT_NO_AUTOTUNE=1 timeout ${TEST_TIMEOUT:-240} python3 -m pytest ${TESTS:-tests} -q ${PYTEST_ARGS:-} \
    -p no:cacheprovider -rf --durations=15 2>&1 | tee "$OUT/tests.log" | tail -40
  status=$(( status | ${PIPESTATUS[0]} ))
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
