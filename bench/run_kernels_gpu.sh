#!/usr/bin/env bash
# One device call: compile sweep, GPU kernel tests, then the linear benchmark; logs and results land in $OUT.
# MODE: all | tests | bench.  BENCH_ARGS narrows the grid (e.g. --layers 8192x28672 --ms 1,16 --configs 4:mul1).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XDG_CACHE_HOME=/tmp/exl3cache EXL3_TEST_REPORT=$OUT/gpu_test_report.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, cuda.bindings; print(torch.__version__, cuda.bindings.__version__)" | tee -a "$OUT/env.txt"
MODE=${1:-all}
python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs 16 > "$OUT/compile_sm90.txt" 2>&1; echo "compile rc=$? $(tail -1 $OUT/compile_sm90.txt)"
if [ "$MODE" != "bench" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -m gpu tests/test_kernels_gpu.py ${PYTEST_ARGS:-} > "$OUT/gpu_tests.txt" 2>&1
  echo "tests rc=$?"; tail -4 "$OUT/gpu_tests.txt"
  grep -E "FAIL|Error|error" "$OUT/gpu_tests.txt" | head -20
fi
if [ "$MODE" != "tests" ]; then
  timeout ${BENCH_TIMEOUT:-400} python3 bench/bench_linear.py ${BENCH_ARGS:-} --out-dir "$OUT" > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?"
  grep -E "copy bandwidth|decode-only" "$OUT/bench.txt"
  grep -E " auto " "$OUT/bench.txt" | sed -E 's/ +/ /g'
  grep -E " M= *[0-9]+ " "$OUT/bench.txt" | grep -v " auto " | sed -E "s/ +/ /g" | cut -c1-90
fi
