"""`exl3-vllm synth`: write a synthetic EXL3 checkpoint from a preset or an HF config.json."""

from __future__ import annotations

import argparse
import sys

from ..format.errors import Exl3FormatError
from .presets import PRESETS


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "synth", help="write a synthetic EXL3 checkpoint (random valid trellis, exllamav3 layout)",
        description="Write a checkpoint that looks like exllamav3's output, with random but valid EXL3 "
                    f"tensors. Presets: {', '.join(PRESETS)}.")
    p.add_argument("--config", required=True, help="preset name or path of an HF config.json (or its directory)")
    p.add_argument("--bits", default="4", help="bits per weight of the decoder linears: 1..8 or 1.5/2.5/3.5 "
                                               "(default 4)")
    p.add_argument("--codebook", default="mul1", help="mul1 (default), mcg or 3inst")
    p.add_argument("--head-bits", default="6", help="bits of lm_head, 16 = unquantized fp16 (default 6)")
    p.add_argument("--embed-bits", default="16", help="bits of the token embedding table, 1..8 (exllamav3's "
                                                     "--embed_bits), 16 = unquantized (default)")
    p.add_argument("--mlp-slices", default="1", help="store each dense MLP's gate/up/down as this many .slice.N "
                                                     "modules, as exllamav3 does for intermediate sizes over 55296")
    p.add_argument("--bits-map", metavar="FILE",
                   help='JSON {"module glob": bits | {"bits": b, "codebook": c}}, first match wins')
    p.add_argument("--seed", default="0", help="random seed (default 0); the same seed gives identical files")
    p.add_argument("--also-dense", metavar="DIR",
                   help="also write the same network with reconstructed dense weights as a plain HF checkpoint")
    p.add_argument("--dense-dtype", default="bfloat16", help="dtype of the dense weights: bfloat16 or float32")
    p.add_argument("--shard-size", metavar="MB", default=None,
                   help="shard size limit in MiB (default 2048, or half the model when smaller)")
    p.add_argument("--overwrite", action="store_true", help="allow non-empty output directories "
                                                            "(synth's own files there are replaced)")
    p.add_argument("--config-only", action="store_true",
                   help="write only config.json (dtype from --dense-dtype) and the tokenizer of the "
                        "unquantized network, no weights (for vLLM's --load-format dummy)")
    p.add_argument("--dry-run", action="store_true", help="print the module plan and write nothing")
    p.add_argument("--out", metavar="DIR", help="output directory")
    p.set_defaults(func=main)
    return p


def _int_arg(value, what: str) -> int:
    try:
        v = int(str(value).strip())
    except ValueError:
        raise Exl3FormatError(f"{what} must be an integer, got {value!r}") from None
    return v


def _print_plan(p) -> None:
    print(f"{'module':<56} {'format':<11} {'K':>4} {'codebook':<8} {'k x n / shape':<18} {'bytes':>12}")
    for m in p.modules:
        if m.kind == "exl3":
            pad = "" if (m.k, m.n) == (m.in_features, m.out_features) else " (padded)"
            print(f"{m.key:<56} {'exl3':<11} {m.bits:>4g} {m.codebook:<8} {f'{m.k}x{m.n}{pad}':<18} {m.nbytes:>12}")
        else:
            shape = "x".join(map(str, m.tensors[0].shape))
            print(f"{m.key:<56} {'unquantized':<11} {'':>4} {'':<8} {shape:<18} {m.nbytes:>12}")
    avg = p.average_bpw
    print(f"{p.arch}: {len(p.exl3_modules())} EXL3 linears, {len(p.modules)} modules, "
          f"{p.total_bytes / 1024 ** 3:.3f} GiB, {avg:.2f} bpw decoder average, head {p.head_bits} bits")


def main(args) -> int:
    from .plan import plan
    from .writer import synthesize, write_config_only

    try:
        seed = _int_arg(args.seed, "--seed")
        shard = None
        if args.shard_size is not None:
            mb = _int_arg(args.shard_size, "--shard-size")
            if mb <= 0:
                raise Exl3FormatError(f"--shard-size must be positive, got {mb}")
            shard = mb * 1024 ** 2
        if args.dry_run:
            _print_plan(plan(args.config, bits=args.bits, codebook=args.codebook, head_bits=args.head_bits,
                             bits_map=args.bits_map, embed_bits=args.embed_bits,
                             mlp_slices=_int_arg(args.mlp_slices, "--mlp-slices")))
            return 0
        if not args.out:
            raise Exl3FormatError("--out DIR is required (or pass --dry-run)")
        if args.config_only:
            write_config_only(args.config, args.out, args.dense_dtype, overwrite=args.overwrite, log=print)
            return 0
        synthesize(args.config, args.out, bits=args.bits, codebook=args.codebook, head_bits=args.head_bits,
                   bits_map=args.bits_map, seed=seed, embed_bits=args.embed_bits, also_dense=args.also_dense, dense_dtype=args.dense_dtype,
                   shard_bytes=shard, overwrite=args.overwrite, log=print,
                   mlp_slices=_int_arg(args.mlp_slices, "--mlp-slices"))
    except Exl3FormatError as e:
        print(f"exl3-vllm synth: error: {e}", file=sys.stderr)
        return 2
    return 0
