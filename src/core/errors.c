/* Status names and the per-context (or, before a context exists, per-thread) message. */
#include "core/core.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char thread_message[MF_MESSAGE_BYTES];

static const char *const status_names[MOEFUSE_STATUS_COUNT_] = {
    [MOEFUSE_OK] = "MOEFUSE_OK",
    [MOEFUSE_ERR_NULL_POINTER] = "MOEFUSE_ERR_NULL_POINTER",
    [MOEFUSE_ERR_INVALID_ARGUMENT] = "MOEFUSE_ERR_INVALID_ARGUMENT",
    [MOEFUSE_ERR_SHAPE] = "MOEFUSE_ERR_SHAPE",
    [MOEFUSE_ERR_DTYPE] = "MOEFUSE_ERR_DTYPE",
    [MOEFUSE_ERR_STRIDE] = "MOEFUSE_ERR_STRIDE",
    [MOEFUSE_ERR_ALIGNMENT] = "MOEFUSE_ERR_ALIGNMENT",
    [MOEFUSE_ERR_WRONG_DEVICE] = "MOEFUSE_ERR_WRONG_DEVICE",
    [MOEFUSE_ERR_UNSUPPORTED] = "MOEFUSE_ERR_UNSUPPORTED",
    [MOEFUSE_ERR_BACKEND_UNAVAILABLE] = "MOEFUSE_ERR_BACKEND_UNAVAILABLE",
    [MOEFUSE_ERR_OUT_OF_MEMORY] = "MOEFUSE_ERR_OUT_OF_MEMORY",
    [MOEFUSE_ERR_BACKEND_FAILURE] = "MOEFUSE_ERR_BACKEND_FAILURE",
    [MOEFUSE_ERR_INTERNAL] = "MOEFUSE_ERR_INTERNAL",
    [MOEFUSE_ERR_OUT_OF_BOUNDS] = "MOEFUSE_ERR_OUT_OF_BOUNDS",
    [MOEFUSE_ERR_OVERLAP] = "MOEFUSE_ERR_OVERLAP",
    [MOEFUSE_ERR_CONTEXT_BUSY] = "MOEFUSE_ERR_CONTEXT_BUSY",
    [MOEFUSE_ERR_WORKSPACE_TOO_SMALL] = "MOEFUSE_ERR_WORKSPACE_TOO_SMALL",
};

const char *moefuse_status_name(moefuse_status status)
{
    if ((unsigned)status >= MOEFUSE_STATUS_COUNT_)
        return "unknown status";
    return status_names[status];
}

moefuse_status mf_error(moefuse_context *ctx, moefuse_status status, const char *fmt, ...)
{
    char *buffer = ctx ? ctx->message : thread_message;
    va_list args;
    va_start(args, fmt);
    vsnprintf(buffer, MF_MESSAGE_BYTES, fmt, args);
    va_end(args);
    return status;
}

const char *moefuse_last_error(const moefuse_context *ctx)
{
    return ctx ? ctx->message : thread_message;
}

moefuse_status mf_enter(moefuse_context *ctx, const char *op)
{
    if (!ctx)
        return mf_error(NULL, MOEFUSE_ERR_NULL_POINTER, "%s: ctx is NULL", op);
    /* One atomic exchange per call: cheap next to any kernel launch. */
    if (atomic_exchange_explicit(&ctx->in_call, true, memory_order_acquire))
        return mf_error(NULL, MOEFUSE_ERR_CONTEXT_BUSY,
                        "%s: another thread is inside a call on this context; a context is "
                        "used by one thread at a time (create one per thread)",
                        op);
    ctx->message[0] = '\0';
    return MOEFUSE_OK;
}

moefuse_status mf_leave(moefuse_context *ctx, moefuse_status status)
{
    atomic_store_explicit(&ctx->in_call, false, memory_order_release);
    return status;
}

moefuse_status mf_unimplemented(moefuse_context *ctx, const char *op)
{
    return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED, "%s: the %s backend does not implement it yet",
                    op, ctx->backend->name);
}
