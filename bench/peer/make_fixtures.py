"""Generate bit-exact fixtures from exllamav3 1.6.5's own CUDA kernels (runs on the GPU machine).

    EXL3_INT8_GEMV=0 python3 bench/peer/make_fixtures.py --out /tmp/fixtures

EXL3_INT8_GEMV=0 must be set (the int8-activation GEMV for mul1 at m <= 2 would otherwise be taken even with
force_num_sms set). EXL3_GEMV is left at its default so the `*_auto` tensors show the fp16 GEMV path.

Writes one safetensors file per case (k{K}_{codebook}.safetensors, half-integer K as k2p5_mul1 etc.),
codebooks.safetensors and checks.json. See tests/data/exllamav3/README.md for what every tensor is.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_ext  # noqa: E402

CBS = {"3inst": (False, False), "mcg": (True, False), "mul1": (False, True)}
CB_ID = {"3inst": 0, "mcg": 1, "mul1": 2}
K_SHAPE = (128, 128)          # (k, n) of every case
M_LIST = (1, 8, 16, 64)
SEED = 20261201


def cases():
    out = []
    for K in range(1, 9):
        for cb in ("3inst", "mcg", "mul1"):
            out.append((float(K), cb))
    for K in (1.5, 2.5, 3.5):
        out.append((K, "mul1"))
    return out


def case_name(K: float, cb: str) -> str:
    ks = str(int(K)) if K == int(K) else str(K).replace(".", "p")
    return f"k{ks}_{cb}"


def tile_words(K: float) -> int:
    return int(16 * K) if K == int(K) else int(16 * int(K) + 8)


PERM = []
for _j in range(256):
    _t, _q = _j // 8, _j % 8
    _r = 2 * (_t % 4) + (_q & 1) + 8 * ((_q >> 1) & 1)
    _c = _t // 4 + 8 * (_q >> 2)
    PERM.append(16 * _r + _c)


def make_case(ext, idx: int, K: float, cb: str, dev) -> tuple[dict, dict]:
    mcg, mul1 = CBS[cb]
    k, n = K_SHAPE
    kt, nt = k // 16, n // 16
    g = torch.Generator(device="cpu").manual_seed(SEED + idx)
    trellis = torch.randint(-32768, 32768, (kt, nt, tile_words(K)), dtype=torch.int16, generator=g)
    sgn_k = torch.randint(0, 2, (k,), generator=g) * 2 - 1
    sgn_n = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    suh = (sgn_k * (0.5 + torch.rand(k, generator=g))).half()
    svh = (sgn_n * (0.5 + torch.rand(n, generator=g)) * 0.02).half()
    x = torch.randn(max(M_LIST), k, generator=g).half()

    t_d, suh_d, svh_d, x_d = (a.to(dev).contiguous() for a in (trellis, suh, svh, x))
    meta = {"K": str(K), "codebook": cb, "k": str(k), "n": str(n), "exllamav3": "1.6.5", "seed": str(SEED + idx)}

    states = torch.empty((kt, nt, 256), dtype=torch.int16, device=dev)
    if K == int(K):
        ext.unpack_trellis(states, t_d, int(K))
        meta["states_fn"] = f"unpack_trellis(states, trellis, {int(K)})"
    else:
        ext.unpack_trellis_frac(states, t_d, int(K), 0xAAAA)
        meta["states_fn"] = f"unpack_trellis_frac(states, trellis, {int(K)}, 0xAAAA)"

    w_hat = torch.empty((k, n), dtype=torch.half, device=dev)
    ext.reconstruct(w_hat, t_d, K, mcg, mul1)
    w = torch.empty((k, n), dtype=torch.half, device=dev)
    ext.reconstruct_had_slice(w, t_d, suh_d, svh_d, K, mcg, mul1, 0)
    had_x = torch.empty_like(x_d)
    ext.had_r_128(x_d, had_x, suh_d, None, 1.0)

    out = {"trellis": trellis, "suh": suh, "svh": svh, "states": states.cpu(), "w_hat": w_hat.cpu(),
           "w": w.cpu(), "x": x, "had_x": had_x.cpu()}
    checks = {}
    for M in M_LIST:
        xm = x_d[:M].contiguous()
        ys = []
        for rep in range(2):
            y = torch.full((M, n), float("nan"), dtype=torch.half, device=dev)
            xh = torch.empty_like(xm)
            r = ext.exl3_gemm(xm, t_d, y, suh_d, xh, svh_d, -1, mcg, mul1, 1)
            ys.append(y)
        assert not torch.isnan(ys[0]).any(), f"{case_name(K, cb)} M={M}: unwritten output"
        checks[f"y_m{M}_deterministic"] = bool(torch.equal(ys[0], ys[1]))
        out[f"y_m{M}"] = ys[0].cpu()
        meta[f"y_m{M}_path"] = f"tensor-core GEMM, shape_idx {r}, grid 1 (force_num_sms=1)"
    for M in (1, 8):
        xm = x_d[:M].contiguous()
        y = torch.full((M, n), float("nan"), dtype=torch.half, device=dev)
        xh = torch.empty_like(xm)
        r = ext.exl3_gemm(xm, t_d, y, suh_d, xh, svh_d, -1, mcg, mul1, 0)
        checks[f"y_m{M}_auto_ret"] = int(r)
        if r == 90:
            y2 = torch.full((M, n), float("nan"), dtype=torch.half, device=dev)
            ext.exl3_gemm(xm, t_d, y2, suh_d, xh, svh_d, -1, mcg, mul1, 0)
            checks[f"y_m{M}_auto_deterministic"] = bool(torch.equal(y, y2))
            out[f"y_m{M}_auto"] = y.cpu()
            meta[f"y_m{M}_auto_path"] = "fp16 GEMV (exl3_gemm returned 90)"
    # consistency of the reference against itself: fp32 x @ w vs y_m64
    ref = x.float() @ out["w"].float()
    rel = ((out["y_m64"].float() - ref).norm() / ref.norm()).item()
    checks["rel_err_y_m64_vs_x_at_w_fp32"] = rel
    return out, meta | {"checks": json.dumps(checks)}


def codebooks(ext, dev) -> tuple[dict, dict]:
    """All 65536 states per codebook, via exllamav3's reconstruct() of a K=8 trellis whose odd positions
    hold every (hi, lo) byte pair: symbols alternate hi, lo_0, hi, lo_1, ... (two tiles per hi byte)."""
    kt, nt = 16, 32                     # 512 tiles
    K = 8
    sym = torch.empty((kt * nt, 256), dtype=torch.int16)
    for tile in range(kt * nt):
        hi, half = tile // 2, tile % 2
        sym[tile, 0::2] = hi
        sym[tile, 1::2] = torch.arange(128) + 128 * half
    sym = sym.view(kt, nt, 256).to(dev)
    trellis = torch.empty((kt, nt, 16 * K), dtype=torch.int16, device=dev)
    ext.pack_trellis(trellis, sym, K)
    states = torch.empty((kt, nt, 256), dtype=torch.int16, device=dev)
    ext.unpack_trellis(states, trellis, K)
    st = states.view(-1, 256).long().cpu() & 0xFFFF
    perm = torch.tensor(PERM)
    out, checks = {}, {}
    for cb, (mcg, mul1) in CBS.items():
        w_hat = torch.empty((kt * 16, nt * 16), dtype=torch.half, device=dev)
        ext.reconstruct(w_hat, trellis, float(K), mcg, mul1)
        tiles = w_hat.view(kt, 16, nt, 16).permute(0, 2, 1, 3).reshape(kt * nt, 256).cpu()
        vals = tiles[:, perm]                        # trellis order
        table = torch.full((65536,), float("nan"), dtype=torch.half)
        table[st.flatten()] = vals.flatten()
        # every state seen more than once must decode to the same bits (checks PERM and the state unpack)
        agree = torch.equal(table[st.flatten()].view(torch.int16), vals.flatten().view(torch.int16))
        checks[cb] = {"covered": int((~torch.isnan(table)).sum()), "duplicates_agree": bool(agree),
                      "mean": table.float().mean().item(), "std": table.float().std().item(),
                      "min": table.float().min().item(), "max": table.float().max().item()}
        out[f"cb_{cb}"] = table
    meta = {"exllamav3": "1.6.5", "checks": json.dumps(checks),
            "how": "pack_trellis(trellis, symbols, 8); unpack_trellis(states, trellis, 8); "
                   "reconstruct(w_hat, trellis, 8.0, mcg, mul1); cb[state] = w_hat at PERM position"}
    return out, meta


def decode_dump_check(ext, dev) -> dict:
    """Our decode_only.cu (docs/format.md section 3 math) against exllamav3's reconstruct(), bitwise."""
    res = {}
    k, n = 256, 512
    g = torch.Generator(device="cpu").manual_seed(SEED - 1)
    for K in range(1, 9):
        t = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), dtype=torch.int16, generator=g).to(dev)
        for cb, (mcg, mul1) in CBS.items():
            ref = torch.empty((k, n), dtype=torch.half, device=dev)
            ext.reconstruct(ref, t, float(K), mcg, mul1)
            dump = torch.empty((k // 16) * (n // 16) * 256, dtype=torch.half, device=dev)
            ext.peer_decode_dump(t, dump, CB_ID[cb])
            ours = dump.view(k // 16, n // 16, 16, 16).permute(0, 2, 1, 3).reshape(k, n)
            res[f"K{K}_{cb}"] = int((ours.view(torch.int16) != ref.view(torch.int16)).sum().item())
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode-check-only", action="store_true",
                    help="only compare our decode_only.cu against exllamav3 reconstruct(); writes decode_check.json")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda:0")
    ext = peer_ext.load()
    if a.decode_check_only:
        res = decode_dump_check(ext, dev)
        print("decode_only vs reconstruct mismatches:", res, flush=True)
        with open(os.path.join(a.out, "decode_check.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    assert os.environ.get("EXL3_INT8_GEMV") == "0", "run with EXL3_INT8_GEMV=0"
    t0 = time.time()
    allchecks = {"info": peer_ext.info(ext)}
    for idx, (K, cb) in enumerate(cases()):
        tensors, meta = make_case(ext, idx, K, cb, dev)
        name = case_name(K, cb)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(a.out, name + ".safetensors"),
                  metadata=meta)
        allchecks[name] = json.loads(meta["checks"])
        print(name, meta["checks"], flush=True)
    cbt, cbm = codebooks(ext, dev)
    save_file(cbt, os.path.join(a.out, "codebooks.safetensors"), metadata=cbm)
    allchecks["codebooks"] = json.loads(cbm["checks"])
    print("codebooks", cbm["checks"], flush=True)
    allchecks["decode_only_vs_reconstruct_mismatches"] = decode_dump_check(ext, dev)
    print("decode_only vs reconstruct mismatches:", allchecks["decode_only_vs_reconstruct_mismatches"], flush=True)
    with open(os.path.join(a.out, "checks.json"), "w") as f:
        json.dump(allchecks, f, indent=1)
    print(f"fixtures done in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
