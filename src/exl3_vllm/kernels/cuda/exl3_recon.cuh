// The weight reconstruction of the large-M path (exl3_recon_*): decode, both Hadamards, suh and svh into a dense weight.
#pragma once
#include "exl3_linear_args.cuh"

// Large-M path: the dense weight (both Hadamards, suh and svh folded in) of columns col0..col0+cols in the output
// dtype as wt[c][k], k contiguous, so cuBLAS multiplies x by it directly and no pass over x or y is left. A block owns
// a 128 k x 128 column unit of 8 x 8 tiles and every step stays on packed fp16 fragments in registers:
// - phase 1, warp w = strip w (16 columns), its 8 tiles down k: the 8-point Hadamard across them (k bits 4-6) on the
//   decoded fragments, an mma with the +-1 matrix H16 for k bits 0-3, then the packed result to shared memory;
// - phase 2, warp w = k tile w, its 8 tiles across the strips: the 8-point Hadamard across them (column bits 4-6), an
//   mma with H16 for column bits 0-3 that leaves k along each lane's pairs, the scales, 8-byte stores.
// Phase 1's H16 rows are permuted (recon_row) so that a phase-2 lane holds 4 consecutive k of its two columns.
EXL3_INLINE u32 pack_f16x2(float lo, float hi) { u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }
EXL3_INLINE u32 had16_pair(int i, int j0, int j1)  // fp16 (H16[i][j0], H16[i][j1]), H16[i][j] = (-1)^popc(i & j)
{
    return ((__popc(i & j0) & 1) ? 0xBC00u : 0x3C00u) | (((__popc(i & j1) & 1) ? 0xBC00u : 0x3C00u) << 16);
}
// H16's rows r0 (k or column g) and r1 (g + 8) as an m16n8k16 A fragment of lane column pair t.
EXL3_INLINE void had16_a(int r0, int r1, int t, u32 (&a)[4])
{
    a[0] = had16_pair(r0, 2 * t, 2 * t + 1); a[1] = had16_pair(r1, 2 * t, 2 * t + 1);
    a[2] = had16_pair(r0, 2 * t + 8, 2 * t + 9); a[3] = had16_pair(r1, 2 * t + 8, 2 * t + 9);
}
EXL3_INLINE u32 hsub2(u32 a, u32 b) { u32 r; asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
// The k (within the tile) that phase 1's mma row r computes: phase 2's lane t then gets rows 2t, 2t+1 (its low mma)
// and 2t + 8, 2t + 9 (its high one) = k 4t .. 4t + 3.
EXL3_INLINE int recon_row(int r) { return 4 * ((r & 7) >> 1) + 2 * (r >> 3) + (r & 1); }
// The 8-point Sylvester Hadamard (unscaled) across v[0..7] on packed fp16 pairs, 4 registers each.
EXL3_INLINE void had8_packed(u32 (&v)[8][4])
{
    #pragma unroll
    for (int S = 1; S < 8; S <<= 1)
    #pragma unroll
    for (int j = 0; j < 8; ++j)
        if (!(j & S))
        {
            #pragma unroll
            for (int q = 0; q < 4; ++q)
            {
                const u32 a = v[j][q], b = v[j | S][q];
                v[j][q] = hadd2(a, b);
                v[j | S][q] = hsub2(a, b);
            }
        }
}
// Two floats in the output dtype, packed (lo in the low half) by one conversion.
template <bool BF16> EXL3_INLINE u32 pack2(float lo, float hi)
{
    u32 r;
    if constexpr (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// t_off, u_off, v_off, w_off: element offsets into trellis, suh, svh, wt (one expert's slices); kept apart from the
// pointers, which stay kernel parameters instead of live registers (at 128 registers a pointer more spills).
template <bool OUT_BF16>
__device__ __forceinline__ void recon_body(const u32* __restrict__ trellis, long long t_off,
                                           const u16* __restrict__ suh, int u_off, const u16* __restrict__ svh,
                                           int v_off, u16* __restrict__ wt, long long w_off, int n_total, int col0,
                                           int cols, int k)
{
    // [2 buffers][8 k tiles][8 strips][32 lanes] packed fragments (variants.RECON_SMEM): the next unit's phase 1
    // writes the other buffer, so one barrier per unit suffices.
    extern __shared__ __align__(16) uint4 frag[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    LaneMap<KA, HALF> lm;
    lm.init(lane);
    // A operands (rows = output index, columns = the index summed over): phase 1's rows permuted by recon_row.
    u32 h1[4], h2[4];
    had16_a(recon_row(g), recon_row(g + 8), t, h1);
    had16_a(g, g + 8, t, h2);
    const int kb = k >> 7, units = (cols >> 7) * kb;
    const int tile_row = (n_total >> 4) * TL::W32;  // words between k16 rows of tiles
    // The next unit's words load right after this unit's decode, so their latency hides behind both phases.
    u32 wr[8][TL::NW];
    // Unit u = cu * kb + ku; the grid stride steps (cu, ku) by (dcu, dku) with a carry, no division per unit.
    const int dcu = gridDim.x / kb, dku = gridDim.x - dcu * kb;
    int cu = blockIdx.x / kb, ku = blockIdx.x - cu * kb;
    auto tiles_of = [&](int c, int kk) {
        return trellis + t_off + (size_t)kk * 8 * (size_t)tile_row + (size_t)((col0 >> 4) + c * 8 + warp) * TL::W32;
    };
    const u32* tw = tiles_of(blockIdx.x < units ? cu : 0, blockIdx.x < units ? ku : 0);
    #pragma unroll
    for (int j = 0; j < 8; ++j)
        #pragma unroll
        for (int q = 0; q < TL::NW; ++q) wr[j][q] = blockIdx.x < units ? __ldg(tw + j * tile_row + lm.idx[q]) : 0u;
    int buf = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x, buf ^= 1)
    {
        const int cn = cu + dcu + (ku + dku >= kb), kn = ku + dku - (ku + dku >= kb ? kb : 0);
        // Phase 1: decode the strip's 8 tiles (pairs along k, B-fragment layout), Hadamard across them, H16 over k.
        u32 v[8][4];
        #pragma unroll
        for (int j = 0; j < 8; ++j) words_to_frag<KA, HALF, CB>(wr[j], lm.off, v[j]);
        if (u + (int)gridDim.x < units)
        {
            tw = tiles_of(cn, kn);
            #pragma unroll
            for (int j = 0; j < 8; ++j)
                #pragma unroll
                for (int q = 0; q < TL::NW; ++q) wr[j][q] = __ldg(tw + j * tile_row + lm.idx[q]);
        }
        had8_packed(v);
        uint4* fb = frag + buf * 2048 + warp * 32 + lane;  // [J][strip w][lane]: J at a 256-entry stride
        #pragma unroll
        for (int j = 0; j < 8; ++j)
        {
            float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            mma_16816(d[0], h1, v[j][0], v[j][1]);  // H16 . tile (exact: 16 fp16 terms in fp32), columns 0-7
            mma_16816(d[1], h1, v[j][2], v[j][3]);  // columns 8-15
            // The D fragment rounded to fp16 is an A fragment (rows: k, columns: the strip's 16 columns).
            fb[j * 256] = make_uint4(pack_f16x2(d[0][0], d[0][1]), pack_f16x2(d[0][2], d[0][3]),
                                     pack_f16x2(d[1][0], d[1][1]), pack_f16x2(d[1][2], d[1][3]));
        }
        __syncthreads();
        // Phase 2: k tile J = warp across the 8 strips.
        const uint4* fa = frag + buf * 2048 + warp * 256 + lane;
        #pragma unroll
        for (int s = 0; s < 8; ++s)
        {
            const uint4 a = fa[s * 32];
            v[s][0] = a.x; v[s][1] = a.y; v[s][2] = a.z; v[s][3] = a.w;
        }
        had8_packed(v);
        // This lane's k: ku * 128 + 16 J + 4t .. +3; both Hadamards' 1/sqrt(128) folded into suh's factor.
        const int kq = ku * 128 + warp * 16 + 4 * t;
        float fk[4];
        h2f4(suh + u_off + kq, fk);
        #pragma unroll
        for (int i = 0; i < 4; ++i) fk[i] *= 0.0078125f;
        // Columns cu * 128 + 16 s + g (+ 8): wt rows 16 k apart per strip, one pointer and one stride.
        const int c0 = cu * 128 + g;
        const u16* sv = svh + v_off + col0 + c0;
        u16* wp = wt + w_off + (size_t)c0 * k + kq;
        const size_t rstep = (size_t)8 * k;
        #pragma unroll
        for (int s = 0; s < 8; ++s, wp += 2 * rstep)
        {
            // svh folded into H16's rows (exact in fp16: +-svh): diag(svh) H16 . X^T, rows = column n' (g, g + 8),
            // pairs along k; B = the A fragment's halves (X^T's columns).
            const u32 s0 = __ldg(sv + 16 * s) * 0x10001u, s1 = __ldg(sv + 16 * s + 8) * 0x10001u;
            const u32 hs[4] = {hmul2(h2[0], s0), hmul2(h2[1], s1), hmul2(h2[2], s0), hmul2(h2[3], s1)};
            float lo[4] = {0.f, 0.f, 0.f, 0.f}, hi[4] = {0.f, 0.f, 0.f, 0.f};
            mma_16816(lo, hs, v[s][0], v[s][2]);  // k rows 2t, 2t + 1 of phase 1 = k 4t, 4t + 1
            mma_16816(hi, hs, v[s][1], v[s][3]);  // k 4t + 2, 4t + 3
            *(uint2*)wp = make_uint2(pack2<OUT_BF16>(lo[0] * fk[0], lo[1] * fk[1]),
                                     pack2<OUT_BF16>(hi[0] * fk[2], hi[1] * fk[3]));
            *(uint2*)(wp + rstep) = make_uint2(pack2<OUT_BF16>(lo[2] * fk[0], lo[3] * fk[1]),
                                               pack2<OUT_BF16>(hi[2] * fk[2], hi[3] * fk[3]));
        }
        cu = cn;
        ku = kn;
    }
}
