// After a GEMM segment: the k-warp reduction, split-k through slots or atomics, and the epilogue.
#pragma once
#include "exl3_linear_args.cuh"

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
    if (ncontrib == 1)
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
