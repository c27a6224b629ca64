// Input transform (x * suh -> Hadamard-128 -> fp16) and the split-k slot reduction + output transform.
#include "exl3_common.cuh"

// One warp per (shard, row, 128-column chunk): xh[s, r, :] = fp16(had128(x[r, :] * suh[s, :])).
template <bool IN_BF16>
__device__ __forceinline__ void input_body(const u16* __restrict__ x, int ldx, const u16* __restrict__ suh,
                                           u16* __restrict__ xh, int m, int k, int S)
{
    const int lane = threadIdx.x & 31;
    const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int chunks = k >> 7;
    const long long total = (long long)S * m * chunks;
    if (gw >= total) return;
    const int c = (int)(gw % chunks);
    const long long sr = gw / chunks;
    const int r = (int)(sr % m), s = (int)(sr / m);
    const int col = c * 128 + lane * 4;
    const uint2 xv = *(const uint2*)(x + (size_t)r * ldx + col);
    const uint2 sv = *(const uint2*)(suh + (size_t)s * k + col);
    float v[4] = {ld2f<IN_BF16>(xv.x & 0xffff) * h2f(sv.x & 0xffff), ld2f<IN_BF16>(xv.x >> 16) * h2f(sv.x >> 16),
                  ld2f<IN_BF16>(xv.y & 0xffff) * h2f(sv.y & 0xffff), ld2f<IN_BF16>(xv.y >> 16) * h2f(sv.y >> 16)};
    had128_warp(v, lane);
    uint2 o;
    o.x = f2h(v[0]) | ((u32)f2h(v[1]) << 16);
    o.y = f2h(v[2]) | ((u32)f2h(v[3]) << 16);
    *(uint2*)(xh + ((size_t)s * m + r) * k + col) = o;
}

extern "C" __global__ void __launch_bounds__(256) exl3_input_f16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body<false>(x, ldx, suh, xh, m, k, S); }
extern "C" __global__ void __launch_bounds__(256) exl3_input_bf16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body<true>(x, ldx, suh, xh, m, k, S); }

// Deterministic split-k: sum the slots in split order, then output Hadamard, svh, bias; one warp per row.
template <bool OUT_BF16>
__device__ __forceinline__ void reduce_body(const float* __restrict__ ws, int splits, int m, int n_total,
                                            const u16* __restrict__ svh, const u16* __restrict__ bias, u16* __restrict__ out)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.y * 8 + warp;
    if (row >= m) return;
    const int col = blockIdx.x * 128 + lane * 4;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < splits; ++s)
    {
        const float4 a = *(const float4*)(ws + ((size_t)s * m + row) * n_total + col);
        v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
    }
    had128_warp(v, lane);
    const uint2 sv = *(const uint2*)(svh + col);
    float b[4] = {0.f, 0.f, 0.f, 0.f};
    if (bias)
    {
        const uint2 bb = *(const uint2*)(bias + col);
        b[0] = h2f(bb.x & 0xffff); b[1] = h2f(bb.x >> 16); b[2] = h2f(bb.y & 0xffff); b[3] = h2f(bb.y >> 16);
    }
    uint2 o;
    o.x = f2st<OUT_BF16>(v[0] * h2f(sv.x & 0xffff) + b[0]) | ((u32)f2st<OUT_BF16>(v[1] * h2f(sv.x >> 16) + b[1]) << 16);
    o.y = f2st<OUT_BF16>(v[2] * h2f(sv.y & 0xffff) + b[2]) | ((u32)f2st<OUT_BF16>(v[3] * h2f(sv.y >> 16) + b[3]) << 16);
    *(uint2*)(out + (size_t)row * n_total + col) = o;
}

extern "C" __global__ void __launch_bounds__(256) exl3_reduce_f16(const float* ws, int splits, int m, int n_total, const u16* svh, const u16* bias, u16* out)
{ reduce_body<false>(ws, splits, m, n_total, svh, bias, out); }
extern "C" __global__ void __launch_bounds__(256) exl3_reduce_bf16(const float* ws, int splits, int m, int n_total, const u16* svh, const u16* bias, u16* out)
{ reduce_body<true>(ws, splits, m, n_total, svh, bias, out); }
