"""Runs one vLLM engine (the CPU one in CI) in its own process and prints its results as JSON.

Usage: python vllm_runner.py MODEL_DIR DTYPE PROMPTS_JSON MAX_TOKENS [TP [LLM_KWARGS_JSON]]
LLM_KWARGS_JSON adds or overrides LLM(...) arguments, e.g. {"enable_expert_parallel": true}.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def live_heads(worker) -> int:
    """Output heads alive in the worker's process: a draft's own head, replaced by the model's after loading, must
    have been freed (vLLM freezes the collector's heap after start-up: unfreeze it to count what is left)."""
    import gc

    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    gc.unfreeze()
    gc.collect()
    return sum(isinstance(o, ParallelLMHead) for o in gc.get_objects())

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model, dtype, prompts, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    # Tensor parallelism needs worker processes; one rank runs in this process.
    kwargs = {"distributed_executor_backend": "uni"} if tp == 1 else {"tensor_parallel_size": tp}
    kwargs.update(json.loads(sys.argv[6]) if len(sys.argv) > 6 else {})
    # VLLM_RUNNER_EXTRA (JSON): the machine's overrides, e.g. on a shared GPU a fixed KV cache and CUDA graphs.
    kwargs.update(json.loads(os.environ.get("VLLM_RUNNER_EXTRA") or "{}"))
    # "full_prompt_logprobs": N also returns the whole distribution (N = the vocabulary) at every prompt position.
    full = kwargs.pop("full_prompt_logprobs", 0)
    # "full_decode_logprobs": N the same at every generated position (with speculative decoding: the verifier's).
    full_decode = kwargs.pop("full_decode_logprobs", 0)
    if full or full_decode:
        kwargs["max_logprobs"] = max(full, full_decode)
    # "one_at_a_time": also generate each prompt alone (concurrency 1) in the same engine, as "alone_tokens".
    alone = kwargs.pop("one_at_a_time", False)
    if kwargs.get("speculative_config"):
        kwargs.setdefault("disable_log_stats", False)  # the spec-decode counters reported below
    llm = LLM(model=model, dtype=dtype, seed=0, **{"max_model_len": 256, "max_num_seqs": 8, "enforce_eager": True,
                                                    **kwargs})
    # A prompt {"prompt": ..., "noise_image": [seed, side]} carries a side x side RGB noise image (vision towers).
    for i, pr in enumerate(prompts):
        if isinstance(pr, dict) and "noise_image" in pr:
            import numpy as np
            from PIL import Image

            seed, side = pr.pop("noise_image")
            pixels = (np.random.RandomState(seed).rand(side, side, 3) * 255).astype("uint8")
            prompts[i] = {**pr, "multi_modal_data": {"image": Image.fromarray(pixels)}}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=full_decode or 1, prompt_logprobs=full or 1,
                            detokenize=not (full or full_decode))
    results = []
    for out in llm.generate(prompts, params):
        prompt_lp = []
        for tok, lp in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [None])[1:]):
            prompt_lp.append(lp[tok].logprob if lp and tok in lp else None)
        results.append({"prompt_ids": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids),
                        "prompt_logprobs": prompt_lp})
        if full:
            results[-1]["prompt_dists"] = [[[t, v.logprob] for t, v in lp.items()] for lp in out.prompt_logprobs[1:]]
        if full_decode:
            results[-1]["decode_dists"] = [[[t, v.logprob] for t, v in lp.items()] for lp in out.outputs[0].logprobs]
    if alone:
        for r, p in zip(results, prompts):
            r["alone_tokens"] = list(llm.generate([p], params)[0].outputs[0].token_ids)
    if kwargs.get("speculative_config"):
        counts = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
        results[0]["spec_decode"] = {k: v for k, v in counts.items() if isinstance(v, (int, float))}
        results[0]["live_heads"] = llm.collective_rpc(live_heads)[0]
    print("RESULT " + json.dumps(results), flush=True)
