/*
 * State and helpers shared by the CUDA backend's files. Host code is C
 * (backend_cuda.c, cuda_util.c); kernels and their launchers are .cu files
 * compiled by nvcc as C++ but written in C style, exporting the vtable
 * members below with C linkage.
 *
 * Rules every file follows:
 *  - Every CUDA call's status is checked and turned into a moefuse status
 *    with mf_cuda_fail (the message names the operation and the call);
 *    every launch is followed by mf_cuda_launched.
 *  - No hidden synchronisation: operations only enqueue on s->stream, never
 *    read device data on the host, and size scratch from the shapes.
 *  - Offsets and sizes are 64-bit (int64_t / size_t) everywhere.
 */
#ifndef MOEFUSE_CUDA_INTERNAL_H
#define MOEFUSE_CUDA_INTERNAL_H

#include "core/backend.h"
#include "core/fault.h"

#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cuda_state {
    int device;                /* the device this context runs on */
    cudaStream_t own_stream;   /* created by the context (non-blocking) */
    cudaStream_t stream;       /* own_stream, or the caller's */
    int sm_count;              /* multiprocessors, read from the device */
    int cc_major, cc_minor;    /* compute capability */
    int pdl;                   /* launches may use programmatic dependent launch (mf_cuda_probe_pdl) */
    int clusters;              /* kernels may run in thread block clusters (mf_cuda_probe_pdl) */
    size_t smem_optin;         /* max dynamic shared memory per block after opt-in */
    /* one bit per GEMM kernel whose dynamic shared-memory limit this context has raised
     * (moe_mma.cu, moe_wgmma.cu, moe_ws.cu): per context, so threads with contexts of their own
     * share no mutable state, and a context is used by one thread at a time */
    uint32_t mma_smem_raised, wgmma_smem_raised, ws_smem_raised, dec_smem_raised;
    int dec_max_clusters[2][9]; /* moe_fp8_decode.cu: resident clusters [final, gate][split] */
    uint32_t rows_smem_raised; /* the same for the staged row kernels (rows.cu) */
    uint32_t meta_smem_raised; /* the same for routing_metadata's cluster kernels (a bit each) */
    int meta_cluster16;        /* its clusters of 16 blocks fit: 0 not asked yet, 1 yes, -1 no */
    float *act_tables;         /* act(g) of the bf16 gates, per activation (act_table.cuh) */
    size_t l2_bytes;
    void *scratch;             /* stream-ordered scratch, grown on demand */
    size_t scratch_bytes;
    cudaEvent_t scratch_free;  /* recorded after the last work that used scratch */
    cudaStream_t scratch_stream; /* the stream scratch_free was recorded on */
    int scratch_used;          /* this call took the scratch: record scratch_free at its end */
    void *capture_scratch;     /* this call's own scratch inside a graph capture */
    /* the driver's cuMemGetAddressRange (through the runtime, so that the library does not
     * link libcuda), or NULL: bounds of the allocation a tensor lies in */
    int (*address_range)(unsigned long long *base, size_t *size, unsigned long long ptr);
    /* cuPointerGetAttributes (driver API, through the runtime's entry point), or NULL: the
     * ownership check asks it for the type, device and allocation range in one call, and
     * leaves the range for the bounds check that follows at once (checked_ptr, 0 = none) */
    int (*pointer_attributes)(unsigned n, int *attributes, void **data, unsigned long long ptr);
    /* cuTensorMapEncodeTiled (driver API, through the runtime's entry point), or NULL: the
     * TMA descriptors of moe_ws.cu; without it the Hopper GEMMs take moe_wgmma.cu */
    void (*tensor_map_encode)(void);
    /* MOEFUSE_CUDA_GEMM: the MoE GEMM configuration forced for routed calls (enum moe_cfg),
     * or -1 for the choice by shape (mf_cuda_gemm_from_env) */
    int forced_gemm;
    /* MOEFUSE_CUDA_SPLIT: blocks sharing the depth of a decode tile (1..8), or 0 for the
     * choice by shape (mf_cuda_split_from_env) */
    int forced_split;
    /* MOEFUSE_CUDA_FP8: the FP8 GEMM forced (enum fp8_gemm_kind), or 0 for the choice by
     * device (mf_cuda_fp8_gemm_from_env; moe_fp8_plan.cu's fp8_gemm_for) */
    int fp8_gemm;
    /* MOEFUSE_CUDA_FP8_A: how the large-tile FP8 kernel loads A (enum fp8_a_load), or 0 for
     * the choice by shape (mf_cuda_fp8_a_from_env; moe_fp8_plan.cu's fp8_ws_a_copied) */
    int fp8_a;
    /* moe_fp8.cu: the scratch where a layer's FP8 gate left its route (mf_moe_args.layer), and
     * the tile height it was listed for, for the layer's final to take; NULL when none */
    const void *fp8_route_left;
    int fp8_route_bm;
    /* MOEFUSE_CUDA_ROUTER: topk_route's kernel forced (enum route_kernel in router.h), or 0
     * for the choice by shape (mf_cuda_router_from_env) */
    int forced_router;
    /* MOEFUSE_CUDA_META: routing_metadata's path forced (enum meta_path in routing_meta.cuh),
     * or 0 for the choice by shape (mf_cuda_meta_from_env) */
    int forced_meta;
    const void *checked_ptr;
    unsigned long long checked_base;
    size_t checked_size;
    char device_name[256];
} cuda_state;

/* A failed CUDA call as a moefuse status: "<op>: <call> failed: <error name>: <string>". */
moefuse_status mf_cuda_fail(moefuse_context *ctx, cudaError_t err, const char *op,
                            const char *call);

/* After a kernel launch: the launch error (bad configuration, no kernel image) if any. */
moefuse_status mf_cuda_launched(moefuse_context *ctx, const char *op, const char *kernel);

/*
 * Device scratch of at least `bytes` for the current call; at most one request per call. The
 * caller's workspace when one is set (moefuse_set_workspace: ordering it is the caller's), else
 * the context's own, ordered on s->stream (cudaMallocAsync). Growing it never
 * synchronises the device, and work on another stream that used it last is
 * waited for on the device (an event), not on the host. Inside a CUDA graph
 * capture the call gets scratch of its own, allocated and freed by the
 * captured work, so a graph never shares or outlives memory it does not own.
 */
moefuse_status mf_cuda_scratch(moefuse_context *ctx, cuda_state *s, size_t bytes, const char *op,
                               void **out);

/*
 * Whether the next call's scratch starts with what this call left in it: the caller's
 * workspace, or the context's own outside a graph capture (a captured call's scratch is its
 * own, freed at its end). Both steps of a layer ask it the same way.
 */
int mf_cuda_scratch_kept(moefuse_context *ctx, const cuda_state *s);

/*
 * End of every operation (the vtable wraps each): frees a captured call's
 * scratch, or marks where the eager scratch's last use ends. Returns `status`,
 * or the failure of that bookkeeping when `status` was OK.
 */
moefuse_status mf_cuda_end_call(moefuse_context *ctx, cuda_state *s, const char *op,
                                moefuse_status status);

/* Start of a tensor's data: the device pointer plus its byte offset. */
static inline char *mf_cuda_base(const moefuse_tensor *t)
{
    return t->data ? (char *)t->data + t->offset : (char *)0;
}

/* Grid size for a grid-stride loop over `work` items in blocks of `per_block`. */
static inline unsigned mf_cuda_grid(const cuda_state *s, int64_t work, int64_t per_block,
                                    int blocks_per_sm)
{
    int64_t need = (work + per_block - 1) / per_block;
    int64_t cap = (int64_t)s->sm_count * blocks_per_sm;
    if (need > cap)
        need = cap;
    return (unsigned)(need > 0 ? need : 1);
}

/* Sets s->pdl and s->clusters: the device is sm_90 or later and runs this library's code
 * compiled for sm_90 or later (not older PTX compiled at load time, whose kernels have no
 * griddepcontrol.wait and no cluster barriers). */
void mf_cuda_probe_pdl(cuda_state *s);

/* MOEFUSE_CUDA_GEMM as a configuration: -1 when unset or empty, -2 when it names none
 * (moe_ops.cu, which knows the configurations). */
int mf_cuda_gemm_from_env(void);
/* MOEFUSE_CUDA_SPLIT as a split count: 0 when unset or empty, -1 when not an integer in 1..8. */
int mf_cuda_split_from_env(void);
int mf_cuda_router_from_env(void);
int mf_cuda_meta_from_env(void);

/* Builds s->act_tables on s->own_stream and waits for it (context creation; rows.cu). */
moefuse_status mf_cuda_build_act_tables(moefuse_context *ctx, cuda_state *s);

/* Operations: rows.cu / quant.cu / topk.cu (row ops), moe_*.cu (GEMMs). */
moefuse_status mf_cuda_act_quant(moefuse_context *ctx, void *state, const mf_rows_args *a);
moefuse_status mf_cuda_act_mul(moefuse_context *ctx, void *state, const mf_rows_args *a);
moefuse_status mf_cuda_quant(moefuse_context *ctx, void *state, const mf_rows_args *a);
moefuse_status mf_cuda_dequant(moefuse_context *ctx, void *state, const mf_dequant_args *a);
moefuse_status mf_cuda_topk_softmax(moefuse_context *ctx, void *state, const mf_topk_args *a);
moefuse_status mf_cuda_topk_route(moefuse_context *ctx, void *state, const mf_topk_args *a);
moefuse_status mf_cuda_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a);
/* expert parallelism: the low-latency steps (ep_ll.cu), the rows (ep_rows.cu) */
moefuse_status mf_cuda_ep_ll_pack(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cuda_ep_ll_place(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cuda_ep_ll_partial(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cuda_ep_ll_sum(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
moefuse_status mf_cuda_ep_gather(moefuse_context *ctx, void *state, const mf_ep_rows_args *a);
moefuse_status mf_cuda_ep_scatter(moefuse_context *ctx, void *state, const mf_ep_rows_args *a);
moefuse_status mf_cuda_ep_reduce(moefuse_context *ctx, void *state, const mf_ep_reduce_args *a);
moefuse_status mf_cuda_ep_copy(moefuse_context *ctx, void *state, void *dst, const void *src,
                               size_t bytes);
/* expert parallelism over NCCL (ep_nccl.c) */
moefuse_status mf_cuda_ep_unique_id(moefuse_context *ctx, void *state, void *id);
moefuse_status mf_cuda_ep_transport(moefuse_context *ctx, void *state, const void *id,
                                    void *comm, int32_t rank, int32_t world,
                                    mf_ep_transport *out);
moefuse_status mf_cuda_moe_shared_routing(moefuse_context *ctx, void *state,
                                          const mf_shared_args *a);
moefuse_status mf_cuda_meta_workspace(moefuse_context *ctx, void *state, const mf_meta_args *a,
                                      size_t *bytes);
moefuse_status mf_cuda_moe_gate(moefuse_context *ctx, void *state, const mf_moe_args *a);
moefuse_status mf_cuda_moe_final(moefuse_context *ctx, void *state, const mf_moe_args *a);
moefuse_status mf_cuda_moe_forward(moefuse_context *ctx, void *state, const mf_moe_args *a);
/*
 * quant as a step of another operation (the FP8 MoE's x): the same kernels and bits, with the
 * scratch it needs (mf_cuda_quant_scratch_bytes: the masked layout's row offsets past 4096
 * experts, else 0) a share of the caller's own request, so a call still asks once.
 */
size_t mf_cuda_quant_scratch_bytes(const mf_rows_args *a);
moefuse_status mf_cuda_quant_in_call(moefuse_context *ctx, cuda_state *s, const mf_rows_args *a,
                                     const char *op, void *scratch);
/* FP8 MoE (moe_fp8.cu). */
moefuse_status mf_cuda_moe_gate_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a);
moefuse_status mf_cuda_moe_final_fp8(moefuse_context *ctx, void *state, const mf_moe_args *a);
moefuse_status mf_cuda_moe_gate_fp8_workspace(moefuse_context *ctx, void *state,
                                              const mf_moe_args *a, size_t *bytes);
moefuse_status mf_cuda_moe_final_fp8_workspace(moefuse_context *ctx, void *state,
                                               const mf_moe_args *a, size_t *bytes);
/* MOEFUSE_CUDA_FP8 as an FP8 GEMM (enum fp8_gemm_kind, moe_fp8.h): 0 when unset or empty,
 * -1 when it names none. */
int mf_cuda_fp8_gemm_from_env(void);
/* MOEFUSE_CUDA_FP8_A as an enum fp8_a_load (moe_fp8.h): 0 when unset or empty, -1 when it
 * names none. */
int mf_cuda_fp8_a_from_env(void);
/* The bytes of scratch each takes (backend.h's *_workspace members). */
moefuse_status mf_cuda_rows_workspace(moefuse_context *ctx, void *state, const mf_rows_args *a,
                                      size_t *bytes);
moefuse_status mf_cuda_moe_gate_workspace(moefuse_context *ctx, void *state,
                                          const mf_moe_args *a, size_t *bytes);
moefuse_status mf_cuda_moe_final_workspace(moefuse_context *ctx, void *state,
                                           const mf_moe_args *a, size_t *bytes);
moefuse_status mf_cuda_moe_forward_workspace(moefuse_context *ctx, void *state,
                                             const mf_moe_args *a, size_t *bytes);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_CUDA_INTERNAL_H */
