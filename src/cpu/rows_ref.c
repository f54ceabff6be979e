/*
 * The scalar row kernels: the readable text of docs/NUMERICS.md ("Gated
 * activation", "Per-token-group quantization"), one channel at a time. They
 * are the reference the vector kernels (rows_simd.h) are tested against, and
 * the level MOEFUSE_CPU_ISA=scalar runs.
 */
#include "cpu/activation.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "cpu/tensor_cpu.h"

#include <math.h>

#if defined(__GNUC__)
#define MF_NOINLINE __attribute__((noinline))
#else
#define MF_NOINLINE
#endif

/*
 * h of one channel: clamp, activation, product, factors, intermediate rounding. Never
 * inlined, so that there is one compiled copy: which NaN a product of two NaNs keeps
 * depends on how the compiler placed the operands, and every level must keep the same.
 */
MF_NOINLINE float mf_cpu_h_channel(const mf_row_plan *p, float g, float u, float rs, float es)
{
    if (p->limit > 0.0f) {
        g = mf_clamp_gate(g, p->limit);
        u = mf_clamp_up(u, p->limit);
    }
    u = mf_add_up_offset(u, p->up_offset);
    float a = mf_activate((moefuse_activation)p->activation, p->alpha, g);
    if (p->round_bf16)
        a = mf_round_bf16(a);
    float h = a * u;
    if (p->has_row_scale)
        h = h * rs;
    if (p->has_expert_scale)
        h = h * es;
    if (p->round_bf16)
        h = mf_round_bf16(h);
    return h;
}

/* h[0..H) of one row in f32; xbuf holds 2H floats. */
static void h_row(const mf_row_plan *p, const void *x, float rs, float es, float *restrict xbuf,
                  float *restrict h)
{
    const int64_t H = p->hidden;
    if (!p->activate) {
        mf_load_row(h, x, p->in_dtype, H);
        return;
    }
    mf_load_row(xbuf, x, p->in_dtype, 2 * H);
    const float *g = xbuf + mf_gate_at(p->order, H), *u = xbuf + mf_up_at(p->order, H);
    const int64_t step = mf_gate_step(p->order);
    for (int64_t c = 0; c < H; c++)
        h[c] = mf_cpu_h_channel(p, g[c * step], u[c * step], rs, es);
}

static void quant_row_scalar(const mf_row_plan *p, const void *x, float rs, float es, void *q,
                             float *s, uint8_t *ue, float *scratch)
{
    const int64_t H = p->hidden, G = p->group;
    float *h = scratch + 2 * H;
    h_row(p, x, rs, es, scratch, h);
    const bool fp8 = p->out_dtype == MOEFUSE_F8_E4M3;
    for (int64_t g = 0; g < p->groups; g++) {
        const float *hg = h + g * G;
        float amax = 0.0f;
        for (int64_t c = 0; c < G; c++) {
            float v = hg[c];
            if (isfinite(v)) {
                float av = fabsf(v);
                amax = av > amax ? av : amax;
            }
        }
        const float sg = mf_group_scale(p, amax, &ue[g]);
        s[g] = sg;
        if (fp8) {
            uint8_t *qg = (uint8_t *)q + g * G;
            for (int64_t c = 0; c < G; c++)
                qg[c] = mf_e4m3_code(hg[c], sg);
        } else {
            int8_t *qg = (int8_t *)q + g * G;
            for (int64_t c = 0; c < G; c++)
                qg[c] = mf_i8_code(hg[c], sg);
        }
    }
}

static void act_mul_row_scalar(const mf_row_plan *p, const void *x, float rs, float es, void *out,
                               float *scratch)
{
    const int64_t H = p->hidden;
    float *h = scratch + 2 * H;
    h_row(p, x, rs, es, scratch, h);
    mf_store_row(out, h, p->out_dtype, H);
}

static void dequant_span_scalar(const void *q, bool fp8, float s, int64_t n,
                                moefuse_dtype out_dtype, void *out)
{
    const int64_t osz = (int64_t)mf_cpu_elem_size(out_dtype);
    for (int64_t c = 0; c < n; c++) {
        const uint8_t b = ((const uint8_t *)q)[c];
        const float v = fp8 ? mf_e4m3_to_f32(b) : (float)(int8_t)b;
        mf_store_elem((char *)out + c * osz, out_dtype, v * s);
    }
}

static void exp_array_scalar(const float *x, float *y, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = mf_exp_f32(x[i]);
}

const mf_cpu_row_kernels mf_cpu_rows_scalar = {
    MF_CPU_ISA_SCALAR,   "scalar",         quant_row_scalar,
    act_mul_row_scalar, dequant_span_scalar, exp_array_scalar,
    NULL, /* the packed GEMM */
    NULL,    /* its panels packed by a scalar loop */
};
