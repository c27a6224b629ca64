"""tests/data/exllamav3/embedding_rows.safetensors: random quantized-embedding rows (K = 1..8, hidden 640, so the
last 256-group is partly padding) and exllamav3 1.6.5's own decode of them (its reference decoder,
modules/quant/exl3_lib/ngram_codec.py `dequant_rows`, run on the CPU; no GPU needed).

    python3 bench/peer/make_embedding_fixture.py [--src .peer/src] [--out tests/data/exllamav3]

exllamav3's source is read from .peer/src (see bench/README.md, "Peer harness"); none of it is copied.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import torch
from safetensors.torch import save_file

HIDDEN, ROWS, GROUP = 640, 6, 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=".peer/src")
    ap.add_argument("--out", default="tests/data/exllamav3")
    a = ap.parse_args()
    path = os.path.join(a.src, "exllamav3", "modules", "quant", "exl3_lib", "ngram_codec.py")
    spec = importlib.util.spec_from_file_location("exl3_ngram_codec", path)
    codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec)
    gen = torch.Generator().manual_seed(641)
    groups = -(-HIDDEN // GROUP)
    tensors = {}
    for k in range(1, 9):
        words = torch.randint(-32768, 32768, (ROWS, groups, 1 + 16 * k), generator=gen, dtype=torch.int32)
        words = words.to(torch.int16)
        scale = (torch.rand(ROWS, groups, generator=gen) * 0.06 + 0.002).half()
        words[..., 0] = scale.view(torch.int16)
        signs = (torch.randint(0, 2, (groups, GROUP), generator=gen) * 2 - 1).half()
        rows = codec.dequant_rows(words.view(ROWS * groups, -1), k, codec.mul1_codebook("cpu"),
                                  signs=signs.repeat(ROWS, 1)).half().view(ROWS, groups * GROUP)[:, :HIDDEN]
        tensors.update({f"k{k}.trellis": words.view(ROWS, -1).contiguous(), f"k{k}.signs": signs,
                        f"k{k}.rows": rows.contiguous()})
    save_file(tensors, os.path.join(a.out, "embedding_rows.safetensors"),
              metadata={"source": "exllamav3 1.6.5 ngram_codec.dequant_rows (CPU)", "hidden": str(HIDDEN)})


if __name__ == "__main__":
    main()
