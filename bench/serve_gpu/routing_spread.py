"""How many distinct experts an MoE model's decode steps touch: the router's top-k over the batch's rows, per layer.

A served MoE step reads the weights of every expert some row routes to, so its time follows this count. Models with
no weights (`--load-format dummy`, how the bf16 / FP8 / GPTQ kinds are served) need not route like trained or
synthetic ones; this measures it, in vLLM, here on the CPU engine (in-process, eager):
    python bench/serve_gpu/routing_spread.py --model DIR [--dummy] --concurrency 16 --out spread.json
It prints, per phase, the mean distinct experts per layer and step, beside what uniform routing gives.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys


def uniform_distinct(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts when each of `rows` tokens picks top_k distinct experts uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="--load-format dummy (no weights)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--in-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--out")
    a = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # hooks must live in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams

    cfg = json.load(open(os.path.join(a.model, "config.json")))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
    top_k = cfg["num_experts_per_tok"]
    llm = LLM(a.model, load_format="dummy" if a.dummy else "auto", dtype=a.dtype, enforce_eager=True,
              max_model_len=a.in_len + a.decode_tokens + 8, max_num_seqs=a.concurrency,
              max_num_batched_tokens=max(a.concurrency * a.in_len, 256), enable_prefix_caching=False, seed=0)
    steps: list[tuple[int, int]] = []  # (rows, distinct experts), one per router call

    def hook(_mod, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        ids = logits.float().topk(top_k, dim=-1).indices
        steps.append((ids.shape[0], int(torch.unique(ids).numel())))

    def install(model):
        n = 0
        for name, mod in model.named_modules():
            if name.endswith("mlp.gate") or name.endswith("block_sparse_moe.gate"):
                mod.register_forward_hook(hook)
                n += 1
        return n

    routers = sum(llm.apply_model(install))
    if not routers:
        sys.exit("no router modules (*.mlp.gate) found")
    rng = random.Random(0)
    vocab = cfg["vocab_size"]
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(a.in_len)]}
               for _ in range(a.concurrency)]
    params = SamplingParams(max_tokens=a.decode_tokens, ignore_eos=True, temperature=a.temperature, seed=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    decode = [d for r, d in steps if r == a.concurrency]
    prefill = [(r, d) for r, d in steps if r > a.concurrency]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    res = {
        "model": a.model, "dummy": a.dummy, "dtype": a.dtype, "experts": experts, "top_k": top_k,
        "routers": routers, "concurrency": a.concurrency, "temperature": a.temperature,
        "decode_steps": len(decode) // routers,
        "decode_distinct_mean": sum(decode) / max(len(decode), 1),
        "decode_distinct_min": min(decode, default=0), "decode_distinct_max": max(decode, default=0),
        "decode_uniform": uniform_distinct(experts, top_k, a.concurrency),
        "prefill_distinct_mean": sum(d for _, d in prefill) / max(len(prefill), 1),
        "prefill_uniform": (sum(uniform_distinct(experts, top_k, r) for r, _ in prefill) / max(len(prefill), 1)),
        "distinct_generated_tokens_per_step": sum(len({t[i] for t in tokens}) for i in range(a.decode_tokens))
        / a.decode_tokens,
    }
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
