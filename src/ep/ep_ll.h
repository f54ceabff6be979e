/*
 * The low-latency mode of dispatch and combine (ep_ll.c): one exchange of fixed-size blocks
 * each way, the route made on the device, nothing read back to the host.
 */
#ifndef MOEFUSE_EP_LL_H
#define MOEFUSE_EP_LL_H

#include "ep/ep_payload.h"

/* The backend has the mode's steps, and a call of M tokens and recv_x's Tmax fits blocks of
   cap rows (M <= cap, W cap <= Tmax) whose sizes fit size_t; else a refusal. */
moefuse_status mf_ep_ll_check(moefuse_context *ctx, const char *op, const moefuse_ep_group *g,
                              const mf_ep_payload *pay, int64_t topk, int64_t cap, int64_t tmax);

/* Dispatch (arguments checked): x's rows to the experts' ranks, into recv_x, recv_scales
   (rank 3, pay->act's layout) and recv_counts; h (allocated, zeroed) gets the call's records. */
moefuse_status mf_ep_ll_dispatch(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                 const mf_ep_payload *pay, const moefuse_tensor *x,
                                 const moefuse_routing *routing, const moefuse_tensor *recv_x,
                                 const moefuse_tensor *recv_scales,
                                 const moefuse_tensor *recv_counts, int64_t cap,
                                 moefuse_ep_handle *h);

/* Combine after a low-latency dispatch (arguments checked). */
moefuse_status mf_ep_ll_combine(moefuse_context *ctx, const char *op, moefuse_ep_group *g,
                                const moefuse_ep_handle *h, const moefuse_tensor *y,
                                const moefuse_tensor *out);

#endif
