// EXL3 GEMM and weight decode for one (K, codebook); compiled with -DEXL3_KA=.. -DEXL3_HALF=.. -DEXL3_CB=..
#include "exl3_common.cuh"
#include "exl3_wgmma.cuh"

#ifndef EXL3_KA
#error "EXL3_KA must be defined"
#endif

constexpr int KA = EXL3_KA;
constexpr bool HALF = EXL3_HALF != 0;
constexpr int CB = EXL3_CB;
typedef Tile<KA, HALF> TL;
static_assert(!HALF || CB == 2, "half-integer K exists only for mul1");

struct GemmArgs
{
    const u16* xh;        // [S, m, k] fp16 input after suh and the input Hadamard
    const u32* trellis;   // [k/16, n_total/16, W32] words
    const u16* svh;       // [n_total] fp16
    const u16* bias;      // [n_total] fp16, or null
    void* out;            // [m, n_total] in the output dtype
    float* ws;            // split-k accumulator (atomic: [m, n_total], zero between calls; slots: [splits, m, n_total])
    int* counters;        // [m_blocks, n_total/128], zero between calls
    int m, k, n_total;
    int splits, steps_per_split, mode;   // mode 0: atomics + last block epilogue, 1: slots reduced by exl3_reduce
    int nshards;
    int shard_end[8];     // exclusive end of each shard in 128-column blocks
    int stream;           // >0: stream-k over this many blocks (grid.x), each taking an equal run of (column block, stage) units
    const float* xmeta;   // int8 path: [S, mblocks, 8, 4] per row (hi scale, lo scale, row sum of the quantized x, 0)
    // Grouped experts (null for a dense layer): row block mb runs expert block_expert[mb] (-1: unused) when that
    // expert's (group, index) in expert_where is in this launch's group; its trellis is index * expert_words further.
    const int* block_expert;
    const int* expert_where;
    long long expert_words;
    int group;
    int mblocks;          // row blocks in xh / xq (1 for a dense layer)
    int dp;               // stream-k: column blocks run whole first, a multiple of grid.x (no partial sums for them)
    // The h8 / h16 "fx" kernels: the raw rows [m, k] in the output dtype and suh [S, k]; each block transforms its
    // own rows and k range into shared memory (xh unused), so the call needs no input-transform launch.
    const u16* xraw;
    const u16* suh;
};

constexpr int RLD = 132;  // padded fp32 row of the 128-column reduction tile, avoids bank conflicts

template <bool OUT_BF16, int NWARPS>
__device__ __forceinline__ void epilogue_rows(const float* red, int rows, int row0, int ncol0, const GemmArgs& p,
                                              const u16* svh)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = ncol0 + lane * 4;
    const uint2 sv = *(const uint2*)(svh + col);
    const u16 s16[4] = {(u16)(sv.x & 0xffff), (u16)(sv.x >> 16), (u16)(sv.y & 0xffff), (u16)(sv.y >> 16)};
    float bs[4] = {0.f, 0.f, 0.f, 0.f};
    if (p.bias) h2f4(p.bias + col, bs);
    for (int r = warp; r < rows; r += NWARPS)
    {
        const float4 v4 = *(const float4*)(red + r * RLD + lane * 4);
        float v[4] = {v4.x, v4.y, v4.z, v4.w};
        had128_warp(v, lane);
        u16 o[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = f2st<OUT_BF16>(v[i] * h2f(s16[i]) + bs[i]);
        uint2 st; st.x = o[0] | ((u32)o[1] << 16); st.y = o[2] | ((u32)o[3] << 16);
        *(uint2*)((u16*)p.out + (size_t)(row0 + r) * p.n_total + col) = st;
    }
}

// This thread's share of every stage's trellis copies: KS k16 steps x TILES consecutive 16x16 tiles (contiguous
// within a step, steps b_row words apart in global memory, TILES * W32 words apart in shared memory). The chunks a
// thread copies are the same in every stage, so their addresses are worked out once per segment, not per stage.
template <int KS, int TILES, int THREADS>
struct TrellisCopy
{
    static constexpr int CH = TILES * TL::W32 / 4;  // 16-byte chunks per step
    static constexpr int N = (KS * CH + THREADS - 1) / THREADS;
    u32 src[N], dst[N];  // word offset from the stage's first word (32 bits: KS rows of a layer), shared-memory bytes
    int n;               // chunks this thread copies (N, or fewer when THREADS does not divide the stage)
    // Chunk c = (step i, 16-byte piece j of the step's tiles): its word offset in global and byte offset in shared.
    EXL3_INLINE static u32 src_of(const int c, const size_t b_row) { return (u32)((c / CH) * b_row) + (c % CH) * 4; }
    EXL3_INLINE static u32 dst_of(const int c) { return ((c / CH) * TILES * TL::W32 + (c % CH) * 4) * 4; }
    EXL3_INLINE void init(const size_t b_row, const int tid)
    {
        n = 0;
        #pragma unroll
        for (int t = 0; t < N; ++t)
        {
            const int c = tid + t * THREADS;
            src[t] = src_of(c, b_row);
            dst[t] = dst_of(c);
            n += c < KS * CH;
        }
    }
    // The stage whose first word is at g into shared memory at sdst.
    EXL3_INLINE void issue(const u32 sdst, const u32* g) const
    {
        #pragma unroll
        for (int t = 0; t < N; ++t)
            if (N * THREADS == KS * CH || t < n) cp_async16(sdst + dst[t], g + src[t], 16);
    }
    // The same copies with the offsets worked out on the spot (tiers with no registers to keep them in).
    EXL3_INLINE static void issue_computed(const u32 sdst, const u32* g, const size_t b_row, const int tid)
    {
        for (int c = tid; c < KS * CH; c += THREADS) cp_async16(sdst + dst_of(c), g + src_of(c, b_row), 16);
    }
};

// This thread's share of every stage's x copies: rows x KS k16 steps as 16-byte chunks (rows past `rows` read
// nothing and land as zeros); off(r, j) places chunk j of row r in the stage. Fixed per segment like TrellisCopy.
template <int ROWS, int KS, int THREADS, class OFF>
struct XCopy
{
    static constexpr int TOTAL = ROWS * KS * 2;
    static constexpr int N = (TOTAL + THREADS - 1) / THREADS;
    u32 src[N], dst[N];  // element offset from the block's first row (32 bits: ROWS rows of x), shared-memory bytes
    int n, live;         // chunks this thread copies; bit t set: chunk t is a real row
    // Chunk c = (row r, 16-byte piece j): its element offset in global (rows past `rows` read row 0) and shared.
    EXL3_INLINE static u32 src_of(const int c, const int ld, const int rows)
    {
        const int r = c / (KS * 2);
        return (u32)((r < rows ? r : 0) * ld + (c % (KS * 2)) * 8);
    }
    EXL3_INLINE static u32 dst_of(const int c) { return OFF()(c / (KS * 2), c % (KS * 2)); }
    EXL3_INLINE void init(const int ld, const int rows, const int tid)
    {
        n = 0; live = 0;
        #pragma unroll
        for (int t = 0; t < N; ++t)
        {
            const int c = tid + t * THREADS;
            src[t] = src_of(c, ld, rows);
            dst[t] = dst_of(c);
            n += c < TOTAL;
            live |= (c / (KS * 2) < rows) << t;
        }
    }
    // The stage's k columns from g (row 0, its first column) on into shared memory at sdst.
    EXL3_INLINE void issue(const u32 sdst, const u16* g) const
    {
        #pragma unroll
        for (int t = 0; t < N; ++t)
            if (N * THREADS == TOTAL || t < n) cp_async16(sdst + dst[t], g + src[t], (live >> t) & 1 ? 16 : 0);
    }
    // The same copies with the offsets worked out on the spot.
    EXL3_INLINE static void issue_computed(const u32 sdst, const u16* g, const int ld, const int rows, const int tid)
    {
        for (int c = tid; c < TOTAL; c += THREADS)
            cp_async16(sdst + dst_of(c), g + src_of(c, ld, rows), c / (KS * 2) < rows ? 16 : 0);
    }
};

// Where chunk j of row r of an x stage goes: rows of LD halves (the mma.sync tiers).
template <int LD>
struct PaddedRows { EXL3_INLINE u32 operator()(int r, int j) const { return (u32)(r * LD + j * 8) * 2; } };

// The cp.async ring both GEMM segments run: a stage's weights (load_w) and x (load_x) go into buffer buf, STAGES - 1
// stages ahead. The prologue issues the weights before waiting on the input transform (pdl_wait), so under a dependent
// launch they stream in while it finishes; stage 0's group then holds every prologue stage's weights.
template <int STAGES, class LOADW, class LOADX>
EXL3_INLINE void ring_prologue(const LOADW& load_w, const LOADX& load_x, int nstages)
{
    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
        if (s < nstages) load_w(s, s);
    pdl_wait();
    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
    {
        if (s < nstages) load_x(s, s);
        cp_async_commit();
    }
}

// Stage s has landed for the whole block (ASYNC: also for wgmma's async-proxy reads) and the load STAGES - 1 ahead is
// issued into the buffer stage s - 1 used; returns stage s's buffer.
template <int STAGES, bool ASYNC, class LOAD>
EXL3_INLINE int ring_next(const LOAD& load, int s, int nstages)
{
    cp_async_wait<STAGES - 2>();
#ifdef EXL3_WGMMA
    if constexpr (ASYNC) fence_proxy_async();
#endif
    __syncthreads();
    const int nx = s + STAGES - 1;
    if (nx < nstages) load(nx, nx % STAGES);
    cp_async_commit();
    return s % STAGES;
}

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

// Split-k through atomics, after this block's partial sums went into the workspace: counts its arrival at (row
// block mb, column block cb); true for the last of ncontrib arrivals, which then resets the counter. sync is the
// barrier of the threads that wrote. One thread's acq_rel atomic after the barrier orders the whole block's sums
// (release is cumulative over the barrier) and, for the last block, everyone else's (cheaper than fence.sc per thread).
template <class SYNC>
EXL3_INLINE bool last_arrival(const GemmArgs& p, const int mb, const int cb, const int ncontrib, const SYNC& sync)
{
    __shared__ int s_last;
    int* counter = p.counters + mb * (p.n_total >> 7) + cb;
    sync();
    if (threadIdx.x == 0) s_last = atom_add_acq_rel(counter, 1) == ncontrib - 1;
    sync();
    return s_last;
}

// The summed partials of rows x 128 columns from the workspace into red, leaving the workspace zero for the next call.
// B 16-byte loads per thread are in flight before their stores: one L2 round trip per batch, not per element (B is
// smaller where accumulators are still live, so the batch does not spill).
template <int THREADS, int B>
EXL3_INLINE void take_partials(const GemmArgs& p, float* red, const int rows, const int row0, const int ncol0,
                               const int tid)
{
    const int total = rows * 32;  // float4 chunks: row idx / 32, columns 4 (idx % 32)..
    auto chunk = [&](const int idx) { return p.ws + (size_t)(row0 + (idx >> 5)) * p.n_total + ncol0 + (idx & 31) * 4; };
    for (int c0 = tid; c0 < total; c0 += B * THREADS)
    {
        float4 v[B];
        #pragma unroll
        for (int i = 0; i < B; ++i)
            if (c0 + i * THREADS < total) v[i] = ld_cg4(chunk(c0 + i * THREADS));
        #pragma unroll
        for (int i = 0; i < B; ++i)
        {
            const int idx = c0 + i * THREADS;
            if (idx >= total) continue;
            *(float4*)(red + (idx >> 5) * RLD + (idx & 31) * 4) = v[i];
            st_cg4(chunk(idx), make_float4(0.f, 0.f, 0.f, 0.f));
        }
    }
}

// After the block's partial sums for rows x 128 columns are in red: the epilogue directly (ncontrib == 1), split
// slots (mode 1), or atomics into the fp32 workspace with the last arriving block finishing (TB: take_partials' batch;
// VEC: vector atomics, where registers allow: the stream-k kernels keep more live across the tail and spill with them).
template <bool OUT_BF16, int NWARPS, int TB = 4, bool VEC = true>
__device__ __forceinline__ void segment_tail(const GemmArgs& p, const u16* svh, float* red, const int rows,
                                             const int row0, const int cb, const int split, const int mb,
                                             const int ncontrib)
{
    constexpr int THREADS = 32 * NWARPS;
    const int tid = threadIdx.x;
    const int ncol0 = cb * 128;
#ifdef EXL3_DIAG_NO_TAIL  // bound analysis only (wrong results): every split runs the epilogue on its own partials
    if (true)
#else
    if (ncontrib == 1)
#endif
    {
        epilogue_rows<OUT_BF16, NWARPS>(red, rows, row0, ncol0, p, svh);
        return;
    }
    if (p.mode == 1)
    {
        float* dst = p.ws + (size_t)split * p.m * p.n_total;
        for (int idx = tid; idx < rows * 32; idx += THREADS)
        {
            const int r = idx >> 5, c = (idx & 31) * 4;
            *(float4*)(dst + (size_t)(row0 + r) * p.n_total + ncol0 + c) = *(const float4*)(red + r * RLD + c);
        }
        return;
    }
#if __CUDA_ARCH__ >= 900
    if constexpr (VEC)  // one vector atomic per 4 columns: a quarter of the L2 operations the arrival waits out
    {
        for (int idx = tid; idx < rows * 32; idx += THREADS)
        {
            const int r = idx >> 5, c = (idx & 31) * 4;
            red_add4(p.ws + (size_t)(row0 + r) * p.n_total + ncol0 + c, *(const float4*)(red + r * RLD + c));
        }
    }
    else
#endif
    for (int idx = tid; idx < rows * 128; idx += THREADS)
    {
        const int r = idx >> 7, c = idx & 127;
        red_add(p.ws + (size_t)(row0 + r) * p.n_total + ncol0 + c, red[r * RLD + c]);
    }
    if (!last_arrival(p, mb, cb, ncontrib, [] { __syncthreads(); })) return;
    take_partials<THREADS, TB>(p, red, rows, row0, ncol0, tid);
    if (tid == 0) p.counters[mb * (p.n_total >> 7) + cb] = 0;
    __syncthreads();
    epilogue_rows<OUT_BF16, NWARPS>(red, rows, row0, ncol0, p, svh);
}

// The second half of a one-pass k-warp reduction: once each k-warp stored its partials in slice kw of red (BM rows of
// RLD floats each), every thread sums its elements' slices in k-warp order into slice 0 (a fixed order, so results do
// not depend on scheduling; two barriers instead of KW rounds of them).
template <int KW, int BM, int THREADS>
EXL3_INLINE void sum_slices(float* red, const int rows)
{
    __syncthreads();
    for (int idx = threadIdx.x; idx < rows * 128; idx += THREADS)
    {
        const int o = (idx >> 7) * RLD + (idx & 127);
        float v = red[o];
        #pragma unroll
        for (int kk = 1; kk < KW; ++kk) v += red[kk * BM * RLD + o];
        red[o] = v;
    }
    __syncthreads();
}

// mma_16816 in the h8 / h16 loop; EXL3_DIAG_NO_MMA folds the operands into the accumulator instead (bound analysis
// only, wrong results: the loop without the tensor-core work).
EXL3_INLINE void mma_16816_d(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1)
{
#ifdef EXL3_DIAG_NO_MMA
    c[0] = __uint_as_float(__float_as_uint(c[0]) ^ a[0] ^ a[1] ^ a[2] ^ a[3] ^ b0 ^ b1);
#else
    mma_16816(c, a, b0, b1);
#endif
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
    constexpr int NW = TL::NW;
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
                        mma_16816_d(xsum[nb], {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u}, xa[nb], xb[nb]);
                }
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                {
                    const u32* tw = bB + i * B_STEP + (nw * NT + nt) * W32;
                    if constexpr (CB == 2)
                    {
                        u32 st[8];
#ifdef EXL3_DIAG_NO_DECODE  // bound analysis only (wrong results): the tile's raw words instead of its states
                        #pragma unroll
                        for (int q = 0; q < 8; ++q) st[q] = tw[lm.idx[q % NW]];
#else
                        tile_states(tw, lm, st);
#endif
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
                                mma_16816_d(acc[nb][nt], {h[0], h[4], h[2], h[6]}, xa[nb], xb[nb]);
                                mma_16816_d(acc[nb][nt], {h[1], h[5], h[3], h[7]}, x1[nb], x3[nb]);
                            }
                            continue;
                        }
                        u32 b[4];
#ifdef EXL3_DIAG_NO_DECODE
                        b[0] = st[0]; b[1] = st[1]; b[2] = st[2]; b[3] = st[3];
#else
                        if constexpr (SUMS) mul1_sums_to_frag(st, b);
                        else mul1_states_to_frag(st, b);
#endif
                        #pragma unroll
                        for (int nb = 0; nb < MT; ++nb)
                            mma_16816_d(acc[nb][nt], {b[0], b[2], b[1], b[3]}, xa[nb], xb[nb]);
                    }
                    else
                    {
                        u32 h[8];
#ifdef EXL3_DIAG_NO_DECODE
                        #pragma unroll
                        for (int q = 0; q < 8; ++q) h[q] = tw[lm.idx[q % NW]];
#else
                        tile_halves(tw, lm, h);
#endif
                        #pragma unroll
                        for (int nb = 0; nb < MT; ++nb)
                        {
                            mma_16816_d(acc[nb][nt], {h[0], h[4], h[1], h[5]}, x0[nb], x1[nb]);
                            mma_16816_d(acc[nb][nt], {h[2], h[6], h[3], h[7]}, x2[nb], x3[nb]);
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

// The (column block, split, first k16 step, stages, contributors) segments this block runs: one per block for fixed
// split-k, or under stream-k (grid.x = p.stream = G) whole column blocks b, b+G, .. below p.dp (full waves, no partial
// sums), then the run [b*U/G, (b+1)*U/G) of the U (column block, stage) units of the rest.
template <int KS, bool STREAM, class F>
EXL3_INLINE void for_each_segment(const GemmArgs& p, const int cols, const F& f)
{
    if constexpr (!STREAM)
    {
        const int step0 = blockIdx.y * p.steps_per_split;
        f(blockIdx.x, blockIdx.y, step0, min(p.steps_per_split, (p.k >> 4) - step0) / KS, p.splits);
        return;
    }
    const int nst = (p.k >> 4) / KS;
    for (int cb = blockIdx.x; cb < p.dp; cb += p.stream) f(cb, 0, 0, nst, 1);
    // At most one block per unit: a block between a column block's first and last contributors must own some of it.
    const long long U = (long long)(p.n_total / cols - p.dp) * nst, G = min((long long)p.stream, U);
    if (blockIdx.x >= G) return;
    int u0 = (int)(blockIdx.x * U / G);
    const int u1 = (int)((blockIdx.x + 1) * U / G);
    while (u0 < u1)
    {
        const int c = u0 / nst, s_lo = u0 - c * nst;
        const int nstages = min(nst - s_lo, u1 - u0);
        const int first = (int)((((long long)c * nst + 1) * G - 1) / U);
        const int last = (int)(((long long)(c + 1) * nst * G - 1) / U);
        f(p.dp + c, 0, s_lo * KS, nstages, last - first + 1);
        u0 += nstages;
    }
}

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
#ifdef EXL3_DIAG_NO_X  // bound analysis only (wrong results): the pipeline without the x loads
                    mbar_arrive(full + 8 * buf);
#else
                    const u32 xdst = sx + buf * SH::X_STAGE;
                    mbar_arrive_expect_tx(full + 8 * buf, (KS / 4) * rows * 128);
                    #pragma unroll
                    for (int a = 0; a < KS / 4; ++a)
                        bulk_g2s(xdst + a * (BN * 128), XG + (size_t)(s * (KS / 4) + a) * gstep, rows * 128, full + 8 * buf);
#endif
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
#ifdef EXL3_DIAG_NO_DECODE
                    break;  // bound analysis only (wrong results): the pipeline without the decode
#endif
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
#ifndef EXL3_DIAG_NO_MMA  // bound analysis only (wrong results): the pipeline without the tensor-core work
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
#endif
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

// Tiers: (rows per block, n16 tiles per warp, k-warps, k16 steps per stage, pipeline stages).
#define EXL3_TIER(NAME, BM, NT, KW, KS, ST) \
    extern "C" __global__ void __launch_bounds__(32 * (8 / NT) * KW) exl3_gemm_##NAME##_f16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, NT, KW, KS, ST, false>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(32 * (8 / NT) * KW) exl3_gemm_##NAME##_bf16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, NT, KW, KS, ST, true>(p, smem); }

EXL3_TIER(m16, 16, 8, 8, 8, 4)

EXL3_TIER(m32, 32, 4, 4, 8, 4)
EXL3_TIER(m64, 64, 2, 4, 8, 3)
EXL3_TIER(m128, 128, 1, 2, 4, 3)

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
// h8 / h16: each 8 rows of x as the MMA's n against 16 weight columns as its A operand (per 8 rows and tile one MMA
// for mul1, two for 3inst / mcg whose weight halves the MMA adds: no fp16 packing in the decode).
EXL3_FEW_TIER(h8, 8, 3, 16, 2)
EXL3_FEW_TIER(h16, 16, 3, 16, 2)
EXL3_FEW_TIER(h8k8, 8, 3, 8, 4)
EXL3_FEW_TIER(h16k8, 16, 3, 8, 4)
// Their "fx" twins (fixed split-k): each block transforms its own rows of raw x (no input-transform launch).
#define EXL3_FX_TIER(NAME, BM, KS, ST) \
    extern "C" __global__ void __launch_bounds__(256, 1) exl3_gemm_##NAME##fx_f16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, false, 3, false, false, true>(p, smem); } \
    extern "C" __global__ void __launch_bounds__(256, 1) exl3_gemm_##NAME##fx_bf16(const GemmArgs p) \
    { extern __shared__ __align__(16) char smem[]; gemm_body<BM, 4, 4, KS, ST, true, 3, false, false, true>(p, smem); }
EXL3_FX_TIER(h8, 8, 16, 2)
EXL3_FX_TIER(h16, 16, 16, 2)
EXL3_FX_TIER(h8k8, 8, 8, 4)
EXL3_FX_TIER(h16k8, 16, 8, 4)

#if EXL3_CB == 2

// int8 activations against the mul1 product bytes: i8 = up to 8 rows (hi and lo parts as the 16 MMA rows), i4 = up
// to 4 rows with the weights as the MMA's A operand (16 columns per MMA instead of 8: half the MMAs per tile).
EXL3_FEW_TIER(i8, 8, 1, 16, 2)
EXL3_FEW_TIER(i4, 8, 2, 16, 2)
EXL3_FEW_TIER(i8k8, 8, 1, 8, 4)
EXL3_FEW_TIER(i4k8, 8, 2, 8, 4)
#endif

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

EXL3_WG_TIER(w16, 16, 2, 8, 4)
EXL3_WG_TIER(w32, 32, 2, 8, 4)
EXL3_WG_TIER(w64n, 64, 2, 4, 4)
EXL3_WG_TIER(w128n, 128, 2, 4, 4)
EXL3_WG_TIER(w64, 64, 4, 8, 4)
EXL3_WG_TIER(w128, 128, 4, 4, 4)
EXL3_WG_STREAM(w32, 32, 2, 8, 4)
EXL3_WG_STREAM(w64n, 64, 2, 4, 4)
EXL3_WG_STREAM(w64, 64, 4, 8, 4)

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

EXL3_WS_TIER(x64, 64, 2, 8, 3, 0)
EXL3_WS_TIER(x128, 128, 2, 4, 4, 0)
// x256's producers keep 80 registers so the consumers' 176 hold the accumulators and a stage's A fragments.
EXL3_WS_TIER(x256, 256, 2, 4, 3, 80)
#endif

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

template <bool OUT_BF16>
__device__ __forceinline__ void recon_body(const u32* __restrict__ trellis, const u16* __restrict__ suh,
                                           const u16* __restrict__ svh, u16* __restrict__ wt, int n_total, int col0,
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
        return trellis + (size_t)kk * 8 * (size_t)tile_row + (size_t)((col0 >> 4) + c * 8 + warp) * TL::W32;
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
        h2f4(suh + kq, fk);
        #pragma unroll
        for (int i = 0; i < 4; ++i) fk[i] *= 0.0078125f;
        // Columns cu * 128 + 16 s + g (+ 8): wt rows 16 k apart per strip, one pointer and one stride.
        const int c0 = cu * 128 + g;
        const u16* sv = svh + col0 + c0;
        u16* wp = wt + (size_t)c0 * k + kq;
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

// Two blocks per SM where registers allow (a warp's eight tiles' packed fragments stay live through each phase).
#if __CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 800
constexpr int RECON_MINB = 2;
#else
constexpr int RECON_MINB = 1;
#endif
extern "C" __global__ void __launch_bounds__(256, RECON_MINB) exl3_recon_f16(const u32* trellis, const u16* suh, const u16* svh, u16* wt, int n_total, int col0, int cols, int k)
{ recon_body<false>(trellis, suh, svh, wt, n_total, col0, cols, k); }
extern "C" __global__ void __launch_bounds__(256, RECON_MINB) exl3_recon_bf16(const u32* trellis, const u16* suh, const u16* svh, u16* wt, int n_total, int col0, int cols, int k)
{ recon_body<true>(trellis, suh, svh, wt, n_total, col0, cols, k); }

// Decode-only pass for the benchmark floor: every weight decoded to a B fragment, folded into one word per thread.
extern "C" __global__ void __launch_bounds__(256) exl3_decode_sum(const u32* __restrict__ trellis, long long ntiles, u32* __restrict__ sink)
{
    const int lane = threadIdx.x & 31;
    const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    LaneMap<KA, HALF> lm;
    lm.init(lane);
    u32 accx = 0;
    for (long long t = gw; t < ntiles; t += nwarps)
    {
        const u32* tw = trellis + t * TL::W32;
        u32 w[TL::NW];
        #pragma unroll
        for (int q = 0; q < TL::NW; ++q) w[q] = __ldg(tw + lm.idx[q]);
        u32 b[4];
        words_to_frag<KA, HALF, CB, true>(w, lm.off, b);
        accx = hadd2(accx, hadd2(hadd2(b[0], b[1]), hadd2(b[2], b[3])));
    }
    sink[(size_t)blockIdx.x * blockDim.x + threadIdx.x] = accx;
}
