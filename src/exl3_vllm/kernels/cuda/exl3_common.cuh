// Header-free helpers: NVRTC wheels ship no CUDA headers, so fp16/bf16 go through inline PTX.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#define EXL3_INLINE __device__ __forceinline__

EXL3_INLINE float h2f(u16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
EXL3_INLINE u16 f2h(float f) { u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
EXL3_INLINE float bf2f(u16 h) { return __uint_as_float(((u32)h) << 16); }
EXL3_INLINE u16 f2bf(float f) { u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

template <bool BF16> EXL3_INLINE float ld2f(u16 h) { return BF16 ? bf2f(h) : h2f(h); }
template <bool BF16> EXL3_INLINE u16 f2st(float f) { return BF16 ? f2bf(f) : f2h(f); }

// The 4 fp16 values at p (8 bytes) as floats.
EXL3_INLINE void h2f4(const u16* p, float (&v)[4])
{
    const uint2 a = *(const uint2*)p;
    v[0] = h2f(a.x & 0xffff); v[1] = h2f(a.x >> 16); v[2] = h2f(a.y & 0xffff); v[3] = h2f(a.y >> 16);
}
// v * f + b in the output dtype, 4 consecutive values at dst (8 bytes).
template <bool BF16>
EXL3_INLINE void store_fma4(u16* dst, const float (&v)[4], const float (&f)[4], const float (&b)[4])
{
    uint2 o;
    o.x = f2st<BF16>(v[0] * f[0] + b[0]) | ((u32)f2st<BF16>(v[1] * f[1] + b[1]) << 16);
    o.y = f2st<BF16>(v[2] * f[2] + b[2]) | ((u32)f2st<BF16>(v[3] * f[3] + b[3]) << 16);
    *(uint2*)dst = o;
}

EXL3_INLINE u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
// The 128-byte swizzle of x for wgmma: 16-byte chunk j (0..7) of row r sits at chunk j ^ (r % 8) of its 128 bytes.
EXL3_INLINE int swz128(int j, int r) { return j ^ (r & 7); }

EXL3_INLINE void cp_async16(u32 dst, const void* src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
EXL3_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> EXL3_INLINE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Programmatic dependent launch (sm_90+; no-ops before, and when the launch did not ask for it): a producer kernel lets
// its dependent start early; the dependent's wait returns once the producer grid has finished and its writes are visible.
EXL3_INLINE void pdl_launch_dependents()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
EXL3_INLINE void pdl_wait()
{
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

EXL3_INLINE void ldmatrix_x4(u32 (&r)[4], u32 addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

EXL3_INLINE void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

EXL3_INLINE u32 funnel_l(u32 lo, u32 hi, u32 s) { u32 r; asm("shf.l.wrap.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(s)); return r; }
EXL3_INLINE u32 funnel_r(u32 lo, u32 hi, u32 s) { u32 r; asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(s)); return r; }
EXL3_INLINE u32 prmt(u32 a, u32 b, u32 sel) { u32 r; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel)); return r; }
EXL3_INLINE u32 dp4a_u(u32 a, u32 b, u32 c) { u32 r; asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r; }
EXL3_INLINE u32 hfma2(u32 a, u32 b, u32 c) { u32 r; asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r; }
// (a & b) ^ c in one LOP3 (immLut = (0xF0 & 0xCC) ^ 0xAA); written plainly, ptxas emits an AND and an XOR.
EXL3_INLINE u32 and_xor(u32 a, u32 b, u32 c) { u32 r; asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r; }
EXL3_INLINE u32 hadd2(u32 a, u32 b) { u32 r; asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
// (lo + hi, lo + hi) of an fp16 pair: ptxas folds the half broadcasts into HADD2's operand selectors.
EXL3_INLINE u32 hsum_halves(u32 x)
{
    u32 r;
    asm("{ .reg .b16 l, h; .reg .b32 a, c; mov.b32 {l, h}, %1; mov.b32 a, {l, l}; mov.b32 c, {h, h}; add.rn.f16x2 %0, a, c; }"
        : "=r"(r) : "r"(x));
    return r;
}
EXL3_INLINE u32 hmul2(u32 a, u32 b) { u32 r; asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }

EXL3_INLINE float4 ld_cg4(const float* p)
{
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}
EXL3_INLINE void st_cg4(float* p, float4 v)
{
    asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w));
}
EXL3_INLINE int atom_add_acq_rel(int* p, int v)
{
    int r;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(r) : "l"(p), "r"(v) : "memory");
    return r;
}
EXL3_INLINE void red_add(float* p, float v) { asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory"); }
#if __CUDA_ARCH__ >= 900
EXL3_INLINE void red_add4(float* p, float4 v)
{
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
#endif

// 128-point Sylvester Hadamard over a warp: lane holds elements 4*lane..4*lane+3, result scaled by 1/sqrt(128).
EXL3_INLINE void had128_warp(float (&v)[4], int lane)
{
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2; v[1] = a1 + a3; v[2] = a0 - a2; v[3] = a1 - a3;
    #pragma unroll
    for (int m = 1; m < 32; m <<= 1)
    {
        bool upper = lane & m;
        #pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            float p = __shfl_xor_sync(0xffffffffu, v[i], m);
            v[i] = upper ? p - v[i] : v[i] + p;
        }
    }
    #pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= 0.08838834764831845f;
}

// Geometry of one 16x16 trellis tile for K = KA (+0.5 when HALF).
template <int KA, bool HALF>
struct Tile
{
    static constexpr int W32 = HALF ? 8 * KA + 4 : 8 * KA;     // uint32 words per tile
    static constexpr int RING = 32 * W32;                       // ring bits
    // End bit of position q counted from the lane's first position (lanes start on even positions).
    __host__ __device__ static constexpr int end(int q) { return HALF ? ((q & 1) ? ((q + 1) / 2) * (2 * KA + 1) : (q / 2) * (2 * KA + 1) + KA) : (q + 1) * KA; }
    __host__ __device__ static constexpr int lane_bits() { return HALF ? 4 * (2 * KA + 1) : 8 * KA; }
    static constexpr int SPAN = end(7) - end(0) + 16;
    __host__ __device__ static constexpr int start_bit(int t) { return (t * lane_bits() + end(0) - 16 + RING) % RING; }
    __host__ __device__ static constexpr int max_words()
    {
        int mx = 0;
        for (int t = 0; t < 32; ++t) { int o = start_bit(t) % 32; int w = (o + SPAN + 31) / 32; if (w > mx) mx = w; }
        return mx;
    }
    static constexpr int NW = max_words();                      // words one lane reads
};

// Per-lane constants: which words of a tile this lane reads and the bit offset of its first window.
template <int KA, bool HALF>
struct LaneMap
{
    int idx[Tile<KA, HALF>::NW];
    u32 off;
    EXL3_INLINE void init(int lane)
    {
        typedef Tile<KA, HALF> T;
        int b = T::start_bit(lane);
        int w0 = b >> 5;
        off = b & 31;
        #pragma unroll
        for (int i = 0; i < T::NW; ++i) { int w = w0 + i; idx[i] = w >= T::W32 ? w - T::W32 : w; }
    }
};

// Where each of the 8 state windows is cut from: a few 32-bit "views" of the stream, each window at byte offset 0/8/16
// of one view, so a window costs one SHF/LOP/PRMT and a view one funnel shift (or nothing when word-aligned).
template <int KA, bool HALF>
struct StatePlan
{
    typedef Tile<KA, HALF> T;
    // Every lane starts at the same bit when K is a multiple of 4: read the raw words, no normalising shifts.
    static constexpr bool RAW = !HALF && KA % 4 == 0;
    static constexpr int BASE = RAW ? ((KA - 16) & 31) : 0;
    struct P { int nv; int vc[8]; int fv[8]; int fd[8]; };
    __host__ __device__ static constexpr P make()
    {
        P p{};
        for (int q = 0; q < 8; ++q)
        {
            const int a = BASE + T::end(q) - T::end(0);
            int f = -1;
            for (int v = 0; v < p.nv && f < 0; ++v) { int d = a - p.vc[v]; if (d == 0 || d == 8 || d == 16) f = v; }
            if (f < 0)
            {
                int c = a;
                for (int dd = 16; dd >= 0; dd -= 8) if (a - dd >= 0 && (a - dd) % 32 == 0) { c = a - dd; break; }
                f = p.nv; p.vc[p.nv++] = c;
            }
            p.fv[q] = f; p.fd[q] = a - p.vc[f];
        }
        return p;
    }
};

// 8 states of this lane from its words (state q = stream bits [end(q)-16, end(q)) read MSB-first).
template <int KA, bool HALF>
EXL3_INLINE void lane_states(const u32 (&w)[Tile<KA, HALF>::NW], u32 off, u32 (&st)[8])
{
    typedef StatePlan<KA, HALF> SP;
    constexpr int NW = Tile<KA, HALF>::NW;
    constexpr typename SP::P P = SP::make();
    u32 x[NW];
    #pragma unroll
    for (int i = 0; i < NW; ++i) x[i] = SP::RAW ? w[i] : funnel_l(i + 1 < NW ? w[i + 1] : 0u, w[i], off);
    u32 view[P.nv];
    #pragma unroll
    for (int iv = 0; iv < P.nv; ++iv)
    {
        const int c = P.vc[iv], i = c >> 5, r = c & 31;
        view[iv] = r == 0 ? x[i] : funnel_l(i + 1 < NW ? x[i + 1 < NW ? i + 1 : i] : 0u, x[i], r);
    }
    #pragma unroll
    for (int q = 0; q < 8; ++q)
    {
        const int d = P.fd[q];
        const u32 v = view[P.fv[q]];
        st[q] = d == 0 ? v >> 16 : d == 16 ? v & 0xffffu : prmt(v, 0u, 0x4421);
    }
}

EXL3_INLINE u32 mulhi_u(u32 a, u32 b) { u32 r; asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b)); return r; }
EXL3_INLINE u32 mad_lo(u32 a, u32 b, u32 c) { u32 r; asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r; }

// st * MULT + ADD (mod 2^32) of this lane's 8 states, cut on the FMA pipe where a view's top half is cut anyway:
// top = view / 2^16 (IMAD.HI), bottom * MULT = view * MULT - top * (MULT * 2^16), instead of SHF / LOP3 on the ALU.
template <int KA, bool HALF, u32 MULT, u32 ADD>
EXL3_INLINE void lane_products(const u32 (&w)[Tile<KA, HALF>::NW], u32 off, u32 (&pr)[8])
{
    typedef StatePlan<KA, HALF> SP;
    constexpr int NW = Tile<KA, HALF>::NW;
    constexpr typename SP::P P = SP::make();
    u32 x[NW];
    #pragma unroll
    for (int i = 0; i < NW; ++i) x[i] = SP::RAW ? w[i] : funnel_l(i + 1 < NW ? w[i + 1] : 0u, w[i], off);
    u32 view[P.nv], top[P.nv];
    #pragma unroll
    for (int iv = 0; iv < P.nv; ++iv)
    {
        const int c = P.vc[iv], i = c >> 5, r = c & 31;
        view[iv] = r == 0 ? x[i] : funnel_l(i + 1 < NW ? x[i + 1 < NW ? i + 1 : i] : 0u, x[i], r);
        top[iv] = mulhi_u(view[iv], 0x10000u);
    }
    #pragma unroll
    for (int q = 0; q < 8; ++q)
    {
        const int d = P.fd[q], f = P.fv[q];
        bool has_top = false;
        #pragma unroll
        for (int q2 = 0; q2 < 8; ++q2) has_top |= P.fv[q2] == f && P.fd[q2] == 0;
        if (d == 0) pr[q] = mad_lo(top[f], MULT, ADD);
        else if (d == 16 && has_top) pr[q] = mad_lo(top[f], 0u - (MULT << 16), mad_lo(view[f], MULT, ADD));
        else pr[q] = mad_lo(d == 16 ? view[f] & 0xffffu : prmt(view[f], 0u, 0x4421), MULT, ADD);
    }
}

// The codebooks' state hash: 3inst v = st * 89226354 + 64248484, mcg v = st * 0xCBAC1FED, mul1 v = st * 0x83DCD12D.
template <int CB> constexpr u32 CB_MULT = CB == 0 ? 89226354u : CB == 1 ? 0xCBAC1FEDu : 0x83DCD12Du;
template <int CB> constexpr u32 CB_ADD = CB == 0 ? 64248484u : 0u;
// 3inst / mcg: a state's weight is the sum of the two fp16 halves of this word, from its hash v.
EXL3_INLINE u32 cb_halves_of(u32 v) { return and_xor(v, 0x8FFF8FFFu, 0x3B603B60u); }

// mul1's last step, w = scale * v + add on v = 1024 + bytesum(state * mult): its fp16 constants.
constexpr u16 MUL1_SCALE = 0x1EEE, MUL1_ADD = 0xC931;

// mul1 before its fp16 affine step: the exact integer 1024 + bytesum(state * mult) as fp16, upper half zero.
EXL3_INLINE u32 mul1_sum(u32 st) { return dp4a_u(st * CB_MULT<2>, 0x01010101u, 0x6400u); }

// The same for a lane's 8 states as fp16 pairs (two m16n8k16 B fragments).
EXL3_INLINE void mul1_sums_to_frag(const u32 (&st)[8], u32 (&b)[4])
{
    u32 h[8];
    #pragma unroll
    for (int q = 0; q < 8; ++q) h[q] = mul1_sum(st[q]);
    #pragma unroll
    for (int p = 0; p < 4; ++p) b[p] = prmt(h[2 * p], h[2 * p + 1], 0x5410);
}

// mul1: states -> packed fp16 pairs (w0,w1),(w2,w3),(w4,w5),(w6,w7) = two m16n8k16 B fragments.
EXL3_INLINE void mul1_states_to_frag(const u32 (&st)[8], u32 (&b)[4])
{
    mul1_sums_to_frag(st, b);
    #pragma unroll
    for (int p = 0; p < 4; ++p) b[p] = hfma2(b[p], MUL1_SCALE * 0x10001u, MUL1_ADD * 0x10001u);
}

// 3inst / mcg: this lane's 8 words of fp16 halves (a weight is the sum of its word's two) from its tile words.
// CUT: the windows cut on the FMA pipe (lane_products); faster where the decode alone is ALU-bound (the decode-only
// pass), slower in the GEMM loops (bench/results/2026-12-05a), so those keep the ALU cuts.
template <int KA, bool HALF, int CB, bool CUT = false>
EXL3_INLINE void words_to_halves(const u32 (&w)[Tile<KA, HALF>::NW], u32 off, u32 (&h)[8])
{
    if constexpr (CUT)
        lane_products<KA, HALF, CB_MULT<CB>, CB_ADD<CB>>(w, off, h);
    else
    {
        lane_states<KA, HALF>(w, off, h);
        #pragma unroll
        for (int q = 0; q < 8; ++q) h[q] = h[q] * CB_MULT<CB> + CB_ADD<CB>;
    }
    #pragma unroll
    for (int q = 0; q < 8; ++q) h[q] = cb_halves_of(h[q]);
}

// This lane's two m16n8k16 B fragments of a tile from its words: fp16 pairs (w0,w1),(w2,w3),(w4,w5),(w6,w7).
template <int KA, bool HALF, int CB, bool CUT = false>
EXL3_INLINE void words_to_frag(const u32 (&w)[Tile<KA, HALF>::NW], u32 off, u32 (&b)[4])
{
    if constexpr (CB == 2)
    {
        u32 st[8];
        lane_states<KA, HALF>(w, off, st);
        mul1_states_to_frag(st, b);
    }
    else
    {
        u32 h[8];
        words_to_halves<KA, HALF, CB, CUT>(w, off, h);
        #pragma unroll
        for (int p = 0; p < 4; ++p)
        {
            if constexpr (CUT)  // each word's halves summed by HADD2's operand selectors, then paired: one ALU op
                b[p] = prmt(hsum_halves(h[2 * p]), hsum_halves(h[2 * p + 1]), 0x5410);
            else
                b[p] = hadd2(prmt(h[2 * p], h[2 * p + 1], 0x5410), prmt(h[2 * p], h[2 * p + 1], 0x7632));
        }
    }
}
