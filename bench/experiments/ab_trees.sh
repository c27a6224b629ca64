#!/usr/bin/env bash
# Issue 43 A/B in one device call: bench_linear.py from this tree (after) and from .dev/ab43/before (ad7b345^,
# git archive of src + bench), alternated in separate processes; CSVs, ab43.log and the .md tables land in $OUT.
# Carry .dev/ab43 and .dev/nvrtc-sm90.tar.xz. Env: ORDER (default "after before before after"), BUDGET_S (390),
# BENCH_ARGS (default: Llama-3-8B layers, M 1/4/16/64/2048, 4-bit mul1 + mcg, 05c's timing options, auto path only).
# Report here: python bench/experiments/ab_trees_report.py <files_at>
# Prepare here: git archive ad7b345^ src bench | tar -x -C .dev/ab43/before; then that tree's sm_90 cache, as
# precompile.sh does (PYTHONPATH=.dev/ab43/before/src ... --compile-only), packed as .dev/ab43/nvrtc-before-sm90.tar.xz.
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/ab43.log
T0=$(date +%s); END=$((T0 + ${BUDGET_S:-390}))
for v in $(compgen -e | grep '^EXL3_VLLM_'); do unset "$v"; done  # no developer switch may reach either tree
export PYTHONUNBUFFERED=1
A=.dev/ab43
GRID="--layers 4096x4096,4096x14336,14336x4096 --ms 1,4,16,64,2048 --configs 4:mul1,4:mcg"
ARGS=${BENCH_ARGS:-$GRID --reps 5 --calls 10 --pool-gb 2 --peer off --no-compare}
C=/tmp/ab43cache; rm -rf $C; mkdir -p $C
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee -a $LOG
echo "[ab] before = $(cat $A/before/COMMIT 2>/dev/null || echo '?'), after = this tree" | tee -a $LOG
for t in .dev/nvrtc-sm90.tar.xz $A/nvrtc-before-sm90.tar.xz $A/nvrtc-extra-sm90.tar.xz; do
  tar -C $C -xJf $t || echo "[ab] cannot unpack $t (its modules compile below)"
done
echo "[ab] $(ls $C/exl3_vllm/kernels/*.cubin | wc -l) cubins in one cache (entries keyed by a hash of source + headers)"
srcof() { [ "$1" = after ] && echo src || echo $A/before/src; }
# Every module the runs load, one process each: hits take a second, misses compile here in parallel, not in a run.
WARM='import sys; from exl3_vllm.kernels import nvrtc, variants as v
m, t = sys.argv[1:]
if m[0] == "d": sys.path.insert(0, "bench"); import decode_floor as f; c = f.compile_decode_sum(4, int(m[1:]), 90)
elif m == "io": c = nvrtc.compile_source(v.IO_SOURCE, 90, {})
else: c = nvrtc.compile_source(v.LINEAR_SOURCE, 90, v.linear_defines(4, int(m)))
print(f"[warm] {t:6s} {c.source} {c.defines}:", "cache hit" if c.cached else "COMPILED (miss)")'
for tm in after:io after:1 after:2 after:d1 after:d2 before:io before:1 before:2; do
  PYTHONPATH=$(srcof ${tm%%:*}) XDG_CACHE_HOME=$C timeout 300 python3 -c "$WARM" ${tm#*:} ${tm%%:*} &
done
wait
echo "[ab] warm done t+$(( $(date +%s) - T0 ))s"
set -- ${ORDER:-after before before after}
N=$#; I=0
for t in "$@"; do
  I=$((I + 1)); NOW=$(date +%s); LEFT=$(( (END - NOW) / (N - I + 1) ))
  [ $LEFT -lt 40 ] && { echo "[ab] run $I ($t) skipped: ${LEFT}s left"; continue; }
  # Fresh tune table per run (the tuner's pick is part of the noise), one shared kernel cache.
  R=$C/run$I; mkdir -p $R/exl3_vllm; ln -s $C/exl3_vllm/kernels $R/exl3_vllm/kernels
  S=bench/bench_linear.py; [ $t = before ] && S=$A/before/bench/bench_linear.py
  PYTHONPATH=$(srcof $t) XDG_CACHE_HOME=$R timeout $LEFT python3 $S $ARGS --tag ab43-$I-$t --out-dir "$OUT" \
    --deadline $((NOW + LEFT - 20)) 2>&1 | sed -u "s/^/[$I $t] /" >> $LOG
  echo "[ab] run $I ($t) rc=${PIPESTATUS[0]} took $(( $(date +%s) - NOW ))s of ${LEFT}s, t+$(( $(date +%s) - T0 ))s"
  grep -E "^\[$I $t\] (copy bandwidth|.*prepare|.*deadline|Traceback|.*Error)" $LOG | sed -E 's/ +/ /g' | tail -n 8
done
(cd "$OUT" && ls ab43-*.md >/dev/null 2>&1 && tar -czf ab43-md.tgz ab43-*.md && rm -f ab43-*.md)
python3 bench/experiments/ab_trees_report.py "$OUT"
