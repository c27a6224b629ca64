#!/usr/bin/env python3
"""Check a staged vllm-gpu-kit against the Python it runs under.

On the device, after `source /tmp/vllm-kit/env.sh`:
    python3 /tmp/vllm-kit/site/vllm_kit_check.py            # requirements + imports + GPU
    python3 /tmp/vllm-kit/site/vllm_kit_check.py --no-import # requirements only

1. For every distribution in the kit's site/ folder, every Requires-Dist that applies
   (base requirements plus the extras vLLM asks for) must be met by what Python sees
   first on sys.path (kit first, then the image's site-packages). Packages left out
   of the kit on purpose are listed as 'skipped'; known, harmless pin mismatches
   as 'known'; anything else as MISSING or CONFLICT.
2. Imports vllm, its OpenAI server module and, where a GPU is visible, the CUDA
   extensions, and says which FlashAttention versions are usable.
Exit status 0 when nothing is MISSING/CONFLICT and every import worked.
"""
import argparse
import importlib
import importlib.util
import importlib.metadata as md
import os
import re
import sys
import traceback

try:
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - pip always vendors it
    from pip._vendor.packaging.requirements import Requirement

HERE = os.path.dirname(os.path.abspath(__file__))

# Left out on purpose (see README.md, "Skipped").
SKIPPED = {
    "flashinfer-python": "FlashInfer backend/sampler not used (env.sh sets VLLM_USE_FLASHINFER_SAMPLER=0)",
    "flashinfer-cubin": "FlashInfer cubins",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (FA4, GDN/Qwen3.5, DeepSeek-V4, SM100)",
    "quack-kernels": "CuTe-DSL helpers (same users as nvidia-cutlass-dsl)",
    "tilelang": "mHC TileLang kernels",
    "torchcodec": "video/audio decoding for multimodal inputs",
    "pynvvideocodec": "GPU video decoding",
    "humming-kernels": "optional quantised GEMM kernels",
    "tokenspeed-mla": "MLA kernels for DeepSeek-style models on SM100",
    "fastsafetensors": "optional GDS weight loader (--load-format fastsafetensors)",
    "nvidia-cudnn-frontend": "FlashInfer's cuDNN path",
    "fastapi-cli": "fastapi[standard] command line, unused by vLLM",
    "fastar": "fastapi[standard] deploy archives, unused by vLLM",
    "cryptography": "pyjwt[crypto], only for MCP OAuth",
}
# Requirements that the image does not meet exactly but that do not matter here.
KNOWN = {
    "numba": "vllm pins 0.65.0 (numpy<2.5); the image's numba is used, only by n-gram spec decode",
    "setuptools": "vllm asks <81 for py>3.11; unused at run time",
    "numpy": "mistral-common caps numpy<2.4; image has 2.5.x; only Mistral tokenizers use it",
    "opencv-python-headless": "multimodal image I/O only",
    "torch": "image torch is the one vLLM 0.26.0 was built for (2.11.0)",
    "torchaudio": "audio models only",
    "torchvision": "vision models only",
}
# Extras that vLLM's own requirements turn on.
EXTRAS = {
    "fastapi": {"standard"},
    "uvicorn": {"standard"},
    "mistral-common": {"image"},
    "pydantic-extra-types": {"pycountry"},
    "fastapi-cli": {"standard"},
}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def visible_dists():
    """name -> Distribution that import would find first (sys.path order)."""
    seen = {}
    for d in md.distributions():
        name = d.metadata["Name"]
        if name and norm(name) not in seen:
            seen[norm(name)] = d
    return seen


def dist_dir(d):
    try:
        return os.path.dirname(os.path.abspath(str(d._path)))
    except Exception:
        return "?"


def check_requirements(site):
    site = os.path.abspath(site)
    dists = visible_dists()
    kit = {n: d for n, d in dists.items() if dist_dir(d) == site}
    problems, notes = [], []
    for name, d in sorted(kit.items()):
        extras = {""} | EXTRAS.get(name, set())
        for line in d.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in extras
            ):
                continue
            rn = norm(req.name)
            got = dists.get(rn)
            where = f"{name} {d.version} needs {req}"
            if got is None:
                if rn in SKIPPED:
                    notes.append(f"skipped   {where}: {SKIPPED[rn]}")
                else:
                    problems.append(f"MISSING   {where}")
                continue
            if req.specifier and not req.specifier.contains(got.version, prereleases=True):
                msg = f"{where}, found {got.version} in {dist_dir(got)}"
                if rn in KNOWN:
                    notes.append(f"known     {msg}: {KNOWN[rn]}")
                else:
                    problems.append(f"CONFLICT  {msg}")
    shadow = [
        n for n, d in kit.items()
        if any(dist_dir(o) != site for o in md.distributions(name=d.metadata["Name"]))
    ]
    print(f"kit site: {site} ({len(kit)} distributions)")
    if shadow:
        print("kit copies shadow image packages: " + ", ".join(sorted(shadow)))
    for line in notes:
        print("  " + line)
    for line in problems:
        print("  " + line)
    print(f"requirements: {len(problems)} problem(s), {len(notes)} note(s)")
    return not problems


def versions():
    names = [
        "torch", "triton", "transformers", "tokenizers", "huggingface-hub", "numpy",
        "safetensors", "typing-extensions", "anyio", "httpx", "h11", "click", "protobuf",
        "aiohttp", "pillow", "numba", "packaging", "uvloop", "pydantic", "fastapi",
        "openai", "xgrammar", "vllm",
    ]
    dists = visible_dists()
    out = []
    for n in names:
        d = dists.get(norm(n))
        out.append(f"{n}={d.version if d else '-'}")
    print("versions: " + " ".join(out))


def check_imports():
    ok = True

    def attempt(label, fn):
        nonlocal ok
        try:
            res = fn()
            print(f"  ok    {label}" + (f": {res}" if res not in (None, "") else ""))
        except Exception as e:  # noqa: BLE001
            ok = False
            print(f"  FAIL  {label}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=3, file=sys.stdout)

    print("imports:")
    attempt("import vllm", lambda: importlib.import_module("vllm").__version__)
    attempt("from vllm import LLM, SamplingParams", lambda: getattr(importlib.import_module("vllm"), "LLM") and None)
    attempt("vllm.entrypoints.cli.main", lambda: importlib.import_module("vllm.entrypoints.cli.main") and None)
    attempt("vllm.entrypoints.openai.api_server",
            lambda: importlib.import_module("vllm.entrypoints.openai.api_server") and None)
    for mod in ("xgrammar", "llguidance", "outlines_core", "openai_harmony", "zmq", "msgspec", "blake3"):
        attempt(f"import {mod}", lambda mod=mod: importlib.import_module(mod) and None)

    import torch

    try:
        if not torch.cuda.is_available():
            print("  (no CUDA device visible: skipping CUDA extension checks)")
            return ok
        cap = torch.cuda.get_device_capability()
        print(f"  gpu   {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch cuda {torch.version.cuda}")
    except Exception as e:  # noqa: BLE001
        print(f"  FAIL  CUDA initialisation: {type(e).__name__}: {e}")
        return False
    attempt("vllm._C_stable_libtorch", lambda: importlib.import_module("vllm._C_stable_libtorch") and None)
    if importlib.util.find_spec("vllm._moe_C_stable_libtorch") is None:
        print("  note  vllm._moe_C_stable_libtorch absent: the MoE add-on (moe-00) is not staged; dense models are fine")
    else:
        attempt("vllm._moe_C_stable_libtorch", lambda: importlib.import_module("vllm._moe_C_stable_libtorch") and None)

    def fa():
        from vllm.vllm_flash_attn import flash_attn_interface as f

        return (f"FA2_AVAILABLE={f.FA2_AVAILABLE} FA3_AVAILABLE={f.FA3_AVAILABLE} "
                f"fa3_supported={f.is_fa_version_supported(3)} "
                f"fa3_reason={f.fa_version_unsupported_reason(3)}")

    attempt("vllm.vllm_flash_attn", fa)

    def platform():
        from vllm.platforms import current_platform

        return f"{type(current_platform).__name__} device_name={current_platform.get_device_name()}"

    attempt("vllm.platforms.current_platform", platform)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default=HERE, help="the kit's site folder (default: this file's folder)")
    ap.add_argument("--no-import", action="store_true", help="only check requirements")
    args = ap.parse_args()
    if os.path.abspath(args.site) not in [os.path.abspath(p) for p in sys.path if p]:
        sys.path.insert(0, os.path.abspath(args.site))
        print(f"note: {args.site} was not on sys.path (source env.sh first); added it for this check")
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    versions()
    ok = check_requirements(args.site)
    if not args.no_import:
        ok = check_imports() and ok
    print("KIT CHECK " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
