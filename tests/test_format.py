"""The format reference against independent, naive re-derivations of docs/format.md."""

import numpy as np
import pytest
import torch

from exl3_vllm.format import codebook as cb
from exl3_vllm.format import trellis as tr
from exl3_vllm.format.errors import Exl3FormatError
from exl3_vllm.format.hadamard import had_128, hadamard_128
from exl3_vllm.format.linear import linear
from exl3_vllm.format.reconstruct import dense_weight, w_hat


def rand_trellis(kt, nt, bits, gen):
    return torch.randint(-32768, 32768, (kt, nt, tr.width_from_bits(bits)), dtype=torch.int16, generator=gen)


def rand_scale(n, gen):
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    return (sign * (0.5 + torch.rand(n, generator=gen)) * 0.05).half()


def naive_states(tile: np.ndarray, bits: float) -> list[int]:
    """Bit-by-bit reading of docs/format.md 3.2/3.6: ring bit p is bit 31-p%32 of LE uint32 word p//32."""
    u16 = tile.astype(np.uint16).astype(np.uint64)
    words = [int(u16[2 * m]) | (int(u16[2 * m + 1]) << 16) for m in range(len(u16) // 2)]
    ring = len(words) * 32
    bit = [(words[p // 32] >> (31 - p % 32)) & 1 for p in range(ring)]
    ka = int(bits)
    end, states = 0, []
    for j in range(256):
        end += ka + (1 if bits != ka and j % 2 == 1 else 0)
        s = 0
        for b in range(16):
            s = (s << 1) | bit[(end - 16 + b) % ring]
        states.append(s)
    return states


@pytest.mark.parametrize("bits", tr.ALL_BITS)
def test_unpack_matches_naive_bit_reading(bits):
    gen = torch.Generator().manual_seed(int(bits * 10))
    t = rand_trellis(2, 3, bits, gen)
    states = tr.unpack(t)
    for tk in range(2):
        for tn in range(3):
            assert states[tk, tn].tolist() == naive_states(t[tk, tn].numpy(), bits)


@pytest.mark.parametrize("bits", tr.ALL_BITS)
def test_pack_unpack_round_trip(bits):
    gen = torch.Generator().manual_seed(int(bits * 100))
    t = rand_trellis(3, 5, bits, gen)
    states = tr.unpack(t)
    assert states.dtype == torch.int32 and int(states.min()) >= 0 and int(states.max()) < 65536
    assert torch.equal(tr.pack(states, bits), t)
    assert torch.equal(tr.unpack(tr.pack(states, bits)), states)


@pytest.mark.parametrize("bits", tr.ALL_BITS)
def test_states_overlap_as_a_tail_biting_shift_register(bits):
    gen = torch.Generator().manual_seed(7)
    s = tr.unpack(rand_trellis(2, 2, bits, gen)).long()
    nxt = s.roll(-1, -1)
    d = torch.full((256,), int(bits), dtype=torch.long)
    if bits != int(bits):
        d += torch.arange(256) % 2
    d = d.roll(-1)  # new bits of the next position
    expect = ((s << d) | (nxt & ((1 << d) - 1))) & 0xFFFF
    assert torch.equal(expect, nxt)


def test_k4_word_layout_example():
    # docs/format.md 3.2: int16[2m+1] holds symbols 8m..8m+3, int16[2m] symbols 8m+4..8m+7.
    t = torch.zeros(1, 1, 64, dtype=torch.int16)
    t[0, 0, 1] = 0x1234
    t[0, 0, 0] = 0x5678
    s = tr.unpack(t)[0, 0].tolist()
    assert s[:8] == [0x1, 0x12, 0x123, 0x1234, 0x2345, 0x3456, 0x4567, 0x5678]
    assert s[255] == 0 and s[8] == 0x6780


def test_pack_rejects_bad_input():
    with pytest.raises(Exl3FormatError):
        tr.pack(torch.zeros(3, 255, dtype=torch.int32), 4)
    with pytest.raises(Exl3FormatError):
        tr.pack(torch.zeros(3, 256, dtype=torch.int32), 4.5)
    for w in (0, 8, 15, 50, 136, 144):
        with pytest.raises(Exl3FormatError):
            tr.bits_from_width(w)


def test_perm():
    assert tr.PERM[:16].tolist() == [0, 16, 128, 144, 8, 24, 136, 152, 32, 48, 160, 176, 40, 56, 168, 184]
    assert sorted(tr.PERM.tolist()) == list(range(256))
    assert torch.equal(tr.PERM[tr.INV_PERM], torch.arange(256))
    for j in range(256):
        r, c = divmod(int(tr.PERM[j]), 16)
        t = 4 * (c % 8) + (r % 8) // 2
        q = (r & 1) + 2 * (r >= 8) + 4 * (c >= 8)
        assert j == 8 * t + q
    m = torch.randn(32, 48)
    assert torch.equal(tr.tiles_to_matrix(tr.matrix_to_tiles(m)), m)


def numpy_inst(states: np.ndarray, mult: int, add: int) -> np.ndarray:
    x = (states.astype(np.uint64) * mult + add) & 0xFFFFFFFF
    x = ((x & 0x8FFF8FFF) ^ 0x3B603B60).astype(np.uint32)
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16)
    hi = (x >> 16).astype(np.uint16).view(np.float16)
    return lo + hi  # numpy adds float16 with one IEEE rounding


def numpy_mul1(states: np.ndarray) -> np.ndarray:
    x = (states.astype(np.uint64) * cb.MUL1_MULT) & 0xFFFFFFFF
    t = sum((x >> (8 * i)) & 0xFF for i in range(4)).astype(np.float64)
    k_inv = np.array([0x1EEE], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
    k_bias = np.array([0xC931], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
    return ((1024 + t) * k_inv + k_bias).astype(np.float16)


STATS = {  # mean, std, min, max from docs/format.md 3.5
    "3inst": (0.0002, 1.24371, -3.957, 3.973),
    "mcg": (0.0, 1.2441, -3.949, 3.949),
    "mul1": (-0.0019, 1.0003, -3.453, 3.348),
}


@pytest.mark.parametrize("name", cb.CODEBOOKS)
def test_codebook_all_states(name):
    v = cb.all_values(name)
    assert v.dtype == torch.float16 and v.shape == (65536,)
    assert torch.isfinite(v).all()
    states = np.arange(65536)
    if name == "mul1":
        ref = numpy_mul1(states)
    elif name == "mcg":
        ref = numpy_inst(states, cb.MCG_MULT, 0)
    else:
        ref = numpy_inst(states, 89226354, 64248484)
    assert np.array_equal(v.numpy().view(np.uint16), ref.view(np.uint16))
    mean, std, lo, hi = STATS[name]
    d = v.double()
    assert abs(d.mean().item() - mean) < 5e-4
    assert abs(d.std().item() - std) < 5e-4
    assert abs(d.min().item() - lo) < 2e-3 and abs(d.max().item() - hi) < 2e-3


def test_codebook_known_values():
    assert cb.decode(torch.tensor([0]), "mcg").item() == 1.84375
    assert cb.decode(torch.tensor([0]), "mul1").item() == -3.453125
    assert torch.equal(cb.decode(torch.tensor([-1], dtype=torch.int16), "mul1"),
                       cb.decode(torch.tensor([65535]), "mul1"))
    assert cb.MARKER_VALUES == {"mcg": -877912083, "mul1": -2082680531}
    with pytest.raises(Exl3FormatError):
        cb.decode(torch.tensor([0]), "mul2")


def test_hadamard():
    h = hadamard_128(torch.float64)
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-14)
    assert torch.equal(h, h.T)
    a = torch.arange(128)
    sign = torch.tensor([[(-1) ** bin(int(i) & int(j)).count("1") for j in a] for i in a], dtype=torch.float64)
    assert torch.allclose(h * 128 ** 0.5, sign, atol=1e-12)
    x = torch.randn(3, 256, dtype=torch.float64)
    assert torch.allclose(had_128(had_128(x)), x, atol=1e-12)
    with pytest.raises(Exl3FormatError):
        had_128(torch.randn(2, 100))


@pytest.mark.parametrize("bits,name", [(1, "3inst"), (2, "mcg"), (3, "mul1"), (4, "3inst"), (5, "mcg"),
                                       (6, "mul1"), (8, "mul1"), (1.5, "mul1"), (3.5, "mul1")])
def test_reference_linear_equals_dense_fp64(bits, name):
    gen = torch.Generator().manual_seed(11)
    k, n = 256, 384
    t = rand_trellis(k // 16, n // 16, bits, gen)
    suh, svh = rand_scale(k, gen), rand_scale(n, gen)
    bias = torch.randn(n, generator=gen).half()
    x = torch.randn(7, k, dtype=torch.float64, generator=gen)
    w = dense_weight(t, suh, svh, name, torch.float64)
    ref = x @ w + bias.double()
    y = linear(x, t, suh, svh, name, bias=bias, compute_dtype=torch.float64)
    assert y.dtype == torch.float64
    assert ((y - ref).norm() / ref.norm()).item() < 1e-10
    # The dense weight really is B_k W_hat B_n scaled, checked elementwise for one entry.
    wh, h = w_hat(t, name).double(), hadamard_128(torch.float64)
    i, j = 130, 257
    e = suh[i].double() * svh[j].double() * (h[i % 128] @ wh[128:256, 256:384] @ h[:, j % 128])
    assert abs(e.item() - w[i, j].item()) < 1e-12


def test_half_k_needs_mul1():
    gen = torch.Generator().manual_seed(3)
    t = rand_trellis(8, 8, 2.5, gen)
    with pytest.raises(Exl3FormatError, match="mul1"):
        w_hat(t, "mcg")


def test_fused_layer_equals_separate_layers():
    gen = torch.Generator().manual_seed(5)
    k, sizes = 256, [256, 128, 128]
    ts = [rand_trellis(k // 16, s // 16, 4, gen) for s in sizes]
    suhs = [rand_scale(k, gen) for _ in sizes]
    svhs = [rand_scale(s, gen) for s in sizes]
    x = torch.randn(5, k, dtype=torch.float64, generator=gen)
    fused = linear(x, torch.cat(ts, 1), torch.stack(suhs), torch.cat(svhs), "mul1", shard_sizes=sizes,
                   compute_dtype=torch.float64)
    parts = [linear(x, t, su, sv, "mul1", compute_dtype=torch.float64) for t, su, sv in zip(ts, suhs, svhs)]
    assert torch.allclose(fused, torch.cat(parts, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs(dtype):
    gen = torch.Generator().manual_seed(9)
    k, n = 256, 256
    t = rand_trellis(k // 16, n // 16, 4, gen)
    suh, svh = rand_scale(k, gen), rand_scale(n, gen)
    x = torch.randn(3, 2, k, generator=gen).to(dtype)
    y = linear(x, t, suh, svh, "mcg")
    assert y.dtype == dtype and y.shape == (3, 2, n)
    ref = x.double().reshape(-1, k) @ dense_weight(t, suh, svh, "mcg", torch.float64)
    err = ((y.double().reshape(-1, n) - ref).norm() / ref.norm()).item()
    assert err < {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    assert linear(x, t, suh, svh, "mcg", out_dtype=torch.float32).dtype == torch.float32


def test_linear_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(1)
    t = rand_trellis(16, 16, 4, gen)
    suh, svh = rand_scale(256, gen), rand_scale(256, gen)
    with pytest.raises(Exl3FormatError, match="features"):
        linear(torch.randn(2, 128), t, suh, svh, "mul1")
    with pytest.raises(Exl3FormatError, match="svh"):
        linear(torch.randn(2, 256), t, suh, svh[:128], "mul1")
    with pytest.raises(Exl3FormatError, match="shard"):
        linear(torch.randn(2, 256), t, suh, svh, "mul1", shard_sizes=[100, 156])
    with pytest.raises(Exl3FormatError, match="suh"):
        linear(torch.randn(2, 256), t, suh, svh, "mul1", shard_sizes=[128, 128])
    with pytest.raises(Exl3FormatError, match="int16"):
        linear(torch.randn(2, 256), t.int(), suh, svh, "mul1")
    with pytest.raises(Exl3FormatError, match="128"):
        linear(torch.randn(2, 64), rand_trellis(4, 16, 4, gen), suh[:64], svh, "mul1")


def test_codebook_enum_is_the_one_numbering():
    """Codebook numbers the codebooks as the kernels' EXL3_CB does and names them as checkpoints do; no module
    compares a codebook with a bare number."""
    import os
    import re

    from exl3_vllm.format.codebook import CODEBOOKS, Codebook
    from exl3_vllm.kernels.variants import linear_defines

    assert [c.label for c in Codebook] == list(CODEBOOKS)
    for c in Codebook:
        assert Codebook.of(c.label) is c and Codebook.of(int(c)) is c
        assert linear_defines(4, c)["EXL3_CB"] == int(c)
    with pytest.raises(Exl3FormatError, match="unknown codebook"):
        Codebook.of("mul2")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "exl3_vllm")
    for d, _, files in os.walk(src):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(d, f)).read()
                assert not re.search(r"\b(codebook|cb|c) [!=]= \d\b", text), f
