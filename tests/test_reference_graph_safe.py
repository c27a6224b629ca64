"""The format reference is CUDA-graph safe after its first call: no host tensor reaches a device op.

vLLM captures EXL3_VLLM_BACKEND=reference inside CUDA graphs, where a host-to-device copy fails. On
this CPU machine the "meta" device stands in for the GPU: any CPU tensor in an op on meta tensors is
such a copy.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from exl3_vllm.format.linear import linear


class HostTensorSpy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in tree_leaves((args, kwargs))):
            self.seen.append(str(func))
        return func(*args, **kwargs)


def _call(width_bits: int, codebook: str, shards):
    k, n = 256, sum(shards)
    trellis = torch.empty(k // 16, n // 16, 16 * width_bits, dtype=torch.int16, device="meta")
    suh = torch.empty(len(shards), k, dtype=torch.float16, device="meta")
    svh = torch.empty(n, dtype=torch.float16, device="meta")
    x = torch.empty(5, k, dtype=torch.bfloat16, device="meta")
    return linear(x, trellis, suh, svh, codebook, bias=torch.empty(n, dtype=torch.float16, device="meta"),
                  shard_sizes=shards, out_dtype=torch.bfloat16)


def test_reference_linear_makes_no_host_copies_after_first_call():
    for bits, codebook in ((4, "mul1"), (3, "mcg"), (2, "3inst")):
        _call(bits, codebook, [256, 128])  # warm-up: vLLM's profile run does this before capture
        with HostTensorSpy() as spy:
            y = _call(bits, codebook, [256, 128])
        assert y.shape == (5, 384) and y.device.type == "meta"
        assert spy.seen == [], f"K={bits} {codebook}: host tensors in {spy.seen}"
