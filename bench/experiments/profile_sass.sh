#!/usr/bin/env bash
# Per-SASS-instruction stall samples of one forced tier (ncu source counters), for finding what a kernel waits on.
# usage: bench/experiments/profile_sass.sh TIER M [LAYER] -> $OUT/sass_TIER_mM.csv (+ .txt summary of the warp states)
set -o pipefail
TIER=$1; M=$2; LAYER=${3:-8192x28672}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=${NCU:-/usr/local/cuda/bin/ncu}
REP="$OUT/sass_${TIER}_m${M}"
export PYTHONPATH=src XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/exl3cache}
"$NCU" -f -o "$REP" -k "regex:exl3_gemm_${TIER}" -s 1 -c 1 --section SourceCounters --section WarpStateStats \
  --section SpeedOfLight --section SchedulerStats \
  python3 bench/experiments/profile_tier.py --tier "$TIER" --m "$M" --layer "$LAYER" > "$REP.log" 2>&1 || { tail -5 "$REP.log"; exit 1; }
"$NCU" -i "$REP.ncu-rep" --page details > "$REP.txt" 2>&1
"$NCU" -i "$REP.ncu-rep" --page source --csv --print-source sass > "$REP.csv" 2>&1
rm -f "$REP.ncu-rep"
echo "$TIER m=$M: $(grep -E 'Duration|Issued Warp Per Scheduler|No Eligible' "$REP.txt" | sed -E 's/ +/ /g' | tr '\n' ';')"
