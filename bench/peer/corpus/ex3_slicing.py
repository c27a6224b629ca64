"""exllamav3 stores MLPs wider than its MAX_MLP_INTERMEDIATE (55,296) as `.slice.N` modules. The corpus makes such
checkpoints from its small models by lowering that bound in the converter and, per checkpoint, in exllamav3's
forward: its MLP classes take the bound as a default argument, so the default is what changes.

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
