#!/usr/bin/env bash
# One device call: compile sweep (fills the NVRTC cache the tests use), a bounded check of SMOKE_TIERS (if set), GPU
# tests (dense, MoE, quantized embedding), the large-M path's parts (unless NO_PARTS=1), then the linear benchmark (with exllamav3's columns when .peer/lib is carried); logs and tables land in $OUT.
# MODE: all | tests | bench.  BENCH_ARGS narrows the grid (e.g. --layers 8192x28672 --ms 1,16 --configs 4:mul1);
# BUDGET_S (default 560) bounds the whole call: the benchmark stops at its deadline and writes what it has.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XDG_CACHE_HOME=/tmp/exl3cache EXL3_TEST_REPORT=$OUT/gpu_test_report.txt EXLLAMAV3_TUNE_CACHE=/tmp/peer_tune_v1.bin
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-560}))
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, cuda.bindings; print(torch.__version__, cuda.bindings.__version__)" | tee -a "$OUT/env.txt"
MODE=${1:-all}
python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs 16 > "$OUT/compile_sm90.txt" 2>&1
echo "compile rc=$? $(tail -1 $OUT/compile_sm90.txt) t+$(( $(date +%s) - T0 ))s"
TEST_K=""
if [ -n "${SMOKE_TIERS:-}" ]; then
  # New tiers first, bounded: a failure or a hang leaves them out of the tests and the dispatch for this call.
  timeout 150 python3 bench/check_tier.py --tiers "$SMOKE_TIERS" > "$OUT/smoke.txt" 2>&1
  rc=$?; echo "smoke rc=$rc $(tail -1 $OUT/smoke.txt) t+$(( $(date +%s) - T0 ))s"
  grep -E "FAIL|ERROR" "$OUT/smoke.txt" | head -10
  if [ $rc -ne 0 ]; then export EXL3_VLLM_DISABLE=x*; TEST_K="not $(echo "$SMOKE_TIERS" | sed 's/,/ and not /g')"; fi
fi
if [ "$MODE" != "bench" ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_moe_gpu.py tests/test_embedding.py ${TEST_K:+-k "$TEST_K"} > "$OUT/gpu_tests.txt" 2>&1
  echo "tests rc=$? $(tail -1 $OUT/gpu_tests.txt) t+$(( $(date +%s) - T0 ))s"
  grep -E "^FAILED|Error" "$OUT/gpu_tests.txt" | head -20
fi
if [ "$MODE" != "tests" ]; then
  [ -z "${NO_PARTS:-}" ] && timeout 90 python3 bench/bench_dequant_parts.py --out "$OUT/dequant_parts.md"
  [ -d .peer/lib ] && SO=$(python3 bench/peer/peer_ext.py unpack .peer/lib 2>/dev/null | tail -n 1) && export EXL3_PEER_SO=$PWD/$SO
  timeout $((END - $(date +%s))) python3 bench/bench_linear.py ${BENCH_ARGS:-} --out-dir "$OUT" --deadline $((END - 25)) \
    > "$OUT/bench.txt" 2>&1
  echo "bench rc=$? t+$(( $(date +%s) - T0 ))s"
  grep -E "copy bandwidth|decode-only|exllamav3:|deadline" "$OUT/bench.txt"
  grep -E " auto " "$OUT/bench.txt" | sed -E 's/ +/ /g'
fi
