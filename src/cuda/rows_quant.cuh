/*
 * The row kernels' quantization (rows.cu): a group's scale from its amax, the codes, and
 * where each scale layout puts the scales.
 */
#ifndef MOEFUSE_CUDA_ROWS_QUANT_CUH
#define MOEFUSE_CUDA_ROWS_QUANT_CUH

#include "cuda/rows_values.cuh"

/* --------------------------------------------------------- quantization */

/* Scale of a group from its amax: s, and the exponent byte when ue8m0. */
static __device__ __forceinline__ float group_scale(const rows_params &p, float amax,
                                                    uint32_t *ue)
{
    amax = amax > p.eps ? amax : p.eps;
    const float qmax = p.fp8 ? 448.0f : 127.0f;
    /* the branch-free division where device_check.cu proved it exact, IEEE's elsewhere */
    float s = mf_div_fast_ok(amax) ? mf_div_fast(amax, qmax) : amax / qmax;
    *ue = 0u;
    if (p.ue8m0) {
        *ue = mf_ue8m0_exponent(s);
        s = mf_bits_f32(*ue << 23);
    }
    return s;
}

/* An i8 code of a non-NaN value: half to even, clamped to [-127, 127] (= mf_f32_to_i8). */
static __device__ __forceinline__ uint32_t i8code(float d)
{
    const float c = fminf(fmaxf(d, -127.0f), 127.0f);
    return (uint32_t)__float2int_rn(c) & 0xFFu;
}

/* Eight quotients' codes (e4m3 or i8), packed in two words in their order. */
static __device__ __forceinline__ void pack8(int fp8, const float d[8], uint32_t w[2])
{
    if (fp8) {
        w[0] = mf_e4m3x2(d[0], d[1]) | (mf_e4m3x2(d[2], d[3]) << 16);
        w[1] = mf_e4m3x2(d[4], d[5]) | (mf_e4m3x2(d[6], d[7]) << 16);
    } else {
        w[0] = i8code(d[0]) | (i8code(d[1]) << 8) | (i8code(d[2]) << 16) | (i8code(d[3]) << 24);
        w[1] = i8code(d[4]) | (i8code(d[5]) << 8) | (i8code(d[6]) << 16) | (i8code(d[7]) << 24);
    }
}

/*
 * Codes of 8 finite values of h with scale s (y = 1/s, s in the range of
 * mf_div_scale): q = h / s, correctly rounded. The 8 bytes go to w[2].
 */
static __device__ __forceinline__ void codes8(int fp8, const float h[8], float s, float y,
                                              uint32_t w[2])
{
    float d[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        d[i] = mf_div_scale(h[i], s, y);
    pack8(fp8, d, w);
}

/*
 * The same for a power-of-two scale (UE8M0) with y = 1/s exact: h * y is
 * the exact quotient rounded once, as h / s is, so one multiplication per
 * value gives the bits of the division (and keeps the sign of -0).
 */
static __device__ __forceinline__ void codes8_pow2(int fp8, const float h[8], float y,
                                                   uint32_t w[2])
{
    float d[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        d[i] = h[i] * y;
    pack8(fp8, d, w);
}

/* Code of one value of h: NaN (with the CPU's bits), +-Inf, finite with either division. */
static __device__ __forceinline__ uint32_t code1(int fp8, float v, float s, float y, int fast)
{
    if (mf_is_nan(v))
        return fp8 ? (((mf_f32_bits(v) >> 24) & 0x80u) | 0x7Fu) : 0u;
    const float q = fast ? mf_div_scale(v, s, y) : v / s;
    const float d = mf_is_finite(v) ? q : copysignf(448.0f, v); /* Inf: +-448 or +-127 */
    return fp8 ? (mf_e4m3x2(d, 0.0f) & 0xFFu) : i8code(d);
}

/* Eight values passed by value: an array argument of an out-of-line call would put the
 * caller's h in local memory on every path. */
typedef struct vals8 {
    float v[8];
} vals8;

/*
 * Codes of 8 values when one is not finite, or s is outside the range of
 * mf_div_scale: rare (a divergent branch). A NaN's sign is the one the CPU
 * computes, recomputed from memory. Out of line: inlined, its loop made the
 * compiler evaluate the range test once per value on the hot path.
 */
static __device__ __noinline__ uint2 codes8_slow(act_opts o, int64_t c0, vals8 h, float s,
                                                 float y, int fp8)
{
    const int fast = mf_scale_fast_ok(s);
    uint32_t w[2] = {0u, 0u};
    for (int i = 0; i < 8; i++) {
        const float v = mf_is_nan(h.v[i]) ? h_exact(o, c0 + i) : h.v[i];
        w[i >> 2] |= code1(fp8, v, s, y, fast) << ((i & 3) * 8);
    }
    return make_uint2(w[0], w[1]);
}

/* Element index of group 0 of row (e, t) in the scales: the byte index for packed words. */
static __device__ __forceinline__ int64_t scale_base(const rows_params &p, int64_t e, int64_t t)
{
    if (p.layout == MF_LAYOUT_PACKED)
        return (e * p.ss0 + t) * 4;
    return e * p.ss0 + (p.layout == MF_LAYOUT_COL ? t : t * p.ss1);
}

/* Store the scale of group g of the row whose scale_base is base (byte g % 4 of a packed,
 * little-endian word). */
static __device__ __forceinline__ void put_scale_at(const rows_params &p, int64_t base, int64_t g,
                                                    float s, uint32_t ue)
{
    if (p.layout == MF_LAYOUT_PACKED) {
        p.sc[base + (g >> 2) * p.ss1 * 4 + (g & 3)] = (char)ue;
        return;
    }
    const int64_t i = base + (p.layout == MF_LAYOUT_COL ? g * p.ss1 : g);
    if (p.sc_f32)
        ((float *)p.sc)[i] = s;
    else
        ((uint8_t *)p.sc)[i] = (uint8_t)ue;
}

static __device__ __forceinline__ void put_scale(const rows_params &p, int64_t e, int64_t t,
                                                 int64_t g, float s, uint32_t ue)
{
    put_scale_at(p, scale_base(p, e, t), g, s, ue);
}


#endif /* MOEFUSE_CUDA_ROWS_QUANT_CUH */
