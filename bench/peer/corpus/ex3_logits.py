"""exllamav3's own forward on every converted checkpoint: the reference logits of the fidelity gate (GPU machine).

    PYTHONPATH=.peer/src:src python3 bench/peer/corpus/ex3_logits.py --corpus /tmp/corpus/exl3 --hf /tmp/corpus/hf \
        --out /tmp/corpus/ref [--tokens 2048] [--names a,b] [--fixture-out DIR]

Held-out text: /tmp/corpus/hf/heldout.txt (make_models.py), tokenized once; the sequence is BOS + its first
tokens - 1 tokens. Per checkpoint it writes OUT/<name>.pt: {"logits": fp16 [T, vocab]} (exllamav3, fp16, no cache),
and per source model OUT/hf-<model>.pt (transformers, fp32: the unquantized reference). It also decodes a
quantized embedding with exllamav3's kernel and compares it bit for bit with exl3_vllm.format.embedding.
OUT/ex3.json: per checkpoint the config, KL(unquantized || exllamav3), top-1 agreement, embedding check, seconds.
--fixture-out: for the fixture checkpoints, a 32-token held-out prompt with exllamav3's greedy continuation to 96
tokens, and exllamav3's fp16 logits over the whole sequence, as safetensors.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

FIXTURE_TOKENS = 96
FIXTURE_PROMPT = 32


def heldout_ids(hf: str, n: int, out: str) -> torch.Tensor:
    """BOS + the first n - 1 held-out tokens; the 4096 tokens after them go to OUT/greedy_tokens.json."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(hf, "tokenizer"))
    ids = tok(open(os.path.join(hf, "heldout.txt"), encoding="utf-8").read())["input_ids"]
    path = os.path.join(out, "greedy_tokens.json")
    if not os.path.exists(path):  # written once; later runs (one per converted batch) find it
        with open(path + ".tmp", "w") as f:
            json.dump({"tokens": ids[n - 1: n - 1 + 4096]}, f)
        os.replace(path + ".tmp", path)
    return torch.tensor([tok.bos_token_id] + ids[: n - 1], dtype=torch.long)


def kl_top1(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || got) in nats and top-1 agreement over rows of logits."""
    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return kl, (ref.argmax(-1) == got.argmax(-1)).float().mean().item()


def hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        out = m(ids.view(1, -1).cuda()).logits[0].float().cpu()
    del m
    torch.cuda.empty_cache()
    return out


def embedding_check(model, ckpt_dir: str) -> dict | None:
    """exllamav3's decode of every row of a quantized embedding against ours, bit for bit."""
    from exl3_vllm.format.checkpoint import Checkpoint, EmbeddingSpec
    from exl3_vllm.format.embedding import dense_table

    ck = Checkpoint(ckpt_dir)
    spec = next((m for m in ck.modules.values() if isinstance(m, EmbeddingSpec)), None)
    if spec is None:
        return None
    hidden = ck.config.get("hidden_size") or ck.config.get("text_config", {}).get("hidden_size")
    ours = dense_table(ck.tensor(f"{spec.key}.trellis"), ck.tensor(f"{spec.key}.signs"), hidden)
    emb = next(m for m in model.modules if type(m).__name__ == "Embedding")
    ids = torch.arange(spec.rows, dtype=torch.long).view(1, -1)
    with torch.inference_mode():
        theirs = emb.forward(ids, {}).view(spec.rows, -1)[:, :hidden].cpu()
    theirs16 = theirs.half()
    return {"bits": spec.bits, "rows": spec.rows, "exact": bool(torch.equal(theirs16.view(torch.int16),
                                                                            ours.view(torch.int16))),
            "exact_in_out_dtype": bool(torch.equal(theirs16.float(), theirs.float())),
            "max_abs_diff": (theirs.float() - ours.float()).abs().max().item(), "out_dtype": str(theirs.dtype)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--names", default="")
    ap.add_argument("--fixture-out", default="")
    ap.add_argument("--fixture-names", default="llama-recipe-eb4,qwen3-moe-recipe-eb3")
    args = ap.parse_args()
    from exllamav3 import Config, Model
    from ex3_slicing import use_split_of

    os.makedirs(args.out, exist_ok=True)
    ids = heldout_ids(args.hf, args.tokens, args.out)
    if not os.path.exists(os.path.join(args.out, "tokens.pt")):  # the engines may be reading it
        torch.save(ids, os.path.join(args.out, "tokens.pt.tmp"))
        os.replace(os.path.join(args.out, "tokens.pt.tmp"), os.path.join(args.out, "tokens.pt"))
    done = json.load(open(os.path.join(args.corpus, "convert.json")))
    names = args.names.split(",") if args.names else [r["name"] for r in done if r["rc"] == 0]
    refs: dict[str, torch.Tensor] = {}
    summary = []
    for name in names:
        d = os.path.join(args.corpus, name)
        row: dict = {"name": name}
        t0 = time.time()
        try:
            cfg_json = json.load(open(os.path.join(d, "config.json")))
            model_name = next(r["model"] for r in done if r["name"] == name)
            row.update(model=model_name, quantization_config=cfg_json.get("quantization_config"))
            hf_path = os.path.join(args.out, f"hf-{model_name}.pt")
            if not os.path.isdir(os.path.join(args.hf, model_name)):  # a committed fixture: no source model here
                refs[model_name] = None
            elif model_name not in refs and os.path.exists(hf_path):
                refs[model_name] = torch.load(hf_path)["logits"]
            elif model_name not in refs:
                refs[model_name] = hf_logits(os.path.join(args.hf, model_name), ids)
                torch.save({"logits": refs[model_name]}, hf_path + ".tmp")
                os.replace(hf_path + ".tmp", hf_path)
            use_split_of(d)
            cfg = Config.from_directory(d)
            model = Model.from_config(cfg)
            model.load(device="cuda:0")
            vocab = cfg_json.get("vocab_size") or cfg_json["text_config"]["vocab_size"]
            with torch.inference_mode():
                logits = model.forward(ids.view(1, -1), {})[0, :, :vocab].float().cpu()
                fix = None
                if args.fixture_out and (args.fixture_names == "all" or name in args.fixture_names.split(",")):
                    # A held-out prompt, then exllamav3's own greedy continuation (one full forward per token).
                    seq = ids[:FIXTURE_PROMPT].view(1, -1)
                    while seq.shape[1] < FIXTURE_TOKENS:
                        nxt = model.forward(seq, {})[0, -1, :vocab].float().argmax().view(1, 1).cpu()
                        seq = torch.cat([seq, nxt], 1)
                    fix = (seq[0], model.forward(seq, {})[0, :, :vocab].half().cpu())
            row["embedding"] = embedding_check(model, d)
            model.unload()
            del model
            torch.cuda.empty_cache()
            torch.save({"logits": logits.half()}, os.path.join(args.out, f"{name}.pt"))
            row["finite"] = bool(torch.isfinite(logits).all())
            if refs[model_name] is not None:
                kl, top1 = kl_top1(refs[model_name], logits)
                row.update(kl_vs_unquantized=kl, top1_vs_unquantized=top1)
            if fix is not None:
                from safetensors.torch import save_file

                os.makedirs(args.fixture_out, exist_ok=True)
                save_file({"input_ids": fix[0].to(torch.int32).contiguous(), "logits": fix[1].contiguous()},
                          os.path.join(args.fixture_out, f"{name}.exllamav3-logits.safetensors"),
                          metadata={"source": "exllamav3 1.6.5 Model.forward, fp16, no cache", "model": name,
                                    "prompt_tokens": str(FIXTURE_PROMPT),
                                    "greedy": "tokens after the prompt are exllamav3's argmax"})
        except Exception as e:  # noqa: BLE001 - one broken checkpoint must not stop the corpus
            row["error"] = f"{type(e).__name__}: {e}"
        row["seconds"] = round(time.time() - t0, 1)
        print("[ex3]", json.dumps({k: v for k, v in row.items() if k != "quantization_config"}), flush=True)
        summary.append(row)
    record = os.path.join(args.out, "ex3.json")
    earlier = [r for r in json.load(open(record)) if r["name"] not in names] if os.path.exists(record) else []
    with open(record + ".tmp", "w") as f:  # the engines (gate_vllm.py --follow) poll it
        json.dump(earlier + summary, f, indent=1)
    os.replace(record + ".tmp", record)


if __name__ == "__main__":
    main()
