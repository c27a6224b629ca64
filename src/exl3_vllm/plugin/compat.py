"""Everything that differs between the vLLM versions we support (run on 0.25, 0.26 and 0.32; 0.25-0.34 checked)."""

from __future__ import annotations

import vllm

VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2] if p.isdigit())
# The releases whose sources tools/vllm_api_check.py passes (docs/vllm-api.md); pyproject's gpu extra asks for these.
CHECKED = ((0, 25), (0, 34))


def version_note() -> str | None:
    """None for a checked vLLM release, else the warning to log once."""
    (lo, hi), v = CHECKED, VLLM_VERSION[:2]
    if lo <= v <= hi:
        return None
    return (f"vLLM {vllm.__version__} is outside the releases exl3-vllm was checked against ({lo[0]}.{lo[1]} to "
            f"{hi[0]}.{hi[1]}); it may still work. If loading fails, include `exl3-vllm doctor` in the report.")


def unquantized_linear_method():
    """UnquantizedLinearMethod() (0.32's constructor reads the current vLLM config)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return UnquantizedLinearMethod()


def concurrent_streams() -> list:
    """The streams vLLM runs layers on while the main stream runs others: its auxiliary stream, where a MoE layer's
    shared experts run beside the routed ones (up to VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD tokens)."""
    try:
        from vllm.utils.torch_utils import aux_stream
    except ImportError:  # pragma: no cover - a release without it runs shared experts on the main stream
        return []
    stream = aux_stream()
    return [] if stream is None else [stream]


def routed_experts_class():
    """The MoE experts layer type (a factory in 0.25 named FusedMoE; RoutedExperts in both)."""
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
    except ImportError:  # pragma: no cover - older releases
        return None
    return RoutedExperts


# ---- MoE (RoutedExperts) attributes, as 0.32 names them (docs/vllm-api.md); getattr defaults where one may lack them
def moe_config(layer):
    """The layer's FusedMoEConfig (FusedMoEMethodBase's constructor argument)."""
    return layer.moe_config


def moe_tp(layer) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split of every expert's intermediate dimension."""
    pc = layer.moe_config.moe_parallel_config
    return int(pc.tp_rank), int(pc.tp_size)


def moe_activation(layer) -> str:
    """The activation name ("silu", ...): an enum in 0.32 (MoEActivation), a string before."""
    act = getattr(layer, "activation", None) or getattr(layer.moe_config, "activation", "silu")
    return str(getattr(act, "value", act)).lower()


def moe_is_gated(layer) -> bool:
    return bool(getattr(layer.moe_config, "is_act_and_mul", True))


def moe_ckpt_names(layer) -> tuple[str, str | None, str]:
    """Checkpoint names of (gate, up, down): gate_proj/up_proj/down_proj, or Mixtral's w1/w3/w2 (up is None
    for a non-gated activation)."""
    return (getattr(layer, "ckpt_gate_proj_name", "gate_proj"), getattr(layer, "ckpt_up_proj_name", "up_proj"),
            getattr(layer, "ckpt_down_proj_name", "down_proj"))


def moe_num_logical_experts(layer) -> int:
    """Experts stored in the checkpoint (0.32 adds EPLB's redundant copies on top of these)."""
    return int(getattr(layer.moe_config, "num_logical_experts", None) or layer.global_num_experts)


def moe_expert_map(layer):
    """Global -> local expert id map (-1: not on this rank), or None without expert parallelism."""
    return getattr(layer, "expert_map", None)


def moe_local_expert(layer, global_id: int) -> int:
    return int(layer._map_global_expert_id_to_local_expert_id(int(global_id)))


def moe_top_k(layer) -> int:
    """Experts each token is routed to."""
    return int(getattr(layer.moe_config, "experts_per_token", None) or getattr(layer, "top_k"))
