#!/bin/bash
# Peer harness, one device call: build (or unpack) exllamav3's EXL3-linear kernels + our bindings, make the
# fixtures, run both benchmark processes against a wall-clock budget. Everything lands in $OUT.
#
#   bash bench/peer/run_device.sh build    # compile from .peer/src (carry .peer/src/exllamav3/exllamav3_ext)
#   bash bench/peer/run_device.sh prebuilt # use .peer/lib/exl3_peer.so.xz.part* (carry .peer/lib)
#
# env: BUDGET_S (default 570: seconds from start until everything must be written), SKIP_FIXTURES=1,
#      SKIP_BENCH=1, BENCH_QUICK=1 (headline subset only), BENCH_REPEAT=1 (run the default process twice,
#      the second into bench_default_rep.csv, for a run-to-run spread), DECODE_CHECK=1 (with SKIP_FIXTURES=1:
#      still compare our decode-only kernel against exllamav3's reconstruct), ONLY_CEILINGS=1 (default process
#      measures the copy / GEMM / decode-only ceilings only; no nogemv process), LIGHT_ONLY=1 (skip the heavy
#      M > 256 pass), B_RESERVE_S (seconds kept for the nogemv process, default 70)
set -u -o pipefail
MODE=${1:-build}
OUT=${OUT:-/tmp/peer_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-570}
END=$((T0 + BUDGET_S))
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "[run] mode=$MODE start=$(date -u +%FT%TZ) budget=${BUDGET_S}s git=$(git rev-parse --verify -q HEAD || echo none)$(git status --porcelain -- bench/peer 2>/dev/null | grep -q . && echo "+uncommitted bench/peer")"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
nvcc --version | tail -n 2

if [ "$MODE" = build ]; then
  timeout 420 python3 bench/peer/peer_ext.py build --jobs 16 --pack /tmp/peer_parts || { echo "[run] BUILD FAILED"; exit 1; }
  SO=$(ls .peer/build/exl3_peer*.so | head -n 1)
  du -b "$SO"
  # bring the packed library back only if it fits comfortably (<= 3 parts of 15 MiB)
  NP=$(ls /tmp/peer_parts | wc -l)
  if [ "$NP" -le 3 ]; then cp /tmp/peer_parts/* "$OUT/"; else echo "[run] packed library too large ($NP parts), not returned"; fi
else
  python3 bench/peer/peer_ext.py unpack .peer/lib || exit 1
  SO=.peer/lib/exl3_peer.so
fi
export EXL3_PEER_SO=$PWD/$SO
[ "${SO:0:1}" = / ] && export EXL3_PEER_SO=$SO
echo "[run] library: $EXL3_PEER_SO  (t+$(( $(date +%s) - T0 ))s)"
python3 bench/peer/peer_ext.py check || { echo "[run] IMPORT FAILED"; exit 1; }

if [ "${SKIP_FIXTURES:-0}" != 1 ]; then
  rm -rf /tmp/fixtures
  EXL3_INT8_GEMV=0 timeout 150 python3 bench/peer/make_fixtures.py --out /tmp/fixtures && \
    tar -C /tmp -cf "$OUT/fixtures.tar" fixtures && ls -la /tmp/fixtures | tail -n 3
  echo "[run] fixtures done (t+$(( $(date +%s) - T0 ))s)"
elif [ "${DECODE_CHECK:-0}" = 1 ]; then
  timeout 60 python3 bench/peer/make_fixtures.py --out "$OUT" --decode-check-only
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  export EXLLAMAV3_TUNE_CACHE=/tmp/peer_tune_v1.bin
  NOW=$(date +%s)
  A_DL=$((END - ${B_RESERVE_S:-70}))
  QUICK=""; [ "${BENCH_QUICK:-0}" = 1 ] && QUICK="--quick"
  [ "${ONLY_CEILINGS:-0}" = 1 ] && QUICK="--only-ceilings"
  [ "${LIGHT_ONLY:-0}" = 1 ] && QUICK="--light-only"
  timeout $((A_DL - NOW + 40)) python3 bench/peer/bench_peer.py --proc default --csv "$OUT/bench_default.csv" \
    --deadline $A_DL $QUICK
  echo "[run] bench default done (t+$(( $(date +%s) - T0 ))s)"
  if [ "${BENCH_REPEAT:-0}" = 1 ]; then
    NOW=$(date +%s)
    timeout $((A_DL - NOW + 40)) python3 bench/peer/bench_peer.py --proc default --csv "$OUT/bench_default_rep.csv" \
      --deadline $A_DL $QUICK
    echo "[run] bench default (repeat) done (t+$(( $(date +%s) - T0 ))s)"
  fi
  NOW=$(date +%s)
  B_DL=$((END - 8))
  if [ $((B_DL - NOW)) -gt 15 ] && [ "${ONLY_CEILINGS:-0}" != 1 ]; then
    EXL3_GEMV=0 EXL3_INT8_GEMV=0 timeout $((B_DL - NOW + 20)) python3 bench/peer/bench_peer.py --proc nogemv \
      --csv "$OUT/bench_nogemv.csv" --ceilings-from "$OUT/bench_default.csv" --deadline $B_DL
  fi
  echo "[run] bench nogemv done (t+$(( $(date +%s) - T0 ))s)"
  python3 bench/peer/report.py --summary "$OUT/bench_default.csv" || true
fi
echo "[run] end t+$(( $(date +%s) - T0 ))s"
ls -la "$OUT"
