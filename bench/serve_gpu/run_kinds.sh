#!/usr/bin/env bash
# Several kinds' serving rows in one device call on the same GPU (e.g. `gptq fp8`, then `exl3 bf16` in the next call:
# four kinds in two calls), everything $OUT gets tarred into one file (a call returns at most 8 files).
# STAGE=c1: stage that kit part first. ROWS / PRESET: serve_bench's --rows / --preset.
# One after another (default): PER seconds per kind (default 280), each server alone with vLLM's default KV cache.
# PAIR=1: every kind's server starts at once (the start-up is most of a kind's time), each with a fixed KV cache
# (PAIR_KV bytes, default 12 GiB: 64 x 1,280 tokens of the 8B shape fit) and a share of the GPU's memory; then the
# kinds take turns, rows only while no other server starts or runs rows. CALL_S: the call's seconds (default 560),
# ROWS_S: each later kind's warm-up and rows (default 190).
#   STAGE=c1 PAIR=1 bash bench/serve_gpu/run_kinds.sh gptq fp8
set -u
[ -n "${STAGE:-}" ] && bash .vkit26/$STAGE/stage.sh .vkit26/$STAGE 2>&1 | tail -1
ARGS="--rows ${ROWS:-1024:1:10,1024:16:96,1024:64:192,8192:1:8} ${PRESET:+--preset $PRESET}"
report() {
  echo "$1 rc=$2"; tail -9 "$OUT/speed-$1.txt"
  grep -h -E "Model loading took|Available KV cache|GPU KV cache size|Using [A-Za-z]+LinearKernel|quantization=" \
    "$OUT/${1}_server.log" | cut -c1-220 | head -7
}
if [ -z "${PAIR:-}" ]; then
  for k in "$@"; do
    BUDGET_S=${PER:-280} SPEED_ARGS="$ARGS" bash bench/serve_gpu/run_speed.sh "$k" > "$OUT/speed-$k.txt" 2>&1
    report "$k" $?
  done
else
  source bench/serve_gpu/device_env.sh || exit 3
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  T0=$(date +%s) D=/tmp/pair.$$ N=$# i=0 prev= ready= pids=()
  mkdir -p "$D"
  for k in "$@"; do ready+="$D/$k.ready,"; done
  MEM=$(python3 -c "print(round(0.9 / $N, 3))")
  for k in "$@"; do
    i=$((i + 1))
    python3 bench/serve_gpu/serve_bench.py --kind "$k" --out "$OUT" $ARGS --port $((8360 + i)) --gpu-mem "$MEM" \
      --deadline $((T0 + ${CALL_S:-560} - (N - i) * ${ROWS_S:-190})) \
      --serve-args "--kv-cache-memory-bytes ${PAIR_KV:-12884901888} ${SERVE_ARGS:-}" \
      --ready-file "$D/$k.ready" --turn-after "$ready${prev:+$D/$prev.done}" --done-file "$D/$k.done" \
      > "$OUT/speed-$k.txt" 2>&1 &
    pids+=($!) prev=$k
  done
  i=0
  for k in "$@"; do wait "${pids[$i]}"; report "$k" $?; i=$((i + 1)); done
fi
tar -C "$OUT" -czf /tmp/kinds.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/kinds.tgz "$OUT/"
