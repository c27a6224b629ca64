// The warp-specialised GEMM (x tiers, sm_90a): producer warpgroups decode into shared memory, consumers run wgmma.
#pragma once
#include "exl3_gemm_wg.cuh"

#ifdef EXL3_WGMMA
// Warp-specialized Hopper GEMM over 128-column blocks: NP producer warpgroups load the trellis with cp.async and x with
// bulk copies, and decode each 16x16 tile once into shared memory in wgmma's A layout; two consumer warpgroups (64
// columns each) run wgmma with A and x from shared memory over all BN rows, then the epilogue. Per-stage barriers
// replace block-wide ones, so decoding runs up to STAGES stages ahead of the tensor cores, across segments too.
// (Both roles start with the launch's per-thread register share; with PREG the producers give theirs down to PREG
// and the consumers take the rest for their accumulators, which is what lets 256 rows run with 8 producer warps.)
template <int BN, int NP, int KS, int STAGES, int PREG = 0>
struct WsShape
{
    static constexpr int NPW = 4 * NP;                  // producer warps
    static constexpr int UPW = 8 * KS / NPW;            // tiles per producer warp and stage: u = pw + NPW * j
    static constexpr int THREADS = 128 * (2 + NP);
    static constexpr int X_STAGE = WgX<BN, KS>::STAGE;
    static constexpr int A_STEP = 4096;                 // one k16 step: two 64-column A operands of 8x(8 rows x 16 bytes)
    static constexpr int A_STAGE = KS * A_STEP;
    static constexpr int T_STAGE = UPW * TL::W32;       // trellis words of one producer warp's stage
    // Registers per thread: the launch's share of the register file, and the consumers' count once the producers
    // keep only PREG (0: no rebalance).
    static constexpr int LAUNCH_REGS = (65536 / THREADS) & ~7;
    static constexpr int CREG_ = ((LAUNCH_REGS * THREADS - 128 * NP * PREG) / 256) & ~7;
    static constexpr int CREG = CREG_ > 240 ? 240 : CREG_;
    // ptxas gives one instruction no more than the launch's registers (an n-row wgmma needs n/2 + ~26): below that
    // it runs as two halves of BN/2 rows (each half's accumulators, the same fragment layout).
    // Halves read each A tile once into registers (ldmatrix) for both, instead of once per half from shared memory,
    // whose pipe bounds these tiers.
    static constexpr bool HALVES = LAUNCH_REGS < BN / 2 + 32;
    // Tile (k16 step u / 8, column tile u % 8) = rows 16 (u % 4).. of consumer (u / 4) % 2's operand.
    EXL3_INLINE static constexpr u32 a_off(int u) { return (u >> 3) * A_STEP + ((u >> 2) & 1) * 2048 + (u & 3) * 512; }
    static_assert(NPW == 4 || NPW == 8, "a_off splits over pw and j only for 4 or 8 producer warps");
    static_assert(PREG == 0 || (PREG % 8 == 0 && PREG >= 24 && PREG < LAUNCH_REGS && CREG > LAUNCH_REGS),
                  "a rebalance gives the consumers more than the launch's share");
    static_assert((8 * KS) % NPW == 0, "whole tiles per producer warp");
    static_assert(BN % 64 == 0 && BN <= 256, "wgmma n of 64, 128 or 256 rows");
};

EXL3_INLINE void consumer_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// Consumers only (256 threads, named barrier 1): partial sums from the accumulators to split slots (mode 1), or
// through atomics with the last contributor finishing, or straight through the reduction tile 64 rows at a time.
template <int BN, bool OUT_BF16>
__device__ __forceinline__ void ws_tail(const GemmArgs& p, const u16* svh, float* red, const float (&acc)[BN / 2],
                                        const int rows, const int row0, const int cb, const int split, const int mb,
                                        const int ncontrib)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ncol0 = cb * 128;
    const int col = warp * 16 + (lane >> 2);
    // acc[4j + e]: row 8j + 2(lane % 4) + (e & 1), column col + 8 (e >> 1)
    if (ncontrib > 1)
    {
        // Row 2 (lane % 4) of this lane's first pair, then 8 rows further per j (pointer steps, no 64-bit products).
        float* g = p.ws + (p.mode == 1 ? (size_t)split * p.m * p.n_total : 0)
                 + (size_t)(row0 + 2 * (lane & 3)) * p.n_total + ncol0 + col;
        const size_t step = (size_t)8 * p.n_total;
        const int r0 = 2 * (lane & 3);
        #pragma unroll
        for (int j = 0; j < BN / 8; ++j, g += step)
            #pragma unroll
            for (int e = 0; e < 4; ++e)
            {
                if (j * 8 + r0 + (e & 1) >= rows) continue;
                float* ge = g + (e & 1) * p.n_total + 8 * (e >> 1);
                if (p.mode == 1) *ge = acc[4 * j + e]; else red_add(ge, acc[4 * j + e]);
            }
        if (p.mode == 1) return;
        if (!last_arrival(p, mb, cb, ncontrib, consumer_sync)) return;
        if (tid == 0) p.counters[mb * (p.n_total >> 7) + cb] = 0;
    }
    // The reduction tile holds 64 rows (its own shared memory, see Tier.smem). Separate loops for the two sources, so
    // the accumulators are dead while the partials are read back.
    if (ncontrib == 1)
    {
        for (int r0 = 0; r0 < rows; r0 += 64)
        {
            #pragma unroll
            for (int j = 0; j < BN / 8; ++j)
            {
                if (j * 8 < r0 || j * 8 >= r0 + 64) continue;
                const int r = j * 8 - r0 + 2 * (lane & 3);
                red[r * RLD + col] = acc[4 * j];
                red[(r + 1) * RLD + col] = acc[4 * j + 1];
                red[r * RLD + col + 8] = acc[4 * j + 2];
                red[(r + 1) * RLD + col + 8] = acc[4 * j + 3];
            }
            consumer_sync();
            epilogue_rows<OUT_BF16, 8>(red, min(64, rows - r0), row0 + r0, ncol0, p, svh);
            consumer_sync();
        }
        return;
    }
    for (int r0 = 0; r0 < rows; r0 += 64)
    {
        const int n = min(64, rows - r0);
        take_partials<256, (BN > 128 ? 1 : 4)>(p, red, n, row0 + r0, ncol0, tid);
        consumer_sync();
        epilogue_rows<OUT_BF16, 8>(red, n, row0 + r0, ncol0, p, svh);
        consumer_sync();
    }
}

template <int BN, int NP, int KS, int STAGES, bool OUT_BF16, bool STREAM, int PREG>
__device__ __forceinline__ void ws_body(const GemmArgs& p, char* smem)
{
    typedef WsShape<BN, NP, KS, STAGES, PREG> SH;
    constexpr int W32 = TL::W32;
    constexpr int NW = TL::NW;
    __shared__ __align__(8) u64 bars[2 * STAGES];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int mb = blockIdx.z;
    const int row0 = mb * BN;
    const int rows = min(BN, p.m - row0);
    const size_t b_row = (size_t)(p.n_total >> 4) * W32;
    char* base = smem + ((1024 - (smem_addr(smem) & 1023)) & 1023);
    const u32 sx = smem_addr(base), sa = sx + STAGES * SH::X_STAGE;
    u32* tring = (u32*)(base + STAGES * (SH::X_STAGE + SH::A_STAGE));
    float* red = (float*)(tring + SH::NPW * STAGES * SH::T_STAGE);
    const u32 full = smem_addr(bars), empty = full + 8 * STAGES;
    if (tid == 0)
    {
        // Arrivals per stage: each producer warp once its A tiles are stored, plus the lane that issues the stage's x
        // bulk copies (which also wait for their bytes); each consumer warp once its wgmmas are done. (Per-warp
        // arrivals: a barrier takes arrivals one at a time.)
        #pragma unroll
        for (int s = 0; s < STAGES; ++s)
        {
            mbar_init(full + 8 * s, SH::NPW + 1);
            mbar_init(empty + 8 * s, 8);
        }
    }
    // x rows past the block's rows stay zero in every stage buffer, so the loads skip them.
    for (int c = tid; c < STAGES * (BN - rows) * KS * 2; c += SH::THREADS)
    {
        const int st = c / ((BN - rows) * KS * 2), rj = c - st * ((BN - rows) * KS * 2);
        const int r = rows + rj / (KS * 2), j = rj % (KS * 2);
        *(uint4*)(base + st * SH::X_STAGE + WgX<BN, KS>::offset(r, j)) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async();
    __syncthreads();

    // Stages run so far in this block (ring slot, barrier parity, whether the ring has wrapped): the roles keep the
    // same count across segments, so the pipeline does not drain between them.
    int buf = 0;
    u32 phase = 0;
    bool wrapped = false;
    auto advance = [&]() { if (++buf == STAGES) { buf = 0; phase ^= 1; wrapped = true; } };
    if (warp >= 8)
    {
        if constexpr (PREG != 0) setmaxnreg_dec<PREG>();
        const int pw = warp - 8;
        const u32* trp = tring + pw * STAGES * SH::T_STAGE;
        const u32 tr = smem_addr(trp);
        LaneMap<KA, HALF> lm;
        lm.init(lane);
        // Lane's row address inside a tile's four 8x8 matrices (stmatrix): matrix j = (row group j & 1, k half j >> 1).
        const u32 lane_off = ((lane >> 3) & 1) * 256 + (lane >> 4) * 128 + (lane & 7) * 16;
        // Tile u = pw + NPW * j sits at a_off(pw) + a_off(NPW * j): the second part is a constant per unrolled j.
        const u32 warp_a = SH::a_off(pw);
        // This lane's 16-byte trellis chunks of a stage: chunk c = lane + 32 t is word 4 (c % CH) of tile c / CH.
        constexpr int CH = W32 / 4;
        constexpr int NCH = (SH::UPW * CH + 31) / 32;
        int xw = 0;  // the producer warp that loads the next stage's x
        for_each_segment<KS, STREAM>(p, 128, [&](int cb, int, int step0, int nstages, int) {
            int shard = 0;
            #pragma unroll
            for (int i = 0; i < 7; ++i) if (i + 1 < p.nshards && cb >= p.shard_end[i]) shard = i + 1;
            // x in the staged layout (exl3_input_staged): each 64-k group of the block's rows is rows * 128 contiguous
            // bytes already in the stage's swizzle, one bulk copy (step0 is a multiple of KS, so of 4 k16 steps).
            const u16* XG = p.xh + ((size_t)shard * (p.k >> 6) * p.m + (size_t)(step0 >> 2) * p.m + row0) * 64;
            const size_t gstep = (size_t)p.m * 64;
            const u32* src[NCH];
            bool has[NCH];
            #pragma unroll
            for (int t = 0; t < NCH; ++t)
            {
                const int c = lane + 32 * t, j = c / CH, u = pw + SH::NPW * j;
                has[t] = c < SH::UPW * CH;
                src[t] = p.trellis + (size_t)(step0 + (u >> 3)) * b_row + ((size_t)cb * 8 + (u & 7)) * W32 + (c % CH) * 4;
            }
            const size_t stage_words = (size_t)KS * b_row;
            auto load_trellis = [&](int s, int slot) {
                #pragma unroll
                for (int t = 0; t < NCH; ++t)
                    if (has[t]) cp_async16(tr + (slot * SH::T_STAGE + (lane + 32 * t) * 4) * 4, src[t] + s * stage_words, 16);
            };
            __syncwarp();
            #pragma unroll
            for (int s = 0; s < STAGES - 1; ++s)
            {
                if (s < nstages) load_trellis(s, (buf + s) % STAGES);
                cp_async_commit();
            }
            pdl_wait();  // x is the input transform's output (dependent launch: the weights above are already on the way)
            for (int s = 0; s < nstages; ++s, advance())
            {
                if (wrapped) mbar_wait(empty + 8 * buf, phase ^ 1);
                // The stage's x by one lane of one warp in turn: bulk copies through the async proxy that wgmma reads
                // through, counted on the stage's barrier (no per-thread copies or arrivals).
                if (pw == xw && lane == 0)
                {
                    const u32 xdst = sx + buf * SH::X_STAGE;
                    mbar_arrive_expect_tx(full + 8 * buf, (KS / 4) * rows * 128);
                    #pragma unroll
                    for (int a = 0; a < KS / 4; ++a)
                        bulk_g2s(xdst + a * (BN * 128), XG + (size_t)(s * (KS / 4) + a) * gstep, rows * 128, full + 8 * buf);
                }
                if (++xw == SH::NPW) xw = 0;
                __syncwarp();  // the ring slot loaded next was read by every lane in the previous stage
                if (s + STAGES - 1 < nstages) load_trellis(s + STAGES - 1, buf == 0 ? STAGES - 1 : buf - 1);
                cp_async_commit();
                cp_async_wait<STAGES - 1>();
                __syncwarp();
                const u32* tb = trp + buf * SH::T_STAGE;
                const u32 adst = sa + buf * SH::A_STAGE + lane_off + warp_a;
                u32 w[NW];
                #pragma unroll
                for (int q = 0; q < NW; ++q) w[q] = tb[lm.idx[q]];
                #pragma unroll
                for (int j = 0; j < SH::UPW; ++j)
                {
                    // The next tile's words now: loads cannot move past stmatrix (an asm with a memory clobber), so
                    // without this every tile would wait out a shared-memory load latency.
                    u32 wn[NW];
                    #pragma unroll
                    for (int q = 0; q < NW; ++q) wn[q] = j + 1 < SH::UPW ? tb[(j + 1) * W32 + lm.idx[q]] : 0u;
                    u32 b[4];
                    words_to_frag<KA, HALF, CB>(w, lm.off, b);
                    stmatrix_x4(adst + SH::a_off(SH::NPW * j), b[0], b[2], b[1], b[3]);
                    #pragma unroll
                    for (int q = 0; q < NW; ++q) w[q] = wn[q];
                }
                fence_proxy_async();  // the stmatrix stores (generic proxy) before wgmma reads them (async proxy)
                __syncwarp();
                if (lane == 0) mbar_arrive(full + 8 * buf);
            }
            cp_async_wait<0>();
        });
    }
    else
    {
        if constexpr (PREG != 0) setmaxnreg_inc<SH::CREG>();
        const int c = warp >> 2;
        // ldmatrix row address of this warp's 16 rows of its consumer's A tile (the inverse of the producers' stmatrix).
        const u32 a_lane = c * 2048 + (warp & 3) * 512 + ((lane >> 3) & 1) * 256 + (lane >> 4) * 128 + (lane & 7) * 16;
        for_each_segment<KS, STREAM>(p, 128, [&](int cb, int split, int, int nstages, int ncontrib) {
            float acc[BN / 2];
            #pragma unroll
            for (int j = 0; j < BN / 2; ++j) acc[j] = 0.f;
            for (int s = 0; s < nstages; ++s, advance())
            {
                mbar_wait(full + 8 * buf, phase);
                const u64 ad = smem_desc(sa + buf * SH::A_STAGE + c * 2048, 128, 256);
                const u64 xd = WgX<BN, KS>::desc(sx + buf * SH::X_STAGE, 0);
                // Halves: every step's A fragments of the stage in their own registers (none is rewritten while a wgmma
                // reads it).
                u32 af[SH::HALVES ? KS : 1][4];
                if constexpr (SH::HALVES)
                {
                    #pragma unroll
                    for (int i = 0; i < KS; ++i) ldmatrix_x4(af[i], sa + buf * SH::A_STAGE + i * SH::A_STEP + a_lane);
                }
                wgmma_fence();
                #pragma unroll
                for (int i = 0; i < KS; ++i)  // step i's A is A_STEP bytes further: one add to the start-address field
                {
                    const u64 adi = ad + (u64)((i * SH::A_STEP) >> 4), xdi = WgX<BN, KS>::desc_step(xd, i);
                    if constexpr (SH::HALVES)  // rows BN/2.. start BN/2 * 128 bytes further in each 64-k group
                    {
                        const u32 (&a)[4] = af[i];
                        wgmma_rs<BN / 2>(*reinterpret_cast<float(*)[BN / 4]>(acc), a, xdi);
                        wgmma_rs<BN / 2>(*reinterpret_cast<float(*)[BN / 4]>(acc + BN / 4), a, xdi + (u64)((BN / 2 * 128) >> 4));
                    }
                    else
                        wgmma_ss<BN>(acc, adi, xdi);
                }
                wgmma_commit();
                // The stage goes back as soon as its wgmmas are done: its x load is the next one the producers issue.
                wgmma_wait<0>();
                __syncwarp();
                if (lane == 0) mbar_arrive(empty + 8 * buf);
            }
            ws_tail<BN, OUT_BF16>(p, p.svh, red, acc, rows, row0, cb, split, mb, ncontrib);
        });
    }
}
#endif
