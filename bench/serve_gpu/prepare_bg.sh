#!/usr/bin/env bash
# run_prepare.sh's model writing, detached beside other work (e.g. the corpus sitting), so that run_speed.sh can follow
# it in the same sitting: a private copy of the tree writes the EXL3 checkpoint and the bf16 config into
# /tmp/serve-bench, then touches /tmp/serve-bench/PREPARED. Kernels: the NVRTC cache the corpus pipeline unpacks.
set -u
T=/tmp/preptree
rm -rf $T && mkdir -p $T /tmp/serve-bench && cp -r src bench pyproject.toml $T/ || { echo "[prepare_bg] copy FAILED"; exit 1; }
cd $T && PYTHONPATH=$T/src setsid nohup bash -c "for K in exl3 bf16; do \
  python3 bench/serve_gpu/serve_bench.py --kind \$K --prepare-only --out /tmp/serve-prep ${SPEED_ARGS:-} || exit 1; done; \
  touch /tmp/serve-bench/PREPARED" > /tmp/serve-prep.log 2>&1 < /dev/null &
echo "[prepare_bg] started: /tmp/serve-prep.log, /tmp/serve-bench/PREPARED when done"
