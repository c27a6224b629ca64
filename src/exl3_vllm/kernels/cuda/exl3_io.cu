// Input transform (x * suh -> Hadamard-128 -> fp16) and the split-k slot reduction + output transform.
#include "exl3_input.cuh"

extern "C" __global__ void __launch_bounds__(256) exl3_input_f16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body(DenseRows<false>{x, ldx, suh, k}, xh, m, k, S); }
extern "C" __global__ void __launch_bounds__(256) exl3_input_bf16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body(DenseRows<true>{x, ldx, suh, k}, xh, m, k, S); }
extern "C" __global__ void __launch_bounds__(256) exl3_input_staged_f16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body<DenseRows<false>, true>(DenseRows<false>{x, ldx, suh, k}, xh, m, k, S); }
extern "C" __global__ void __launch_bounds__(256) exl3_input_staged_bf16(const u16* x, int ldx, const u16* suh, u16* xh, int m, int k, int S)
{ input_body<DenseRows<true>, true>(DenseRows<true>{x, ldx, suh, k}, xh, m, k, S); }

// Rows >= m of the 8 slots are padding (grid.x = 8).
template <bool IN_BF16>
struct DenseRowsI8 : DenseRows<IN_BF16>
{
    int m;
    EXL3_INLINE bool live(int r) const { return r < m; }
};

extern "C" __global__ void __launch_bounds__(1024) exl3_input_i8_f16(const u16* x, int ldx, const u16* suh, signed char* xq, float* meta, int m, int k)
{ input_i8_body(DenseRowsI8<false>{{x, ldx, suh, k}, m}, xq, meta, blockIdx.x, blockIdx.y, 0, 1, k); }
extern "C" __global__ void __launch_bounds__(1024) exl3_input_i8_bf16(const u16* x, int ldx, const u16* suh, signed char* xq, float* meta, int m, int k)
{ input_i8_body(DenseRowsI8<true>{{x, ldx, suh, k}, m}, xq, meta, blockIdx.x, blockIdx.y, 0, 1, k); }

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
    float f[4], b[4] = {0.f, 0.f, 0.f, 0.f};
    h2f4(svh + col, f);
    if (bias) h2f4(bias + col, b);
    store_fma4<OUT_BF16>(out + (size_t)row * n_total + col, v, f, b);
}

extern "C" __global__ void __launch_bounds__(256) exl3_reduce_f16(const float* ws, int splits, int m, int n_total, const u16* svh, const u16* bias, u16* out)
{ reduce_body<false>(ws, splits, m, n_total, svh, bias, out); }
extern "C" __global__ void __launch_bounds__(256) exl3_reduce_bf16(const float* ws, int splits, int m, int n_total, const u16* svh, const u16* bias, u16* out)
{ reduce_body<true>(ws, splits, m, n_total, svh, bias, out); }
