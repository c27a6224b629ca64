"""exllamav3 stores MLPs wider than its MAX_MLP_INTERMEDIATE (55,296) as `.slice.N` modules. The corpus makes such
checkpoints from its small models by lowering that bound in the converter and, per checkpoint, in exllamav3's
forward: its MLP classes take the bound as a default argument, so the default is what changes.

exllamav3 1.6.5 loads each unquantized slice as the whole checkpoint tensor and LinearFP16 is meant to cut the
slice out of it, but its test is inverted (modules/quant/fp16.py: `weight.shape[0] < in_features`, never true for a
full tensor), so every slice keeps the full weight and the converter's first slice forward fails in hgemm ("b and c
have incompatible shapes"). set_split therefore also cuts the slice out before LinearFP16 sees the weight.

    python3 bench/peer/corpus/ex3_slicing.py 256 exllamav3.conversion.convert_model ARGS...   # the converter, sliced
"""
from __future__ import annotations

import inspect
import json
import math
import os
import re
import struct

DEFAULT = 55296  # exllamav3 1.6.5's constants.MAX_MLP_INTERMEDIATE


def set_split(n: int) -> None:
    """MLPs built from now on are sliced when wider than n."""
    from exllamav3.modules import mlp

    for cls in (mlp.MLP, mlp.GatedMLP):
        f = cls.__init__
        names = [p.name for p in inspect.signature(f).parameters.values()
                 if p.default is not inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
        d = list(f.__defaults__)
        d[names.index("intermediate_split_size")] = n
        f.__defaults__ = tuple(d)
    fix_fp16_slices()


def fix_fp16_slices() -> None:
    """Give exllamav3's LinearFP16 only its slice of a full (in, out) weight (see the module docstring)."""
    from exllamav3.modules.quant import fp16

    init = fp16.LinearFP16.__init__
    if getattr(init, "_slices_fixed", False):
        return

    def __init__(self, in_features, out_features, weight, bias, full_in_features=None, full_out_features=None,
                 first_in_feature=None, first_out_feature=None, *args, **kwargs):
        a, b = first_in_feature or 0, first_out_feature or 0
        if full_in_features and in_features < full_in_features == weight.shape[0]:
            weight = weight[a:a + in_features, :]
        if full_out_features and out_features < full_out_features == weight.shape[1]:
            weight = weight[:, b:b + out_features]
            if bias is not None and bias.shape[-1] == full_out_features:
                bias = bias[..., b:b + out_features]
        init(self, in_features, out_features, weight, bias, full_in_features, full_out_features,
             first_in_feature, first_out_feature, *args, **kwargs)

    __init__._slices_fixed = True
    fp16.LinearFP16.__init__ = __init__


_current = DEFAULT


def use_split_of(ckpt: str) -> None:
    """Before exllamav3 builds the model of ckpt: slice its MLPs as they are stored (a no-op for unsliced ones
    while nothing was changed)."""
    global _current
    n = split_for(ckpt)
    if n != _current:
        set_split(n)
        _current = n


def split_for(ckpt: str) -> int:
    """The bound under which exllamav3 slices this checkpoint's MLPs as they are stored (DEFAULT if unsliced)."""
    slices = set()
    for f in os.listdir(ckpt):
        if f.endswith(".safetensors"):
            with open(os.path.join(ckpt, f), "rb") as fh:
                header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            slices |= {int(m.group(1)) for k in header if (m := re.search(r"layers\.0\.mlp\.\w+\.slice\.(\d+)\.", k))}
    if not slices:
        return DEFAULT
    inter = json.load(open(os.path.join(ckpt, "config.json")))["intermediate_size"]
    return math.ceil(inter / (max(slices) + 1))


if __name__ == "__main__":
    import runpy
    import sys

    set_split(int(sys.argv[1]))
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
