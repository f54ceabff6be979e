/*
 * `moefuse bench` setup of the MoE GEMMs in the input dtype (moe_gate, moe_final,
 * moe_forward): random weights, the drawn routing, and the FLOPs and weight bytes.
 */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int bench_setup_moe(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    const size_t es = moefuse_dtype_size(b->dtype);
    if (shape_int(s, name, "M", -1, MAX_DIM, &b->M) != 0 ||
        shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
        shape_int(s, name, "k", -1, 1 << 20, &b->k) != 0 ||
        shape_int(s, name, "K", -1, MAX_DIM, &b->K) != 0 ||
        shape_int(s, name, "I", -1, MAX_DIM, &b->I) != 0)
        return -1;
    if (b->k > b->E) {
        fprintf(stderr, "moefuse bench: k=%lld exceeds E=%lld (each token takes k distinct "
                        "experts)\n", (long long)b->k, (long long)b->E);
        return -1;
    }
    const int gate = strcmp(name, "moe_final") != 0, final = strcmp(name, "moe_gate") != 0;
    const int64_t M = b->M, k = b->k, K = b->K, I = b->I, E = b->E;
    printf("weights: %.2f GB in %s\n",
           (double)((gate ? E * 2 * I * K : 0) + (final ? E * K * I : 0)) * (double)es / 1e9,
           moefuse_dtype_name(b->dtype));
    int32_t *ids;
    float *wts;
    int64_t distinct;
    if (draw_routing(M, k, E, &ids, &wts, &distinct) != 0)
        return -1;
    if (strcmp(name, "moe_forward") == 0 && bench_router(b, s, ids) != 0) {
        free(ids), free(wts);
        return -1;
    }
    b->weight_bytes = (double)distinct * (double)es *
                      ((gate ? 2.0 * (double)I * (double)K : 0.0) +
                       (final ? (double)K * (double)I : 0.0));
    int64_t rs[2] = {M, k};
    void *di = bench_upload(b, ids, (size_t)(M * k) * 4);
    void *dw = bench_upload(b, wts, (size_t)(M * k) * 4);
    free(ids);
    free(wts);
    if (!di || !dw)
        return -1;
    b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
    b->route.topk_weights = moefuse_tensor_dense(dw, MOEFUSE_F32, 2, rs);
    int64_t xs[2] = {M, K}, w1s[3] = {E, 2 * I, K}, w2s[3] = {E, K, I}, hs[3] = {M, k, I};
    if (gate) {
        void *dx = bench_random(b, b->dtype, M * K, 1.0f, 31);
        void *dw1 = bench_random(b, b->dtype, E * 2 * I * K, 1.0f / 32.0f, 32);
        if (!dx || !dw1)
            return -1;
        b->x = moefuse_tensor_dense(dx, b->dtype, 2, xs);
        b->w1 = moefuse_tensor_dense(dw1, b->dtype, 3, w1s);
    }
    if (final) {
        void *dw2 = bench_random(b, b->dtype, E * K * I, 1.0f / 32.0f, 33);
        if (!dw2)
            return -1;
        b->w2 = moefuse_tensor_dense(dw2, b->dtype, 3, w2s);
    }
    if (strcmp(name, "moe_forward") != 0) {
        void *dh = strcmp(name, "moe_final") == 0 ? bench_random(b, b->dtype, M * k * I, 1.0f, 34)
                                                  : bench_alloc(b, (size_t)(M * k * I) * es);
        if (!dh)
            return -1;
        b->h = moefuse_tensor_dense(dh, b->dtype, 3, hs);
    }
    if (final) {
        void *dout = bench_alloc(b, (size_t)(M * K) * es);
        if (!dout)
            return -1;
        b->out = moefuse_tensor_dense(dout, b->dtype, 2, xs);
    }
    *work = 2.0 * (double)M * (double)k *
            ((gate ? 2.0 * (double)I * (double)K : 0.0) + (final ? (double)K * (double)I : 0.0));
    return 0;
}
