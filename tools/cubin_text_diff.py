"""Whether a kernel source refactor changed the machine code: compare two NVRTC caches kernel by kernel.

Each cache is a folder as precompile.sh packs it (exl3_vllm/kernels/<module>-sm90-<hash>.cubin). Cubins of the two
caches are paired by the code of kernels the change did not touch (--anchor), then each --kernel's .text section is
compared byte for byte. Exit 0 only when every paired kernel is identical.
    python3 tools/cubin_text_diff.py OLD_CACHE NEW_CACHE --kernel exl3_recon_bf16,exl3_recon_f16
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import struct
import sys


def text_sections(path: str) -> dict[str, bytes]:
    """An ELF64 file's .text.<kernel> sections by kernel name."""
    b = open(path, "rb").read()
    if b[:4] != b"\x7fELF" or b[4] != 2:
        raise SystemExit(f"{path}: not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    names = hdrs[shstrndx][4]
    out = {}
    for name_off, kind, _, _, off, size, *_ in hdrs:
        name = b[names + name_off:b.index(b"\0", names + name_off)].decode()
        if name.startswith(".text.") and kind != 8:  # 8: SHT_NOBITS
            out[name[6:]] = b[off:off + size]
    return out


def load(cache: str, module: str, anchors: list[str]) -> dict[str, tuple[str, dict]]:
    res = {}
    for p in sorted(glob.glob(os.path.join(cache, "exl3_vllm", "kernels", f"{module}-*.cubin"))):
        s = text_sections(p)
        key = hashlib.sha1(b"".join(s.get(a, b"") for a in anchors)).hexdigest()
        res[key] = (os.path.basename(p), s)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--kernel", required=True, help="comma-separated kernel names to compare")
    ap.add_argument("--module", default="exl3_linear")
    ap.add_argument("--anchor", default="exl3_gemm_m16_bf16,exl3_gemm_i8_bf16,exl3_gemm_h16_f16",
                    help="kernels the change left alone, whose code pairs the two caches' cubins")
    a = ap.parse_args()
    anchors = a.anchor.split(",")
    old, new = load(a.old, a.module, anchors), load(a.new, a.module, anchors)
    paired = sorted(set(old) & set(new))
    print(f"{a.module}: {len(old)} old and {len(new)} new cubins, {len(paired)} paired by {', '.join(anchors)}")
    if not paired or len(paired) != len(old) or len(paired) != len(new):
        print("not every cubin paired: the anchors changed too, or the caches hold other variants")
        return 1
    diff = 0
    for key in paired:
        for k in a.kernel.split(","):
            x, y = old[key][1].get(k), new[key][1].get(k)
            if x is None or y is None or x != y:
                diff += 1
                print(f"DIFFERENT {k}: {old[key][0]} ({len(x or b'')} bytes) / {new[key][0]} ({len(y or b'')} bytes)")
    print(f"{len(paired) * len(a.kernel.split(',')) - diff} identical, {diff} different")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
