"""The wheel users get from `pip install exl3-vllm`: it carries the CUDA sources the kernels compile at run time,
the `exl3-vllm` command, the entry point vLLM finds the plugin by and the package metadata (Python and vLLM ranges);
installed beside vLLM, vLLM finds it. The source distribution carries the CUDA sources too."""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_has_the_kernel_sources_and_the_entry_points(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src-tree"  # a copy: the build leaves build/ and *.egg-info where it runs
    shutil.copytree(os.path.join(ROOT, "src"), src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md", "LICENSE", "NOTICE"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = glob.glob(str(tmp_path / "exl3_vllm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    cuda = {os.path.basename(n) for n in names if n.startswith("exl3_vllm/kernels/cuda/")}
    want = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "src/exl3_vllm/kernels/cuda/*.cu*"))}
    assert want and want <= cuda, want - cuda
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "[vllm.general_plugins]" in text and "exl3 = exl3_vllm.plugin:register" in text
    assert "exl3-vllm = exl3_vllm.cli:main" in text
    assert not [n for n in names if n.startswith(("tests/", "bench/", "tools/"))]
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Python: >=3.10" in meta and "License-Expression: MIT" in meta
    # The GPU extra asks for the vLLM range that tools/vllm_api_check.py passes (docs/vllm-api.md, compat.CHECKED).
    assert "Provides-Extra: gpu" in meta and 'Requires-Dist: vllm<0.35,>=0.25; extra == "gpu"' in meta, meta
    if importlib.util.find_spec("vllm") is not None:
        from exl3_vllm.plugin import compat
        assert compat.CHECKED == ((0, 25), (0, 34)), "update pyproject's gpu extra with compat.CHECKED"
    # The source distribution carries the CUDA sources and the notices too.
    from setuptools import build_meta
    cwd = os.getcwd()
    try:
        os.chdir(src)
        sdist = os.path.join(src, "dist", build_meta.build_sdist("dist"))
    finally:
        os.chdir(cwd)
    with tarfile.open(sdist) as t:
        members = {os.path.relpath(m, t.getnames()[0].split("/")[0]) for m in t.getnames()}
    assert {f"src/exl3_vllm/kernels/cuda/{w}" for w in want} | {"LICENSE", "NOTICE", "pyproject.toml"} <= members
    # Installed from the wheel beside vLLM, vLLM's own plugin loading finds "exl3" (no flags, no source tree).
    pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    smoke = ("import exl3_vllm, sys; assert exl3_vllm.__file__.startswith(sys.argv[1]), exl3_vllm.__file__\n"
             "from vllm.plugins import load_general_plugins\n"
             "from vllm.model_executor.layers.quantization import get_quantization_config\n"
             "load_general_plugins(); print('FOUND', get_quantization_config('exl3').__name__)")
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1")
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-c", smoke, str(site)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=str(tmp_path))
    assert proc.returncode == 0 and "FOUND Exl3Config" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
