"""Small real models for the EXL3 checkpoint corpus: a BPE tokenizer and Llama / Qwen3 / Qwen3-MoE models trained
for a few minutes on real text, saved in Hugging Face format for exllamav3's converter (GPU machine).

    python3 bench/peer/corpus/make_models.py --text-dir DIR --out /tmp/corpus/hf [--steps 1500] [--only NAME,...]

The text is exllamav3's calibration text (DIR = exllamav3/conversion/standard_cal_data): each file's first 90% is
training text, its last 10% is held out (heldout.txt, for the fidelity gate); the running Python's standard library
sources (tests left out, about 12 MB) are training text too, so 1,500 steps pass over the data about 8 times, not 24.
Models train concurrently, one process each, on one GPU. Every model: 4 layers, head_dim 64, vocab 2048, hidden 256
(Qwen3: 384, so a quantized embedding's last 256-wide group is half padding); all widths multiples of 128. The
two-layer "-2l" models make the CI fixtures small (tests/data/corpus, at most 4 MB together). The two MTP models
(Qwen3.5's and GLM-4-MoE-Lite's DeepSeek-style layer) train their draft layer beside the model.
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
# Qwen3.5 as published (the multimodal class: exllamav3 converts MTP layers only for it), gated-delta-net layers beside
# one gated full-attention layer, one MTP layer trained with the model (train_mtp), a one-block vision tower left as
# initialised (text-only serving never runs it).
QWEN35_TEXT = {"model_type": "qwen3_5_text", "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 64, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
               "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
               "attn_output_gate": True, "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [4, 2, 2], "mrope_interleaved": True}}
QWEN35_VISION = {"depth": 1, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2, "out_hidden_size": 256,
                 "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 256}
# What exllamav3 reads for a Qwen3-VL-style vision tower (Qwen's published image processor settings).
QWEN35_PREPROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
                       "processor_class": "Qwen3VLProcessor"}
# Seconds of training for models whose steps are slow (transformers' reference gated-delta-net code on the device), or
# may be (GLM-4-MoE-Lite: latent attention and experts, in the model and again in its MTP layer; not yet timed there).
TRAIN_SECONDS = {"qwen3.5-mtp": 240, "glm4-moe-lite-mtp": 240}
# The vision placeholders, specials after <pad>, <s>, </s> (ids 3-6): Qwen-VL's names, never produced by text.
VISION_SPECIALS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                   "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
QWEN35_TOKENS = {k: 3 + i for i, k in enumerate(VISION_SPECIALS)}
MODELS["qwen3.5-mtp"] = ("Qwen3_5ForConditionalGeneration", {"model_type": "qwen3_5"})
MODELS["llama-2l"] = (MODELS["llama"][0], {**MODELS["llama"][1], "num_hidden_layers": 2})
MODELS["qwen3-moe-2l"] = (MODELS["qwen3-moe"][0], {**MODELS["qwen3-moe"][1], "num_hidden_layers": 2})
# GLM-4.7-Flash's class: multi-head latent attention, a dense first layer, then routed experts with sigmoid scores and
# DeepSeek-V3's balancing bias (score_bias_balancer) beside a shared expert, and one DeepSeek-style MTP layer trained
# with the model (nextn_layer). kv_lora_rank + qk_rope_head_dim stays 576: vLLM's MLA kernels need it. As many
# key/value heads as heads: the latent attention expands its keys to every head (transformers would repeat them again).
MODELS["glm4-moe-lite-mtp"] = ("Glm4MoeLiteForCausalLM", {
    "model_type": "glm4_moe_lite", "num_key_value_heads": 4, "intermediate_size": 512, "moe_intermediate_size": 128,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "routed_scaling_factor": 1.8,
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "first_k_dense_replace": 1, "q_lora_rank": 256, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64, "v_head_dim": 64, "rope_interleave": True, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "attention_bias": False})
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
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", *VISION_SPECIALS.values()],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([train_txt], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tdir = os.path.join(out, "tokenizer")
    fast.save_pretrained(tdir)
    return tdir


MTP_WEIGHT = 0.3  # the draft's share of the loss (DeepSeek-V3's weight for its MTP modules)


def mtp_layer(model):
    """Qwen3.5's MTP draft as vLLM runs it (qwen3_5_mtp): at position t, fc([norm(embed(token t+1)); norm(h_t)]) with
    h_t the main model's final (normed) hidden state, one full-attention decoder layer, a norm, the shared lm_head;
    it predicts token t+2. Its tensors are saved as mtp.* (fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0,
    norm), as published Qwen3.5 checkpoints store them."""
    import copy

    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    class Mtp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            tc = copy.deepcopy(model.config.text_config)
            n = tc.num_hidden_layers
            tc.layer_types = list(tc.layer_types) + ["full_attention"]
            h = tc.hidden_size
            self.fc = torch.nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = q.Qwen3_5RMSNorm(h, eps=tc.rms_norm_eps)
            self.pre_fc_norm_hidden = q.Qwen3_5RMSNorm(h, eps=tc.rms_norm_eps)
            self.layers = torch.nn.ModuleList([q.Qwen3_5DecoderLayer(tc, n)])
            self.norm = q.Qwen3_5RMSNorm(h, eps=tc.rms_norm_eps)
            self.model = [model]  # not a submodule: its parameters are the main model's

        def losses(self, batch):
            m = self.model[0]
            lm = m.model.language_model
            hid = lm(input_ids=batch).last_hidden_state
            logits = m.lm_head(hid).float()
            ce = torch.nn.functional.cross_entropy
            main = ce(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(lm.embed_tokens(batch[:, 1:])),
                                   self.pre_fc_norm_hidden(hid[:, :-1])], -1))
            pos = torch.arange(x.shape[1], device=x.device)[None, None].expand(3, x.shape[0], -1)
            x = self.layers[0](x, position_embeddings=lm.rotary_emb(x, pos), attention_mask=None)
            draft = m.lm_head(self.norm(x)).float()
            return main, ce(draft[:, :-1].reshape(-1, draft.shape[-1]), batch[:, 2:].reshape(-1))

        def save(self, d):
            from safetensors.torch import load_file, save_file
            path = os.path.join(d, "model.safetensors")
            tensors = load_file(path)
            tensors.update({f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()})
            save_file(tensors, path, metadata={"format": "pt"})

    return Mtp()


def nextn_layer(model):
    """GLM-4-MoE-Lite's DeepSeek-style MTP layer as vLLM runs it (glm4_moe_lite_mtp): at position t,
    eh_proj([enorm(embed(token t+1)); hnorm(h_t)]) with h_t the main model's final (normed) hidden state and the
    embedding zeroed at position 0, one decoder layer (latent attention, routed and shared experts), shared_head.norm,
    the shared lm_head; it predicts token t+2. Its tensors are saved as model.layers.{num_hidden_layers}.* (enorm,
    hnorm, eh_proj, the decoder layer's names with one tensor per expert, shared_head.norm), as GLM-4.7-Flash stores
    them and exllamav3 and vLLM read them; no embed_tokens or shared_head.head (both borrow the model's)."""
    import copy

    import torch
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as g

    class Mtp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            c = copy.deepcopy(model.config)
            self.n = c.num_hidden_layers
            c.mlp_layer_types = list(c.mlp_layer_types) + ["sparse"]
            h = c.hidden_size
            self.enorm = g.Glm4MoeLiteRMSNorm(h, eps=c.rms_norm_eps)
            self.hnorm = g.Glm4MoeLiteRMSNorm(h, eps=c.rms_norm_eps)
            self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
            self.block = g.Glm4MoeLiteDecoderLayer(c, self.n)
            self.shared_head = torch.nn.ModuleDict({"norm": g.Glm4MoeLiteRMSNorm(h, eps=c.rms_norm_eps)})
            for m in self.modules():  # the model's own initialisation (its fused experts start as torch.empty)
                model._init_weights(m)
            self.model = [model]  # not a submodule: its parameters are the main model's

        def losses(self, batch):
            m = self.model[0]
            hid = m.model(input_ids=batch).last_hidden_state
            logits = m.lm_head(hid).float()
            ce = torch.nn.functional.cross_entropy
            main = ce(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            emb = m.model.embed_tokens(batch[:, 1:])
            emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], 1)  # vLLM masks position 0's embedding
            x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hid[:, :-1])], -1))
            pos = torch.arange(x.shape[1], device=x.device)[None]
            x = self.block(x, position_embeddings=m.model.rotary_emb(x, pos), attention_mask=None)
            draft = m.lm_head(self.shared_head["norm"](x)).float()
            return main, ce(draft[:, :-1].reshape(-1, draft.shape[-1]), batch[:, 2:].reshape(-1))

        def save(self, d):
            from safetensors.torch import load_file, save_file
            path = os.path.join(d, "model.safetensors")
            tensors = load_file(path)
            for k, v in self.state_dict().items():
                k = f"model.layers.{self.n}." + k.removeprefix("block.")
                if ".mlp.experts." in k:  # transformers' fused experts [E, 2I or H, ...]: one tensor per expert
                    stem, fused = k.rsplit(".", 1)
                    for e, w in enumerate(v):
                        parts = zip(("gate_proj", "up_proj"), w.chunk(2)) if fused == "gate_up_proj" else [(fused, w)]
                        tensors.update({f"{stem}.{e}.{p}.weight": t.to(torch.bfloat16).contiguous() for p, t in parts})
                else:  # the routers' score bias stays fp32, as GLM-4.7-Flash stores it
                    tensors[k] = (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).contiguous()
            save_file(tensors, path, metadata={"format": "pt"})

    return Mtp()


BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed


def score_bias_balancer(modules):
    """DeepSeek-V3's auxiliary-loss-free expert balancing (GLM-4.7-Flash's routing, noaux_tc): after each step every
    router's e_score_correction_bias moves by BIAS_RATE toward its less loaded experts. The routing reads the bias, the
    gradient never does; trained so, the saved bias is not zero and the converters' use of it is exercised."""
    import torch

    counts = {}

    def count(router, _, out):
        load = torch.bincount(out[2].flatten(), minlength=router.e_score_correction_bias.numel())
        counts[router] = counts.get(router, 0) + load

    for m in modules:
        for r in m.modules():
            if hasattr(r, "e_score_correction_bias"):
                r.register_forward_hook(count)

    def update():
        with torch.no_grad():
            for r, load in counts.items():
                r.e_score_correction_bias += BIAS_RATE * torch.sign(load.float().mean() - load.float())
        counts.clear()

    return update


def train_one(name: str, tdir: str, train_txt: str, out: str, steps: int, seed: int) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: dry runs only
    arch, extra = MODELS[name]
    mtp = balance = None
    if arch == "Qwen3_5ForConditionalGeneration":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
        text = {**COMMON, **QWEN35_TEXT, **{k: v for k, v in extra.items() if k != "model_type"}}
        text["rope_theta"] = text["rope_parameters"]["rope_theta"]
        cfg = Qwen3_5Config(text_config=text, vision_config=QWEN35_VISION, tie_word_embeddings=False, **QWEN35_TOKENS)
        cfg.architectures = [arch]
        model = Qwen3_5ForConditionalGeneration(cfg).to(DEV)
        mtp = mtp_layer(model).to(DEV)
    else:
        kw = {**COMMON, **{k: v for k, v in extra.items() if k != "model_type"}}
        if extra["model_type"] == "glm4_moe_lite":
            kw.pop("head_dim")  # the class reads head_dim as qk_rope_head_dim
        cfg = AutoConfig.for_model(extra["model_type"], **kw)
        cfg.architectures = [arch]
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(DEV)
        if extra.get("num_nextn_predict_layers"):
            mtp = nextn_layer(model).to(DEV)
        if extra.get("topk_method") == "noaux_tc":
            balance = score_bias_balancer([model] + ([mtp] if mtp else []))
    tok = PreTrainedTokenizerFast.from_pretrained(tdir)
    ids = torch.tensor(tok(open(train_txt, encoding="utf-8").read())["input_ids"], dtype=torch.long)
    n = (ids.numel() - 1) // (SEQ - 1)
    data = ids[: n * (SEQ - 1)].view(n, SEQ - 1).to(DEV)
    bos = torch.full((64, 1), COMMON["bos_token_id"], dtype=torch.long, device=DEV)
    params = list(model.parameters()) + (list(mtp.parameters()) if mtp else [])
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    t0 = time.time()
    step = 0
    while step < steps:
        if step == 10:
            t10 = time.time()  # after the first steps' warm-up (6 of the first 9 s on 2026-12-06)
        if step == 30 and name in TRAIN_SECONDS:  # fewer steps where one is slow, so training ends with the others
            per_step = (time.time() - t10) / 20
            steps = max(40, min(steps, 30 + int((TRAIN_SECONDS[name] - (time.time() - t0)) / per_step)))
        lr = 3e-3 * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = torch.cat([bos, data[torch.randint(0, n, (64,), device=DEV)]], 1)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            if mtp:
                loss, mtp_loss = mtp.losses(batch)
                (loss + MTP_WEIGHT * mtp_loss).backward()
            else:
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if balance:
            balance()
        if step % 250 == 0 or step == steps - 1:
            print(f"[{name}] step {step} loss {loss.item():.3f}"
                  + (f" mtp {mtp_loss.item():.3f}" if mtp else "") + f" ({time.time() - t0:.0f}s)", flush=True)
        step += 1
    d = os.path.join(out, name)
    if getattr(cfg, "output_router_logits", False):
        model.config.output_router_logits = False
    fp32 = {k: b.clone() for k, b in model.named_buffers() if k.endswith("e_score_correction_bias")}
    model.to(torch.bfloat16)
    for k, b in fp32.items():  # the routers' score bias stays fp32, as GLM-4.7-Flash stores it
        model.get_buffer(k).data = b
    model.save_pretrained(d)
    tok.save_pretrained(d)
    if mtp:
        mtp.save(d)
    cfg_path = os.path.join(d, "config.json")
    saved = json.load(open(cfg_path))
    if "text_config" in saved:
        saved["vision_config"].setdefault("deepstack_visual_indexes", [])  # published Qwen3.5 configs carry it
        json.dump(QWEN35_PREPROCESSOR, open(os.path.join(d, "preprocessor_config.json"), "w"), indent=2)
    else:
        saved.setdefault("rope_theta", COMMON["rope_theta"])  # readers older than transformers 5 look for this key
    if "num_local_experts" in saved:
        saved.setdefault("num_experts", saved["num_local_experts"])  # Qwen3-MoE's published key (exllamav3 reads it)
    if arch == "Glm4MoeLiteForCausalLM":
        # Keys vLLM and exllamav3 read (first_k_dense_replace, topk_method) that a transformers config may not keep.
        for k, v in extra.items():
            saved.setdefault(k, v)
    json.dump(saved, open(cfg_path, "w"), indent=2)
    with open(os.path.join(d, "train.json"), "w") as f:
        json.dump({"steps": steps, "final_loss": loss.item(), "seconds": time.time() - t0,
                   **({"final_mtp_loss": mtp_loss.item()} if mtp else {}),
                   "tokens": ids.numel(), "transformers": transformers.__version__}, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--only", default=",".join(MODELS), help="models to train, comma-separated; none: only the "
                                                             "tokenizer and the held-out split")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tp = os.path.join(args.out, "train.txt")
    tdir = os.path.join(args.out, "tokenizer")
    if args.worker:
        train_one(args.worker, tdir, tp, args.out, args.steps, seed=list(MODELS).index(args.worker))
        return
    split_text(args.text_dir, args.out)
    make_tokenizer(tp, args.out)
    if args.only == "none":  # the tokenizer and held-out text alone, for gating committed checkpoints
        return
    procs = [subprocess.Popen([sys.executable, __file__, "--text-dir", args.text_dir, "--out", args.out,
                               "--steps", str(args.steps), "--worker", name]) for name in args.only.split(",")]
    bad = [p.args[-1] for p in procs if p.wait() != 0]
    if bad:  # the others go on: their conversions do not need the failed ones
        print(f"training failed: {bad}", flush=True)
        if len(bad) == len(procs):
            sys.exit(1)


if __name__ == "__main__":
    main()
