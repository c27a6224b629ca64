// EXL3 GEMM and weight decode for one (K, codebook); compiled with -DEXL3_KA=.. -DEXL3_HALF=.. -DEXL3_CB=..
// The kernels' entry points, one per tier and output dtype; their bodies are in the exl3_gemm_* and exl3_recon headers.
#include "exl3_gemm_body.cuh"
#include "exl3_gemm_ws.cuh"
#include "exl3_recon.cuh"

// Tiers: (rows per block, n16 tiles per warp, k-warps, k16 steps per stage, pipeline stages).
#define EXL3_TIER(NAME, BM, NT, KW, KS, ST) \
    extern "C" __global__ void __launch_bounds__(32 * (8 / NT) * KW) exl3_gemm_##NAME##_f16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, NT, KW, KS, ST, false>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(32 * (8 / NT) * KW) exl3_gemm_##NAME##_bf16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, NT, KW, KS, ST, true>(p, smem); }

// Stream-k twins keep two resident blocks (128 registers) where K allows, enough warps to hide the decode latency.
// 16-step stages unroll twice the decode: that fits for integer K up to 5 on sm_90 / sm_120, not on sm_8x (the
// compile sweep's spills).
constexpr int MINB_STREAM = KA <= 6 ? 2 : 1;
#if __CUDA_ARCH__ >= 900
constexpr int MINB_STREAM16 = KA <= 5 && !HALF ? 2 : 1;
#else
constexpr int MINB_STREAM16 = 1;
#endif
__host__ __device__ constexpr int minb_stream(int ks) { return ks > 8 ? MINB_STREAM16 : MINB_STREAM; }

// Few-row tiers (MODE as in gemm_segment) over BM rows of x: 8 warps, 4 tiles each, 4 k-warps, KS k16 steps per stage,
// ST stages. 16 x 2 halves the stage barriers of 8 x 4 in the same shared memory; stages are whole, so the "k8" twins
// (8 x 4) serve layers whose k is not a multiple of 256 (variants.for_k picks them).
#define EXL3_FEW_TIER(NAME, BM, MODE, KS, ST) \
    extern "C" __global__ void __launch_bounds__(256, 1) exl3_gemm_##NAME##_f16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, false, MODE>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(256, 1) exl3_gemm_##NAME##_bf16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, true, MODE>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(256, minb_stream(KS)) exl3_gemm_##NAME##s_f16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, false, MODE, true>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(256, minb_stream(KS)) exl3_gemm_##NAME##s_bf16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, true, MODE, true>(p, smem); }
// Their "fx" twins (fixed split-k): each block transforms its own rows of raw x (no input-transform launch).
#define EXL3_FX_TIER(NAME, BM, KS, ST) \
    extern "C" __global__ void __launch_bounds__(256, 1) exl3_gemm_##NAME##fx_f16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, false, 3, false, false, true>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(256, 1) exl3_gemm_##NAME##fx_bf16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, true, 3, false, false, true>(p, smem); }

#ifdef EXL3_WGMMA
// Hopper tiers: (rows of x per block, warpgroups per block (64 columns each), k16 steps per stage, stages); the NT
// slot of gemm_body carries the warpgroup count.
#define EXL3_WG_TIER(NAME, BN, NWG, KS, ST) \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 4 / NWG) exl3_gemm_##NAME##_f16(const GemmArgs p) \
    { extern __shared__ __align__(128) char smem[]; gemm_body<BN, NWG, 1, KS, ST, false, false, false, true>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 4 / NWG) exl3_gemm_##NAME##_bf16(const GemmArgs p) \
    { extern __shared__ __align__(128) char smem[]; gemm_body<BN, NWG, 1, KS, ST, true, false, false, true>(p, smem); }
// Stream-k twins (the tiers whose twins fit the register budget at every K).
#define EXL3_WG_STREAM(NAME, BN, NWG, KS, ST) \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 4 / NWG) exl3_gemm_##NAME##s_f16(const GemmArgs p) \
    { extern __shared__ __align__(128) char smem[]; gemm_body<BN, NWG, 1, KS, ST, false, false, true, true>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(128 * NWG, 4 / NWG) exl3_gemm_##NAME##s_bf16(const GemmArgs p) \
    { extern __shared__ __align__(128) char smem[]; gemm_body<BN, NWG, 1, KS, ST, true, false, true, true>(p, smem); }

// Warp-specialized tiers: (rows of x per block, producer warpgroups, k16 steps per stage, stages, PREG); 128 columns
// per block, two consumer warpgroups; PREG > 0: the producers keep that many registers per thread, the rest go to the
// consumers (setmaxnreg).
#define EXL3_WS_KERNEL(NAME, BN, NP, KS, ST, PREG, BF, STREAM) \
    extern "C" __global__ void __launch_bounds__(128 * (2 + NP), 1) exl3_gemm_##NAME(const GemmArgs p) \
    { extern __shared__ __align__(128) char smem[]; ws_body<BN, NP, KS, ST, BF, STREAM, PREG>(p, smem); }
#define EXL3_WS_TIER(NAME, BN, NP, KS, ST, PREG) \
    EXL3_WS_KERNEL(NAME##_f16, BN, NP, KS, ST, PREG, false, false) \
    EXL3_WS_KERNEL(NAME##_bf16, BN, NP, KS, ST, PREG, true, false) \
    EXL3_WS_KERNEL(NAME##s_f16, BN, NP, KS, ST, PREG, false, true) \
    EXL3_WS_KERNEL(NAME##s_bf16, BN, NP, KS, ST, PREG, true, true)
#endif

// The instantiations: one line per tier of variants.TIERS, generated (nvrtc.py passes it as this header).
#include "exl3_tiers.cuh"

// Two blocks per SM where registers allow (a warp's eight tiles' packed fragments stay live through each phase).
#if __CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 800
constexpr int RECON_MINB = 2;
#else
constexpr int RECON_MINB = 1;
#endif
extern "C" __global__ void __launch_bounds__(256, RECON_MINB) exl3_recon_f16(const u32* trellis, const u16* suh, const u16* svh, u16* wt, int n_total, int col0, int cols, int k)
{ recon_body<false>(trellis, 0, suh, 0, svh, 0, wt, 0, n_total, col0, cols, k); }
extern "C" __global__ void __launch_bounds__(256, RECON_MINB) exl3_recon_bf16(const u32* trellis, const u16* suh, const u16* svh, u16* wt, int n_total, int col0, int cols, int k)
{ recon_body<true>(trellis, 0, suh, 0, svh, 0, wt, 0, n_total, col0, cols, k); }
// A range of experts at once (the large-M MoE path): blockIdx.y = expert e0 + y, whose weight goes to wt + y * wt_stride;
// experts of another (K, codebook) group than this launch's exit at once (where[e] = its group, index in the group).
#define EXL3_RECON_EXPERTS(SUF, BF) \
extern "C" __global__ void __launch_bounds__(256, RECON_MINB) exl3_recon_experts_##SUF(const u32* trellis, const int* where, int group, int e0, long long expert_words, const u16* suh, int suh_stride, const u16* svh, int svh_stride, u16* wt, long long wt_stride, int n_total, int col0, int cols, int k) \
{ \
    const int e = e0 + blockIdx.y; \
    if (where[2 * e] != group) return; \
    recon_body<BF>(trellis, where[2 * e + 1] * expert_words, suh, e * suh_stride, svh, e * svh_stride, \
                   wt, blockIdx.y * wt_stride, n_total, col0, cols, k); \
}
EXL3_RECON_EXPERTS(f16, false)
EXL3_RECON_EXPERTS(bf16, true)
