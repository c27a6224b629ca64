#!/usr/bin/env bash
# Device call 1 (carry one kit part, the smallest beside the cache: .vkit26/c2): the part, plus the work that needs
# no vLLM; see README.md here.
set -uo pipefail
part=${1:?usage: run_prepare.sh .vkit26/c2}
export OUT=${OUT:-/tmp/serve-out}; mkdir -p "$OUT"
bash "$part/stage.sh" "$part"; echo "stage rc=$? (3 = parts still missing, expected here)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" XDG_CACHE_HOME=/tmp/exl3cache PYTHONUNBUFFERED=1
# NVRTC_TAR (bench/peer/corpus/precompile.sh, carried): the compile below then only reads the cache.
[ -n "${NVRTC_TAR:-}" ] && mkdir -p /tmp/exl3cache && tar -C /tmp/exl3cache -xJf "$NVRTC_TAR" && echo "NVRTC cache unpacked"
# Every kernel variant into the NVRTC cache (/tmp survives warm calls), while the models are written.
python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs 14 > "$OUT/kernel_compile.txt" 2>&1 &
COMPILE=$!
# The Llama-3-8B-shaped EXL3 checkpoint (~4.6 GB) and the bf16 config for --load-format dummy, both in /tmp.
python3 bench/serve_gpu/serve_bench.py --kind exl3 --prepare-only --out "$OUT" ${SPEED_ARGS:-}
python3 bench/serve_gpu/serve_bench.py --kind bf16 --prepare-only --out "$OUT" ${SPEED_ARGS:-}
# Its "failure(s)" count spills too; only COMPILE ERROR lines mean a kernel is missing.
wait $COMPILE; echo "kernel compile rc=$?"; head -1 "$OUT/kernel_compile.txt"; tail -1 "$OUT/kernel_compile.txt"
echo "compile errors: $(grep -c 'COMPILE ERROR' "$OUT/kernel_compile.txt")"
du -sh /tmp/serve-bench/* 2>/dev/null
