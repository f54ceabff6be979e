/* topk_route's kernel arguments, shared by its two kernels (router.cu, router_warp.cu). */
#ifndef MOEFUSE_CUDA_ROUTER_H
#define MOEFUSE_CUDA_ROUTER_H

#include <cuda_runtime.h>
#include <stdint.h>

typedef struct RouteParams {
    const void *l, *lb, *cb; /* logits [M, E]; the logit and choice biases [E] or NULL */
    int64_t ls0;
    int ldt, lbdt, cbdt;
    int32_t *ids;
    int64_t is0;
    float *w;
    int64_t ws0;
    int64_t M, E, k, groups, kept;
    int scoring, group_scoring, renorm;
    float scale;
} RouteParams;

/* The most experts the warp kernel takes (16 a lane). */
#define ROUTE_WARP_MAX_E 512

/* Launch the warp-per-row kernel (E <= ROUTE_WARP_MAX_E) on stream (mf_cuda_launched after). */
void mf_route_warp_launch(const RouteParams *p, cudaStream_t stream);

#endif
