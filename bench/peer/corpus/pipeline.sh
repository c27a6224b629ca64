#!/bin/bash
# The corpus on the GPU machine, start to end: build exllamav3's extension (CPU) while the models train (GPU),
# convert them, run exllamav3's forward. Meant to run detached (setsid) so it outlives one device call:
#
#   SET=sample setsid nohup bash bench/peer/corpus/pipeline.sh > /dev/null 2>&1 &
#   bash bench/peer/corpus/collect.sh      # same or later call: waits, then copies results to $OUT
#
# Needs: carry .peer/src/exllamav3 (the exllamav3 1.6.5 package, see bench/README.md) and .whl (pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions, marisa-trie: what the image lacks).
# Or set EXT_SO=path of a prebuilt exllamav3_ext*.so, or EXT_XZ (below), to skip the build. Everything lands in
# /tmp/corpus.
set -u
C=/tmp/corpus
mkdir -p $C
exec > >(tee -a $C/log.txt) 2>&1
T0=$(date +%s)
stamp() { echo "[pipeline] $* (t+$(( $(date +%s) - T0 ))s)"; }
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 TORCH_EXTENSIONS_DIR=$C/ext
for V in EXT_XZ EXT_SO NVRTC_TAR; do [ -n "${!V:-}" ] && declare $V="$(realpath "${!V}")"; done  # before the cd below
# A private copy of what it runs: later device calls lay the working tree out anew under this process.
mkdir -p $C/tree/.peer/src $C/tree/tests && cp -r bench src .whl $C/tree/ && cp -r tests/data $C/tree/tests/ \
  && cp -r .peer/src/exllamav3 $C/tree/.peer/src/ \
  && cd $C/tree || { stamp "copy FAILED"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { stamp "wheel install FAILED"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/.peer/src:$PWD/src
# A build an earlier sitting returned (collect.sh PACK_EXT=1): EXT_XZ=folder of its ext.so.xz.partNN, carried.
if [ -n "${EXT_XZ:-}" ]; then
  mkdir -p $C/extso && cat "$EXT_XZ"/ext.so.xz.part* | xz -d > $C/extso/exllamav3_ext.so && EXT_SO=$C/extso/exllamav3_ext.so
fi
if [ -n "${EXT_SO:-}" ]; then
  mkdir -p $C/extso && { [ "$EXT_SO" -ef $C/extso/exllamav3_ext.so ] || cp "$EXT_SO" $C/extso/exllamav3_ext.so; } \
    && export PYTHONPATH=$C/extso:$PYTHONPATH
fi
stamp "start set=${SET:-sample} git=$(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
# NVRTC_TAR: our kernels compiled here beforehand (precompile.sh): the compile below then only reads the cache, so
# it runs at once instead of after the build.
if [ -n "${NVRTC_TAR:-}" ]; then
  mkdir -p /tmp/exl3cache && tar -C /tmp/exl3cache -xJf "$NVRTC_TAR" && stamp "NVRTC cache unpacked"
  ( XDG_CACHE_HOME=/tmp/exl3cache python3 -m exl3_vllm.kernels.cli kernels --compile-only --arch sm_90 --jobs 12 \
    > $C/nvrtc.log 2>&1; touch $C/NVRTC_DONE; stamp "NVRTC compiled ($(tail -n 1 $C/nvrtc.log))" ) &
fi
# FIXTURES=committed (default): the CI fixtures in tests/data/corpus join the gate as they are, instead of being
# converted again (their two embedding quantizations hold the GPU for minutes); their source models are not
# retrained, so they have no unquantized reference. COMMITTED: the folders of tests/data whose checkpoints join so
# (default corpus; "corpus qwen3.5" adds the committed Qwen3.5). With SET=fixture and MODELS=none nothing is trained
# or converted: the committed checkpoints alone are gated. FIXTURES=convert makes new ones (then copy them into tests/).
# FIXTURES=skip leaves them out (a sitting after one that gated them: four engines fewer).
# SKIP_SET: sets an earlier sitting converted (SET=full SKIP_SET=gate converts the rest of the full set).
SKIP=${SKIP_SET:+--skip-set $SKIP_SET}
if [ "${FIXTURES:-committed}" = skip ]; then
  SKIP="--skip-set fixture${SKIP_SET:+,$SKIP_SET}"
  : "${MODELS:=llama,llama-tied,qwen3,qwen3-moe}"
elif [ "${FIXTURES:-committed}" = committed ]; then
  mkdir -p $C/exl3 && for D in ${COMMITTED:-corpus}; do cp -r tests/data/$D/*/ $C/exl3/ || exit 1; done \
    && SKIP="--skip-set fixture${SKIP_SET:+,$SKIP_SET}"
  python3 - $C/exl3 <<'PY'
import json, os, sys
d = sys.argv[1]
names = sorted(n for n in os.listdir(d) if os.path.isfile(os.path.join(d, n, "config.json")))
json.dump([{"name": n, "model": "committed fixture", "rc": 0, "seconds": 0, "cmd": "tests/data"} for n in names],
          open(os.path.join(d, "convert.json"), "w"), indent=1)
PY
  : "${MODELS:=llama,llama-tied,qwen3,qwen3-moe}"
fi
( python3 -c "import exllamav3.ext as e; print('ext', e.exllamav3_ext.__file__)" > $C/build.log 2>&1
  echo "rc=$?" >> $C/build.log ) &
BUILD=$!
python3 bench/peer/corpus/make_models.py --text-dir .peer/src/exllamav3/conversion/standard_cal_data --out $C/hf \
  --steps ${STEPS:-1500} ${MODELS:+--only $MODELS} > $C/train.log 2>&1 || { stamp "training FAILED"; tail -n 30 $C/train.log; exit 1; }
grep -h "step $(( ${STEPS:-1500} - 1 ))" $C/train.log
stamp "trained"
wait $BUILD
tail -n 3 $C/build.log
grep -q "rc=0" $C/build.log || { stamp "build FAILED"; grep -m 20 -i "error" $C/build.log; exit 1; }
stamp "built"
# Our kernels for the gate, compiled once here (the cache the kit's engines read, device_env.sh): engines that
# start before it is done would each compile the same modules at load. After the extension's build, not beside it:
# there, starved of CPU, it finished 400 s after the build and held the engines back.
[ -z "${NVRTC_TAR:-}" ] && ( XDG_CACHE_HOME=/tmp/exl3cache nice -n 5 python3 -m exl3_vllm.kernels.cli kernels \
  --compile-only --arch sm_90 --jobs 12 > $C/nvrtc.log 2>&1; touch $C/NVRTC_DONE; stamp "NVRTC compiled" ) &
# Convert every job of the set (those that quantize the embedding first: they hold the GPU longest). exllamav3's
# reference forward follows each checkpoint as it lands, so the engines (gate.sh) start while the rest convert.
# ONLY=a,b: just these jobs (a sitting too short for the set's embedding quantizations, for one).
python3 bench/peer/corpus/convert.py --hf $C/hf --out $C/exl3 --set ${SET:-sample} $SKIP ${ONLY:+--only $ONLY} --jobs ${JOBS:-5} \
  >> $C/convert.log 2>&1 &
CONV=$!
while :; do
  kill -0 $CONV 2> /dev/null && RUNNING=1 || RUNNING=0
  NEW=$(python3 - $C <<'PY'
import json, os, sys
c = sys.argv[1]
conv = json.load(open(f"{c}/exl3/convert.json")) if os.path.exists(f"{c}/exl3/convert.json") else []
seen = set(open(f"{c}/ex3.attempted").read().split()) if os.path.exists(f"{c}/ex3.attempted") else set()
print(",".join(r["name"] for r in conv if r["rc"] == 0 and r["name"] not in seen))
PY
)
  if [ -n "$NEW" ]; then
    echo "$NEW" | tr ',' '\n' >> $C/ex3.attempted  # tried once: a crashed reference run is not retried forever
    grep "^\[convert\]" $C/convert.log | tail -n 12
    python3 bench/peer/corpus/ex3_logits.py --corpus $C/exl3 --hf $C/hf --out $C/ref --fixture-out $C/fixture \
      --names "$NEW" --fixture-names "${FIXTURE_NAMES:-all}" >> $C/ex3.log 2>&1
    grep "^\[ex3\]" $C/ex3.log | cut -c1-400 | tail -n $(echo "$NEW" | tr ',' '\n' | wc -l)
    stamp "reference logits done: $NEW"
  elif [ $RUNNING = 0 ]; then
    break
  else
    sleep 5
  fi
done
wait $CONV; stamp "converted rc=$?"
grep "^\[convert\]" $C/convert.log | tail -n 40
tail -n 5 $C/ex3.log
touch $C/DONE
