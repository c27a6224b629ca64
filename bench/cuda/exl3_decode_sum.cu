// Decode-only benchmark floor, compiled by bench/decode_floor.py with the linear module's -DEXL3_KA/-DEXL3_HALF/-DEXL3_CB.
#include "exl3_linear_args.cuh"

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
