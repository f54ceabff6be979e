/*
 * moefuse example: quantize an activation to FP8 with column-major scales, then
 * run a tiny MoE layer. Works on any backend: data goes through moefuse_buffer_*.
 * Build: cc example.c $(pkg-config --cflags --libs moefuse) -o example
 */
#include <moefuse.h>

#include <stdio.h>
#include <stdlib.h>

/* Print what went wrong and leave. */
#define CHECK(ctx, call)                                                                   \
    do {                                                                                   \
        moefuse_status st_ = (call);                                                       \
        if (st_ != MOEFUSE_OK) {                                                           \
            fprintf(stderr, "%s failed: %s: %s\n", #call, moefuse_status_name(st_),      \
                    moefuse_last_error(ctx));                                              \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* A backend buffer holding a copy of `bytes` of host data. */
static void *upload(moefuse_context *ctx, const void *src, size_t bytes)
{
    void *buf;
    CHECK(ctx, moefuse_buffer_alloc(ctx, bytes, &buf));
    CHECK(ctx, moefuse_buffer_write(ctx, buf, 0, src, bytes));
    return buf;
}

int main(void)
{
    moefuse_context *ctx;
    /* NULL: the MOEFUSE_BACKEND environment variable, else "auto". */
    if (moefuse_context_create(&ctx, NULL) != MOEFUSE_OK) {
        fprintf(stderr, "no context: %s\n", moefuse_last_error(NULL));
        return 1;
    }
    printf("backend %s on %s\n", moefuse_backend_name(ctx), moefuse_device_name(ctx));

    /* ---- 1. silu(gate) * up, quantized to FP8 e4m3 in groups of 128 ---- */
    enum { T = 3, H = 256, G = 128, GN = H / G, TA = (T + 3) / 4 * 4 };
    static float x[T][2 * H];
    for (int t = 0; t < T; t++)
        for (int c = 0; c < 2 * H; c++)
            x[t][c] = (float)((t + 1) * (c % 17) - 8) / 8.0f; /* gate = x[:, :H], up = x[:, H:] */

    void *x_buf = upload(ctx, x, sizeof x);
    void *q_buf, *s_buf;
    CHECK(ctx, moefuse_buffer_alloc(ctx, T * H, &q_buf));                /* one byte a code */
    CHECK(ctx, moefuse_buffer_alloc(ctx, GN * TA * sizeof(float), &s_buf));

    int64_t x_shape[2] = {T, 2 * H}, q_shape[2] = {T, H};
    int64_t s_shape[2] = {GN, TA}; /* column-major ("MN-major"): T padded to a multiple of 4 */
    moefuse_tensor tx = moefuse_tensor_dense(x_buf, MOEFUSE_F32, 2, x_shape);
    moefuse_tensor tq = moefuse_tensor_dense(q_buf, MOEFUSE_F8_E4M3, 2, q_shape);
    moefuse_tensor ts = moefuse_tensor_dense(s_buf, MOEFUSE_F32, 2, s_shape);

    moefuse_act_quant_options aq = {0}; /* zero = defaults: silu, gate first, G = 128, eps */
    aq.quant.scale_layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    CHECK(ctx, moefuse_act_quant(ctx, &tx, NULL, &tq, &ts, &aq));

    float scales[GN][TA];
    unsigned char codes[T][H];
    CHECK(ctx, moefuse_buffer_read(ctx, s_buf, 0, scales, sizeof scales));
    CHECK(ctx, moefuse_buffer_read(ctx, q_buf, 0, codes, sizeof codes));
    for (int t = 0; t < T; t++)
        printf("row %d: scales %.6g %.6g, first codes 0x%02x 0x%02x\n", t, scales[0][t],
               scales[1][t], codes[t][0], codes[t][1]);

    /* A wrong call is refused with a message, and writes nothing. */
    int64_t bad_shape[2] = {T, H - 1};
    moefuse_tensor bad = moefuse_tensor_dense(q_buf, MOEFUSE_F8_E4M3, 2, bad_shape);
    moefuse_status st = moefuse_act_quant(ctx, &tx, NULL, &bad, &ts, &aq);
    printf("wrong q shape -> %s: %s\n", moefuse_status_name(st), moefuse_last_error(ctx));
    if (st == MOEFUSE_OK)
        return 1;

    /* ---- 2. a tiny MoE layer: M = 2 tokens, E = 4 experts, top-2, K = 8, I = 4 ---- */
    enum { M = 2, E = 4, TOPK = 2, K = 8, I = 4 };
    static float xm[M][K], w1[E][2 * I][K], w2[E][K][I];
    for (int m = 0; m < M; m++)
        for (int c = 0; c < K; c++)
            xm[m][c] = 0.25f * (float)(c - 2 * m);
    for (int e = 0; e < E; e++) {
        for (int r = 0; r < 2 * I; r++)
            for (int c = 0; c < K; c++)
                w1[e][r][c] = 0.5f * (float)((e + r + c) % 5 - 2);
        for (int c = 0; c < K; c++)
            for (int i = 0; i < I; i++)
                w2[e][c][i] = 0.5f * (float)((e * c + i) % 3 - 1);
    }
    int32_t ids[M][TOPK] = {{0, 3}, {2, -1}}; /* -1: an empty slot, skipped */
    float wts[M][TOPK] = {{0.75f, 0.25f}, {1.0f, 0.0f}};

    int64_t xs[2] = {M, K}, w1s[3] = {E, 2 * I, K}, w2s[3] = {E, K, I}, rs[2] = {M, TOPK};
    moefuse_tensor txm = moefuse_tensor_dense(upload(ctx, xm, sizeof xm), MOEFUSE_F32, 2, xs);
    moefuse_tensor tw1 = moefuse_tensor_dense(upload(ctx, w1, sizeof w1), MOEFUSE_F32, 3, w1s);
    moefuse_tensor tw2 = moefuse_tensor_dense(upload(ctx, w2, sizeof w2), MOEFUSE_F32, 3, w2s);
    moefuse_routing route = {0}; /* expert_map left absent: E_global = E */
    route.topk_ids = moefuse_tensor_dense(upload(ctx, ids, sizeof ids), MOEFUSE_I32, 2, rs);
    route.topk_weights = moefuse_tensor_dense(upload(ctx, wts, sizeof wts), MOEFUSE_F32, 2, rs);
    void *out_buf;
    CHECK(ctx, moefuse_buffer_alloc(ctx, sizeof(float) * M * K, &out_buf));
    moefuse_tensor tout = moefuse_tensor_dense(out_buf, MOEFUSE_F32, 2, xs);

    /* No biases (NULL), default options (NULL): silu, gate rows first. */
    CHECK(ctx, moefuse_moe_forward(ctx, &txm, &tw1, &tw2, NULL, NULL, &route, &tout, NULL));
    CHECK(ctx, moefuse_synchronize(ctx));

    float out[M][K];
    CHECK(ctx, moefuse_buffer_read(ctx, out_buf, 0, out, sizeof out));
    for (int m = 0; m < M; m++) {
        printf("out[%d] =", m);
        for (int c = 0; c < K; c++)
            printf(" %+.5f", out[m][c]);
        printf("\n");
    }

    /* Buffers belong to the context: free them before destroying it. */
    CHECK(ctx, moefuse_buffer_free(ctx, x_buf));
    CHECK(ctx, moefuse_buffer_free(ctx, q_buf));
    CHECK(ctx, moefuse_buffer_free(ctx, s_buf));
    CHECK(ctx, moefuse_buffer_free(ctx, out_buf));
    CHECK(ctx, moefuse_buffer_free(ctx, txm.data));
    CHECK(ctx, moefuse_buffer_free(ctx, tw1.data));
    CHECK(ctx, moefuse_buffer_free(ctx, tw2.data));
    CHECK(ctx, moefuse_buffer_free(ctx, route.topk_ids.data));
    CHECK(ctx, moefuse_buffer_free(ctx, route.topk_weights.data));
    moefuse_context_destroy(ctx);
    return 0;
}
