#!/bin/bash
# Issue 46 on the GPU, detached beside other jobs (the corpus gate): Qwen3.5 with its EXL3 MTP draft under vLLM's
# speculative decoding (tests/test_vllm_qwen35.py: 16 requests together and each alone, CUDA graphs, a fixed KV
# cache), then our kernels against the format reference inside one engine on a synthetic multimodal Qwen3.5
# (exactness.py, served as text).
# Needs the kit staged; waits for the corpus pipeline's NVRTC cache if one is being filled. Logs land in
# /tmp/corpus/gputests (collect.sh returns them) or $MTP_OUT.
set -u
O=${MTP_OUT:-/tmp/corpus/gputests}
T=/tmp/mtptree
rm -rf $T && mkdir -p $T $O && cp -r src tests bench pyproject.toml $T/ || { echo "[mtp] copy FAILED"; exit 1; }
cd $T && setsid nohup bash -c "
  while [ -d /tmp/corpus ] && [ ! -f /tmp/corpus/NVRTC_DONE ]; do sleep 5; done
  export EXL3_PLUGIN_DIR=/tmp/exl3-plugin-mtp EXL3_VLLM_TUNE=0
  source bench/serve_gpu/device_env.sh || exit 3
  export VLLM_RUNNER_EXTRA=\$(python3 bench/serve_gpu/kit_args.py)
  timeout 900 python3 -m pytest -q -s -p no:cacheprovider tests/test_vllm_qwen35.py > $O/qwen35-pytest.log 2>&1
  echo \"rc=\$?\" >> $O/qwen35-pytest.log
  python3 -m exl3_vllm.cli synth --config tiny-qwen3.5-vl --bits 3.5 --head-bits 6 --seed 3 --out /tmp/q35-synth \
    > $O/qwen35-exact.log 2>&1
  EXACT_KV_MIB=512 timeout 600 python3 bench/serve_gpu/exactness.py --checkpoint /tmp/q35-synth --dtype bfloat16 \
    --out $O/qwen35-exactness >> $O/qwen35-exact.log 2>&1
  echo \"rc=\$?\" >> $O/qwen35-exact.log
" > /dev/null 2>&1 < /dev/null &
echo "[mtp] started in $T, logs in $O"
