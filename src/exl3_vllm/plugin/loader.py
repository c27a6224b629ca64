"""`--load-format exl3`: vLLM's default loader, except that an EXL3 module which the model builds as a plain torch
Linear (the eh_proj of DeepSeek-style MTP drafts: DeepSeek, GLM-4-MoE(-Lite), HY-V3) reaches the model as the dense
weight its tensors decode to. Every other tensor passes through unchanged."""

from __future__ import annotations

import copy
import logging

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..format.checkpoint import Checkpoint, Exl3Spec
from ..format.reconstruct import dense_weight

LOAD_FORMAT = "exl3"
logger = logging.getLogger("exl3_vllm")


def load_format_is_ours() -> bool:
    """Whether the engine being built loads through this loader (asked while its layers are made)."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return cfg is not None and getattr(cfg.load_config, "load_format", None) == LOAD_FORMAT


def plain_linears(checkpoint: Checkpoint, params: dict[str, torch.Tensor]) -> dict[str, Exl3Spec]:
    """EXL3 modules of the checkpoint that the model holds as a plain weight: a `<key>.weight` parameter, no trellis."""
    return {key: spec for key, spec in checkpoint.modules.items()
            if isinstance(spec, Exl3Spec) and f"{key}.weight" in params and f"{key}.trellis" not in params}


def dense_linear(checkpoint: Checkpoint, spec: Exl3Spec, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The module's tensors as torch's Linear holds them: weight [out, in] in the parameter's dtype (the converter's
    padding trimmed to its shape), and the bias if there is one."""
    w = checkpoint.weights(spec.key)
    out_f, in_f = weight.shape
    dense = dense_weight(w.trellis, w.suh, w.svh, w.codebook).T[:out_f, :in_f]
    out = {f"{spec.key}.weight": dense.to(weight.dtype).contiguous()}
    if w.bias is not None:
        out[f"{spec.key}.bias"] = w.bias[:out_f].to(weight.dtype)
    return out


@register_model_loader(LOAD_FORMAT)
class Exl3ModelLoader(DefaultModelLoader):
    def __init__(self, load_config):
        # The default loader picks its file reader by this name: EXL3 checkpoints are safetensors.
        load_config = copy.copy(load_config)
        load_config.load_format = "safetensors"
        super().__init__(load_config)

    def get_all_weights(self, model_config, model):
        weights = super().get_all_weights(model_config, model)
        checkpoint = _checkpoint(model)
        if checkpoint is None:
            yield from weights
            return
        params = dict(model.named_parameters())
        plain = plain_linears(checkpoint, params)
        owner = {t.name: spec for spec in plain.values() for t in spec.tensors.values()}
        done = set()
        for name, tensor in weights:
            spec = owner.get(name)
            if spec is None:
                yield name, tensor
            elif spec.key not in done:
                done.add(spec.key)
                logger.info("exl3: %s is a plain torch Linear in this model: loading its EXL3 weight dense",
                            spec.key)
                yield from dense_linear(checkpoint, spec, params[f"{spec.key}.weight"]).items()


def _checkpoint(model) -> Checkpoint | None:
    """The checkpoint the model's EXL3 layers were made from (Exl3Config read its headers once), or None for a
    model with none."""
    from .config import Exl3Config

    for m in model.modules():
        cfg = getattr(getattr(m, "quant_method", None), "config", None)
        if isinstance(cfg, Exl3Config):
            return cfg.checkpoint
    return None
