/*
 * The CPU backend's row kernels at every instruction-set level this machine
 * has (src/cpu/rows_isa.h: scalar reference, AVX2, AVX-512) give the scalar
 * level's bytes: every output buffer, canaries, row padding and rows an op
 * leaves alone included, for act_quant (2-D and masked), quant, act_mul and
 * dequant on fresh random data and on edge inputs (NaN with payloads, +-Inf,
 * all-zero groups, amax of exactly 448, 464 and 480, quotients on e4m3
 * rounding ties, scales next to powers of two, denormals, huge values, g
 * beyond +-88, odd H, 0 and 1 tokens, masked counts out of range). The MoE GEMMs' levels
 * are test_cpu_gemm_isa.c's.
 *
 * `test_cpu_isa --exp-all` (not part of `meson test`: minutes) compares the
 * vector exp of each level with mf_exp_f32 on all 2^32 f32 inputs.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/gemm.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "harness.h"
#include "numerics/mf_exp.h"

/* ------------------------------------------- the vector text at 16 lanes */

/*
 * src/cpu/rows_simd.h compiled here over plain-C 16-lane operations with AVX-512's
 * semantics (bit masks, per-lane IEEE operations), so that the text the AVX-512 level
 * runs is exercised at its width on any machine; the AVX-512 intrinsics themselves run
 * only where the processor has them (t_act_quant and the others then cover them).
 */
#define SIMD_W 16
#define SIMD_FN static
#define SIMD_ISA MF_CPU_ISA_AVX512
#define SIMD_ISA_NAME "16 lanes in C"
#define SIMD_NAME(f) w16_##f
#define SIMD_TABLE w16_rows
#define SIMD_ACT_TABLE 0 /* as rows_avx512.c: silu computed */
#define SIMD_SILU_ONE_PASS 1 /* as rows_avx512.c (AVX2 covers the two passes) */
#define LANES for (int l = 0; l < 16; l++)

typedef struct { float v[16]; } vf;
typedef struct { uint32_t v[16]; } vi;
typedef uint32_t vm;

static vf vf_set(float a) { vf r; LANES r.v[l] = a; return r; }
static vf vf_loadu(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
static void vf_storeu(float *p, vf a) { memcpy(p, a.v, sizeof a.v); }
static vf vf_add(vf a, vf b) { LANES a.v[l] = a.v[l] + b.v[l]; return a; }
static vf vf_sub(vf a, vf b) { LANES a.v[l] = a.v[l] - b.v[l]; return a; }
static vf vf_mul(vf a, vf b) { LANES a.v[l] = a.v[l] * b.v[l]; return a; }
static vf vf_div(vf a, vf b) { LANES a.v[l] = a.v[l] / b.v[l]; return a; }
static vf vf_fma(vf a, vf b, vf c) { LANES a.v[l] = fmaf(a.v[l], b.v[l], c.v[l]); return a; }
static vf vf_fnma(vf a, vf b, vf c) { LANES a.v[l] = fmaf(-a.v[l], b.v[l], c.v[l]); return a; }
static vf vf_fnms(vf a, vf b, vf c) { LANES a.v[l] = fmaf(-a.v[l], b.v[l], -c.v[l]); return a; }
static vi vf_bits(vf a) { vi r; memcpy(r.v, a.v, sizeof r.v); return r; }
static vf vi_as_vf(vi a) { vf r; memcpy(r.v, a.v, sizeof r.v); return r; }
static vi vi_set(int32_t a) { vi r; LANES r.v[l] = (uint32_t)a; return r; }
static vi vi_and(vi a, vi b) { LANES a.v[l] &= b.v[l]; return a; }
static vi vi_or(vi a, vi b) { LANES a.v[l] |= b.v[l]; return a; }
static vi vi_add(vi a, vi b) { LANES a.v[l] += b.v[l]; return a; }
static vi vi_sub(vi a, vi b) { LANES a.v[l] -= b.v[l]; return a; }
static vi vi_max(vi a, vi b) { LANES a.v[l] = (int32_t)a.v[l] > (int32_t)b.v[l] ? a.v[l] : b.v[l]; return a; }
static vi vi_sll(vi a, int n) { LANES a.v[l] <<= n; return a; }
static vi vi_srl(vi a, int n) { LANES a.v[l] >>= n; return a; }
static vf vf_neg(vf a) { vi b = vf_bits(a); LANES b.v[l] ^= 0x80000000u; return vi_as_vf(b); }
static vf vf_abs(vf a) { return vi_as_vf(vi_and(vf_bits(a), vi_set(0x7FFFFFFF))); }
static vf vf_max(vf a, vf b) { LANES a.v[l] = a.v[l] > b.v[l] ? a.v[l] : b.v[l]; return a; }
static vf vf_round_even(vf a) { LANES a.v[l] = rintf(a.v[l]); return a; }
/* cvtps2dq: integral values exactly, anything else the integer indefinite */
static vi vf_to_vi(vf a) { vi r; LANES r.v[l] = fabsf(a.v[l]) < 0x1p31f ? (uint32_t)(int32_t)a.v[l] : 0x80000000u; return r; }
static vf vi_to_vf(vi a) { vf r; LANES r.v[l] = (float)(int32_t)a.v[l]; return r; }
static vi vi_load_u16(const uint16_t *p) { vi r; LANES r.v[l] = p[l]; return r; }
static vf vf_gather(const float *b, vi o) { vf r; LANES memcpy(&r.v[l], (const char *)b + o.v[l], 4); return r; }
static vi vi_load_u8(const uint8_t *p) { vi r; LANES r.v[l] = p[l]; return r; }
static vi vi_load_i8(const int8_t *p) { vi r; LANES r.v[l] = (uint32_t)(int32_t)p[l]; return r; }
#define MASK(cond) vm m = 0; LANES m |= (vm)(cond) << l; return m
static vm vm_gt(vf a, vf b) { MASK(a.v[l] > b.v[l]); }
static vm vm_lt(vf a, vf b) { MASK(a.v[l] < b.v[l]); }
static vm vm_not_lt(vf a, vf b) { MASK(!(a.v[l] < b.v[l])); }
static vm vm_unordered(vf a, vf b) { MASK(isnan(a.v[l]) || isnan(b.v[l])); }
static vm vi_gt(vi a, vi b) { MASK((int32_t)a.v[l] > (int32_t)b.v[l]); }
static vm vi_eq(vi a, vi b) { MASK(a.v[l] == b.v[l]); }
#undef MASK
static unsigned vm_bits(vm m) { return m; }
static vf vf_blend(vm m, vf t, vf f) { LANES if (m >> l & 1) f.v[l] = t.v[l]; return f; }
static vi vi_blend(vm m, vi t, vi f) { LANES if (m >> l & 1) f.v[l] = t.v[l]; return f; }
static vf vf_zero_unless(vm m, vf a) { return vf_blend(~m, vf_set(0.0f), a); }
static vi vi_or_and(vi a, vi b, vi c) { LANES a.v[l] |= b.v[l] & c.v[l]; return a; }
static vi vi_sub_where(vm m, vi a, vi b, vi c) { LANES if (m >> l & 1) a.v[l] = b.v[l] - c.v[l]; return a; }
static float vf_hmax(vf a) { float m = a.v[0]; LANES m = a.v[l] > m ? a.v[l] : m; return m; }
static int32_t vi_hmax(vi a) { int32_t m = (int32_t)a.v[0]; LANES m = (int32_t)a.v[l] > m ? (int32_t)a.v[l] : m; return m; }
static void store_u8(uint8_t *p, vi c) { LANES p[l] = (uint8_t)c.v[l]; }
static void store_i8(int8_t *p, vi c) { LANES p[l] = (int8_t)(uint8_t)c.v[l]; }
static void store_u8x4(uint8_t *p, vi a, vi b, vi c, vi d) { store_u8(p, a); store_u8(p + 16, b); store_u8(p + 32, c); store_u8(p + 48, d); }
static void store_u16(uint16_t *p, vi a) { LANES p[l] = (uint16_t)a.v[l]; }
typedef struct { float hi[32], lo[32]; } simd_exp_table;
static void simd_exp_table_init(simd_exp_table *t) { for (int j = 0; j < 32; j++) { t->hi[j] = MF_EXP_TABLE[2 * j]; t->lo[j] = MF_EXP_TABLE[2 * j + 1]; } }
static void simd_exp_lookup(const simd_exp_table *t, vi kb, vf *hi, vf *lo) { LANES { hi->v[l] = t->hi[kb.v[l] & 31]; lo->v[l] = t->lo[kb.v[l] & 31]; } }
#undef LANES

#include "cpu/rows_simd.h"

enum op { OP_ACT_QUANT, OP_MASKED, OP_QUANT, OP_ACT_MUL, OP_DEQUANT };

typedef struct {
    enum op op;
    tbuf *x, *counts, *rs, *es, *q, *scales, *out;
    moefuse_act_quant_options o;
    char what[200];
} op_call;

static moefuse_status call_op(const op_call *c)
{
    switch (c->op) {
    case OP_ACT_QUANT:
        return moefuse_act_quant(g_ctx, T(c->x), T(c->rs), T(c->q), T(c->scales), &c->o);
    case OP_MASKED:
        return moefuse_act_quant_masked(g_ctx, T(c->x), T(c->counts), T(c->rs), T(c->es), T(c->q),
                                        T(c->scales), &c->o);
    case OP_QUANT: return moefuse_quant(g_ctx, T(c->x), T(c->q), T(c->scales), &c->o.quant);
    case OP_ACT_MUL: return moefuse_act_mul(g_ctx, T(c->x), T(c->rs), T(c->out), &c->o.act);
    default: return moefuse_dequant(g_ctx, T(c->q), T(c->scales), T(c->out), &c->o.quant);
    }
}

/*
 * Runs the call at every level, each time from the same output bytes (poison and
 * canaries), and requires every byte of every output buffer to equal the scalar
 * level's. CALL checks canaries, row padding and inputs after each run. Frees the case's
 * tensors at the end.
 */
static void compare_levels(op_call *c)
{
    tbuf *outs[3];
    int n = 0;
    if (c->op == OP_DEQUANT || c->op == OP_ACT_MUL)
        outs[n++] = c->out;
    else {
        outs[n++] = c->q;
        outs[n++] = c->scales;
    }
    unsigned char *pristine[3], *ref[3];
    for (int i = 0; i < n; i++) {
        pristine[i] = malloc(outs[i]->total);
        ref[i] = malloc(outs[i]->total);
        memcpy(pristine[i], outs[i]->full, outs[i]->total);
    }
    for (int lvl = MF_CPU_ISA_SCALAR; lvl < MF_CPU_ISA_COUNT; lvl++) {
        if (!mf_cpu_isa_force((mf_cpu_isa)lvl))
            continue;
        for (int i = 0; i < n; i++) {
            memcpy(outs[i]->full, pristine[i], outs[i]->total);
            tb_upload(outs[i]);
        }
        moefuse_status st = CALL(call_op(c));
        HCHECK(st == MOEFUSE_OK, "%s at %s: %s (%s)", c->what, mf_cpu_isa_name((mf_cpu_isa)lvl),
               moefuse_status_name(st), moefuse_last_error(g_ctx));
        for (int i = 0; i < n; i++) {
            if (lvl == MF_CPU_ISA_SCALAR) {
                memcpy(ref[i], outs[i]->full, outs[i]->total);
                continue;
            }
            size_t b = 0;
            while (b < outs[i]->total && outs[i]->full[b] == ref[i][b])
                b++;
            if (b < outs[i]->total)
                HCHECK(0, "%s: %s differs from scalar in '%s' at byte %zu of %zu (0x%02x, scalar 0x%02x)",
                       c->what, mf_cpu_isa_name((mf_cpu_isa)lvl), outs[i]->name, b,
                       outs[i]->total, outs[i]->full[b], ref[i][b]);
        }
    }
    for (int i = 0; i < n; i++) {
        free(pristine[i]);
        free(ref[i]);
    }
    tb_free_all();
}

/* ------------------------------------------------------------------ values */

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Inputs the fast paths must hand over, or must get exactly right. */
static float edge_value(void)
{
    static const uint32_t nan_bits[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF912345u,
                                        0x7FBFFFFFu, 0xFFFFFFFFu};
    static const float edges[] = {
        INFINITY, -INFINITY, 0.0f, -0.0f, 86.5f, -86.5f, 0x1.59fffep+6f, -0x1.59fffep+6f,
        88.0f, -88.0f, 88.8f, -88.8f, 89.5f, -89.5f, 104.0f, -104.0f, 105.0f, -105.0f,
        16.6355f, -16.6355f, 17.0f, 1e30f, -1e30f, 3.4e38f, -3.4e38f, 1e-40f, -1e-40f,
        0x1p-149f, -0x1p-149f, 0x1p-126f, 1e-30f, 448.0f, -448.0f, 464.0f, 480.0f, -480.0f,
        0x1p-30f, 65504.0f, 65520.0f, 1.0e-7f,
        /* silu_alpha's exp edge at alpha = 1.702: |alpha g| crosses 86.5 near 50.82 */
        50.82f, -50.82f, 50.83f, -50.83f, 61.2f, -61.2f,
    };
    const int64_t k = h_randint(0, (int64_t)(sizeof edges / sizeof edges[0]) + 5);
    if (k < 6)
        return bits_f32(nan_bits[k]);
    return edges[k - 6];
}

/* Writes v into element i of a contiguous tensor of dtype dt (raw codes for the halves, so
 * that NaN payloads survive where the format can hold them). */
static void put(tbuf *tb, int64_t i, float v)
{
    unsigned char *p = tb->full + tb->pad;
    switch (tb->t.dtype) {
    case MOEFUSE_F32: memcpy(p + 4 * i, &v, 4); break;
    case MOEFUSE_BF16: {
        uint32_t u;
        memcpy(&u, &v, 4);
        const uint16_t b = (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)(u >> 16 | 0x0040u)
                                                           : mf_f32_to_bf16(v);
        memcpy(p + 2 * i, &b, 2);
        break;
    }
    default: {
        const uint16_t h = mf_f32_to_f16(v);
        memcpy(p + 2 * i, &h, 2);
        break;
    }
    }
}

/* Element i of the tensor's storage order for a [rows, width] view with row stride. */
static int64_t at(const tbuf *tb, int64_t row, int64_t col)
{
    return row * tb->t.stride[tb->t.rank - 2] + col;
}

/*
 * Fills rows of width w: uniform in [-range, range], edge values with probability
 * 1/edge_every (0: none), an all-zero group now and then.
 */
static void fill_rows(tbuf *tb, int64_t rows, int64_t w, float range, int edge_every)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < w; c++) {
            float v = (float)h_unif(-range, range);
            if (edge_every && h_randint(1, edge_every) == 1)
                v = edge_value();
            put(tb, at(tb, r, c), v);
        }
}

/* e4m3 code values, for quotients on rounding ties */
static float e4m3_value(int code) { return mf_e4m3_to_f32((uint8_t)code); }

/*
 * quant input rows of G-wide groups built around the scale: each group is one of
 *  - amax exactly 448, 464 or 480 (s = 1, 464/448, 480/448), the others on code ties of s = 1;
 *  - amax = 448 * 2^k (1 + d) with d in {-2^-23, 0, 2^-23} (UE8M0 next to a power of two);
 *  - all zero; denormals only; amax at 2^-30; NaN and Inf among finite values; huge values;
 *  - uniform.
 */
static void fill_quant_rows(tbuf *tb, int64_t rows, int64_t H, int64_t G)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g0 = 0; g0 < H; g0 += G) {
            const int kind = (int)h_randint(0, 8);
            const float top[3] = {448.0f, 464.0f, 480.0f};
            const int k = (int)h_randint(-20, 20);
            const float pw = 448.0f * ldexpf(1.0f, k) * (1.0f + (float)h_randint(-1, 1) * 0x1p-23f);
            for (int64_t c = 0; c < G; c++) {
                float v;
                const int code = (int)h_randint(0, 0x7D);
                const float tie = 0.5f * (e4m3_value(code) + e4m3_value(code + 1));
                switch (kind) {
                case 0: v = c == 0 ? top[h_randint(0, 2)] : (h_randint(0, 1) ? tie : -tie); break;
                case 1: v = c == 0 ? pw : pw * (float)h_unif(-1, 1); break;
                case 2: v = 0.0f; break;
                case 3: v = bits_f32((uint32_t)h_randint(0, 0x7FFFFF)) * (h_randint(0, 1) ? 1 : -1); break;
                case 4: v = 0x1p-30f * (float)h_unif(-1, 1); break;
                case 5: v = h_randint(0, 7) == 0 ? edge_value() : (float)h_unif(-10, 10); break;
                case 6: v = (float)h_unif(-3.4e38, 3.4e38); break;
                default: v = (float)h_unif(-6, 6); break;
                }
                put(tb, at(tb, r, g0 + c), v);
            }
        }
}

/* ------------------------------------------------------------------- cases */

static const moefuse_dtype XDTS[] = {MOEFUSE_BF16, MOEFUSE_F32, MOEFUSE_F16};

/* A group size for H: one that divides it (H itself for odd H). */
static int64_t pick_group(int64_t H)
{
    const int64_t Gs[] = {32, 64, 128};
    const int64_t G = Gs[h_randint(0, 2)];
    return H % G == 0 && h_randint(0, 3) > 0 ? G : H;
}

/* silu_alpha's alpha: the default (0), gpt-oss's written out, or any other */
static float random_alpha(void)
{
    const int k = (int)h_randint(0, 2);
    return k == 0 ? 0.0f : k == 1 ? 1.702f : (float)h_unif(0.1, 4);
}

/* up_offset: none half the time, else gpt-oss's 1, a negative one or any */
static float random_up_offset(void)
{
    const int k = (int)h_randint(0, 5);
    return k < 3 ? 0.0f : k == 3 ? 1.0f : k == 4 ? -0.5f : (float)h_unif(-20, 20);
}

static moefuse_act_quant_options random_options(int64_t G, lay L, int fp8)
{
    moefuse_act_quant_options o = {0};
    const int pick = (int)h_randint(0, 5);
    o.act.activation = pick == 0   ? (moefuse_activation)h_randint(1, 2)
                       : pick == 1 ? MOEFUSE_ACT_SILU_ALPHA
                                   : MOEFUSE_ACT_SILU;
    if (o.act.activation == MOEFUSE_ACT_SILU_ALPHA)
        o.act.alpha = random_alpha();
    o.act.up_offset = random_up_offset();
    o.act.order = (moefuse_gate_order)h_randint(0, 2);
    o.act.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.5, 8) : 0.0f;
    o.act.intermediate = (moefuse_rounding)h_randint(0, 1);
    o.quant.group_size = G;
    o.quant.scale_layout = fp8 ? L.layout : MOEFUSE_SCALE_ROW_MAJOR;
    o.quant.ue8m0 = fp8 ? L.ue8m0 : 0;
    return o;
}

/* x rows: uniform, wide, tiny or edge-heavy */
static void fill_x(tbuf *x, int64_t rows, int64_t w)
{
    const float ranges[] = {4.0f, 30.0f, 100.0f, 1e-3f};
    fill_rows(x, rows, w, ranges[h_randint(0, 3)], (int)h_randint(0, 2) * 8);
}

static void fill_row_scale(tbuf *rs, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        put(rs, i, h_randint(0, 9) == 0 ? edge_value() : (float)h_unif(0.05, 3));
}

/* A quantizing case's group size, code type (FP8 three times in four, else i8) and scale
 * layout (any with FP8 codes, row-major f32 with i8), drawn in that order. */
typedef struct {
    int64_t G;
    int fp8;
    lay L;
} quant_pick;

static quant_pick pick_quant(int64_t H)
{
    quant_pick p;
    p.G = pick_group(H);
    p.fp8 = h_randint(0, 3) > 0;
    p.L = LAYS[p.fp8 ? h_randint(0, 4) : 0];
    return p;
}

/* One time in two a row scale [Tn] (fill_row_scale's values), else NULL. */
static tbuf *maybe_row_scale(int64_t Tn)
{
    if (!h_randint(0, 1))
        return NULL;
    tbuf *rs = tb_new1("row_scale", MOEFUSE_F32, Tn, 1);
    fill_row_scale(rs, Tn);
    tb_upload(rs);
    return rs;
}

static void case_act_quant(int64_t Tn, int64_t H)
{
    op_call c = {.op = OP_ACT_QUANT};
    const quant_pick p = pick_quant(H);
    const moefuse_dtype xdt = XDTS[h_randint(0, 2)];
    c.x = tb_new2("x", xdt, Tn, 2 * H, h_randint(0, 3), 1);
    fill_x(c.x, Tn, 2 * H);
    tb_upload(c.x);
    c.rs = maybe_row_scale(Tn);
    c.q = tb_new2("q", p.fp8 ? MOEFUSE_F8_E4M3 : MOEFUSE_I8, Tn, H, h_randint(0, 1) * 3, 0);
    c.scales = h_new_scales_of("scales", p.L, 0, Tn, H / p.G, h_randint(0, 1));
    c.o = random_options(p.G, p.L, p.fp8);
    snprintf(c.what, sizeof c.what, "act_quant T=%lld H=%lld G=%lld x=%d q=%s layout=%d ue8m0=%d act=%d alpha=%g beta=%g ord=%d lim=%g rnd=%d rs=%d",
             (long long)Tn, (long long)H, (long long)p.G, xdt, p.fp8 ? "f8" : "i8", p.L.layout,
             p.L.ue8m0, c.o.act.activation, c.o.act.alpha, c.o.act.up_offset, c.o.act.order,
             c.o.act.limit, c.o.act.intermediate, c.rs != NULL);
    compare_levels(&c);
}

static void case_masked(int64_t E, int64_t Tmax, int64_t H)
{
    op_call c = {.op = OP_MASKED};
    const int64_t G = pick_group(H);
    const lay L = LAYS[h_randint(0, 4)];
    const moefuse_dtype xdt = XDTS[h_randint(0, 2)];
    c.x = tb_new3("x", xdt, E, Tmax, 2 * H, h_randint(0, 2), 1);
    fill_x(c.x, E * Tmax, 2 * H);
    tb_upload(c.x);
    c.counts = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int64_t e = 0; e < E; e++) {
        const int32_t pick[] = {-1, 0, 1, (int32_t)Tmax, (int32_t)Tmax + 3, INT32_MIN, INT32_MAX,
                                (int32_t)h_randint(0, Tmax)};
        const int32_t n = pick[h_randint(0, 7)];
        memcpy(c.counts->full + c.counts->pad + 4 * e, &n, 4);
    }
    tb_upload(c.counts);
    if (h_randint(0, 1)) {
        c.rs = tb_new2("row_scale", MOEFUSE_F32, E, Tmax, 0, 1);
        fill_row_scale(c.rs, E * Tmax);
        tb_upload(c.rs);
    }
    if (h_randint(0, 1)) {
        c.es = tb_new1("expert_scale", h_randint(0, 1) ? MOEFUSE_F32 : MOEFUSE_BF16, E, 1);
        fill_row_scale(c.es, E);
        tb_upload(c.es);
    }
    c.q = tb_new3("q", MOEFUSE_F8_E4M3, E, Tmax, H, 0, 0);
    c.scales = h_new_scales_of("scales", L, E, Tmax, H / G, 0);
    c.o = random_options(G, L, 1);
    c.o.zero_tail = (int32_t)h_randint(0, 1);
    snprintf(c.what, sizeof c.what, "act_quant_masked E=%lld Tmax=%lld H=%lld G=%lld x=%d layout=%d ue8m0=%d act=%d alpha=%g beta=%g ord=%d lim=%g rnd=%d rs=%d es=%d zero_tail=%d",
             (long long)E, (long long)Tmax, (long long)H, (long long)G, xdt, L.layout, L.ue8m0,
             c.o.act.activation, c.o.act.alpha, c.o.act.up_offset, c.o.act.order, c.o.act.limit,
             c.o.act.intermediate, c.rs != NULL, c.es != NULL, c.o.zero_tail);
    compare_levels(&c);
}

static void case_quant(int64_t Tn, int64_t H)
{
    op_call c = {.op = OP_QUANT};
    const quant_pick p = pick_quant(H);
    const moefuse_dtype xdt = h_randint(0, 1) ? MOEFUSE_F32 : XDTS[h_randint(0, 2)];
    c.x = tb_new2("x", xdt, Tn, H, h_randint(0, 2), 1);
    if (h_randint(0, 1))
        fill_quant_rows(c.x, Tn, H, p.G);
    else
        fill_x(c.x, Tn, H);
    tb_upload(c.x);
    c.q = tb_new2("q", p.fp8 ? MOEFUSE_F8_E4M3 : MOEFUSE_I8, Tn, H, 0, 0);
    c.scales = h_new_scales_of("scales", p.L, 0, Tn, H / p.G, 0);
    c.o = random_options(p.G, p.L, p.fp8);
    snprintf(c.what, sizeof c.what, "quant T=%lld H=%lld G=%lld x=%d q=%s layout=%d ue8m0=%d",
             (long long)Tn, (long long)H, (long long)p.G, xdt, p.fp8 ? "f8" : "i8", p.L.layout,
             p.L.ue8m0);
    compare_levels(&c);
}

static void case_act_mul(int64_t Tn, int64_t H)
{
    op_call c = {.op = OP_ACT_MUL};
    const moefuse_dtype xdt = XDTS[h_randint(0, 2)];
    c.x = tb_new2("x", xdt, Tn, 2 * H, h_randint(0, 2), 1);
    fill_x(c.x, Tn, 2 * H);
    tb_upload(c.x);
    c.rs = maybe_row_scale(Tn);
    c.out = tb_new2("out", xdt, Tn, H, h_randint(0, 2), 0);
    c.o = random_options(32, LAYS[0], 1);
    snprintf(c.what, sizeof c.what, "act_mul T=%lld H=%lld x=%d act=%d alpha=%g beta=%g ord=%d lim=%g rnd=%d rs=%d",
             (long long)Tn, (long long)H, xdt, c.o.act.activation, c.o.act.alpha,
             c.o.act.up_offset, c.o.act.order, c.o.act.limit, c.o.act.intermediate, c.rs != NULL);
    compare_levels(&c);
}

static void case_dequant(int64_t Tn, int64_t H)
{
    op_call c = {.op = OP_DEQUANT};
    const quant_pick p = pick_quant(H);
    c.q = tb_new2("q", p.fp8 ? MOEFUSE_F8_E4M3 : MOEFUSE_I8, Tn, H, 0, 1);
    for (int64_t i = 0; i < Tn * H; i++) /* every code, NaN codes included */
        c.q->full[c.q->pad + i] = (unsigned char)h_randint(0, 255);
    tb_upload(c.q);
    c.scales = h_new_scales_of("scales", p.L, 0, Tn, H / p.G, 0);
    c.scales->is_input = 1;
    for (size_t b = c.scales->pad; b + c.scales->pad < c.scales->total; b++) { /* every byte */
        if (c.scales->t.dtype == MOEFUSE_F32 && (b - c.scales->pad) % 4 == 3)
            c.scales->full[b] = (unsigned char)(h_randint(0, 9) == 0 ? h_randint(0, 255)
                                                                       : h_randint(0x38, 0x40));
        else
            c.scales->full[b] = (unsigned char)h_randint(0, 255);
    }
    tb_upload(c.scales);
    c.out = tb_new2("out", XDTS[h_randint(0, 2)], Tn, H, h_randint(0, 2), 0);
    c.o = random_options(p.G, p.L, p.fp8);
    snprintf(c.what, sizeof c.what, "dequant T=%lld H=%lld G=%lld q=%s layout=%d ue8m0=%d out=%d",
             (long long)Tn, (long long)H, (long long)p.G, p.fp8 ? "f8" : "i8", p.L.layout,
             p.L.ue8m0, c.out->t.dtype);
    compare_levels(&c);
}

/* H values: odd and tiny ones (per-row groups), tails of every length class for 8 and 16
 * lanes, vector multiples */
static int64_t pick_hidden(void)
{
    const int64_t Hs[] = {1, 3, 7, 13, 17, 24, 33, 100, 128, 192, 200, 256, 384, 1000, 1024, 2048};
    return Hs[h_randint(0, 15)];
}

static int64_t pick_tokens(void)
{
    const int64_t Ts[] = {0, 1, 2, 3, 9, 24};
    return Ts[h_randint(0, 5)];
}

START_TEST(t_levels_available)
{
    /* the scalar level always exists and the active level is one of those this machine has */
    HCHECK(mf_cpu_row_kernels_of(MF_CPU_ISA_SCALAR) != NULL, "no scalar level");
    const mf_cpu_row_kernels *k = mf_cpu_row_kernels_active();
    HCHECK(mf_cpu_row_kernels_of(k->isa) == k, "active level %s is not available", k->name);
    for (int lvl = 0; lvl < MF_CPU_ISA_COUNT; lvl++)
        fprintf(stderr, "test_cpu_isa: level %s %s\n", mf_cpu_isa_name((mf_cpu_isa)lvl),
                mf_cpu_row_kernels_of((mf_cpu_isa)lvl) ? "available" : "not available here");
}
END_TEST

/* The 2-D row operations, each on its number of random (tokens, hidden) shapes. */
static const struct {
    void (*run)(int64_t Tn, int64_t H);
    int cases;
} ROW_OPS[] = {
    {case_act_quant, 400},
    {case_quant, 500},
    {case_act_mul, 400},
    {case_dequant, 400},
};

/* a loop test: _i picks the operation (each iteration a test of its own, the RNG restarted) */
START_TEST(t_random_rows)
{
    for (int i = 0; i < ROW_OPS[_i].cases; i++)
        ROW_OPS[_i].run(pick_tokens(), pick_hidden());
}
END_TEST

START_TEST(t_masked)
{
    for (int i = 0; i < 300; i++)
        case_masked(h_randint(1, 5), h_randint(1, 13), pick_hidden());
}
END_TEST

/* A model-sized row or two, so that long rows and many groups are covered. */
START_TEST(t_wide_rows)
{
    case_act_quant(2, 7168);
    case_quant(3, 7168);
    case_act_mul(2, 7168);
    case_masked(2, 3, 7168);
    case_dequant(2, 7168);
}
END_TEST

/*
 * The 16-lane text against the scalar level, kernel by kernel, on random plans: every
 * option, group size and H (odd ones included), random bit patterns among the inputs.
 */
START_TEST(t_sixteen_lanes)
{
    const mf_cpu_row_kernels *ref = mf_cpu_row_kernels_of(MF_CPU_ISA_SCALAR), *k = &w16_rows;
    for (int it = 0; it < 1500; it++) {
        mf_row_plan p = {0};
        const int mode = (int)h_randint(0, 2); /* act_quant, quant, act_mul */
        p.hidden = pick_hidden();
        p.group = pick_group(p.hidden);
        p.groups = p.hidden / p.group;
        p.in_dtype = XDTS[h_randint(0, 2)];
        p.activate = mode != 1;
        p.order = (int)h_randint(0, 2);
        const int pick = (int)h_randint(0, 5);
        p.activation = pick == 0 ? (int)h_randint(1, 2)
                       : pick == 1 ? MOEFUSE_ACT_SILU_ALPHA : MOEFUSE_ACT_SILU;
        if (p.activation == MOEFUSE_ACT_SILU_ALPHA) /* as the core fills it in */
            p.alpha = h_randint(0, 1) ? 1.702f : (float)h_unif(0.1, 4);
        p.up_offset = random_up_offset();
        p.limit = h_randint(0, 2) == 0 ? (float)h_unif(0.5, 8) : 0.0f;
        p.has_row_scale = h_randint(0, 1);
        p.has_expert_scale = h_randint(0, 1);
        p.round_bf16 = h_randint(0, 1);
        p.ue8m0 = h_randint(0, 1);
        p.eps = 1e-10f;
        p.out_dtype = mode == 2 ? XDTS[h_randint(0, 2)]
                                : (h_randint(0, 3) ? MOEFUSE_F8_E4M3 : MOEFUSE_I8);
        if (p.activate && p.in_dtype == MOEFUSE_BF16) /* as rows.c plans it */
            p.act_table = mf_cpu_act_table(p.activation);
        const int64_t H = p.hidden, w = p.activate ? 2 * H : H;
        const size_t esz = p.in_dtype == MOEFUSE_F32 ? 4 : 2;
        tbuf *x = tb_new2("x", p.in_dtype, 1, w, 0, 1); /* its host bytes are the row */
        if (mode == 1 && h_randint(0, 1))
            fill_quant_rows(x, 1, H, p.group);
        else
            fill_x(x, 1, w);
        for (int64_t i = 0; i < w; i++)
            if (h_randint(0, 40) == 0)
                for (size_t b = 0; b < esz; b++)
                    x->full[x->pad + i * esz + b] = (unsigned char)h_randint(0, 255);
        const float rs = h_randint(0, 9) ? (float)h_unif(0.05, 3) : edge_value();
        const float es = h_randint(0, 9) ? (float)h_unif(0.05, 3) : edge_value();
        const size_t ob = (size_t)H * 4 + 64, sb = (size_t)p.groups * 4;
        unsigned char *oa = malloc(ob), *ok = malloc(ob), *ua = malloc(p.groups), *uk = malloc(p.groups);
        float *sa = malloc(sb), *sk = malloc(sb);
        float *scratch = malloc((size_t)mf_row_scratch_floats(&p) * sizeof(float));
        memset(oa, 0x5A, ob);
        memset(ok, 0x5A, ob);
        const void *xr = x->full + x->pad;
        if (mode == 2) {
            ref->act_mul_row(&p, xr, rs, es, oa, scratch);
            k->act_mul_row(&p, xr, rs, es, ok, scratch);
        } else {
            ref->quant_row(&p, xr, rs, es, oa, sa, ua, scratch);
            k->quant_row(&p, xr, rs, es, ok, sk, uk, scratch);
        }
        HCHECK(memcmp(oa, ok, ob) == 0 &&
                   (mode == 2 || (memcmp(sa, sk, sb) == 0 && memcmp(ua, uk, (size_t)p.groups) == 0)),
               "16 lanes differ from scalar: mode %d H=%lld G=%lld x=%d out=%d act=%d alpha=%g beta=%g ord=%d lim=%g rs=%d(%g) es=%d(%g) rnd=%d ue8m0=%d",
               mode, (long long)H, (long long)p.group, p.in_dtype, p.out_dtype, p.activation,
               p.alpha, p.up_offset, p.order, p.limit, p.has_row_scale, rs, p.has_expert_scale, es,
               p.round_bf16, p.ue8m0);
        /* dequant of the same bytes, as codes, with a random scale */
        const float s = h_randint(0, 9) ? (float)h_unif(1e-3, 10) : edge_value();
        const moefuse_dtype odt = XDTS[h_randint(0, 2)];
        const int fp8 = (int)h_randint(0, 1);
        memset(oa, 0x5A, ob);
        memset(ok, 0x5A, ob);
        ref->dequant_span(xr, fp8, s, H, odt, oa);
        k->dequant_span(xr, fp8, s, H, odt, ok);
        HCHECK(memcmp(oa, ok, ob) == 0, "16 lanes differ from scalar: dequant H=%lld fp8=%d s=%g out=%d",
               (long long)H, fp8, s, odt);
        free(oa), free(ok), free(ua), free(uk), free(sa), free(sk), free(scratch);
        tb_free_all();
    }
    /* exp on every 4099th f32 and on the edges */
    float *xs = malloc(sizeof(float) << 20), *ya = malloc(sizeof(float) << 20), *yk = malloc(sizeof(float) << 20);
    for (int64_t i = 0; i < (1 << 20); i++)
        xs[i] = i < 64 ? edge_value() : bits_f32((uint32_t)(i * 4099u));
    ref->exp_array(xs, ya, 1 << 20);
    k->exp_array(xs, yk, 1 << 20);
    HCHECK(memcmp(ya, yk, sizeof(float) << 20) == 0, "16 lanes differ from scalar: exp");
    free(xs), free(ya), free(yk);
}
END_TEST

/*
 * Every bf16 gate (65536 in one row of bf16 x) at every vector level and at 16 lanes: the
 * table path (mf_act_table.h) for the covered gates, the reference for the others, each
 * activation, without options and with intermediate rounding and a row scale.
 */
START_TEST(t_every_bf16_gate)
{
    const int64_t H = 65536, G = 128;
    uint16_t *x = malloc((size_t)H * 4);
    for (int64_t k = 0; k < H; k++) {
        x[k] = (uint16_t)((uint32_t)k * 0x9E37u); /* odd factor: every pattern once */
        x[H + k] = (uint16_t)mf_f32_to_bf16(h_randint(0, 99) ? (float)h_unif(-3, 3) : edge_value());
    }
    const mf_cpu_row_kernels *ref = mf_cpu_row_kernels_of(MF_CPU_ISA_SCALAR);
    const mf_cpu_row_kernels *levels[3] = {&w16_rows, mf_cpu_row_kernels_of(MF_CPU_ISA_AVX2),
                                           mf_cpu_row_kernels_of(MF_CPU_ISA_AVX512)};
    const size_t ob = (size_t)H * 4, sb = (size_t)(H / G) * 4;
    unsigned char *oa = malloc(ob), *ok = malloc(ob), *ua = malloc((size_t)(H / G)),
                  *uk = malloc((size_t)(H / G));
    float *sa = malloc(sb), *sk = malloc(sb), *scratch = malloc((size_t)H * 12);
    int compared = 0;
    for (int act = 0; act < 4; act++)
        for (int opt = 0; opt < 3; opt++) {
            mf_row_plan p = {0};
            p.hidden = H, p.group = G, p.groups = H / G;
            p.in_dtype = MOEFUSE_BF16;
            p.activate = true;
            p.order = MOEFUSE_GATE_FIRST;
            p.activation = act;
            p.alpha = act == MOEFUSE_ACT_SILU_ALPHA ? 1.702f : 0.0f;
            p.round_bf16 = opt == 1, p.has_row_scale = opt == 1;
            p.up_offset = opt == 2 ? 1.0f : 0.0f; /* the table path with gpt-oss's offset */
            p.eps = 1e-10f;
            p.act_table = mf_cpu_act_table(act); /* none for silu_alpha: computed */
            const float rs = 0.75f;
            for (int l = 0; l < 3; l++) {
                const mf_cpu_row_kernels *k = levels[l];
                if (k == NULL)
                    continue;
                p.out_dtype = MOEFUSE_F8_E4M3;
                ref->quant_row(&p, x, rs, 1.0f, oa, sa, ua, scratch);
                k->quant_row(&p, x, rs, 1.0f, ok, sk, uk, scratch);
                HCHECK(memcmp(oa, ok, (size_t)H) == 0 && memcmp(sa, sk, sb) == 0,
                       "every bf16 gate, act %d opt %d: %s quant_row differs from scalar", act, opt,
                       k == &w16_rows ? "16 lanes" : k->name);
                p.out_dtype = MOEFUSE_F32;
                ref->act_mul_row(&p, x, rs, 1.0f, oa, scratch);
                k->act_mul_row(&p, x, rs, 1.0f, ok, scratch);
                HCHECK(memcmp(oa, ok, ob) == 0, "every bf16 gate, act %d opt %d: %s act_mul_row differs",
                       act, opt, k == &w16_rows ? "16 lanes" : k->name);
                compared++;
            }
        }
    HCHECK(mf_cpu_act_table(MOEFUSE_ACT_SILU_ALPHA) == NULL,
           "silu_alpha has a table, which could not know the call's alpha");
    fprintf(stderr, "every bf16 gate: %d (level, activation, options) triples equal to scalar\n", compared);
    free(x), free(oa), free(ok), free(ua), free(uk), free(sa), free(sk), free(scratch);
}
END_TEST

/* ------------------------------------------------------- exhaustive exp */

static int exp_all(void)
{
    int failed = 0;
    for (int lvl = MF_CPU_ISA_SCALAR + 1; lvl < MF_CPU_ISA_COUNT; lvl++) {
        const mf_cpu_row_kernels *k = mf_cpu_row_kernels_of((mf_cpu_isa)lvl);
        if (k == NULL) {
            printf("exp, %s: not available on this machine\n", mf_cpu_isa_name((mf_cpu_isa)lvl));
            continue;
        }
        unsigned long long bad = 0;
        const int64_t chunk = 1 << 16;
#pragma omp parallel reduction(+ : bad)
        {
            float *x = malloc((size_t)chunk * sizeof *x), *y = malloc((size_t)chunk * sizeof *y);
#pragma omp for schedule(dynamic, 16)
            for (int64_t hi = 0; hi < (1 << 16); hi++) {
                for (int64_t i = 0; i < chunk; i++)
                    x[i] = bits_f32((uint32_t)(hi << 16 | i));
                k->exp_array(x, y, chunk);
                for (int64_t i = 0; i < chunk; i++) {
                    const float r = mf_exp_f32(x[i]);
                    if (memcmp(&r, &y[i], sizeof r) != 0) {
                        if (bad < 5)
                            printf("exp, %s: x = %a (0x%08llx): vector %a, mf_exp_f32 %a\n",
                                   k->name, x[i], (unsigned long long)(hi << 16 | i), y[i], r);
                        bad++;
                    }
                }
            }
            free(x);
            free(y);
        }
        printf("exp, %s: %llu of 2^32 inputs differ from mf_exp_f32\n", k->name, bad);
        failed |= bad != 0;
    }
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--exp-all") == 0)
        return exp_all();
    Suite *s = suite_create("cpu_isa");
    TCase *tc = h_add_tcase(s, "cpu_isa", h_setup, 240);
    tcase_add_test(tc, t_levels_available);
    tcase_add_loop_test(tc, t_random_rows, 0, sizeof ROW_OPS / sizeof ROW_OPS[0]);
    tcase_add_test(tc, t_masked);
    tcase_add_test(tc, t_wide_rows);
    tcase_add_test(tc, t_sixteen_lanes);
    tcase_add_test(tc, t_every_bf16_gate);
    return h_run(s);
}
