// Input transforms shared by the dense and MoE modules: rows of x -> x * suh -> Hadamard-128 -> fp16 or int8 parts.
// A row source (DenseRows, or the MoE gather/SwiGLU sources) says which rows exist and yields 4 values per lane.
#pragma once
#include "exl3_common.cuh"

// Rows of a dense x: row r times shard s's suh.
template <bool IN_BF16>
struct DenseRows
{
    const u16* x; int ldx; const u16* suh; int k;
    EXL3_INLINE bool active(int) const { return true; }
    EXL3_INLINE bool live(int) const { return true; }
    // The 4 values of row r, columns col..col+3 of shard s after x * suh and the warp's Hadamard-128.
    EXL3_INLINE void load(int s, int r, int col, int lane, float (&v)[4]) const
    {
        const uint2 xv = *(const uint2*)(x + (size_t)r * ldx + col);
        const uint2 sv = *(const uint2*)(suh + (size_t)s * k + col);
        v[0] = ld2f<IN_BF16>(xv.x & 0xffff) * h2f(sv.x & 0xffff); v[1] = ld2f<IN_BF16>(xv.x >> 16) * h2f(sv.x >> 16);
        v[2] = ld2f<IN_BF16>(xv.y & 0xffff) * h2f(sv.y & 0xffff); v[3] = ld2f<IN_BF16>(xv.y >> 16) * h2f(sv.y >> 16);
        had128_warp(v, lane);
    }
};

// One warp per (shard, row, 128-column chunk), grid-strided: xh[s, r, :] = fp16(had128(row r of shard s)); rows that
// are padding get zeros, rows of unused blocks are skipped (nothing reads them). 32-bit indices: S * m * k / 128 < 2^31.
// STAGED: xh[s][k / 64][m][64] with each row's 16-byte chunks already swizzled (swz128), so a stage of rows is one
// contiguous bulk copy that lands in the warp-specialized tiers' x layout.
template <class SRC, bool STAGED = false>
__device__ __forceinline__ void input_body(const SRC& src, u16* __restrict__ xh, int m, int k, int S)
{
    pdl_launch_dependents();  // the GEMM may start loading its weights now; it waits for xh before reading it
    const int lane = threadIdx.x & 31;
    const unsigned chunks = (unsigned)k >> 7;
    const unsigned total = (unsigned)S * (unsigned)m * chunks;
    const unsigned nwarps = gridDim.x * (blockDim.x >> 5);
    for (unsigned gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; gw < total; gw += nwarps)
    {
        const unsigned sr = gw / chunks, c = gw - sr * chunks;
        const int r = (int)(sr % (unsigned)m), s = (int)(sr / (unsigned)m);
        if (!src.active(r)) continue;
        const int col = (int)c * 128 + lane * 4;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (src.live(r)) src.load(s, r, col, lane, v);
        uint2 o;
        o.x = f2h(v[0]) | ((u32)f2h(v[1]) << 16);
        o.y = f2h(v[2]) | ((u32)f2h(v[3]) << 16);
        if constexpr (STAGED)
            *(uint2*)(xh + (((size_t)s * (k >> 6) + (col >> 6)) * m + r) * 64 + (swz128((col >> 3) & 7, r) << 3) + (col & 7)) = o;
        else
            *(uint2*)(xh + ((size_t)s * m + r) * k + col) = o;
    }
}

EXL3_INLINE float block_sum(float v, float* red, bool is_max)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    #pragma unroll
    for (int o = 16; o; o >>= 1) { const float u = __shfl_xor_sync(0xffffffffu, v, o); v = is_max ? fmaxf(v, u) : v + u; }
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.f;
    #pragma unroll
    for (int o = 16; o; o >>= 1) { const float u = __shfl_xor_sync(0xffffffffu, v, o); v = is_max ? fmaxf(v, u) : v + u; }
    return v;
}

// int8 activations for the mul1 integer GEMM: one block per (row slot, shard, 8-row block); the transformed row stays
// in shared memory until its absmax is known, then x ~ hi * sh + lo * sh / 254 with hi, lo int8. Padding rows get zeros.
// xq[s][mb][k16 step][16 rows: 8 hi, 8 lo][16 bytes, k offsets 0,1,8,9, 2,3,10,11, 4,5,12,13, 6,7,14,15]
// meta[s][mb][8 rows][hi scale, lo scale, row sum of the quantized x, 0]
template <class SRC>
__device__ __forceinline__ void input_i8_body(const SRC& src, signed char* __restrict__ xq, float* __restrict__ meta,
                                              int r, int s, int mb, int mblocks, int k)
{
    extern __shared__ float xs[];
    __shared__ float red[32];
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int row = mb * 8 + r;
    if (!src.active(row)) return;
    const bool live = src.live(row);
    float amax = 0.f;
    if (live)
        for (int c = warp; c < (k >> 7); c += nw)
        {
            const int col = c * 128 + lane * 4;
            float v[4];
            src.load(s, row, col, lane, v);
            *(float4*)(xs + col) = make_float4(v[0], v[1], v[2], v[3]);
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
        }
    amax = block_sum(amax, red, true);
    __syncthreads();
    const float sh = amax > 0.f ? amax * (1.f / 127.f) : 1.f, sl = sh * (1.f / 254.f);
    const float ih = 1.f / sh, il = 1.f / sl;
    signed char* base = xq + (size_t)(s * mblocks + mb) * (k >> 4) * 256;
    float sum = 0.f;
    // A thread per k16 step: its 16 hi and 16 lo bytes leave as two 16-byte stores.
    for (int st = threadIdx.x; st < (k >> 4); st += blockDim.x)
    {
        float v[16];
        #pragma unroll
        for (int i = 0; i < 16; i += 4)
        {
            const float4 f = live ? *(const float4*)(xs + st * 16 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[i] = f.x; v[i + 1] = f.y; v[i + 2] = f.z; v[i + 3] = f.w;
        }
        u32 qh[16], ql[16];
        #pragma unroll
        for (int o = 0; o < 16; ++o)
        {
            const float h = fminf(fmaxf(rintf(v[o] * ih), -127.f), 127.f);
            const float l = fminf(fmaxf(rintf((v[o] - h * sh) * il), -127.f), 127.f);
            sum += h * sh + l * sl;
            qh[o] = (u32)(int)h & 0xffu;
            ql[o] = (u32)(int)l & 0xffu;
        }
        uint4 wh, wl;
        u32* ph = (u32*)&wh;
        u32* pl = (u32*)&wl;
        #pragma unroll
        for (int w = 0; w < 4; ++w)  // word w holds k offsets 2w, 2w + 1, 2w + 8, 2w + 9
        {
            ph[w] = qh[2 * w] | (qh[2 * w + 1] << 8) | (qh[2 * w + 8] << 16) | (qh[2 * w + 9] << 24);
            pl[w] = ql[2 * w] | (ql[2 * w + 1] << 8) | (ql[2 * w + 8] << 16) | (ql[2 * w + 9] << 24);
        }
        *(uint4*)(base + (size_t)st * 256 + r * 16) = wh;
        *(uint4*)(base + (size_t)st * 256 + (8 + r) * 16) = wl;
    }
    sum = block_sum(sum, red, false);
    if (threadIdx.x == 0)
    {
        float* mt = meta + ((size_t)(s * mblocks + mb) * 8 + r) * 4;
        mt[0] = live ? sh : 0.f; mt[1] = live ? sl : 0.f; mt[2] = sum; mt[3] = 0.f;
    }
}
