/* topk_route's kernel arguments, shared by its four kernels. Each is a programmatic dependent
 * launch when pdl (cuda_state): it waits for the kernel before it, then lets the next launch. */
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
    int vec; /* the lanes kernel: which of l, lb, cb take 16-byte loads (bits 1, 2, 4) */
} RouteParams;

/* The most experts the warp and block kernels take (16 a lane; a thread each). */
#define ROUTE_WARP_MAX_E 512

/* topk_route's kernels, as MOEFUSE_CUDA_ROUTER names them (0: the choice by shape). */
enum route_kernel { ROUTE_AUTO = 0, ROUTE_BLOCK, ROUTE_LANES, ROUTE_WARP, ROUTE_THREAD };

/* Launch the warp-per-row kernel (E <= ROUTE_WARP_MAX_E) on stream (mf_cuda_launched after). */
void mf_route_warp_launch(const RouteParams *p, cudaStream_t stream, int pdl);

/* Whether the lanes-per-row kernel (16 or 32 a row) takes p (E = 128, 256, 384; n_group 1, 2, 4, 8,
 * 16; k <= 32), and its launch. */
bool mf_route_lanes_takes(const RouteParams *p);
void mf_route_lanes_launch(RouteParams *p, cudaStream_t stream, int pdl);

/* Whether the block-per-row kernel takes p (E <= ROUTE_WARP_MAX_E, k <= 32), and its launch. */
bool mf_route_block_takes(const RouteParams *p);
void mf_route_block_launch(const RouteParams *p, cudaStream_t stream, int pdl);

#endif
