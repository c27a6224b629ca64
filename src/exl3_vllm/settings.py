"""Every EXL3_VLLM_* environment variable, declared once: its default, how it is read, what it does, and whether the
measured dispatch's cache depends on it. Modules read them only through get(); README's tables list the same set
(tests/test_settings.py checks both)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


class SettingError(ValueError):
    """An EXL3_VLLM_* variable holds a value it cannot take."""


def _on(v: str) -> bool:
    return v != "0"


def _true(v: str) -> bool:
    return v not in ("", "0", "false", "False")


def _choice(*names: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v.lower() not in names:
            raise ValueError(f"not one of {', '.join(names)}")
        return v.lower()
    return parse


def _int(v: str) -> int:
    return int(v)


def _opt_int(v: str) -> int | None:
    return int(v) if v else None


def _text(v: str) -> str:
    return v


def _names(v: str) -> frozenset[str]:
    return frozenset(i.strip().lower() for i in v.split(",") if i.strip())


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    parse: Callable[[str], Any]
    doc: str
    developer: bool = False  # a knob for measuring and debugging the kernels, not for serving
    keys_tune: bool = False  # the measured dispatch's timings depend on it: part of its cache key
    keys_call: bool = False  # the linear op's per-shape launch recipe depends on it: part of that cache's key


_ALL = (
    Setting("EXL3_VLLM_BACKEND", "auto", _choice("auto", "kernels", "reference"),
            "auto: our kernels on CUDA, the format reference elsewhere; reference: the reference on any device"),
    Setting("EXL3_VLLM_DETERMINISTIC", "0", _true, "no atomics in split-k: bit-identical results run to run",
            keys_call=True),
    Setting("EXL3_VLLM_DEBUG_NAMES", "0", _true, "log the checkpoint modules found for every vLLM layer"),
    Setting("EXL3_VLLM_CACHE_DIR", "", _text, "where compiled kernels and tuning tables go (default "
            "$XDG_CACHE_HOME/exl3_vllm, else ~/.cache/exl3_vllm)"),
    Setting("EXL3_VLLM_TUNE", "1", _on, "0: skip the measured dispatch and use the static plan", keys_call=True),
    Setting("EXL3_VLLM_DISABLE", "", _names, "kernel features left out of the dispatch, static and measured (cached "
            "choices included), comma-separated: tier names or globs (i* the mul1 int8 tiers, w* and x* the Hopper "
            "wgmma tiers, x* only their warp-specialized ones; a name covers its k8 and n twins), streamk, "
            "streamk-dp (stream-k shares out only the last wave), pdl (programmatic dependent launch)",
            keys_tune=True, keys_call=True),
    Setting("EXL3_VLLM_TIER", "", _text, "force a tier (or 'dequant', which also sends bf16 MoE experts to dense "
            "weights and grouped GEMMs), with ':fixed' or ':s<N>'", developer=True, keys_call=True),
    Setting("EXL3_VLLM_SPLITS", "", _opt_int, "force the split-k factor", developer=True, keys_call=True),
    Setting("EXL3_VLLM_LARGE_M", "128", _int, "rows above which the static plan takes dequantize + cuBLAS",
            developer=True, keys_call=True),
    Setting("EXL3_VLLM_DEQUANT_BYTES", str(128 << 20), _int, "bytes of the large-M path's weight scratch",
            developer=True, keys_call=True),
    Setting("EXL3_VLLM_FUSED_INPUT", "32", _text, "h8/h16 transform their own rows of x up to this many pieces "
            "per slot (32: bench/results/2026-12-04b-fused-input-h200.md); 0: never; all: wherever x fits",
            developer=True, keys_tune=True, keys_call=True),
    Setting("EXL3_VLLM_TUNE_SPLITS", "512", _int, "the largest row bucket also timed at other split-k factors "
            "(0: none)", developer=True, keys_tune=True),
    Setting("EXL3_VLLM_EXTRA_DEFINES", "", _text, "NAME=V,... preprocessor defines added to every kernel compile",
            developer=True, keys_call=True),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}
_CALL_KEYED = tuple(s.name for s in _ALL if s.keys_call)
_CALL_KEYED_ENCODED = tuple(map(getattr(os.environ, "encodekey", str), _CALL_KEYED))
# Switches that EXL3_VLLM_DISABLE replaced: set to "0" they are refused with the new spelling, not ignored.
RETIRED = {"EXL3_VLLM_INT8": "i4,i8", "EXL3_VLLM_WGMMA": "w*,x*", "EXL3_VLLM_WS": "x*",
           "EXL3_VLLM_STREAMK": "streamk", "EXL3_VLLM_STREAMK_DP": "streamk-dp", "EXL3_VLLM_PDL": "pdl"}


def raw(name: str) -> str:
    """The variable's text, or its default."""
    return os.environ.get(name, SETTINGS[name].default)


def check_retired() -> None:
    """A replaced switch set to anything but its old default ("1") is refused with the spelling to use."""
    old = next((n for n in RETIRED if os.environ.get(n, "1") != "1"), None)
    if old is not None:
        raise SettingError(f"{old} is no longer read: set EXL3_VLLM_DISABLE={RETIRED[old]} instead (with any other "
                           "items, comma-separated)")


def get(name: str) -> Any:
    """The variable's value, parsed; a value it cannot take raises SettingError naming it."""
    s = SETTINGS[name]
    v = raw(name)
    try:
        return s.parse(v)
    except ValueError as e:
        raise SettingError(f"{name}={v!r} is not valid ({e or 'expected ' + s.parse.__name__.strip('_')}): "
                           f"{s.doc}") from None


def call_key() -> tuple:
    """The raw values of the settings marked keys_call, read once each: what a cached launch recipe depends on."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        # os.environ.get encodes each name on every read (6.5 µs for these nine, per op call); its store is read as is.
        return tuple(map(data.get, _CALL_KEYED_ENCODED))
    return tuple(map(os.environ.get, _CALL_KEYED))


def tune_digest() -> str:
    """The values the measured dispatch's timings depend on, as text for its cache key."""
    return ";".join(f"{s.name[10:]}={raw(s.name)}" for s in _ALL if s.keys_tune)
