#!/bin/bash
# pytest -m gpu beside the corpus pipeline, detached (it outlives the call that starts it): a private copy of the
# tree, started once pipeline.sh has filled the NVRTC cache; logs land in /tmp/corpus/gputests, which collect.sh returns.
set -u
C=/tmp/corpus
G=/tmp/gputree
rm -rf $G && mkdir -p $G $C/gputests && cp -r src tests tools bench pyproject.toml $G/ || { echo "[gputests] copy FAILED"; exit 1; }
cd $G && setsid nohup bash -c "while [ ! -f $C/NVRTC_DONE ]; do sleep 5; done; \
  OUT=$C/gputests TEST_TIMEOUT=${TEST_TIMEOUT:-420} bash bench/run_kernels_gpu.sh tests > $C/pytest-gpu.log 2>&1" \
  > /dev/null 2>&1 < /dev/null &
echo "[gputests] started in $G"
