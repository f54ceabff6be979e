/* The caller's workspace (moefuse_set_workspace) and the scratch step every call ends with. */
#include "core/core.h"
#include "core/fault.h"

#include <stdint.h>

size_t mf_workspace_align(size_t n)
{
    const size_t a = MOEFUSE_WORKSPACE_ALIGNMENT;
    return n > SIZE_MAX - (a - 1) ? SIZE_MAX : (n + a - 1) / a * a;
}

size_t mf_size_add_sat(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

bool mf_caller_workspace(const moefuse_context *ctx, mf_region *ws)
{
    if (!ctx->caller_workspace.data)
        return false;
    *ws = ctx->caller_workspace;
    return true;
}

bool mf_workspace_matters(const moefuse_context *ctx, const size_t *measure)
{
    return measure != NULL || ctx->caller_workspace.data != NULL;
}

moefuse_status mf_caller_scratch(moefuse_context *ctx, const char *op, size_t bytes,
                                 mf_region *ws, bool *given)
{
    *given = mf_caller_workspace(ctx, ws);
    if (*given && bytes > ws->bytes)
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL,
                        "%s: internal error: %zu bytes of scratch asked of a workspace of %zu "
                        "that the size query said was enough",
                        op, bytes, ws->bytes);
    return MOEFUSE_OK;
}

moefuse_status mf_workspace_step(moefuse_context *ctx, const char *op, size_t need,
                                 size_t *measure, bool *run)
{
    *run = false;
    if (need == SIZE_MAX)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE,
                        "%s: the workspace this call needs overflows size_t", op);
    if (measure) {
        *measure = need;
        return MOEFUSE_OK;
    }
    const mf_region *ws = &ctx->caller_workspace;
    if (ws->data && need > ws->bytes)
        return mf_error(ctx, MOEFUSE_ERR_WORKSPACE_TOO_SMALL,
                        "%s: the workspace set by moefuse_set_workspace holds %zu bytes; this call "
                        "needs %zu (moefuse_%s_workspace_size)",
                        op, ws->bytes, need, op);
    *run = true;
    return MOEFUSE_OK;
}

moefuse_status mf_enter_query(moefuse_context *ctx, const char *op, const size_t *bytes)
{
    MF_TRY(mf_enter(ctx, op));
    if (!bytes)
        return mf_leave(ctx, mf_error(ctx, MOEFUSE_ERR_NULL_POINTER,
                                      "%s: bytes (where the workspace size goes) is NULL", op));
    return MOEFUSE_OK;
}

moefuse_status mf_nothing_to_do(size_t *measure)
{
    if (measure)
        *measure = 0;
    return MOEFUSE_OK;
}

/* A context-owned buffer (*buf of *have bytes) of at least `bytes`, reallocated when smaller. */
static moefuse_status grow_owned(moefuse_context *ctx, void **buf, size_t *have, size_t bytes)
{
    if (bytes > *have || !*buf) {
        if (*buf)
            ctx->backend->buffer_free(ctx->state, *buf);
        *buf = NULL;
        *have = 0;
        MF_TRY(ctx->backend->buffer_alloc(ctx, ctx->state, bytes, buf));
        *have = bytes;
    }
    return MOEFUSE_OK;
}

moefuse_status mf_workspace(moefuse_context *ctx, size_t bytes, void **buffer)
{
    if ((bytes > ctx->workspace_bytes || !ctx->workspace) &&
        mf_fault_hit(MF_FAULT_SCRATCH_GROW)) /* test hook: a growth that fails */
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "moe_forward: growing the workspace to %zu bytes failed (injected)",
                        bytes);
    MF_TRY(grow_owned(ctx, &ctx->workspace, &ctx->workspace_bytes, bytes));
    *buffer = ctx->workspace;
    return MOEFUSE_OK;
}

moefuse_status mf_shared_routing_scratch(moefuse_context *ctx, size_t bytes, void **buffer)
{
    MF_TRY(grow_owned(ctx, &ctx->shared_routing, &ctx->shared_routing_bytes, bytes));
    *buffer = ctx->shared_routing;
    return MOEFUSE_OK;
}

static moefuse_status set_workspace(moefuse_context *ctx, const char *op,
                                    const moefuse_tensor *workspace)
{
    if (!workspace || !workspace->data) {
        ctx->caller_workspace = (mf_region){0};
        return MOEFUSE_OK;
    }
    MF_TRY(mf_check_tensor(ctx, op, "workspace", workspace, 1, MF_DT(MOEFUSE_U8)));
    const uint64_t align = MOEFUSE_WORKSPACE_ALIGNMENT;
    if (ctx->backend->data_is_handle && workspace->offset != 0)
        return mf_error(ctx, MOEFUSE_ERR_ALIGNMENT,
                        "%s: workspace.offset is %lld; on %s the workspace is a whole buffer "
                        "(offset 0; a sub-buffer gives a piece of a larger one)",
                        op, (long long)workspace->offset, ctx->backend->name);
    if (!ctx->backend->data_is_handle &&
        ((uint64_t)(uintptr_t)workspace->data + (uint64_t)workspace->offset) % align != 0)
        return mf_error(ctx, MOEFUSE_ERR_ALIGNMENT,
                        "%s: workspace (data %p + offset %lld) does not start at a multiple "
                        "of %llu bytes (MOEFUSE_WORKSPACE_ALIGNMENT)",
                        op, workspace->data, (long long)workspace->offset,
                        (unsigned long long)align);
    ctx->caller_workspace.data = workspace->data;
    ctx->caller_workspace.offset = (uint64_t)workspace->offset;
    ctx->caller_workspace.bytes = (size_t)workspace->shape[0];
    return MOEFUSE_OK;
}

moefuse_status moefuse_set_workspace(moefuse_context *ctx, const moefuse_tensor *workspace)
{
    static const char op[] = "set_workspace";
    MF_TRY(mf_enter(ctx, op));
    return mf_leave(ctx, set_workspace(ctx, op, workspace));
}
