"""How far a model's top-1 moves with the activation dtype alone: the floor under the gate's top-1 bounds (CPU).

    .venv/bin/python bench/peer/corpus/dtype_floor.py --corpus DIR/exl3 --names llama-b4,qwen3-moe-b4 \
        --text .peer/src/exllamav3/conversion/standard_cal_data [--tokens 2048] [--out F.json]

Each checkpoint's dense reconstruction (the exact weights the quantized model computes with) runs in transformers
in float32, float16 and bfloat16 over the gate's held-out tokens (BOS + the first tokens - 1 of heldout.txt, as
ex3_logits.py). No exl3 kernel and no exllamav3 code is involved: the rows are what two correct engines that differ
only in activation dtype and summation order disagree by. bfloat16 vs float16 is the floor of the gate's bf16 row
(vLLM in bf16 against exllamav3 in fp16); float16 vs float32 is one fp16 engine's own rounding.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from make_models import split_text  # noqa: E402
from moe_routing import dense_model  # noqa: E402


def heldout_ids(text_dir: str, ckpt: str, n: int) -> torch.Tensor:
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        _, held = split_text(text_dir, tmp)
        text = open(held, encoding="utf-8").read()
    tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    return torch.tensor([tok.bos_token_id] + tok(text)["input_ids"][: n - 1], dtype=torch.long)


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top2 = ref.double().topk(2, -1).values
    differ = ref.argmax(-1) != got.argmax(-1)
    return {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "top1": 1.0 - differ.double().mean().item(),
            "ref_margin_at_differ_max": (top2[:, 0] - top2[:, 1])[differ].max().item() if differ.any() else None}


def dtype_logits(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """model's logits over ids [1, T] in float32, float16 and bfloat16 (on ids' device), fp32 on the CPU."""
    rope = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    out = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        model.to(dt)
        for n, b in rope.items():  # RoPE frequencies stay fp32, as every engine keeps them
            setattr(model.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1], b.clone())
        with torch.inference_mode():
            out[str(dt).split(".")[1]] = model(ids).logits[0].float().cpu()
    return out


def dense_logits(ckpt: str, ids: torch.Tensor, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The checkpoint's dense reconstruction run over ids in float32, float16 and bfloat16 (logits on the CPU)."""
    model, _ = dense_model(ckpt)
    logits = dtype_logits(model.to(device), ids.view(1, -1).to(device))
    del model
    return logits


def floors(logits: dict[str, torch.Tensor]) -> dict[str, dict]:
    """One engine's own dtype floors: float16 against float32, bfloat16 against float16."""
    return {"float16": compare(logits["float32"], logits["float16"]),
            "bfloat16": compare(logits["float16"], logits["bfloat16"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--names", required=True)
    ap.add_argument("--text", required=True, help="exllamav3's standard_cal_data (the held-out split's source)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for name in a.names.split(","):
        ckpt = os.path.join(a.corpus, name)
        model, _ = dense_model(ckpt)
        ids = heldout_ids(a.text, ckpt, a.tokens).view(1, -1)
        logits = dtype_logits(model, ids)
        for ref, got in (("float32", "float16"), ("float32", "bfloat16"), ("float16", "bfloat16")):
            row = {"name": name, "ref": ref, "got": got, "positions": ids.shape[1], **compare(logits[ref], logits[got])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
