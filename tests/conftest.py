"""Shared test set-up: import from src/ when the package is not installed; the gpu marker."""

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
