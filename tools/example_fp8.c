/*
 * moefuse example: a DeepSeek-style FP8 MoE layer. Router (topk_softmax), FP8 weights with one
 * scale per 128 x 128 block, a bf16 x quantized inside moe_forward_fp8 with the workspace sized
 * up front; then the same layer from an x already in FP8 (as a dispatch hands it over), and the
 * masked layout of expert parallelism. Works on any backend: data goes through moefuse_buffer_*.
 * Build: cc example_fp8.c $(pkg-config --cflags --libs moefuse) -o example_fp8
 */
#include <moefuse.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(ctx, call)                                                                   \
    do {                                                                                   \
        moefuse_status st_ = (call);                                                       \
        if (st_ != MOEFUSE_OK) {                                                           \
            fprintf(stderr, "%s failed: %s: %s\n", #call, moefuse_status_name(st_),      \
                    moefuse_last_error(ctx));                                              \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

enum { M = 4, K = 256, I = 128, E = 4, TOPK = 2, TMAX = 3 };

/* A backend buffer of `bytes`, holding a copy of src when it is not NULL. */
static void *buffer(moefuse_context *ctx, const void *src, size_t bytes)
{
    void *buf;
    CHECK(ctx, moefuse_buffer_alloc(ctx, bytes, &buf));
    if (src)
        CHECK(ctx, moefuse_buffer_write(ctx, buf, 0, src, bytes));
    return buf;
}

static moefuse_tensor tensor(void *buf, moefuse_dtype dt, int32_t rank, int64_t a, int64_t b,
                             int64_t c)
{
    const int64_t shape[3] = {a, b, c};
    return moefuse_tensor_dense(buf, dt, rank, shape);
}

/* bf16 bits of a float (round to nearest even; the values here are finite). */
static uint16_t bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* FP8 weight codes [E, N, D] (e4m3 bytes between -1.75 and 1.75, never NaN) and one f32 scale
 * per 128 x 128 block: what a checkpoint stores for each expert. */
static moefuse_tensor fp8_weights(moefuse_context *ctx, int64_t n, int64_t d, int seed,
                                  moefuse_tensor *scales)
{
    size_t count = (size_t)(E * n * d), blocks = (size_t)(E * (n / 128) * (d / 128));
    uint8_t *codes = malloc(count);
    float *s = malloc(blocks * sizeof *s);
    for (size_t i = 0; i < count; i++)
        codes[i] = (uint8_t)(((i * 2654435761u + (size_t)seed) >> 7) % 0x3F | (i & 0x80));
    for (size_t b = 0; b < blocks; b++)
        s[b] = 0.002f * (float)(1 + (b + (size_t)seed) % 3);
    *scales = tensor(buffer(ctx, s, blocks * sizeof *s), MOEFUSE_F32, 3, E, n / 128, d / 128);
    moefuse_tensor w = tensor(buffer(ctx, codes, count), MOEFUSE_F8_E4M3, 3, E, n, d);
    free(codes);
    free(s);
    return w;
}

static void print_row(const char *what, const uint16_t *row)
{
    printf("%s", what);
    for (int c = 0; c < 4; c++) {
        uint32_t u = (uint32_t)row[c] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        printf(" %+.5f", f);
    }
    printf(" ...\n");
}

int main(void)
{
    moefuse_context *ctx;
    if (moefuse_context_create(&ctx, NULL) != MOEFUSE_OK) {
        fprintf(stderr, "no context: %s\n", moefuse_last_error(NULL));
        return 1;
    }
    printf("backend %s\n", moefuse_backend_name(ctx));

    /* ---- the layer's operands: bf16 activations, FP8 experts, router logits ---- */
    static uint16_t x[M][K];
    static float logits[M][E];
    for (int m = 0; m < M; m++) {
        for (int c = 0; c < K; c++)
            x[m][c] = bf16((float)((m * 7 + c * 3) % 23 - 11) / 8.0f);
        for (int e = 0; e < E; e++)
            logits[m][e] = (float)((m + 1) * (e + 2) % 5);
    }
    moefuse_tensor w1s, w2s;
    moefuse_tensor w1 = fp8_weights(ctx, 2 * I, K, 1, &w1s); /* [E, 2I, K], gate rows first */
    moefuse_tensor w2 = fp8_weights(ctx, K, I, 2, &w2s);     /* [E, K, I] */
    moefuse_tensor tx = tensor(buffer(ctx, x, sizeof x), MOEFUSE_BF16, 2, M, K, 0);
    moefuse_tensor tl = tensor(buffer(ctx, logits, sizeof logits), MOEFUSE_F32, 2, M, E, 0);

    /* ---- router: softmax, top-2, renormalized ---- */
    moefuse_routing route = {0};
    route.topk_ids = tensor(buffer(ctx, NULL, M * TOPK * 4), MOEFUSE_I32, 2, M, TOPK, 0);
    route.topk_weights = tensor(buffer(ctx, NULL, M * TOPK * 4), MOEFUSE_F32, 2, M, TOPK, 0);
    CHECK(ctx, moefuse_topk_softmax(ctx, &tl, 1, &route.topk_ids, &route.topk_weights));

    /* ---- the layer from bf16 x: quantized per 1 x 128 group inside the call ---- */
    moefuse_fp8_moe_options opt = {0}; /* silu, gate first; f32 row-major activation scales */
    moefuse_tensor out = tensor(buffer(ctx, NULL, sizeof x), MOEFUSE_BF16, 2, M, K, 0);
    size_t bytes;
    CHECK(ctx, moefuse_moe_forward_fp8_workspace_size(ctx, &tx, NULL, &w1, &w1s, &w2, &w2s, NULL,
                                                      NULL, &route, &out, &opt, &bytes));
    printf("moe_forward_fp8 takes %zu bytes of workspace here\n", bytes);
    moefuse_tensor ws = tensor(buffer(ctx, NULL, bytes ? bytes : 1), MOEFUSE_U8, 1,
                               (int64_t)bytes, 0, 0);
    CHECK(ctx, moefuse_set_workspace(ctx, &ws)); /* no call allocates from here on */
    CHECK(ctx, moefuse_moe_forward_fp8(ctx, &tx, NULL, &w1, &w1s, &w2, &w2s, NULL, NULL, &route,
                                       &out, &opt));

    /* ---- the same layer from an x already in FP8, with its group scales [M, K/128] ---- */
    moefuse_tensor xq = tensor(buffer(ctx, NULL, M * K), MOEFUSE_F8_E4M3, 2, M, K, 0);
    moefuse_tensor xs = tensor(buffer(ctx, NULL, M * (K / 128) * 4), MOEFUSE_F32, 2, M, K / 128, 0);
    CHECK(ctx, moefuse_quant(ctx, &tx, &xq, &xs, &opt.act)); /* as a dispatch would send it */
    moefuse_tensor out2 = tensor(buffer(ctx, NULL, sizeof x), MOEFUSE_BF16, 2, M, K, 0);
    CHECK(ctx, moefuse_moe_forward_fp8(ctx, &xq, &xs, &w1, &w1s, &w2, &w2s, NULL, NULL, &route,
                                       &out2, &opt));
    CHECK(ctx, moefuse_set_workspace(ctx, NULL)); /* the context's own scratch again */

    static uint16_t y[M][K], y2[M][K];
    CHECK(ctx, moefuse_buffer_read(ctx, out.data, 0, y, sizeof y));
    CHECK(ctx, moefuse_buffer_read(ctx, out2.data, 0, y2, sizeof y2));
    print_row("out[0] =", y[0]);
    printf("from an FP8 x: %s\n", memcmp(y, y2, sizeof y) ? "different" : "the same bits");

    /* ---- expert parallel: each local expert's tokens in [E, Tmax, K], counts [E] ---- */
    static uint16_t xe[E][TMAX][K];
    for (int e = 0; e < E; e++)
        for (int t = 0; t < TMAX; t++)
            memcpy(xe[e][t], x[(e + t) % M], sizeof xe[e][t]);
    const int32_t counts[E] = {3, 0, 1, 2}; /* rows t >= counts[e] are neither read nor written */
    moefuse_tensor txe = tensor(buffer(ctx, xe, sizeof xe), MOEFUSE_BF16, 3, E, TMAX, K);
    moefuse_tensor tc = tensor(buffer(ctx, counts, sizeof counts), MOEFUSE_I32, 1, E, 0, 0);
    moefuse_tensor oute = tensor(buffer(ctx, NULL, sizeof xe), MOEFUSE_BF16, 3, E, TMAX, K);
    CHECK(ctx, moefuse_moe_masked_fp8(ctx, &txe, NULL, &tc, &w1, &w1s, &w2, &w2s, NULL, NULL,
                                      &oute, &opt));
    static uint16_t ye[E][TMAX][K];
    CHECK(ctx, moefuse_buffer_read(ctx, oute.data, 0, ye, sizeof ye));
    print_row("masked out[0][0] =", ye[0][0]);

    void *buffers[] = {w1.data, w1s.data, w2.data, w2s.data, tx.data, tl.data,
                       route.topk_ids.data, route.topk_weights.data, out.data, ws.data, xq.data,
                       xs.data, out2.data, txe.data, tc.data, oute.data};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++)
        CHECK(ctx, moefuse_buffer_free(ctx, buffers[i]));
    moefuse_context_destroy(ctx);
    return 0;
}
