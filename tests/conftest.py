"""Shared test set-up: import from src/ when the package is not installed; the gpu marker; one NVRTC cache per run."""

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("exl3_vllm") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
# Test helper modules (ckpt_builder) sit next to the tests.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def nvrtc_cache(tmp_path_factory):
    """One fresh NVRTC cache for the whole run: the compile check fills it, the SASS budgets read the same modules."""
    return os.environ.get("EXL3_VLLM_CACHE_DIR") or str(tmp_path_factory.mktemp("nvrtc"))


@pytest.fixture
def progress(request):
    """Write a line past pytest's capture, so a long test shows where it is."""
    cap = request.config.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:
        with cap.global_and_fixture_disabled():
            print(f"\n    {request.node.name}: {line}", end="", flush=True)
    return say
