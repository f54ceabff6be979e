/*
 * Proof of the accuracy of moefuse's erf and tanh (src/numerics/mf_erf_tanh.h)
 * over every f32: each result against erf()/tanh() in double, in ulps of the
 * exact value; how many are not the correctly rounded one; odd symmetry bit
 * for bit; the special values. Not part of the build. From the repository root:
 *
 *   gcc -O2 -std=c11 -ffp-contract=off -fno-fast-math -fopenmp -Isrc \
 *       src/numerics/tools/check_erf_tanh.c -lm -o /tmp/check_erf_tanh && \
 *       /tmp/check_erf_tanh [--quick]
 *
 * (--quick takes every 97th float.) Exit status 0 when every result is
 * within MAX_ULP and the properties hold.
 */
#include "numerics/mf_erf_tanh.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define MAX_ULP 1.0 /* faithful: never a whole ulp off */

static double ulp_of(double v) /* ulp of the f32 grid at |v| */
{
    v = fabs(v);
    if (v < 0x1p-126)
        return 0x1p-149;
    int e;
    frexp(v, &e);
    return ldexp(1.0, e - 24);
}

static int check(const char *name, float (*fn)(float), double (*ref)(double), int quick)
{
    const uint64_t step = quick ? 97 : 1;
    double worst = 0.0;
    uint32_t worst_b = 0;
    long long not_cr = 0, count = 0, asym = 0;
#pragma omp parallel
    {
        double w = 0.0;
        uint32_t wb = 0;
        long long ncr = 0, cnt = 0, as = 0;
#pragma omp for schedule(dynamic, 1 << 16)
        for (int64_t b = 0; b < 0x7F800000; b += (int64_t)step) { /* +0 .. largest finite */
            const float x = mf_bits_f32((uint32_t)b);
            const float y = fn(x), yn = fn(-x);
            as += mf_f32_bits(yn) != (mf_f32_bits(y) ^ 0x80000000u);
            const double r = ref((double)x);
            const double err = fabs((double)y - r) / ulp_of(r);
            if (err > w) {
                w = err;
                wb = (uint32_t)b;
            }
            ncr += y != (float)r;
            cnt++;
        }
#pragma omp critical
        {
            if (w > worst) {
                worst = w;
                worst_b = wb;
            }
            not_cr += ncr;
            count += cnt;
            asym += as;
        }
    }
    int bad_special = 0;
    const float inf = mf_bits_f32(0x7F800000u), nan = mf_bits_f32(0x7FC12345u);
    bad_special += fn(inf) != 1.0f || fn(-inf) != -1.0f;
    bad_special += mf_f32_bits(fn(0.0f)) != 0u || mf_f32_bits(fn(-0.0f)) != 0x80000000u;
    bad_special += mf_f32_bits(fn(nan)) != 0x7FC12345u;
    bad_special += mf_f32_bits(fn(-nan)) != 0xFFC12345u;
    bad_special += mf_f32_bits(fn(mf_bits_f32(0x7F812345u))) != 0x7FC12345u; /* signalling */
    const float wx = mf_bits_f32(worst_b);
    printf("%s: %lld inputs%s: max error %.4f ulp at x = %a; %lld (%.4f%%) not correctly rounded; "
           "%lld not odd; special cases wrong %d\n",
           name, count * 2, quick ? " (every 97th)" : " (every f32)", worst, (double)wx, not_cr,
           100.0 * (double)not_cr / (double)count, asym, bad_special);
    return worst >= MAX_ULP || asym || bad_special;
}

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int fail = check("mf_erf_f32", mf_erf_f32, erf, quick);
    fail |= check("mf_tanh_f32", mf_tanh_f32, tanh, quick);
    printf(fail ? "check_erf_tanh: FAILED\n" : "check_erf_tanh: all passed\n");
    return fail;
}
