#!/bin/bash
# Wait for pipeline.sh (at most WAIT_S seconds, default 500), then copy what the corpus made into $OUT:
# log.txt, results.tar.xz (convert.json, ex3.json, the per-job logs), fixture.tar (the fixture checkpoints and every
# checkpoint's 96-token exllamav3 logits), with PACK_EXT=1 exllamav3's built extension (ext.so.xz.partNN), and the
# converted checkpoints (ckpts.tar.partNN, 15 MiB parts; CKPTS names which) as far as the return limit allows.
set -u
C=/tmp/corpus
OUT=${OUT:-/tmp/corpus-out}
mkdir -p "$OUT"
END=$(( $(date +%s) + ${WAIT_S:-500} ))
while [ ! -f $C/DONE ] && [ $(date +%s) -lt $END ]; do
  sleep 10
  pgrep -f pipeline.sh > /dev/null || break
done
[ -f $C/DONE ] && echo "[collect] DONE" || echo "[collect] NOT DONE"
cp $C/log.txt "$OUT/log.txt" 2>/dev/null
tail -n 40 $C/log.txt
( cd $C && tar -cJf "$OUT/results.tar.xz" exl3/convert.json exl3/*.log* ref/ex3.json ref/gate.json gate/gate_runs.json \
  gate/*.log gate.log train.log build.log ex3.log convert.log nvrtc.log pytest-gpu.log gputests stress/summary.json stress/progress.json stress/stress.log stress/server.log exactness exactness-sliced hf/*/train.json hf/*/config.json \
  2>/dev/null )
[ -d $C/fixture ] && tar -C $C -cf "$OUT/fixture.tar" fixture $(cd $C && ls -d exl3/${FIXTURE_CKPTS:-llama-recipe-eb4} \
  exl3/qwen3-moe-recipe-eb3 2>/dev/null)
# What comes back is at most 8 files and 64 MiB: the extension's parts first (a later sitting skips the build), then
# as many checkpoint parts as fit (a cut tar still yields every whole checkpoint before the cut).
if [ "${PACK_EXT:-0}" = 1 ]; then
  SO=$(ls $C/ext/exllamav3_ext/*.so 2>/dev/null | head -n 1)
  [ -n "$SO" ] && ls -la "$SO" && xz -T0 -6 -c "$SO" | split -b 15M -d - "$OUT/ext.so.xz.part"
fi
if [ "${PACK_CKPTS:-1}" = 1 ] && [ -d $C/exl3 ]; then
  rm -rf $C/parts && mkdir -p $C/parts
  # CKPTS: only these checkpoints (names under exl3/), in this order; default every one.
  SEL=exl3; [ -n "${CKPTS:-}" ] && SEL=$(for K in $CKPTS; do [ -d $C/exl3/$K ] && echo exl3/$K; done)
  (cd $C && tar -cf - --exclude='*.log' $SEL) | split -b 15M -d - "$C/parts/ckpts.tar.part"
  for P in $C/parts/*; do
    N=$(ls "$OUT" | wc -l); B=$(du -cb "$OUT"/* | tail -n 1 | cut -f1)
    [ $N -lt 8 ] && [ $((B + $(stat -c %s "$P"))) -le $((63 * 1048576)) ] || { echo "[collect] left out $(basename $P) on"; break; }
    cp "$P" "$OUT/"
  done
fi
ls -la "$OUT"
du -cb "$OUT"/* | tail -n 1
