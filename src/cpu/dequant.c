/* dequant: out = f32(q) * s, rounded once to out's dtype, one group at a time by the row
 * kernels of the chosen instruction-set level (rows_isa.h). */
#include "cpu/cpu_internal.h"
#include "cpu/numerics.h"
#include "cpu/rows_isa.h"
#include "cpu/scales.h"
#include "cpu/tensor_cpu.h"

static float read_scale(const mf_dequant_args *a, int64_t t, int64_t g)
{
    return mf_scale_read(&a->scales, a->quant.scale_layout, 0, t, g);
}

moefuse_status mf_cpu_dequant(moefuse_context *ctx, void *state, const mf_dequant_args *a)
{
    (void)ctx;
    (void)state;
    const int64_t T = a->rows, H = a->hidden, G = a->group, Gn = a->groups;
    const bool fp8 = a->q.dtype == MOEFUSE_F8_E4M3;
    const mf_cpu_row_kernels *kern = mf_cpu_row_kernels_active();
    const int64_t osz = (int64_t)mf_cpu_elem_size(a->out.dtype);
MF_OMP(parallel for schedule(static))
    for (int64_t t = 0; t < T; t++) {
        const char *q = mf_at2(&a->q, t, 0);
        char *out = mf_at2(&a->out, t, 0);
        for (int64_t g = 0; g < Gn; g++) {
            const int64_t c0 = g * G, n = H - c0 < G ? H - c0 : G;
            kern->dequant_span(q + c0, fp8, read_scale(a, t, g), n, a->out.dtype, out + c0 * osz);
        }
    }
    return MOEFUSE_OK;
}
