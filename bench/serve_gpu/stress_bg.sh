#!/usr/bin/env bash
# stress.py detached beside other work (e.g. the corpus pipeline): a private copy of the tree and of the plugin, started
# once the NVRTC cache is filled (the marker file $1, default /tmp/corpus/NVRTC_DONE), results in $2 (default
# /tmp/corpus/stress, which bench/peer/corpus/collect.sh returns). Extra stress.py arguments: STRESS_ARGS (default: a
# fixed 2 GiB KV cache, since the GPU is shared).
set -u
MARK=${1:-/tmp/corpus/NVRTC_DONE}
DEST=${2:-/tmp/corpus/stress}
T=/tmp/stresstree
rm -rf $T && mkdir -p $T "$DEST" && cp -r src bench tests pyproject.toml $T/ || { echo "[stress_bg] copy FAILED"; exit 1; }
cd $T && setsid nohup bash -c "while [ ! -f $MARK ]; do sleep 5; done; \
  EXL3_PLUGIN_DIR=/tmp/exl3-plugin-stress source bench/serve_gpu/device_env.sh && \
  python3 bench/serve_gpu/stress.py --out $DEST ${STRESS_ARGS:---kv-cache-mib 2048} > $DEST/stress.log 2>&1" > /dev/null 2>&1 < /dev/null &
echo "[stress_bg] started: waits for $MARK, writes $DEST"
