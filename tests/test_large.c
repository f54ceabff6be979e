/*
 * A tensor of more than 2^31 elements: act_quant on x [131073, 16384] bf16,
 * whose last row starts at element 2^31, so any 32-bit index arithmetic in a
 * kernel would read or write the wrong row. The rows on both sides of that
 * boundary are compared with the CPU backend run on just those rows, and a
 * canary after q must survive.
 *
 * It moves 4.3 GB, so it runs on the cuda backend, and on the others only
 * with MOEFUSE_TEST_LARGE=1; otherwise the program reports SKIP.
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"

enum { H = 8192, G = 128, GN = H / G, CANARY = 256 };
static const int64_t ROWS = ((int64_t)1 << 17) + 1; /* row ROWS-1 of x starts at element 2^31 */

static uint16_t pattern_bf16(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    /* bf16 in about [-4, 4]: sign, exponent 120..128, random mantissa */
    uint16_t sign = (uint16_t)((*s >> 8) & 0x8000u);
    uint16_t exp = (uint16_t)(120u + (*s >> 20) % 9u);
    return (uint16_t)(sign | (exp << 7) | ((*s >> 40) & 0x7Fu));
}

/* act_quant on the cpu backend for rows [r0, r0 + n) of the host copy of x. */
static void cpu_rows(const uint16_t *x, int64_t r0, int64_t n, uint8_t *q, float *s)
{
    moefuse_context *cpu;
    ck_assert_int_eq(moefuse_context_create(&cpu, "cpu"), MOEFUSE_OK);
    int64_t xs[2] = {n, 2 * H}, qs[2] = {n, H}, ss[2] = {n, GN};
    moefuse_tensor xt = moefuse_tensor_dense((void *)(x + r0 * 2 * H), MOEFUSE_BF16, 2, xs);
    moefuse_tensor qt = moefuse_tensor_dense(q, MOEFUSE_F8_E4M3, 2, qs);
    moefuse_tensor st = moefuse_tensor_dense(s, MOEFUSE_F32, 2, ss);
    moefuse_status status = moefuse_act_quant(cpu, &xt, NULL, &qt, &st, NULL);
    HCHECK(status == MOEFUSE_OK, "cpu act_quant: %s", moefuse_last_error(cpu));
    moefuse_context_destroy(cpu);
}

START_TEST(t_act_quant_past_2e31)
{
    const size_t x_elems = (size_t)ROWS * 2 * H, q_bytes = (size_t)ROWS * H;
    ck_assert(x_elems > ((size_t)1 << 31));
    uint16_t *x = malloc(x_elems * sizeof *x);
    ck_assert_msg(x != NULL, "cannot allocate %zu bytes of host memory", x_elems * 2);
    uint64_t s = g_seed | 1;
    for (size_t i = 0; i < x_elems; i++)
        x[i] = pattern_bf16(&s);

    void *xb, *qb, *sb;
    ck_assert_int_eq(moefuse_buffer_alloc(g_ctx, x_elems * 2, &xb), MOEFUSE_OK);
    ck_assert_int_eq(moefuse_buffer_alloc(g_ctx, q_bytes + CANARY, &qb), MOEFUSE_OK);
    ck_assert_int_eq(moefuse_buffer_alloc(g_ctx, (size_t)ROWS * GN * 4, &sb), MOEFUSE_OK);
    ck_assert_int_eq(moefuse_buffer_write(g_ctx, xb, 0, x, x_elems * 2), MOEFUSE_OK);
    unsigned char canary[CANARY], after[CANARY];
    for (int i = 0; i < CANARY; i++)
        canary[i] = (unsigned char)(0xA7 ^ (i * 31));
    ck_assert_int_eq(moefuse_buffer_write(g_ctx, qb, q_bytes, canary, CANARY), MOEFUSE_OK);

    int64_t xs[2] = {ROWS, 2 * H}, qs[2] = {ROWS, H}, ss[2] = {ROWS, GN};
    moefuse_tensor xt = moefuse_tensor_dense(xb, MOEFUSE_BF16, 2, xs);
    moefuse_tensor qt = moefuse_tensor_dense(qb, MOEFUSE_F8_E4M3, 2, qs);
    moefuse_tensor st = moefuse_tensor_dense(sb, MOEFUSE_F32, 2, ss);
    moefuse_status status = moefuse_act_quant(g_ctx, &xt, NULL, &qt, &st, NULL);
    HCHECK(status == MOEFUSE_OK, "act_quant on %s: %s", h_backend(), moefuse_last_error(g_ctx));
    ck_assert_int_eq(moefuse_synchronize(g_ctx), MOEFUSE_OK);

    ck_assert_int_eq(moefuse_buffer_read(g_ctx, qb, q_bytes, after, CANARY), MOEFUSE_OK);
    HCHECK(memcmp(canary, after, CANARY) == 0, "the canary after q changed");

    /* rows 0-1 and the last three (the last one entirely past element 2^31) */
    const int64_t firsts[2] = {0, ROWS - 3}, counts[2] = {2, 3};
    for (int part = 0; part < 2; part++) {
        const int64_t r0 = firsts[part], n = counts[part];
        uint8_t *qd = malloc((size_t)n * H), *qc = malloc((size_t)n * H);
        float *sd = malloc((size_t)n * GN * 4), *sc = malloc((size_t)n * GN * 4);
        ck_assert(qd && qc && sd && sc);
        ck_assert_int_eq(moefuse_buffer_read(g_ctx, qb, (size_t)r0 * H, qd, (size_t)n * H),
                         MOEFUSE_OK);
        ck_assert_int_eq(moefuse_buffer_read(g_ctx, sb, (size_t)r0 * GN * 4, sd,
                                             (size_t)n * GN * 4),
                         MOEFUSE_OK);
        cpu_rows(x, r0, n, qc, sc);
        int64_t apart = 0;
        for (int64_t i = 0; i < n * H; i++) {
            if (qd[i] == qc[i])
                continue;
            /* SPEC 5: one code apart, same sign, on at most 0.01% of the codes */
            int dist = abs((int)(qd[i] & 0x7F) - (int)(qc[i] & 0x7F));
            HCHECK((qd[i] & 0x80) == (qc[i] & 0x80) && dist == 1,
                   "row %lld channel %lld: code 0x%02x, cpu 0x%02x", (long long)(r0 + i / H),
                   (long long)(i % H), qd[i], qc[i]);
            apart++;
        }
        HCHECK(apart * 10000 <= n * H, "%lld codes one apart in %lld", (long long)apart,
               (long long)(n * H));
        for (int64_t i = 0; i < n * GN; i++) {
            uint32_t a, b;
            memcpy(&a, &sd[i], 4);
            memcpy(&b, &sc[i], 4);
            HCHECK(a == b || a == b + 1 || a + 1 == b, "row %lld group %lld: scale %a, cpu %a",
                   (long long)(r0 + i / GN), (long long)(i % GN), sd[i], sc[i]);
        }
        free(qd), free(qc), free(sd), free(sc);
    }
    moefuse_buffer_free(g_ctx, xb);
    moefuse_buffer_free(g_ctx, qb);
    moefuse_buffer_free(g_ctx, sb);
    free(x);
}
END_TEST

int main(void)
{
    const char *large = getenv("MOEFUSE_TEST_LARGE");
    if (strcmp(h_backend(), "cuda") != 0 && !(large && strcmp(large, "1") == 0)) {
        printf("SKIP: the 4.3 GB case runs on cuda, or with MOEFUSE_TEST_LARGE=1 (backend %s)\n",
               h_backend());
        return 77;
    }
    Suite *s = suite_create("large");
    TCase *tc = tcase_create("large");
    tcase_add_checked_fixture(tc, h_setup, h_teardown);
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, t_act_quant_past_2e31);
    suite_add_tcase(s, tc);
    return h_run(s);
}
