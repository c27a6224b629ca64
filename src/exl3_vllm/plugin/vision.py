"""A Qwen3-VL-family vision tower whose attention exllamav3 quantized (--vision_bits): the checkpoint stores the
fused `attn.qkv` as EXL3 `q_proj`/`k_proj`/`v_proj` modules and keeps the unquantized source beside them
(docs/format.md 1.9); vLLM's tower has one qkv layer. That layer runs the three EXL3 modules as its q/k/v shards, and
the tower's loader is taught their names and to skip the source, which exllamav3's forward does not use either."""

from __future__ import annotations

import re

from ..format.errors import Exl3FormatError

# Architectures whose vLLM model builds Qwen3_VisionTransformer (its loader maps attn.q./k./v. onto qkv's shards).
TOWER_ARCHS = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
               "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
_SPLIT = re.compile(r"^(blocks\.(\d+)\.attn\.)(q|k|v)_proj\.")
_SOURCE = re.compile(r"^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")


def split_qkv_specs(config, prefix: str) -> list | None:
    """The q/k/v EXL3 specs behind a vision tower's qkv layer that the checkpoint stores split, or None for any other
    layer; refused with what to do where vLLM's tower for this architecture is not one this module teaches."""
    head, _, last = prefix.rpartition(".")
    if last != "qkv":
        return None
    resolver, ck = config.resolver, config.checkpoint
    keys = [resolver.lookup(f"{head}.{s}_proj") for s in "qkv"]
    if not keys[0] or keys[0][0] not in ck.split_vision_qkv:
        return None
    arch = (ck.config.get("architectures") or ["?"])[0]
    if arch not in TOWER_ARCHS:
        raise Exl3FormatError(
            f"{prefix!r}: the checkpoint quantized this vision attention as separate EXL3 q_proj/k_proj/v_proj "
            f"modules (exllamav3 --vision_bits), which vLLM's vision tower for {arch} (one fused qkv layer) cannot "
            "load yet", file=ck.path, tensor=keys[0][0],
            fix="serve text only with --language-model-only, or convert with --vision_bits 16")
    if any(len(k) != 1 for k in keys):
        raise Exl3FormatError(f"{prefix!r}: the vision attention stores q_proj but not all of k_proj/v_proj "
                              f"({keys})", file=ck.path, tensor=keys[0][0], fix="re-convert the model")
    _teach_tower_loader()
    return [ck.modules[k[0]] for k in keys]


def tp_note(prefix: str) -> str:
    """What a tensor-parallel refusal adds for a vision tower's layer: vLLM can run the tower whole on every GPU."""
    return (", or --mm-encoder-tp-mode data to run the whole vision tower on every GPU"
            if prefix.startswith("visual.") or ".visual." in prefix else "")


def _teach_tower_loader() -> None:
    """Once per process: Qwen3_VisionTransformer.load_weights renames a split block's q/k/v_proj tensors to the
    attn.q./k./v. names its mapper stacks into qkv, and drops that block's unquantized qkv source; a tower whose qkv
    layers are not EXL3 loads as before."""
    from vllm.model_executor.models import qwen3_vl

    cls = qwen3_vl.Qwen3_VisionTransformer
    if getattr(cls.load_weights, "_exl3", False):
        return
    stock = cls.load_weights

    def load_weights(self, weights):
        from .linear_method import Exl3LinearMethod

        split = {str(i) for i, b in enumerate(self.blocks)
                 if isinstance(getattr(b.attn.qkv, "quant_method", None), Exl3LinearMethod)}
        if not split:
            return stock(self, weights)

        def renamed():
            for name, w in weights:
                src = _SOURCE.match(name)
                if src and src.group(1) in split:
                    continue
                m = _SPLIT.match(name)
                yield (f"{m.group(1)}{m.group(3)}.{name[m.end():]}" if m and m.group(2) in split else name), w

        return stock(self, renamed())

    load_weights._exl3 = True
    cls.load_weights = load_weights
