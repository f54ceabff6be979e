/*
 * Row operations of the CUDA backend: act_quant (2-D and 3-D masked), quant
 * and act_mul, bit for bit the CPU reference (src/cpu/rows.c): the same
 * activation text (src/numerics), fast paths proved equal to it.
 *
 * Work unit ("item"): one warp, one row, 1024 consecutive channels (staged
 * kernels) or 512 (direct kernels) in slots of 256; in a slot, lane l owns
 * channels [slot + 8l, slot + 8l + 8): one 16-byte load of gate and one of up
 * (bf16/f16; two each for f32). A quantization group of G channels is G/8
 * neighbouring lanes, reduced with __shfl_xor; codes leave as one 8-byte
 * store per lane and slot. Items are walked grid-stride over the flattened
 * valid rows, so the masked 3-D call costs sum(n[e]) rows whatever E * Tmax
 * is or however the tokens spread: each block turns the clamped counts into
 * row offsets in shared memory (never on the host) and finds an item's
 * expert by a search that starts from the warp's last expert.
 *
 * Kernels: the staged ones (x 16-byte aligned) copy each warp's next item to
 * shared memory while computing the current one (walk_staged): two bulk
 * copies (TMA) on an mbarrier for 2-byte x on sm_90, cp.async otherwise;
 * the direct ones (any alignment: narrower loads) load from memory
 * (walk_items). Each comes as "plain silu" (silu without clamp, factors or
 * rounding, or quant with no activation: every option a constant; bf16 also
 * a constant in the hottest one) and "any" (everything else). silu is
 * branch-free (table exp, division without nvcc's range check) for |g| < 64,
 * proved bit-equal to the reference path by src/cuda/tools/device_check.cu.
 * The table kernels (bf16 x, no options) also have a fast item for G = 128
 * and e4m3 (quant_item_fast: one scale computation per lane and item, the
 * rare cases sent back to the general item by a vote) and a fast act_mul
 * slot, and are launched with programmatic dependent launch.
 * G = H (other than 32/64/128) takes a block per row instead. Rows that are
 * zeroed rather than computed (zero_tail, and the padding rows of the
 * column-major and packed layouts) are a second kernel.
 */
#include "cuda/act_table.cuh"
#include "cuda/cuda_internal.h"
#include "cuda/numerics.cuh"
#include "cuda/pdl.cuh"
#include "cuda/vec.cuh"

#include <float.h>
#include <string.h>

#define MF_WARPS 8 /* warps per block */
#define MF_THREADS (MF_WARPS * 32)
/*
 * Blocks per SM asked of ptxas (__launch_bounds__), which caps registers:
 * the silu and quant kernels fit 80 registers without spilling at 3 (24
 * warps per SM); the gelu forms (double-precision erf/tanh) get 2.
 */
#ifndef MF_BLOCKS_PER_SM
#define MF_BLOCKS_PER_SM 3
#endif
#define MF_BLOCKS_ANY 2
/*
 * The table kernels run one block per SM (its activation table, 32 KiB, is
 * shared by all its warps): MF_TAB_WARPS warps, each with a ring of
 * MF_STAGES items of 4 KiB (bf16 gate and up). The table's halves lie 128 KiB
 * apart (act_table.cuh) with rings between them (by default 14 of 20, 6 after:
 * 192 KiB) under the 227 KiB of an H100 with room for the row offsets of 4096
 * experts.
 */
#ifndef MF_TAB_WARPS
#define MF_TAB_WARPS 20
#endif
#define MF_TAB_THREADS (MF_TAB_WARPS * 32)
#define MF_ITEM 512           /* channels of one warp item of the direct kernels */
#define MF_SMEM_EXPERTS 4096  /* row offsets of up to this many experts in shared memory */
#define MF_SMEM_BYTES (46 * 1024) /* dynamic shared memory without opt-in, some left static */
#define MF_FULL 0xFFFFFFFFu

typedef struct rows_params {
    const char *x;          /* x[e, t, c] at x + (e xs0 + t xs1 + c) * xes */
    int64_t xs0, xs1, xes;
    int64_t goff, uoff;     /* channel of gate value 0 / up value 0 inside a row */
    int64_t cstep;          /* channels between values i and i + 1: 2 interleaved (only the
                               direct kernels, which load by channel, take it), else 1 */
    const char *rs;         /* row_scale[e, t] f32, or NULL */
    int64_t rss0, rss1;
    const char *es;         /* expert_scale[e] f32/bf16, or NULL */
    int64_t ess0;
    const int32_t *counts;  /* [E] or NULL (2-D: all T rows valid, E = 1) */
    int64_t cs0;
    const int64_t *offs_g;  /* row offsets in global memory when E > MF_SMEM_EXPERTS */
    char *q;                /* codes (or act_mul's out): q + (e qs0 + t qs1 + c) * qes */
    int64_t qs0, qs1, qes;
    char *sc;               /* scales: f32, u8 or i32 words, strides in elements */
    int64_t ss0, ss1;
    int64_t E, T, H, Gn, Gw, chunks;
    int glog;               /* log2 G (G in 32, 64, 128), else 0 */
    int lpg;                /* lanes per group: G / 8 */
    float limit, eps, alpha, beta; /* alpha: silu_alpha's; beta: the up offset (0: none) */
    int xdt, qdt, esdt, act, activate, round_bf16, has_rs, has_es;
    int fp8, ue8m0, layout, sc_f32;
    int vec_x, vec_q;       /* 16-byte x loads / 8-byte (quant) or 16-byte (act_mul) stores */
    const float *atab;      /* the activation's table (act_table.cuh) for the table kernels */
} rows_params;

/* ------------------------------------------------------------- h values */

/* Factors of row (e, t): row_scale and expert_scale, 1 when absent. */
static __device__ __forceinline__ void row_factors(const rows_params &p, int64_t e, int64_t t,
                                                   float *rs, float *es)
{
    *rs = p.has_rs ? *(const float *)(p.rs + (e * p.rss0 + t * p.rss1) * 4) : 1.0f;
    *es = 1.0f;
    if (p.has_es) {
        const char *a = p.es + e * p.ess0 * (p.esdt == MF_DT_F32 ? 4 : 2);
        *es = p.esdt == MF_DT_F32 ? *(const float *)a : mf_bf16_to_f32(*(const uint16_t *)a);
    }
}

/*
 * h of 8 channels in place of g: the NUMERICS.md steps in the CPU's order,
 * with the GPU's NaN bits (a NaN result is redone by h_exact). Each option is
 * one uniform branch around a loop, so the 8 channels stay independent;
 * `plain` (a constant in the kernels for silu without options) drops them.
 */
/* silu of the inputs the fast path does not take: out of line, so the compiler shares (and
 * keeps in registers) nothing between the two paths. */
static __device__ __noinline__ float silu_slow(float g)
{
    return mf_silu_formula(g);
}

static __device__ __forceinline__ void act8(const rows_params &p, int act, int plain,
                                            const float *tab, float g[8], float u[8], float rs,
                                            float es)
{
    if (!plain && p.limit > 0.0f) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            g[i] = mf_clamp_gate(g[i], p.limit);
            u[i] = mf_clamp_up(u[i], p.limit);
        }
    }
    if (!plain && p.beta != 0.0f) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            u[i] = mf_add_up_offset(u[i], p.beta);
    }
    if (act == MF_ACT_SILU) {
        /* branch-free for |g| < 64; the others (rare) take the reference path afterwards */
        const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(tab);
        float r[8];
        int ok = 1;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            ok &= mf_silu_fast_ok(g[i]);
            r[i] = mf_silu_fast(g[i], tabs);
        }
        if (!ok) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (!mf_silu_fast_ok(g[i]))
                    r[i] = silu_slow(g[i]);
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = r[i];
    } else if (act == MF_ACT_GELU) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_gelu_formula(g[i]);
    } else if (act == MF_ACT_SILU_ALPHA) { /* (a NaN h is redone by h_exact) */
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_silu_alpha_formula(g[i], p.alpha);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_gelu_tanh_formula(g[i]);
    }
    if (!plain && p.round_bf16) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_round_bf16(g[i]);
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        g[i] = g[i] * u[i];
    if (!plain && p.has_rs) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = g[i] * rs;
    }
    if (!plain && p.has_es) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = g[i] * es;
    }
    if (!plain && p.round_bf16) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = mf_round_bf16(g[i]);
    }
}

/* What h_exact needs, passed by value: a reference to the kernel's parameters would put them
 * in local memory (a stack frame) for the out-of-line call. */
typedef struct act_opts {
    const char *xrow;
    int64_t goff, uoff, cstep;
    float limit, rs, es, alpha, beta;
    int xdt, act, activate, round_bf16, has_rs, has_es;
} act_opts;

static __device__ __forceinline__ act_opts make_opts(const rows_params &p, const char *xrow,
                                                     float rs, float es)
{
    act_opts o;
    o.xrow = xrow;
    o.goff = p.goff;
    o.uoff = p.uoff;
    o.cstep = p.cstep;
    o.limit = p.limit;
    o.alpha = p.alpha;
    o.beta = p.beta;
    o.rs = rs;
    o.es = es;
    o.xdt = p.xdt;
    o.act = p.act;
    o.activate = p.activate;
    o.round_bf16 = p.round_bf16;
    o.has_rs = p.has_rs;
    o.has_es = p.has_es;
    return o;
}

/* h of channel c with the CPU's (x86) NaN bits, from memory: the rare NaN path. */
static __device__ __noinline__ float h_exact(act_opts o, int64_t c)
{
    if (!o.activate)
        return load_elem(o.xrow, c, o.xdt);
    float g = load_elem(o.xrow, o.goff + c * o.cstep, o.xdt);
    float u = load_elem(o.xrow, o.uoff + c * o.cstep, o.xdt);
    if (o.limit > 0.0f) {
        g = mf_clamp_gate(g, o.limit);
        u = mf_clamp_up(u, o.limit);
    }
    u = mf_add_up_offset(u, o.beta);
    float a = mf_activate_f32(o.act, o.alpha, g);
    if (o.round_bf16)
        a = mf_round_bf16(a);
    float h = mf_mul(a, u);
    if (o.has_rs)
        h = mf_mul(h, o.rs);
    if (o.has_es)
        h = mf_mul(h, o.es);
    if (o.round_bf16)
        h = mf_round_bf16(h);
    return h;
}

/* h of one channel (the block-per-row kernel): fast path, exact NaN bits. */
static __device__ __forceinline__ float h_one(const rows_params &p, const float *tab,
                                              const char *xrow, int64_t c, float rs, float es)
{
    float v[8], u[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = u[i] = 0.0f;
    if (!p.activate) {
        v[0] = load_elem(xrow, c, p.xdt);
        return v[0];
    }
    v[0] = load_elem(xrow, p.goff + c * p.cstep, p.xdt);
    u[0] = load_elem(xrow, p.uoff + c * p.cstep, p.xdt);
    act8(p, p.act, 0, tab, v, u, rs, es); /* the other 7 lanes of the arrays are dead code */
    return mf_is_nan(v[0]) ? h_exact(make_opts(p, xrow, rs, es), c) : v[0];
}

/*
 * Gate (off = goff) or up (off = uoff) values c0 .. c0 + n - 1 of a row, for the direct
 * kernels: load8's vectors for consecutive values, one element at a time for the interleaved
 * order's every second channel (a uniform branch).
 */
static __device__ __forceinline__ void load8_values(const rows_params &p, const char *xrow,
                                                    int64_t off, int64_t c0, int xdt, int n,
                                                    float v[8])
{
    if (p.cstep == 1) {
        load8(xrow + off * p.xes, c0, xdt, p.vec_x, n, v);
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = i < n ? load_elem(xrow, off + (c0 + i) * p.cstep, xdt) : 0.0f;
}

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

/* Two f8 codes (lo in the low byte) of finite values: RNE with saturation to 448. */
static __device__ __forceinline__ uint32_t e4m3x2(float lo, float hi)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r; /* the hardware conversion: the same bits for every finite input */
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return mf_f32_to_e4m3(lo) | (mf_f32_to_e4m3(hi) << 8);
#endif
}

/* An i8 code of a non-NaN value: half to even, clamped to [-127, 127] (= mf_f32_to_i8). */
static __device__ __forceinline__ uint32_t i8code(float d)
{
    const float c = fminf(fmaxf(d, -127.0f), 127.0f);
    return (uint32_t)__float2int_rn(c) & 0xFFu;
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
    if (fp8) {
        w[0] = e4m3x2(d[0], d[1]) | (e4m3x2(d[2], d[3]) << 16);
        w[1] = e4m3x2(d[4], d[5]) | (e4m3x2(d[6], d[7]) << 16);
    } else {
        w[0] = i8code(d[0]) | (i8code(d[1]) << 8) | (i8code(d[2]) << 16) | (i8code(d[3]) << 24);
        w[1] = i8code(d[4]) | (i8code(d[5]) << 8) | (i8code(d[6]) << 16) | (i8code(d[7]) << 24);
    }
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
    if (fp8) {
        w[0] = e4m3x2(d[0], d[1]) | (e4m3x2(d[2], d[3]) << 16);
        w[1] = e4m3x2(d[4], d[5]) | (e4m3x2(d[6], d[7]) << 16);
    } else {
        w[0] = i8code(d[0]) | (i8code(d[1]) << 8) | (i8code(d[2]) << 16) | (i8code(d[3]) << 24);
        w[1] = i8code(d[4]) | (i8code(d[5]) << 8) | (i8code(d[6]) << 16) | (i8code(d[7]) << 24);
    }
}

/* Code of one value of h: NaN (with the CPU's bits), +-Inf, finite with either division. */
static __device__ __forceinline__ uint32_t code1(int fp8, float v, float s, float y, int fast)
{
    if (mf_is_nan(v))
        return fp8 ? (((mf_f32_bits(v) >> 24) & 0x80u) | 0x7Fu) : 0u;
    const float q = fast ? mf_div_scale(v, s, y) : v / s;
    const float d = mf_is_finite(v) ? q : copysignf(448.0f, v); /* Inf: +-448 or +-127 */
    return fp8 ? (e4m3x2(d, 0.0f) & 0xFFu) : i8code(d);
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

/* ------------------------------------------------------------- staging */

/*
 * The staged kernels copy items to shared memory with cp.async (16-byte
 * copies that hold no registers while in flight): a ring of MF_STAGES items
 * per warp, so the loads of the next item overlap the arithmetic of this
 * one, and the item is read back one 256-channel slot at a time (few live
 * registers, so items can be 1024 channels: less per-item overhead). Each
 * lane copies and later reads only its own 16-byte chunks, so it needs
 * cp.async.wait_group and no barrier. Chunk (half hh, slot k, part j) of
 * lane l sits at 16 * (hh * slots * parts * 32 + (k * parts + j) * 32 + l);
 * parts = 2 for f32 (8 channels = 32 bytes), 1 for bf16/f16.
 */
#ifndef MF_STAGES
#define MF_STAGES 2
#endif
#ifndef MF_ST_SLOTS
#define MF_ST_SLOTS 4 /* slots of 256 channels in a staged item */
#endif
#define MF_ST_ITEM (MF_ST_SLOTS * 256)

static __device__ __forceinline__ void cp_async16(void *dst, const void *src)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

static __device__ __forceinline__ void cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Wait until at most MF_STAGES - 1 groups (the newer items) are in flight. */
static __device__ __forceinline__ void cp_async_wait_oldest(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(MF_STAGES - 1) : "memory");
}

/*
 * The sm_90 staging of 2-byte x (bf16/f16, whose staged layout is the row's
 * own: slot k, lane l at byte 16 (32 k + l)): one lane copies the item's gate
 * and up ranges with two bulk copies (cp.async.bulk, the TMA engine) that
 * complete on an mbarrier per ring slot, instead of every lane issuing
 * 16-byte cp.async copies and computing their addresses: a handful of
 * instructions per item where the per-lane copies cost ~5 per channel.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MF_BULK 1
#else
#define MF_BULK 0
#endif

static __device__ __forceinline__ void mbar_init(uint64_t *bar)
{
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(a) : "memory");
}

static __device__ __forceinline__ void mbar_init_fence(void)
{
#if MF_BULK
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

/* Lane 0: the item's bytes (gate, then up when activate) to stage, completing on bar. */
static __device__ __forceinline__ void bulk_fetch(char *stage, uint64_t *bar, const char *g,
                                                  const char *u, unsigned bytes, int activate)
{
#if MF_BULK
    const unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    const unsigned d = (unsigned)__cvta_generic_to_shared(stage);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b),
                 "r"(activate ? 2 * bytes : bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];\n" ::"r"(d),
                 "l"(g), "r"(bytes), "r"(b)
                 : "memory");
    if (activate)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                     "[%1], %2, [%3];\n" ::"r"(d + MF_ST_SLOTS * 32 * 16),
                     "l"(u), "r"(bytes), "r"(b)
                     : "memory");
#else
    (void)stage, (void)bar, (void)g, (void)u, (void)bytes, (void)activate;
#endif
}

/* Every lane: wait until the bulk copies of the slot's phase have landed. */
static __device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned phase)
{
#if MF_BULK
    const unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n"
                 "}\n" ::"r"(b),
                 "r"(phase)
                 : "memory");
#else
    (void)bar, (void)phase;
#endif
}

/* Bytes of one staged item of one warp. */
static __host__ __device__ __forceinline__ int64_t stage_bytes(int64_t xes, int activate)
{
    return (activate ? 2 : 1) * MF_ST_SLOTS * (xes / 2) * 32 * 16;
}

static __device__ __forceinline__ void stage_fetch(const rows_params &p, int xdt, char *stage,
                                                   const char *xrow, int64_t ch, int lane)
{
    const int parts = xdt == MF_DT_F32 ? 2 : 1;
    const int64_t xes = xdt == MF_DT_F32 ? 4 : 2;
    const int half = MF_ST_SLOTS * parts * 32 * 16;
    const char *g = xrow + p.goff * xes, *u = xrow + p.uoff * xes;
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        const int64_t c0 = ch * MF_ST_ITEM + k * 256 + lane * 8;
        if (c0 >= p.H)
            break;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (j < parts) {
                char *d = stage + ((k * parts + j) * 32 + lane) * 16;
                cp_async16(d, g + c0 * xes + j * 16);
                if (p.activate)
                    cp_async16(d + half, u + c0 * xes + j * 16);
            }
        }
    }
}

/* The 8 values of (slot k, half hh) of a staged item; zeros past the row (n = 0). */
static __device__ __forceinline__ void stage_read8(const char *stage, int xdt, int activate,
                                                   int k, int hh, int n, int lane, float v[8])
{
    (void)activate;
    if (n == 0) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[i] = 0.0f;
        return;
    }
    if (xdt == MF_DT_F32) {
        const float4 *c = (const float4 *)stage + hh * MF_ST_SLOTS * 2 * 32 + k * 2 * 32 + lane;
        const float4 a = c[0], b = c[32];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
        const uint4 w = ((const uint4 *)stage)[hh * MF_ST_SLOTS * 32 + k * 32 + lane];
        unpack16(w.x, xdt, &v[0], &v[1]);
        unpack16(w.y, xdt, &v[2], &v[3]);
        unpack16(w.z, xdt, &v[4], &v[5]);
        unpack16(w.w, xdt, &v[6], &v[7]);
    }
}

/* max(a, b), NaN when either is NaN (one instruction from sm_80 on). */
static __device__ __forceinline__ float max_keep_nan(float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return (mf_is_nan(a) || mf_is_nan(b)) ? a + b : fmaxf(a, b);
#endif
}

/*
 * One slot of a quantizing item: h of 8 channels per lane from c0 (n = 8 or 0 past the row).
 * lpg: lanes per group (uniform; a constant in the hot kernels). The group's scale comes back
 * in *s_out / *ue_out (every lane of the group has it); store_item_scales writes it.
 */
static __device__ __forceinline__ void quant_slot(const rows_params &p, int lpg,
                                                  const char *xrow, char *qrow, float rs,
                                                  float es, int64_t c0, int n, const float h[8],
                                                  float *s_out, uint32_t *ue_out)
{
    /*
     * amax over the lane's finite values, then over its group's lanes. The fast
     * test: a maximum that keeps NaN is finite exactly when every h is; only
     * then is the finite filter skipped.
     */
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++)
        m = max_keep_nan(m, fabsf(h[i]));
    const int special = !mf_is_finite(m);
    if (special) {
        m = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++)
            m = mf_is_finite(h[i]) ? fmaxf(m, fabsf(h[i])) : m;
    }
#pragma unroll
    for (int off = 1; off < 16; off <<= 1) /* every lane takes part (lpg is uniform) */
        if (off < lpg)
            m = fmaxf(m, __shfl_xor_sync(MF_FULL, m, off));
    uint32_t ue;
    const float s = group_scale(p, m, &ue);
    *s_out = s;
    *ue_out = ue;
    if (n == 0)
        return;
    const int fast = mf_scale_fast_ok(s);
    uint32_t w[2];
    if (!special && fast && p.ue8m0) {
        /* s = 2^(ue - 127) with ue in [67, 187] here: 1/s is 2^(127 - ue), exact and normal */
        codes8_pow2(p.fp8, h, mf_bits_f32((254u - ue) << 23), w);
    } else {
        const float y = fast ? mf_div_fast(1.0f, s) : 1.0f / s;
        if (!special && fast) {
            codes8(p.fp8, h, s, y, w);
        } else {
            vals8 hv;
#pragma unroll
            for (int i = 0; i < 8; i++)
                hv.v[i] = h[i];
            const uint2 c = codes8_slow(make_opts(p, xrow, rs, es), c0, hv, s, y, p.fp8);
            w[0] = c.x;
            w[1] = c.y;
        }
    }
    if (p.vec_q) {
        *(uint2 *)(qrow + c0) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            qrow[c0 + i] = (char)(w[i >> 2] >> ((i & 3) * 8));
    }
}

/*
 * The scales of an item of S slots, written once per item rather than once per slot (the
 * address arithmetic would cost a whole slot's worth of instructions each time): slot k left
 * group k * gps + j (gps = 32 / lpg groups per slot) in the lanes of j; lane i gathers group
 * i by one shuffle per slot and writes it. Groups past the row are skipped, but for the
 * unused bytes of the row's last packed word, which are written as 0.
 */
template <int S>
static __device__ __forceinline__ void store_item_scales(const rows_params &p, int lpg,
                                                         int64_t sbase, int64_t g0,
                                                         const float s[S], const uint32_t ue[S],
                                                         int lane)
{
    const int gps = 32 / lpg;
    const int src = (lane % gps) * lpg, slot = lane / gps;
    float sv = 0.0f;
    uint32_t uv = 0u;
#pragma unroll
    for (int k = 0; k < S; k++) {
        const float a = __shfl_sync(MF_FULL, s[k], src);
        const uint32_t b = p.ue8m0 ? __shfl_sync(MF_FULL, ue[k], src) : 0u;
        sv = k == slot ? a : sv;
        uv = k == slot ? b : uv;
    }
    const int64_t g = g0 + lane;
    if (slot >= S)
        return;
    if (g < p.Gn)
        put_scale_at(p, sbase, g, sv, uv);
    else if (p.layout == MF_LAYOUT_PACKED && g < p.Gw * 4)
        put_scale_at(p, sbase, g, 0.0f, 0u);
}

/* One warp item of the quantizing ops, from memory: row (e, t), 512 channels from ch * 512. */
static __device__ __forceinline__ void quant_item(const rows_params &p, int xdt, int act,
                                                  int plain, const float *tab, int64_t e,
                                                  int64_t t, int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *qrow = p.q + e * p.qs0 + t * p.qs1;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
    float h[2][8], u[2][8];
    int64_t c0[2];
    int n[2];
    /* every load of the item first: 2 KiB (bf16) in flight per warp */
#pragma unroll
    for (int k = 0; k < 2; k++) {
        c0[k] = ch * MF_ITEM + k * 256 + lane * 8;
        n[k] = c0[k] < p.H ? 8 : 0; /* H is a multiple of 32 here: all 8 or none */
        load8_values(p, xrow, p.goff, c0[k], xdt, n[k], h[k]);
        if (p.activate)
            load8_values(p, xrow, p.uoff, c0[k], xdt, n[k], u[k]);
    }
    float sc[2];
    uint32_t ue[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        if (p.activate)
            act8(p, act, plain, tab, h[k], u[k], rs, es);
        quant_slot(p, p.lpg, xrow, qrow, rs, es, c0[k], n[k], h[k], &sc[k], &ue[k]);
    }
    store_item_scales<2>(p, p.lpg, scale_base(p, e, t), (ch * MF_ITEM) >> p.glog, sc, ue, lane);
}

/*
 * act(g) * u of 8 channels computed for gates the table does not cover (zero, tiny, huge,
 * Inf, NaN: rare), with no options. Out of line, so the hot loop keeps none of its registers;
 * a NaN result is redone with the CPU's bits later, as on the computed path. (An activation
 * with a table takes no alpha.)
 */
static __device__ __noinline__ vals8 act8_missed(int act, vals8 g, vals8 u)
{
    vals8 h;
    for (int i = 0; i < 8; i++)
        h.v[i] = mf_activate_f32(act, 0.0f, g.v[i]) * u.v[i];
    return h;
}

/*
 * h of slot k of a staged item: 8 channels, or zeros past the row (n = 0). In the table
 * kernels (atab: bf16 x, no options) act(g) comes from the table, else from act8.
 */
static __device__ __forceinline__ void staged_h(const rows_params &p, int xdt, int act, int plain,
                                                const float *tab, const char *atab,
                                                const char *stage, int k, int n, int lane,
                                                float rs, float es, float h[8])
{
    if (!p.activate || n == 0) {
        stage_read8(stage, xdt, p.activate, k, 0, n, lane, h);
        return;
    }
    float u[8];
    stage_read8(stage, xdt, 1, k, 1, n, lane, u);
    if (atab) { /* a constant: NULL except in the table kernels */
        const uint4 w = ((const uint4 *)stage)[k * 32 + lane]; /* the gate half, bf16 */
        const uint32_t gw[4] = {w.x, w.y, w.z, w.w};
        if (mf_act8_table(atab, gw, u, h))
            return;
        vals8 gv, uv;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            gv.v[i] = mf_bits_f32(i & 1 ? gw[i >> 1] & 0xFFFF0000u : gw[i >> 1] << 16);
            uv.v[i] = u[i];
        }
        const vals8 hv = act8_missed(act, gv, uv);
#pragma unroll
        for (int i = 0; i < 8; i++)
            h[i] = hv.v[i];
        return;
    }
    stage_read8(stage, xdt, 1, k, 0, n, lane, h);
    act8(p, act, plain, tab, h, u, rs, es);
}

/* The same from a staged item (MF_ST_SLOTS slots of 256 channels), slot by slot. */
static __device__ __forceinline__ void quant_item_st(const rows_params &p, int xdt, int act,
                                                     int plain, int lpgc, const float *tab,
                                                     const char *atab, const char *stage,
                                                     int64_t e, int64_t t, int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *qrow = p.q + e * p.qs0 + t * p.qs1;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
    const int lpg = lpgc ? lpgc : p.lpg;
    float sc[MF_ST_SLOTS];
    uint32_t ue[MF_ST_SLOTS];
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        const int64_t c0 = ch * MF_ST_ITEM + k * 256 + lane * 8;
        const int n = c0 < p.H ? 8 : 0;
        float h[8];
        staged_h(p, xdt, act, plain, tab, atab, stage, k, n, lane, rs, es, h);
        quant_slot(p, lpg, xrow, qrow, rs, es, c0, n, h, &sc[k], &ue[k]);
    }
    store_item_scales<MF_ST_SLOTS>(p, lpg, scale_base(p, e, t), (ch * MF_ST_ITEM) >> p.glog, sc,
                                   ue, lane);
}

/*
 * The table kernels' item for G = 128 and e4m3 codes, of nv whole slots (4 but in a row's
 * last item; nv is not a template argument, since a second instance made ptxas spill): the
 * h of every slot first (act(g) from the table when ACT, else x itself), then the amax of
 * the item's groups by one transposing reduction (lane l ends with the
 * group of slot l & 3 in its half of the warp: 14 instructions where four separate
 * reductions take 32), one scale per lane instead of one per slot, the codes slot by slot.
 * Returns 0, having written nothing, when the item needs quant_item_st: a gate outside the
 * table, an h that is not finite, a scale outside the fast division's range (a uniform
 * vote each). The same bits as quant_item_st: the same h, an amax of the same values (a
 * maximum of finite values in any order), group_scale, and codes8 / codes8_pow2.
 */
template <int ACT>
static __device__ __forceinline__ int quant_item_fast(const rows_params &p, const char *atab,
                                                      const char *stage, int64_t e, int64_t t,
                                                      int64_t ch, int nv, int lane)
{
    static_assert(MF_ST_SLOTS == 4, "the transposing reduction takes four slots");
    float h[MF_ST_SLOTS][8], m[MF_ST_SLOTS];
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        m[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++)
            h[k][i] = 0.0f;
        if (k >= nv) /* past the row: a group of zeros, never stored */
            continue;
        const uint4 gv = ((const uint4 *)stage)[k * 32 + lane];
        const uint32_t g[4] = {gv.x, gv.y, gv.z, gv.w};
        if (ACT) {
            const uint4 uv = ((const uint4 *)stage)[(MF_ST_SLOTS + k) * 32 + lane];
            const uint32_t u[4] = {uv.x, uv.y, uv.z, uv.w};
            uint32_t off[8];
            if (__any_sync(MF_FULL, mf_tab_offsets8(g, off))) /* before any read of the table */
                return 0;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                h[k][2 * i] = *(const float *)(atab + off[2 * i]) * mf_bits_f32(u[i] << 16);
                h[k][2 * i + 1] =
                    *(const float *)(atab + off[2 * i + 1]) * mf_bits_f32(u[i] & 0xFFFF0000u);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                h[k][2 * i] = mf_bits_f32(g[i] << 16);
                h[k][2 * i + 1] = mf_bits_f32(g[i] & 0xFFFF0000u);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            m[k] = max_keep_nan(m[k], fabsf(h[k][i]));
    }
    const float all = max_keep_nan(max_keep_nan(m[0], m[1]), max_keep_nan(m[2], m[3]));
    if (__any_sync(MF_FULL, !(all <= FLT_MAX))) /* an Inf or a NaN */
        return 0;
    /* pairs of slots over lanes l, l ^ 1, then pairs of pairs over l, l ^ 2: each lane keeps
     * the half its partner sends it the other of */
    const int odd = lane & 1, two = lane & 2;
    const float s01 = odd ? m[0] : m[1], k01 = odd ? m[1] : m[0];
    const float s23 = odd ? m[2] : m[3], k23 = odd ? m[3] : m[2];
    const float r01 = fmaxf(k01, __shfl_xor_sync(MF_FULL, s01, 1)); /* slot odd */
    const float r23 = fmaxf(k23, __shfl_xor_sync(MF_FULL, s23, 1)); /* slot 2 + odd */
    float amax = fmaxf(two ? r23 : r01, __shfl_xor_sync(MF_FULL, two ? r01 : r23, 2));
    amax = fmaxf(amax, __shfl_xor_sync(MF_FULL, amax, 4));
    amax = fmaxf(amax, __shfl_xor_sync(MF_FULL, amax, 8)); /* slot lane & 3, group lane >> 4 */
    const int mine = (lane & 3) < nv; /* a group of the row */
    uint32_t ue;
    const float s = group_scale(p, amax, &ue);
    if (__any_sync(MF_FULL, mine && !mf_scale_fast_ok(s)))
        return 0;
    /* ue8m0: s = 2^(ue - 127), ue in [67, 187] here, so 1/s = 2^(127 - ue) is exact */
    const float y = p.ue8m0 ? mf_bits_f32((254u - ue) << 23) : mf_div_fast(1.0f, s);
    if ((lane & 12) == 0) {
        const int64_t g = ((ch * MF_ST_ITEM) >> 7) + 2 * (lane & 3) + (lane >> 4);
        if (mine)
            put_scale_at(p, scale_base(p, e, t), g, s, ue);
        else if (p.layout == MF_LAYOUT_PACKED && g < p.Gw * 4) /* the last word's unused bytes */
            put_scale_at(p, scale_base(p, e, t), g, 0.0f, 0u);
    }
    char *q = p.q + e * p.qs0 + t * p.qs1 + ch * MF_ST_ITEM + lane * 8;
    uint32_t w[MF_ST_SLOTS][2];
    if (p.ue8m0) {
#pragma unroll
        for (int k = 0; k < MF_ST_SLOTS; k++)
            codes8_pow2(1, h[k], __shfl_sync(MF_FULL, y, (lane & 16) | k), w[k]);
    } else {
#pragma unroll
        for (int k = 0; k < MF_ST_SLOTS; k++) {
            const int src = (lane & 16) | k;
            codes8(1, h[k], __shfl_sync(MF_FULL, s, src), __shfl_sync(MF_FULL, y, src), w[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++)
        if (k < nv)
            *(uint2 *)(q + k * 256) = make_uint2(w[k][0], w[k][1]);
    return 1;
}

/* One slot of act_mul: h of n (<= 8) channels from c0 (in g), rounded to out's (x's) dtype;
 * a NaN is redone with the CPU's bits. */
static __device__ __forceinline__ void mul_store(const rows_params &p, int xdt, const char *xrow,
                                                 char *orow, float rs, float es, int64_t c0,
                                                 int n, float g[8])
{
    if (n == 0)
        return;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (mf_is_nan(g[i]) && i < n)
            g[i] = h_exact(make_opts(p, xrow, rs, es), c0 + i);
    store8(orow, c0, xdt, p.vec_q, n, g);
}

/* One warp item of act_mul, from memory: 512 channels from ch * 512 (H may be odd). */
static __device__ __forceinline__ void mul_item(const rows_params &p, int xdt, int act,
                                                int plain, const float *tab, int64_t e,
                                                int64_t t, int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *orow = p.q + (e * p.qs0 + t * p.qs1) * p.qes;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
    float g[2][8], u[2][8];
    int64_t c0[2];
    int n[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        c0[k] = ch * MF_ITEM + k * 256 + lane * 8;
        const int64_t left = p.H - c0[k]; /* the last vector of an odd row is partial */
        n[k] = left >= 8 ? 8 : (left > 0 ? (int)left : 0);
        load8_values(p, xrow, p.goff, c0[k], xdt, n[k], g[k]);
        load8_values(p, xrow, p.uoff, c0[k], xdt, n[k], u[k]);
    }
#pragma unroll
    for (int k = 0; k < 2; k++) {
        if (n[k] == 0)
            continue;
        act8(p, act, plain, tab, g[k], u[k], rs, es);
        mul_store(p, xdt, xrow, orow, rs, es, c0[k], n[k], g[k]);
    }
}

/*
 * Slot k of a table kernel's act_mul (bf16 x and out, no options, 16-byte stores): act(g)
 * from the table times u, rounded by the hardware conversion. Returns 0, having written
 * nothing, when the slot needs staged_h and mul_store: a gate outside the table, or a NaN
 * (whose bits the reference chooses). A uniform vote each.
 */
static __device__ __forceinline__ int mul_slot_fast(const char *atab, const char *stage, int k,
                                                    int lane, char *out)
{
    const uint4 gv = ((const uint4 *)stage)[k * 32 + lane];
    const uint4 uv = ((const uint4 *)stage)[(MF_ST_SLOTS + k) * 32 + lane];
    const uint32_t g[4] = {gv.x, gv.y, gv.z, gv.w}, u[4] = {uv.x, uv.y, uv.z, uv.w};
    uint32_t off[8];
    if (__any_sync(MF_FULL, mf_tab_offsets8(g, off))) /* before any read of the table */
        return 0;
    float h[8], any = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        h[2 * i] = *(const float *)(atab + off[2 * i]) * mf_bits_f32(u[i] << 16);
        h[2 * i + 1] = *(const float *)(atab + off[2 * i + 1]) * mf_bits_f32(u[i] & 0xFFFF0000u);
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        any = max_keep_nan(any, h[i]);
    if (__any_sync(MF_FULL, mf_is_nan(any)))
        return 0;
    *(uint4 *)out = make_uint4(mf_bf16x2_rn(h[0], h[1]), mf_bf16x2_rn(h[2], h[3]),
                               mf_bf16x2_rn(h[4], h[5]), mf_bf16x2_rn(h[6], h[7]));
    return 1;
}

/* The same from a staged item (H is a multiple of 8 there: n is 8 or 0). */
static __device__ __forceinline__ void mul_item_st(const rows_params &p, int xdt, int act,
                                                   int plain, const float *tab, const char *atab,
                                                   const char *stage, int64_t e, int64_t t,
                                                   int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *orow = p.q + (e * p.qs0 + t * p.qs1) * p.qes;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        const int64_t c0 = ch * MF_ST_ITEM + k * 256 + lane * 8;
        const int n = c0 < p.H ? 8 : 0;
        /* the vote sends a slot that runs partly past the row to the general path */
        if (atab && p.vec_q && __all_sync(MF_FULL, n == 8) &&
            mul_slot_fast(atab, stage, k, lane, orow + c0 * 2))
            continue;
        float h[8];
        staged_h(p, xdt, act, plain, tab, atab, stage, k, n, lane, rs, es, h);
        mul_store(p, xdt, xrow, orow, rs, es, c0, n, h);
    }
}

/* ------------------------------------------------------------ row walk */

/*
 * Clamped counts -> offs[0..E] (offs[0] = 0), by the whole block in chunks of
 * blockDim.x experts: warp scans by shuffles, then the warp totals. Every
 * thread must call it; offs is complete for every thread on return.
 */
static __device__ void block_prefix(const int32_t *counts, int64_t cs0, int64_t E, int64_t T,
                                    int64_t *offs)
{
    __shared__ int64_t wsum[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    if (tid == 0)
        offs[0] = 0;
    int64_t carry = 0;
    for (int64_t base = 0; base < E; base += blockDim.x) {
        const int64_t e = base + tid;
        int64_t v = 0;
        if (e < E) {
            const int64_t c = counts[e * cs0]; /* device data: never trusted */
            v = c < 0 ? 0 : (c > T ? T : c);
        }
        for (int off = 1; off < 32; off <<= 1) {
            const int64_t o = __shfl_up_sync(MF_FULL, v, off);
            if (lane >= off)
                v += o;
        }
        if (lane == 31)
            wsum[warp] = v;
        __syncthreads();
        int64_t before = 0, total = 0;
        for (int w = 0; w < nw; w++) {
            const int64_t sw = wsum[w];
            before += w < warp ? sw : 0;
            total += sw;
        }
        if (e < E)
            offs[e + 1] = carry + before + v;
        carry += total;
        __syncthreads(); /* wsum is rewritten by the next chunk */
    }
    __syncthreads(); /* offs[0] when E = 0 */
}

/* Expert of flattened valid row `row`: the last e with offs[e] <= row (skips empty experts). */
static __device__ __forceinline__ int64_t find_expert(const int64_t *offs, int64_t E, int64_t row)
{
    int64_t lo = 0, hi = E - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) >> 1;
        if (offs[mid] <= row)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/*
 * The same knowing the answer is at least lo (a warp's rows only grow), by the whole warp
 * (every lane calls it): the lanes test the next 32 experts at once, and since offs only
 * grows, the experts at or below the row are a prefix of them. One step unless the row
 * moved past 32 experts.
 */
static __device__ __forceinline__ int64_t find_expert_warp(const int64_t *offs, int64_t E,
                                                           int64_t row, int64_t lo, int lane)
{
    for (;;) {
        const int64_t j = lo + 1 + lane;
        const unsigned below = __ballot_sync(MF_FULL, j < E && offs[j] <= row);
        lo += __popc(below);
        if (below != MF_FULL)
            return lo;
    }
}

/* Row offsets (shared memory, global memory, or none for the 2-D form); returns the valid rows. */
static __device__ __forceinline__ int64_t setup_rows(const rows_params &p, int64_t *smem,
                                                     const int64_t **offs)
{
    if (!p.counts) {
        *offs = NULL;
        return p.T;
    }
    if (p.offs_g) {
        *offs = p.offs_g;
        return p.offs_g[p.E];
    }
    block_prefix(p.counts, p.cs0, p.E, p.T, smem);
    *offs = smem;
    return smem[p.E];
}

enum { MODE_QUANT, MODE_MUL };

/* 2^(j/32) for mf_exp_tab_fast, copied to shared memory by every block (lanes index it freely). */
__constant__ float mf_c_exp2_tab[64] = MF_EXP_TABLE_INIT;

static __device__ __forceinline__ void load_exp_table(float *tab)
{
    if (threadIdx.x < 64)
        tab[threadIdx.x] = mf_c_exp2_tab[threadIdx.x];
    __syncthreads();
}

/*
 * Grid-stride walk of the warps over the items (row, chunk), chunk fastest:
 * neighbouring warps read neighbouring memory. The item index is advanced
 * without a division per step.
 */
static __device__ __forceinline__ void walk_items(const rows_params &p, int mode, int xdt,
                                                  int act, int plain)
{
    extern __shared__ int64_t mf_smem[];
    __shared__ float tab[64];
    load_exp_table(tab);
    const int64_t *offs;
    const int64_t rows = setup_rows(p, mf_smem, &offs);
    const int lane = threadIdx.x & 31;
    const int64_t W = (int64_t)gridDim.x * MF_WARPS;
    const int64_t it = (int64_t)blockIdx.x * MF_WARPS + (threadIdx.x >> 5);
    int64_t row = it / p.chunks, ch = it % p.chunks;
    const int64_t Wq = W / p.chunks, Wr = W % p.chunks;
    while (row < rows) {
        int64_t e = 0, t = row;
        if (offs) {
            e = find_expert(offs, p.E, row);
            t = row - offs[e];
        }
        if (mode == MODE_QUANT)
            quant_item(p, xdt, act, plain, tab, e, t, ch, lane);
        else
            mul_item(p, xdt, act, plain, tab, e, t, ch, lane);
        ch += Wr;
        row += Wq;
        if (ch >= p.chunks) {
            ch -= p.chunks;
            row++;
        }
    }
}

/* Item iterator of a warp: (row, chunk), advanced by the grid's warp count. */
typedef struct item_it {
    int64_t row, ch;
} item_it;

static __device__ __forceinline__ void it_next(const rows_params &p, item_it *i, int64_t Wq,
                                               int64_t Wr)
{
    i->ch += Wr;
    i->row += Wq;
    if (i->ch >= p.chunks) {
        i->ch -= p.chunks;
        i->row++;
    }
}

/* Stage item (row xrow, chunk ch): bulk copies by lane 0, or 16-byte cp.async by every lane. */
static __device__ __forceinline__ void fetch_item(const rows_params &p, int xdt, int bulk,
                                                  char *stage, uint64_t *bar, const char *xrow,
                                                  int64_t ch, int lane)
{
    if (!bulk) {
        stage_fetch(p, xdt, stage, xrow, ch, lane);
        return;
    }
    __syncwarp(); /* every lane has read what this slot held before */
    if (lane == 0) {
        const int64_t c0 = ch * MF_ST_ITEM;
        const int64_t n = p.H - c0 < MF_ST_ITEM ? p.H - c0 : MF_ST_ITEM;
        bulk_fetch(stage, bar, xrow + (p.goff + c0) * 2, xrow + (p.uoff + c0) * 2,
                   (unsigned)(n * 2), p.activate);
    }
}

/*
 * Dynamic shared memory of the staged kernels: each warp's ring of MF_STAGES items of sb
 * bytes, then the row offsets (masked calls, E small). With an activation table (TABLE:
 * the table kernels when they activate) the table's halves sit at 0 and MF_TAB_NEG
 * (act_table.cuh), the rings of the first warps between them, the others after.
 */
static __host__ __device__ __forceinline__ int64_t ring_offset(int64_t sb, int table, int warp)
{
    const int64_t rb = MF_STAGES * sb;
    if (!table)
        return warp * rb;
    const int64_t fit = (MF_TAB_NEG - MF_TAB_SPAN * 4) / rb; /* rings between the halves */
    return warp < fit ? MF_TAB_SPAN * 4 + warp * rb : MF_TAB_SMEM_SPAN + (warp - fit) * rb;
}

static __host__ __device__ __forceinline__ int64_t offs_offset(int64_t sb, int table, int warps)
{
    const int64_t end = ring_offset(sb, table, warps);
    return table && end < (int64_t)MF_TAB_SMEM_SPAN ? (int64_t)MF_TAB_SMEM_SPAN : end;
}

/*
 * The same walk with the items' x staged in shared memory MF_STAGES - 1
 * items ahead (rows with 16-byte aligned vectors only), by blocks of NW
 * warps; dynamic shared memory as ring_offset says. TABLE: a table kernel,
 * which copies the activation's table (p.atab) to shared memory when the call
 * activates and takes quant_item_fast where it can.
 */
template <int NW>
static __device__ __forceinline__ void walk_staged(const rows_params &p, int mode, int xdt,
                                                   int act, int plain, int lpgc, int table)
{
    extern __shared__ int64_t mf_smem[];
    __shared__ float tab[64];
    __shared__ uint64_t bars[NW][MF_STAGES];
    char *const base = (char *)mf_smem;
    const int has_tab = table && p.activate; /* (without activation the table is never read) */
    const char *atab = has_tab ? base : NULL;
    if (has_tab) { /* the halves to 0 and MF_TAB_NEG */
        const uint4 *src = (const uint4 *)p.atab;
        for (int i = threadIdx.x; i < (int)(MF_TAB_BYTES / 16); i += NW * 32)
            *(uint4 *)(base + mf_tab_smem_offset((uint32_t)i * 4u)) = __ldg(src + i);
    }
    const int bulk = MF_BULK && xdt != MF_DT_F32;
    if (bulk && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int i = 0; i < MF_STAGES; i++)
            mbar_init(&bars[threadIdx.x >> 5][i]);
        mbar_init_fence();
    }
    /* programmatic dependent launch (pdl.cuh): the table copy and the barriers overlap the
     * previous kernel's end; no read of the call's tensors, and no write, before this */
    mf_pdl_wait();
    load_exp_table(tab); /* its barrier also publishes the mbarriers and the table */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t sb = stage_bytes(xdt == MF_DT_F32 ? 4 : 2, p.activate);
    const int64_t *offs;
    const int64_t rows = setup_rows(p, (int64_t *)(base + offs_offset(sb, has_tab, NW)), &offs);
    char *ring = base + ring_offset(sb, has_tab, warp);
    /* the fast item: G = 128, e4m3, 8-byte code stores */
    const int fast = table && lpgc == 16 && p.fp8 && p.vec_q;
    const int64_t W = (int64_t)gridDim.x * NW;
    /* The warp's first item: warp-major across the blocks, so that the last, partial round
     * (items W q .. N - 1) falls on a few warps of every SM rather than on every warp of the
     * first SMs (a decode call of 3584 items on 2640 warps: 10.6 -> 9.1 us); the block index
     * rotated by the warp, so that when W and the grid are multiples of the items per row
     * each SM still mixes the row's chunks (a short last chunk would otherwise fall on whole
     * SMs). A bijection from (block, warp) onto 0 .. W - 1. */
    const int64_t it = (int64_t)warp * gridDim.x + (blockIdx.x + warp) % gridDim.x;
    const int64_t Wq = W / p.chunks, Wr = W % p.chunks;
    item_it fetch_i = {it / p.chunks, it % p.chunks}, proc_i = fetch_i;
    /* (e, t) of each staged item, found once at its fetch (register "arrays": every index is
     * compared with constants, so nothing goes to local memory) */
    int64_t ring_e[MF_STAGES], ring_t[MF_STAGES];
    int64_t fe = 0; /* expert of the last fetch: the next is at least that */
    unsigned phases = 0u; /* parity of each ring slot's next mbarrier phase (bulk) */
#pragma unroll
    for (int i = 0; i < MF_STAGES; i++)
        ring_e[i] = ring_t[i] = 0;
    /* prologue: the first MF_STAGES - 1 items (every lane commits a group per item, even empty) */
#pragma unroll
    for (int sidx = 0; sidx < MF_STAGES - 1; sidx++) {
        if (fetch_i.row < rows) {
            int64_t t = fetch_i.row;
            if (offs) {
                fe = find_expert_warp(offs, p.E, fetch_i.row, fe, lane);
                t = fetch_i.row - offs[fe];
            }
            ring_e[sidx] = fe;
            ring_t[sidx] = t;
            fetch_item(p, xdt, bulk, ring + sidx * sb, &bars[warp][sidx],
                       p.x + (fe * p.xs0 + t * p.xs1) * p.xes, fetch_i.ch, lane);
        }
        if (!bulk)
            cp_async_commit();
        it_next(p, &fetch_i, Wq, Wr);
    }
    for (int sidx = 0; proc_i.row < rows; sidx = sidx + 1 == MF_STAGES ? 0 : sidx + 1) {
        /* the next item goes to the slot this lane emptied last iteration */
        const int fslot = sidx == 0 ? MF_STAGES - 1 : sidx - 1;
        if (fetch_i.row < rows) {
            int64_t t = fetch_i.row;
            if (offs) {
                fe = find_expert_warp(offs, p.E, fetch_i.row, fe, lane);
                t = fetch_i.row - offs[fe];
            }
#pragma unroll
            for (int i = 0; i < MF_STAGES; i++) {
                ring_e[i] = i == fslot ? fe : ring_e[i];
                ring_t[i] = i == fslot ? t : ring_t[i];
            }
            fetch_item(p, xdt, bulk, ring + fslot * sb, &bars[warp][fslot],
                       p.x + (fe * p.xs0 + t * p.xs1) * p.xes, fetch_i.ch, lane);
        }
        it_next(p, &fetch_i, Wq, Wr);
        if (bulk) {
            mbar_wait(&bars[warp][sidx], (phases >> sidx) & 1u);
            phases ^= 1u << sidx;
        } else {
            cp_async_commit();
            cp_async_wait_oldest();
        }
        int64_t e = ring_e[0], t = ring_t[0];
#pragma unroll
        for (int i = 1; i < MF_STAGES; i++) {
            e = i == sidx ? ring_e[i] : e;
            t = i == sidx ? ring_t[i] : t;
        }
        if (mode == MODE_QUANT) {
            const char *stage = ring + sidx * sb;
            /* whole slots of the row in the item: 4, or fewer in a row's last item */
            const int64_t left = p.H - proc_i.ch * MF_ST_ITEM;
            const int nv = left >= MF_ST_ITEM ? MF_ST_SLOTS
                           : left % 256 == 0  ? (int)(left / 256)
                                              : 0;
            int done = 0;
            if (fast && nv > 0)
                done = p.activate ? quant_item_fast<1>(p, atab, stage, e, t, proc_i.ch, nv, lane)
                                  : quant_item_fast<0>(p, atab, stage, e, t, proc_i.ch, nv, lane);
            if (!done)
                quant_item_st(p, xdt, act, plain, lpgc, tab, atab, stage, e, t, proc_i.ch, lane);
        } else
            mul_item_st(p, xdt, act, plain, tab, atab, ring + sidx * sb, e, t, proc_i.ch, lane);
        it_next(p, &proc_i, Wq, Wr);
    }
    /* the next kernel may launch once every block got here (the trigger counts per block;
     * at the start instead, it cost the long masked call 1-2% on the H100) */
    mf_pdl_trigger();
}

/*
 * Each op has a kernel for plain silu (the hot path: silu without clamp,
 * factors or intermediate rounding, and quant, which has no activation;
 * every option is a constant there, and no register goes to the gelu code)
 * and one for everything else. bf16 x without options (any activation, or
 * quant) takes the table kernels: one block of MF_TAB_WARPS warps per SM,
 * so that one copy of the activation's table serves them all.
 */
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_quant_silu(rows_params p)
{
    walk_items(p, MODE_QUANT, p.xdt, MF_ACT_SILU, 1);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_quant_any(rows_params p)
{
    walk_items(p, MODE_QUANT, p.xdt, p.act, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_act_mul_silu(rows_params p)
{
    walk_items(p, MODE_MUL, p.xdt, MF_ACT_SILU, 1);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_act_mul_any(rows_params p)
{
    walk_items(p, MODE_MUL, p.xdt, p.act, 0);
}

/* The staged versions of the four, for 16-byte aligned x. */
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_quant_silu_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_QUANT, p.xdt, MF_ACT_SILU, 1, 0, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_quant_any_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_QUANT, p.xdt, p.act, 0, 0, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_act_mul_silu_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_MUL, p.xdt, MF_ACT_SILU, 1, 0, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_act_mul_any_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_MUL, p.xdt, p.act, 0, 0, 0);
}

/* bf16 x, plain silu (or quant), staged; the dtype and the lanes per group (G / 8) constants
 * too: the hot path while the table kernels are off. */
template <int LPG>
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_quant_silu_st_bf16(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_QUANT, MF_DT_BF16, MF_ACT_SILU, 1, LPG, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_act_mul_silu_st_bf16(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_MUL, MF_DT_BF16, MF_ACT_SILU, 1, 0, 0);
}

/* The table kernels: bf16 x staged, act(g) from the table, the lanes per group a constant. */
template <int LPG>
__global__ void __launch_bounds__(MF_TAB_THREADS, 1) mf_k_quant_tab(rows_params p)
{
    walk_staged<MF_TAB_WARPS>(p, MODE_QUANT, MF_DT_BF16, p.act, 1, LPG, 1);
}

__global__ void __launch_bounds__(MF_TAB_THREADS, 1) mf_k_act_mul_tab(rows_params p)
{
    walk_staged<MF_TAB_WARPS>(p, MODE_MUL, MF_DT_BF16, p.act, 1, 0, 1);
}

/*
 * G = H (not 32, 64 or 128): one block per row, grid-stride over the valid
 * rows. h is kept in shared memory between the amax and the codes when it
 * fits (hcache), else computed again (the same bits).
 */
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_quant_row(rows_params p, int hcache)
{
    extern __shared__ int64_t mf_smem[];
    __shared__ float red[MF_WARPS];
    __shared__ float tab[64];
    load_exp_table(tab);
    const int64_t *offs;
    const int64_t rows = setup_rows(p, mf_smem, &offs);
    float *hc = (float *)(mf_smem + ((p.counts && !p.offs_g) ? p.E + 1 : 0));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        int64_t e = 0, t = row;
        if (offs) {
            e = find_expert(offs, p.E, row);
            t = row - offs[e];
        }
        const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
        char *qrow = p.q + e * p.qs0 + t * p.qs1;
        float rs, es;
        row_factors(p, e, t, &rs, &es);
        float m = 0.0f;
        for (int64_t c = tid; c < p.H; c += MF_THREADS) {
            const float v = h_one(p, tab, xrow, c, rs, es);
            const float a = fabsf(v);
            m = (mf_is_finite(v) && a > m) ? a : m;
            if (hcache)
                hc[c] = v;
        }
        for (int off = 16; off > 0; off >>= 1)
            m = fmaxf(m, __shfl_xor_sync(MF_FULL, m, off));
        if (lane == 0)
            red[warp] = m;
        __syncthreads();
        float amax = 0.0f;
        for (int w = 0; w < MF_WARPS; w++)
            amax = fmaxf(amax, red[w]);
        uint32_t ue;
        const float s = group_scale(p, amax, &ue);
        const float y = 1.0f / s;
        const int fast = mf_scale_fast_ok(s);
        for (int64_t c = tid; c < p.H; c += MF_THREADS) {
            const float v = hcache ? hc[c] : h_one(p, tab, xrow, c, rs, es);
            qrow[c] = (char)code1(p.fp8, v, s, y, fast);
        }
        if (tid == 0) {
            if (p.layout == MF_LAYOUT_PACKED) /* one group: the whole word, bytes 1..3 zero */
                ((int32_t *)p.sc)[e * p.ss0 + t] = (int32_t)ue;
            else
                put_scale(p, e, t, 0, s, ue);
        }
        __syncthreads(); /* red (and hc) are rewritten for the next row */
    }
}

/* Row offsets in global memory for E > MF_SMEM_EXPERTS: one block. */
__global__ void __launch_bounds__(1024) mf_k_count_prefix(const int32_t *counts, int64_t cs0,
                                                          int64_t E, int64_t T, int64_t *offs)
{
    block_prefix(counts, cs0, E, T, offs);
}

/*
 * Rows t in [t_begin, t_end) of every expert that are zeroed rather than
 * computed: with zero_tail the rows t >= n[e] (codes and scales), and the
 * padding rows T..Ta-1 of the column-major and packed layouts (scales). One
 * warp per row.
 */
__global__ void __launch_bounds__(MF_THREADS) mf_k_rows_tail(rows_params p, int64_t t_begin,
                                                             int64_t t_end, int zero_tail,
                                                             int vec16)
{
    const int lane = threadIdx.x & 31;
    const int64_t span = t_end - t_begin, items = p.E * span;
    for (int64_t it = (int64_t)blockIdx.x * MF_WARPS + (threadIdx.x >> 5); it < items;
         it += (int64_t)gridDim.x * MF_WARPS) {
        const int64_t e = it / span, t = t_begin + it % span;
        if (t < p.T) {
            if (!zero_tail)
                continue;
            const int64_t c = p.counts ? (int64_t)p.counts[e * p.cs0] : p.T;
            const int64_t n = c < 0 ? 0 : (c > p.T ? p.T : c);
            if (t < n)
                continue; /* a computed row */
            char *qrow = p.q + e * p.qs0 + t * p.qs1;
            int64_t c16 = 0;
            if (vec16) {
                c16 = p.H / 16 * 16;
                for (int64_t c = (int64_t)lane * 16; c < c16; c += 32 * 16)
                    *(uint4 *)(qrow + c) = make_uint4(0u, 0u, 0u, 0u);
            }
            for (int64_t c = c16 + lane; c < p.H; c += 32)
                qrow[c] = 0;
        }
        if (p.layout == MF_LAYOUT_PACKED) {
            for (int64_t w = lane; w < p.Gw; w += 32)
                ((int32_t *)p.sc)[e * p.ss0 + w * p.ss1 + t] = 0;
        } else {
            for (int64_t g = lane; g < p.Gn; g += 32)
                put_scale(p, e, t, g, 0.0f, 0u);
        }
    }
}

/* ------------------------------------------------------------------ host */

moefuse_status mf_cuda_build_act_tables(moefuse_context *ctx, cuda_state *s)
{
    const size_t bytes = (size_t)MF_TAB_ACTS * MF_TAB_BYTES;
    cudaError_t e = mf_fault_hit(MF_FAULT_DEVICE_ALLOC) ? cudaErrorMemoryAllocation
                                                        : cudaMalloc((void **)&s->act_tables, bytes);
    if (e != cudaSuccess) {
        s->act_tables = NULL;
        return mf_cuda_fail(ctx, e, NULL, "cudaMalloc(activation tables)");
    }
    mf_k_build_act_tables<<<MF_TAB_ACTS * MF_TAB_ENTRIES / 256, 256, 0, s->own_stream>>>(s->act_tables);
    MF_TRY(mf_cuda_launched(ctx, "context creation", "mf_k_build_act_tables"));
    e = cudaStreamSynchronize(s->own_stream);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, NULL, "cudaStreamSynchronize");
}

/*
 * Can every row of t be accessed `align` bytes at a time? The data start and
 * the row strides (in bytes) must be multiples of align; the expert stride
 * matters only when there is more than one expert. The core guarantees only
 * element alignment, so the kernels fall back to narrower accesses.
 */
static int rows_aligned(const moefuse_tensor *t, int64_t align, int64_t experts)
{
    const int64_t es = (int64_t)moefuse_dtype_size(t->dtype);
    if ((uintptr_t)mf_cuda_base(t) % (uintptr_t)align != 0)
        return 0;
    if ((t->stride[1] * es) % align != 0)
        return 0;
    return experts <= 1 || (t->stride[0] * es) % align == 0;
}

/* The fields every row op shares: x, the activation options, the factors, the shapes. */
static void fill_common(rows_params *p, const mf_rows_args *a)
{
    memset(p, 0, sizeof *p);
    p->x = mf_cuda_base(&a->x);
    p->xs0 = a->x.stride[0];
    p->xs1 = a->x.stride[1];
    p->xdt = (int)a->x.dtype;
    p->xes = (int64_t)moefuse_dtype_size(a->x.dtype);
    p->activate = a->activate;
    const int order = a->activate ? (int)a->act.order : MOEFUSE_GATE_FIRST;
    p->goff = mf_gate_at(order, a->hidden);
    p->uoff = mf_up_at(order, a->hidden);
    p->cstep = mf_gate_step(order);
    p->act = (int)a->act.activation;
    p->alpha = a->act.alpha;
    p->limit = a->activate ? a->act.limit : 0.0f;
    p->beta = a->activate ? a->act.up_offset : 0.0f;
    p->round_bf16 = a->activate && a->act.intermediate == MOEFUSE_ROUND_BF16;
    if (a->row_scale.data) {
        p->has_rs = 1;
        p->rs = mf_cuda_base(&a->row_scale);
        p->rss0 = a->row_scale.stride[0];
        p->rss1 = a->row_scale.stride[1];
    }
    if (a->expert_scale.data) {
        p->has_es = 1;
        p->es = mf_cuda_base(&a->expert_scale);
        p->ess0 = a->expert_scale.stride[0];
        p->esdt = (int)a->expert_scale.dtype;
    }
    if (a->counts.data) {
        p->counts = (const int32_t *)mf_cuda_base(&a->counts);
        p->cs0 = a->counts.stride[0];
    }
    p->E = a->experts;
    p->T = a->rows;
    p->H = a->hidden;
    p->chunks = (a->hidden + MF_ITEM - 1) / MF_ITEM;
    p->q = mf_cuda_base(&a->out);
    p->qs0 = a->out.stride[0];
    p->qs1 = a->out.stride[1];
    p->qdt = (int)a->out.dtype;
    p->qes = (int64_t)moefuse_dtype_size(a->out.dtype);
}

/* An activation without clamp, up offset, intermediate rounding or factors, its gate and up
 * halves apart (or no activation at all)? */
static int no_options(const rows_params *p)
{
    return !p->activate || (!(p->limit > 0.0f) && p->beta == 0.0f && p->cstep == 1 &&
                            !p->round_bf16 && !p->has_rs && !p->has_es);
}

/* Can the plain kernels take the call: silu without options, or no activation at all? */
static int plain_silu(const rows_params *p)
{
    return no_options(p) && (!p->activate || p->act == MF_ACT_SILU);
}

/*
 * Can a table kernel take the call: bf16 x staged (16-byte aligned), no options, an
 * activation that has a table (not silu_alpha, whose values depend on alpha)? It reads the
 * activation's table (built at context creation, act_table.cuh), set here in p->atab.
 */
static int table_kernel(const cuda_state *s, rows_params *p)
{
    if (p->xdt != MF_DT_BF16 || !p->vec_x || !no_options(p) || !s->act_tables ||
        (p->activate && !mf_act_table_has(p->act)))
        return 0;
    p->atab = p->activate ? s->act_tables + (size_t)p->act * MF_TAB_ENTRIES : NULL;
    return 1;
}

/* The masked layout's row offsets go to scratch past MF_SMEM_EXPERTS experts: their bytes, or
 * 0 (2-D calls, or offsets in shared memory). */
static size_t offsets_scratch_bytes(bool masked, int64_t experts)
{
    return masked && experts > MF_SMEM_EXPERTS ? (size_t)(experts + 1) * sizeof(int64_t) : 0;
}

extern "C" moefuse_status mf_cuda_rows_workspace(moefuse_context *ctx, void *state,
                                                 const mf_rows_args *a, size_t *bytes)
{
    (void)ctx;
    (void)state;
    *bytes = offsets_scratch_bytes(a->counts.data != NULL, a->experts);
    return MOEFUSE_OK;
}

/* Row offsets of the masked layout: shared memory (dynamic bytes in *smem) or global scratch
 * (`given`, a caller's share of its own scratch, or this call's request). */
static moefuse_status masked_offsets(moefuse_context *ctx, cuda_state *s, rows_params *p,
                                     const char *op, void *given, size_t *smem)
{
    *smem = 0;
    if (!p->counts)
        return MOEFUSE_OK;
    const size_t bytes = offsets_scratch_bytes(true, p->E);
    if (bytes == 0) {
        *smem = (size_t)(p->E + 1) * sizeof(int64_t);
        return MOEFUSE_OK;
    }
    void *offs = given;
    if (!offs)
        MF_TRY(mf_cuda_scratch(ctx, s, bytes, op, &offs));
    mf_k_count_prefix<<<1, 1024, 0, s->stream>>>(p->counts, p->cs0, p->E, p->T, (int64_t *)offs);
    MF_TRY(mf_cuda_launched(ctx, op, "mf_k_count_prefix"));
    p->offs_g = (const int64_t *)offs;
    return MOEFUSE_OK;
}

/*
 * Dynamic shared memory of a staged kernel of `warps` warps in *bytes: the rings (and the
 * activation table for a table kernel that activates) as ring_offset lays them out, then
 * the row offsets (offs_bytes); 0 when even the device's opt-in limit is too small (the
 * unstaged kernel runs instead). Above the default 48 KiB the kernel's limit is raised once
 * per context (bit: its bit in s->rows_smem_raised), not on every call: the attribute call
 * costs host time that a decode-sized call would notice.
 */
static moefuse_status staged_smem(moefuse_context *ctx, cuda_state *s, const rows_params *p,
                                  size_t offs_bytes, const void *kernel, uint32_t bit, int warps,
                                  int table, const char *op, size_t *bytes)
{
    /* the kernels' static shared memory (exp table, mbarriers, the prefix sum's) stays under
     * 2 KiB (832 bytes with MF_TAB_WARPS = 20: ptxas -v) */
    const size_t stat = 2048;
    *bytes = 0;
    if (s->smem_optin <= stat)
        return MOEFUSE_OK;
    const size_t limit = s->smem_optin - stat;
    const int64_t sb = stage_bytes(p->xes, p->activate);
    const size_t need = (size_t)offs_offset(sb, table && p->activate, warps) +
                        (offs_bytes + 15) / 16 * 16;
    if (need > limit)
        return MOEFUSE_OK;
    if (need + stat > 48 * 1024 && !(s->rows_smem_raised & bit)) {
        cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)limit);
        if (e != cudaSuccess)
            return mf_cuda_fail(ctx, e, op, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
        s->rows_smem_raised |= bit;
    }
    *bytes = need;
    return MOEFUSE_OK;
}

void mf_cuda_probe_pdl(cuda_state *s)
{
    struct cudaFuncAttributes fa;
    s->pdl = s->cc_major >= 9 &&
             cudaFuncGetAttributes(&fa, (const void *)mf_k_act_mul_tab) == cudaSuccess &&
             fa.ptxVersion >= 90;
    s->clusters = s->pdl; /* the same condition: code built for sm_90 on an sm_90 device */
    (void)cudaGetLastError(); /* a failed query leaves PDL off, not an error for the next call */
}

static moefuse_status rows_quant(moefuse_context *ctx, cuda_state *s, const mf_rows_args *a,
                                 const char *op, void *offs_scratch)
{
    rows_params p;
    fill_common(&p, a);
    const int masked = p.counts != NULL;
    if (!masked && p.E != 1)
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: %lld experts without counts", op,
                        (long long)p.E);
    const int64_t G = a->group;
    p.Gn = a->groups;
    p.Gw = (a->groups + 3) / 4;
    p.eps = a->quant.eps;
    p.fp8 = a->out.dtype == MOEFUSE_F8_E4M3;
    p.layout = (int)a->quant.scale_layout;
    p.ue8m0 = a->quant.ue8m0 || p.layout == MF_LAYOUT_PACKED;
    p.sc = mf_cuda_base(&a->scales);
    p.ss0 = a->scales.stride[0];
    p.ss1 = a->scales.stride[1];
    p.sc_f32 = a->scales.dtype == MOEFUSE_F32;
    p.qes = 1;
    const int warp_path = G == 32 || G == 64 || G == 128;
    if (warp_path) {
        p.lpg = (int)(G / 8);
        p.glog = G == 32 ? 5 : (G == 64 ? 6 : 7);
    }
    const int64_t E = p.E, T = p.T;
    const int64_t Ta = a->rows_padded;
    if (E > 0 && T > 0) {
        /* 16-byte x loads need every gate/up vector aligned: rows, and the half at H; the
         * interleaved order loads element by element in the direct kernels (no staging) */
        p.vec_x = rows_aligned(&a->x, 16, E) && (p.H * p.xes) % 16 == 0 && p.cstep == 1;
        p.vec_q = rows_aligned(&a->out, 8, E);
        size_t smem;
        MF_TRY(masked_offsets(ctx, s, &p, op, offs_scratch, &smem));
        if (warp_path) {
            /* quant (no activation) runs in the plain kernels, which never call act8 for it */
            const int tab = table_kernel(s, &p);
            const int silu = plain_silu(&p);
            const int bf16 = p.xdt == MF_DT_BF16;
            void (*tabk)(rows_params) = p.lpg == 16  ? mf_k_quant_tab<16>
                                        : p.lpg == 8 ? mf_k_quant_tab<8>
                                                     : mf_k_quant_tab<4>;
            void (*hot)(rows_params) = p.lpg == 16  ? mf_k_quant_silu_st_bf16<16>
                                       : p.lpg == 8 ? mf_k_quant_silu_st_bf16<8>
                                                    : mf_k_quant_silu_st_bf16<4>;
            void (*k)(rows_params) = tab    ? tabk
                                     : silu ? (bf16 ? hot : mf_k_quant_silu_st)
                                            : mf_k_quant_any_st;
            const char *kname = tab ? "mf_k_quant_tab" : silu ? "mf_k_quant_silu_st" : "mf_k_quant_any_st";
            const int warps = tab ? MF_TAB_WARPS : MF_WARPS;
            const int per_sm = tab ? 1 : silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY;
            /* the kernel's bit in s->rows_smem_raised */
            const uint32_t lbit = p.lpg == 16 ? 0 : p.lpg == 8 ? 1 : 2;
            const uint32_t bit = tab ? 1u << (8 + lbit) : !silu ? 1u << 4 : bf16 ? 1u << lbit : 1u << 3;
            size_t bytes = 0;
            if (p.vec_x)
                MF_TRY(staged_smem(ctx, s, &p, smem, (const void *)k, bit, warps, tab, op, &bytes));
            /* staged items are 1024 channels, the others 512 */
            p.chunks = (p.H + (bytes ? MF_ST_ITEM : MF_ITEM) - 1) / (bytes ? MF_ST_ITEM : MF_ITEM);
            if (bytes) {
                /* masked: a persistent grid (the valid rows are known on the device only) */
                const unsigned grid = masked ? (unsigned)s->sm_count * (unsigned)per_sm
                                             : mf_cuda_grid(s, T * p.chunks, warps, per_sm);
                /* the table kernels with programmatic dependent launch (mf_pdl_wait) */
                mf_launch_pdl(k, dim3(grid), (unsigned)warps * 32u, bytes, s->stream,
                              tab && s->pdl, p);
                MF_TRY(mf_cuda_launched(ctx, op, kname));
            } else {
                const int per_sm_d = silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY;
                const unsigned grid = masked ? (unsigned)s->sm_count * (unsigned)per_sm_d
                                             : mf_cuda_grid(s, T * p.chunks, MF_WARPS, per_sm_d);
                if (silu) {
                    mf_k_quant_silu<<<grid, MF_THREADS, smem, s->stream>>>(p);
                    MF_TRY(mf_cuda_launched(ctx, op, "mf_k_quant_silu"));
                } else {
                    mf_k_quant_any<<<grid, MF_THREADS, smem, s->stream>>>(p);
                    MF_TRY(mf_cuda_launched(ctx, op, "mf_k_quant_any"));
                }
            }
        } else {
            const int hcache = smem + (size_t)p.H * sizeof(float) <= MF_SMEM_BYTES;
            const size_t bytes = smem + (hcache ? (size_t)p.H * sizeof(float) : 0);
            const unsigned grid = masked ? (unsigned)s->sm_count * MF_BLOCKS_ANY
                                         : mf_cuda_grid(s, T, 1, MF_BLOCKS_ANY);
            mf_k_quant_row<<<grid, MF_THREADS, bytes, s->stream>>>(p, hcache);
            MF_TRY(mf_cuda_launched(ctx, op, "mf_k_quant_row"));
        }
    }
    /* rows zeroed rather than computed: the tail (zero_tail) and the layout's padding rows */
    const int tail = a->zero_tail && masked;
    const int64_t t_begin = tail ? 0 : T;
    const int64_t t_end = p.layout == MF_LAYOUT_ROW ? T : Ta;
    if (E > 0 && t_end > t_begin) {
        const int vec16 = rows_aligned(&a->out, 16, E);
        const unsigned grid =
            mf_cuda_grid(s, E * (t_end - t_begin), MF_WARPS, MF_BLOCKS_PER_SM);
        mf_k_rows_tail<<<grid, MF_THREADS, 0, s->stream>>>(p, t_begin, t_end, tail, vec16);
        MF_TRY(mf_cuda_launched(ctx, op, "mf_k_rows_tail"));
    }
    return MOEFUSE_OK;
}

moefuse_status mf_cuda_act_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    return rows_quant(ctx, (cuda_state *)state, a,
                      a->counts.data ? "act_quant_masked" : "act_quant", NULL);
}

moefuse_status mf_cuda_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    return rows_quant(ctx, (cuda_state *)state, a, "quant", NULL);
}

size_t mf_cuda_quant_scratch_bytes(const mf_rows_args *a)
{
    return offsets_scratch_bytes(a->counts.data != NULL, a->experts);
}

moefuse_status mf_cuda_quant_in_call(moefuse_context *ctx, cuda_state *s, const mf_rows_args *a,
                                     const char *op, void *scratch)
{
    return rows_quant(ctx, s, a, op, scratch);
}

moefuse_status mf_cuda_act_mul(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    static const char op[] = "act_mul";
    cuda_state *s = (cuda_state *)state;
    rows_params p;
    fill_common(&p, a);
    if (p.counts || p.E != 1)
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: expects the 2-D form", op);
    if (p.T == 0)
        return MOEFUSE_OK;
    p.vec_x = rows_aligned(&a->x, 16, 1) && (p.H * p.xes) % 16 == 0 && p.cstep == 1;
    p.vec_q = rows_aligned(&a->out, 16, 1);
    const int silu = plain_silu(&p);
    size_t bytes = 0;
    /* staged items move 8 channels per lane (mul_item_st): an f32 row of 8n + 4 channels
     * passes the 16-byte test above but would be written 4 channels past its end */
    const int staged = p.vec_x && p.H % 8 == 0;
    const int tab = staged && table_kernel(s, &p);
    const int bf16 = p.xdt == MF_DT_BF16;
    void (*k)(rows_params) = tab    ? mf_k_act_mul_tab
                             : silu ? (bf16 ? mf_k_act_mul_silu_st_bf16 : mf_k_act_mul_silu_st)
                                    : mf_k_act_mul_any_st;
    const int warps = tab ? MF_TAB_WARPS : MF_WARPS;
    const uint32_t bit = tab ? 1u << 11 : !silu ? 1u << 7 : bf16 ? 1u << 5 : 1u << 6;
    if (staged)
        MF_TRY(staged_smem(ctx, s, &p, 0, (const void *)k, bit, warps, tab, op, &bytes));
    p.chunks = (p.H + (bytes ? MF_ST_ITEM : MF_ITEM) - 1) / (bytes ? MF_ST_ITEM : MF_ITEM);
    if (bytes) {
        const int per_sm = tab ? 1 : silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY;
        const unsigned grid = mf_cuda_grid(s, p.T * p.chunks, warps, per_sm);
        mf_launch_pdl(k, dim3(grid), (unsigned)warps * 32u, bytes, s->stream, tab && s->pdl, p);
        return mf_cuda_launched(ctx, op, tab ? "mf_k_act_mul_tab" : silu ? "mf_k_act_mul_silu_st" : "mf_k_act_mul_any_st");
    }
    p.atab = NULL;
    const unsigned grid = mf_cuda_grid(s, p.T * p.chunks, MF_WARPS, silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY);
    if (silu) {
        mf_k_act_mul_silu<<<grid, MF_THREADS, 0, s->stream>>>(p);
        return mf_cuda_launched(ctx, op, "mf_k_act_mul_silu");
    }
    mf_k_act_mul_any<<<grid, MF_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, op, "mf_k_act_mul_any");
}
