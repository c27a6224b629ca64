#!/bin/bash
# Here, before a sitting: every kernel module for sm_90 compiled with NVRTC into a fresh cache and packed for the
# carry (8 minutes on 2 cores; 4.8 MB: the cubins compress ~12x). pipeline.sh unpacks it (NVRTC_TAR=...), so the
# device skips the compile that otherwise holds the gate's engines back. Entries are keyed by the kernel sources,
# the arch and the NVRTC version: after a change to src/exl3_vllm/kernels, make it again (a stale one only misses).
set -eu
OUT=${1:-.dev/nvrtc-sm90.tar.xz}
D=$(mktemp -d /tmp/nvrtc-pre.XXXX)
T0=$(date +%s)
XDG_CACHE_HOME=$D .venv/bin/python -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs "${JOBS:-2}" \
  > "$D.log" 2>&1 || { tail -n 20 "$D.log"; exit 1; }
mkdir -p "$(dirname "$OUT")"
tar -C "$D" -cJf "$OUT" exl3_vllm
echo "[precompile] $(tail -n 1 "$D.log"); $(du -h "$OUT" | cut -f1) in $OUT after $(( $(date +%s) - T0 )) s"
rm -rf "$D" "$D.log"
