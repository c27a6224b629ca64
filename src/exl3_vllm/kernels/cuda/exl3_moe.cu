// Grouped experts: routing into expert-aligned row blocks, the per-expert input transforms and the weighted combine.
// The GEMMs themselves are exl3_linear.cu's, launched with GemmArgs.block_expert set.
#include "exl3_input.cuh"

// Padded row r lies in row block r / bm of expert block_expert[r / bm] (-1: unused block) and holds the (token, slot)
// pair row_src[r] = token * topk + slot (-1: padding).
struct MoeMap
{
    const int* block_expert; const int* row_src; int bm;
    EXL3_INLINE bool active(int r) const { return block_expert[r / bm] >= 0; }
    EXL3_INLINE bool live(int r) const { return row_src[r] >= 0; }
};

// gate/up input: the pair's token row of x (columns >= ncols are zeros), times the expert's suh of shard s and, for
// router weights applied on the input, the pair's weight.
template <bool IN_BF16>
struct MoeGatherRows : MoeMap
{
    const u16* x; int ldx; int ncols; int topk; const u16* suh; int S; int k; const float* wpair;
    EXL3_INLINE void load(int s, int r, int col, int lane, float (&v)[4]) const
    {
        const int i = row_src[r];
        const uint2 sv = *(const uint2*)(suh + ((size_t)block_expert[r / bm] * S + s) * k + col);
        const float w = wpair ? wpair[i] : 1.f;
        uint2 xv = make_uint2(0u, 0u);
        if (col < ncols) xv = *(const uint2*)(x + (size_t)(i / topk) * ldx + col);
        v[0] = ld2f<IN_BF16>(xv.x & 0xffff) * h2f(sv.x & 0xffff) * w; v[1] = ld2f<IN_BF16>(xv.x >> 16) * h2f(sv.x >> 16) * w;
        v[2] = ld2f<IN_BF16>(xv.y & 0xffff) * h2f(sv.y & 0xffff) * w; v[3] = ld2f<IN_BF16>(xv.y >> 16) * h2f(sv.y >> 16) * w;
        had128_warp(v, lane);
    }
};

// down input: SwiGLU of the row's gate and up halves (columns >= valid are the checkpoint's padding: zeros), times suh.
template <bool IN_BF16>
struct MoeSwigluRows : MoeMap
{
    const u16* y13; int inter; int valid; const u16* suh;
    EXL3_INLINE void load(int, int r, int col, int lane, float (&v)[4]) const
    {
        const u16* g = y13 + (size_t)r * 2 * inter + col;
        const uint2 gv = *(const uint2*)g, uv = *(const uint2*)(g + inter);
        const uint2 sv = *(const uint2*)(suh + (size_t)block_expert[r / bm] * inter + col);
        const u32 gw[4] = {gv.x & 0xffff, gv.x >> 16, gv.y & 0xffff, gv.y >> 16};
        const u32 uw[4] = {uv.x & 0xffff, uv.x >> 16, uv.y & 0xffff, uv.y >> 16};
        const u32 sw[4] = {sv.x & 0xffff, sv.x >> 16, sv.y & 0xffff, sv.y >> 16};
        #pragma unroll
        for (int j = 0; j < 4; ++j)
        {
            const float a = ld2f<IN_BF16>((u16)gw[j]), b = ld2f<IN_BF16>((u16)uw[j]);
            v[j] = col + j < valid ? a / (1.f + expf(-a)) * b * h2f((u16)sw[j]) : 0.f;
        }
        had128_warp(v, lane);
    }
};

#define EXL3_MOE_INPUTS(SUF, BF) \
extern "C" __global__ void __launch_bounds__(256) exl3_moe_gather_##SUF(MoeGatherRows<BF> src, u16* xh, int m, int k, int S) \
{ input_body(src, xh, m, k, S); } \
extern "C" __global__ void __launch_bounds__(256) exl3_moe_swiglu_##SUF(MoeSwigluRows<BF> src, u16* xh, int m, int k) \
{ input_body(src, xh, m, k, 1); } \
extern "C" __global__ void __launch_bounds__(1024) exl3_moe_gather_i8_##SUF(MoeGatherRows<BF> src, signed char* xq, float* meta, int mblocks, int k) \
{ input_i8_body(src, xq, meta, blockIdx.x, blockIdx.y, blockIdx.z, mblocks, k); } \
extern "C" __global__ void __launch_bounds__(1024) exl3_moe_swiglu_i8_##SUF(MoeSwigluRows<BF> src, signed char* xq, float* meta, int mblocks, int k) \
{ input_i8_body(src, xq, meta, blockIdx.x, 0, blockIdx.z, mblocks, k); }

EXL3_MOE_INPUTS(f16, false)
EXL3_MOE_INPUTS(bf16, true)

// One block: count the pairs of each expert, give each expert ceil(count / bm) consecutive row blocks, and place every
// pair in its expert's rows (pos[i] = its padded row, -1 for an expert of another rank). Which row a pair gets inside
// its expert does not change any result: rows are computed independently.
extern "C" __global__ void __launch_bounds__(1024) exl3_moe_align(const int* __restrict__ ids, int P, int E, int bm,
                                                                int max_blocks, int* __restrict__ pos,
                                                                int* __restrict__ row_src, int* __restrict__ block_expert)
{
    extern __shared__ int sm[];
    int* cnt = sm;           // [E] pairs per expert
    int* start = sm + E;     // [E] first row block
    int* fill = sm + 2 * E;  // [E] rows handed out
    const int tid = threadIdx.x, lane = tid & 31;
    for (int e = tid; e < E; e += blockDim.x) { cnt[e] = 0; fill[e] = 0; }
    for (int r = tid; r < max_blocks * bm; r += blockDim.x) row_src[r] = -1;
    for (int b = tid; b < max_blocks; b += blockDim.x) block_expert[b] = -1;
    __syncthreads();
    for (int i = tid; i < P; i += blockDim.x)
    {
        const int e = ids[i];
        if (e >= 0 && e < E) atomicAdd(cnt + e, 1);
    }
    __syncthreads();
    if (tid < 32)
    {
        int carry = 0;
        for (int base = 0; base < E; base += 32)
        {
            const int e = base + lane;
            const int nb = e < E ? (cnt[e] + bm - 1) / bm : 0;
            int inc = nb;
            #pragma unroll
            for (int o = 1; o < 32; o <<= 1) { const int u = __shfl_up_sync(0xffffffffu, inc, o); if (lane >= o) inc += u; }
            if (e < E) start[e] = carry + inc - nb;
            carry += __shfl_sync(0xffffffffu, inc, 31);
        }
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x)
    {
        const int nb = (cnt[e] + bm - 1) / bm;
        for (int j = 0; j < nb; ++j) block_expert[start[e] + j] = e;
    }
    for (int i = tid; i < P; i += blockDim.x)
    {
        const int e = ids[i];
        int p = -1;
        if (e >= 0 && e < E)
        {
            p = start[e] * bm + atomicAdd(fill + e, 1);
            row_src[p] = i;
        }
        pos[i] = p;
    }
}

// out[t] = sum over slots j in order of w[t, j] * y[pos[t, j]] in fp32 (no atomics: the same bits every run).
template <bool BF16>
__device__ __forceinline__ void combine_body(const u16* __restrict__ y, int ldy, const int* __restrict__ pos,
                                             const float* __restrict__ w, int topk, int hidden, u16* __restrict__ out)
{
    const int t = blockIdx.x;
    for (int c = 2 * threadIdx.x; c < hidden; c += 2 * blockDim.x)
    {
        float a0 = 0.f, a1 = 0.f;
        for (int j = 0; j < topk; ++j)
        {
            const int p = pos[t * topk + j];
            if (p < 0) continue;
            const float wj = w ? w[t * topk + j] : 1.f;
            const u32 v = *(const u32*)(y + (size_t)p * ldy + c);
            a0 += wj * ld2f<BF16>((u16)(v & 0xffff));
            a1 += wj * ld2f<BF16>((u16)(v >> 16));
        }
        *(u32*)(out + (size_t)t * hidden + c) = f2st<BF16>(a0) | ((u32)f2st<BF16>(a1) << 16);
    }
}

extern "C" __global__ void __launch_bounds__(256) exl3_moe_combine_f16(const u16* y, int ldy, const int* pos, const float* w, int topk, int hidden, u16* out)
{ combine_body<false>(y, ldy, pos, w, topk, hidden, out); }
extern "C" __global__ void __launch_bounds__(256) exl3_moe_combine_bf16(const u16* y, int ldy, const int* pos, const float* w, int topk, int hidden, u16* out)
{ combine_body<true>(y, ldy, pos, w, topk, hidden, out); }
