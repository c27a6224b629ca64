"""Exl3Config: vLLM's view of an EXL3 checkpoint, module by module."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from .. import settings
from ..format.checkpoint import Checkpoint, DenseSpec, EmbeddingSpec, Exl3Spec
from ..format.errors import Exl3FormatError
from . import compat, vision
from .names import NameResolver, canonical

logger = logging.getLogger("exl3_vllm")


def _resolve_dir(model: str, revision: str | None) -> str:
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the files are not here
        raise Exl3FormatError(f"cannot find the checkpoint files for {model!r} ({type(e).__name__})",
                              fix="pass a local directory or download the model first") from None


def _log_warnings(warnings: list[str]) -> None:
    """Log each checkpoint warning once: MoE checkpoints repeat one per expert module ("<module>: <what>")."""
    modules: dict[str, list[str]] = {}
    for w in warnings:
        key, sep, what = w.partition(": ")
        if sep and " " not in key:
            modules.setdefault(what, []).append(key)
        else:
            modules.setdefault(w, [])
    for what, keys in modules.items():
        if len(keys) > 1:
            logger.warning("exl3: %d modules (%s, ...): %s", len(keys), keys[0], what)
        else:
            logger.warning("exl3: %s", f"{keys[0]}: {what}" if keys else what)


LAYOUT_KEY = "exl3_vllm_layout"


def layout_digest(checkpoint: Checkpoint) -> str:
    """What the compiled graph takes from the tensor headers: every name (codebook markers, slices), dtype and
    shape (each shard's K)."""
    rows = sorted((t.name, t.dtype, list(t.shape)) for t in checkpoint.tensors.values())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:32]


def _key_compile_cache(hf_config, checkpoint: Checkpoint) -> None:
    """vLLM keys its compiled-graph cache on config.json, which two conversions into one directory can share while
    their layers differ: the headers' digest joins the quantization_config it hashes."""
    digest = layout_digest(checkpoint)
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        qc = getattr(cfg, "quantization_config", None)
        if isinstance(qc, dict):
            qc[LAYOUT_KEY] = digest


@register_quantization_config("exl3")
class Exl3Config(QuantizationConfig):
    """Per-module EXL3 specs, read from the checkpoint's headers."""

    def __init__(self, quant_config: dict[str, Any]):
        super().__init__()
        self.quant_config = dict(quant_config)
        self.checkpoint: Checkpoint | None = None
        self._resolver: tuple[tuple, NameResolver] | None = None
        self._asked_eh_proj: set[str] = set()

    def __repr__(self) -> str:
        return f"Exl3Config(bits={self.quant_config.get('bits')}, path={getattr(self.checkpoint, 'path', None)})"

    # ---- vLLM's QuantizationConfig contract ------------------------------------------------
    @classmethod
    def get_name(cls) -> str:
        return "exl3"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Exl3Config":
        if config.get("quant_method") != "exl3":
            raise Exl3FormatError(f"quantization_config has quant_method {config.get('quant_method')!r}, "
                                  "not 'exl3'", file="config.json")
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if isinstance(hf_quant_cfg, dict) and hf_quant_cfg.get("quant_method") == "exl3":
            return "exl3"
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None):
        self.load_checkpoint(_resolve_dir(model_name, revision))
        if hf_config is not None:
            _key_compile_cache(hf_config, self.checkpoint)

    def load_checkpoint(self, path: str) -> None:
        """Read the checkpoint's headers once; every layer's spec comes from them."""
        if self.checkpoint is not None and self.checkpoint.path == os.path.abspath(path):
            return
        self.checkpoint = Checkpoint(path)
        if self.checkpoint.unsupported:
            what, why = self.checkpoint.unsupported[0]
            in_file = os.path.exists(os.path.join(path, what))
            raise Exl3FormatError(f"the checkpoint has {why}", file=os.path.join(path, what) if in_file else path,
                                  tensor=None if in_file else what,
                                  fix="serve it with exllamav3, or re-convert without this feature")
        self._resolver = None
        _log_warnings(self.checkpoint.warnings)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        from .linear_method import Exl3LinearMethod

        if self.checkpoint is None:
            raise Exl3FormatError("the EXL3 config was used before its checkpoint was read",
                                  fix="load the model through vLLM (maybe_update_config reads the headers)")
        if prefix:
            self._check_nextn_draft(prefix)
        experts_cls = compat.routed_experts_class()
        if isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead):
            specs = self.specs_for(prefix) if prefix else []
            spec = specs[0][1] if len(specs) == 1 else None
            if not prefix:
                # Some vLLM models (Llama) build their token embedding without a prefix: it is the one table.
                tables = [m for m in self.checkpoint.modules.values() if isinstance(m, EmbeddingSpec)]
                spec = tables[0] if len(tables) == 1 else None
            if isinstance(spec, EmbeddingSpec):
                from .embedding_method import Exl3EmbeddingMethod

                return Exl3EmbeddingMethod(self, prefix, spec)
            return None
        if isinstance(layer, (LinearBase, ParallelLMHead)):
            split = vision.split_qkv_specs(self, prefix)
            if split is not None:
                return Exl3LinearMethod(self, prefix, split)
            sliced = self.sliced_specs(prefix)
            if sliced is not None:
                from .linear_method import SlicedExl3LinearMethod

                return SlicedExl3LinearMethod(self, prefix, sliced)
            specs = self.specs_for(prefix)
            kinds = {type(s).__name__ for _, s in specs if s is not None}
            if "EmbeddingSpec" in kinds:
                raise Exl3FormatError(f"{prefix!r} is a linear layer in vLLM but a quantized embedding table in "
                                      "the checkpoint", file=self.checkpoint.path, tensor=prefix,
                                      fix="the checkpoint does not belong to this model config")
            if settings.get("EXL3_VLLM_DEBUG_NAMES"):
                logger.warning("exl3 names: %s -> %s", prefix,
                               ", ".join(f"{n}={getattr(s, 'key', None)}:{type(s).__name__ if s else 'missing'}"
                                         for n, s in specs))
            if "Exl3Spec" in kinds:
                if kinds != {"Exl3Spec"} or any(s is None for _, s in specs):
                    raise Exl3FormatError(
                        f"vLLM fuses {[n for n, _ in specs]} into {prefix!r}, but only some of them are EXL3 "
                        f"in the checkpoint ({[(n, type(s).__name__ if s else 'missing') for n, s in specs]})",
                        file=self.checkpoint.path, tensor=prefix,
                        fix="mixed quantized/unquantized shards of one fused layer are not supported")
                return Exl3LinearMethod(self, prefix, [s for _, s in specs])
            if isinstance(layer, ParallelLMHead):
                dense = specs[0][1] if len(specs) == 1 and isinstance(specs[0][1], DenseSpec) else None
                if dense is not None and len(dense.shape) == 2 and dense.shape[0] > layer.org_vocab_size:
                    from .embedding_method import padded_dense_head_method

                    return padded_dense_head_method()
                return None
            return compat.unquantized_linear_method()
        if experts_cls is not None and isinstance(layer, experts_cls):
            # Routed experts: EXL3 if the checkpoint quantized any of them (the method checks all), else stock.
            if any(isinstance(s, Exl3Spec) for _, s in self.specs_for_experts(prefix)):
                from .moe_method import Exl3MoEMethod

                return Exl3MoEMethod(self, prefix, layer)
            return None
        return None

    def _check_nextn_draft(self, prefix: str) -> None:
        """A DeepSeek-style MTP layer (decoder layer num_hidden_layers + i) whose eh_proj the checkpoint stores as
        EXL3: vLLM's drafts that build eh_proj with a quantization method ask for it before the layer's other modules;
        the ones that build a plain torch Linear never do, and would stop at load on an unknown `trellis` tensor
        unless `--load-format exl3` (plugin/loader.py) hands them the dense weight. Asked for another module of such
        a layer first without it, refuse with what to do."""
        from .loader import load_format_is_ours

        layer = self.checkpoint.nextn_layer(prefix)
        if layer is None or load_format_is_ours():
            return
        eh = layer + "eh_proj"
        if prefix.startswith(eh):
            self._asked_eh_proj.add(eh)
            return
        if eh in self._asked_eh_proj:
            return
        spec = next((s for _, s in self.specs_for(eh)), None)
        if isinstance(spec, Exl3Spec):
            raise Exl3FormatError(
                "this MTP layer's eh_proj is EXL3 in the checkpoint, and this vLLM draft builds eh_proj as a plain "
                "torch Linear, which cannot load it as EXL3", file=self.checkpoint.path, tensor=spec.key,
                fix="add --load-format exl3 (loads this one module dense), or serve without --speculative-config")

    @property
    def resolver(self) -> NameResolver:
        # The model fills packed_modules_mapping after the config is built, so rebuild on change.
        packed = getattr(self, "packed_modules_mapping", None) or {}
        tag = tuple(sorted((k, tuple(v)) for k, v in packed.items()))
        if self._resolver is None or self._resolver[0] != tag:
            self._resolver = (tag, NameResolver(self.checkpoint.modules.keys(), packed))
        return self._resolver[1]

    def specs_for_experts(self, prefix: str) -> list[tuple[str, Exl3Spec | DenseSpec]]:
        """(key, spec) of every checkpoint module under a RoutedExperts prefix (experts.{e}.<proj>)."""
        want = canonical(prefix) + "."
        return [(k, s) for k, s in self.checkpoint.modules.items() if canonical(k).startswith(want)]

    def sliced_specs(self, prefix: str) -> list[list[Exl3Spec]] | None:
        """For a layer whose shards exllamav3 stored as `.slice.N` modules: per slice, the spec of each shard; None
        for an unsliced layer."""
        shards = self.resolver.shards(prefix)
        if not any(len(keys) > 1 for _, keys in shards):
            return None
        if len({len(keys) for _, keys in shards}) != 1:
            raise Exl3FormatError(f"vLLM fuses {[n for n, _ in shards]} into {prefix!r}, but the checkpoint slices "
                                  f"them differently ({[len(keys) for _, keys in shards]} slices)",
                                  file=self.checkpoint.path, tensor=prefix, fix="re-convert the model")
        slices = [[self.checkpoint.modules[keys[s]] for _, keys in shards] for s in range(len(shards[0][1]))]
        bad = [sp.key for sl in slices for sp in sl if not isinstance(sp, Exl3Spec)]
        if bad:
            raise Exl3FormatError(f"{prefix!r} is stored as slices, some of them not EXL3 ({bad[0]})",
                                  file=self.checkpoint.path, tensor=bad[0], fix="re-convert the model")
        return slices

    def specs_for(self, prefix: str) -> list[tuple[str, Exl3Spec | DenseSpec | None]]:
        """The checkpoint module of each shard of a vLLM layer (None where there is none)."""
        out = []
        for name, keys in self.resolver.shards(prefix):
            if len(keys) > 1:
                raise Exl3FormatError(f"{prefix!r} is stored as {len(keys)} slices ({keys[0]}, ...), which "
                                      "this version does not join yet", file=self.checkpoint.path,
                                      fix="re-convert without MLP slicing")
            out.append((name, self.checkpoint.modules[keys[0]] if keys else None))
        return out
