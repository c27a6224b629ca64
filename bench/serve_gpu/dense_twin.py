"""An EXL3 checkpoint's dense reconstruction written as an unquantized Hugging Face checkpoint (every EXL3 linear as
its `.weight`, every other tensor as stored, MTP and vision modules included; a vision attention quantized as split
q/k/v becomes the one `qkv` exllamav3 runs them as): a bf16 baseline with the same weights
and the same draft, for serving benchmarks when the model the checkpoint came from is not at hand.

    .venv/bin/python bench/serve_gpu/dense_twin.py CKPT OUT [--dtype bfloat16]
"""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

from exl3_vllm.format.checkpoint import INDEX_FILE, Checkpoint, EmbeddingSpec, Exl3Spec
from exl3_vllm.format.embedding import dense_table
from exl3_vllm.format.reconstruct import dense_weight


def twin_state_dict(ck: Checkpoint, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    sd, quantized = {}, set()
    text = ck.config.get("text_config") or ck.config
    for key, spec in ck.modules.items():
        if isinstance(spec, Exl3Spec):
            w = ck.weights(key)
            full = dense_weight(w.trellis, w.suh, w.svh, w.codebook, torch.float32).T
            # Padded widths (exllamav3 pads some to its tile) back to the model's.
            n, k = spec.padded_from.get("n", spec.n), spec.padded_from.get("k", spec.k)
            sd[f"{key}.weight"] = full[:n, :k].to(dtype).contiguous()
            quantized.update(t.name for role, t in spec.tensors.items() if role != "bias")
        elif isinstance(spec, EmbeddingSpec):
            sd[f"{key}.weight"] = dense_table(ck.tensor(f"{key}.trellis"), ck.tensor(f"{key}.signs"),
                                              text["hidden_size"]).to(dtype)
            quantized.update(t.name for t in spec.tensors.values())
    for name in ck.tensors:
        if name in quantized or name in sd:
            continue
        t = ck.tensor(name)
        sd[name] = t.to(dtype) if t.is_floating_point() else t
    for q in ck.split_vision_qkv:  # a quantized vision attention: its q/k/v as the one qkv, replacing the source
        head = q[: -len("q_proj")]
        for part in ("weight", "bias"):
            pieces = [sd.pop(f"{head}{s}_proj.{part}", None) for s in "qkv"]
            if all(x is not None for x in pieces):
                sd[f"{head}qkv.{part}"] = torch.cat(pieces)
    return sd


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = ap.parse_args()
    ck = Checkpoint(a.ckpt)
    sd = twin_state_dict(ck, getattr(torch, a.dtype))
    os.makedirs(a.out, exist_ok=True)
    save_file(sd, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    for c in (cfg, cfg.get("text_config") or {}):
        c["dtype"] = a.dtype
        c.pop("torch_dtype", None)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    # Tokenizer, generation and processor files as they are; weights and the quantization config are replaced.
    for f in os.listdir(a.ckpt):
        if f not in ("config.json", "quantization_config.json", INDEX_FILE) and not f.endswith(".safetensors"):
            shutil.copy(os.path.join(a.ckpt, f), a.out)
    print(f"wrote {a.out}: {len(sd)} tensors, {sum(t.numel() * t.element_size() for t in sd.values()) / 2**20:.1f} "
          f"MiB ({a.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
