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
 * x only), routing (topk_ids [M, k] i32 and topk_weights [M, k] f32; no expert_map; shared
 * experts only where shared_ok, the layer's): checked, and the payload they make.
 */
moefuse_status mf_ep_payload_check(moefuse_context *ctx, const char *op, const moefuse_tensor *x,
                                   const moefuse_tensor *x_scales, const moefuse_routing *routing,
                                   bool quantize, bool shared_ok,
                                   const moefuse_quant_options *act, mf_ep_payload *pay);

/* x (f32/f16/bf16) quantized as the payload's FP8 rows, every row once as moefuse_quant
   does (the one-device layer's first step), in the group's scratch codes_slot and the one
   after it: *codes [1, M, K] and *scales [1, M, K / 128] f32 in the row-major *layout. */
moefuse_status mf_ep_payload_quantize(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                      const mf_ep_payload *pay, const moefuse_tensor *x,
                                      enum mf_ep_slot codes_slot, moefuse_tensor *codes,
                                      moefuse_tensor *scales, moefuse_scale_layout *layout);

/* The rows this rank sends, in the route's send order, in the group's MF_EP_SEND scratch
   (*rows): x's rows, or FP8 ones (quantized here first, in MF_EP_CODES and MF_EP_SCALES, when
   pay->quantize). */
moefuse_status mf_ep_payload_pack(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                  const mf_ep_payload *pay, const moefuse_tensor *x,
                                  const mf_ep_route *r, void **rows);

/* n received rows (backend memory) into rows [E, T, K] at index[i] = e T + t, FP8 scales into
   scales (rank 3, in `layout`); counts [E] (host) when the layout pads: the backend's
   ep_scatter. */
moefuse_status mf_ep_payload_unpack(moefuse_context *ctx, const mf_ep_payload *pay,
                                    const void *recv, int64_t n, const int64_t *index,
                                    const moefuse_tensor *rows, const moefuse_tensor *scales,
                                    moefuse_scale_layout layout, const int64_t *counts);

#endif
