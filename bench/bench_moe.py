"""Benchmark one EXL3 MoE layer (kmoe.moe_cuda) against a bf16 torch grouped-GEMM MoE on the GPU, with floors.

Shapes default to Qwen3-30B-A3B: hidden 2048, moe intermediate 768, 128 experts, top-8, SwiGLU.

Each point: a CUDA graph of --calls calls (bench_linear.graph_time), each on a different copy of the layer's
weights (copies rotate through >= --pool-gb, at least 4 EXL3 / 3 bf16 copies, so the 60 MiB L2 never holds the
routed experts) and each with its own fresh uniform routing (distinct experts per token, pre-generated outside
the timed region); the per-call time is the median replay time / calls over --reps replays.

bf16 baseline 1 (torch grouped GEMM, bf16_us): sort the T*topk (token, expert) pairs by expert inside
the graph (torch.sort stable + searchsorted for the int32 group end offsets, no host sync), gather rows,
torch._grouped_mm(x_sorted, w13) -> silu(gate) * up -> torch._grouped_mm(., w2), scatter the rows back to
(token, slot) order (index_copy_) and sum the slots weighted by the router weights with one bmm (fp32
accumulate, bf16 out). The B-operand layout ([E, K, N] row-major or an [E, N, K] tensor passed transposed) is
probed on a tiny problem against an fp32 per-expert reference and, where both run, the faster one on the real
shape is kept. Fallbacks: routing sorted on the host side of the graph ("presorted"), or a per-expert torch.mm
loop over host-computed routing ("loop").

bf16 baseline 2 (vllm_us, --vllm auto): vLLM's own fused MoE Triton kernel,
vllm.model_executor.layers.fused_moe.fused_moe.fused_experts(x, w1 [E, 2I, H], w2 [E, H, I], topk_weights fp32,
topk_ids int32) inside set_current_vllm_config(VllmConfig()), when vLLM imports, matches the fp32 reference on a tiny
problem and captures in a CUDA graph; otherwise the reason goes into the md header and the column stays empty.

    python bench/bench_moe.py                                  # default grid, 4:mul1 and 4:mcg
    python bench/bench_moe.py --tokens 1,16,256 --configs 4:mul1
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import CB, copies_for, graph_time, measure_ceilings  # noqa: E402  (also puts src/ on sys.path)
from provenance import git_commit, gpu_name  # noqa: E402
from exl3_vllm.kernels import clock  # noqa: E402
from exl3_vllm.kernels import op as kop  # noqa: E402
from decode_floor import decode_floor  # noqa: E402

ALL_T = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
LIGHT_T = 256  # rows with T <= this wait for a rested SM clock (see bench/README.md, measurement notes)
FIELDS = ["config", "K", "cb", "T", "distinct_experts", "ours_us", "bf16_us", "speedup", "vllm_us", "speedup_vllm", "GBps", "TFLOPs",
          "floor_us", "pct_floor", "decode_only_us", "bf16_path", "sm_mhz", "bf16_sm_mhz", "vllm_sm_mhz", "commit",
          "device", "error"]


# ----------------------------------------------------------------------------------------------------------
# routing


def make_routing(t, n_experts, topk, dev):
    """Uniform routing with distinct experts per token; weights = softmax of random logits."""
    ids = torch.rand(t, n_experts, device=dev).topk(topk, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(t, topk, device=dev), dim=1).float()
    return ids.contiguous(), w.contiguous()


def distinct_experts(ids, n_experts):
    hit = torch.zeros(n_experts, device=ids.device)
    hit.index_fill_(0, ids.reshape(-1).long(), 1.0)
    return hit.sum()


# ----------------------------------------------------------------------------------------------------------
# bf16 baseline


def bf16_route(ids, e_range):
    """(order, token of each sorted pair, int32 group end offsets); no host sync."""
    vals, order = torch.sort(ids.reshape(-1), stable=True)
    offs = torch.searchsorted(vals, e_range, right=True, out_int32=True)
    tok = torch.div(order, ids.shape[1], rounding_mode="floor")
    return order, tok, offs


def bf16_compute(x, w, route, w13, w2, inter):
    """w13 [E, H, 2I], w2 [E, I, H] (any strides _grouped_mm takes); returns [T, H] bf16."""
    order, tok, offs = route
    t, topk = w.shape
    xs = x.index_select(0, tok)
    h = torch._grouped_mm(xs, w13, offs=offs)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2, offs=offs)
    yu = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
    return torch.bmm(w.to(x.dtype).unsqueeze(1), yu.view(t, topk, -1)).squeeze(1)


def bf16_moe(x, ids, w, w13, w2, inter, e_range):
    return bf16_compute(x, w, bf16_route(ids, e_range), w13, w2, inter)


def loop_plan(ids, w, n_experts):
    """Host-side routing for the per-expert loop: [(expert, rows, weights)] of the experts hit."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    tok = torch.div(order, ids.shape[1], rounding_mode="floor")
    ws = w.reshape(-1)[order]
    plan, s = [], 0
    for e, c in enumerate(counts):
        if c:
            plan.append((e, tok[s:s + c], ws[s:s + c]))
            s += c
    return plan


def loop_moe(x, plan, w13, w2, inter):
    out = torch.zeros(x.shape[0], w2.shape[-1], dtype=torch.float32, device=x.device)
    for e, rows, ws in plan:
        h = x.index_select(0, rows) @ w13[e]
        a = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, rows, (a @ w2[e]).float() * ws[:, None])
    return out.to(x.dtype)


def ref_moe(x, ids, w, w13, w2, inter):
    """fp32 per-(token, slot) reference."""
    out = torch.zeros(x.shape[0], w2.shape[-1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = xf[t] @ w13[e].float()
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += float(w[t, j]) * (a @ w2[e].float())
    return out


def bf16_weights(layout, n_experts, hidden, inter, dev, scale=0.02):
    """(storage, w13 view [E, H, 2I], w2 view [E, I, H]). layout 'kn': row-major [E, K, N];
    'nk': stored [E, N, K] (nn.Linear order, K contiguous) and passed transposed."""
    if layout == "kn":
        a = torch.randn(n_experts, hidden, 2 * inter, device=dev, dtype=torch.bfloat16) * scale
        b = torch.randn(n_experts, inter, hidden, device=dev, dtype=torch.bfloat16) * scale
        return (a, b), a, b
    a = torch.randn(n_experts, 2 * inter, hidden, device=dev, dtype=torch.bfloat16) * scale
    b = torch.randn(n_experts, hidden, inter, device=dev, dtype=torch.bfloat16) * scale
    return (a, b), a.transpose(1, 2), b.transpose(1, 2)


def probe_baseline(dev, args, log):
    """Pick the baseline: ('grouped', layouts that pass, capture mode) or ('loop', ...)."""
    if args.baseline == "loop":
        log.append("baseline forced to the per-expert loop (--baseline loop)")
        return "loop", [], None
    if not hasattr(torch, "_grouped_mm"):
        log.append("torch has no _grouped_mm: per-expert loop baseline")
        return "loop", [], None
    torch.manual_seed(1)
    e_small, h_small, i_small, t_small, k_small = 4, 64, 32, 6, 2
    # expert 2 is never routed (an empty group); groups have unaligned sizes
    ids = torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [1, 0], [3, 1]], dtype=torch.int32, device=dev)
    w = torch.softmax(torch.randn(t_small, k_small, device=dev), 1)
    x = torch.randn(t_small, h_small, device=dev, dtype=torch.bfloat16)
    e_range = torch.arange(e_small, dtype=torch.int32, device=dev)
    ok = []
    layouts = ("nk", "kn") if args.layout == "auto" else (args.layout,)
    for layout in layouts:
        try:
            _, w13, w2 = bf16_weights(layout, e_small, h_small, i_small, dev, scale=0.2)
            y = bf16_moe(x, ids, w, w13, w2, i_small, e_range).float()
            r = ref_moe(x, ids, w, w13, w2, i_small)
            err = ((y - r).abs().max() / r.abs().max().clamp_min(1e-6)).item()
            good = err < 3e-2
            log.append(f"probe _grouped_mm layout {layout}: rel. max error {err:.2e} vs fp32 per-expert reference "
                       f"-> {'ok' if good else 'MISMATCH'}")
            if good:
                ok.append(layout)
        except Exception as e:  # noqa: BLE001
            log.append(f"probe _grouped_mm layout {layout}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if not ok:
        log.append("no _grouped_mm layout works: per-expert loop baseline")
        return "loop", [], None
    _, w13, w2 = bf16_weights(ok[0], e_small, h_small, i_small, dev, scale=0.2)
    mode = None
    try:
        graph_time([lambda: bf16_moe(x, ids, w, w13, w2, i_small, e_range)] * 2, 1)
        mode = "graph"
        log.append("routing sort + grouped GEMMs capture in one CUDA graph: all of the baseline is timed")
    except Exception as e:  # noqa: BLE001
        log.append(f"capture of sort+grouped_mm failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
                   "trying with the sort precomputed outside the graph")
        torch.cuda.synchronize()
        try:
            route = bf16_route(ids, e_range)
            graph_time([lambda: bf16_compute(x, w, route, w13, w2, i_small)] * 2, 1)
            mode = "presorted"
            log.append("baseline routing (sort, offsets) precomputed OUTSIDE the graph; only gather, GEMMs, "
                       "SwiGLU and combine are timed (the bf16 time is optimistic)")
        except Exception as e2:  # noqa: BLE001
            log.append(f"capture of grouped_mm failed too ({type(e2).__name__}): per-expert loop baseline")
            torch.cuda.synchronize()
            return "loop", [], None
    return "grouped", ok, mode


# ----------------------------------------------------------------------------------------------------------
# vLLM fused_experts baseline


def probe_vllm(dev, args, log):
    """(fused_experts, context factory, description) when vLLM's fused MoE imports, matches the fp32 reference on
    a tiny problem and captures in a CUDA graph; else (None, None, reason), with the reason logged."""
    if args.vllm == "off":
        log.append("vLLM fused_experts baseline off (--vllm off)")
        return None, None, "off (--vllm off)"
    try:
        import vllm  # noqa: PLC0415
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        why = "import failed: " + short_err(e)
        log.append("vLLM fused_experts baseline unavailable: " + why)
        return None, None, why
    ver = getattr(vllm, "__version__", "?")

    def unavailable(why):
        log.append(f"vLLM {ver} fused_experts baseline unavailable: {why}")
        _sync_quiet()
        return None, None, why

    try:
        from vllm.config import VllmConfig, set_current_vllm_config  # noqa: PLC0415
        cfg = VllmConfig()
        with set_current_vllm_config(cfg):
            pass
        ctx, ctx_desc = (lambda: set_current_vllm_config(cfg)), "inside set_current_vllm_config(VllmConfig())"
    except Exception as e:  # noqa: BLE001
        ctx, ctx_desc = contextlib.nullcontext, "WITHOUT a vLLM config context"
        log.append(f"vLLM {ver}: VllmConfig()/set_current_vllm_config failed ({short_err(e)}); "
                   "calling fused_experts without a config context")
    torch.manual_seed(2)
    e_small, h_small, i_small, t_small, k_small = 4, 128, 64, 6, 2
    ids = torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [1, 0], [3, 1]], dtype=torch.int32, device=dev)
    w = torch.softmax(torch.randn(t_small, k_small, device=dev), 1).float().contiguous()
    x = torch.randn(t_small, h_small, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(e_small, 2 * i_small, h_small, device=dev, dtype=torch.bfloat16) * 0.2
    w2 = torch.randn(e_small, h_small, i_small, device=dev, dtype=torch.bfloat16) * 0.2
    try:
        with ctx():
            y = fused_experts(x, w1, w2, w, ids).float()
        r = ref_moe(x, ids, w, w1.transpose(1, 2), w2.transpose(1, 2), i_small)
        err = ((y - r).abs().max() / r.abs().max().clamp_min(1e-6)).item()
        if not err < 3e-2:
            return unavailable(f"probe MISMATCH: rel. max error {err:.2e} vs fp32 per-expert reference")
        log.append(f"probe vLLM {ver} fused_experts: rel. max error {err:.2e} vs fp32 per-expert reference -> ok")
    except Exception as e:  # noqa: BLE001
        return unavailable("probe failed: " + short_err(e))
    try:
        with ctx():
            graph_time([lambda: fused_experts(x, w1, w2, w, ids)] * 2, 1)
        log.append(f"vLLM fused_experts captures in one CUDA graph ({ctx_desc})")
    except Exception as e:  # noqa: BLE001
        return unavailable("CUDA graph capture failed: " + short_err(e))
    return fused_experts, ctx, f"vLLM {ver}, {ctx_desc}"


def _sync_quiet():
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


# ----------------------------------------------------------------------------------------------------------
# output


def eager_time_us(calls: list, reps: int) -> float:
    """GPU time per call in microseconds with the calls launched eagerly (paths that read on the host), the median
    of reps passes over all of them after one warm-up pass."""
    for f in calls:
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for f in calls:
            f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(calls))
    times.sort()
    return times[len(times) // 2]


def write_outputs(args, rows, header_lines):
    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, f"{args.tag}.csv")
    with open(csv_path, "w", newline="") as f:
        extra = ["ours_recon_us"] if any("ours_recon_us" in r for r in rows) else []
        extra += sorted({k for r in rows for k in r if k.startswith("ours_us_t")}, key=lambda k: int(k[9:]))
        wr = csv.DictWriter(f, fieldnames=FIELDS[:6] + extra + FIELDS[6:])
        wr.writeheader()
        wr.writerows(rows)
    md = os.path.join(args.out_dir, f"{args.tag}.md")
    with open(md, "w") as f:
        f.write("# EXL3 MoE layer benchmark\n\n")
        f.writelines(f"- {h}\n" for h in header_lines)
        f.write("\n| " + " | ".join(FIELDS) + " |\n|" + "---|" * len(FIELDS) + "\n")
        for r in rows:
            f.write("| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k in FIELDS) + " |\n")
    return md, csv_path


def short_err(e):
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:200] if s else ''}".replace("|", "/")


# ----------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="", help="e.g. 1,16,256 (default: " + ",".join(map(str, ALL_T)) + ")")
    ap.add_argument("--configs", default="4:mul1,4:mcg", help="K:codebook list (codebooks: 3inst, mcg, mul1)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--pool-gb", type=float, default=4.0, help="EXL3 weight copies: >= this many GB (>= 4 copies)")
    ap.add_argument("--bf16-pool-gb", type=float, default=4.0, help="bf16 weight copies: >= this many GB (>= 3 copies)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768, help="moe intermediate size I")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--layout", choices=["auto", "kn", "nk"], default="auto",
                    help="bf16 B operand of _grouped_mm: kn = [E, K, N] row-major, nk = [E, N, K] passed transposed")
    ap.add_argument("--baseline", choices=["auto", "loop"], default="auto")
    ap.add_argument("--vllm", choices=["auto", "off"], default="auto",
                    help="second bf16 baseline: vLLM's fused_experts (Triton), when vLLM imports and passes a probe")
    ap.add_argument("--recon", action="store_true",
                    help="also time the large-M path (EXL3_VLLM_TIER=dequant), eagerly: it reads row counts on the "
                         "host, so no CUDA graph (column ours_recon_us)")
    ap.add_argument("--input-threads", default="",
                    help="e.g. 256,512: also time ours with kmoe.INPUT_THREADS at each (columns ours_us_t<N>)")
    ap.add_argument("--commit", default="", help="the tree measured (a device copy's git is stale; default: git here)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip the remaining T after this many seconds (0: none)")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="2026-12-02-moe-h200")
    args = ap.parse_args()
    commit = args.commit or git_commit(os.path.dirname(os.path.abspath(__file__)))
    device = gpu_name()

    t_start = time.time()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    H, I, E, TOPK = args.hidden, args.inter, args.experts, args.topk
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else ALL_T
    configs = [(int(c.split(":")[0]), c.split(":")[1]) for c in args.configs.split(",") if c]
    log = []

    bw, gemm_rate = measure_ceilings(args.reps)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s", flush=True)

    # ---- ours: import and weights
    kmoe, ours_err = None, ""
    try:
        from exl3_vllm.kernels import moe as kmoe  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        ours_err = "kernels.moe unavailable: " + short_err(e)
        log.append(ours_err)
        print(ours_err, flush=True)

    per_expert_w = H * 2 * I + I * H
    where = torch.stack([torch.zeros(E, dtype=torch.int32), torch.arange(E, dtype=torch.int32)], 1).to(dev).contiguous()
    w13_suh = ((torch.rand(E, 2, H, device=dev) + 0.5) * 0.05).half()
    w13_svh = ((torch.rand(E, 2 * I, device=dev) + 0.5) * 0.05).half()
    w2_suh = ((torch.rand(E, I, device=dev) + 0.5) * 0.05).half()
    w2_svh = ((torch.rand(E, H, device=dev) + 0.5) * 0.05).half()
    sink = torch.empty(sms * 8 * 256, dtype=torch.int32, device=dev)
    q = {}  # (bits, cbn) -> dict(copies, decode_rate, td, err)
    for bits, cbn in configs:
        ent = {"err": ours_err}
        q[(bits, cbn)] = ent
        try:
            cb = CB[cbn]
            layer_bytes = E * per_expert_w * bits // 8
            nc = max(4, copies_for(layer_bytes, args.pool_gb, cap=256))
            w13s = [torch.randint(-32768, 32768, (E, H // 16, 2 * I // 16, 16 * bits), dtype=torch.int16, device=dev)
                    for _ in range(nc)]
            w2s = [torch.randint(-32768, 32768, (E, I // 16, H // 16, 16 * bits), dtype=torch.int16, device=dev)
                   for _ in range(nc)]
            ent.update(cb=cb, w13=w13s, w2=w2s, nc=nc)
            # decode-only rate over the whole layer (each expert stack seen as one big 2D trellis), rotated copies
            dec = [lambda a=a, b=b: (decode_floor(a.view(-1, 2 * I // 16, 16 * bits), cb, sink),
                                     decode_floor(b.view(-1, H // 16, 16 * bits), cb, sink))
                   for a, b in zip(w13s, w2s)]
            td = graph_time((dec * (args.calls // nc + 1))[:max(args.calls, nc)], args.reps)
            ent["decode_rate"] = E * per_expert_w / (td * 1e-6)
            msg = (f"K={bits} {cbn}: {nc} layer copies ({nc * layer_bytes / 2**30:.1f} GiB); decode-only of the whole "
                   f"layer {td:.1f} us ({ent['decode_rate'] / 1e12:.2f} Tweights/s)")
            print(msg, flush=True)
            log.append(msg)
            if kmoe is not None:
                kmoe.prepare_moe([w13s[0]], [cb], [w2s[0]], [cb], E, TOPK, max(tokens), dev)
        except Exception as e:  # noqa: BLE001
            ent["err"] = ent["err"] or ("setup: " + short_err(e))
            print(f"K={bits} {cbn}: setup failed: {short_err(e)}", flush=True)
            log.append(f"K={bits} {cbn}: setup failed: {short_err(e)}")
            torch.cuda.synchronize()

    # ---- bf16 baseline: choice and weights
    base_kind, layouts, base_mode = probe_baseline(dev, args, log)
    e_range = torch.arange(E, dtype=torch.int32, device=dev)
    bf_bytes = E * per_expert_w * 2
    nb = max(3, copies_for(bf_bytes, args.bf16_pool_gb, cap=max(3, args.calls)))
    layout = layouts[0] if layouts else "kn"
    if base_kind == "grouped" and len(layouts) > 1:
        # both B layouts run: keep the faster one on the real shape (one copy each; all experts hit at these T)
        tl = {}
        for lay in layouts:
            try:
                a13, a2 = bf16_weights(lay, E, H, I, dev)[1:]
                tt = 0.0
                for t in (64, 2048):
                    xt = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
                    rts = [make_routing(t, E, TOPK, dev) for _ in range(4)]
                    tt += graph_time([lambda r=r: bf16_moe(xt, r[0], r[1], a13, a2, I, e_range) for r in rts], 3)
                tl[lay] = tt
                del a13, a2
            except Exception as e:  # noqa: BLE001
                log.append(f"layout {lay} at the real shape failed: {short_err(e)}")
            torch.cuda.empty_cache()
        if tl:
            layout = min(tl, key=tl.get)
            log.append("B layout timing (T=64 + T=2048, us): " + ", ".join(f"{k} {v:.1f}" for k, v in tl.items())
                       + f" -> {layout}")
    bfw = [bf16_weights(layout, E, H, I, dev)[1:] for _ in range(nb)]
    if base_kind == "grouped":
        call_desc = ("torch._grouped_mm(x_sorted [T*8, H] bf16, w13 [E, H, 2I], offs=int32 group ends [E]); "
                     "same for w2 [E, I, H]; w stored "
                     + ("[E, K, N] row-major" if layout == "kn" else "[E, N, K] (K contiguous) and passed .transpose(1, 2)"))
        bf16_path = f"grouped_mm({layout})/{base_mode}"
    else:
        call_desc = "per-expert torch.mm loop over routing computed on the host outside the graph"
        bf16_path = "loop"
    log.append(f"bf16 baseline: {call_desc}; {nb} weight copies ({nb * bf_bytes / 2**30:.1f} GiB)")

    # ---- vLLM fused_experts baseline: probe and weights ([E, 2I, H] / [E, H, I] contiguous)
    vfe, vctx, vdesc = probe_vllm(dev, args, log)
    vfw, v_shared = [], False
    if vfe is not None:
        try:
            cand = [(a.transpose(1, 2), b.transpose(1, 2)) for a, b in bfw]
            if layout == "nk" and all(a.is_contiguous() and b.is_contiguous() for a, b in cand):
                vfw, v_shared = cand, True  # same storage as the grouped_mm baseline's copies
            else:
                vfw = [(torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02,
                        torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(nb)]
            log.append(f"vLLM baseline: {len(vfw)} weight copies "
                       + ("shared with the grouped_mm baseline (its 'nk' storage)" if v_shared else
                          f"of its own ({len(vfw) * bf_bytes / 2**30:.1f} GiB)"))
        except Exception as e:  # noqa: BLE001
            vdesc = "weights: " + short_err(e)
            log.append("vLLM fused_experts baseline unavailable: " + vdesc)
            vfe, vfw = None, []
            torch.cuda.empty_cache()
    for line in log:
        print("[setup] " + line, flush=True)

    header = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"commit: {commit}",
        f"device: {torch.cuda.get_device_name(0)} ({sms} SMs), torch {torch.__version__}",
        f"command: `python bench/bench_moe.py {' '.join(sys.argv[1:])}`",
        f"shape: hidden {H}, moe intermediate {I}, {E} experts, top-{TOPK}, SwiGLU (w13 = gate|up {H}x{2 * I}, "
        f"w2 {I}x{H})",
        f"measured ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s",
        f"method: CUDA graph of {args.calls} calls, each on a different weight copy (EXL3 >= {args.pool_gb} GB and >= 4 "
        f"copies, bf16 >= {args.bf16_pool_gb} GB and >= 3 copies) and with its own fresh uniform top-{TOPK} routing "
        f"(torch.rand(T, E).topk, weights softmax of random logits; made outside the timed region), median of "
        f"{args.reps} replays / {args.calls}; rows with T <= {LIGHT_T} wait for the SM clock to leave the power cap",
        "distinct_experts: experts hit by a call's routing, averaged over the calls",
        f"bytes = D*(H*2I + I*H)*K/8 (weights touched; suh/svh excluded, ~0.6%) + T*H*2 (x) + T*H*2 (out) + "
        f"T*{TOPK}*(2I + I)*2*2 (gate|up and SwiGLU intermediates, written + read once); flops = 2*T*{TOPK}*(H*2I + I*H)",
        "floor = max(bytes/BW*2 (BW counts read+write, as bench_linear), D*(H*2I + I*H)/decode rate, flops/GEMM rate); "
        "decode_only_us = that decode term; decode rate = exl3_decode_sum over the whole layer's w13 and w2 "
        "trellis viewed as 2D trellises, rotated copies",
        "bf16_path: " + bf16_path + " -- " + call_desc + "; routing: torch.sort(ids.flatten(), stable=True), "
        "offs = searchsorted(sorted ids, arange(E), right=True, out_int32=True), gather x rows, silu(gate)*up, "
        "index_copy_ back to (token, slot) order, bmm with the router weights (bf16 weights, fp32 accumulate)",
        "vllm_us: " + ("vLLM fused_experts(x bf16 [T, H], w1 bf16 [E, 2I, H] (gate rows, then up), w2 bf16 [E, H, I], "
                       f"topk_weights fp32 [T, {TOPK}], topk_ids int32 [T, {TOPK}]) from "
                       "vllm.model_executor.layers.fused_moe.fused_moe (Triton; default activation SiLU, no quant_config, "
                       f"global_num_experts -1, no expert_map), {vdesc}; rotated weight copies "
                       + ("shared with the grouped_mm baseline" if v_shared else "of its own")
                       + "; each call with its own routing, same method as bf16_us; speedup_vllm = vllm_us / ours_us"
                       if vfe is not None else f"empty: vLLM fused_experts baseline unavailable ({vdesc})"),
        "ours: kmoe.moe_cuda(x, topk_weights fp32, topk_ids int32, [w13 int16 [E, H/16, 2I/16, 16K]], [cb], "
        "where int32 [E, 2] = (0, e), w13_suh fp16 [E, 2, H], w13_svh fp16 [E, 2I], [w2 int16 [E, I/16, H/16, 16K]], "
        "[cb], where, w2_suh fp16 [E, I], w2_svh fp16 [E, H], -1, False); random trellis; prepare_moe once per config "
        f"with max_tokens {max(tokens)}",
    ] + [f"setup: {line}" for line in log]

    rows = []
    skipped = []
    for t in tokens:
        if args.budget_s and time.time() - t_start > args.budget_s:
            skipped.append(t)
            continue
        row_base = dict(T=t, bf16_path=bf16_path)
        try:
            x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
            routes = [make_routing(t, E, TOPK, dev) for _ in range(args.calls)]
            d_avg = torch.stack([distinct_experts(r[0], E) for r in routes]).mean().item()
        except Exception as e:  # noqa: BLE001
            for bits, cbn in configs:
                rows.append(dict(row_base, config=f"{bits}:{cbn}", K=bits, cb=cbn, error="inputs: " + short_err(e)))
            print(f"T={t}: inputs failed: {short_err(e)}", flush=True)
            continue

        def baselines():
            """bf16 and vLLM's fused_experts on this T's inputs, timed beside each row they divide (never reused
            across codebooks), with the SM clock read after each."""
            tb, tv, errs, mhz = None, None, [], {}
            try:
                if t <= LIGHT_T:
                    clock.rest(0)
                if base_kind == "grouped" and base_mode == "graph":
                    calls = [lambda r=r, wc=wc: bf16_moe(x, r[0], r[1], wc[0], wc[1], I, e_range)
                             for r, wc in zip(routes, (bfw * args.calls)[:args.calls])]
                elif base_kind == "grouped":
                    pre = [bf16_route(r[0], e_range) for r in routes]
                    calls = [lambda r=r, p=p, wc=wc: bf16_compute(x, r[1], p, wc[0], wc[1], I)
                             for r, p, wc in zip(routes, pre, (bfw * args.calls)[:args.calls])]
                else:
                    plans = [loop_plan(r[0], r[1], E) for r in routes]
                    calls = [lambda p=p, wc=wc: loop_moe(x, p, wc[0], wc[1], I)
                             for p, wc in zip(plans, (bfw * args.calls)[:args.calls])]
                tb = graph_time(calls, args.reps)
                mhz["bf16_sm_mhz"] = clock.sm_mhz(0)
            except Exception as e:  # noqa: BLE001
                errs.append("bf16: " + short_err(e))
                print(f"T={t}: bf16 baseline failed: {short_err(e)}", flush=True)
                torch.cuda.synchronize()
            if vfe is not None:
                try:
                    if t <= LIGHT_T:
                        clock.rest(0)
                    calls = [lambda r=r, wc=wc: vfe(x, wc[0], wc[1], r[1], r[0])
                             for r, wc in zip(routes, (vfw * args.calls)[:args.calls])]
                    with vctx():
                        tv = graph_time(calls, args.reps)
                    mhz["vllm_sm_mhz"] = clock.sm_mhz(0)
                except Exception as e:  # noqa: BLE001
                    errs.append("vllm: " + short_err(e))
                    print(f"T={t}: vLLM baseline failed: {short_err(e)}", flush=True)
                    _sync_quiet()
            return tb, tv, "; ".join(errs), mhz

        for bits, cbn in configs:
            ent = q[(bits, cbn)]
            weights = d_avg * per_expert_w
            nbytes = weights * bits / 8 + t * H * 2 * 2 + t * TOPK * 3 * I * 2 * 2
            flops = 2 * t * TOPK * per_expert_w
            tb, tv, berr, mhz = baselines()
            row = dict(row_base, config=f"{bits}:{cbn}", K=bits, cb=cbn, distinct_experts=round(d_avg, 2),
                       bf16_us=None if tb is None else round(tb, 2), vllm_us=None if tv is None else round(tv, 2),
                       error=berr, commit=commit, device=device, **mhz)
            if "decode_rate" in ent:
                dec_s = weights / ent["decode_rate"]
                floor = max(nbytes / bw, dec_s, flops / gemm_rate)  # bw: bytes moved (read + write) per second
                row.update(floor_us=round(floor * 1e6, 2), decode_only_us=round(dec_s * 1e6, 2))
            t_ours = None
            if ent["err"] or kmoe is None:
                row["error"] = "; ".join(v for v in (berr, "ours: " + (ent["err"] or "no kernels")) if v)
            else:
                try:
                    if t <= LIGHT_T:
                        clock.rest(0)
                    cb, nc = ent["cb"], ent["nc"]
                    args13 = [[ent["w13"][i % nc]] for i in range(args.calls)]
                    args2 = [[ent["w2"][i % nc]] for i in range(args.calls)]
                    cbl = [cb]
                    calls = [lambda r=r, a=a, b=b: kmoe.moe_cuda(x, r[1], r[0], a, cbl, where, w13_suh, w13_svh,
                                                                 b, cbl, where, w2_suh, w2_svh, -1, False)
                             for r, a, b in zip(routes, args13, args2)]
                    calls[0]()  # first call of this T outside the capture (lazy compile / workspace)
                    torch.cuda.synchronize()
                    t_ours = graph_time(calls, args.reps)
                    row["sm_mhz"] = clock.sm_mhz(0)
                    row.update(ours_us=round(t_ours, 2), GBps=round(nbytes / t_ours / 1e3, 1),
                               TFLOPs=round(flops / t_ours / 1e6, 2))
                    if tb is not None:
                        row["speedup"] = round(tb / t_ours, 3)
                    if tv is not None:
                        row["speedup_vllm"] = round(tv / t_ours, 3)
                    if "floor_us" in row:
                        row["pct_floor"] = round(100 * row["floor_us"] / t_ours, 1)
                    if args.recon and x.dtype == torch.bfloat16:
                        os.environ["EXL3_VLLM_TIER"] = "dequant"
                        try:
                            row["ours_recon_us"] = round(eager_time_us(calls, args.reps), 2)
                        finally:
                            del os.environ["EXL3_VLLM_TIER"]
                        print(f"  T={t} reconstruction path: {row['ours_recon_us']} us (eager)", flush=True)
                    default_threads = kmoe.INPUT_THREADS
                    for n in [int(v) for v in args.input_threads.split(",") if v]:
                        kmoe.INPUT_THREADS = n
                        try:
                            calls[0]()
                            torch.cuda.synchronize()
                            row[f"ours_us_t{n}"] = round(graph_time(calls, args.reps), 2)
                        finally:
                            kmoe.INPUT_THREADS = default_threads
                        print(f"  T={t} input threads {n}: {row[f'ours_us_t{n}']} us "
                              f"(default {default_threads}: {t_ours:.2f} us)", flush=True)
                except Exception as e:  # noqa: BLE001
                    row["error"] = "; ".join(v for v in (berr, "ours: " + short_err(e)) if v)
                    torch.cuda.synchronize()
            rows.append(row)
            fmt = lambda v, w=9: f"{v:{w}.2f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
            print(f"{bits}:{cbn:5s} T={t:5d} D={d_avg:6.1f} ours {fmt(t_ours)} us  bf16 {fmt(tb)} us  vllm {fmt(tv)} us  "
                  f"x{fmt(row.get('speedup'), 5)}  floor {fmt(row.get('floor_us'), 8)} us "
                  f"({fmt(row.get('pct_floor'), 5)}%)  sm {row.get('sm_mhz', '')} MHz"
                  + (f"  ERROR {row['error']}" if row["error"] else ""), flush=True)
        del x, routes
        hdr = header + ([f"skipped for --budget-s {args.budget_s:g}: T = {skipped}"] if skipped else [])
        write_outputs(args, rows, hdr)
    if vfw and not v_shared:
        del vfw
        torch.cuda.empty_cache()
    hdr = header + ([f"skipped for --budget-s {args.budget_s:g}: T = {skipped}"] if skipped else [])
    if skipped:
        print(f"skipped for the time budget: T = {skipped}", flush=True)
    md, csv_path = write_outputs(args, rows, hdr)
    print(f"wrote {md} and {csv_path} ({time.time() - t_start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
