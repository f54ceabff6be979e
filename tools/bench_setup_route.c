/*
 * `moefuse bench` setup of the routing ops: topk_softmax and topk_route (a router on random
 * logits) and routing_metadata (the dispatch metadata of a drawn routing).
 */
#include "bench.h"
#include "tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* scoring=softmax|sigmoid|topk_softmax */
static int parse_scoring(shape_spec *s, moefuse_router_scoring *out)
{
    const char *v = shape_get(s, "scoring");
    *out = MOEFUSE_ROUTER_SOFTMAX;
    if (!v || strcmp(v, "softmax") == 0)
        return 0;
    if (strcmp(v, "sigmoid") == 0)
        *out = MOEFUSE_ROUTER_SIGMOID;
    else if (strcmp(v, "topk_softmax") == 0)
        *out = MOEFUSE_ROUTER_TOPK_SOFTMAX;
    else {
        fprintf(stderr, "moefuse bench: scoring must be softmax, sigmoid or topk_softmax, "
                        "not '%s'\n", v);
        return -1;
    }
    return 0;
}

/*
 * topk_route: random logits [M, E] in --dtype; bias=1 adds a random choice bias [E] (f32, as
 * DeepSeek-V3's e_score_correction_bias); DeepSeek's options (renormalized, scale 2.5) with
 * scoring=sigmoid, else renormalized softmax. Bytes: logits and bias read, ids and weights
 * written.
 */
static int setup_route(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    int64_t n_group, topk_group, bias;
    if (shape_int(s, name, "n_group", 1, MOEFUSE_ROUTER_MAX_GROUPS, &n_group) != 0 ||
        shape_int(s, name, "topk_group", n_group, n_group, &topk_group) != 0 ||
        shape_count(s, name, "bias", 1, &bias) != 0 || parse_scoring(s, &b->ro.scoring) != 0)
        return -1;
    b->ro.n_group = (int32_t)n_group;
    b->ro.topk_group = (int32_t)topk_group;
    b->ro.renormalize = 1;
    b->ro.scale = b->ro.scoring == MOEFUSE_ROUTER_SIGMOID ? 2.5f : 1.0f;
    int64_t ls[2] = {b->M, b->E}, bs[1] = {b->E};
    void *dl = bench_random(b, b->dtype, b->M * b->E, 4.0f, 11);
    if (!dl)
        return -1;
    b->x = moefuse_tensor_dense(dl, b->dtype, 2, ls);
    b->has_choice_bias = (int)bias;
    if (bias) {
        void *db = bench_random(b, MOEFUSE_F32, b->E, 0.1f, 13);
        if (!db)
            return -1;
        b->choice_bias = moefuse_tensor_dense(db, MOEFUSE_F32, 1, bs);
    }
    *work = (double)(b->M * b->E) * (double)moefuse_dtype_size(b->dtype) +
            (double)(bias ? b->E * 4 : 0) + (double)(b->M * b->k) * 8.0;
    return 0;
}

/*
 * routing_metadata: ids drawn as for the MoE ops (k distinct experts per token), every output
 * asked for, each expert padded to block=N. Bytes: ids read, every output written once.
 */
static int setup_meta(bench *b, shape_spec *s, double *work)
{
    int64_t block;
    if (shape_int(s, b->op->name, "block", 1, 1 << 20, &block) != 0)
        return -1;
    b->block_size = (int32_t)block;
    int32_t *ids;
    float *wts;
    int64_t distinct;
    if (draw_routing(b->M, b->k, b->E, &ids, &wts, &distinct) != 0)
        return -1;
    const int64_t Mk = b->M * b->k, L = Mk + b->E * (block - 1);
    void *di = bench_upload(b, ids, (size_t)Mk * 4);
    free(ids), free(wts);
    void *dc = bench_alloc(b, (size_t)b->E * 4), *doff = bench_alloc(b, (size_t)(b->E + 1) * 4);
    void *dor = bench_alloc(b, (size_t)L * 4), *dp = bench_alloc(b, (size_t)Mk * 4);
    void *dm = bench_alloc(b, (size_t)Mk * 4);
    if (!di || !dc || !doff || !dor || !dp || !dm)
        return -1;
    int64_t rs[2] = {b->M, b->k}, es[1] = {b->E}, os[1] = {b->E + 1}, ls[1] = {L};
    b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
    b->meta.counts = moefuse_tensor_dense(dc, MOEFUSE_I32, 1, es);
    b->meta.offsets = moefuse_tensor_dense(doff, MOEFUSE_I32, 1, os);
    b->meta.order = moefuse_tensor_dense(dor, MOEFUSE_I32, 1, ls);
    b->meta.position = moefuse_tensor_dense(dp, MOEFUSE_I32, 2, rs);
    b->meta.masked_row = moefuse_tensor_dense(dm, MOEFUSE_I32, 2, rs);
    *work = 4.0 * (double)(Mk + b->E + b->E + 1 + L + 2 * Mk);
    return 0;
}

int bench_setup_route(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    if (shape_int(s, name, "M", -1, MAX_DIM, &b->M) != 0 ||
        shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
        shape_int(s, name, "k", -1, 1 << 20, &b->k) != 0)
        return -1;
    if (b->k > b->E) {
        fprintf(stderr, "moefuse bench: k=%lld exceeds E=%lld\n", (long long)b->k,
                (long long)b->E);
        return -1;
    }
    if (strcmp(name, "routing_metadata") == 0)
        return setup_meta(b, s, work);
    if (strcmp(name, "topk_route") == 0) {
        if (setup_route(b, s, work) != 0)
            return -1;
    } else { /* topk_softmax: random logits [M, E]; logits read, ids and weights written */
        int64_t ls[2] = {b->M, b->E};
        void *dl = bench_random(b, b->dtype, b->M * b->E, 4.0f, 11);
        if (!dl)
            return -1;
        b->x = moefuse_tensor_dense(dl, b->dtype, 2, ls);
        *work = (double)(b->M * b->E) * (double)moefuse_dtype_size(b->dtype) +
                (double)(b->M * b->k) * 8.0;
    }
    int64_t rs[2] = {b->M, b->k};
    void *di = bench_alloc(b, (size_t)(b->M * b->k) * 4);
    void *dw = bench_alloc(b, (size_t)(b->M * b->k) * 4);
    if (!di || !dw)
        return -1;
    b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
    b->route.topk_weights = moefuse_tensor_dense(dw, MOEFUSE_F32, 2, rs);
    return 0;
}
