"""The quantized token embedding decoder against independent re-derivations (plain Python integers, a float64
Hadamard matrix); exllamav3's own decode is checked on real checkpoints (test_real_checkpoints.py and the corpus)."""

import pytest
import torch

from exl3_vllm.format import codebook as cb
from exl3_vllm.format import embedding as emb
from exl3_vllm.format.errors import Exl3FormatError


def _ring(bits: int, gen: torch.Generator) -> torch.Tensor:
    words = torch.randint(-32768, 32768, (1 + 16 * bits,), generator=gen, dtype=torch.int32).to(torch.int16)
    words[0] = torch.tensor(0.0371, dtype=torch.float16).view(torch.int16)
    return words


def _states_by_definition(words: torch.Tensor, bits: int) -> list[int]:
    stream = [int(w) & 0xFFFF for w in words[1:]]

    def bit(b):
        return (stream[b >> 4] >> (b & 15)) & 1

    return [sum(bit(((i - m // bits) % 256) * bits + m % bits) << m for m in range(16)) for i in range(256)]


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("bits", range(1, 9))
def test_states_follow_the_ring_definition(bits):
    gen = torch.Generator().manual_seed(bits)
    words = _ring(bits, gen)
    assert emb._states(words[1:], bits).tolist() == _states_by_definition(words, bits)


@pytest.mark.parametrize("bits,hidden", [(1, 256), (3, 640), (4, 384), (8, 512)])
def test_rows_are_scaled_rotated_signed_codebook_values(bits, hidden):
    gen = torch.Generator().manual_seed(100 + bits)
    groups = emb.groups_of(hidden)
    rows = torch.stack([torch.cat([_ring(bits, gen) for _ in range(groups)]) for _ in range(3)])
    signs = (torch.randint(0, 2, (groups, 256), generator=gen) * 2 - 1).half()
    got = emb.decode_rows(rows, signs, hidden)
    # Contiguous also where the last group is part padding (640, 384): vLLM's fused add + RMSNorm needs it.
    assert got.dtype == torch.float16 and got.shape == (3, hidden) and got.is_contiguous()
    h = _sylvester(256)
    for r in range(3):
        want = []
        for g in range(groups):
            words = rows[r, g * (1 + 16 * bits):(g + 1) * (1 + 16 * bits)]
            vals = cb.decode(torch.tensor(_states_by_definition(words, bits)), "mul1").double()
            scale = words[0].view(torch.float16).double()
            want.append((h @ (vals * scale)) / 16 * signs[g].double())
        want = torch.cat(want)[:hidden]
        # The fp32 butterflies differ from the float64 product by far less than one fp16 step.
        assert torch.allclose(got[r].double(), want, rtol=2e-3, atol=1e-6)


def test_zero_rows_decode_to_zeros_and_bad_widths_are_refused():
    signs = torch.ones(2, 256, dtype=torch.float16)
    assert not emb.decode_rows(torch.zeros(4, 2 * 65, dtype=torch.int16), signs, 300).any()
    for width, groups in ((2 * 65 + 1, 2), (2 * 145, 2), (18 * 3, 3)):
        with pytest.raises(Exl3FormatError, match="1 \\+ 16K"):
            emb.bits_from_row(width, groups)


@pytest.mark.gpu
def test_lookup_on_the_gpu_and_in_a_cuda_graph_equals_the_cpu_decode():
    from exl3_vllm.kernels import embedding as embedding_lookup

    gen = torch.Generator().manual_seed(7)
    hidden, vocab, bits = 640, 300, 5
    groups = emb.groups_of(hidden)
    table = torch.stack([torch.cat([_ring(bits, gen) for _ in range(groups)]) for _ in range(vocab)])
    signs = (torch.randint(0, 2, (groups, 256), generator=gen) * 2 - 1).half()
    ids = torch.randint(0, vocab, (3, 17), generator=gen)
    want = emb.decode_rows(table[ids.reshape(-1)], signs, hidden).reshape(3, 17, hidden)
    dev = torch.device("cuda")
    args = (table.to(dev), signs.to(dev), cb.all_values("mul1").to(dev), hidden)
    got = embedding_lookup(ids.to(dev), *args)
    assert got.is_contiguous()
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    static_ids = ids.to(dev)
    embedding_lookup(static_ids, *args)  # warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = embedding_lookup(static_ids, *args)
    out.fill_(float("nan"))
    static_ids.copy_(torch.flip(ids, (1,)).to(dev))
    g.replay()
    want = emb.decode_rows(table[torch.flip(ids, (1,)).reshape(-1)], signs, hidden).reshape(3, 17, hidden)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
