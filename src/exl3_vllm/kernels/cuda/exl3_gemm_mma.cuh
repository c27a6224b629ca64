// The mma.sync GEMM segment (m, h8/h16, i4/i8 tiers and their fx / stream-k twins), every arch.
#pragma once
#include "exl3_gemm_copy.cuh"
#include "exl3_gemm_tail.cuh"

// mul1 as integers: w = mul1_scale * bytesum(state * mult) + mul1_offset, so x.w is an int8 x u8 MMA over the bytes.
// h8 / h16: w = mul1_scale * (1024 + bytesum) + mul1_add, the fp16 fma of mul1_states_to_frag before its rounding.
EXL3_INLINE float mul1_scale() { return h2f(MUL1_SCALE); }
EXL3_INLINE float mul1_add() { return h2f(MUL1_ADD); }
EXL3_INLINE float mul1_offset() { return 1024.f * mul1_scale() + mul1_add(); }

EXL3_INLINE void mma_16832_s8u8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1)
{
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

EXL3_INLINE void mma_16832_u8s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1)
{
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// This lane's words of the tile whose words start at tw (shared memory).
EXL3_INLINE void tile_words(const u32* tw, const LaneMap<KA, HALF>& lm, u32 (&w)[TL::NW])
{
    #pragma unroll
    for (int q = 0; q < TL::NW; ++q) w[q] = tw[lm.idx[q]];
}
// This lane's 8 states of the tile at tw.
EXL3_INLINE void tile_states(const u32* tw, const LaneMap<KA, HALF>& lm, u32 (&st)[8])
{
    u32 w[TL::NW];
    tile_words(tw, lm, w);
    lane_states<KA, HALF>(w, lm.off, st);
}
// This lane's two B fragments of the tile at tw.
EXL3_INLINE void tile_frag(const u32* tw, const LaneMap<KA, HALF>& lm, u32 (&b)[4])
{
    u32 w[TL::NW];
    tile_words(tw, lm, w);
    words_to_frag<KA, HALF, CB>(w, lm.off, b);
}
// mul1: this lane's 8 state products (the bytes the int8 tiers multiply) of the tile at tw.
EXL3_INLINE void tile_products(const u32* tw, const LaneMap<KA, HALF>& lm, u32 (&pr)[8])
{
    tile_states(tw, lm, pr);
    #pragma unroll
    for (int q = 0; q < 8; ++q) pr[q] *= CB_MULT<2>;
}
// 3inst / mcg: this lane's 8 words of fp16 halves (summed by the MMA) of the tile at tw.
EXL3_INLINE void tile_halves(const u32* tw, const LaneMap<KA, HALF>& lm, u32 (&h)[8])
{
    u32 w[TL::NW];
    tile_words(tw, lm, w);
    words_to_halves<KA, HALF, CB>(w, lm.off, h);
}

// The h8 / h16 "fx" kernels' prologue: rows x nst 128-column chunks of x from k column kcol on, times shard suh and
// through the Hadamard-128, as fp16 rows of ld halves at sx (one warp per chunk, 4 chunks' loads in flight per warp);
// rows past `rows` up to BM are zeros. Same arithmetic as the input-transform kernel, so the same fp16 values.
template <int BM, int NWARPS, bool IN_BF16>
struct XTransform
{
    const u16* x; const u16* suh; int k, rows, nst, kcol;
    uint2 xv[4], sv[4];
    // The raw words of chunks c0, c0 + NWARPS, .. (4 of them) into registers.
    EXL3_INLINE void load(const int c0, const int lane)
    {
        #pragma unroll
        for (int j = 0; j < 4; ++j)
        {
            const int c = c0 + j * NWARPS;
            if (c >= rows * nst) continue;
            const int r = c / nst, col = kcol + (c - r * nst) * 128 + lane * 4;
            xv[j] = *(const uint2*)(x + (size_t)r * k + col);
            sv[j] = *(const uint2*)(suh + col);
        }
    }
    EXL3_INLINE void store(const int c0, const int lane, u16* sx, const int ld) const
    {
        #pragma unroll
        for (int j = 0; j < 4; ++j)
        {
            const int c = c0 + j * NWARPS;
            if (c >= rows * nst) continue;
            const int r = c / nst, col = (c - r * nst) * 128 + lane * 4;
            float v[4] = {ld2f<IN_BF16>(xv[j].x & 0xffff) * h2f(sv[j].x & 0xffff),
                          ld2f<IN_BF16>(xv[j].x >> 16) * h2f(sv[j].x >> 16),
                          ld2f<IN_BF16>(xv[j].y & 0xffff) * h2f(sv[j].y & 0xffff),
                          ld2f<IN_BF16>(xv[j].y >> 16) * h2f(sv[j].y >> 16)};
            had128_warp(v, lane);
            uint2 o;
            o.x = f2h(v[0]) | ((u32)f2h(v[1]) << 16);
            o.y = f2h(v[2]) | ((u32)f2h(v[3]) << 16);
            *(uint2*)(sx + r * ld + col) = o;
        }
    }
    // After load(warp): every chunk into sx, then the padding rows' zeros.
    EXL3_INLINE void finish(u16* sx, const int ld)
    {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        store(warp, lane, sx, ld);
        for (int c0 = warp + 4 * NWARPS; c0 < rows * nst; c0 += 4 * NWARPS)
        {
            load(c0, lane);
            store(c0, lane, sx, ld);
        }
        for (int i = rows * (ld >> 3) + threadIdx.x; i < BM * (ld >> 3); i += 32 * NWARPS)
            ((uint4*)sx)[i] = make_uint4(0, 0, 0, 0);
    }
};

// One (column block, k range) segment: pipelined decode + mma, fixed-order k-warp reduction, then the epilogue
// directly (ncontrib == 1), through split slots (mode 1) or through atomics with the last arriving block finishing.
// MODE: 0 = fp16, x as the MMA's A operand; 1 = int8 x as A (i8); 2 = int8 with the weights as A (i4); 3 = fp16 with
// the weights as A (h8, h16: each 8 rows of x are one MMA's n).
template <int BM, int NT, int KW, int KS, int STAGES, bool OUT_BF16, int MODE, bool FX = false, bool STREAM = false>
__device__ __forceinline__ void gemm_segment(const GemmArgs& p, const u32* trellis, const u16* svh, char* smem,
                                             const int cb, const int split, const int mb, const int step0,
                                             const int nstages, const int ncontrib)
{
    constexpr int NWN = 8 / NT;
    constexpr int NWARPS = NWN * KW;
    constexpr int THREADS = 32 * NWARPS;
    constexpr bool I8 = MODE == 1 || MODE == 2;
    constexpr int MT = I8 ? 1 : MODE == 3 ? BM / 8 : BM / 16;
    constexpr int W32 = TL::W32;
    constexpr int B_STEP = 8 * W32;
    constexpr int B_STAGE = KS * B_STEP;
    constexpr int A_LD = KS * 16 + 8;
    // int8 path: per k16 step 16 rows (8 hi, 8 lo) x 16 permuted bytes, in u16 units.
    constexpr int A_STAGE = I8 ? KS * 128 : BM * A_LD;
    static_assert(KS % KW == 0, "each k-warp takes whole steps of a stage");
    static_assert(!I8 || (BM == 8 && CB == 2), "the int8 path is mul1 with 8 rows");
    static_assert(MODE != 3 || (BM == 8 || BM == 16), "h8 / h16: 8 rows of x per MMA n");
    static_assert(!FX || MODE == 3, "only h8 / h16 transform their own x");
    static_assert(!FX || KS % 8 == 0, "x is transformed in 128-column chunks, whole ones per stage");
    // h8 / h16 mul1: the MMAs take 1024 + bytesum per weight and w = scale * v + add is applied to their sums (with
    // x's row sums from one more MMA against ones per step): one FMA-pipe instruction less per weight pair.
    constexpr bool SUMS = MODE == 3 && CB == 2;
    // h8 mul1 at K >= 6: one MMA per state parity instead of packing the sums into fp16 pairs (4 PRMT fewer per tile,
    // one MMA more per tile and 8 rows); measured faster at K = 6..8 and slower at K = 4 / 5 (bench/results/2026-12-05a,
    // 2026-12-05c), and h16 would pay two more MMAs for the same saving.
    constexpr bool ZHI = SUMS && MT == 1 && KA >= 6;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nw = warp % NWN, kw = warp / NWN;
    const int row0 = mb * BM;
    const int rows = min(BM, p.m - row0);
    int shard = 0;
    #pragma unroll
    for (int i = 0; i < 7; ++i) if (i + 1 < p.nshards && cb >= p.shard_end[i]) shard = i + 1;
    const u16* A = p.xh + ((size_t)shard * p.m + row0) * p.k;
    const int ntiles = p.n_total >> 4;
    const size_t b_row = (size_t)ntiles * W32;
    const u32* B = trellis + (size_t)step0 * b_row + (size_t)cb * 8 * W32;

    u32* sB = (u32*)smem;
    u16* sA = (u16*)(smem + STAGES * B_STAGE * 4);
    const int xld = p.steps_per_split * 16 + 8;  // FX: the block's whole k range of x stays in shared memory

    TrellisCopy<KS, 8, THREADS> tcopy;
    tcopy.init(b_row, tid);
    XCopy<I8 ? 16 : BM, KS, THREADS, PaddedRows<A_LD>> xcopy;  // (the int8 path copies its own layout below)
    if constexpr (!I8 && !FX) xcopy.init(p.k, rows, tid);
    auto load_w = [&](int s, int buf) { tcopy.issue(smem_addr(sB + buf * B_STAGE), B + (size_t)s * KS * b_row); };
    auto load_x = [&](int s, int buf) {
        const int kcol = (step0 + s * KS) * 16;
        const u32 adst = smem_addr(sA + buf * A_STAGE);
        if constexpr (FX) return;
        else if constexpr (I8)
        {
            const char* xq = (const char*)p.xh + ((size_t)(shard * p.mblocks + mb) * (p.k >> 4) + step0 + s * KS) * 256;
            // A fixed count per thread, unrolled (a runtime loop here took more instructions per stage than its copies).
            #pragma unroll
            for (int j = 0; j < (KS * 16 + THREADS - 1) / THREADS; ++j)
            {
                const int c = tid + j * THREADS;
                if ((KS * 16) % THREADS == 0 || c < KS * 16) cp_async16(adst + c * 16, xq + c * 16, 16);
            }
        }
        else xcopy.issue(adst, A + kcol);
    };
    auto load_stage = [&](int s, int buf) { load_w(s, buf); load_x(s, buf); };

    float acc[MT][2 * NT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int j = 0; j < 2 * NT; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
    float xsum[SUMS ? MT : 1][4];  // SUMS: each x row's sum over this warp's k
    #pragma unroll
    for (int nb = 0; nb < (SUMS ? MT : 1); ++nb)
        #pragma unroll
        for (int e = 0; e < 4; ++e) xsum[nb][e] = 0.f;
    int iacc[I8 ? 2 * NT : 1][4];
    #pragma unroll
    for (int j = 0; j < (I8 ? 2 * NT : 1); ++j)
        #pragma unroll
        for (int e = 0; e < 4; ++e) iacc[j][e] = 0;

    LaneMap<KA, HALF> lm;
    lm.init(lane);

    XTransform<BM, NWARPS, OUT_BF16> xt;
    if constexpr (FX)
    {
        // No transform kernel runs before this one: wait for x's producer, then x's first words go out ahead of the
        // weights so they are back by the time the prologue's weights are issued.
        pdl_wait();
        xt = {p.xraw + (size_t)row0 * p.k, p.suh + (size_t)shard * p.k, p.k, rows, nstages * (KS / 8), step0 * 16};
        xt.load(warp, lane);
    }
    ring_prologue<STAGES>(load_w, load_x, nstages);
    if constexpr (FX) xt.finish(sA, xld);
    for (int s = 0; s < nstages; ++s)
    {
        const int buf = ring_next<STAGES, false>(load_stage, s, nstages);
        const u32* bB = sB + buf * B_STAGE;
        const u16* bA = sA + buf * A_STAGE;
        #pragma unroll
        for (int ii = 0; ii < KS / KW; ++ii)
        {
            const int i = kw + ii * KW;
            if constexpr (MODE == 2)
            {
                // Weights as the A operand (16 columns x 8 k per MMA), x as B: MMA column n = lane / 4 is x row n / 2,
                // part n % 2, so one word per lane holds its four k offsets 2j, 2j+1, 8+2j, 9+2j (rows 0..3 only).
                const u32* aw = (const u32*)(bA + i * 128);
                const u32 xw = aw[((lane >> 2) & 1) * 32 + (lane >> 3) * 4 + (lane & 3)];
                const u32 x0 = prmt(xw, 0u, 0x0000), x1 = prmt(xw, 0u, 0x1111);
                const u32 x2 = prmt(xw, 0u, 0x2222), x3 = prmt(xw, 0u, 0x3333);
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                {
                    u32 st[8];
                    tile_products(bB + i * B_STEP + (nw * NT + nt) * W32, lm, st);
                    mma_16832_u8s8(iacc[nt], st[0], st[4], st[1], st[5], x0, x1);
                    mma_16832_u8s8(iacc[nt], st[2], st[6], st[3], st[7], x2, x3);
                }
                continue;
            }
            if constexpr (MODE == 3)
            {
                // Weights as the A operand (16 columns per MMA), x row 8 nb + lane / 4 as MMA column n: this lane's x
                // at k offsets (2j, 2j+1) and (8+2j, 9+2j), j = lane % 4.
                u32 xa[MT], xb[MT], x0[MT], x1[MT], x2[MT], x3[MT];
                #pragma unroll
                for (int nb = 0; nb < MT; ++nb)
                {
                    const u16* xr = FX ? sA + (nb * 8 + (lane >> 2)) * xld + s * KS * 16 + i * 16 + 2 * (lane & 3)
                                       : bA + (nb * 8 + (lane >> 2)) * A_LD + i * 16 + 2 * (lane & 3);
                    xa[nb] = *(const u32*)xr;
                    xb[nb] = *(const u32*)(xr + 8);
                    // 3inst / mcg: a weight is two fp16 halves summed, so the raw word is an A pair against x repeated
                    // (the tensor cores add the halves: two MMAs per tile and 8 rows); mul1: one.
                    x0[nb] = prmt(xa[nb], 0u, 0x1010); x1[nb] = prmt(xa[nb], 0u, 0x3232);
                    x2[nb] = prmt(xb[nb], 0u, 0x1010); x3[nb] = prmt(xb[nb], 0u, 0x3232);
                    if constexpr (SUMS)
                        mma_16816(xsum[nb], {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u}, xa[nb], xb[nb]);
                }
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                {
                    const u32* tw = bB + i * B_STEP + (nw * NT + nt) * W32;
                    if constexpr (CB == 2)
                    {
                        u32 st[8];
                        tile_states(tw, lm, st);
                        if constexpr (ZHI)
                        {
                            // Each 1024 + bytesum alone in its word (upper half zero): the even-k states against x as
                            // loaded, the odd-k ones against x's odd elements repeated; no packing in the decode.
                            u32 h[8];
                            #pragma unroll
                            for (int q = 0; q < 8; ++q) h[q] = mul1_sum(st[q]);
                            #pragma unroll
                            for (int nb = 0; nb < MT; ++nb)
                            {
                                mma_16816(acc[nb][nt], {h[0], h[4], h[2], h[6]}, xa[nb], xb[nb]);
                                mma_16816(acc[nb][nt], {h[1], h[5], h[3], h[7]}, x1[nb], x3[nb]);
                            }
                            continue;
                        }
                        u32 b[4];
                        if constexpr (SUMS) mul1_sums_to_frag(st, b);
                        else mul1_states_to_frag(st, b);
                        #pragma unroll
                        for (int nb = 0; nb < MT; ++nb)
                            mma_16816(acc[nb][nt], {b[0], b[2], b[1], b[3]}, xa[nb], xb[nb]);
                    }
                    else
                    {
                        u32 h[8];
                        tile_halves(tw, lm, h);
                        #pragma unroll
                        for (int nb = 0; nb < MT; ++nb)
                        {
                            mma_16816(acc[nb][nt], {h[0], h[4], h[1], h[5]}, x0[nb], x1[nb]);
                            mma_16816(acc[nb][nt], {h[2], h[6], h[3], h[7]}, x2[nb], x3[nb]);
                        }
                    }
                }
                continue;
            }
            if constexpr (I8)
            {
                // Lane's hi and lo words hold k offsets 2j, 2j+1, 8+2j, 9+2j (j = lane % 4); each byte is replicated
                // over the 4 product bytes of one weight.
                const u32* aw = (const u32*)(bA + i * 128);
                const u32 hi = aw[(lane >> 2) * 4 + (lane & 3)], lo = aw[32 + (lane >> 2) * 4 + (lane & 3)];
                const u32 a0[4] = {prmt(hi, 0u, 0x0000), prmt(lo, 0u, 0x0000), prmt(hi, 0u, 0x1111), prmt(lo, 0u, 0x1111)};
                const u32 a8[4] = {prmt(hi, 0u, 0x2222), prmt(lo, 0u, 0x2222), prmt(hi, 0u, 0x3333), prmt(lo, 0u, 0x3333)};
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                {
                    u32 st[8];
                    tile_products(bB + i * B_STEP + (nw * NT + nt) * W32, lm, st);
                    mma_16832_s8u8(iacc[2 * nt], a0, st[0], st[1]);
                    mma_16832_s8u8(iacc[2 * nt], a8, st[2], st[3]);
                    mma_16832_s8u8(iacc[2 * nt + 1], a0, st[4], st[5]);
                    mma_16832_s8u8(iacc[2 * nt + 1], a8, st[6], st[7]);
                }
                continue;
            }
            u32 a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(a[mt], smem_addr(bA + (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * A_LD + i * 16 + (lane >> 4) * 8));
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
            {
                u32 b[4];
                tile_frag(bB + i * B_STEP + (nw * NT + nt) * W32, lm, b);
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                {
                    mma_16816(acc[mt][2 * nt], a[mt], b[0], b[1]);
                    mma_16816(acc[mt][2 * nt + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (MODE == 3)
    {
        // acc[nb][nt]: x rows 8 nb + 2j, 8 nb + 2j + 1 (j = lane % 4) of output columns g and g + 8 of tile nt.
        if constexpr (SUMS)
        {
            const float a = mul1_scale(), b = mul1_add();
            #pragma unroll
            for (int nb = 0; nb < MT; ++nb)
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) acc[nb][nt][e] = acc[nb][nt][e] * a + xsum[nb][e] * b;
        }
        float* red = (float*)smem;
        // Each k-warp writes its own slice (Tier.red_bytes); sum_slices adds them in k-warp order.
        #pragma unroll
        for (int nb = 0; nb < MT; ++nb)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    red[kw * BM * RLD + (nb * 8 + 2 * (lane & 3) + (e & 1)) * RLD + (nw * NT + nt) * 16 + (lane >> 2)
                        + 8 * (e >> 1)] = acc[nb][nt][e];
        sum_slices<KW, BM, THREADS>(red, rows);
        segment_tail<OUT_BF16, NWARPS, 4, !STREAM>(p, svh, red, rows, row0, cb, split, mb, ncontrib);
        return;
    }
    if constexpr (MODE == 2)
    {
        // Lane holds x row lane % 4 (hi, lo) of output columns g and g + 8 of each tile.
        const float* mt = p.xmeta + ((size_t)(shard * p.mblocks + mb) * 8 + (lane & 3)) * 4;
        const float sh = mt[0] * mul1_scale(), sl = mt[1] * mul1_scale();
        const float off = (step0 == 0 && kw == 0) ? mt[2] * mul1_offset() : 0.f;
        float* red = (float*)smem;
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int h = 0; h < 2; ++h)
                red[kw * BM * RLD + (lane & 3) * RLD + (nw * NT + nt) * 16 + (lane >> 2) + 8 * h] =
                    (float)iacc[nt][2 * h] * sh + (float)iacc[nt][2 * h + 1] * sl + off;
        sum_slices<KW, BM, THREADS>(red, rows);
        segment_tail<OUT_BF16, NWARPS, 4, !STREAM>(p, svh, red, rows, row0, cb, split, mb, ncontrib);
        return;
    }
    if constexpr (I8)
    {
        // Back to floats: hi and lo rows recombine in-lane; the split holding k = 0 adds the offset term once.
        const float* mt = p.xmeta + ((size_t)(shard * p.mblocks + mb) * 8 + (lane >> 2)) * 4;
        const float sh = mt[0] * mul1_scale(), sl = mt[1] * mul1_scale();
        const float off = (step0 == 0 && kw == 0) ? mt[2] * mul1_offset() : 0.f;
        #pragma unroll
        for (int j = 0; j < 2 * NT; ++j)
        {
            acc[0][j][0] = (float)iacc[j][0] * sh + (float)iacc[j][2] * sl + off;
            acc[0][j][1] = (float)iacc[j][1] * sh + (float)iacc[j][3] * sl + off;
        }
    }

    float* red = (float*)smem;
    if constexpr (I8)
    {
        #pragma unroll
        for (int j = 0; j < 2 * NT; ++j)
            *(float2*)(red + kw * BM * RLD + (lane >> 2) * RLD + nw * NT * 16 + j * 8 + 2 * (lane & 3)) =
                make_float2(acc[0][j][0], acc[0][j][1]);
        sum_slices<KW, BM, THREADS>(red, rows);
        segment_tail<OUT_BF16, NWARPS, 4, !STREAM>(p, svh, red, rows, row0, cb, split, mb, ncontrib);
        return;
    }
    // The m tiers: KW rounds of load-add-store in k-warp order (a slice per k-warp would outgrow their stages).
    #pragma unroll 1
    for (int kk = 0; kk < KW; ++kk)
    {
        if (kw == kk)
        {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int j = 0; j < 2 * NT; ++j)
                    #pragma unroll
                    for (int h = 0; h < 2; ++h)
                    {
                        const int r = mt * 16 + (lane >> 2) + h * 8;
                        const int c = nw * NT * 16 + j * 8 + 2 * (lane & 3);
                        float2* d = (float2*)(red + r * RLD + c);
                        float2 v = make_float2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
                        if (kk) { float2 o = *d; v.x += o.x; v.y += o.y; }
                        *d = v;
                    }
        }
        __syncthreads();
    }
    segment_tail<OUT_BF16, NWARPS, 4, !STREAM>(p, svh, red, rows, row0, cb, split, mb, ncontrib);
}
