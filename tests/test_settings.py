"""settings.py is the one home of every EXL3_VLLM_* variable: the code reads no other, README documents each in the
right table, a bad value is refused by name, and every variable the timings depend on keys the tune cache."""

import os
import re

import pytest

from exl3_vllm import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "exl3_vllm")


def _sources():
    for d, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                yield os.path.relpath(path, SRC), open(path).read()


def test_the_code_reads_only_declared_variables_and_only_through_settings():
    named = set()
    for rel, text in _sources():
        found = set(re.findall(r"EXL3_VLLM_[A-Z0-9_]+", text))
        named |= found
        if rel != "settings.py":
            assert not re.search(r"environ(?:\.get)?[\[(]\s*f?[\"']EXL3_VLLM_", text), f"{rel} reads EXL3_VLLM_* itself"
            assert not found & set(settings.RETIRED), (rel, found & set(settings.RETIRED))
    assert named == set(settings.SETTINGS) | set(settings.RETIRED), named ^ set(settings.SETTINGS)


def test_readme_documents_each_in_its_table():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("### Environment variables"):readme.index("### Troubleshooting")]
    user, dev = section.split("For kernel development")
    for s in settings.SETTINGS.values():
        assert f"`{s.name}" in (dev if s.developer else user), f"{s.name} belongs in the {'developer' if s.developer else 'user'} table"


def test_defaults_parse_and_bad_values_are_refused_by_name(monkeypatch):
    for name in settings.SETTINGS:
        monkeypatch.delenv(name, raising=False)
        settings.get(name)
    assert settings.get("EXL3_VLLM_BACKEND") == "auto" and settings.get("EXL3_VLLM_LARGE_M") == 128
    assert settings.get("EXL3_VLLM_SPLITS") is None and settings.get("EXL3_VLLM_TUNE") is True
    monkeypatch.setenv("EXL3_VLLM_BACKEND", "Reference")
    assert settings.get("EXL3_VLLM_BACKEND") == "reference"
    for name, bad in (("EXL3_VLLM_BACKEND", "gpu"), ("EXL3_VLLM_LARGE_M", "lots"), ("EXL3_VLLM_SPLITS", "two")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(settings.SettingError, match=f"{name}='{bad}'"):
            settings.get(name)


def test_every_variable_the_timings_depend_on_keys_the_tune_cache(monkeypatch):
    from exl3_vllm.kernels import tune

    keyed = [s for s in settings.SETTINGS.values() if s.keys_tune]
    assert {s.name for s in keyed} >= {"EXL3_VLLM_DISABLE", "EXL3_VLLM_FUSED_INPUT", "EXL3_VLLM_TUNE_SPLITS"}
    for s in keyed:
        monkeypatch.delenv(s.name, raising=False)
    tag = tune.tier_set_tag()
    for s in keyed:
        monkeypatch.setenv(s.name, "0" if s.default != "0" else "1")
        assert tune.tier_set_tag() != tag, s.name
        monkeypatch.delenv(s.name)
    assert tune.tier_set_tag() == tag
