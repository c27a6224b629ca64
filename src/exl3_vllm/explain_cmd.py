"""`exl3-vllm explain DIR`: for every kernel call a checkpoint's linear layers make, the path the static dispatch takes
at each batch size M and why the paths ranked before it were passed over; and which paths the measured dispatch
times there on a GPU (it keeps the fastest, kernels/tune.py). No GPU needed."""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

from .format.checkpoint import Checkpoint, Exl3Spec
from .format.codebook import Codebook
from .plugin.names import DEFAULT_PACKED, shard_groups

# Row-parallel under tensor parallelism: their k is split across ranks, every other linear's n.
_ROW_PARALLEL = ("o_proj", "down_proj", "dense", "out_proj", "w2")


def kernel_calls(ck: Checkpoint, tp: int = 1) -> dict[tuple, list[str]]:
    """(k, n_total, bits, codebook id, shard widths) of each kernel call, per rank -> the modules making it. Fused
    as vLLM fuses them (q/k/v, gate/up); routed experts are left out (their dispatch is the MoE op's)."""
    specs = {k: s for k, s in ck.modules.items() if isinstance(s, Exl3Spec) and ".experts." not in k}
    layers, used = [], set()
    for key in sorted(specs):
        parent, _, leaf = key.rpartition(".")
        for names in DEFAULT_PACKED.values():
            keys = [f"{parent}.{n}" if parent else n for n in names]
            if leaf == names[0] and all(k in specs for k in keys):
                layers.append(keys)
                used.update(keys)
    layers += [[k] for k in sorted(specs) if k not in used]
    calls: dict[tuple, list[str]] = {}
    for keys in layers:
        row = keys[0].rpartition(".")[2] in _ROW_PARALLEL
        for g in shard_groups([specs[k] for k in keys]):
            s = [specs[keys[i]] for i in g]
            k = s[0].k // tp if row else s[0].k
            sizes = tuple(x.n if row else x.n // tp for x in s)
            calls.setdefault((k, sum(sizes), s[0].bits, int(Codebook.of(s[0].codebook)), sizes), []).extend(
                keys[i] for i in g)
    return calls


def explain(ck: Checkpoint, ms: list[int], arch: int = 90, sms: int = 132, smem: int = 227 * 1024,
            tp: int = 1) -> list[dict]:
    import math

    from .kernels import dispatch, tune

    dev = SimpleNamespace(arch=arch, smem_limit=smem, sms=sms)
    experts = sum(1 for k, s in ck.modules.items() if isinstance(s, Exl3Spec) and ".experts." in k)
    out = []
    for (k, n, bits, codebook, sizes), mods in sorted(kernel_calls(ck, tp).items()):
        rows = []
        for m in ms:
            p = dispatch.plan(m, k, n, bits, sms, smem, codebook, arch, math.gcd(*sizes))
            rows.append({"m": m, "path": p.path, "tier": p.tier or "-", "splits": p.splits,
                         "stream_k": p.stream or "-", "passed_over": dispatch.passed_over(m, k, bits, codebook, arch, smem),
                         "timed_on_gpu": [str(c) for c in tune.candidates(dev, m, k, bits, codebook, math.gcd(*sizes))]
                         if tune.enabled() else []})
        out.append({"k": k, "n": n, "bits": bits, "codebook": codebook, "shards": list(sizes),
                    "modules": len(mods), "example": mods[0], "rows": rows, "experts": experts})
    return out


def render(calls: list[dict], arch: int, sms: int, tp: int) -> str:
    lines = [f"static dispatch on sm_{arch} with {sms} SMs, tensor_parallel_size={tp} (per rank); a GPU's measured "
             "dispatch keeps the fastest of the 'timed' column"]
    experts = calls[0]["experts"] if calls else 0
    if experts:
        lines.append(f"(routed experts, {experts} modules, are dispatched by the MoE op and not shown)")
    for c in calls:
        lines.append(f"\n{c['k']}x{c['n']} K={c['bits']:g} {Codebook(c['codebook']).label} shards {c['shards']}: "
                     f"{c['modules']} modules, e.g. {c['example']}")
        lines.append(f"  {'M':>5} {'path':<7} {'tier':<6} {'splits':>6} {'stream':>6}  passed over | timed on a GPU")
        for r in c["rows"]:
            lines.append(f"  {r['m']:>5} {r['path']:<7} {r['tier']:<6} {r['splits']:>6} {str(r['stream_k']):>6}  "
                         f"{'; '.join(r['passed_over']) or '-'} | timed: {', '.join(r['timed_on_gpu']) or '-'}")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="which kernel path each linear layer takes at each batch size, and why")
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--m", default="1,4,8,16,32,64,128,256,1024", help="batch sizes (rows), comma-separated")
    p.add_argument("--arch", type=int, default=90, help="SM architecture, e.g. 90 (H100/H200), 89, 80")
    p.add_argument("--sms", type=int, default=132, help="streaming multiprocessors (H100/H200 SXM: 132)")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (shapes per rank)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    ms = [int(x) for x in args.m.split(",") if x.strip()]
    calls = explain(Checkpoint(args.path), ms, args.arch, args.sms, tp=args.tp)
    if args.json:
        json.dump(calls, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render(calls, args.arch, args.sms, args.tp))
    return 0
