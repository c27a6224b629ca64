// Input transform (x * suh -> Hadamard-128 -> fp16) and the split-k slot reduction + output transform.
#include "exl3_common.cuh"

// The 4 values of row r, columns col..col+3 of shard s after x * suh and the warp's Hadamard-128.
template <bool IN_BF16>
EXL3_INLINE void x_suh_had(const u16* __restrict__ x, int ldx, const u16* __restrict__ suh, int k, int r, int s, int col,
                           int lane, float (&v)[4])
{
    const uint2 xv = *(const uint2*)(x + (size_t)r * ldx + col);
    const uint2 sv = *(const uint2*)(suh + (size_t)s * k + col);
    v[0] = ld2f<IN_BF16>(xv.x & 0xffff) * h2f(sv.x & 0xffff); v[1] = ld2f<IN_BF16>(xv.x >> 16) * h2f(sv.x >> 16);
    v[2] = ld2f<IN_BF16>(xv.y & 0xffff) * h2f(sv.y & 0xffff); v[3] = ld2f<IN_BF16>(xv.y >> 16) * h2f(sv.y >> 16);
    had128_warp(v, lane);
}

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
    float v[4];
    x_suh_had<IN_BF16>(x, ldx, suh, k, r, s, col, lane, v);
    uint2 o;
    o.x = f2h(v[0]) | ((u32)f2h(v[1]) << 16);
    o.y = f2h(v[2]) | ((u32)f2h(v[3]) << 16);
    *(uint2*)(xh + ((size_t)s * m + r) * k + col) = o;
}

extern "C" __global__ void __launch_bounds__(256) exl3_input_f16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body<false>(x, ldx, suh, xh, m, k, S); }
extern "C" __global__ void __launch_bounds__(256) exl3_input_bf16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body<true>(x, ldx, suh, xh, m, k, S); }

// int8 activations for the mul1 integer GEMM: one block per (row slot, shard); xh = had128(x * suh) stays in shared
// memory until the row's absmax is known, then x ~ hi * sh + lo * sh / 254 with hi, lo int8. Row slots >= m get zeros.
// xq[s][k16 step][16 rows: 8 hi, 8 lo][16 bytes, k offsets 0,1,8,9, 2,3,10,11, 4,5,12,13, 6,7,14,15]
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

template <bool IN_BF16>
__device__ __forceinline__ void input_i8_body(const u16* __restrict__ x, int ldx, const u16* __restrict__ suh,
                                              signed char* __restrict__ xq, float* __restrict__ meta, int m, int k)
{
    extern __shared__ float xs[];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int r = blockIdx.x, s = blockIdx.y;
    const bool live = r < m;
    float amax = 0.f;
    if (live)
        for (int c = warp; c < (k >> 7); c += nw)
        {
            const int col = c * 128 + lane * 4;
            float v[4];
            x_suh_had<IN_BF16>(x, ldx, suh, k, r, s, col, lane, v);
            *(float4*)(xs + col) = make_float4(v[0], v[1], v[2], v[3]);
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
        }
    amax = block_sum(amax, red, true);
    __syncthreads();
    const float sh = amax > 0.f ? amax * (1.f / 127.f) : 1.f, sl = sh * (1.f / 254.f);
    const float ih = 1.f / sh, il = 1.f / sl;
    signed char* base = xq + (size_t)s * (k >> 4) * 256;
    float sum = 0.f;
    for (int e = threadIdx.x; e < k; e += blockDim.x)
    {
        const float v = live ? xs[e] : 0.f;
        const float qh = fminf(fmaxf(rintf(v * ih), -127.f), 127.f);
        const float ql = fminf(fmaxf(rintf((v - qh * sh) * il), -127.f), 127.f);
        sum += qh * sh + ql * sl;
        const int o = e & 15, pos = 4 * ((o & 7) >> 1) + 2 * (o >> 3) + (o & 1);
        signed char* d = base + (size_t)(e >> 4) * 256 + pos;
        d[r * 16] = (signed char)(int)qh;
        d[(8 + r) * 16] = (signed char)(int)ql;
    }
    sum = block_sum(sum, red, false);
    if (threadIdx.x == 0)
    {
        float* mt = meta + ((size_t)s * 8 + r) * 4;
        mt[0] = live ? sh : 0.f; mt[1] = live ? sl : 0.f; mt[2] = sum; mt[3] = 0.f;
    }
}

extern "C" __global__ void __launch_bounds__(1024) exl3_input_i8_f16(const u16* x, int ldx, const u16* suh, signed char* xq, float* meta, int m, int k)
{ input_i8_body<false>(x, ldx, suh, xq, meta, m, k); }
extern "C" __global__ void __launch_bounds__(1024) exl3_input_i8_bf16(const u16* x, int ldx, const u16* suh, signed char* xq, float* meta, int m, int k)
{ input_i8_body<true>(x, ldx, suh, xq, meta, m, k); }

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
