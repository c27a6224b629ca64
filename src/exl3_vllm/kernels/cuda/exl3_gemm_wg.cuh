// The wgmma GEMM segment (w tiers, sm_90a): warps decode into wgmma A fragments, x from swizzled shared memory.
#pragma once
#include "exl3_gemm_copy.cuh"
#include "exl3_gemm_tail.cuh"

#ifdef EXL3_WGMMA
// Shared-memory layout of one stage of x (BN rows x KS k16 steps, K-major) as wgmma's B operand: 128-byte swizzle
// atoms of 8 rows x 64 k (16-byte chunk c of row r at chunk c ^ (r % 8)), which keeps the tensor cores' row reads
// free of bank conflicts; desc(i) addresses k16 step i (32 bytes further inside the atom).
template <int BN, int KS>
struct WgX
{
    static_assert(KS % 4 == 0, "the 128-byte swizzle atom is 4 k16 steps");
    static constexpr int STAGE = KS * BN * 32;
    // Byte offset of row r's 16-byte chunk j (k values 8j..8j+7 of the stage).
    EXL3_INLINE static u32 offset(int r, int j) { return (j >> 3) * (BN * 128) + r * 128 + (swz128(j & 7, r) << 4); }
    EXL3_INLINE static u64 desc(u32 stage_addr, int i)
    {
        return smem_desc(stage_addr + (i >> 2) * (BN * 128) + (i & 3) * 32, 16, 1024) | (1ull << 62);
    }
    // Step i's descriptor from step 0's: the start-address field is bits 0-13 (address / 16) and shared addresses stay
    // below 2^18, so adding the step's offset / 16 cannot carry out of it (one add instead of rebuilding the fields).
    EXL3_INLINE static u64 desc_step(u64 desc0, int i) { return desc0 + (u64)(((i >> 2) * (BN * 128) + (i & 3) * 32) >> 4); }
};
template <int BN, int KS>
struct SwizzledX { EXL3_INLINE u32 operator()(int r, int j) const { return WgX<BN, KS>::offset(r, j); } };

// Hopper segment over 64 * NWG columns: every warp decodes one 16x16 tile per k16 step straight into the A fragment
// of W^T (output columns as MMA rows), and each warpgroup multiplies its 64 columns by all BN rows of x with one
// asynchronous wgmma reading x from shared memory, so the tensor cores run while the warps decode the next step.
// More warpgroups per block share each x tile among more columns (x is re-read once per column block).
template <int BN, int NWG, int KS, int STAGES, bool OUT_BF16>
__device__ __forceinline__ void wg_segment(const GemmArgs& p, const u32* trellis, const u16* svh, char* smem,
                                           const int cb, const int split, const int mb, const int step0,
                                           const int nstages, const int ncontrib)
{
    constexpr int THREADS = 128 * NWG;
    constexpr int W32 = TL::W32;
    constexpr int NW = TL::NW;
    constexpr int B_STEP = 4 * NWG * W32;
    static_assert(NWG == 2 || NWG == 4, "a block covers 128 or 256 columns");
    constexpr int B_STAGE = KS * B_STEP;
    static_assert(BN % 8 == 0 && BN <= 128, "wgmma n is a multiple of 8, at most 128 rows here");

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row0 = mb * BN;
    const int rows = min(BN, p.m - row0);
    int shard = 0;
    #pragma unroll
    for (int i = 0; i < 7; ++i) if (i + 1 < p.nshards && cb * (NWG / 2) >= p.shard_end[i]) shard = i + 1;
    const u16* A = p.xh + ((size_t)shard * p.m + row0) * p.k;
    const size_t b_row = (size_t)(p.n_total >> 4) * W32;
    const u32* B = trellis + (size_t)step0 * b_row + (size_t)cb * 4 * NWG * W32;

    // x tiles first, at a 1024-byte aligned base (the 128-byte swizzle pattern is a function of the address).
    char* base = smem + ((1024 - (smem_addr(smem) & 1023)) & 1023);
    u16* sA = (u16*)base;
    u32* sB = (u32*)(base + STAGES * WgX<BN, KS>::STAGE);

    // 4 warpgroups with 128 rows keep 64 accumulators per thread under the 128-register cap: no stored offsets there.
    constexpr bool PRE = !(NWG == 4 && BN >= 128);
    typedef TrellisCopy<KS, 4 * NWG, THREADS> TC;
    typedef XCopy<BN, KS, THREADS, SwizzledX<BN, KS>> XC;
    TC tcopy;
    XC xcopy;
    if constexpr (PRE)
    {
        tcopy.init(b_row, tid);
        xcopy.init(p.k, rows, tid);
    }
    auto load_w = [&](int s, int buf) {
        const u32* g = B + (size_t)s * KS * b_row;
        if constexpr (PRE) tcopy.issue(smem_addr(sB + buf * B_STAGE), g);
        else TC::issue_computed(smem_addr(sB + buf * B_STAGE), g, b_row, tid);
    };
    auto load_x = [&](int s, int buf) {
        const u16* gx = A + (step0 + s * KS) * 16;
        const u32 xdst = smem_addr(sA) + buf * WgX<BN, KS>::STAGE;
        if constexpr (PRE) xcopy.issue(xdst, gx);
        else XC::issue_computed(xdst, gx, p.k, rows, tid);
    };
    auto load_stage = [&](int s, int buf) { load_w(s, buf); load_x(s, buf); };

    float acc[BN / 2];
    #pragma unroll
    for (int j = 0; j < BN / 2; ++j) acc[j] = 0.f;

    LaneMap<KA, HALF> lm;
    lm.init(lane);

    ring_prologue<STAGES>(load_w, load_x, nstages);
    for (int s = 0; s < nstages; ++s)
    {
        const int buf = ring_next<STAGES, true>(load_stage, s, nstages);
        const u32* bB = sB + buf * B_STAGE + warp * W32;
        const u64 xdesc = WgX<BN, KS>::desc(smem_addr(sA) + buf * WgX<BN, KS>::STAGE, 0);
        u32 w[NW];
        #pragma unroll
        for (int q = 0; q < NW; ++q) w[q] = bB[lm.idx[q]];
        // 64 accumulators leave no room for a second step's fragments in flight.
        #pragma unroll (BN >= 128 ? 1 : KS)
        for (int i = 0; i < KS; ++i)
        {
            // The next step's words before the wgmma fences (asm with memory clobbers that loads cannot cross).
            u32 wn[NW];
            #pragma unroll
            for (int q = 0; q < NW; ++q) wn[q] = bB[min(i + 1, KS - 1) * B_STEP + lm.idx[q]];
            u32 b[4];
            words_to_frag<KA, HALF, CB>(w, lm.off, b);
            // The m16n8k16 B fragments of tile (k, n) are the A fragment of its transpose, registers reordered.
            const u32 a[4] = {b[0], b[2], b[1], b[3]};
            wgmma_fence();
            wgmma_rs<BN>(acc, a, WgX<BN, KS>::desc_step(xdesc, i));
            wgmma_commit();
            // Unrolled, each step's A fragment has its own registers and one wgmma may stay in flight; a rolled loop
            // reuses them, so it waits (ptxas does not guard A registers across a back edge).
            if constexpr (BN >= 128) wgmma_wait<0>(); else wgmma_wait<1>();
            #pragma unroll
            for (int q = 0; q < NW; ++q) w[q] = wn[q];
        }
        // The next stage's loads overwrite the buffer these wgmmas read.
        wgmma_wait<0>();
    }
    cp_async_wait<0>();
    __syncthreads();

    // One 128-column half at a time through the reduction tile: its 8 warps write, the whole block finishes it.
    float* red = (float*)smem;
    const int col = (warp & 7) * 16 + (lane >> 2);
    #pragma unroll 1
    for (int h = 0; h < NWG / 2; ++h)
    {
        if (h) __syncthreads();
        if ((warp >> 3) == h)
        {
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j)
            {
                const int r = j * 8 + 2 * (lane & 3);
                red[r * RLD + col] = acc[4 * j];
                red[(r + 1) * RLD + col] = acc[4 * j + 1];
                red[r * RLD + col + 8] = acc[4 * j + 2];
                red[(r + 1) * RLD + col + 8] = acc[4 * j + 3];
            }
        }
        __syncthreads();
        constexpr int TB = NWG > 2 ? 2 : 4;  // the 4-warpgroup tiers' accumulators leave room for 2 loads in flight
        segment_tail<OUT_BF16, 4 * NWG, TB, NWG <= 2>(p, svh, red, rows, row0, cb * (NWG / 2) + h, split, mb, ncontrib);
    }
}
#endif
