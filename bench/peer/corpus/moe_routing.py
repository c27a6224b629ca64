"""Where an MoE checkpoint's logits part from exllamav3's: the router's top-k margin at each such position (CPU).

    .venv/bin/python bench/peer/corpus/moe_routing.py CKPT REF.exllamav3-logits.safetensors [--over 0.005]

Builds the checkpoint's model in transformers from our dense reconstruction (fp32; Qwen3-MoE layout of transformers 5:
experts fused into gate_up_proj / down_proj), runs the reference's token sequence, and prints the mean / max
KL(exllamav3 || this) and, for each position over --over, every layer's gap between the k-th and (k+1)-th router
probability. A gap near zero is a near tie: exllamav3 (fp16) and an fp32 engine may route that token to different
experts, and the positions after it inherit the difference through attention.
"""
from __future__ import annotations

import argparse
import json
import re

import torch
from safetensors import safe_open

from exl3_vllm.format.checkpoint import Checkpoint, DenseSpec, EmbeddingSpec, Exl3Spec
from exl3_vllm.format.embedding import dense_table
from exl3_vllm.format.reconstruct import dense_weight


def dense_model(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    ck = Checkpoint(path)
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    text = cfg.get("text_config") or cfg  # a multimodal model's decoder
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}),
        dtype=torch.float32).eval()
    sd = {name: ck.tensor(name).float() for name in ck.other}
    for key, spec in ck.modules.items():
        if isinstance(spec, Exl3Spec):
            w = ck.weights(key)
            sd[f"{key}.weight"] = dense_weight(w.trellis, w.suh, w.svh, w.codebook, torch.float32).T
            if spec.has_bias:
                sd[f"{key}.bias"] = ck.tensor(f"{key}.bias").float()
        elif isinstance(spec, EmbeddingSpec):
            sd[f"{key}.weight"] = dense_table(ck.tensor(f"{key}.trellis"), ck.tensor(f"{key}.signs"),
                                              text["hidden_size"]).float()
        elif isinstance(spec, DenseSpec):
            sd[f"{key}.weight"] = ck.tensor(f"{key}.weight").float()
    # Sliced MLPs (`.slice.N`, exllamav3's MLPs over its width bound) joined back: gate / up along their outputs,
    # down along its inputs.
    sliced = sorted({m.group(1) for k in sd if (m := re.match(r"(.*)\.slice\.\d+\.weight$", k))})
    for key in sliced:
        parts = sorted((k for k in sd if re.match(re.escape(key) + r"\.slice\.\d+\.weight$", k)),
                       key=lambda k: int(k.rsplit(".", 2)[1]))
        sd[f"{key}.weight"] = torch.cat([sd.pop(k) for k in parts], 1 if key.endswith("down_proj") else 0)
    want = model.state_dict()
    if not any(k.startswith("model.language_model.") for k in want):  # the text-only class transformers builds
        sd = {re.sub(r"^model\.language_model\.", "model.", k): v for k, v in sd.items()}
    for i in range(text["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp.experts"
        if f"{pre}.gate_up_proj" in want:
            n = want[f"{pre}.down_proj"].shape[0]  # num_experts, or n_routed_experts (GLM-4-MoE-Lite)
            sd[f"{pre}.gate_up_proj"] = torch.stack([
                torch.cat([sd.pop(f"{pre}.{e}.gate_proj.weight"), sd.pop(f"{pre}.{e}.up_proj.weight")])
                for e in range(n)])
            sd[f"{pre}.down_proj"] = torch.stack([sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(n)])
    # Padded widths in the checkpoint are trimmed to the model's.
    loaded = {k: v[tuple(slice(0, s) for s in want[k].shape)].contiguous() for k, v in sd.items() if k in want}
    missing = sorted(set(want) - set(loaded))
    if missing:
        raise SystemExit(f"no checkpoint tensor for {missing[:5]}")
    model.load_state_dict(loaded)
    return model, cfg


def router_gaps(model, cfg: dict, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, vocab], gaps [T, MoE layers]): each MoE layer's gap between its k-th and (k+1)-th router
    probability; for sigmoid routers with a score-correction bias (GLM-4-MoE-Lite), between the k-th and (k+1)-th of
    the scores it selects on (sigmoid + bias)."""
    router: dict[int, torch.Tensor] = {}

    def keep(mod, inp, out, i):
        x = (out[0] if isinstance(out, tuple) else out).detach().float()
        bias = getattr(mod, "e_score_correction_bias", None)
        router[i] = torch.softmax(x, -1) if bias is None else torch.sigmoid(x) + bias.float()

    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: keep(mod, inp, out, i))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]  # not dense layers
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(ids.view(1, -1).to(dev)).logits[0].float().cpu()
    for h in hooks:
        h.remove()
    k = cfg["num_experts_per_tok"]
    probs = [router[i].view(len(ids), -1).sort(-1, descending=True).values.cpu() for i in sorted(router)]
    return logits, torch.stack([p[:, k - 1] - p[:, k] for p in probs], 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("reference")
    ap.add_argument("--over", type=float, default=0.005, help="KL above which a position is explained")
    a = ap.parse_args()
    model, cfg = dense_model(a.ckpt)
    with safe_open(a.reference, "pt") as f:
        ids, ref = f.get_tensor("input_ids").long(), f.get_tensor("logits").float()
    got, gaps = router_gaps(model, cfg, ids)
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    out = {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
           "top1": (lp.argmax(-1) == lq.argmax(-1)).float().mean().item(), "positions": []}
    for p in (kl > a.over).nonzero().flatten().tolist():
        out["positions"].append({"pos": p, "kl": round(kl[p].item(), 4),
                                 "router_gap_per_layer": [round(g, 5) for g in gaps[p].tolist()]})
    print(json.dumps(out, indent=1))

if __name__ == "__main__":
    main()
