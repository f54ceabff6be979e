/* `moefuse bench` setup: which file sets up which op. */
#include "bench.h"

#include <stdio.h>
#include <string.h>

int bench_setup(bench *b, shape_spec *s, double *work)
{
    if (b->op->kind == KIND_ROWS || b->op->kind == KIND_MASKED)
        return bench_setup_rows(b, s, work);
    if (b->op->kind == KIND_TOPK)
        return bench_setup_route(b, s, work);
    if (strstr(b->op->name, "_fp8"))
        return bench_setup_fp8(b, s, work);
    return bench_setup_moe(b, s, work);
}
