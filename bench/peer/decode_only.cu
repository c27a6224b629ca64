// exl3-vllm peer harness: our own decode-only microbenchmark kernel (not exllamav3 code).
//
// Turns EXL3 trellis tiles into fp16 codebook values with no matmul, following the format facts in
// docs/format.md section 3 (ring bitstream, uint32 words with ring bit p at bit 31 - p%32, 16-bit
// state = window ending at the last bit of position j, tail-biting wrap) and section 3.5 (codebooks).
//
// One warp per 16x16 tile, 4 consecutive tiles in flight per warp (grid-stride). Lane t decodes trellis positions
// 8t..8t+7 (the MMA B-fragment order), two at a time as half2.
//   mode 0 (bench): each thread sums its decoded values in a register and writes one float at the end,
//                   so nothing is dead-code-eliminated while the output traffic stays negligible.
//   mode 1 (dump):  writes every decoded value to out[tile*256 + PERM[j]] (row-major tile), for checking
//                   against exllamav3's reconstruct().
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ATen/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <stdint.h>
#include <algorithm>

namespace exl3peer {

__device__ __forceinline__ int perm_of(int j)
{
    int t = j >> 3, q = j & 7;
    int r = 2 * (t & 3) + (q & 1) + 8 * ((q >> 1) & 1);
    int c = (t >> 2) + 8 * (q >> 2);
    return 16 * r + c;
}

// Two codebook values (states s0, s1) as one half2, docs/format.md 3.5
template <int CB>
__device__ __forceinline__ half2 cb_pair(uint32_t s0, uint32_t s1)
{
    if constexpr (CB == 2)
    {
        const uint32_t h0 = __dp4a(s0 * 0x83DCD12Du, 0x01010101u, 0x6400u);   // fp16 bits of 1024 + byte sum
        const uint32_t h1 = __dp4a(s1 * 0x83DCD12Du, 0x01010101u, 0x6400u);
        const uint32_t hh = __byte_perm(h0, h1, 0x5410);
        const half2 k_inv = __halves2half2(__ushort_as_half((unsigned short) 0x1EEE), __ushort_as_half((unsigned short) 0x1EEE));
        const half2 k_bias = __halves2half2(__ushort_as_half((unsigned short) 0xC931), __ushort_as_half((unsigned short) 0xC931));
        return __hfma2(*reinterpret_cast<const half2*>(&hh), k_inv, k_bias);
    }
    else
    {
        uint32_t x0 = (CB == 0) ? (s0 * 89226354u + 64248484u) : (s0 * 0xCBAC1FEDu);
        uint32_t x1 = (CB == 0) ? (s1 * 89226354u + 64248484u) : (s1 * 0xCBAC1FEDu);
        x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
        x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
        const uint32_t lo = __byte_perm(x0, x1, 0x5410);
        const uint32_t hi = __byte_perm(x0, x1, 0x7632);
        return __hadd2(*reinterpret_cast<const half2*>(&lo), *reinterpret_cast<const half2*>(&hi));
    }
}

// K: integer bits per weight (1..8). Tile = 8K uint32 words (ring bit p at bit 31 - p%32 of word p/32).
// Lane t needs ring bits [8tK + K - 16, 8tK + 8K) (mod 256K): at most 7K + 16 bits, starting at a runtime
// offset o within word i0. It loads NWIN words, funnel-shifts them once into NA words aligned at o, and then
// every state is a 16-bit field at a compile-time bit position qK of that aligned stream.
template <int K, int CB, bool DUMP>
__global__ __launch_bounds__(256)
void decode_kernel(const uint32_t* __restrict__ trellis, float* __restrict__ out, half* __restrict__ dump, int64_t num_tiles)
{
    constexpr int NW = 8 * K;                      // words per tile
    constexpr int NA = (7 * K + 16 + 31) / 32;     // aligned words needed
    constexpr int NWIN = NA + 1;                   // raw words loaded
    constexpr int U = 4;                           // tiles in flight per warp (memory-level parallelism)
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int64_t warps_total = (int64_t) gridDim.x * 8;
    const int b0 = 8 * lane * K + K - 16 + 256 * K;     // start bit of position 8*lane's window, kept positive
    const int i0 = (b0 >> 5) % NW;
    const int o = b0 & 31;
    int idx[NWIN];
    #pragma unroll
    for (int j = 0; j < NWIN; ++j) { idx[j] = i0 + j; if (idx[j] >= NW) idx[j] -= NW; }
    half2 acc = __float2half2_rn(0.0f);
    float facc = 0.0f;

    for (int64_t tile0 = ((int64_t) blockIdx.x * 8 + warp) * U; tile0 < num_tiles; tile0 += warps_total * U)
    {
        // issue all loads of U consecutive tiles first
        uint32_t w[U][NWIN];
        #pragma unroll
        for (int u = 0; u < U; ++u)
        {
            const int64_t tile = tile0 + u < num_tiles ? tile0 + u : num_tiles - 1;
            const uint32_t* src = trellis + tile * NW;
            #pragma unroll
            for (int j = 0; j < NWIN; ++j) w[u][j] = __ldg(src + idx[j]);
        }
        #pragma unroll
        for (int u = 0; u < U; ++u)
        {
            uint32_t a[NA + 1];
            #pragma unroll
            for (int j = 0; j < NA; ++j) a[j] = __funnelshift_l(w[u][j + 1], w[u][j], o);   // (w_j:w_j+1) << o
            a[NA] = 0;

            uint32_t st[8];
            #pragma unroll
            for (int q = 0; q < 8; ++q)
            {
                const int p = q * K;                    // compile-time after unrolling
                const int wi = p >> 5, sh = p & 31;
                if (sh <= 16) st[q] = (a[wi] >> (16 - sh)) & 0xFFFFu;
                else          st[q] = __funnelshift_l(a[wi + 1], a[wi], sh) >> 16;
            }

            half2 v[4];
            #pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = cb_pair<CB>(st[2 * q], st[2 * q + 1]);

            const int64_t tile = tile0 + u;
            if constexpr (DUMP)
            {
                if (tile < num_tiles)
                {
                    #pragma unroll
                    for (int q = 0; q < 4; ++q)
                    {
                        dump[tile * 256 + perm_of(8 * lane + 2 * q)] = __low2half(v[q]);
                        dump[tile * 256 + perm_of(8 * lane + 2 * q + 1)] = __high2half(v[q]);
                    }
                }
            }
            else
            {
                #pragma unroll
                for (int q = 0; q < 4; ++q) acc = __hadd2(acc, v[q]);
            }
        }
        if constexpr (!DUMP)
        {
            // fold into fp32 once per U tiles (keeps the fp16 sum bounded)
            float2 f = __half22float2(acc); facc += f.x + f.y; acc = __float2half2_rn(0.0f);
        }
    }
    if constexpr (!DUMP)
    {
        float2 f = __half22float2(acc);
        out[(int64_t) blockIdx.x * blockDim.x + threadIdx.x] = facc + f.x + f.y;
    }
}

template <bool DUMP, int CB>
static void* pick_k(int K)
{
    switch (K)
    {
        case 1: return (void*) decode_kernel<1, CB, DUMP>;
        case 2: return (void*) decode_kernel<2, CB, DUMP>;
        case 3: return (void*) decode_kernel<3, CB, DUMP>;
        case 4: return (void*) decode_kernel<4, CB, DUMP>;
        case 5: return (void*) decode_kernel<5, CB, DUMP>;
        case 6: return (void*) decode_kernel<6, CB, DUMP>;
        case 7: return (void*) decode_kernel<7, CB, DUMP>;
        case 8: return (void*) decode_kernel<8, CB, DUMP>;
    }
    return nullptr;
}

template <bool DUMP>
static void* pick(int K, int cb)
{
    if (cb == 0) return pick_k<DUMP, 0>(K);
    if (cb == 1) return pick_k<DUMP, 1>(K);
    if (cb == 2) return pick_k<DUMP, 2>(K);
    return nullptr;
}

static void launch(const at::Tensor& trellis, float* out, half* dump, int cb, int grid)
{
    TORCH_CHECK(trellis.is_cuda() && trellis.is_contiguous() && trellis.dim() == 3, "trellis: contiguous 3-D CUDA tensor");
    TORCH_CHECK(trellis.scalar_type() == at::kShort, "trellis must be int16");
    const int w = (int) trellis.size(2);
    TORCH_CHECK(w % 16 == 0 && w / 16 >= 1 && w / 16 <= 8, "decode_only: integer K 1..8 only");
    const int K = w / 16;
    const int64_t num_tiles = trellis.size(0) * trellis.size(1);
    void* fn = dump ? pick<true>(K, cb) : pick<false>(K, cb);
    TORCH_CHECK(fn, "decode_only: bad K/codebook");
    const uint32_t* tp = (const uint32_t*) trellis.data_ptr();
    void* args[] = { (void*) &tp, (void*) &out, (void*) &dump, (void*) &num_tiles };
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    cudaError_t err = cudaLaunchKernel(fn, dim3(grid), dim3(256), args, 0, stream);
    TORCH_CHECK(err == cudaSuccess, "decode_only launch: ", cudaGetErrorString(err));
}

}  // namespace exl3peer

// out: float32 tensor with >= grid*256 elements (one sum per thread)
void peer_decode_only(const at::Tensor& trellis, at::Tensor& out, int64_t cb, int64_t grid)
{
    const at::cuda::OptionalCUDAGuard guard(trellis.device());
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.numel() >= grid * 256, "out: float32, >= grid*256");
    exl3peer::launch(trellis, (float*) out.data_ptr(), nullptr, (int) cb, (int) grid);
}

// dump: fp16 tensor of numel = tiles*256, written as row-major 16x16 tiles in trellis tile order
void peer_decode_dump(const at::Tensor& trellis, at::Tensor& dump, int64_t cb)
{
    const at::cuda::OptionalCUDAGuard guard(trellis.device());
    TORCH_CHECK(dump.scalar_type() == at::kHalf && dump.numel() == trellis.size(0) * trellis.size(1) * 256, "dump: fp16, tiles*256");
    int64_t tiles = trellis.size(0) * trellis.size(1);
    int grid = (int) std::min<int64_t>((tiles + 31) / 32, 65535 * 8);
    exl3peer::launch(trellis, nullptr, (half*) dump.data_ptr(), (int) cb, grid);
}
