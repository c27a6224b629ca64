#!/usr/bin/env bash
# One device call: exllamav3's kernels (bench/peer) built from the carried source or unpacked from the carried
# parts, then bench_linear.py with its exllamav3 columns, stopping before the budget; everything lands in $OUT.
#   bash bench/run_linear_peer.sh build      # carry .peer/src/exllamav3/exllamav3_ext; also returns the packed library
#   bash bench/run_linear_peer.sh prebuilt   # carry .peer/lib (the exl3_peer.so.xz.part* an earlier build returned)
# env: BENCH_ARGS (the grid; default below), BUDGET_S (seconds from start until the tables are written, default 540)
set -u -o pipefail
MODE=${1:-build}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
export XDG_CACHE_HOME=/tmp/exl3cache EXLLAMAV3_TUNE_CACHE=/tmp/peer_tune_v1.bin
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-540}))
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
if [ "$MODE" = build ]; then
  timeout 420 python3 bench/peer/peer_ext.py build --jobs 16 --pack "$OUT" > "$OUT/peer_build.txt" 2>&1 \
    || { tail -n 20 "$OUT/peer_build.txt"; echo "[run] PEER BUILD FAILED"; exit 1; }
  SO=$(ls "$PWD"/.peer/build/exl3_peer*.so | head -n 1) || { echo "[run] NO BUILT LIBRARY"; exit 1; }
else
  SO=$PWD/$(python3 bench/peer/peer_ext.py unpack .peer/lib | tail -n 1) || { echo "[run] PEER UNPACK FAILED"; exit 1; }
fi
export EXL3_PEER_SO=$SO
echo "[run] library $EXL3_PEER_SO (t+$(( $(date +%s) - T0 ))s)"
python3 bench/peer/peer_ext.py check || { echo "[run] PEER IMPORT FAILED"; exit 1; }
# --deadline leaves 40 s for the point in flight and the tables; timeout is only the backstop
LEFT=$((END - $(date +%s))); [ "$LEFT" -lt 60 ] && LEFT=60
timeout $LEFT python3 bench/bench_linear.py --tag linear-peer-h200 --peer auto \
  ${BENCH_ARGS:---ms 1,2,8,16,64,256,1024,4096 --configs 4:mul1,4:mcg} --out-dir "$OUT" --deadline $((END - 40)) \
  > "$OUT/bench.txt" 2>&1
echo "[run] bench rc=$? (t+$(( $(date +%s) - T0 ))s)"
grep -E "copy bandwidth|^exllamav3|exllamav3 failed|deadline| auto |M= *[0-9]+ exllamav3" "$OUT/bench.txt" | sed -E 's/ +/ /g'
ls -la "$OUT"
