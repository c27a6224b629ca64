// The linear module's (K, codebook), fixed by -DEXL3_KA/-DEXL3_HALF/-DEXL3_CB, the GEMM kernels' arguments and schedule.
#pragma once
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
