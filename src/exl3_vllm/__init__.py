"""exl3-vllm: serve EXL3 (exllamav3 trellis-quantized) checkpoints with stock vLLM."""

__version__ = "0.1.0"
