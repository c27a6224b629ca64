#!/usr/bin/env bash
# Device calls 3 (exl3) and 4 (bf16, then the report), and the fp8 / gptq / marlin peers: one kind's serving benchmark; README.md here.
set -uo pipefail
T0=$(date +%s)
kind=${1:?usage: run_speed.sh exl3|bf16|fp8|gptq|marlin}
source bench/serve_gpu/device_env.sh || exit $?
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
RESERVE=0; [ "$kind" = bf16 ] && RESERVE=15
# BUDGET_S: seconds this call may use (the run tool gives at most 600, less when little device time is left).
BUDGET=${BUDGET_S:-570}
python3 bench/serve_gpu/serve_bench.py --kind "$kind" --out "$OUT" --deadline $(( T0 + BUDGET - RESERVE )) \
  ${SPEED_ARGS:-}
rc=$?
if [ "$kind" = bf16 ]; then
  # A first look from both kinds' rows in /tmp/serve-bench; the real report is made afterwards off the device.
  python3 -c "import matplotlib" 2>/dev/null || echo "no matplotlib on the device: report without the PNG"
  python3 bench/serve_gpu/report.py --dir /tmp/serve-bench --out-dir "$OUT" --device-run || true
fi
exit $rc
