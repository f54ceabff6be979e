/*
 * What every FP8 MoE kernel of the CUDA backend needs (docs/NUMERICS.md "FP8 MoE"): the exact
 * value of an e4m3 code as an integer count of 2^-9, the scale views of activations (every act
 * layout, 2-D or 3-D masked) and of weight blocks, the x86 NaN rules of the block sum's
 * fused multiply-add, the h quantization of one 128-column group exactly as `quant` does, and
 * the kernel parameter block of one FP8 GEMM (Fp8Gemm). moe_fp8_portable.cu builds on these;
 * a Hopper kernel reuses them so that both read operands and write h the same way.
 */
#ifndef MOEFUSE_CUDA_FP8_CUH
#define MOEFUSE_CUDA_FP8_CUH

#include "cuda/moe_kernels.cuh"

#include <stdint.h>

#define FP8_BLOCK 128             /* depth of a scale block; width of an activation group */
#define FP8_NAN_NONE 0x7FFFFFFF   /* first-NaN key of a row block without a NaN code */

/* ------------------------------------------------------------ e4m3 codes */

/* Whether code b is a NaN code (0x7F / 0xFF). */
static __host__ __device__ __forceinline__ bool fp8_is_nan_code(uint32_t b)
{
    return (b & 0x7Fu) == 0x7Fu;
}

/*
 * The exact value of a non-NaN code as a signed count of 2^-9: a subnormal m * 2^-9 is m, a
 * normal (8 + m) * 2^(e - 10) is (8 + m) << (e - 1). |count| <= 14 << 14 < 2^18, so the
 * product of two counts (a multiple of 2^-18) fits 36 bits and 128 of them 43 bits.
 * NaN codes give 0: the caller tracks them apart (fp8_nan_key).
 */
static __host__ __device__ __forceinline__ int32_t fp8_count(uint32_t b)
{
    const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    int32_t v = e == 0u ? (int32_t)m : (int32_t)((8u | m) << (e - 1u));
    v = fp8_is_nan_code(b) ? 0 : v;
    return (b & 0x80u) ? -v : v;
}

/* The value of code b as f32 (NaN codes: the quiet NaN with the code's sign). */
static __host__ __device__ __forceinline__ float fp8_value(uint32_t b)
{
    return mf_e4m3_to_f32(b);
}

/*
 * Which NaN a block sum gets. The reference adds value(qa[k]) * value(qw[k]) for k = 0..127
 * and keeps the first NaN it meets (x86: the first NaN operand of each operation), so the
 * NaN of the lowest k wins, the activation's before the weight's at the same k. A key orders
 * those: (k << 2) | (weight ? 2 : 0) | sign; the smaller key of the two operand rows decides,
 * FP8_NAN_NONE when neither row block has a NaN code.
 */
static __device__ __forceinline__ int fp8_nan_key(int k, int weight, uint32_t code)
{
    return (k << 2) | (weight ? 2 : 0) | (int)((code >> 7) & 1u);
}

/* The block sum p_b from its exact count of 2^-18, or the NaN its key names. */
static __device__ __forceinline__ float fp8_block_sum(long long count, int key)
{
    if (key != FP8_NAN_NONE)
        return mf_bits_f32((key & 1) ? 0xFFC00000u : 0x7FC00000u);
    /* one rounding to f32 (nearest even); times 2^-18 is exact (|count| >= 1 stays normal) */
    return __fmul_rn(__ll2float_rn(count), 0x1p-18f);
}

/* 16 codes at src: one 16-byte load when rows are aligned, else bytes. */
static __device__ __forceinline__ uint4 fp8_load16(const uint8_t *src, int vec)
{
    if (vec)
        return __ldg((const uint4 *)src);
    uint32_t w[4];
#pragma unroll
    for (int q = 0; q < 4; q++)
        w[q] = (uint32_t)__ldg(src + 4 * q) | ((uint32_t)__ldg(src + 4 * q + 1) << 8) |
               ((uint32_t)__ldg(src + 4 * q + 2) << 16) | ((uint32_t)__ldg(src + 4 * q + 3) << 24);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* ------------------------------------------------ x86 NaN rules of the sums */

/* a + b with the CPU's NaN bits (first NaN operand quieted; an invalid sum the default NaN). */
static __device__ __forceinline__ float fp8_add(float a, float b)
{
    return mf_nan_of(__fadd_rn(a, b), a, b);
}

/*
 * fmaf(p, s, acc) with the CPU's NaN bits: the first NaN of p, s, acc (in that order,
 * quieted), else the default NaN 0xFFC00000 for an invalid operation (Inf * 0, Inf - Inf).
 */
static __device__ __forceinline__ float fp8_fma(float p, float s, float acc)
{
    const float r = __fmaf_rn(p, s, acc);
    if (!mf_is_nan(r))
        return r;
    if (mf_is_nan(p))
        return mf_quiet(p);
    return mf_nan_of(r, s, acc);
}

/* The scale product sa * sw of a block with the CPU's NaN bits. */
static __device__ __forceinline__ float fp8_scale_mul(float sa, float sw)
{
    return mf_nan_of(__fmul_rn(sa, sw), sa, sw);
}

/* --------------------------------------------------------------- scales */

/*
 * Group scales of an activation tensor (x or h) in an act layout (docs/NUMERICS.md "Scale
 * layouts"), normalised to rank 3 as mf_rows_args.scales: expert block e (0 for the 2-D
 * layout), row t, group g. Strides in elements (words for the packed layout).
 */
typedef struct Fp8ActScales {
    const void *p;
    int64_t s0, s1; /* expert block, and rows (row-major) or groups (column-major / packed) */
    int layout;     /* MF_LAYOUT_ROW / _COL / _PACKED */
    int u8;         /* exponent bytes (u8 tensors); packed words are always bytes */
} Fp8ActScales;

/* Element index of (e, t, g): a byte index for packed words. */
static __device__ __forceinline__ int64_t fp8_act_scale_index(const Fp8ActScales &v, int64_t e,
                                                              int64_t t, int64_t g)
{
    if (v.layout == MF_LAYOUT_PACKED)
        return (e * v.s0 + (g >> 2) * v.s1 + t) * 4 + (g & 3);
    if (v.layout == MF_LAYOUT_COL)
        return e * v.s0 + g * v.s1 + t;
    return e * v.s0 + t * v.s1 + g;
}

/* The scale of group g of row t of expert block e, as f32 (2^(e-127) for a byte, 255 NaN). */
static __device__ __forceinline__ float fp8_act_scale(const Fp8ActScales &v, int64_t e, int64_t t,
                                                      int64_t g)
{
    const int64_t i = fp8_act_scale_index(v, e, t, g);
    if (v.layout == MF_LAYOUT_PACKED || v.u8)
        return mf_ue8m0_read(((const uint8_t *)v.p)[i]);
    return ((const float *)v.p)[i];
}

/* Block scales of a weight tensor [E, N/128, D/128], f32 or u8 exponents. */
typedef struct Fp8WScales {
    const void *p;
    int64_t s0, s1, s2;
    int u8;
} Fp8WScales;

/* The scale of row block rb, depth block db of expert e. */
static __device__ __forceinline__ float fp8_w_scale(const Fp8WScales &v, int64_t e, int64_t rb,
                                                    int64_t db)
{
    const int64_t i = e * v.s0 + rb * v.s1 + db * v.s2;
    return v.u8 ? mf_ue8m0_read(((const uint8_t *)v.p)[i]) : ((const float *)v.p)[i];
}

/* ------------------------------------------------------- h quantization */

/* The scale of a group from its amax over finite values, as `quant` forms it: s and the byte. */
static __device__ __forceinline__ float fp8_group_scale(float amax, float eps, int ue8m0,
                                                        uint32_t *ue)
{
    amax = amax > eps ? amax : eps;
    float s = __fdiv_rn(amax, 448.0f); /* one IEEE division */
    *ue = 0u;
    if (ue8m0) {
        *ue = mf_ue8m0_exponent(s); /* rounded up to a power of two, 1..254 */
        s = mf_bits_f32(*ue << 23);
    }
    return s;
}

/* The code of one h value with scale s: NaN keeps its sign, +-Inf gives +-448, else h / s. */
static __device__ __forceinline__ uint32_t fp8_code(float h, float s)
{
    if (mf_is_nan(h))
        return ((mf_f32_bits(h) >> 24) & 0x80u) | 0x7Fu;
    if (!mf_is_finite(h))
        return ((mf_f32_bits(h) >> 24) & 0x80u) | 0x7Eu;
    return mf_f32_to_e4m3(__fdiv_rn(h, s)); /* one IEEE division, not h * (1 / s) */
}

/*
 * One 128-value group held by a warp, four consecutive values a lane (lane l: 4 l .. 4 l + 3):
 * the group's amax over finite values across the warp, its scale (returned; *ue its exponent
 * byte under ue8m0) and the lane's four codes packed low byte first, as `quant` forms them.
 */
static __device__ __forceinline__ float fp8_quant_warp4(const float (&v)[4], float eps,
                                                        int ue8m0, uint32_t *codes, uint32_t *ue)
{
    float amax = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const float a = fabsf(v[q]);
        amax = (mf_is_finite(v[q]) && a > amax) ? a : amax;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    const float s = fp8_group_scale(amax, eps, ue8m0, ue);
    uint32_t w = 0;
#pragma unroll
    for (int q = 0; q < 4; q++)
        w |= fp8_code(v[q], s) << (8 * q);
    *codes = w;
    return s;
}

/* Where the gate writes h: codes (rows at Fp8Gemm's output offsets) and group scales. */
typedef struct Fp8HOut {
    uint8_t *q;      /* h codes */
    Fp8ActScales sc; /* their scales, in the act layout (p is written): row t = m * k + j
                        (routed, expert block 0) or t of expert block e (masked) */
    int64_t groups;  /* I / 128 */
    float eps;
    int ue8m0;       /* round scales up to powers of two (u8, packed) */
} Fp8HOut;

/* Store the scale of (e, t, g): f32, a byte, or byte g % 4 of a packed word. */
static __device__ __forceinline__ void fp8_put_scale(const Fp8HOut &o, int64_t e, int64_t t,
                                                     int64_t g, float s, uint32_t ue)
{
    const int64_t i = fp8_act_scale_index(o.sc, e, t, g);
    if (o.sc.layout == MF_LAYOUT_PACKED || o.sc.u8)
        ((uint8_t *)o.sc.p)[i] = (uint8_t)ue;
    else
        ((float *)o.sc.p)[i] = s;
}

/*
 * Zero the scale bytes of row t that no group owns: the unused bytes of the last packed
 * word (quant writes them as 0 in every row it writes).
 */
static __device__ __forceinline__ void fp8_put_scale_tail(const Fp8HOut &o, int64_t e, int64_t t)
{
    if (o.sc.layout != MF_LAYOUT_PACKED)
        return;
    for (int64_t g = o.groups; g < (o.groups + 3) / 4 * 4; g++)
        ((uint8_t *)o.sc.p)[fp8_act_scale_index(o.sc, e, t, g)] = 0u;
}

/* ------------------------------------------------------ GEMM parameters */

/* Epilogue of an FP8 GEMM. */
enum fp8_epilogue {
    FP8_EPI_GATE = 0,  /* act(gate, up) quantized into h codes and scales (Fp8HOut) */
    FP8_EPI_Y_F32 = 1, /* y + bias in f32 into y scratch [S, K]; a reduce kernel sums it */
    FP8_EPI_OUT = 2    /* y + bias rounded once into out (un-reduced [M, k, K] or masked) */
};

/*
 * One FP8 GEMM of the layer, passed by value. A rows: routed, slot s = m * k + j of the
 * route's lists (rt) reads codes a + m * a_s0 + j * a_s1 and scale row m * a_srow_m + j (x:
 * a_srow_m = 1 with k as 1, h: rows m * k + j); masked, row t of expert e reads
 * a + e * a_s0 + t * a_s1 and scale (e, t). B: weight row r of expert e at w + e * w_s0 +
 * r * w_s1, scales (e, r / 128, depth block). Output row of slot s at m * o_s0 + j * o_s1
 * (masked: e * o_s0 + t * o_s1).
 */
typedef struct Fp8Gemm {
    MoeRoute rt;               /* routed layout: the route's lists (tiles of bm slots) */
    int masked;                /* 3-D layout: tiles (e, t0) of rows t < n[e] */
    const int32_t *counts;     /* masked: n [E], clamped to [0, Tmax] on use */
    int64_t counts_s0, tmax;
    const uint8_t *a;          /* activation codes */
    int64_t a_s0, a_s1;
    Fp8ActScales as;           /* their group scales */
    int a_scale_slot;          /* routed: 1 when scale rows are slots (h), 0 when tokens (x) */
    const uint8_t *w;          /* weight codes */
    int64_t w_s0, w_s1;
    Fp8WScales ws;             /* their block scales */
    int64_t depth;             /* K (gate) or I (final): a multiple of 128 */
    int64_t ncols;             /* I (gate: h columns) or K (final) */
    int64_t nblk;              /* column blocks of 128 (h columns for the gate) */
    int64_t gate_row, up_row;  /* gate: w1 / b1 row of gate value 0 and of up value 0 */
    int64_t row_step;          /* gate: rows between values i and i + 1 (2 interleaved, else 1) */
    const void *bias;          /* b1 / b2 [E, rows] or NULL */
    int64_t bias_s0;
    int bias_dt;
    int epi;                   /* enum fp8_epilogue */
    int act;
    float alpha, limit, up_offset; /* the gate's activation (moefuse_moe_options) */
    Fp8HOut h;                 /* FP8_EPI_GATE */
    void *out;                 /* FP8_EPI_Y_F32 / FP8_EPI_OUT */
    int64_t o_s0, o_s1;
    int out_dt;
    int vec_a, vec_w;          /* every row start is 16-byte aligned: 16-byte loads */
    long long lin_bound;       /* routed: tile indices to cover */
} Fp8Gemm;

/* Local expert and slots of routed tile `lin` of BM slots: e = -1 past the last tile. */
static __device__ __forceinline__ void fp8_routed_tile(const MoeRoute &rt, long long nblk, int bm,
                                                       long long lin, long long *e,
                                                       long long *nb, long long *first,
                                                       long long *count)
{
    *e = -1;
    const long long total = rt.tiles[rt.E] * nblk;
    if (lin >= total)
        return;
    const long long ee = rt.tile_expert[lin / nblk];
    const long long t0 = rt.tiles[ee], mtc = rt.tiles[ee + 1] - t0;
    const long long r = lin - t0 * nblk, mt = r % mtc;
    *e = ee;
    *nb = r / mtc;
    *first = rt.offs[ee] + mt * bm;
    const long long c = rt.offs[ee + 1] - *first;
    *count = c < bm ? c : bm;
}

/* Valid rows of expert e in the masked layout: n[e] clamped to [0, Tmax] (device data). */
static __device__ __forceinline__ long long fp8_masked_rows(const Fp8Gemm &p, long long e)
{
    const long long n = p.counts[e * p.counts_s0];
    return n < 0 ? 0 : (n > p.tmax ? p.tmax : n);
}

#endif /* MOEFUSE_CUDA_FP8_CUH */
