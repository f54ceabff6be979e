/*
 * What one dispatched row carries: x's row as it is (K elements of x's dtype), or FP8: its K
 * e4m3 codes then its K / 128 group scales as f32 values (a UE8M0 exponent is a power of two,
 * exact in f32), whatever layout x_scales and recv_scales use.
 */
#ifndef MOEFUSE_EP_PAYLOAD_H
#define MOEFUSE_EP_PAYLOAD_H

#include "ep/ep_internal.h"

#include <stdbool.h>

typedef struct mf_ep_payload {
    bool fp8;                  /* rows carry codes and scales */
    bool quantize;             /* x (f32/f16/bf16) is quantized before it is sent */
    moefuse_quant_options act; /* normalised (fp8): group 128, layout, ue8m0, eps */
    moefuse_tensor xs;         /* an f8 x's scales, rank 3 [1, ...] */
    int64_t tokens, model_dim, groups; /* M, K, K / 128 */
    size_t row_bytes;
} mf_ep_payload;

/*
 * x [M, K] (f32/f16/bf16, or f8_e4m3 with x_scales in act's layout), quantize (f32/f16/bf16
 * x only), routing (topk_ids [M, k] i32 and topk_weights [M, k] f32; no expert_map, no shared
 * experts): checked, and the payload they make.
 */
moefuse_status mf_ep_payload_check(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                   const moefuse_tensor *x_scales, const moefuse_routing *routing,
                                   bool quantize, const moefuse_quant_options *act,
                                   mf_ep_payload *pay);

/* The rows this rank sends, in the route's send order, in a new buffer (*rows, malloc'd). */
moefuse_status mf_ep_payload_pack(moefuse_context *ctx, const char *op, const mf_ep_payload *pay,
                                  const moefuse_tensor *x, const mf_ep_route *r, char **rows);

/* One received row into dst (K elements: x's dtype, or codes) and, FP8, its scales into
   scales (rank 3, in `layout`) at expert e, row t. */
void mf_ep_payload_unpack(const mf_ep_payload *pay, const char *row, void *dst,
                          const moefuse_tensor *scales, moefuse_scale_layout layout, int64_t e,
                          int64_t t);

#endif
