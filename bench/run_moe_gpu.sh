#!/usr/bin/env bash
# One device call for the grouped experts: compile sweep, MoE GPU tests, a dense-kernel regression subset, the MoE
# layer benchmark and a short dense benchmark; logs land in $OUT, a short summary is printed last.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XDG_CACHE_HOME=/tmp/exl3cache EXL3_TEST_REPORT=$OUT/gpu_test_report.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs 16 > "$OUT/compile_sm90.txt" 2>&1
echo "compile rc=$? $(tail -1 "$OUT/compile_sm90.txt")"
timeout ${MOE_TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_moe_gpu.py ${MOE_PYTEST_ARGS:-} > "$OUT/moe_tests.txt" 2>&1
echo "moe tests rc=$?"; tail -3 "$OUT/moe_tests.txt"
# The GEMM kernels changed for grouped experts: every tier through a representative set of (K, codebook) variants.
timeout ${DENSE_TEST_TIMEOUT:-130} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py \
  -k "${DENSE_K:-4-2 or 3-1 or 2.5-2 or 8-0 or split or int8 or graph or deterministic or bad}" > "$OUT/dense_tests.txt" 2>&1
echo "dense tests rc=$?"; tail -3 "$OUT/dense_tests.txt"
timeout ${MOE_BENCH_TIMEOUT:-200} python3 bench/bench_moe.py --out-dir "$OUT" ${MOE_BENCH_ARGS:---budget-s 150} > "$OUT/moe_bench.txt" 2>&1
echo "moe bench rc=$?"
timeout ${DENSE_BENCH_TIMEOUT:-70} python3 bench/bench_linear.py --out-dir "$OUT" --tag dense-check \
  ${DENSE_BENCH_ARGS:---layers 8192x28672,4096x4096 --ms 1,8,64 --configs 4:mul1 --reps 10} > "$OUT/dense_bench.txt" 2>&1
echo "dense bench rc=$?"
grep -E "FAIL|Error" "$OUT/moe_tests.txt" "$OUT/dense_tests.txt" | head -12
grep -E "^moe " "$OUT/gpu_test_report.txt" | head -20
grep -E "copy bandwidth|decode" "$OUT/moe_bench.txt" | head -4
grep -vE "^(copy|\[|layer)" "$OUT/moe_bench.txt" | grep -E "T=|error" | cut -c1-160 | head -40
grep -E " auto " "$OUT/dense_bench.txt" | sed -E 's/ +/ /g'
