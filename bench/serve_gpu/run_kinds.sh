#!/usr/bin/env bash
# Several kinds' serving rows in one device call, one after another on the same GPU (e.g. `gptq fp8`, then `exl3
# bf16` in the next call: four kinds in two calls), everything $OUT gets tarred into one file (a call returns at most
# 8 files). STAGE=c1: stage that kit part first. PER: seconds per kind (default 280). ROWS / PRESET: serve_bench's
# --rows / --preset.
#   STAGE=c1 PER=280 bash bench/serve_gpu/run_kinds.sh gptq fp8
set -u
[ -n "${STAGE:-}" ] && bash .vkit26/$STAGE/stage.sh .vkit26/$STAGE 2>&1 | tail -1
for k in "$@"; do
  BUDGET_S=${PER:-280} SPEED_ARGS="--rows ${ROWS:-1024:1:10,1024:16:96,1024:64:192,8192:1:8} ${PRESET:+--preset $PRESET}" \
    bash bench/serve_gpu/run_speed.sh "$k" > "$OUT/speed-$k.txt" 2>&1
  echo "$k rc=$?"; tail -9 "$OUT/speed-$k.txt"
  grep -h -E "Model loading took|Available KV cache|Using [A-Za-z]+LinearKernel|quantization=" "$OUT/${k}_server.log" \
    | cut -c1-220 | head -6
done
tar -C "$OUT" -czf /tmp/kinds.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/kinds.tgz "$OUT/"
