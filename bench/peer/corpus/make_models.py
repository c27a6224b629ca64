"""Small real models for the EXL3 checkpoint corpus: a BPE tokenizer and Llama / Qwen3 / Qwen3-MoE models trained
for a few minutes on real text, saved in Hugging Face format for exllamav3's converter (GPU machine).

    python3 bench/peer/corpus/make_models.py --text-dir DIR --out /tmp/corpus/hf [--steps 1500] [--only NAME,...]

The text is exllamav3's calibration text (DIR = exllamav3/conversion/standard_cal_data): each file's first 90% is
training text, its last 10% is held out (heldout.txt, for the fidelity gate); the running Python's standard library
sources (tests left out, about 12 MB) are training text too, so 1,500 steps pass over the data about 8 times, not 24.
Models train concurrently, one process each, on one GPU. Every model: 4 layers, head_dim 64, vocab 2048, hidden 256
(Qwen3: 384, so a quantized embedding's last 256-wide group is half padding); all widths multiples of 128. The
two-layer "-2l" models make the CI fixtures small (tests/data/corpus, at most 4 MB together).
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import sysconfig
import time

VOCAB = 2048
COMMON = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
MODELS = {
    "llama": ("LlamaForCausalLM", {"model_type": "llama", "intermediate_size": 512, "tie_word_embeddings": False,
                                   "attention_bias": False, "mlp_bias": False}),
    "llama-tied": ("LlamaForCausalLM", {"model_type": "llama", "intermediate_size": 512,
                                        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False}),
    "qwen3": ("Qwen3ForCausalLM", {"model_type": "qwen3", "hidden_size": 384, "num_attention_heads": 6,
                                   "intermediate_size": 1024, "tie_word_embeddings": False,
                                   "attention_bias": False, "use_sliding_window": False, "max_window_layers": 4}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"model_type": "qwen3_moe", "intermediate_size": 768,
                                          "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
                                          "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                                          "tie_word_embeddings": False, "attention_bias": False,
                                          "router_aux_loss_coef": 0.01, "output_router_logits": True}),
}
MODELS["llama-2l"] = (MODELS["llama"][0], {**MODELS["llama"][1], "num_hidden_layers": 2})
MODELS["qwen3-moe-2l"] = (MODELS["qwen3-moe"][0], {**MODELS["qwen3-moe"][1], "num_hidden_layers": 2})
SEQ = 512


def split_text(text_dir: str, out: str) -> tuple[str, str]:
    train, held = [], []
    for f in sorted(glob.glob(os.path.join(text_dir, "*.utf8"))):
        t = open(f, encoding="utf-8").read()
        cut = int(len(t) * 0.9)
        train.append(t[:cut])
        held.append(t[cut:])
    lib = sysconfig.get_paths()["stdlib"]
    for f in sorted(glob.glob(os.path.join(lib, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(f, lib)
        if not any(p.startswith(("test", "site-packages", "idlelib")) for p in rel.split(os.sep)):
            train.append(open(f, encoding="utf-8", errors="replace").read())
    os.makedirs(out, exist_ok=True)
    tp, hp = os.path.join(out, "train.txt"), os.path.join(out, "heldout.txt")
    open(tp, "w", encoding="utf-8").write("\n\n".join(train))
    open(hp, "w", encoding="utf-8").write("\n\n".join(held))
    return tp, hp


def make_tokenizer(train_txt: str, out: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([train_txt], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tdir = os.path.join(out, "tokenizer")
    fast.save_pretrained(tdir)
    return tdir


def train_one(name: str, tdir: str, train_txt: str, out: str, steps: int, seed: int) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: dry runs only
    arch, extra = MODELS[name]
    cfg = AutoConfig.for_model(extra["model_type"], **{**COMMON, **{k: v for k, v in extra.items()
                                                                     if k != "model_type"}})
    cfg.architectures = [arch]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(DEV)
    tok = PreTrainedTokenizerFast.from_pretrained(tdir)
    ids = torch.tensor(tok(open(train_txt, encoding="utf-8").read())["input_ids"], dtype=torch.long)
    n = (ids.numel() - 1) // (SEQ - 1)
    data = ids[: n * (SEQ - 1)].view(n, SEQ - 1).to(DEV)
    bos = torch.full((64, 1), COMMON["bos_token_id"], dtype=torch.long, device=DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    t0 = time.time()
    for step in range(steps):
        lr = 3e-3 * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = torch.cat([bos, data[torch.randint(0, n, (64,), device=DEV)]], 1)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            outp = model(input_ids=batch, labels=batch)
        outp.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 250 == 0 or step == steps - 1:
            print(f"[{name}] step {step} loss {outp.loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    d = os.path.join(out, name)
    if getattr(cfg, "output_router_logits", False):
        model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(d)
    tok.save_pretrained(d)
    cfg_path = os.path.join(d, "config.json")
    saved = json.load(open(cfg_path))
    saved.setdefault("rope_theta", COMMON["rope_theta"])  # readers older than transformers 5 look for this key
    if "num_local_experts" in saved:
        saved.setdefault("num_experts", saved["num_local_experts"])  # Qwen3-MoE's published key (exllamav3 reads it)
    json.dump(saved, open(cfg_path, "w"), indent=2)
    with open(os.path.join(d, "train.json"), "w") as f:
        json.dump({"steps": steps, "final_loss": outp.loss.item(), "seconds": time.time() - t0,
                   "tokens": ids.numel(), "transformers": transformers.__version__}, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--only", default=",".join(MODELS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tp = os.path.join(args.out, "train.txt")
    tdir = os.path.join(args.out, "tokenizer")
    if args.worker:
        train_one(args.worker, tdir, tp, args.out, args.steps, seed=list(MODELS).index(args.worker))
        return
    split_text(args.text_dir, args.out)
    make_tokenizer(tp, args.out)
    procs = [subprocess.Popen([sys.executable, __file__, "--text-dir", args.text_dir, "--out", args.out,
                               "--steps", str(args.steps), "--worker", name]) for name in args.only.split(",")]
    bad = [p.args[-1] for p in procs if p.wait() != 0]
    if bad:
        sys.exit(f"training failed: {bad}")


if __name__ == "__main__":
    main()
