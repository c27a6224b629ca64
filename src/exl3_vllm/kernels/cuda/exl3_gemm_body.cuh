// The kernel body of the mma.sync and wgmma tiers: runs its segments under fixed split-k or stream-k.
#pragma once
#include "exl3_gemm_mma.cuh"
#include "exl3_gemm_wg.cuh"

// Fixed split-k (grid = column blocks x splits x row blocks) or, as separate kernels, stream-k (grid.x = p.stream
// blocks, block b owning units [b*U/G, (b+1)*U/G) of U = column blocks x stages).
template <int BM, int NT, int KW, int KS, int STAGES, bool OUT_BF16, int MODE = 0, bool STREAM = false, bool WG = false,
          bool FX = false>
__device__ __forceinline__ void gemm_body(const GemmArgs& p, char* smem)
{
    const int mb = blockIdx.z;
    const u32* trellis = p.trellis;
    const u16* svh = p.svh;
    if (p.block_expert)
    {
        const int e = p.block_expert[mb];
        if (e < 0 || p.expert_where[2 * e] != p.group) return;
        trellis += (size_t)p.expert_where[2 * e + 1] * p.expert_words;
        svh += (size_t)e * p.n_total;
    }
    auto segment = [&](int cb, int split, int step0, int nstages, int ncontrib) {
#ifdef EXL3_WGMMA
        if constexpr (WG)
        {
            wg_segment<BM, NT, KS, STAGES, OUT_BF16>(p, trellis, svh, smem, cb, split, mb, step0, nstages, ncontrib);
            return;
        }
#endif
        if constexpr (!WG)
            gemm_segment<BM, NT, KW, KS, STAGES, OUT_BF16, MODE, FX, STREAM>(p, trellis, svh, smem, cb, split, mb, step0,
                                                                         nstages, ncontrib);
    };
    for_each_segment<KS, STREAM>(p, WG ? 64 * NT : 128, [&](int cb, int split, int step0, int nstages, int ncontrib) {
        segment(cb, split, step0, nstages, ncontrib);
        if constexpr (STREAM) __syncthreads();
    });
}
