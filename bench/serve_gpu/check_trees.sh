#!/usr/bin/env bash
# One device call, no kit: the GPU kernel tests and the op's host cost for each tree given (a src/ directory, e.g.
# src, .dev/old/src from `git archive OLD src`, carried), then one launch's host cost. The tests are this checkout's:
# name an older tree DIR:cost to time it without them (its API may predate them). NVRTC_TAR: the compiled
# kernels (bench/peer/corpus/precompile.sh), unpacked first. $OUT gets two logs (every tree's, in turn), a JSON of
# host times per tree and launch_cost.json: few files, as a device call returns only a handful.
#   NVRTC_TAR=.dev/nvrtc-sm90.tar.xz bash bench/serve_gpu/check_trees.sh src .dev/old/src:cost
set -u
export OUT=${OUT:-/tmp/check-trees}; mkdir -p "$OUT" /tmp/exl3cache
[ -n "${NVRTC_TAR:-}" ] && tar -C /tmp/exl3cache -xJf "$NVRTC_TAR" && echo "NVRTC cache unpacked"
export XDG_CACHE_HOME=/tmp/exl3cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
i=0
for arg in "$@"; do
  i=$((i + 1)); tree=${arg%:cost}
  echo "== tree $i: $arg" | tee -a "$OUT/kernels_gpu.log" >> "$OUT/host_cost.txt"; echo "== tree $i: $arg"
  if [ "$tree" = "$arg" ]; then
    PYTHONPATH="$tree" timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py \
      tests/test_moe_gpu.py > /tmp/kernels_gpu.log 2>&1
    cat /tmp/kernels_gpu.log >> "$OUT/kernels_gpu.log"; tail -1 /tmp/kernels_gpu.log
  fi
  PYTHONPATH="$tree" timeout 90 python3 bench/host_cost.py --gpu --out "$OUT/host_cost_$i.json" > /tmp/host_cost.txt 2>&1
  cat /tmp/host_cost.txt >> "$OUT/host_cost.txt"; grep "^M=" /tmp/host_cost.txt
done
PYTHONPATH="${1%:cost}" timeout 60 python3 bench/experiments/launch_cost.py --out "$OUT/launch_cost.json"
