/*
 * Core internals shared by the files of src/core: the context, and the
 * validation helpers every public entry point uses before a backend call.
 */
#ifndef MOEFUSE_CORE_CORE_H
#define MOEFUSE_CORE_CORE_H

#include "core/backend.h"

#define MF_MESSAGE_BYTES 1024

#include <stdatomic.h>

struct moefuse_context {
    atomic_bool in_call;         /* a thread is inside a public call (mf_enter .. mf_leave) */
    const moefuse_backend_i *backend;
    void *state;                 /* backend's own */
    char message[MF_MESSAGE_BYTES];
    void *workspace;             /* moe_forward's h when the caller set no workspace */
    size_t workspace_bytes;
    void *shared_routing;        /* shared experts' slot ids and weights, the same case */
    size_t shared_routing_bytes;
    mf_region caller_workspace;  /* moefuse_set_workspace's; data NULL when none is set */
};

/* Set of dtypes, for "one of" checks. */
typedef unsigned mf_dtype_set;
#define MF_DT(d) (1u << (d))
#define MF_FLOATS (MF_DT(MOEFUSE_F32) | MF_DT(MOEFUSE_F16) | MF_DT(MOEFUSE_BF16))
#define MF_QUANTIZED (MF_DT(MOEFUSE_F8_E4M3) | MF_DT(MOEFUSE_I8))

/* The status for a vtable member the backend left NULL. */
moefuse_status mf_unimplemented(moefuse_context *ctx, const char *op);

/* Backend registry (registry.c). */
const moefuse_backend_i *mf_backend_find(const char *name);
const moefuse_backend_i *mf_backend_auto(void);

/*
 * Entry-point guard: ctx must be non-NULL and not inside a call of another
 * thread (MOEFUSE_ERR_CONTEXT_BUSY, reported in the calling thread's message,
 * since ctx's belongs to the thread inside); clears the message. On success the
 * call must end with mf_leave.
 */
moefuse_status mf_enter(moefuse_context *ctx, const char *op);
/* End of a call mf_enter let in: frees the context for the next call, returns status. */
moefuse_status mf_leave(moefuse_context *ctx, moefuse_status status);

/* An optional operand is present when the pointer and its data are non-NULL. */
bool mf_present(const moefuse_tensor *t);
/* The absent tensor (data NULL). */
moefuse_tensor mf_absent(void);

/*
 * Full check of one operand: non-NULL, rank, dtype in `allowed`, dims >= 0,
 * innermost stride 1 and non-overlapping rows, offset >= 0 and aligned,
 * 64-bit extent without overflow, memory owned by the backend.
 */
moefuse_status mf_check_tensor(moefuse_context *ctx, const char *op, const char *name,
                               const moefuse_tensor *t, int32_t rank, mf_dtype_set allowed);
/* The same for an optional operand: absent passes. */
moefuse_status mf_check_optional(moefuse_context *ctx, const char *op, const char *name,
                                 const moefuse_tensor *t, int32_t rank, mf_dtype_set allowed);
/* Shape must equal `want` (rank already checked); `what` explains where want comes from. */
moefuse_status mf_expect_shape(moefuse_context *ctx, const char *op, const char *name,
                               const moefuse_tensor *t, const int64_t *want, const char *what);

/* An operand of a call, for mf_check_outputs. Absent and empty tensors are skipped. */
typedef struct mf_operand {
    const char *name;
    const moefuse_tensor *t;
    bool output;
} mf_operand;

/*
 * The last check of every call. No output may share a byte with another operand:
 * kernels read rows, stage them and write codes of another size, so no call is safe
 * in place. Judged on each tensor's range from its first to one past its last byte
 * (within one cl_mem for handle backends), which also refuses interleaved views that
 * would not collide. *idle is set when every output is empty: the call then has
 * nothing to write and returns before the backend, whatever the sizes of the empty
 * dimensions' neighbours (a [0, 2^62] tensor is valid and must cost nothing).
 */
moefuse_status mf_check_outputs(moefuse_context *ctx, const char *op, const mf_operand *ops,
                                size_t count, bool *idle);

/* "[8, 2048, 4096]" into buf. */
const char *mf_shape_str(char *buf, size_t size, int32_t rank, const int64_t *shape);

/* The same view with a leading dimension of size 1 (rank + 1). */
moefuse_tensor mf_with_leading_unit(const moefuse_tensor *t);

/* Backend scratch owned by the context, grown on demand: moe_forward's h (mf_workspace) and the
 * shared experts' slots (mf_shared_routing_scratch), each in a buffer of its own. */
moefuse_status mf_workspace(moefuse_context *ctx, size_t bytes, void **buffer);
moefuse_status mf_shared_routing_scratch(moefuse_context *ctx, size_t bytes, void **buffer);

/*
 * The last step of every call, once its arguments are valid and `need` (the bytes of
 * workspace it takes) is known. A size query (`measure` non-NULL) gets `need` there and stops
 * (*run false); a call checks that the caller's workspace, if one is set, holds it.
 */
moefuse_status mf_workspace_step(moefuse_context *ctx, const char *op, size_t need,
                                 size_t *measure, bool *run);
/* Whether a call must know the workspace it takes: it is a size query (`measure`), or it runs
 * with the caller's workspace, which must hold it. Otherwise the backend sizes its own scratch
 * as it goes, and asking first would plan the call twice. */
bool mf_workspace_matters(const moefuse_context *ctx, const size_t *measure);
/* mf_enter for a moefuse_<call>_workspace_size query, which also needs `bytes`. */
moefuse_status mf_enter_query(moefuse_context *ctx, const char *op, const size_t *bytes);
/* The same for a call with nothing to write (every output empty): it takes no workspace. */
moefuse_status mf_nothing_to_do(size_t *measure);
/* n rounded up to MOEFUSE_WORKSPACE_ALIGNMENT; SIZE_MAX stays SIZE_MAX. */
size_t mf_workspace_align(size_t n);
/* a + b, or SIZE_MAX when that overflows (a workspace size too large to have). */
size_t mf_size_add_sat(size_t a, size_t b);

#endif /* MOEFUSE_CORE_CORE_H */
