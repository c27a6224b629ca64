"""HF config.json dicts for the built-in presets (written out here: nothing is fetched)."""

from __future__ import annotations

import copy
import json
import os

from ..format.errors import Exl3FormatError

_TINY_COMMON = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "max_position_embeddings": 512,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 1024,
}


def _tiny(**kw) -> dict:
    d = dict(_TINY_COMMON)
    d.update(kw)
    return d


PRESETS: dict[str, dict] = {
    "tiny-llama": _tiny(
        architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=512, mlp_bias=False,
        pretraining_tp=1, rope_scaling=None,
    ),
    "tiny-qwen2": _tiny(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", intermediate_size=512,
        max_window_layers=2, sliding_window=None, use_sliding_window=False,
    ),
    "tiny-qwen3": _tiny(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=512,
        max_window_layers=2, rope_scaling=None, sliding_window=None, use_sliding_window=False,
    ),
    # Qwen3.5's text model: gated-delta-net (linear attention) layers and a full-attention layer with an output gate.
    "tiny-qwen3.5": _tiny(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=4, num_attention_heads=2, num_key_value_heads=1, head_dim=128, attn_output_gate=True,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, partial_rotary_factor=0.25, mtp_num_hidden_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    "tiny-qwen3-moe": _tiny(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=512,
        moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
        max_window_layers=2, rope_scaling=None, sliding_window=None, use_sliding_window=False,
    ),
    "tiny-qwen2-moe": _tiny(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", intermediate_size=512,
        moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, output_router_logits=False,
        router_aux_loss_coef=0.001, qkv_bias=True, max_window_layers=2, rope_scaling=None, sliding_window=None,
        use_sliding_window=False,
    ),
    # GLM-4.7-Flash's layout (Glm4MoeLiteForCausalLM): multi-head latent attention, a dense first layer, routed experts
    # with a shared one and sigmoid scores, one DeepSeek-style MTP layer. kv_lora_rank + qk_rope_head_dim stays 576,
    # the one latent width vLLM's CPU MLA backends run; the heads are GLM-4.7-Flash's (192 + 64, v 256): vLLM's GPU MLA
    # prefill (FlashAttention) takes only three head shapes, this one among them.
    "tiny-glm4-moe-lite": _tiny(
        architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", intermediate_size=512,
        moe_intermediate_size=128, num_hidden_layers=3, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, routed_scaling_factor=1.8, n_group=1, topk_group=1, norm_topk_prob=True,
        topk_method="noaux_tc", scoring_func="sigmoid", first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, rope_interleave=True, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny-mixtral": _tiny(
        architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=128,
        num_local_experts=8, num_experts_per_tok=2, output_router_logits=False,
        router_aux_loss_coef=0.02, sliding_window=None,
    ),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
}


def _multimodal_qwen3_5(text: dict) -> dict:
    """The class Qwen3.5 is published as (exllamav3 writes MTP layers for it): the decoder in text_config, a one-block
    vision tower (stored unquantized, as --vision_bits 16 writes it), one MTP layer."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": dict(text, model_type="qwen3_5_text", mtp_num_hidden_layers=1),
            "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 128,
                              "intermediate_size": 256, "num_heads": 2, "out_hidden_size": text["hidden_size"],
                              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "num_position_embeddings": 256, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
                              "deepstack_visual_indexes": []},
            "tie_word_embeddings": False}


# HF maps head_dim onto qk_rope_head_dim for this class: the common tiny head_dim must not be there.
del PRESETS["tiny-glm4-moe-lite"]["head_dim"]
PRESETS["tiny-qwen3.5-vl"] = _multimodal_qwen3_5(PRESETS["tiny-qwen3.5"])
# Qwen/Qwen3.5-27B's decoder and MTP layer (its public config); the vision tower is the one-block stand-in above, for
# serving benchmarks that run with --language-model-only.
PRESETS["qwen3.5-27b"] = _multimodal_qwen3_5(dict(
    _TINY_COMMON, bos_token_id=None, eos_token_id=248044, hidden_size=5120, intermediate_size=17408,
    max_position_embeddings=262144, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    vocab_size=248320, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
    full_attention_interval=4, attn_output_gate=True, linear_num_key_heads=16, linear_num_value_heads=48,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}))


def load_config(config_or_preset) -> dict:
    """A preset name, a config.json path (or its directory) or a dict -> a fresh HF config dict."""
    if isinstance(config_or_preset, dict):
        return copy.deepcopy(config_or_preset)
    if isinstance(config_or_preset, os.PathLike):
        config_or_preset = os.fspath(config_or_preset)
    if not isinstance(config_or_preset, str) or not config_or_preset:
        raise Exl3FormatError(f"config must be a preset name, a config.json path or a dict, "
                              f"got {config_or_preset!r}")
    if config_or_preset in PRESETS:
        return copy.deepcopy(PRESETS[config_or_preset])
    path = config_or_preset
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    looks_like_path = os.sep in config_or_preset or config_or_preset.endswith(".json") or os.path.exists(path)
    if not looks_like_path:
        raise Exl3FormatError(f"unknown preset {config_or_preset!r}",
                              fix=f"use one of {', '.join(PRESETS)} or the path of an HF config.json")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise Exl3FormatError("config file does not exist", file=path,
                              fix=f"pass an HF config.json or one of the presets {', '.join(PRESETS)}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise Exl3FormatError(f"config is not valid JSON ({type(e).__name__}: {e})", file=path) from None
    except OSError as e:
        raise Exl3FormatError(f"cannot read config: {e.strerror or e}", file=path) from None
    if not isinstance(data, dict):
        raise Exl3FormatError("config must hold a JSON object", file=path)
    return data
