#!/bin/bash
# Issue 46 on the GPU, detached beside other jobs (the corpus gate): Qwen3.5 with its EXL3 MTP draft under vLLM's
# speculative decoding (tests/test_vllm_qwen35.py: 16 requests together and each alone, CUDA graphs, a fixed KV
# cache; again on the format reference's linears), a DeepSeek-style draft (tests/test_vllm_glm4_moe_lite.py, needs
# the MoE add-on), our kernels against the format reference inside one engine on a synthetic multimodal Qwen3.5
# (exactness.py, served as text); and beside them the trained Qwen3.5 (MTP_CKPT: a checkpoint directory, or a
# corpus job's name, default qwen3.5-mtp-b4, waited for until the corpus pipeline has converted it) drafting: greedy
# output against undrafted at c=16 and c=1, and the draft's acceptance (bench/peer/corpus/mtp_check.py, on held-out
# text cut from MTP_HELDOUT, default the corpus's copy of exllamav3's calibration text).
# Needs the kit staged; waits for the corpus pipeline's NVRTC cache if one is being filled. Logs land in
# /tmp/corpus/gputests (collect.sh returns them) or $MTP_OUT. `mtp_bg.sh here` runs it in the foreground instead.
set -u
O=${MTP_OUT:-/tmp/corpus/gputests}
T=/tmp/mtptree
if [ "${1:-}" != here ]; then
  # A private copy: later device calls lay the working tree out anew under this process.
  rm -rf $T && mkdir -p $T $O && cp -r src tests bench pyproject.toml $T/ || { echo "[mtp] copy FAILED"; exit 1; }
  cd $T && setsid nohup bash bench/serve_gpu/mtp_bg.sh here > /dev/null 2>&1 < /dev/null &
  echo "[mtp] started in $T, logs in $O"
  exit 0
fi
mkdir -p $O
while [ -d /tmp/corpus ] && [ ! -f /tmp/corpus/NVRTC_DONE ]; do sleep 5; done
export EXL3_PLUGIN_DIR=/tmp/exl3-plugin-mtp EXL3_VLLM_TUNE=0
source bench/serve_gpu/device_env.sh || exit 3
VLLM_RUNNER_EXTRA=$(python3 bench/serve_gpu/kit_args.py)
export VLLM_RUNNER_EXTRA
NAME=${MTP_CKPT:-qwen3.5-mtp-b4}
CKPT=$NAME; [[ $NAME == */* ]] || CKPT=/tmp/corpus/exl3/$NAME
converted() {
  [[ $NAME == */* ]] || python3 -c "import json, sys; sys.exit(not any(r['name'] == '$NAME' and r['rc'] == 0
                                    for r in json.load(open('/tmp/corpus/exl3/convert.json'))))" 2> /dev/null
}
( for _ in $(seq 180); do converted && break; sleep 5; done
  timeout 600 python3 bench/peer/corpus/mtp_check.py --ckpt $CKPT --spec-tokens 1,2 --alone --csv $O/mtp-check.csv \
    --heldout ${MTP_HELDOUT:-/tmp/corpus/tree/.peer/src/exllamav3/conversion/standard_cal_data} > $O/mtp-check.log 2>&1
  echo "rc=$?" >> $O/mtp-check.log ) &
CHECK=$!
# The MTP contract again with both engines on the format reference's linears, beside it: a parting that stays
# there is vLLM's (bf16 attention, GDN), not our kernels'.
( EXL3_VLLM_BACKEND=reference timeout 900 python3 -m pytest -q -s -p no:cacheprovider tests/test_vllm_qwen35.py -k mtp \
    > $O/qwen35-reference.log 2>&1; echo "rc=$?" >> $O/qwen35-reference.log ) &
REF=$!
timeout 900 python3 -m pytest -q -s -p no:cacheprovider tests/test_vllm_qwen35.py > $O/qwen35-pytest.log 2>&1
echo "rc=$?" >> $O/qwen35-pytest.log
# A DeepSeek-style draft (GLM-4-MoE-Lite, latent attention): needs the kit's MoE add-on staged (c3).
timeout 600 python3 -m pytest -q -s -p no:cacheprovider tests/test_vllm_glm4_moe_lite.py > $O/glm-pytest.log 2>&1
echo "rc=$?" >> $O/glm-pytest.log
wait $REF
python3 -m exl3_vllm.cli synth --config tiny-qwen3.5-vl --bits 3.5 --head-bits 6 --seed 3 --out /tmp/q35-synth \
  > $O/qwen35-exact.log 2>&1
EXACT_KV_MIB=512 timeout 600 python3 bench/serve_gpu/exactness.py --checkpoint /tmp/q35-synth --dtype bfloat16 \
  --out $O/qwen35-exactness >> $O/qwen35-exact.log 2>&1
echo "rc=$?" >> $O/qwen35-exact.log
wait $CHECK
