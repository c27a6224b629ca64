"""bench/sass_mix.py's SASS parsing and per-tile counts on a hand-written listing (no nvdisasm, no GPU)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sass_mix = pytest.importorskip("sass_mix")
sys.path.pop(0)

MUL1 = 0x83DCD12D


def listing(per_tile_extra: str = "") -> str:
    # Outer loop (.L_x_1) around an inner one (.L_x_2) that decodes two tiles: 16 multiplies, both loops hold them.
    mul = "".join(f"        /*{0x100 + 16 * i:04x}*/                   IMAD R{10 + i}, R{30 + i}, -0x7c232ed3, RZ ;\n"
                  for i in range(16))
    dp = "".join(f"        /*{0x200 + 16 * i:04x}*/                   IDP.4A.U8.U8 R{10 + i}, R{10 + i}, UR5, R87 ;\n"
                 for i in range(16))
    return f"""	.section	.text.exl3_gemm_h8_f16,"ax",@progbits
.text.exl3_gemm_h8_f16:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_9) ;
.L_x_1:
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_2:
        /*0030*/                   LDS R30, [R2] ;
        /*0040*/                   SHF.R.U32.HI R31, RZ, 0x10, R30 ;
{mul}{dp}        /*0300*/                   PRMT R40, R10, 0x5410, R11 ;
        /*0310*/                   HMMA.16816.F32 R60, R40, R50, R60 ;
{per_tile_extra}        /*0400*/               @P1 BRA `(.L_x_2) ;
        /*0410*/                   IMAD.MOV.U32 R5, RZ, RZ, R6 ;
        /*0420*/               @P2 BRA `(.L_x_1) ;
.L_x_9:
        /*0430*/                   EXIT ;
	.section	.text.other,"ax",@progbits
.text.other:
        /*0000*/                   EXIT ;
"""


def test_functions_split_by_kernel():
    funcs = sass_mix.functions(listing())
    assert set(funcs) == {"exl3_gemm_h8_f16", "other"}


def test_decode_loop_is_the_innermost_loop_with_the_multiplies():
    ins, labels = sass_mix.parse(sass_mix.functions(listing())["exl3_gemm_h8_f16"])
    assert labels == {".L_x_1": 0x20, ".L_x_2": 0x30, ".L_x_9": 0x430}
    body = sass_mix.decode_loop(ins, labels, MUL1)
    # The inner loop: LDS .. its back branch; the forward branch to .L_x_9 is not a loop.
    assert body[0][0] == 0x30 and body[-1][0] == 0x400
    assert not any(op.startswith("BAR") for _, op, _ in body)


def test_mix_counts_per_tile_and_pipes():
    ins, labels = sass_mix.parse(sass_mix.functions(listing())["exl3_gemm_h8_f16"])
    r = sass_mix.mix(sass_mix.decode_loop(ins, labels, MUL1), MUL1)
    assert r["tiles"] == 2
    # 1 LDS + 1 SHF + 16 IMAD + 16 IDP + 1 PRMT + 1 HMMA + 1 BRA = 37 instructions over 2 tiles.
    assert r["issue"] == pytest.approx(37 / 2)
    assert r["ops"]["IMAD"] == 8 and r["ops"]["IDP"] == 8
    assert r["pipes"]["fma_heavy"] == 16 and r["pipes"]["alu"] == 1 and r["pipes"]["tensor"] == 0.5
    assert r["cycles"]["fma_heavy"] == 32 and r["bound"] == "fma_heavy"


def test_multiplier_matches_signed_and_unsigned_immediates_only_on_imad():
    assert sass_mix.is_multiply("IMAD", "R1, R2, -0x7c232ed3, RZ", MUL1)
    assert sass_mix.is_multiply("IMAD", "R1, R2, 0x83dcd12d, RZ", MUL1)
    assert not sass_mix.is_multiply("IMAD.MOV.U32", "R1, RZ, RZ, -0x7c232ed3", MUL1)
    assert not sass_mix.is_multiply("LOP3.LUT", "R1, R2, -0x7c232ed3, RZ, 0xc0, !PT", MUL1)
    # 3inst is counted by its addend (its multiplier sits in a register).
    assert sass_mix.is_multiply("IMAD", "R12, R21, R10, 0x3d45aa4", sass_mix.MULTIPLIERS[0])


def test_no_loop_without_multiplies():
    ins, labels = sass_mix.parse(sass_mix.functions(listing())["exl3_gemm_h8_f16"])
    assert sass_mix.decode_loop(ins, labels, 0xCBAC1FED) is None
