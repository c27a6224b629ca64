#!/usr/bin/env bash
# Device call 2 (carry the last kit part, e.g. .vkit/c1): that part, then exactness of our kernels inside vLLM
# (README.md here).
set -uo pipefail
T0=$(date +%s)
part=${1:?usage: run_exactness.sh .vkit/cN}
export OUT=${OUT:-/tmp/serve-out}; mkdir -p "$OUT"
# NVRTC-compile every kernel variant in parallel meanwhile (the engine would otherwise compile them one by one at
# load), unless an earlier call of the sitting started it (compile_bg.sh): then wait for that one.
if [ -f /tmp/exl3-compile.pid ] && kill -0 "$(cat /tmp/exl3-compile.pid)" 2> /dev/null; then
  COMPILE=""
else
  (XDG_CACHE_HOME=/tmp/exl3cache PYTHONPATH=src python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 \
    --jobs 14 > /tmp/exl3-compile.txt 2>&1; echo "kernel compile rc=$?" >> /tmp/exl3-compile.txt) &
  COMPILE=$!
fi
bash "$part/stage.sh" "$part" || exit $?
source bench/serve_gpu/device_env.sh || exit $?
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
# The plugin must come in through vLLM's own entry-point loader, as in `vllm serve`.
python3 -c "
import vllm, torch
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
assert 'exl3' in QUANTIZATION_METHODS, 'exl3 plugin not registered'
print('vllm', vllm.__version__, 'torch', torch.__version__, 'exl3 plugin registered')" || exit 4
# Its "failure(s)" count spills too; only COMPILE ERROR lines mean a kernel is missing.
if [ -n "$COMPILE" ]; then wait $COMPILE; else
  while [ ! -f /tmp/exl3-compile.done ] && kill -0 "$(cat /tmp/exl3-compile.pid)" 2> /dev/null; do sleep 2; done; fi
tail -2 /tmp/exl3-compile.txt; echo "compile errors: $(grep -c 'COMPILE ERROR' /tmp/exl3-compile.txt)"
LEFT=$(( T0 + ${BUDGET_S:-570} - $(date +%s) ))
echo "exactness: $LEFT s left in this call"
python3 bench/serve_gpu/exactness.py --out "$OUT" --budget $(( LEFT - 15 )) ${EXACT_ARGS:-} 2>&1 \
  | tee "$OUT/exactness.log"
