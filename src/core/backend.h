/*
 * The backend interface. A backend implements `struct moefuse_backend_i` and
 * nothing else: the core (src/core/ops_*.c) has validated every argument and
 * filled one of the *_args structs below before a member is called, so a
 * backend never re-checks shapes, dtypes or strides. Tensors arrive
 * normalised to a fixed rank (documented per struct) with derived sizes
 * precomputed. A backend must still treat device-resident data (counts,
 * expert ids) as untrusted and clamp or skip it as docs/NUMERICS.md says.
 */
#ifndef MOEFUSE_CORE_BACKEND_H
#define MOEFUSE_CORE_BACKEND_H

#include "moefuse.h"
#include "ep/ep_ll_wire.h"
#include "ep/transport.h"

#include <stdbool.h>

#ifdef __cplusplus /* the CUDA backend's .cu files are compiled as C++ */
extern "C" {
#endif

/* --------------------------------------------------------- operation args */

/*
 * act_quant (2-D and 3-D masked), act_mul, quant: one row-wise shape.
 * E = 1 for the 2-D calls. All tensors normalised to rank 3 with a leading
 * expert dimension (stride 0 when E = 1 is implied by the 2-D form).
 */
typedef struct mf_rows_args {
    moefuse_tensor x;            /* [E, T, 2H] (act_*) or [E, T, H] (quant) */
    moefuse_tensor counts;       /* [E] i32 or absent: all T rows valid */
    moefuse_tensor row_scale;    /* [E, T] f32 or absent */
    moefuse_tensor expert_scale; /* [E] f32/bf16 or absent */
    moefuse_tensor out;          /* q [E, T, H] (f8/i8) or act_mul's out [E, T, H] */
    moefuse_tensor scales;       /* quantizing ops: see moefuse_scale_layout, rank 3 */
    int64_t experts;             /* E */
    int64_t rows;                /* T (Tmax for masked) */
    int64_t hidden;              /* H, width of out */
    int64_t group;               /* G (quantizing ops) */
    int64_t groups;              /* Gn = H / G */
    int64_t rows_padded;         /* Ta = round_up(T, 4), column-major / packed layouts */
    bool activate;               /* false for quant: x is h itself */
    moefuse_act_options act;     /* defaults filled in */
    moefuse_quant_options quant; /* defaults filled in (group_size, eps) */
    bool zero_tail;
} mf_rows_args;

/* dequant: q [T, H] + scales -> out [T, H]. Scales normalised to rank 3, E = 1. */
typedef struct mf_dequant_args {
    moefuse_tensor q;      /* [T, H] */
    moefuse_tensor scales; /* rank 3, E = 1 */
    moefuse_tensor out;    /* [T, H] */
    int64_t rows, hidden, group, groups, rows_padded;
    moefuse_quant_options quant;
} mf_dequant_args;

/* topk_softmax and topk_route (topk_softmax: softmax, no biases, no groups, scale 1). */
typedef struct mf_topk_args {
    const char *op;         /* "topk_softmax" or "topk_route": what messages start with */
    moefuse_tensor logits;  /* [M, E] */
    moefuse_tensor ids;     /* [M, k] i32 */
    moefuse_tensor weights; /* [M, k] f32 */
    int64_t tokens, experts, topk;
    bool renormalize;
    /* topk_route only */
    moefuse_tensor logit_bias, choice_bias; /* [E] each, absent: data NULL */
    moefuse_router_scoring scoring;
    moefuse_group_scoring group_scoring;
    int64_t groups, groups_kept; /* 1 and 1 without groups */
    float scale;                 /* 1 unless set */
} mf_topk_args;

/*
 * MoE gate / final / forward. Absent optional tensors have data == NULL.
 *  x [M, K], w1 [E, 2I, K], b1 [E, 2I], h [M, k, I], w2 [E, K, I], b2 [E, K],
 *  topk_ids / topk_weights [M, k], expert_map [E_global],
 *  out [M, K] (reduce) or [M, k, K] (!reduce).
 */
typedef struct mf_moe_args {
    moefuse_tensor x, w1, b1, h, w2, b2;
    moefuse_tensor topk_ids, topk_weights, expert_map;
    moefuse_tensor out;
    int64_t tokens;         /* M */
    int64_t model_dim;      /* K */
    int64_t inter_dim;      /* I */
    int64_t experts;        /* E, local experts in w1 / w2 */
    int64_t global_experts; /* E_global: expert_map length, else E */
    int64_t topk;           /* k */
    bool reduce;            /* out is [M, K] (true) or [M, k, K] */
    moefuse_moe_options opt;
    /*
     * FP8 calls only (the *_fp8 members; docs/NUMERICS.md "FP8 MoE"). Codes are f8_e4m3.
     *  x_scales: absent when x is f32/f16/bf16 (the backend quantizes x's rows itself), else
     *            x's group scales normalised to rank 3 [1 or E, ...] as mf_rows_args.scales;
     *  w1_scales [E, 2I/128, K/128], w2_scales [E, K/128, I/128]: f32 or u8 (UE8M0);
     *  h_scales: h's group scales, rank 3 [1 or E, ...], rows t = m * k + j (routed) or t
     *            (masked); act: the activation quantization (group 128, layout, ue8m0, eps).
     * Masked layout (masked = true): x [E, Tmax, K], h [E, Tmax, I], out [E, Tmax, K],
     * counts [E] i32 (device data: clamp to [0, Tmax]); tokens = Tmax, topk = 1, no routing
     * tensors, reduce = false, and rows t >= n[e] of h and out are not written.
     */
    moefuse_tensor x_scales, w1_scales, h_scales, w2_scales, counts;
    moefuse_quant_options act; /* a scales tensor of R rows pads them to round_up(R, 4): R is
                                  M (x) or M * k (h) routed, Tmax masked */
    bool masked;
    /*
     * FP8 steps only: this gate and the final that follows it are one whole layer's, run by the
     * core on one workspace (the gate's scratch request is at least the final's, so a backend's
     * own scratch is not regrown between them). A backend may keep what both steps share there
     * (the CUDA backend's route) and skip what only the layer's final would read (h's rows of
     * invalid slots); or ignore it.
     */
    bool layer;
} mf_moe_args;

/*
 * Shared experts as slots (moe_shared_routing): from route's topk_ids [M, k] (k = route.topk,
 * the routed slots), expert_map and topk_weights (absent for a gate), write ids [M, k + n]
 * i32, each slot's local expert (-1: invalid, a routed slot on a shared expert included; slot
 * k + s: experts - n + s), and weights [M, k + n] f32 when present (routed: topk_weights;
 * shared: scale * shared_weights[m], or scale).
 */
typedef struct mf_shared_args {
    mf_moe_args route;
    int64_t n_shared;
    float scale;
    moefuse_tensor shared_weights; /* [M] f32, or absent */
    moefuse_tensor ids, weights;   /* dense; weights absent when route.topk_weights is */
} mf_shared_args;

/* routing_metadata: route holds the routing fields of mf_moe_args (tokens, topk, experts,
 * global_experts, topk_ids, expert_map); absent outputs (data NULL) are not written. */
typedef struct mf_meta_args {
    mf_moe_args route;
    int64_t block;  /* block_size */
    int64_t length; /* L, order's length (0 when order is absent) */
    moefuse_tensor counts, offsets, order, position, masked_row;
} mf_meta_args;

/*
 * Expert parallelism's rows (src/ep). A list of n rows of a rank-3 tensor [E, T, K] (x lifted
 * to [1, M, K], recv_x, y), row i at index[i] = e * T + t, and a packed buffer of n rows of
 * row_bytes in backend memory. A packed row is the row's K elements as they are; or, f8 rows
 * with scales, its K codes then its K / 128 group scales as f32 values (UE8M0 exponents
 * decoded); or, to_f32, its K elements as f32.
 */
typedef struct mf_ep_rows_args {
    moefuse_tensor rows;         /* [E, T, K] */
    moefuse_tensor scales;       /* f8 rows: rank 3 in `layout` (f32, u8 or packed i32) */
    moefuse_scale_layout layout;
    int64_t groups;              /* K / 128 with scales, else 0 */
    const int64_t *index;        /* [n], host memory */
    int64_t n;
    bool to_f32;                 /* gather only */
    void *buffer;                /* backend memory, n * row_bytes */
    size_t row_bytes;
    /* scatter with scales in the column-major or packed layout: [E] rows each expert gets, so
       that the padding rows T .. Ta - 1 and the written rows' whole packed words are zeroed
       first (host memory) */
    const int64_t *counts;
} mf_ep_rows_args;

/* The top-k sum of the rows sent back: out[m] = sum over j with slot_row[m k + j] >= 0, in
   order, of weight * back[slot_row], each product rounded to f32 and added in f32 from 0,
   rounded once to out's dtype (docs/NUMERICS.md, MoE's reduced final). */
typedef struct mf_ep_reduce_args {
    const void *back;        /* backend memory: [n, K] f32 */
    const int64_t *slot_row; /* [M k], host memory */
    const float *weight;     /* [M k], host memory */
    int64_t tokens, topk, model_dim;
    moefuse_tensor out;      /* [M, K] f32/f16/bf16 */
} mf_ep_reduce_args;

/*
 * Expert parallelism's low-latency mode (src/ep/ep_ll.c): blocks of fixed size between ranks,
 * laid out as ep/ep_ll_wire.h says, in backend memory; every index the steps share lives in
 * backend memory too, written and read on the device, so that no step waits for the host.
 * The four steps take the members they name.
 */
typedef struct mf_ep_ll_args {
    mf_ep_ll_wire wire;
    int32_t world, rank;           /* W, and this rank: its own blocks never cross the link
                                      (place and partial read block `rank` of send, sum block
                                      `rank` of partial) */
    int64_t tokens, model_dim;     /* M (this rank's), K */
    int64_t groups;                /* FP8 rows: K / 128 scales a row; else 0 */
    /* pack: this rank's rows into the W send blocks, and where each token went */
    moefuse_tensor x;              /* [1, M, K]: x's rows, or FP8 codes */
    moefuse_tensor x_scales;       /* FP8: rank 3 [1, M, G] in x_layout */
    moefuse_scale_layout x_layout;
    moefuse_tensor ids, weights;   /* [M, k] i32 global experts, f32 */
    const int32_t *owner, *local;  /* [experts], backend memory: an expert's rank, its index
                                      there */
    int32_t experts;               /* E, global */
    void *send;                    /* [W] blocks */
    int32_t *pos;                  /* [C, W]: token m's row in block p, -1: not sent there
                                      (pack writes it, sum reads it) */
    /* place: the W received blocks into the masked layout */
    const void *recv;              /* [W] blocks, block p from rank p (but this rank's) */
    moefuse_tensor recv_x;         /* [E_local, Tmax, K] */
    moefuse_tensor recv_scales;    /* FP8: rank 3 in recv_layout */
    moefuse_scale_layout recv_layout;
    moefuse_tensor recv_counts;    /* [E_local] i32: rows each expert should hold */
    int32_t *row_of;               /* [W, C, k]: slot j of row i of block p, its row t of its
                                      expert, or -2 (lost past Tmax); read only for slots
                                      whose expert is here */
    /* partial: y's rows of each received row's slots, summed; sum: those rows summed by rank */
    moefuse_tensor y;              /* [E_local, Tmax, K] */
    float *partial;                /* [W, C, K]: row i for rank p's block */
    const float *back;             /* [W, C, K]: what rank p sent back for this rank's rows (but
                                      this rank's) */
    moefuse_tensor out;            /* [M, K] */
} mf_ep_ll_args;

/* -------------------------------------------------------------- workspace */

/* A region of backend memory: data (a pointer, or a cl_mem) plus a byte offset. */
typedef struct mf_region {
    void *data;
    uint64_t offset;
    size_t bytes;
} mf_region;

/*
 * The caller's workspace (moefuse_set_workspace) when one is set: a backend takes its scratch
 * from it instead of allocating. The core has checked that it holds what the operation's
 * *_workspace member declared, so a request beyond it is a bug (MOEFUSE_ERR_INTERNAL).
 */
bool mf_caller_workspace(const moefuse_context *ctx, mf_region *ws);
/*
 * An operation's scratch of `bytes` from the caller's workspace: *given is false when none is
 * set (the backend allocates its own), else *ws is the workspace. A request beyond it is
 * MOEFUSE_ERR_INTERNAL: the operation's *_workspace member under-reported.
 */
moefuse_status mf_caller_scratch(moefuse_context *ctx, const char *op, size_t bytes,
                                 mf_region *ws, bool *given);

/* ---------------------------------------------------------------- vtable */

typedef struct moefuse_backend_i moefuse_backend_i;

struct moefuse_backend_i {
    /* Name used by MOEFUSE_BACKEND and moefuse_backend_name. */
    const char *name;

    /* Whether a usable device exists, without creating state (for "auto" and `moefuse info`). */
    bool (*probe)(void);

    /* Create the backend's state for a new context. Report failures with mf_error(ctx, ...).
     * device: the caller's choice of device (moefuse_context_create_on, never ""), or NULL for
     * the backend's own (its environment variable, else its default). */
    moefuse_status (*init)(moefuse_context *ctx, const char *device, void **state);
    /* [optional] create the state over the caller's native context and queue (both non-NULL;
     * moefuse_context_create_opencl), retaining them so that release drops only its own
     * references; failures as init. Default: MOEFUSE_ERR_UNSUPPORTED. */
    moefuse_status (*adopt)(moefuse_context *ctx, void *native_context, void *native_queue,
                            void **state);
    /* Release the state (NULL allowed). */
    void (*release)(void *state);

    /* Device description, owned by the state. */
    const char *(*device_name)(void *state);

    /* [optional] attach the caller's stream/queue (NULL = own). Default: only NULL accepted. */
    moefuse_status (*set_stream)(moefuse_context *ctx, void *state, void *stream);
    /* [optional] the stream/queue in use. Default: NULL (no streams). */
    void *(*get_stream)(void *state);
    /* [optional] wait for submitted work. Default: nothing to wait for. */
    moefuse_status (*synchronize)(moefuse_context *ctx, void *state);

    /* Backend memory. */
    moefuse_status (*buffer_alloc)(moefuse_context *ctx, void *state, size_t bytes, void **buffer);
    void (*buffer_free)(void *state, void *buffer);
    moefuse_status (*buffer_write)(moefuse_context *ctx, void *state, void *buffer, size_t offset,
                                   const void *src, size_t bytes);
    moefuse_status (*buffer_read)(moefuse_context *ctx, void *state, const void *buffer,
                                  size_t offset, void *dst, size_t bytes);
    /* [optional] does `data` belong to this backend's device? Default: any non-NULL pointer. */
    bool (*owns_pointer)(void *state, const void *data);
    /* [optional] bytes from `data` to the end of the memory it lies in (a cl_mem's size, the
     * rest of a device allocation), false when unknown. Tensors must end inside it. Called
     * only for data owns_pointer accepted. Default: unknown (host pointers). */
    bool (*buffer_extent)(void *state, const void *data, uint64_t *bytes);
    /* [optional] accept `buffer` (non-NULL), memory the caller allocated, in tensors and buffer
     * copies until buffer_free (moefuse_buffer_import). Default: accept what owns_pointer
     * accepts (nothing to do), refuse the rest with MOEFUSE_ERR_WRONG_DEVICE. */
    moefuse_status (*buffer_import)(moefuse_context *ctx, void *state, void *buffer);
    /* true when tensor.data is an opaque handle (cl_mem): alignment is checked on offset only. */
    bool data_is_handle;

    /* Operations. Args are validated and normalised; outputs may be written freely. */
    moefuse_status (*act_quant)(moefuse_context *ctx, void *state, const mf_rows_args *a);
    moefuse_status (*act_mul)(moefuse_context *ctx, void *state, const mf_rows_args *a);
    moefuse_status (*quant)(moefuse_context *ctx, void *state, const mf_rows_args *a);
    moefuse_status (*dequant)(moefuse_context *ctx, void *state, const mf_dequant_args *a);
    moefuse_status (*topk_softmax)(moefuse_context *ctx, void *state, const mf_topk_args *a);
    /* [optional] shared experts as slots, which the core then passes to the MoE members as
     * an ordinary routing (no expert map). Default: shared experts are unsupported */
    moefuse_status (*moe_shared_routing)(moefuse_context *ctx, void *state,
                                         const mf_shared_args *a);
    /* [optional] routing_metadata. Default: the call is unsupported on the backend */
    moefuse_status (*routing_metadata)(moefuse_context *ctx, void *state, const mf_meta_args *a);
    /* [optional] topk_route, every option of mf_topk_args. Default: the call is unsupported
     * on the backend (topk_softmax falls back to it when topk_softmax is absent) */
    moefuse_status (*topk_route)(moefuse_context *ctx, void *state, const mf_topk_args *a);
    moefuse_status (*moe_gate)(moefuse_context *ctx, void *state, const mf_moe_args *a);
    moefuse_status (*moe_final)(moefuse_context *ctx, void *state, const mf_moe_args *a);
    /*
     * [optional] whole layer, keeping the [M, k, I] intermediate in scratch of
     * its own (a->h is absent), so it can grow it without synchronising.
     * Default: moe_gate then moe_final on a context workspace the core allocates.
     */
    moefuse_status (*moe_forward)(moefuse_context *ctx, void *state, const mf_moe_args *a);

    /*
     * [optional] Exact bytes of scratch an operation takes with these args: what it asks for
     * (from mf_caller_workspace when the caller set one, else its own allocation). Default:
     * none. No backend needs scratch to dequantize, so dequant has no member.
     */
    /* act_quant (2-D and masked), act_mul, quant */
    moefuse_status (*rows_workspace)(moefuse_context *ctx, void *state, const mf_rows_args *a,
                                     size_t *bytes);
    moefuse_status (*topk_workspace)(moefuse_context *ctx, void *state, const mf_topk_args *a,
                                     size_t *bytes);
    moefuse_status (*meta_workspace)(moefuse_context *ctx, void *state, const mf_meta_args *a,
                                     size_t *bytes);
    moefuse_status (*moe_gate_workspace)(moefuse_context *ctx, void *state, const mf_moe_args *a,
                                         size_t *bytes);
    moefuse_status (*moe_final_workspace)(moefuse_context *ctx, void *state, const mf_moe_args *a,
                                          size_t *bytes);
    /* with moe_forward: its scratch, the [M, k, I] intermediate included */
    moefuse_status (*moe_forward_workspace)(moefuse_context *ctx, void *state,
                                            const mf_moe_args *a, size_t *bytes);

    /*
     * [optional] FP8 MoE (the FP8 fields of mf_moe_args; routed or masked). Default:
     * MOEFUSE_ERR_UNSUPPORTED. The gate writes h and h_scales; the final reads them.
     */
    moefuse_status (*moe_gate_fp8)(moefuse_context *ctx, void *state, const mf_moe_args *a);
    moefuse_status (*moe_final_fp8)(moefuse_context *ctx, void *state, const mf_moe_args *a);
    /* [optional] whole layer with h and h_scales in scratch of its own (a->h absent).
     * Default: moe_gate_fp8 then moe_final_fp8 with h in the core's workspace. */
    moefuse_status (*moe_forward_fp8)(moefuse_context *ctx, void *state, const mf_moe_args *a);
    /* [optional] their scratch, as for moe_gate_workspace */
    moefuse_status (*moe_gate_fp8_workspace)(moefuse_context *ctx, void *state,
                                             const mf_moe_args *a, size_t *bytes);
    moefuse_status (*moe_final_fp8_workspace)(moefuse_context *ctx, void *state,
                                              const mf_moe_args *a, size_t *bytes);
    moefuse_status (*moe_forward_fp8_workspace)(moefuse_context *ctx, void *state,
                                                const mf_moe_args *a, size_t *bytes);

    /*
     * [optional] expert parallelism's work on rows (src/ep): pack listed rows into a buffer,
     * unpack a buffer into listed rows, the top-k sum of returned rows, and a copy between
     * two regions of backend memory that completes before it returns (the in-process
     * transport's). All four or none. Default: expert parallelism unsupported on the backend.
     */
    moefuse_status (*ep_gather)(moefuse_context *ctx, void *state, const mf_ep_rows_args *a);
    moefuse_status (*ep_scatter)(moefuse_context *ctx, void *state, const mf_ep_rows_args *a);
    moefuse_status (*ep_reduce)(moefuse_context *ctx, void *state, const mf_ep_reduce_args *a);
    moefuse_status (*ep_copy)(moefuse_context *ctx, void *state, void *dst, const void *src,
                              size_t bytes);
    /*
     * [optional] the low-latency mode's four steps (mf_ep_ll_args): pack (a: the pack fields,
     * send, pos), place (recv into recv_x, recv_scales, recv_counts, row_of), partial (recv's
     * rows, row_of and y into partial) and sum (back and pos into out). Queued on the
     * backend's stream like the ops; none reads device data on the host. All four or none
     * (with the rows' members). Default: the mode unsupported on the backend.
     */
    moefuse_status (*ep_ll_pack)(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
    moefuse_status (*ep_ll_place)(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
    moefuse_status (*ep_ll_partial)(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
    moefuse_status (*ep_ll_sum)(moefuse_context *ctx, void *state, const mf_ep_ll_args *a);
    /*
     * [optional] groups over NCCL, one rank per process and device: a new unique id (128
     * bytes), and this rank's transport among `world` from one (or over the caller's comm, an
     * ncclComm_t, when comm is non-NULL; it is not destroyed with the transport). Default:
     * groups over NCCL unsupported on the backend.
     */
    moefuse_status (*ep_unique_id)(moefuse_context *ctx, void *state, void *id);
    moefuse_status (*ep_transport)(moefuse_context *ctx, void *state, const void *id, void *comm,
                                   int32_t rank, int32_t world, mf_ep_transport *out);
};

/* Backends compiled in; each file defines one (NULL-terminated table in registry.c). */
extern const moefuse_backend_i mf_backend_cpu;
#ifdef MOEFUSE_WITH_CUDA
extern const moefuse_backend_i mf_backend_cuda;
#endif
#ifdef MOEFUSE_WITH_OPENCL
extern const moefuse_backend_i mf_backend_opencl;
#endif

/* Return from the enclosing function when a step fails (core and backends alike). */
#define MF_TRY(expr)                                                                             \
    do {                                                                                         \
        moefuse_status mf_status_ = (expr);                                                      \
        if (mf_status_ != MOEFUSE_OK)                                                            \
            return mf_status_;                                                                   \
    } while (0)

/* A rank-2 tensor as rank 3 with a leading unit dimension (stride 0); any other as it is: the
 * masked layout's [E, T, K] read by the code of both layouts. */
moefuse_tensor mf_tensor_lift3(const moefuse_tensor *t);

/* Record a formatted error message on ctx (printf-style) and return `status`. */
moefuse_status mf_error(moefuse_context *ctx, moefuse_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_CORE_BACKEND_H */
