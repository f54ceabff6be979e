/*
 * The routing of `moefuse bench`'s MoE ops, drawn on the host so that every run reads the
 * same experts, and router=1's logits that moefuse_topk_softmax turns into that routing.
 */
#include "bench.h"
#include "convert.h"
#include "random.h"
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>

/*
 * Routing of M tokens: k distinct random experts each, positive weights summing to 1, and the
 * number of distinct experts routed to (whose weights a call must read at least once).
 */
int draw_routing(int64_t M, int64_t k, int64_t E, int32_t **ids_out, float **wts_out,
                 int64_t *distinct)
{
    int32_t *ids = malloc((size_t)(M * k) * sizeof *ids);
    float *wts = malloc((size_t)(M * k) * sizeof *wts);
    char *hit = calloc((size_t)E, 1);
    if (!ids || !wts || !hit) {
        free(ids), free(wts), free(hit);
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return -1;
    }
    rng r = rng_seed(21);
    *distinct = 0;
    for (int64_t m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            int32_t e;
            int fresh;
            do {
                e = (int32_t)rng_below(&r, (uint32_t)E);
                fresh = 1;
                for (int64_t i = 0; i < j; i++)
                    fresh &= ids[m * k + i] != e;
            } while (!fresh);
            ids[m * k + j] = e;
            wts[m * k + j] = 0.5f + 0.5f * rng_uniform(&r) + 0.5f;
            sum += wts[m * k + j];
            *distinct += !hit[e];
            hit[e] = 1;
        }
        for (int64_t j = 0; j < k; j++)
            wts[m * k + j] /= sum;
    }
    free(hit);
    *ids_out = ids;
    *wts_out = wts;
    return 0;
}

/*
 * router=1: logits [M, E] in the bench's dtype whose top k in each row are the drawn experts
 * (in [2.5, 3.5) against [-1, 1) for the rest), so that moefuse_topk_softmax, run before the
 * layer in every call, routes the tokens to the experts of the draw and the layer reads the
 * same weights, the floor's, as without the router. Its weights are the softmax's, renormalized
 * over the k (as Mixtral, Qwen3 and DeepSeek-V3 renormalize), not the draw's.
 */
int bench_router(bench *b, shape_spec *s, const int32_t *ids)
{
    if (shape_int(s, b->op->name, "router", 0, 1, &b->router) != 0)
        return -1;
    if (!b->router)
        return 0;
    const int64_t M = b->M, E = b->E, k = b->k;
    const size_t es = moefuse_dtype_size(b->dtype);
    float *v = malloc((size_t)(M * E) * sizeof *v);
    void *host = malloc((size_t)(M * E) * es);
    if (!v || !host) {
        free(v), free(host);
        fprintf(stderr, "moefuse bench: out of host memory\n");
        return -1;
    }
    rng r = rng_seed(41);
    for (int64_t i = 0; i < M * E; i++)
        v[i] = rng_uniform(&r);
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++)
            v[m * E + ids[m * k + j]] = 3.0f + 0.5f * rng_uniform(&r);
    for (int64_t i = 0; i < M * E; i++)
        store_float(host, b->dtype, i, v[i]);
    void *dl = bench_upload(b, host, (size_t)(M * E) * es);
    free(v), free(host);
    if (!dl)
        return -1;
    int64_t ls[2] = {M, E};
    b->logits = moefuse_tensor_dense(dl, b->dtype, 2, ls);
    printf("router: moefuse_topk_softmax of logits [%lld, %lld] %s (renormalized) before each "
           "layer call, timed with it\n",
           (long long)M, (long long)E, moefuse_dtype_name(b->dtype));
    return 0;
}
