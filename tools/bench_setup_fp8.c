/*
 * `moefuse bench` setup of the block-scaled FP8 MoE ops (moe_forward_fp8, moe_masked_fp8):
 * e4m3 weights with their block scales, x in bf16 or FP8, and the FLOPs and weight bytes.
 */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The FP8 MoE ops: FP8 weights with f32 block scales; bf16 x (or FP8 x with its scales). */
int bench_setup_fp8(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    b->fp8 = 1;
    b->masked = strcmp(name, "moe_masked_fp8") == 0;
    int64_t xq = 0, ue8m0 = 0, T = 0, shared = 0;
    if (shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
        shape_int(s, name, "K", -1, MAX_DIM, &b->K) != 0 ||
        shape_int(s, name, "I", -1, MAX_DIM, &b->I) != 0)
        return -1;
    if (b->masked) {
        if (shape_int(s, name, "Tmax", -1, MAX_DIM, &T) != 0 ||
            shape_int(s, name, "valid", T, T, &b->valid) != 0)
            return -1;
        b->M = T;
        b->k = 1;
    } else if (shape_int(s, name, "M", -1, MAX_DIM, &b->M) != 0 ||
               shape_int(s, name, "k", -1, 1 << 20, &b->k) != 0 ||
               shape_int(s, name, "xq", 0, 1, &xq) != 0 ||
               shape_int(s, name, "ue8m0", 0, 1, &ue8m0) != 0) {
        return -1;
    }
    /* shared=S: S shared experts after the E routed ones */
    if (!b->masked && shape_count(s, name, "shared", 64, &shared) != 0)
        return -1;
    if (b->K % 128 || b->I % 128 || (!b->masked && b->k > b->E)) {
        fprintf(stderr, "moefuse bench: FP8 MoE needs K and I multiples of 128 and k <= E\n");
        return -1;
    }
    const int64_t M = b->M, k = b->k, K = b->K, I = b->I, E = b->E + shared;
    b->fo.act.ue8m0 = (int32_t)ue8m0;
    printf("weights: %.2f GB in f8_e4m3 with f32 128x128 block scales\n",
           (double)(E * 3 * I * K) / 1e9);
    if (shared)
        printf("shared experts: %lld after the %lld routed (routing.n_shared), every token's "
               "slots %lld + %lld\n",
               (long long)shared, (long long)b->E, (long long)k, (long long)shared);
    void *dw1 = bench_fp8_codes(b, E * 2 * I * K, 32), *dw2 = bench_fp8_codes(b, E * K * I, 33);
    if (!dw1 || !dw2)
        return -1;
    int64_t w1s[3] = {E, 2 * I, K}, w2s[3] = {E, K, I};
    b->w1 = moefuse_tensor_dense(dw1, MOEFUSE_F8_E4M3, 3, w1s);
    b->w2 = moefuse_tensor_dense(dw2, MOEFUSE_F8_E4M3, 3, w2s);
    b->w1s = bench_block_scales(b, E, 2 * I, K, 34);
    b->w2s = bench_block_scales(b, E, K, I, 35);
    if (!b->w1s.data || !b->w2s.data)
        return -1;
    int64_t slots;
    if (b->masked) {
        int64_t xs[3] = {E, T, K}, cs[1] = {E};
        int32_t *counts = malloc((size_t)E * sizeof *counts);
        if (!counts)
            return -1;
        for (int64_t e = 0; e < E; e++)
            counts[e] = (int32_t)b->valid;
        void *dc = bench_upload(b, counts, (size_t)E * sizeof *counts);
        free(counts);
        void *dx = bench_random(b, MOEFUSE_BF16, E * T * K, 1.0f, 31);
        void *dout = bench_alloc(b, (size_t)(E * T * K) * 2);
        if (!dc || !dx || !dout)
            return -1;
        b->counts = moefuse_tensor_dense(dc, MOEFUSE_I32, 1, cs);
        b->x = moefuse_tensor_dense(dx, MOEFUSE_BF16, 3, xs);
        b->out = moefuse_tensor_dense(dout, MOEFUSE_BF16, 3, xs);
        slots = E * b->valid;
        b->weight_bytes = b->valid > 0 ? (double)(E * 3 * I * K) : 0.0;
    } else {
        int32_t *ids;
        float *wts;
        int64_t distinct;
        if (draw_routing(M, k, b->E, &ids, &wts, &distinct) != 0)
            return -1;
        if (bench_router(b, s, ids) != 0) {
            free(ids), free(wts);
            return -1;
        }
        int64_t rs[2] = {M, k}, xs[2] = {M, K}, ss[2] = {M, K / 128};
        void *di = bench_upload(b, ids, (size_t)(M * k) * 4);
        void *dw = bench_upload(b, wts, (size_t)(M * k) * 4);
        free(ids), free(wts);
        void *dout = bench_alloc(b, (size_t)(M * K) * 2);
        if (!di || !dw || !dout)
            return -1;
        b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
        b->route.topk_weights = moefuse_tensor_dense(dw, MOEFUSE_F32, 2, rs);
        b->out = moefuse_tensor_dense(dout, MOEFUSE_BF16, 2, xs);
        void *dx = xq ? bench_fp8_codes(b, M * K, 31) : bench_random(b, MOEFUSE_BF16, M * K,
                                                                      1.0f, 31);
        if (!dx)
            return -1;
        b->x = moefuse_tensor_dense(dx, xq ? MOEFUSE_F8_E4M3 : MOEFUSE_BF16, 2, xs);
        if (xq) {
            float *sc = malloc((size_t)(M * (K / 128)) * sizeof *sc);
            if (!sc)
                return -1;
            for (int64_t i = 0; i < M * (K / 128); i++)
                sc[i] = 0.01f;
            void *dsc = bench_upload(b, sc, (size_t)(M * (K / 128)) * sizeof *sc);
            free(sc);
            if (!dsc)
                return -1;
            b->xs = moefuse_tensor_dense(dsc, MOEFUSE_F32, 2, ss);
        }
        b->route.n_shared = (int32_t)shared;
        slots = M * (k + shared);
        b->weight_bytes = (double)(distinct + (M > 0 ? shared : 0)) * (double)(3 * I * K);
    }
    *work = 2.0 * (double)slots * 3.0 * (double)I * (double)K;
    return 0;
}
