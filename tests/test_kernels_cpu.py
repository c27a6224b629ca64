"""CPU-side checks of the kernels package: NVRTC compile (no GPU needed), the fake impl, the CPU op."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from exl3_vllm.format.linear import linear as ref_linear
from exl3_vllm.kernels import op as kop  # noqa: F401  (registers torch.ops.exl3.linear)
from exl3_vllm.kernels.nvrtc import parse_ptxas_log
from exl3_vllm.kernels.variants import TIERS, all_modules

_HAVE_NVRTC = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


def _layer(k, n, bits, shards=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = int(16 * bits) if bits == int(bits) else 16 * int(bits) + 8
    trellis = torch.randint(-32768, 32768, (k // 16, n // 16, w), dtype=torch.int16, generator=g)
    sign = lambda *s: torch.where(torch.rand(*s, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    suh = (sign(shards, k) * (0.5 + torch.rand(shards, k, generator=g)) * 0.05).half()
    svh = (sign(n) * (0.5 + torch.rand(n, generator=g)) * 0.05).half()
    return trellis, suh, svh


@pytest.mark.skipif(not _HAVE_NVRTC, reason="cuda-bindings / nvidia-cuda-nvrtc not installed (pip install cuda-bindings nvidia-cuda-nvrtc)")
def test_compile_sm90_no_spills(tmp_path, monkeypatch):
    """Every variant (or the CI subset when EXL3_VLLM_CI_FULL is unset) compiles for sm_90 without spills."""
    import os

    from exl3_vllm.kernels.cli import run_compile
    try:
        from cuda.bindings import nvrtc  # noqa: F401
        from exl3_vllm.kernels.nvrtc import nvrtc_version
        nvrtc_version()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"NVRTC not usable here: {e}")
    if not os.environ.get("XDG_CACHE_HOME") and not os.environ.get("EXL3_VLLM_CACHE_DIR"):
        monkeypatch.setenv("EXL3_VLLM_CACHE_DIR", str(tmp_path))
    import io
    buf = io.StringIO()
    full = os.environ.get("EXL3_VLLM_CI_FULL", "") not in ("", "0")
    rc = run_compile([90], jobs=os.cpu_count() or 1, subset=not full, out=buf)
    print(buf.getvalue())
    assert rc == 0, buf.getvalue()
    assert "exl3_gemm_m16_f16" in buf.getvalue()


def test_ptxas_log_parser():
    log = """ptxas info    : Function properties for exl3_gemm_m16_f16
ptxas         .     0 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 126 registers, used 1 barriers, 16 bytes smem
"""
    (k,) = parse_ptxas_log(log)
    assert (k.name, k.registers, k.smem_static, k.spill_stores, k.spill_loads) == ("exl3_gemm_m16_f16", 126, 16, 4, 8)


def test_variant_list():
    mods = all_modules()
    assert len(mods) == 1 + 8 * 3 + 3
    for t in TIERS.values():
        assert t.smem(8) <= 227 * 1024
        assert t.threads % 32 == 0 and t.ks % t.kw == 0


def test_plan_shapes():
    p = kop.plan(1, 4096, 4096, 4, 132)
    assert p.path == "gemm" and p.tier == "m16" and p.splits > 1
    assert p.splits * p.steps_per_split >= 4096 // 16
    assert kop.plan(100, 4096, 4096, 4, 132).tier == "m128"
    assert kop.plan(129, 4096, 4096, 4, 132).path == "dequant"
    assert kop.plan(4096, 4096, 4096, 4, 132).path == "dequant"


def test_plan_int8_tier(monkeypatch):
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2).tier == "i8"
    assert kop.plan(8, 4096, 4096, 2.5, 132, codebook=2).tier == "i8"
    assert kop.plan(9, 4096, 4096, 4, 132, codebook=2).tier == "m16"
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=1).tier == "m16"
    assert kop.plan(1, 65536 + 128, 4096, 4, 132, codebook=2, smem_limit=1 << 20).tier == "m16"
    monkeypatch.setenv("EXL3_VLLM_INT8", "0")
    assert kop.plan(1, 4096, 4096, 4, 132, codebook=2).tier == "m16"
    monkeypatch.setenv("EXL3_VLLM_TIER", "i8")
    with pytest.raises(kop.KernelError, match="mul1"):
        kop.plan(1, 4096, 4096, 4, 132, codebook=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_impl_shapes(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(2, 5, 256, dtype=dtype)
        tr = torch.empty(16, 24, 64, dtype=torch.int16)
        y = torch.ops.exl3.linear(x, tr, torch.empty(2, 256, dtype=torch.float16), torch.empty(384, dtype=torch.float16),
                                  None, [128, 256], 2)
        assert y.shape == (2, 5, 384) and y.dtype == dtype


@pytest.mark.parametrize("bits,cb", [(4, 2), (3, 1), (2, 0), (2.5, 2)])
def test_cpu_op_equals_reference(bits, cb):
    k, n = 256, 384
    trellis, suh, svh = _layer(k, n, bits, shards=2, seed=int(bits * 10) + cb)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    bias = torch.randn(n).half()
    y = torch.ops.exl3.linear(x, trellis, suh, svh, bias, [128, 256], cb)
    ref = ref_linear(x, trellis, suh, svh, cb, bias=bias, shard_sizes=[128, 256], out_dtype=x.dtype)
    assert y.dtype == x.dtype and torch.equal(y, ref)


def test_cpu_op_rejects_bad_shapes():
    trellis, suh, svh = _layer(256, 128, 4)
    with pytest.raises(Exception, match="features|k="):
        torch.ops.exl3.linear(torch.randn(2, 128).half(), trellis, suh[0], svh, None, [128], 2)
