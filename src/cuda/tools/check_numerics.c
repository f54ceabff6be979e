/*
 * Host check of the CUDA backend's numerics (src/cuda/numerics.cuh), which
 * are __host__ __device__ code in f32 with explicit fmaf: the host result is
 * the device result. Not part of the build. From the repository root:
 *
 *   gcc -O2 -std=c11 -ffp-contract=off -fno-fast-math -fopenmp -Iinclude -Isrc \
 *       src/cuda/tools/check_numerics.c -lm \
 *       -o /tmp/check_numerics && /tmp/check_numerics [--quick]
 *
 * 1. mf_exp_f32 (src/numerics/mf_exp.h: every backend's exp) against
 *    exp((double)x) for every float in [-104, 89] (about 2.2e9 inputs;
 *    --quick takes every 61st): the largest error in ulps of the exact value
 *    (must be < 0.53 for normal results, < 1 for subnormal ones), how many
 *    results are not the correctly rounded one, and the special cases.
 * 2. (The conversions are src/numerics/mf_convert.h, the one text every backend compiles;
 *    tools/device_check.cu holds the device's hardware shortcuts to them.)
 * 3. mf_div_scale (one division per group, Markstein's correction per element)
 *    against the IEEE quotient h / s, for every float h with |h| <= 448 s for
 *    a set of s, and for random (h, s): the same bits wherever |h / s| >= 2^-24,
 *    the same e4m3/i8 codes and sign below (codes are 0 there).
 * 4. The activation tables of the table kernels (act_table.cuh): for every
 *    bf16 gate in either half of a word, the lookup misses exactly outside
 *    the covered magnitudes, and otherwise reads the entry that holds
 *    mf_activate_f32 of that gate; mf_act8_table's h is act(g) * u.
 * Exit status 0 when everything holds.
 */
#include "cuda/act_table.cuh"
#include "cuda/numerics.cuh"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

static double ulp_of(double v) /* ulp of the f32 grid at |v| */
{
    v = fabs(v);
    if (v < 0x1p-126)
        return 0x1p-149;
    int e;
    frexp(v, &e); /* v = f * 2^e, f in [0.5, 1) */
    return ldexp(1.0, e - 1 - 23);
}

static float exp_shared(float x) { return mf_exp_f32(x); }

static void check_exp(int quick, float (*fn)(float), const char *name)
{
    const uint32_t step = quick ? 61u : 1u;
    /* [+0, 89] and [-0, -104] as bit ranges */
    const uint32_t ranges[2][2] = {{0x00000000u, 0x42B20000u}, {0x80000000u, 0xC2D00000u}};
    double worst = 0.0, worst_sub = 0.0;
    float worst_x = 0.0f;
    long long not_cr = 0, count = 0, bad_overflow = 0;
    for (int rg = 0; rg < 2; rg++) {
        const int64_t lo = ranges[rg][0], hi = ranges[rg][1];
#pragma omp parallel
        {
            double w = 0.0, ws = 0.0;
            float wx = 0.0f;
            long long ncr = 0, cnt = 0, bov = 0;
#pragma omp for schedule(dynamic, 65536)
            for (int64_t b = lo; b <= hi; b += step) {
                const float x = mf_bits_f32((uint32_t)b);
                const float y = fn(x);
                const double ref = exp((double)x);
                cnt++;
                if (ref >= 0x1p128 * (1.0 - 0x1p-25)) { /* rounds to Inf */
                    bov += !(isinf(y) && y > 0);
                    continue;
                }
                const double err = fabs((double)y - ref) / ulp_of(ref);
                if (ref < 0x1p-126) {
                    ws = err > ws ? err : ws;
                } else if (err > w) {
                    w = err;
                    wx = x;
                }
                ncr += y != (float)ref;
            }
#pragma omp critical
            {
                if (w > worst) {
                    worst = w;
                    worst_x = wx;
                }
                worst_sub = ws > worst_sub ? ws : worst_sub;
                not_cr += ncr;
                count += cnt;
                bad_overflow += bov;
            }
        }
    }
    /* special values, as glibc's expf */
    const float specials[] = {INFINITY, -INFINITY, 0.0f, -0.0f, 0x1.62e42ep+6f, 0x1.62e430p+6f,
                              -0x1.9fe368p+6f, -0x1.9fe36ap+6f, -104.0f, -1000.0f, 1000.0f};
    int bad_special = 0;
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) {
        const float x = specials[i];
        const float y = fn(x), r = (float)exp((double)x);
        if (memcmp(&y, &r, 4) != 0 && !(y == r)) {
            printf("  special: exp(%a) = %a, expected %a\n", (double)x, (double)y, (double)r);
            bad_special++;
        }
    }
    const float nan = mf_bits_f32(0x7FC00000u);
    bad_special += !mf_is_nan(fn(nan));
    printf("%s: %lld inputs in [-104, 89]%s: max error %.4f ulp at x = %a (%.9g) for normal "
           "results, %.4f ulp for subnormal ones; %lld (%.4f%%) not correctly rounded; overflow "
           "mismatches %lld; special cases wrong %d\n",
           name, count, quick ? " (every 61st float)" : "", worst, (double)worst_x, (double)worst_x,
           worst_sub, not_cr, 100.0 * (double)not_cr / (double)count, bad_overflow, bad_special);
    if (worst >= 0.53 || worst_sub >= 1.0 || bad_overflow || bad_special) {
        printf("%s: FAILED\n", name);
        failures++;
    }
}

/* One (h, s) pair: 0 if mf_div_scale agrees with h / s. */
static int div_case(float h, float s, float y)
{
    const float q = mf_div_scale(h, s, y), r = h / s;
    if (fabsf(r) >= 0x1p-24f) /* any quotient that can give a nonzero code: the same bits */
        return memcmp(&q, &r, 4) != 0;
    /* far below the smallest code (e4m3 2^-10, i8 0.5): the same codes and sign; such
     * quotients may come from subnormal h, where the residual is not exact */
    return mf_f32_to_e4m3(q) != mf_f32_to_e4m3(r) || mf_f32_to_i8(q) != mf_f32_to_i8(r) ||
           signbit(q) != signbit(r);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void check_division(int quick)
{
    /* scales as the kernels make them: amax / 448, amax / 127, powers of two, extremes */
    const float amaxes[] = {1.0f, 3.0f, 0.123456789f, 1e-10f, 5.75e7f, 1.0000001f, 448.0f,
                            0x1.fffffep+0f};
    const uint32_t step = quick ? 97u : 1u;
    long long bad = 0, count = 0;
    for (size_t i = 0; i < sizeof amaxes / sizeof amaxes[0]; i++)
        for (int kind = 0; kind < 3; kind++) {
            float s = kind == 0 ? amaxes[i] / 448.0f : kind == 1 ? amaxes[i] / 127.0f
                                                                   : mf_bits_f32(mf_ue8m0_exponent(amaxes[i] / 448.0f) << 23);
            if (!mf_scale_fast_ok(s))
                continue;
            const float y = 1.0f / s;
            /* up to the group's amax, which may lie an ulp or two above 448 s when s = amax / 448
             * rounded down: four ulps past 448 s */
            const float bound = 448.0f * s;
            const uint32_t top = mf_f32_bits(bound) + 4u;
            long long b_local = 0, c_local = 0;
#pragma omp parallel for schedule(dynamic, 65536) reduction(+ : b_local, c_local)
            for (int64_t b = 0; b <= (int64_t)top; b += step) {
                const float h = mf_bits_f32((uint32_t)b);
                b_local += div_case(h, s, y) + div_case(-h, s, y);
                c_local += 2;
            }
            bad += b_local;
            count += c_local;
        }
    /* random scales over the whole fast range, random h with |h| <= 448 s */
    const long long nrand = quick ? 2000000 : 200000000;
    long long bad_r = 0;
    for (long long i = 0; i < nrand; i++) {
        uint64_t v = rng();
        float s = mf_bits_f32((uint32_t)(((uint32_t)(v >> 40) % (120u << 23)) + (67u << 23)));
        if (!mf_scale_fast_ok(s))
            continue;
        const float y = 1.0f / s;
        float h = s * ldexpf((float)((v & 0xFFFFFF) | 1) / 16777216.0f, (int)((v >> 24) % 40) - 39) * 448.0f;
        if (fabsf(h) > 448.0f * s)
            h = 448.0f * s;
        bad_r += div_case(h, s, y) + div_case(-h, s, y);
        count += 2;
        /* the group's own amax: s = RN(amax / 448) for an amax near s * 448, and h = amax */
        const float amax = mf_bits_f32(mf_f32_bits(448.0f * s) + (uint32_t)(v >> 60) % 5u - 2u);
        const float sa = amax / 448.0f;
        if (mf_scale_fast_ok(sa)) {
            bad_r += div_case(amax, sa, 1.0f / sa) + div_case(-amax, sa, 1.0f / sa);
            count += 2;
        }
    }
    printf("scale division: %lld (h, s) pairs%s: %lld differ from h / s (exhaustive part %lld, "
           "random %lld)\n",
           count, quick ? " (sampled)" : "", bad + bad_r, bad, bad_r);
    if (bad + bad_r) {
        printf("scale division: FAILED\n");
        failures++;
    }
}

static void check_act_tables(void)
{
    static float tab[MF_TAB_SMEM_SPAN / 4]; /* the shared-memory layout, gap included */
    long long bad = 0, covered = 0;
    for (int act = 0; act < MF_TAB_ACTS; act++) {
        for (uint32_t j = 0; j < MF_TAB_ENTRIES; j++)
            tab[mf_tab_smem_offset(j) / 4] = mf_act_table_entry(act, j);
        for (uint32_t b = 0; b < 0x10000u; b++) {
            const uint32_t m = b & 0x7FFFu;
            const int in = m >= MF_TAB_LO && m < MF_TAB_LO + MF_TAB_SPAN;
            const float a = mf_activate_f32(act, 0.0f, mf_bf16_to_f32(b));
            for (int half = 0; half < 2; half++) {
                /* the other half of the word holds a gate that is covered (1.0) */
                const uint32_t w = half ? (b << 16) | 0x3F80u : 0x3F800000u | b;
                const uint32_t gw[4] = {w, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
                const float u[8] = {1.5f, 1.5f, 1, 1, 1, 1, 1, 1};
                float h[8];
                const int hit = mf_act8_table((const char *)tab, gw, u, h);
                covered += hit;
                if (hit != in || (hit && mf_f32_bits(h[half]) != mf_f32_bits(a * 1.5f))) {
                    if (bad++ < 5)
                        printf("  act %d gate 0x%04x (half %d): hit %d, expected %d, h %a, act*u %a\n",
                               act, (unsigned)b, half, hit, in, hit ? (double)h[half] : 0.0,
                               (double)(a * 1.5f));
                }
            }
        }
    }
    printf("activation tables: %lld of %d lookups covered, %lld wrong\n", covered,
           MF_TAB_ACTS * 2 * 0x10000, bad);
    if (bad) {
        failures++;
        printf("activation tables: FAILED\n");
    }
}

int main(int argc, char **argv)
{
    const int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    check_act_tables();
    check_division(quick);
    check_exp(quick, exp_shared, "mf_exp_f32");
    printf(failures ? "check_numerics: %d FAILED\n" : "check_numerics: all passed\n", failures);
    return failures ? 1 : 0;
}
