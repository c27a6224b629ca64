#!/usr/bin/env bash
# Build the offline vLLM 0.26.0 kit for the lent H100/H200 machines (cp312, x86_64).
#
#   bash build.sh            # download -> unpack -> trim -> pack -> split
#
# Everything large lives under $VKIT_BUILD_DIR (default /tmp/vllm-kit-build-026; the
# shared 0.25.0 kit uses /tmp/vllm-kit-build, so both builds can coexist):
#   cache/  downloaded wheels (kept between runs)
#   site/   the unpacked staging tree that becomes /tmp/vllm-kit/site on the device
#   out/    part-00, part-01, ... (core kit) and moe-00 (optional MoE add-on), each
#           <= $VKIT_PART_MIB MiB, SHA256SUMS, SUMMARY.txt, plus copies of stage.sh,
#           env.sh, kit_check.py, tiny_model.py, smoke.sh and carry_prep.sh
# Idempotent: wheels already in cache/ are not fetched again, and when the inputs
# (packages.txt, the kit's scripts, options, wheel names) are unchanged and out/
# verifies, nothing is rebuilt. Set VKIT_FORCE=1 to rebuild anyway.
#
# Options (environment):
#   VKIT_BUILD_DIR  build folder                                   (/tmp/vllm-kit-build-026)
#   VKIT_PART_MIB   max part size in MiB                           (44: part + a ~14 MB
#                   working tree must fit one 64 MiB carry)
#   VKIT_KEEP_FA2   1 = keep vllm_flash_attn/_vllm_fa2_C.abi3.so   (0; 291 MiB unpacked in 0.26.0)
#   VKIT_MOE_ADDON  1 = pack vllm/_moe_C_stable_libtorch.abi3.so (MoE-only kernels,
#                   ~38 MiB packed) as a separate add-on, parts moe-NN (1);
#                   0 = leave it in the core archive
#   VKIT_COMPRESS   zstd | xz | auto (auto = zstd if installed, else xz)
#   VKIT_SEED_DIRS  folders searched for already downloaded wheels (none by default;
#                   e.g. /tmp/vllm-kit-build/cache, the 0.25.0 build's wheels)
#   VKIT_FORCE      1 = rebuild site/ and out/ even if up to date
#   PYTHON          python used for pip and helpers                (python3)
set -euo pipefail

KIT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BUILD_DIR=${VKIT_BUILD_DIR:-/tmp/vllm-kit-build-026}
CACHE=$BUILD_DIR/cache
SITE=$BUILD_DIR/site
OUT=$BUILD_DIR/out
PART_MIB=${VKIT_PART_MIB:-44}
KEEP_FA2=${VKIT_KEEP_FA2:-0}
MOE_ADDON=${VKIT_MOE_ADDON:-1}
COMPRESS=${VKIT_COMPRESS:-auto}
SEED_DIRS=${VKIT_SEED_DIRS:-}
FORCE=${VKIT_FORCE:-0}
PY=${PYTHON:-python3}
PKG_LIST=$KIT_DIR/packages.txt

# pip platform tags: the brief's base set; EXTRA is tried only for wheels that need it
# (llguidance 1.7.6 ships only manylinux_2_31). All are <= glibc 2.31 (device: Ubuntu 24.04, glibc 2.39).
BASE_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
                manylinux2014_x86_64 manylinux1_x86_64 any)
EXTRA_PLATFORMS=(manylinux_2_31_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64
                 manylinux_2_18_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64)

log() { printf '[build] %s\n' "$*" >&2; }
die() { printf '[build] ERROR: %s\n' "$*" >&2; exit 1; }

for t in unzip tar split sha256sum; do command -v "$t" >/dev/null || die "needs '$t'"; done
if [[ $COMPRESS == auto ]]; then
  if command -v zstd >/dev/null; then COMPRESS=zstd; else COMPRESS=xz; fi
fi
case $COMPRESS in
  zstd) command -v zstd >/dev/null || die "zstd not installed"; EXT=tar.zst ;;
  xz)   command -v xz   >/dev/null || die "xz not installed";   EXT=tar.xz ;;
  *) die "VKIT_COMPRESS must be zstd, xz or auto" ;;
esac

mkdir -p "$CACHE" "$OUT"
mapfile -t SPECS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$PKG_LIST" | grep -v '^$')
(( ${#SPECS[@]} > 0 )) || die "no packages in $PKG_LIST"

# ---------------------------------------------------------------- 1. download
# find_wheel NAME==VERSION -> path of the matching wheel in cache/ (normalised name)
find_wheel() {
  "$PY" - "$CACHE" "$1" <<'EOF'
import os, re, sys
cache, spec = sys.argv[1], sys.argv[2]
name, ver = spec.split("==")
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
hits = []
for f in sorted(os.listdir(cache)):
    if not f.endswith(".whl"):
        continue
    p = f[:-4].split("-")
    if len(p) >= 5 and norm(p[0]) == norm(name) and p[1] == ver:
        hits.append(os.path.join(cache, f))
if len(hits) > 1:
    sys.exit("several wheels for %s: %s" % (spec, hits))
print(hits[0] if hits else "")
EOF
}

pip_download() {  # pip_download quiet|loud SPEC PLATFORM...
  local mode=$1 spec=$2; shift 2
  local args=()
  for p in "$@"; do args+=(--platform "$p"); done
  local cmd=("$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all:
             --python-version 3.12 --implementation cp "${args[@]}" -d "$CACHE" "$spec")
  if [[ $mode == quiet ]]; then "${cmd[@]}" 2>/dev/null
  else "${cmd[@]}" 2> >(grep -v "^WARNING: Location" >&2); fi
}

WHEELS=()
for spec in "${SPECS[@]}"; do
  [[ $spec == *==* ]] || die "not pinned: $spec"
  whl=$(find_wheel "$spec")
  if [[ -z $whl ]]; then
    name=${spec%%==*}; ver=${spec##*==}
    for d in $SEED_DIRS; do   # reuse a wheel someone already downloaded
      for f in "$d"/*.whl; do
        [[ -f $f ]] || continue
        b=$(basename "$f")
        if [[ ${b%%-*} == "${name//-/_}" && $(cut -d- -f2 <<<"$b") == "$ver" ]]; then
          log "seed $b from $d"; cp -n "$f" "$CACHE/"
        fi
      done
    done
    whl=$(find_wheel "$spec")
  fi
  if [[ -z $whl ]]; then
    log "download $spec"
    pip_download quiet "$spec" "${BASE_PLATFORMS[@]}" ||
      { log "retry $spec with extra manylinux tags"; pip_download loud "$spec" "${BASE_PLATFORMS[@]}" "${EXTRA_PLATFORMS[@]}"; } ||
      die "could not download $spec"
    whl=$(find_wheel "$spec")
    [[ -n $whl ]] || die "downloaded $spec but found no wheel in $CACHE"
  fi
  WHEELS+=("$whl")
done
log "${#WHEELS[@]} wheels ready in $CACHE"

# ---------------------------------------------------------------- up to date?
# The stamp covers what goes INTO the archives; the carry-side scripts (stage.sh,
# env.sh, carry_prep.sh) are re-copied to out/ on every run.
CARRY_FILES=(stage.sh env.sh carry_prep.sh kit_check.py tiny_model.py smoke.sh)
copy_carry_files() {
  for f in "${CARRY_FILES[@]}"; do cp "$KIT_DIR/$f" "$OUT/"; done
  chmod +x "$OUT/stage.sh" "$OUT/carry_prep.sh" "$OUT/smoke.sh"
}
STAMP=$( { cat "$PKG_LIST" "$KIT_DIR/build.sh" "$KIT_DIR/kit_check.py" "$KIT_DIR/tiny_model.py" "$KIT_DIR/smoke.sh";
           echo "fa2=$KEEP_FA2 moe_addon=$MOE_ADDON part=$PART_MIB compress=$COMPRESS";
           for w in "${WHEELS[@]}"; do basename "$w"; done; } | sha256sum | cut -c1-16)
if [[ $FORCE != 1 && -f $OUT/STAMP && $(cat "$OUT/STAMP") == "$STAMP" && -f $OUT/SHA256SUMS ]] &&
   (cd "$OUT" && grep -E ' (part|moe)-' SHA256SUMS | sha256sum --quiet -c -); then
  copy_carry_files
  log "out/ is up to date (stamp $STAMP); set VKIT_FORCE=1 to rebuild"
  cat "$OUT/SUMMARY.txt" 2>/dev/null || true
  exit 0
fi

# ---------------------------------------------------------------- 2. unpack
STAGE=$BUILD_DIR/site.new
rm -rf "$STAGE" "$BUILD_DIR/unpack.tmp"
mkdir -p "$STAGE"
for whl in "${WHEELS[@]}"; do
  tmp=$BUILD_DIR/unpack.tmp
  rm -rf "$tmp"; mkdir -p "$tmp"
  unzip -q -o "$whl" -d "$tmp"
  for data in "$tmp"/*.data; do
    [[ -d $data ]] || continue
    for sub in purelib platlib; do
      [[ -d $data/$sub ]] && cp -a "$data/$sub/." "$tmp/"
    done
    rm -rf "$data"   # scripts/, headers/, data/ are not needed (no console scripts, no C headers)
  done
  cp -a "$tmp/." "$STAGE/"
  rm -rf "$tmp"
done
du_mib() { du -sm "$1" | cut -f1; }
log "unpacked: $(du_mib "$STAGE") MiB"

# ---------------------------------------------------------------- 3. trim
TRIM_LOG=$BUILD_DIR/trim.log
: > "$TRIM_LOG"
trim() {  # trim PATH-or-glob WHY   (relative to site)
  local why=$2 p found=0
  for p in $STAGE/$1; do
    [[ -e $p ]] || continue
    found=1
    printf '%8s  %s  (%s)\n' "$(du -sh "$p" | cut -f1)" "${p#"$STAGE"/}" "$why" >> "$TRIM_LOG"
    rm -rf "$p"
  done
  (( found )) || log "note: nothing to trim at $1"
}
if [[ $KEEP_FA2 != 1 ]]; then
  # FA2 kernels (sm80+). On sm90 fa_utils.get_flash_attn_version() picks FA3 when
  # _vllm_fa3_C imports; FA2 is needed only for ALiBi models / VLLM_BATCH_INVARIANT + FA4.
  trim 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'FA2; sm90 (H100/H200) uses FA3'
fi
trim 'vllm/vllm-rs' 'Rust frontend, only with VLLM_USE_RUST_FRONTEND=1'
trim 'vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so' 'DeepGEMM for other Pythons'
trim 'vllm/third_party/fmha_sm100/cutlass' 'CUTLASS headers for the SM100-only MiniMax-M3 JIT'
trim 'xgrammar/lib' 'static libxgrammar.a (link-time only)'
trim 'xgrammar/include' 'C++ headers (build-time only)'
trim 'pycountry/locales' 'translations, unused by pydantic-extra-types/mistral-common'
trim 'pycountry/tests' 'tests'
trim 'mistral_common/data/tekken_2407*.json' 'bundled demo tokenizers; models ship their own'
trim 'mistral_common/data/tekken_2409*.json' 'bundled demo tokenizers; models ship their own'
find "$STAGE" -name __pycache__ -type d -prune -exec rm -rf {} +
log "trimmed: $(du_mib "$STAGE") MiB left"
cat "$TRIM_LOG" >&2

# ---------------------------------------------------------------- 4. launcher, check, manifest
cat > "$STAGE/vllm_kit_cli.py" <<'EOF'
"""Run vLLM's command line without console-script entry points.

    python3 /tmp/vllm-kit/site/vllm_kit_cli.py serve MODEL [args]   ==  vllm serve MODEL [args]
"""
import sys

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
EOF
cp "$KIT_DIR/kit_check.py" "$STAGE/vllm_kit_check.py"
cp "$KIT_DIR/tiny_model.py" "$STAGE/vllm_kit_tiny_model.py"
cp "$KIT_DIR/smoke.sh" "$STAGE/vllm_kit_smoke.sh"
{
  echo "# vllm-gpu-kit manifest (stamp $STAMP, built $(date -u +%Y-%m-%dT%H:%M:%SZ))"
  for w in "${WHEELS[@]}"; do basename "$w"; done
} > "$STAGE/vllm_kit_manifest.txt"
cp "$TRIM_LOG" "$STAGE/vllm_kit_trimmed.txt"

# ---------------------------------------------------------------- 5. split off the MoE add-on
ADDON_DIR=$BUILD_DIR/addon-moe
rm -rf "$ADDON_DIR"
if [[ $MOE_ADDON == 1 ]]; then
  # Only MoE models call torch.ops._moe_C (topk_softmax, moe_align_block_size, ...);
  # vllm/platforms/cuda.py imports it under contextlib.suppress(ImportError).
  mkdir -p "$ADDON_DIR/site/vllm"
  mv "$STAGE/vllm/_moe_C_stable_libtorch.abi3.so" "$ADDON_DIR/site/vllm/"
fi

rm -rf "$SITE"
mv "$STAGE" "$SITE"

# ---------------------------------------------------------------- 6. pack and split
pack() {  # pack SRC_PARENT ARCHIVE : tar SRC_PARENT/site into ARCHIVE
  local parent=$1 archive=$2
  local tarcmd=(tar -C "$parent" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - site)
  if [[ $COMPRESS == zstd ]]; then
    "${tarcmd[@]}" | zstd -19 -T0 -q -f -o "$archive.tmp"
  else
    "${tarcmd[@]}" | xz -9 -T0 -c > "$archive.tmp"
  fi
  mv "$archive.tmp" "$archive"
}
rm -f "$OUT"/part-* "$OUT"/moe-* "$OUT/SHA256SUMS" "$OUT/STAMP" "$OUT/SUMMARY.txt" "$BUILD_DIR"/vllm-kit*.tar.*
ARCHIVES=("$BUILD_DIR/vllm-kit.$EXT")
log "packing core with $COMPRESS (a few minutes on 2 cores)"
pack "$BUILD_DIR" "${ARCHIVES[0]}"
split -b "${PART_MIB}M" -d -a 2 "${ARCHIVES[0]}" "$OUT/part-"
if [[ $MOE_ADDON == 1 ]]; then
  ARCHIVES+=("$BUILD_DIR/vllm-kit-moe.$EXT")
  log "packing MoE add-on"
  pack "$ADDON_DIR" "${ARCHIVES[1]}"
  split -b "${PART_MIB}M" -d -a 2 "${ARCHIVES[1]}" "$OUT/moe-"
fi
(
  cd "$OUT"
  sha256sum part-* $( [[ $MOE_ADDON == 1 ]] && echo moe-*) > SHA256SUMS
  cd "$BUILD_DIR" && for a in "${ARCHIVES[@]}"; do sha256sum "$(basename "$a")"; done >> "$OUT/SHA256SUMS"
)
copy_carry_files

mib() { echo $(( ($1 + 1048575) / 1048576 )); }
{
  echo "vllm-gpu-kit stamp $STAMP ($COMPRESS, parts <= $PART_MIB MiB)"
  echo "site unpacked: $(du_mib "$SITE") MiB core$( [[ $MOE_ADDON == 1 ]] && echo " + $(du_mib "$ADDON_DIR/site") MiB MoE add-on"), ${#WHEELS[@]} wheels"
  for a in "${ARCHIVES[@]}"; do
    sz=$(stat -c %s "$a"); echo "archive $(basename "$a"): $sz bytes ($(mib "$sz") MiB)"
  done
  total=0; for a in "${ARCHIVES[@]}"; do total=$(( total + $(stat -c %s "$a") )); done
  echo "total: $total bytes ($(mib "$total") MiB) in $(ls "$OUT"/part-* "$OUT"/moe-* 2>/dev/null | wc -l) parts"
  ls -l "$OUT"/part-* "$OUT"/moe-* 2>/dev/null | awk '{n=$NF; sub(".*/", "", n); printf "  %s %d bytes\n", n, $5}'
} | tee "$OUT/SUMMARY.txt"
echo "$STAMP" > "$OUT/STAMP"
log "done: $OUT"
