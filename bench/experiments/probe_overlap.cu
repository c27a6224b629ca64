// Overlap probe (sm_90a): can the trellis decode (integer ALU work) run while the tensor cores run wgmma on the same
// SM? One block per SM. Split roles: warpgroups [0, nmma) issue back-to-back m64nNk16 wgmmas (mode & 1), the others
// decode tiles held in shared memory (mode & 2); mode 3 runs both. Fused (RS only): every warpgroup decodes a tile
// and feeds it to its wgmma (mode 4, the w-tier loop), that loop without the wgmma (5) or without the decode (6).
// Compiled by bench/experiments/probe_overlap.py with -DEXL3_KA/-DEXL3_HALF/-DEXL3_CB like the linear module.
#include "exl3_wgmma.cuh"

constexpr int KA = EXL3_KA;
constexpr bool HALF = EXL3_HALF != 0;
constexpr int CB = EXL3_CB;
typedef Tile<KA, HALF> TL;

#ifdef EXL3_WGMMA
// K-major operand of `rows` rows in 128-byte swizzle atoms (8 rows x 64 k); step i (of 4) is 32 bytes into the atom.
EXL3_INLINE u64 probe_desc(u32 addr, int i) { return smem_desc(addr + i * 32, 16, 1024) | (1ull << 62); }

EXL3_INLINE u32 probe_decode(const u32* sw, int it, int warp, const LaneMap<KA, HALF>& lm, u32 (&b)[4])
{
    const u32* tw = sw + ((it + warp) & 63) * TL::W32;
    u32 w[TL::NW];
    #pragma unroll
    for (int q = 0; q < TL::NW; ++q) w[q] = tw[lm.idx[q]];
    words_to_frag<KA, HALF, CB>(w, lm.off, b);
    return hadd2(hadd2(b[0], b[1]), hadd2(b[2], b[3]));
}

// Shared memory: B (N rows x 4 k16 steps), A (64 rows x 4 steps, SS only), 64 trellis tiles.
template <int N, bool SS>
__device__ __forceinline__ void probe_body(int nmma, int mma_iters, int alu_iters, int mode, u32* sink, long long* clk)
{
    extern __shared__ __align__(1024) char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    constexpr int BB = 4 * N * 32, AB = SS ? 4 * 64 * 32 : 0;
    char* base = smem + ((1024 - (smem_addr(smem) & 1023)) & 1023);
    u32* sx = (u32*)base;
    u32* sw = (u32*)(base + BB + AB);
    // Small fp16 operands (no infinities in the accumulators), random-looking trellis words.
    for (int i = tid; i < (BB + AB) / 4; i += blockDim.x) sx[i] = 0x2c002c00u ^ ((i * 0x00050003u) & 0x01ff01ffu);
    for (int i = tid; i < 64 * TL::W32; i += blockDim.x) sw[i] = (u32)i * 0x9E3779B1u ^ (blockIdx.x * 0x85EBCA6Bu);
    __syncthreads();
    LaneMap<KA, HALF> lm;
    lm.init(lane);
    const u32 bsm = smem_addr(base), asm_ = bsm + BB;
    float acc[N / 2];
    #pragma unroll
    for (int j = 0; j < N / 2; ++j) acc[j] = 0.f;
    u32 out = 0;
    const long long t0 = clock64();
    if (mode <= 3)
    {
        if (wg < nmma && (mode & 1))
        {
            const u32 a[4] = {0x2c002c00u ^ lane, 0x2c012c00u, 0x2c002c02u ^ lane, 0x2c032c00u};
            #pragma unroll 1
            for (int it = 0; it < mma_iters; ++it)
            {
                wgmma_fence();
                if constexpr (SS) wgmma_ss<N>(acc, probe_desc(asm_, it & 3), probe_desc(bsm, it & 3));
                else wgmma_rs<N>(acc, a, probe_desc(bsm, it & 3));
                wgmma_commit();
                wgmma_wait<1>();
            }
            wgmma_wait<0>();
        }
        else if (wg >= nmma && (mode & 2))
        {
            #pragma unroll 1
            for (int it = 0; it < alu_iters; ++it)
            {
                u32 b[4];
                out = hadd2(out, probe_decode(sw, it, warp, lm, b));
            }
        }
    }
    else if constexpr (!SS)
    {
        #pragma unroll 1
        for (int it = 0; it < mma_iters; ++it)
        {
            u32 b[4] = {0x2c002c00u ^ lane, 0x2c012c00u, 0x2c002c02u ^ lane, 0x2c032c00u};
            if (mode != 6) out = hadd2(out, probe_decode(sw, it, warp, lm, b));
            if (mode != 5)
            {
                const u32 a[4] = {b[0], b[2], b[1], b[3]};
                wgmma_fence();
                wgmma_rs<N>(acc, a, probe_desc(bsm, it & 3));
                wgmma_commit();
                wgmma_wait<0>();
            }
        }
    }
    const long long t1 = clock64();
    float s = 0.f;
    #pragma unroll
    for (int j = 0; j < N / 2; ++j) s += acc[j];
    sink[blockIdx.x * blockDim.x + tid] = out ^ __float_as_uint(s);  // keeps both roles' work alive
    if (lane == 0)
    {
        const int w = blockIdx.x * (blockDim.x >> 5) + warp;
        clk[2 * w] = t0;
        clk[2 * w + 1] = t1;
    }
}

#define PROBE(NAME, N, SS, THREADS) \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(int nmma, int mi, int ai, int mode, u32* sink, long long* clk) \
    { probe_body<N, SS>(nmma, mi, ai, mode, sink, clk); }
PROBE(probe_rs64, 64, false, 512)
PROBE(probe_rs128, 128, false, 512)
PROBE(probe_ss64, 64, true, 384)
PROBE(probe_ss128, 128, true, 384)
PROBE(probe_ss256, 256, true, 384)
#endif
