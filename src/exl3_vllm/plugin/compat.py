"""Everything that differs between the vLLM versions we support (0.25 and 0.32)."""

from __future__ import annotations

import vllm

VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2] if p.isdigit())


def unquantized_linear_method():
    """UnquantizedLinearMethod() (0.32's constructor reads the current vLLM config)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return UnquantizedLinearMethod()


def routed_experts_class():
    """The MoE experts layer type (a factory in 0.25 named FusedMoE; RoutedExperts in both)."""
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
    except ImportError:  # pragma: no cover - older releases
        return None
    return RoutedExperts
