// cp.async copies of trellis and x stages and the ring of stages both GEMM segment kinds run.
#pragma once
#include "exl3_linear_args.cuh"

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
