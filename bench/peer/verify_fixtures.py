"""Independent CPU check of tests/data/exllamav3 against docs/format.md (sections 2.3, 3, 3.5, 4).

    python bench/peer/verify_fixtures.py tests/data/exllamav3

Recomputes, from the stored trellis only, the 16-bit states (docs/format.md 3.1-3.2, 3.6), the codebook values (3.5),
W_hat (2.3 steps 1-5, PERM of 3.4) and compares them bit for bit; compares W, had_x and y_m* against a float64
reference (relative Frobenius error). Prints JSON; exits non-zero if any bit-exact comparison fails."""
import glob
import json
import os
import sys

import numpy as np
from safetensors import safe_open
D = sys.argv[1] if len(sys.argv) > 1 else "tests/data/exllamav3"
PERM = []
for j in range(256):
    t, q = j // 8, j % 8
    PERM.append(16 * (2 * (t % 4) + (q & 1) + 8 * ((q >> 1) & 1)) + (t // 4 + 8 * (q >> 2)))
PERM = np.array(PERM)

def cb_val(s, cb):
    s = s.astype(np.uint64)
    if cb == "mul1":
        x = (s * 0x83DCD12D) & 0xFFFFFFFF
        t = (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + ((x >> 24) & 255)
        return (0.00676727294921875 * (1024 + t.astype(np.float64)) - 10.3828125).astype(np.float16)
    x = ((s * 89226354 + 64248484) if cb == "3inst" else (s * 0xCBAC1FED)) & 0xFFFFFFFF
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = (x >> 16).astype(np.uint16).view(np.float16)
    return (lo + hi).astype(np.float16)        # numpy fp16 add: round-to-nearest of exact sum

def states_of(trellis, K):
    kt, nt, w = trellis.shape
    half = (w % 16 == 8); KA = w // 16
    u16 = trellis.view(np.uint16).astype(np.uint64)
    words = u16[..., 0::2] | (u16[..., 1::2] << 16)
    R = 16 * w
    d = np.full(256, KA) + ((np.arange(256) & 1) if half else 0)
    S = np.cumsum(d)
    st = np.zeros((kt, nt, 256), dtype=np.uint64)
    for b in range(16):
        p = (S - 16 + b) % R
        bit = (words[..., p // 32] >> (31 - (p % 32)).astype(np.uint64)) & 1
        st = (st << 1) | bit
    return st

def sylvester(n):
    H = np.array([[1.0]])
    while H.shape[0] < n: H = np.block([[H, H], [H, -H]])
    return H

Hs = sylvester(128) / np.sqrt(128)
res = {}
cbf = safe_open(os.path.join(D, "codebooks.safetensors"), "np")
for cb in ("3inst", "mcg", "mul1"):
    tab = cbf.get_tensor(f"cb_{cb}")
    mine = cb_val(np.arange(65536), cb)
    res[f"codebook_{cb}_bitexact"] = int((tab.view(np.uint16) != mine.view(np.uint16)).sum())
for f in sorted(glob.glob(os.path.join(D, "k*.safetensors"))):
    name = os.path.basename(f)[:-12]
    sf = safe_open(f, "np")
    meta = sf.metadata()
    T = {k: sf.get_tensor(k) for k in sf.keys()}
    K = float(meta["K"]); cb = meta["codebook"]
    st = states_of(T["trellis"], K)
    r = {"states_mismatch": int((st.astype(np.uint16) != T["states"].view(np.uint16)).sum())}
    v = cb_val(st, cb)
    kt, nt = st.shape[:2]
    tile = np.empty((kt, nt, 256), np.float16); tile[..., PERM] = v
    W_hat = tile.reshape(kt, nt, 16, 16).transpose(0, 2, 1, 3).reshape(16 * kt, 16 * nt)
    r["w_hat_mismatch"] = int((W_hat.view(np.uint16) != T["w_hat"].view(np.uint16)).sum())
    k, n = W_hat.shape
    W = (Hs @ W_hat.astype(np.float64).reshape(k // 128, 128, n)).reshape(k, n)
    W = (W.reshape(k, n // 128, 128) @ Hs).reshape(k, n)
    W = T["suh"].astype(np.float64)[:, None] * W * T["svh"].astype(np.float64)[None, :]
    r["w_rel_err_vs_fp64"] = float(np.linalg.norm(T["w"].astype(np.float64) - W) / np.linalg.norm(W))
    x = T["x"].astype(np.float64)
    hx = ((x * T["suh"].astype(np.float64)).reshape(x.shape[0], -1, 128) @ Hs).reshape(x.shape)
    r["had_x_rel_err"] = float(np.linalg.norm(T["had_x"].astype(np.float64) - hx) / np.linalg.norm(hx))
    for M in (1, 8, 16, 64):
        y = x[:M] @ W
        r[f"y_m{M}_rel_err"] = float(np.linalg.norm(T[f"y_m{M}"].astype(np.float64) - y) / np.linalg.norm(y))
        if f"y_m{M}_auto" in T:
            r[f"y_m{M}_auto_rel_err"] = float(np.linalg.norm(T[f"y_m{M}_auto"].astype(np.float64) - y) / np.linalg.norm(y))
    res[name] = r
print(json.dumps(res, indent=1))
bad = [k for k, v in res.items() if (isinstance(v, int) and v) or
       (isinstance(v, dict) and (v["states_mismatch"] or v["w_hat_mismatch"]))]
if bad:
    print("BIT-EXACT FAILURES:", bad)
    sys.exit(1)
