"""`exl3-vllm inspect DIR`: what a checkpoint holds, from its headers alone."""

from __future__ import annotations

import argparse
import json
import sys

from .format.checkpoint import Checkpoint, DenseSpec, EmbeddingSpec, Exl3Spec


def summary(ckpt: Checkpoint) -> dict:
    """Machine-readable description of a checkpoint (the --json output)."""
    modules = []
    for key in sorted(ckpt.modules):
        m = ckpt.modules[key]
        if isinstance(m, Exl3Spec):
            modules.append({"key": key, "format": "exl3", "bits": m.bits, "codebook": m.codebook,
                            "k": m.k, "n": m.n, "bias": m.has_bias, "legacy_signs": m.legacy_signs,
                            "padded_from": m.padded_from, "bytes": m.nbytes})
        elif isinstance(m, EmbeddingSpec):
            modules.append({"key": key, "format": "exl3-embedding", "bits": m.bits, "codebook": "mul1",
                            "rows": m.rows, "hidden": m.hidden, "bytes": m.nbytes})
        else:
            modules.append({"key": key, "format": "unquantized", "shape": list(m.shape),
                            "dtype": m.tensors["weight"].dtype if "weight" in m.tensors else None,
                            "bytes": m.nbytes})
    exl3 = ckpt.exl3_modules()
    heads = [m for m in exl3 if ckpt.is_head(m.key)]
    total = sum(t.nbytes for t in ckpt.tensors.values())
    embeds = [m for m in ckpt.modules.values() if isinstance(m, EmbeddingSpec)]
    # Modules config's bits does not cover, with the bits the config states for them.
    apart = {}
    # MTP layers: Qwen3.5's mtp.*, or DeepSeek-style decoder layers numbered from num_hidden_layers on.
    for name, key, part_of in (("MTP layers", "mtp_bits", lambda k: "mtp" in k.split(".") or ckpt.nextn_layer(k)),
                               ("vision tower", "vision_bits", lambda k: "visual" in k.split("."))):
        mods = [m for m in exl3 if part_of(m.key)]
        if mods or key in ckpt.quantization_config:
            w = sum(m.k * m.n for m in mods)
            apart[name] = {"config": ckpt.quantization_config.get(key), "modules": len(mods),
                           "average_bpw": sum(m.bits * m.k * m.n for m in mods) / w if w else None}
    return {
        "path": ckpt.path,
        "config_bits": ckpt.quantization_config.get("bits"),
        "average_bpw": ckpt.average_bpw(),
        "head_bits": heads[0].bits if heads else None,
        "apart": apart,
        "embedding_bits": embeds[0].bits if embeds else None,
        "model_bpw": ckpt.model_bpw(),
        "exl3_modules": len(exl3),
        "unquantized_modules": sum(isinstance(m, DenseSpec) for m in ckpt.modules.values()),
        "exl3_bytes": sum(m.nbytes for m in exl3) + sum(m.nbytes for m in embeds),
        "total_bytes": total,
        "codebooks": sorted({m.codebook for m in exl3}),
        "warnings": ckpt.warnings,
        "unsupported": [f"{what}: {why}" for what, why in ckpt.unsupported],
        "modules": modules,
    }


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def render(s: dict) -> str:
    lines = [f"{'module':<56} {'format':<11} {'K':>4} {'codebook':<8} {'k x n / shape':<18} {'bytes':>11}"]
    for m in s["modules"]:
        if m["format"] == "exl3":
            dims = f"{m['k']}x{m['n']}"
            lines.append(f"{m['key']:<56} {'exl3':<11} {m['bits']:>4g} {m['codebook']:<8} {dims:<18} "
                         f"{_fmt_bytes(m['bytes']):>11}")
        elif m["format"] == "exl3-embedding":
            dims = f"{m['rows']}x{m['hidden']}"
            lines.append(f"{m['key']:<56} {'exl3-embed':<11} {m['bits']:>4g} {m['codebook']:<8} {dims:<18} "
                         f"{_fmt_bytes(m['bytes']):>11}")
        else:
            dims = "x".join(map(str, m["shape"]))
            lines.append(f"{m['key']:<56} {'unquantized':<11} {'':>4} {'':<8} {dims:<18} {_fmt_bytes(m['bytes']):>11}")
    avg = s["average_bpw"]
    lines.append("")
    lines.append(f"EXL3 modules: {s['exl3_modules']}, unquantized: {s['unquantized_modules']}, "
                 f"codebooks: {', '.join(s['codebooks']) or '-'}")
    lines.append(f"average bpw (decoder linears): {avg:.2f}" if avg is not None else "average bpw: n/a")
    if s["head_bits"] is not None:
        lines.append(f"head bits: {s['head_bits']:g}")
    if s["embedding_bits"] is not None:
        lines.append(f"embedding bits: {s['embedding_bits']:g}")
    for name, a in s["apart"].items():
        got = f"{a['modules']} EXL3 modules, {a['average_bpw']:.2f} bpw" if a["modules"] else "unquantized"
        lines.append(f"{name}: {got} (config: {a['config'] if a['config'] is not None else 'not stated'})")
    if s["model_bpw"] is not None:
        lines.append(f"bpw over every weight matrix (decoder, head, embedding; 16 where unquantized): "
                     f"{s['model_bpw']:.2f}")
    lines.append(f"config bits: {s['config_bits']}")
    lines.append(f"size: {_fmt_bytes(s['total_bytes'])} ({_fmt_bytes(s['exl3_bytes'])} EXL3)")
    for w in s["warnings"]:
        lines.append(f"warning: {w}")
    for u in s["unsupported"]:
        lines.append(f"not servable by vLLM: {u}")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe an EXL3 checkpoint (headers only)")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verify", action="store_true", help="also read the data the headers cannot vouch for: every "
                                                          "scale vector, bias, unquantized weight and embedding row "
                                                          "scale finite, no zero-filled hole in a trellis, and each "
                                                          "file's sha256 where a Hugging Face download recorded one "
                                                          "(reads every byte)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    ck = Checkpoint(args.path)
    s = summary(ck)
    if args.verify:
        ck.verify()
        s["verified"] = True
    if args.json:
        json.dump(s, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render(s))
        if args.verify:
            print("verify: every scale, bias, unquantized weight and embedding row scale is finite, no trellis "
                  "has a hole, and every recorded checksum matches")
    return 1 if ck.unsupported else 0
