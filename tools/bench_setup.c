/*
 * `moefuse bench` setup: which file sets up which op, and the one op small enough to need no
 * file of its own, topk_softmax.
 */
#include "bench.h"

#include <stdio.h>
#include <string.h>

/* topk_softmax: random logits [M, E], and the ids and weights it writes. */
static int bench_setup_topk(bench *b, shape_spec *s, double *work)
{
    const char *name = b->op->name;
    const size_t es = moefuse_dtype_size(b->dtype);
    if (shape_int(s, name, "M", -1, MAX_DIM, &b->M) != 0 ||
        shape_int(s, name, "E", -1, 1 << 20, &b->E) != 0 ||
        shape_int(s, name, "k", -1, 1 << 20, &b->k) != 0)
        return -1;
    if (b->k > b->E) {
        fprintf(stderr, "moefuse bench: k=%lld exceeds E=%lld\n", (long long)b->k,
                (long long)b->E);
        return -1;
    }
    int64_t ls[2] = {b->M, b->E}, rs[2] = {b->M, b->k};
    void *dl = bench_random(b, b->dtype, b->M * b->E, 4.0f, 11);
    void *di = bench_alloc(b, (size_t)(b->M * b->k) * 4);
    void *dw = bench_alloc(b, (size_t)(b->M * b->k) * 4);
    if (!dl || !di || !dw)
        return -1;
    b->x = moefuse_tensor_dense(dl, b->dtype, 2, ls);
    b->route.topk_ids = moefuse_tensor_dense(di, MOEFUSE_I32, 2, rs);
    b->route.topk_weights = moefuse_tensor_dense(dw, MOEFUSE_F32, 2, rs);
    *work = (double)(b->M * b->E) * (double)es + (double)(b->M * b->k) * 8.0;
    return 0;
}

int bench_setup(bench *b, shape_spec *s, double *work)
{
    if (b->op->kind == KIND_ROWS || b->op->kind == KIND_MASKED)
        return bench_setup_rows(b, s, work);
    if (b->op->kind == KIND_TOPK)
        return bench_setup_topk(b, s, work);
    if (strstr(b->op->name, "_fp8"))
        return bench_setup_fp8(b, s, work);
    return bench_setup_moe(b, s, work);
}
