/*
 * `moefuse prove`: shows, for every one of the 2^32 f32 inputs, that a
 * backend's activation gives the bits of the library's own definition
 * (src/numerics/mf_activation.h, docs/NUMERICS.md). It runs act_mul with
 * f32 in and out, g = every bit pattern and u = 1 (h = act(g) * 1 = act(g),
 * NaN bits included), through the public API, so what is proved is the
 * kernel a user calls; the reference is the header text evaluated here.
 */
#include "numerics/mf_activation.h"
#include "tools.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROVE_ROWS 4096
#define PROVE_WIDTH 4096 /* g values per row: a call covers 2^24 patterns */
#define PROVE_CHUNK ((uint64_t)PROVE_ROWS * PROVE_WIDTH)

void help_prove(void)
{
    printf("usage: moefuse prove [--backend NAME] [--act silu|gelu|gelu_tanh|silu_alpha|all]\n"
           "                     [--every N]\n"
           "\n"
           "Runs act_mul over all 2^32 f32 gate values (up = 1, f32 out) on the backend and\n"
           "compares every result, bit for bit, with the library's definition of the activation\n"
           "(docs/NUMERICS.md); silu_alpha with its default alpha, 1.702. --every N checks one\n"
           "chunk of 2^24 values in N (a quick look).\n"
           "Exit status 0 when no value differs.\n");
}

static const char *const act_names[] = {"silu", "gelu", "gelu_tanh", "silu_alpha"};
#define PROVE_ACTS 4

/* The activation of the definition, with the alpha the call gets (the default). */
static float reference(int act, float g)
{
    return mf_activate_f32(act, act == MF_ACT_SILU_ALPHA ? MOEFUSE_SILU_ALPHA_DEFAULT : 0.0f, g);
}

/* Run one chunk (patterns base .. base + 2^24 - 1); return the number of differing values. */
static int64_t prove_chunk(moefuse_context *ctx, int act, uint64_t base, float *x, float *out,
                           void *dx, void *dout, int64_t *reported)
{
    const size_t xbytes = (size_t)PROVE_CHUNK * 2 * sizeof(float);
    const size_t obytes = (size_t)PROVE_CHUNK * sizeof(float);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < PROVE_ROWS; r++) {
        float *row = x + r * 2 * PROVE_WIDTH;
        for (int64_t c = 0; c < PROVE_WIDTH; c++) {
            row[c] = mf_bits_f32((mf_u32)(base + (uint64_t)(r * PROVE_WIDTH + c)));
            row[PROVE_WIDTH + c] = 1.0f;
        }
    }
    moefuse_status st = moefuse_buffer_write(ctx, dx, 0, x, xbytes);
    if (st != MOEFUSE_OK)
        return -report_failure(ctx, "buffer_write", st);
    const int64_t xs[2] = {PROVE_ROWS, 2 * PROVE_WIDTH}, os[2] = {PROVE_ROWS, PROVE_WIDTH};
    const moefuse_tensor tx = moefuse_tensor_dense(dx, MOEFUSE_F32, 2, xs);
    const moefuse_tensor to = moefuse_tensor_dense(dout, MOEFUSE_F32, 2, os);
    moefuse_act_options opt;
    memset(&opt, 0, sizeof opt);
    opt.activation = (moefuse_activation)act;
    st = moefuse_act_mul(ctx, &tx, NULL, &to, &opt);
    if (st == MOEFUSE_OK)
        st = moefuse_buffer_read(ctx, dout, 0, out, obytes);
    if (st != MOEFUSE_OK)
        return -report_failure(ctx, "act_mul", st);
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t i = 0; i < (int64_t)PROVE_CHUNK; i++) {
        const float g = mf_bits_f32((mf_u32)(base + (uint64_t)i));
        bad += mf_f32_bits(out[i]) != mf_f32_bits(reference(act, g));
    }
    /* the first few differences, found again serially (rare: only on failure) */
    for (int64_t i = 0; bad && i < (int64_t)PROVE_CHUNK && *reported < 5; i++) {
        const float g = mf_bits_f32((mf_u32)(base + (uint64_t)i));
        const float want = reference(act, g);
        if (mf_f32_bits(out[i]) != mf_f32_bits(want)) {
            printf("  %s(%a): backend 0x%08X, definition 0x%08X\n", act_names[act], (double)g,
                   (unsigned)mf_f32_bits(out[i]), (unsigned)mf_f32_bits(want));
            (*reported)++;
        }
    }
    return bad;
}

int cmd_prove(int argc, char **argv)
{
    const char *backend = NULL, *which = "all";
    int64_t every = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (is_help(a)) {
            help_prove();
            return 0;
        }
        if (!v) {
            fprintf(stderr, "moefuse prove: %s needs a value (see --help)\n", a);
            return 2;
        }
        if (strcmp(a, "--backend") == 0)
            backend = v;
        else if (strcmp(a, "--act") == 0)
            which = v;
        else if (strcmp(a, "--every") == 0) {
            if (parse_i64("--every", v, &every) != 0 || every < 1)
                return 2;
        } else {
            fprintf(stderr, "moefuse prove: unknown option '%s' (see --help)\n", a);
            return 2;
        }
        i++;
    }
    int first = 0, last = PROVE_ACTS - 1;
    if (strcmp(which, "all") != 0) {
        first = -1;
        for (int k = 0; k < PROVE_ACTS; k++)
            if (strcmp(which, act_names[k]) == 0)
                first = last = k;
        if (first < 0) {
            fprintf(stderr, "moefuse prove: --act must be silu, gelu, gelu_tanh, silu_alpha or "
                            "all\n");
            return 2;
        }
    }
    moefuse_context *ctx = NULL;
    moefuse_status st = moefuse_context_create(&ctx, backend);
    if (st != MOEFUSE_OK) {
        fprintf(stderr, "moefuse prove: no context for backend '%s': %s\n",
                backend ? backend : "auto", moefuse_last_error(NULL));
        return 1;
    }
    const size_t xbytes = (size_t)PROVE_CHUNK * 2 * sizeof(float);
    const size_t obytes = (size_t)PROVE_CHUNK * sizeof(float);
    float *x = malloc(xbytes), *out = malloc(obytes);
    void *dx = NULL, *dout = NULL;
    int rc = 1;
    if (!x || !out) {
        fprintf(stderr, "moefuse prove: out of host memory\n");
        goto done;
    }
    if ((st = moefuse_buffer_alloc(ctx, xbytes, &dx)) != MOEFUSE_OK ||
        (st = moefuse_buffer_alloc(ctx, obytes, &dout)) != MOEFUSE_OK) {
        report_failure(ctx, "buffer_alloc", st);
        goto done;
    }
    printf("backend: %s (%s)\n", moefuse_backend_name(ctx), moefuse_device_name(ctx));
    rc = 0;
    for (int act = first; act <= last; act++) {
        int64_t bad = 0, reported = 0, chunks = 0;
        for (uint64_t base = 0; base < (1ull << 32); base += PROVE_CHUNK * (uint64_t)every) {
            const int64_t b = prove_chunk(ctx, act, base, x, out, dx, dout, &reported);
            if (b < 0) {
                rc = 1;
                goto done;
            }
            bad += b;
            chunks++;
        }
        printf("%s: %lld values checked (%s), %lld differ from the definition\n", act_names[act],
               (long long)(chunks * (int64_t)PROVE_CHUNK),
               every == 1 ? "every f32" : "sampled", (long long)bad);
        rc |= bad != 0;
    }
done:
    if (dx)
        moefuse_buffer_free(ctx, dx);
    if (dout)
        moefuse_buffer_free(ctx, dout);
    free(x);
    free(out);
    moefuse_context_destroy(ctx);
    return rc;
}
