/*
 * moefuse: fused Mixture-of-Experts kernels (activation + quantization,
 * merged MoE GEMMs, routing) behind one API on CPU, CUDA and OpenCL.
 *
 * Conventions shared by every call:
 *  - Every entry point returns a moefuse_status. On failure nothing has been
 *    written to any output, and moefuse_last_error(ctx) says what was wrong
 *    (one exception: MOEFUSE_ERR_BACKEND_FAILURE from a launch the device
 *    runtime failed after an earlier kernel of the call ran).
 *  - Option structs are zero-initialisable: a field left at 0 takes the
 *    documented default, so `moefuse_quant_options opt = {0};` is valid. Each
 *    ends in reserved words that must stay 0: a later version gives them meaning
 *    (0 keeps today's behaviour), so the structs never change size, and an older
 *    library refuses a non-zero word rather than ignore an option it does not know.
 *  - Tensors live where the context's backend wants them: host memory for
 *    "cpu", CUDA device pointers for "cuda", cl_mem handles plus a byte offset
 *    for "opencl" (from moefuse_buffer_alloc, or the caller's through
 *    moefuse_buffer_import). moefuse_buffer_* moves data portably for tests and tools.
 *  - A context is used by one thread at a time (like a CUDA stream); a call that
 *    finds another thread inside a call on the same context is refused with
 *    MOEFUSE_ERR_CONTEXT_BUSY. Different contexts may be used from different
 *    threads at once.
 *  - No output may share a byte with any other operand of the same call.
 */
#ifndef MOEFUSE_H
#define MOEFUSE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library exports these symbols only (it is built with hidden visibility). Windows is not
 * a supported platform yet, so there is no dllexport / dllimport here. */
#if defined(__GNUC__) && defined(MOEFUSE_BUILDING)
#define MOEFUSE_API __attribute__((visibility("default")))
#else
#define MOEFUSE_API
#endif

/* The version of this header (meson.build holds the same). moefuse_version() returns the
 * library's: a program can compare the two to find that it runs against another build. */
#define MOEFUSE_VERSION_MAJOR 0
#define MOEFUSE_VERSION_MINOR 3
#define MOEFUSE_VERSION_PATCH 0
#define MOEFUSE_VERSION                                                                            \
    (MOEFUSE_VERSION_MAJOR * 10000 + MOEFUSE_VERSION_MINOR * 100 + MOEFUSE_VERSION_PATCH)

/* ------------------------------------------------------------------ status */

typedef enum moefuse_status {
    MOEFUSE_OK = 0,
    MOEFUSE_ERR_NULL_POINTER,        /* a required pointer argument is NULL */
    MOEFUSE_ERR_INVALID_ARGUMENT,    /* an option or scalar is out of range */
    MOEFUSE_ERR_SHAPE,               /* ranks or shapes do not fit together */
    MOEFUSE_ERR_DTYPE,               /* a tensor has a dtype the call cannot take */
    MOEFUSE_ERR_STRIDE,              /* innermost stride is not 1, or strides overlap rows */
    MOEFUSE_ERR_ALIGNMENT,           /* data pointer/offset not aligned to its element */
    MOEFUSE_ERR_WRONG_DEVICE,        /* tensor memory does not belong to this context */
    MOEFUSE_ERR_UNSUPPORTED,         /* valid request this backend does not implement */
    MOEFUSE_ERR_BACKEND_UNAVAILABLE, /* backend not built, or no device found */
    MOEFUSE_ERR_OUT_OF_MEMORY,       /* host or device allocation failed */
    MOEFUSE_ERR_BACKEND_FAILURE,     /* the device runtime reported an error */
    MOEFUSE_ERR_INTERNAL,            /* a bug in moefuse */
    MOEFUSE_ERR_OUT_OF_BOUNDS,       /* a tensor runs past the end of its buffer */
    MOEFUSE_ERR_OVERLAP,             /* an output shares memory with another operand */
    MOEFUSE_ERR_CONTEXT_BUSY,        /* another thread is inside a call on this context;
                                        the message is in moefuse_last_error(NULL) */
    MOEFUSE_ERR_WORKSPACE_TOO_SMALL, /* the caller's workspace holds less than the call needs */
    MOEFUSE_STATUS_COUNT_            /* not a status: number of statuses */
} moefuse_status;

/* "MOEFUSE_ERR_SHAPE" and so on; "unknown status" outside the enum. */
MOEFUSE_API const char *moefuse_status_name(moefuse_status status);

/* The library's MOEFUSE_VERSION (major * 10000 + minor * 100 + patch), as it was built. */
MOEFUSE_API unsigned moefuse_version(void);

/* ------------------------------------------------------------------ tensors */

typedef enum moefuse_dtype {
    MOEFUSE_F32 = 0,
    MOEFUSE_F16,
    MOEFUSE_BF16,
    MOEFUSE_F8_E4M3, /* e4m3fn: max 448, no Inf, NaN = 0x7F / 0xFF */
    MOEFUSE_I8,
    MOEFUSE_I32,
    MOEFUSE_U8,      /* UE8M0 scale exponents (value 2^(e-127)) */
    MOEFUSE_DTYPE_COUNT_
} moefuse_dtype;

#define MOEFUSE_MAX_RANK 4

/*
 * A strided view of memory. Shapes and strides are in elements, 64-bit.
 * The innermost dimension must have stride 1; outer strides may exceed the
 * dense ones (padded rows, slices) but rows may not overlap.
 * `data` is a host pointer, a CUDA device pointer, or a cl_mem; the element
 * at index i0..i3 sits at byte `offset + sum(i_d * stride[d]) * elem_size`.
 * A tensor with data == NULL is "absent" where an operand is optional.
 */
typedef struct moefuse_tensor {
    void *data;
    int64_t offset;                  /* bytes, added to data */
    moefuse_dtype dtype;
    int32_t rank;
    int64_t shape[MOEFUSE_MAX_RANK];
    int64_t stride[MOEFUSE_MAX_RANK];
} moefuse_tensor;

/* A dense row-major tensor over `data` (shape[rank-1] contiguous). */
MOEFUSE_API moefuse_tensor moefuse_tensor_dense(void *data, moefuse_dtype dtype,
                                                int32_t rank, const int64_t *shape);
/* Same with explicit strides (elements). */
MOEFUSE_API moefuse_tensor moefuse_tensor_strided(void *data, moefuse_dtype dtype, int32_t rank,
                                                  const int64_t *shape, const int64_t *stride);
/* Number of elements (product of the shape; 1 for rank 0); -1 when it overflows int64. */
MOEFUSE_API int64_t moefuse_tensor_numel(const moefuse_tensor *t);
/* Bytes from the first to one past the last element (0 when empty); -1 when it overflows. */
MOEFUSE_API int64_t moefuse_tensor_span_bytes(const moefuse_tensor *t);
MOEFUSE_API size_t moefuse_dtype_size(moefuse_dtype dtype);
MOEFUSE_API const char *moefuse_dtype_name(moefuse_dtype dtype);

/* ------------------------------------------------------------------ context */

typedef struct moefuse_context moefuse_context;

/*
 * Create a context on `backend`: "cpu", "cuda", "opencl", or "auto".
 * NULL means the MOEFUSE_BACKEND environment variable, or "auto" if unset.
 * "auto" takes CUDA if a device is present, else OpenCL if a GPU platform is
 * present, else CPU. On failure *out is NULL and moefuse_last_error(NULL)
 * says why (an unknown or unbuilt name lists the built backends).
 */
MOEFUSE_API moefuse_status moefuse_context_create(moefuse_context **out, const char *backend);
/*
 * As moefuse_context_create, on a chosen device of `backend` ("cuda" or "opencl"; NULL and
 * "auto" take no device, and "cpu" has one): for CUDA a device index ("0", "1", ...), for
 * OpenCL "p:d" (platform index, device index) or a case-insensitive piece of the device or
 * platform name. It takes the place of MOEFUSE_CUDA_DEVICE / MOEFUSE_OPENCL_DEVICE; NULL keeps
 * them. A device that does not exist gives MOEFUSE_ERR_BACKEND_UNAVAILABLE.
 */
MOEFUSE_API moefuse_status moefuse_context_create_on(moefuse_context **out, const char *backend,
                                                     const char *device);
/*
 * A context on the caller's OpenCL objects: `cl_context` is a cl_context and `cl_queue` an
 * in-order cl_command_queue of it; the context's device is the queue's (MOEFUSE_OPENCL_DEVICE
 * does not apply). moefuse retains both and moefuse_context_destroy releases only its own
 * references, after waiting for the queue (clFinish). The queue becomes the context's own:
 * calls run on it, and moefuse_set_stream(ctx, NULL) returns to it. Tensors lie in buffers of
 * moefuse_buffer_alloc or in the caller's cl_mem once imported (moefuse_buffer_import).
 * Refused: NULL out, cl_context or cl_queue (MOEFUSE_ERR_NULL_POINTER); a queue of another
 * cl_context (MOEFUSE_ERR_WRONG_DEVICE); an out-of-order queue (MOEFUSE_ERR_INVALID_ARGUMENT);
 * a library built without OpenCL (MOEFUSE_ERR_BACKEND_UNAVAILABLE). On failure *out is NULL
 * and moefuse_last_error(NULL) says why, as for moefuse_context_create.
 */
MOEFUSE_API moefuse_status moefuse_context_create_opencl(moefuse_context **out, void *cl_context,
                                                         void *cl_queue);
MOEFUSE_API void moefuse_context_destroy(moefuse_context *ctx);

/* "cpu", "cuda" or "opencl". */
MOEFUSE_API const char *moefuse_backend_name(const moefuse_context *ctx);
/* Human-readable device ("CPU (x86_64, 2 OpenMP threads)", "NVIDIA H100 ..."). */
MOEFUSE_API const char *moefuse_device_name(const moefuse_context *ctx);

/*
 * Message of the last failed call on ctx ("" after success). With ctx NULL:
 * the calling thread's message from moefuse_context_create.
 */
MOEFUSE_API const char *moefuse_last_error(const moefuse_context *ctx);

/*
 * Run on the caller's cudaStream_t (cuda) or cl_command_queue (opencl).
 * NULL restores the context's own stream/queue. The cpu backend takes only NULL.
 */
MOEFUSE_API moefuse_status moefuse_set_stream(moefuse_context *ctx, void *stream);
/*
 * The cudaStream_t or cl_command_queue calls on ctx run on now (the caller's
 * or the context's own), for enqueueing one's own work in order with them;
 * NULL on the cpu backend. From an OpenCL queue, clGetCommandQueueInfo gives
 * the cl_context and cl_device_id. The handle stays owned by its creator.
 */
MOEFUSE_API moefuse_status moefuse_get_stream(moefuse_context *ctx, void **stream);
/* Wait until all work submitted on the context's stream is done. */
MOEFUSE_API moefuse_status moefuse_synchronize(moefuse_context *ctx);

/* Comma-separated list of the backends compiled into this library. */
MOEFUSE_API const char *moefuse_built_backends(void);

/* ------------------------------------------------------------------ buffers */
/* Memory in the backend's address space (host memory for cpu). */

MOEFUSE_API moefuse_status moefuse_buffer_alloc(moefuse_context *ctx, size_t bytes, void **buffer);
/* Frees a buffer of moefuse_buffer_alloc; for an imported cl_mem, drops moefuse's reference. */
MOEFUSE_API moefuse_status moefuse_buffer_free(moefuse_context *ctx, void *buffer);
/*
 * Let tensors of ctx lie in memory the caller allocated. NULL: MOEFUSE_ERR_NULL_POINTER.
 * OpenCL: `buffer` must be a cl_mem buffer object (a sub-buffer too) of the context's
 * cl_context. moefuse retains it and accepts it in tensors and in moefuse_buffer_write / _read
 * until moefuse_buffer_free(ctx, buffer), which drops moefuse's reference only (the caller's
 * stays valid; moefuse_context_destroy drops it too). Tensors on it must end inside its
 * CL_MEM_SIZE. Importing it again changes nothing (one reference). Refused: a cl_mem of another
 * cl_context (MOEFUSE_ERR_WRONG_DEVICE), an image (MOEFUSE_ERR_INVALID_ARGUMENT). Anything but
 * a cl_mem is undefined behaviour: OpenCL cannot tell a host pointer from a handle, and asking
 * about one crashes inside the ICD loader (this is why tensors need an import at all).
 * moefuse cannot see that two sub-buffers, or a sub-buffer and its parent, share memory: there
 * the caller keeps outputs apart from other operands.
 * CUDA and CPU: tensors may lie in any memory of the device, so nothing is imported. Memory the
 * backend accepts in tensors (device memory of the context's device; any host pointer) gives
 * MOEFUSE_OK and nothing changes; other memory gives MOEFUSE_ERR_WRONG_DEVICE. Such memory must
 * not go to moefuse_buffer_free there: it would be freed.
 */
MOEFUSE_API moefuse_status moefuse_buffer_import(moefuse_context *ctx, void *buffer);
/* Copy host -> buffer at byte `offset`, and back. Synchronous. */
MOEFUSE_API moefuse_status moefuse_buffer_write(moefuse_context *ctx, void *buffer, size_t offset,
                                                const void *src, size_t bytes);
MOEFUSE_API moefuse_status moefuse_buffer_read(moefuse_context *ctx, const void *buffer,
                                               size_t offset, void *dst, size_t bytes);

/* ---------------------------------------------------------------- workspace */
/*
 * Scratch memory: routing lists, f32 partial rows, moe_forward's [M, k, I] intermediate on the
 * devices, per-thread row buffers on the CPU. By default a context allocates its own, grown on
 * demand and freed with it. After moefuse_set_workspace every call takes its scratch from the
 * caller's buffer and allocates none; a call that needs more than the buffer holds is refused
 * with MOEFUSE_ERR_WORKSPACE_TOO_SMALL before anything is written.
 *
 * workspace: a rank-1 u8 tensor [bytes] in the backend's memory, its first byte aligned to
 * MOEFUSE_WORKSPACE_ALIGNMENT; on OpenCL a whole cl_mem (offset 0: clCreateSubBuffer cuts a
 * piece of a larger one). NULL, or data NULL, gives the context its own scratch back.
 * Calls use the buffer in the order of the context's stream / queue, so one buffer serves
 * every call on one stream; it must stay allocated, and untouched by other work and by the
 * calls' operands, until the calls that used it have finished.
 *
 * moefuse_<call>_workspace_size(ctx, <the call's arguments>, &bytes) validates the arguments
 * as the call would (same statuses and messages) and gives the exact bytes the call takes on
 * ctx's backend, without running it: 0 when it takes none. The CPU backend's needs scale with
 * its OpenMP thread count at the time of the query.
 */
#define MOEFUSE_WORKSPACE_ALIGNMENT 256

MOEFUSE_API moefuse_status moefuse_set_workspace(moefuse_context *ctx,
                                                 const moefuse_tensor *workspace);

/* ------------------------------------------------------------------ options */

typedef enum moefuse_activation {
    MOEFUSE_ACT_SILU = 0,       /* g / (1 + exp(-g)) */
    MOEFUSE_ACT_GELU = 1,       /* 0.5 g (1 + erf(g / sqrt 2)) */
    MOEFUSE_ACT_GELU_TANH = 2,  /* 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) */
    MOEFUSE_ACT_SILU_ALPHA = 3, /* g / (1 + exp(-(alpha g))), the options' alpha (gpt-oss: 1.702) */
    MOEFUSE_ACT_COUNT_
} moefuse_activation;

/* Where the gate and up values of a gated row (x of the row ops, w1 / b1 of the MoE calls)
 * lie, for H values of each. */
typedef enum moefuse_gate_order {
    MOEFUSE_GATE_FIRST = 0,       /* [gate | up]: gate i at i, up i at H + i */
    MOEFUSE_UP_FIRST = 1,         /* [up | gate]: up i at i, gate i at H + i */
    MOEFUSE_GATE_INTERLEAVED = 2, /* gate i at 2i, up i at 2i + 1 (gpt-oss) */
    MOEFUSE_GATE_ORDER_COUNT_
} moefuse_gate_order;

/* alpha of MOEFUSE_ACT_SILU_ALPHA when the options leave it 0 (gpt-oss's value). */
#define MOEFUSE_SILU_ALPHA_DEFAULT 1.702f

typedef enum moefuse_rounding {
    MOEFUSE_ROUND_NONE = 0, /* one f32 value per element */
    MOEFUSE_ROUND_BF16,     /* act(g) and h rounded to bf16 (RNE), as unfused engines do */
    MOEFUSE_ROUNDING_COUNT_
} moefuse_rounding;

/*
 * Where per-group scales go, for T rows and Gn = H / G groups per row
 * (Ta = T rounded up to a multiple of 4; in the 3-D layout T is Tmax and each
 * expert gets its own block, the expert index outermost):
 *  ROW_MAJOR     scales [T, Gn]            (3-D: [E, Tmax, Gn])   f32, or u8 with ue8m0
 *  COLUMN_MAJOR  scales [Gn, Ta]           (3-D: [E, Gn, Ta])     f32, or u8 with ue8m0
 *  PACKED_UE8M0  scales [ceil(Gn/4), Ta]   (3-D: [E, ceil(Gn/4), Ta]) i32, byte g%4 of
 *                word (g/4, t) holds the exponent; implies ue8m0.
 * Padding (rows T..Ta-1, unused bytes of the last packed word) is written as 0.
 */
typedef enum moefuse_scale_layout {
    MOEFUSE_SCALE_ROW_MAJOR = 0,
    MOEFUSE_SCALE_COLUMN_MAJOR,
    MOEFUSE_SCALE_PACKED_UE8M0,
    MOEFUSE_SCALE_LAYOUT_COUNT_
} moefuse_scale_layout;

/*
 * The smallest eps accepted: with it every scale amax / 448 (or / 127) is a
 * normal f32 number, so h / s stays finite and no finite input gives a NaN code.
 */
#define MOEFUSE_QUANT_EPS_MIN 1e-35f

/* Per-token-group quantization. The output dtype (f8_e4m3 or i8) is q's dtype. */
typedef struct moefuse_quant_options {
    int64_t group_size;                /* 32, 64, 128 or H; 0 = 128 */
    moefuse_scale_layout scale_layout; /* default ROW_MAJOR */
    int32_t ue8m0;                     /* round scales up to a power of two (FP8 only) */
    float eps;                         /* floor of amax; 0 = 1e-10; at least
                                          MOEFUSE_QUANT_EPS_MIN */
    uint32_t reserved[4];              /* must be 0 */
} moefuse_quant_options;

/* The gated activation h = act(g) * (u + up_offset), docs/NUMERICS.md "Gated activation".
 * gpt-oss: activation SILU_ALPHA, alpha 1.702 (or 0), up_offset 1, limit 7, order
 * GATE_INTERLEAVED. */
typedef struct moefuse_act_options {
    moefuse_activation activation; /* default SILU */
    moefuse_gate_order order;      /* default GATE_FIRST */
    float limit;                   /* > 0: g = min(g, limit), u = clamp(u, -limit, limit); 0 = off */
    moefuse_rounding intermediate; /* default NONE */
    float alpha;                   /* SILU_ALPHA's alpha: finite and > 0, 0 = 1.702; must be 0
                                      with the other activations */
    float up_offset;               /* finite; added to u after the clamp; 0 = nothing added */
    uint32_t reserved[2];          /* must be 0 */
} moefuse_act_options;

typedef struct moefuse_act_quant_options {
    moefuse_act_options act;
    moefuse_quant_options quant;
    int32_t zero_tail; /* masked 3-D only: rows t >= n[e] get q = 0 and scale = 0 */
    uint32_t reserved[4]; /* must be 0 */
} moefuse_act_quant_options;

/* ------------------------------------------- fused activation + quantization */

/*
 * 2-D: x [T, 2H] f32/f16/bf16 -> q [T, H] f8_e4m3 or i8, scales per layout.
 * row_scale: optional [T] f32, multiplied into h (router weight folded in).
 * opt may be NULL (all defaults).
 */
MOEFUSE_API moefuse_status moefuse_act_quant(moefuse_context *ctx, const moefuse_tensor *x,
                                             const moefuse_tensor *row_scale,
                                             const moefuse_tensor *q, const moefuse_tensor *scales,
                                             const moefuse_act_quant_options *opt);
MOEFUSE_API moefuse_status moefuse_act_quant_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *row_scale,
    const moefuse_tensor *q, const moefuse_tensor *scales, const moefuse_act_quant_options *opt,
    size_t *bytes);

/*
 * 3-D expert-masked: x [E, Tmax, 2H]; counts [E] i32 in the backend's memory,
 * clamped to [0, Tmax] by the kernel; row_scale optional [E, Tmax] f32;
 * expert_scale optional [E] f32 or bf16; q [E, Tmax, H]. Rows t >= n[e] are
 * left untouched unless opt->zero_tail.
 */
MOEFUSE_API moefuse_status moefuse_act_quant_masked(moefuse_context *ctx, const moefuse_tensor *x,
                                                    const moefuse_tensor *counts,
                                                    const moefuse_tensor *row_scale,
                                                    const moefuse_tensor *expert_scale,
                                                    const moefuse_tensor *q,
                                                    const moefuse_tensor *scales,
                                                    const moefuse_act_quant_options *opt);
MOEFUSE_API moefuse_status moefuse_act_quant_masked_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *counts,
    const moefuse_tensor *row_scale, const moefuse_tensor *expert_scale, const moefuse_tensor *q,
    const moefuse_tensor *scales, const moefuse_act_quant_options *opt, size_t *bytes);

/* x [T, 2H] -> out [T, H] in x's dtype (SwiGLU / GeGLU), row_scale optional [T] f32. */
MOEFUSE_API moefuse_status moefuse_act_mul(moefuse_context *ctx, const moefuse_tensor *x,
                                           const moefuse_tensor *row_scale,
                                           const moefuse_tensor *out,
                                           const moefuse_act_options *opt);
MOEFUSE_API moefuse_status moefuse_act_mul_workspace_size(moefuse_context *ctx,
                                                          const moefuse_tensor *x,
                                                          const moefuse_tensor *row_scale,
                                                          const moefuse_tensor *out,
                                                          const moefuse_act_options *opt,
                                                          size_t *bytes);

/* x [T, H] f32/f16/bf16 -> q [T, H] f8_e4m3 or i8, scales per layout. */
MOEFUSE_API moefuse_status moefuse_quant(moefuse_context *ctx, const moefuse_tensor *x,
                                         const moefuse_tensor *q, const moefuse_tensor *scales,
                                         const moefuse_quant_options *opt);
MOEFUSE_API moefuse_status moefuse_quant_workspace_size(moefuse_context *ctx,
                                                        const moefuse_tensor *x,
                                                        const moefuse_tensor *q,
                                                        const moefuse_tensor *scales,
                                                        const moefuse_quant_options *opt,
                                                        size_t *bytes);

/* q [T, H] with its scales -> out [T, H] f32/f16/bf16 (out = q * s; NaN code -> NaN). */
MOEFUSE_API moefuse_status moefuse_dequant(moefuse_context *ctx, const moefuse_tensor *q,
                                           const moefuse_tensor *scales, const moefuse_tensor *out,
                                           const moefuse_quant_options *opt);
MOEFUSE_API moefuse_status moefuse_dequant_workspace_size(moefuse_context *ctx,
                                                          const moefuse_tensor *q,
                                                          const moefuse_tensor *scales,
                                                          const moefuse_tensor *out,
                                                          const moefuse_quant_options *opt,
                                                          size_t *bytes);

/* ---------------------------------------------------------------------- MoE */

typedef struct moefuse_moe_options {
    moefuse_activation activation; /* default SILU */
    moefuse_gate_order order;      /* order of gate/up rows in w1 and b1; default GATE_FIRST */
    float limit;                   /* clamp as in moefuse_act_options; 0 = off */
    float alpha;                   /* as in moefuse_act_options: SILU_ALPHA's, 0 = 1.702 */
    float up_offset;               /* as in moefuse_act_options: added to u; 0 = nothing added */
    uint32_t reserved[2];          /* must be 0 */
} moefuse_moe_options;

/*
 * Routing operands shared by the MoE calls.
 *  topk_ids     [M, k] i32, global expert ids (device data: never trusted)
 *  topk_weights [M, k] f32 (final/forward only)
 *  expert_map   optional [E_global] i32: global id -> local id in [0, E), -1 = not here.
 *               Without it E_global = E.
 * A slot whose id is < 0, >= E_global, or maps outside [0, E) is invalid: it
 * reads no weights and contributes nothing; its rows of h and y are written as 0.
 * With shared experts, a routed slot whose local expert is a shared one is invalid too.
 */
typedef struct moefuse_routing {
    moefuse_tensor topk_ids;
    moefuse_tensor topk_weights;
    moefuse_tensor expert_map;
    /*
     * Shared experts (DeepSeek-V3, Qwen2-MoE; docs/NUMERICS.md "MoE"): the last n_shared local
     * experts of w1 / w2, which every token passes through as slots k .. k + n_shared - 1
     * after its routed ones (h and an un-reduced out then have k + n_shared slots). 0: none.
     */
    int32_t n_shared;
    float shared_scale;            /* each shared slot's weight; 0 means 1 */
    moefuse_tensor shared_weights; /* optional [M] f32: a factor per token on the shared slots'
                                      weight (Qwen2-MoE's sigmoid gate); final / forward only */
} moefuse_routing;

/*
 * Gate: for each valid (m, j), a = x[m] @ w1[e]^T + b1[e] in f32, then
 * h[m, j, :] = act(a_gate) * (a_up + up_offset), rounded once to h's dtype.
 *  x [M, K] f32/f16/bf16, w1 [E, 2I, K] same dtype as x, b1 optional [E, 2I]
 *  (f32/f16/bf16), h [M, k, I] f32/f16/bf16. With shared experts, k here and below counts
 *  the routed slots and the shared ones: k = topk_ids' k + routing->n_shared.
 */
MOEFUSE_API moefuse_status moefuse_moe_gate(moefuse_context *ctx, const moefuse_tensor *x,
                                            const moefuse_tensor *w1, const moefuse_tensor *b1,
                                            const moefuse_routing *routing,
                                            const moefuse_tensor *h,
                                            const moefuse_moe_options *opt);
MOEFUSE_API moefuse_status moefuse_moe_gate_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *w1,
    const moefuse_tensor *b1, const moefuse_routing *routing, const moefuse_tensor *h,
    const moefuse_moe_options *opt, size_t *bytes);

/*
 * Final: y[m, j, :] = h[m, j] @ w2[e]^T + b2[e] in f32.
 *  h [M, k, I], w2 [E, K, I] same dtype as h, b2 optional [E, K].
 *  out [M, K]: sum over j = 0..k-1, in that order, of topk_weights[m, j] * y[m, j, :]
 *  in f32, rounded once; or out [M, k, K]: the un-reduced y (weights not applied).
 */
MOEFUSE_API moefuse_status moefuse_moe_final(moefuse_context *ctx, const moefuse_tensor *h,
                                             const moefuse_tensor *w2, const moefuse_tensor *b2,
                                             const moefuse_routing *routing,
                                             const moefuse_tensor *out,
                                             const moefuse_moe_options *opt);
MOEFUSE_API moefuse_status moefuse_moe_final_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *h, const moefuse_tensor *w2,
    const moefuse_tensor *b2, const moefuse_routing *routing, const moefuse_tensor *out,
    const moefuse_moe_options *opt, size_t *bytes);

/*
 * Whole layer: gate then final, with h [M, k, I] kept in x's dtype in the call's workspace.
 * out [M, K] f32/f16/bf16.
 */
MOEFUSE_API moefuse_status moefuse_moe_forward(moefuse_context *ctx, const moefuse_tensor *x,
                                               const moefuse_tensor *w1, const moefuse_tensor *w2,
                                               const moefuse_tensor *b1, const moefuse_tensor *b2,
                                               const moefuse_routing *routing,
                                               const moefuse_tensor *out,
                                               const moefuse_moe_options *opt);

MOEFUSE_API moefuse_status moefuse_moe_forward_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *w1,
    const moefuse_tensor *w2, const moefuse_tensor *b1, const moefuse_tensor *b2,
    const moefuse_routing *routing, const moefuse_tensor *out, const moefuse_moe_options *opt,
    size_t *bytes);

/* ------------------------------------------------------------------ FP8 MoE */

/*
 * Block-scaled FP8 MoE layers (the DeepSeek-V3 recipe), exact definition in docs/NUMERICS.md
 * "FP8 MoE".
 *  Weights: f8_e4m3 codes with one scale per 128 x 128 block, f32 or u8 (UE8M0 exponents):
 *   w1 [E, 2I, K] with w1_scales [E, 2I/128, K/128], w2 [E, K, I] with w2_scales
 *   [E, K/128, I/128]. K and I must be multiples of 128. Biases as in moefuse_moe_gate.
 *  Activations: f8_e4m3 codes with one scale per 1 x 128 group of a row, in the layout and
 *   form that moefuse_quant writes with opt->act (ROW_MAJOR or COLUMN_MAJOR f32, or u8 with
 *   ue8m0; PACKED_UE8M0 i32). An x of f32/f16/bf16 is quantized inside the call (x_scales
 *   absent, NULL or data == NULL); an f8_e4m3 x comes with its x_scales.
 */
typedef struct moefuse_fp8_moe_options {
    moefuse_moe_options moe;   /* activation, order, limit */
    moefuse_quant_options act; /* activation quantization: group_size 0 or 128, scale layout of
                                  x_scales and h_scales, ue8m0, eps */
    uint32_t reserved[4];      /* must be 0 */
} moefuse_fp8_moe_options;

/*
 * Gate: h [M, k, I] f8_e4m3 = quant(act(x @ w1[e]^T + b1[e])) for each valid slot, with its
 * group scales h_scales laid out as for a quantized [M * k, I] tensor (row t = m * k + j).
 * Invalid slots get codes 0 and scale bytes 0.
 */
MOEFUSE_API moefuse_status moefuse_moe_gate_fp8(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *w1, const moefuse_tensor *w1_scales, const moefuse_tensor *b1,
    const moefuse_routing *routing, const moefuse_tensor *h, const moefuse_tensor *h_scales,
    const moefuse_fp8_moe_options *opt);
MOEFUSE_API moefuse_status moefuse_moe_gate_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *w1, const moefuse_tensor *w1_scales, const moefuse_tensor *b1,
    const moefuse_routing *routing, const moefuse_tensor *h, const moefuse_tensor *h_scales,
    const moefuse_fp8_moe_options *opt, size_t *bytes);

/* Final: as moefuse_moe_final, with h [M, k, I] f8_e4m3 and h_scales as the gate writes them. */
MOEFUSE_API moefuse_status moefuse_moe_final_fp8(
    moefuse_context *ctx, const moefuse_tensor *h, const moefuse_tensor *h_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b2,
    const moefuse_routing *routing, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt);
MOEFUSE_API moefuse_status moefuse_moe_final_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *h, const moefuse_tensor *h_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b2,
    const moefuse_routing *routing, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
    size_t *bytes);

/*
 * Whole routed layer: gate then final, with h and its scales kept in FP8 in the call's
 * workspace. out [M, K] f32/f16/bf16.
 */
MOEFUSE_API moefuse_status moefuse_moe_forward_fp8(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *w1, const moefuse_tensor *w1_scales, const moefuse_tensor *w2,
    const moefuse_tensor *w2_scales, const moefuse_tensor *b1, const moefuse_tensor *b2,
    const moefuse_routing *routing, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt);
MOEFUSE_API moefuse_status moefuse_moe_forward_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *w1, const moefuse_tensor *w1_scales, const moefuse_tensor *w2,
    const moefuse_tensor *w2_scales, const moefuse_tensor *b1, const moefuse_tensor *b2,
    const moefuse_routing *routing, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
    size_t *bytes);

/*
 * Whole layer in the 3-D expert-masked layout of expert parallelism: x [E, Tmax, K] (x_scales
 * in the 3-D layout of act_quant_masked when x is f8_e4m3), counts [E] i32 in the backend's
 * memory (each clamped to [0, Tmax]), out [E, Tmax, K] f32/f16/bf16. Row t of expert e is
 * computed for t < n[e] only, as a routed slot of expert e with weight 1 and no reduction;
 * rows n[e] <= t < Tmax of out are not written. Time follows the valid rows.
 */
MOEFUSE_API moefuse_status moefuse_moe_masked_fp8(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *counts, const moefuse_tensor *w1, const moefuse_tensor *w1_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
    const moefuse_tensor *b2, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt);
MOEFUSE_API moefuse_status moefuse_moe_masked_fp8_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *x, const moefuse_tensor *x_scales,
    const moefuse_tensor *counts, const moefuse_tensor *w1, const moefuse_tensor *w1_scales,
    const moefuse_tensor *w2, const moefuse_tensor *w2_scales, const moefuse_tensor *b1,
    const moefuse_tensor *b2, const moefuse_tensor *out, const moefuse_fp8_moe_options *opt,
    size_t *bytes);

/*
 * Router: softmax in f32 over logits [M, E] (f32/f16/bf16), then the k largest
 * probabilities in descending order, ties to the lower expert id, NaN logits
 * (probability 0) after every number. ids [M, k] i32, weights [M, k] f32.
 * renormalize != 0 divides the k weights by their sum (when it is > 0).
 */
MOEFUSE_API moefuse_status moefuse_topk_softmax(moefuse_context *ctx, const moefuse_tensor *logits,
                                                int32_t renormalize, const moefuse_tensor *ids,
                                                const moefuse_tensor *weights);
MOEFUSE_API moefuse_status moefuse_topk_softmax_workspace_size(moefuse_context *ctx,
                                                               const moefuse_tensor *logits,
                                                               int32_t renormalize,
                                                               const moefuse_tensor *ids,
                                                               const moefuse_tensor *weights,
                                                               size_t *bytes);

/* How a router turns logits into scores (moefuse_router_options.scoring). */
typedef enum moefuse_router_scoring {
    MOEFUSE_ROUTER_SOFTMAX = 0,     /* softmax over the E logits, then the choice (Mixtral, Qwen) */
    MOEFUSE_ROUTER_SIGMOID = 1,     /* the sigmoid of each logit, then the choice (DeepSeek-V3) */
    MOEFUSE_ROUTER_TOPK_SOFTMAX = 2 /* the choice on the logits, softmax over the k (gpt-oss) */
} moefuse_router_scoring;

/* How a group of experts is scored when the choice is limited to the best groups. */
typedef enum moefuse_group_scoring {
    MOEFUSE_GROUP_TOP2_SUM = 0, /* the sum of its two best choice scores (DeepSeek-V3) */
    MOEFUSE_GROUP_MAX = 1       /* its best choice score (DeepSeek-V2) */
} moefuse_group_scoring;

/* The most expert groups a router takes (a bit each in the device kernels' masks). */
#define MOEFUSE_ROUTER_MAX_GROUPS 64

typedef struct moefuse_router_options {
    moefuse_router_scoring scoring;      /* default SOFTMAX */
    int32_t n_group;                     /* 0 or 1: no groups; else a divisor of E, <= 64 */
    int32_t topk_group;                  /* with groups: how many are kept, 1..n_group */
    moefuse_group_scoring group_scoring; /* default TOP2_SUM */
    int32_t renormalize;                 /* != 0: the k weights divided by their sum */
    float scale;                         /* multiplies every weight last (DeepSeek's
                                            routed_scaling_factor); 0 means 1 */
    uint32_t reserved[4];                /* must be 0 */
} moefuse_router_options;

/*
 * Router of today's MoE models (docs/NUMERICS.md, "Router (topk_route)"). logits [M, E]
 * f32/f16/bf16. logit_bias [E] (optional, f32/f16/bf16) is added to the logits (gpt-oss's
 * router bias); choice_bias [E] (optional) is added to the scores for the choice only
 * (DeepSeek-V3's correction bias); with n_group > 1 the choice is limited to the best
 * topk_group groups. ids [M, k] i32 in rank order, weights [M, k] f32 from the unbiased
 * scores. opt NULL: softmax, no groups, no renormalization, which gives topk_softmax's bits.
 * k is at most the experts of the kept groups (E without groups).
 */
MOEFUSE_API moefuse_status moefuse_topk_route(moefuse_context *ctx, const moefuse_tensor *logits,
                                              const moefuse_tensor *logit_bias,
                                              const moefuse_tensor *choice_bias,
                                              const moefuse_router_options *opt,
                                              const moefuse_tensor *ids,
                                              const moefuse_tensor *weights);
MOEFUSE_API moefuse_status moefuse_topk_route_workspace_size(
    moefuse_context *ctx, const moefuse_tensor *logits, const moefuse_tensor *logit_bias,
    const moefuse_tensor *choice_bias, const moefuse_router_options *opt,
    const moefuse_tensor *ids, const moefuse_tensor *weights, size_t *bytes);

/*
 * Routing metadata: what an engine drives expert-parallel dispatch and the masked layout with
 * (vLLM's moe_align_block_size), from routing->topk_ids [M, k] and routing->expert_map
 * (topk_weights is not read). Slot s = m * k + j is valid as in the MoE calls; E is the length
 * of counts. Every tensor is i32 in the backend's memory; all but counts are optional.
 */
typedef struct moefuse_routing_meta {
    moefuse_tensor counts;     /* [E]: the valid slots of each local expert */
    moefuse_tensor offsets;    /* [E + 1]: where each expert's list starts in order, each list
                                  padded up to a multiple of block_size; [E] is the total */
    moefuse_tensor order;      /* [L], L >= M * k + E * (block_size - 1): the valid slots
                                  expert by expert, ascending within an expert; -1 in the
                                  padding and past the total */
    moefuse_tensor position;   /* [M, k]: each slot's index in order; -1 when invalid */
    moefuse_tensor masked_row; /* [M, k]: each slot's row in the masked 3-D layout (its rank
                                  among its expert's slots); -1 when invalid */
} moefuse_routing_meta;

/* block_size >= 1 (1: no padding). Deterministic: the order depends on the ids alone. */
MOEFUSE_API moefuse_status moefuse_routing_metadata(moefuse_context *ctx,
                                                    const moefuse_routing *routing,
                                                    int32_t block_size,
                                                    const moefuse_routing_meta *meta);
MOEFUSE_API moefuse_status moefuse_routing_metadata_workspace_size(
    moefuse_context *ctx, const moefuse_routing *routing, int32_t block_size,
    const moefuse_routing_meta *meta, size_t *bytes);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_H */
