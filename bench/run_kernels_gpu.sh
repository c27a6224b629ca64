#!/usr/bin/env bash
# One device call: GPU kernel tests, then the linear benchmark; logs and results land in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XDG_CACHE_HOME=/tmp/exl3cache EXL3_TEST_REPORT=$OUT/gpu_test_report.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, cuda.bindings; print(torch.__version__, cuda.bindings.__version__)" | tee -a "$OUT/env.txt"
MODE=${1:-all}
python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs 16 > "$OUT/compile_sm90.txt" 2>&1; echo "compile rc=$? $(tail -1 $OUT/compile_sm90.txt)"
if [ "$MODE" != "bench" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -m gpu tests/test_kernels_gpu.py ${PYTEST_ARGS:-} 2>&1 | tail -60 | tee "$OUT/gpu_tests.txt"
fi
if [ "$MODE" != "tests" ]; then
  timeout ${BENCH_TIMEOUT:-400} python3 bench/bench_linear.py ${BENCH_ARGS:-} --out-dir "$OUT" 2>&1 | tee "$OUT/bench.txt" | grep -v "^ " | tail -5
  cp "$OUT"/2026-12-01-linear-h200.* bench/results/ 2>/dev/null
  grep -E "M=(1|16|64|256|2048) " "$OUT/bench.txt" | tail -40
fi
