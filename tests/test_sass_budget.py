"""The hot decode loops' instruction budgets, read from the compiled SASS (NVRTC + nvdisasm, no GPU).

At small M the kernels are bound by the integer work of the trellis decode, so instructions per 16x16 tile and lane
are the speed that CI can see without a GPU. A budget here is the count at the last measured change plus a few
percent: a refactor that adds work to a hot loop (or stops it unrolling) fails here before any device call. Lower a
budget when a change lowers the count (bench/sass_mix.py prints it); raise one only with a measured reason.
"""

import os
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
sass_mix = pytest.importorskip("sass_mix")
sys.path.pop(0)

# The compiler the counts come from (pyproject's test extras pin nvidia-cuda-nvrtc 13.0.x, the GPU image's).
PINNED_NVRTC = (13, 0)
# (codebook, kernel) -> (tiles per loop iteration, max instructions per tile, max bound clocks per tile) at K=4, sm_90.
BUDGETS = {
    (2, "exl3_gemm_h8_f16"): (16, 41.0, 41.0),
    (2, "exl3_gemm_h16_f16"): (16, 44.5, 44.5),
    (2, "exl3_gemm_i4_f16"): (16, 29.5, 29.5),
    (2, "exl3_gemm_i8_f16"): (16, 35.5, 35.5),
    (2, "exl3_gemm_w64_f16"): (8, 56.5, 56.5),
    (2, "exl3_gemm_x64_f16"): (8, 58.0, 58.0),
    (1, "exl3_gemm_h8_f16"): (16, 38.5, 45.5),
    (1, "exl3_gemm_h16_f16"): (16, 44.5, 51.0),
    (1, "exl3_gemm_w64_f16"): (8, 60.5, 64.0),
    (1, "exl3_decode_sum"): (1, 63.0, 63.0),
    (2, "exl3_recon_f16"): (8, 110.0, 110.0),
    (1, "exl3_recon_f16"): (8, 115.0, 115.0),
}


def _nvrtc_ok() -> bool:
    try:
        from exl3_vllm.kernels.nvrtc import nvrtc_version
        nvrtc_version()
        return True
    except Exception:  # noqa: BLE001
        return False


def _disassemble(job):
    cb, cache = job
    os.environ["EXL3_VLLM_CACHE_DIR"] = cache
    return cb, sass_mix.disassemble(4, cb)[0]


@pytest.fixture(scope="module")
def sass(nvrtc_cache):
    if not _nvrtc_ok():
        pytest.skip("NVRTC not usable here (pip install cuda-bindings nvidia-cuda-nvrtc)")
    from exl3_vllm.kernels.nvrtc import nvrtc_version
    if tuple(nvrtc_version()) != PINNED_NVRTC:
        pytest.skip(f"the budgets are counts from NVRTC {PINNED_NVRTC} (the test extras' pin), this is {nvrtc_version()}")
    try:
        sass_mix.find_nvdisasm()
    except SystemExit:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    with ProcessPoolExecutor(2) as ex:
        return dict(ex.map(_disassemble, [(2, nvrtc_cache), (1, nvrtc_cache)]))


@pytest.mark.parametrize("cb,kernel", sorted(BUDGETS))
def test_decode_loop_within_budget(sass, cb, kernel):
    tiles, max_issue, max_bound = BUDGETS[(cb, kernel)]
    body = sass_mix.decode_loop(*sass_mix.parse(sass[cb][kernel]), sass_mix.MULTIPLIERS[cb])
    assert body is not None, f"{kernel}: no loop with the codebook's hash found (not unrolled, or renamed)"
    r = sass_mix.mix(body, sass_mix.MULTIPLIERS[cb])
    assert r["tiles"] == tiles, f"{kernel}: {r['tiles']} tiles per iteration, expected {tiles} (unrolling changed)"
    bound = r["cycles"][r["bound"]]
    assert r["issue"] <= max_issue and bound <= max_bound, (
        f"{kernel} (codebook {cb}): {r['issue']:.2f} instructions and {bound:.1f} {r['bound']} clocks per tile, "
        f"budget {max_issue} / {max_bound}; top: {sorted(r['ops'].items(), key=lambda kv: -kv[1])[:8]}")
