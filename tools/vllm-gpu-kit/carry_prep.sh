#!/usr/bin/env bash
# Lay the built kit out in a repo as one git-ignored folder per device call:
#
#   bash carry_prep.sh REPO_ROOT [KIT_OUT_DIR] [FOLDER]
#       KIT_OUT_DIR default $VKIT_BUILD_DIR/out, i.e. /tmp/vllm-kit-build-026/out
#       FOLDER      default $VKIT_CARRY_DIR or .vkit (a plain name at the repo root,
#                   e.g. .vkit26 to keep an older kit's .vkit/ untouched)
#
# makes REPO_ROOT/FOLDER/c0, c1, ... each holding ONE part plus SHA256SUMS, stage.sh,
# env.sh and kit_check.py (a few KiB), adds /FOLDER/ to the repo's info/exclude so
# nothing travels unless a call names it in `carry`, and prints the calls to make.
# Core parts (part-NN) come first, then the MoE add-on (moe-NN).
set -euo pipefail
REPO=$(cd "${1:?usage: carry_prep.sh REPO_ROOT [KIT_OUT_DIR] [FOLDER]}" && pwd)
OUTDIR=${2:-${VKIT_BUILD_DIR:-/tmp/vllm-kit-build-026}/out}
DIR=${3:-${VKIT_CARRY_DIR:-.vkit}}
[[ $DIR =~ ^[A-Za-z0-9._-]+$ && $DIR != . && $DIR != .. && $DIR != .git ]] ||
  { echo "FOLDER must be a plain name at the repo root (like .vkit or .vkit26), not '$DIR'" >&2; exit 1; }
[[ -f $OUTDIR/SHA256SUMS ]] || { echo "no $OUTDIR/SHA256SUMS: run build.sh first" >&2; exit 1; }

EXCLUDE=$(git -C "$REPO" rev-parse --git-path info/exclude)
[[ $EXCLUDE = /* ]] || EXCLUDE=$REPO/$EXCLUDE
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF "/$DIR/" "$EXCLUDE" 2>/dev/null || echo "/$DIR/" >> "$EXCLUDE"

rm -rf "${REPO:?}/$DIR"
mkdir -p "$REPO/$DIR"
mapfile -t PARTS < <( (cd "$OUTDIR" && ls part-[0-9]* 2>/dev/null; ls moe-[0-9]* 2>/dev/null) )
i=0
for p in "${PARTS[@]}"; do
  d=$REPO/$DIR/c$i
  mkdir -p "$d"
  ln "$OUTDIR/$p" "$d/$p" 2>/dev/null || cp "$OUTDIR/$p" "$d/$p"
  for f in SHA256SUMS stage.sh env.sh kit_check.py; do cp "$OUTDIR/$f" "$d/"; done
  i=$((i + 1))
done
echo "Made $i folders under $REPO/$DIR (ignored by git). Make these device calls back to back"
echo "(each within 30 s of the previous one ending, or /tmp/vllm-kit is lost):"
for ((k = 0; k < i; k++)); do
  echo "  command $((k + 1)), carrying $DIR/c$k:  bash $DIR/c$k/stage.sh $DIR/c$k   # ${PARTS[$k]}"
done
echo "The call that completes the core prints KIT READY; append your work to it, e.g."
echo "  bash $DIR/cN/stage.sh $DIR/cN && source /tmp/vllm-kit/env.sh && python3 /tmp/vllm-kit/site/vllm_kit_check.py && ..."
