# Sourced on the GPU machine by every serve_gpu script, from the repo root, once the kit is staged.
# Puts vLLM (the kit) and our package on PYTHONPATH; caches live in /tmp so later warm calls reuse them.
VKIT_ROOT=${VKIT_ROOT:-/tmp/vllm-kit}
if [ ! -f "$VKIT_ROOT/READY" ] || [ ! -f "$VKIT_ROOT/env.sh" ]; then
  echo "NO KIT: $VKIT_ROOT is not staged (the machine went cold?); start again at the c0 call"
  return 3 2>/dev/null || exit 3
fi
source "$VKIT_ROOT/env.sh"
export OUT=${OUT:-/tmp/serve-out}; mkdir -p "$OUT"
# A copy of src/ plus a hand-written dist-info: vLLM finds plugins by entry point, so no pip or setuptools is needed.
PLUG=${EXL3_PLUGIN_DIR:-/tmp/exl3-plugin}  # a detached job keeps its own copy: a later call re-makes this one
# EXL3_SRC: another tree's src/ (e.g. `git archive OLD src | tar -x -C .dev/old`, carried) for a served A/B.
rm -rf "$PLUG" && mkdir -p "$PLUG/exl3_vllm-0.1.0.dist-info" && cp -r "${EXL3_SRC:-src}/exl3_vllm" "$PLUG/"
python3 - "$PLUG/exl3_vllm-0.1.0.dist-info" <<'EOF'
import sys, tomllib
d, p = sys.argv[1], tomllib.load(open("pyproject.toml", "rb"))["project"]
open(f"{d}/METADATA", "w").write(f"Metadata-Version: 2.1\nName: {p['name']}\nVersion: {p['version']}\n")
groups = dict(p.get("entry-points", {}), console_scripts=p.get("scripts", {}))
open(f"{d}/entry_points.txt", "w").write("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) + "\n"
                                                 for g, e in groups.items()))
EOF
export PYTHONPATH="$PLUG:$PYTHONPATH" VLLM_PLUGINS=exl3
# NVRTC cubins of our kernels: /tmp survives between warm calls, so later calls skip the compiles.
export XDG_CACHE_HOME=/tmp/exl3cache
