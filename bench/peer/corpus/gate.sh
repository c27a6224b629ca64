#!/bin/bash
# The fidelity gate on the GPU machine, once the corpus pipeline (pipeline.sh) runs and the vLLM kit is staged:
# wait for the pipeline, run vLLM + exl3-vllm on every converted checkpoint (gate_vllm.py, under the kit), compare
# with exllamav3 (compare.py, under exllamav3), then collect.sh. Re-entrant: a later call picks up where the time ran
# out (finished engines are kept). BUDGET_S (default 560) bounds the whole call.
set -u
C=/tmp/corpus
T0=$(date +%s)
END=$((T0 + ${BUDGET_S:-560}))
# Engines start on the first reference exllamav3 writes and follow the rest as they land (until DONE or the deadline).
while [ ! -f $C/ref/ex3.json ] && [ $(date +%s) -lt $((END - 200)) ] && pgrep -f pipeline.sh > /dev/null; do sleep 10; done
while [ ! -f $C/NVRTC_DONE ] && [ $(date +%s) -lt $((END - 200)) ]; do sleep 5; done
if [ ! -f $C/ref/ex3.json ] || [ ! -f $C/NVRTC_DONE ]; then
  echo "[gate] corpus not ready"; tail -n 20 $C/log.txt
  WAIT_S=0 PACK_CKPTS=0 bash bench/peer/corpus/collect.sh; exit 1
fi
(
  source bench/serve_gpu/device_env.sh || exit 3
  # Engines share the GPU, so load-time timing would measure each other: the static plan instead (every tier it
  # picks is checked against the format reference by pytest -m gpu).
  export EXL3_VLLM_TUNE=0
  python3 bench/peer/corpus/gate_vllm.py --corpus $C/exl3 --ref $C/ref --out $C/gate --parallel ${PARALLEL:-6} \
    --deadline $((END - 120)) --follow $C/DONE ${GATE_ARGS:-}
) 2>&1 | tee -a $C/gate.log | grep -E "^\[gate\]|NO KIT|Error" | cut -c1-600
PYTHONPATH=$C/extso:/tmp/site:$C/tree/.peer/src:$PWD/src TORCH_EXTENSIONS_DIR=$C/ext TORCH_CUDA_ARCH_LIST=9.0 \
  python3 bench/peer/corpus/compare.py --corpus $C/exl3 --ref $C/ref --gate $C/gate --out $C/gate/gate.json \
  2>&1 | tee -a $C/gate.log | grep -E "^\[compare\]|GATE|Error" | cut -c1-700
cp $C/gate/gate.json $C/ref/ 2>/dev/null
WAIT_S=0 bash bench/peer/corpus/collect.sh
