/* Context lifetime (by backend name, or over the caller's native handles), backend selection,
 * streams and backend memory (allocated here, or the caller's imported). */
#include "core/core.h"
#include "core/fault.h"

#include <stdlib.h>
#include <string.h>

static const char *const known_backends[] = {"cpu", "cuda", "opencl"};

static bool is_known_backend(const char *name)
{
    for (size_t i = 0; i < sizeof known_backends / sizeof known_backends[0]; i++)
        if (strcmp(name, known_backends[i]) == 0)
            return true;
    return false;
}

/* Where a new context's backend state comes from: init on a device (NULL: the backend's
 * default), or adopt over the caller's native context and queue when native_context is set. */
typedef struct state_origin {
    const char *device;
    void *native_context;
    void *native_queue;
} state_origin;

static moefuse_status make_state(moefuse_context *ctx, const state_origin *origin)
{
    const moefuse_backend_i *b = ctx->backend;
    if (!origin->native_context)
        return b->init(ctx, origin->device, &ctx->state);
    if (!b->adopt)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "the %s backend cannot work on the caller's native handles", b->name);
    return b->adopt(ctx, origin->native_context, origin->native_queue, &ctx->state);
}

/* The one path every creation takes once the backend is known: *out is set on success only,
 * and a failure's message goes to the calling thread's slot, prefixed with `op`. */
static moefuse_status open_context(moefuse_context **out, const moefuse_backend_i *backend,
                                   const state_origin *origin, const char *op)
{
    moefuse_context *ctx = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : calloc(1, sizeof *ctx);
    if (!ctx)
        return mf_error(NULL, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: out of host memory", op);
    atomic_init(&ctx->in_call, false);
    ctx->backend = backend;
    moefuse_status status = make_state(ctx, origin);
    if (status != MOEFUSE_OK) {
        mf_error(NULL, status, "%s: %s", op, ctx->message);
        free(ctx);
        return status;
    }
    ctx->message[0] = '\0';
    *out = ctx;
    return MOEFUSE_OK;
}

/* Both ways of creating a context by name; `op` names the call in messages. */
static moefuse_status create(moefuse_context **out, const char *backend, const char *device,
                             const char *op)
{
    if (!out)
        return mf_error(NULL, MOEFUSE_ERR_NULL_POINTER, "%s: out is NULL", op);
    *out = NULL;
    if (device && !*device)
        return mf_error(NULL, MOEFUSE_ERR_INVALID_ARGUMENT, "%s: device is empty (NULL: the "
                        "backend's default)", op);
    if (device && (!backend || strcmp(backend, "auto") == 0))
        return mf_error(NULL, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "%s: device '%s' needs a backend name (cuda or opencl), not %s", op,
                        device, backend ? "auto" : "NULL");
    const char *source = "argument";
    if (!backend) {
        backend = getenv("MOEFUSE_BACKEND");
        source = "MOEFUSE_BACKEND";
        if (!backend || !*backend)
            backend = "auto";
    }
    const moefuse_backend_i *chosen;
    if (strcmp(backend, "auto") == 0) {
        chosen = mf_backend_auto();
    } else {
        chosen = mf_backend_find(backend);
        if (!chosen)
            return mf_error(NULL, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                            "%s: backend '%s' (from %s) is %s; built backends: %s, or auto", op,
                            backend, source,
                            is_known_backend(backend) ? "not built into this library" : "unknown",
                            moefuse_built_backends());
    }
    const state_origin origin = {device, NULL, NULL};
    return open_context(out, chosen, &origin, op);
}

moefuse_status moefuse_context_create(moefuse_context **out, const char *backend)
{
    return create(out, backend, NULL, "context_create");
}

moefuse_status moefuse_context_create_on(moefuse_context **out, const char *backend,
                                         const char *device)
{
    return create(out, backend, device, "context_create_on");
}

moefuse_status moefuse_context_create_opencl(moefuse_context **out, void *cl_context,
                                             void *cl_queue)
{
    static const char op[] = "context_create_opencl";
    if (!out)
        return mf_error(NULL, MOEFUSE_ERR_NULL_POINTER, "%s: out is NULL", op);
    *out = NULL;
    if (!cl_context || !cl_queue)
        return mf_error(NULL, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op,
                        cl_context ? "cl_queue" : "cl_context");
    const moefuse_backend_i *opencl = mf_backend_find("opencl");
    if (!opencl)
        return mf_error(NULL, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                        "%s: the opencl backend is not built into this library; built backends: %s",
                        op, moefuse_built_backends());
    const state_origin origin = {NULL, cl_context, cl_queue};
    return open_context(out, opencl, &origin, op);
}

void moefuse_context_destroy(moefuse_context *ctx)
{
    if (!ctx)
        return;
    if (ctx->workspace)
        ctx->backend->buffer_free(ctx->state, ctx->workspace);
    if (ctx->shared_routing)
        ctx->backend->buffer_free(ctx->state, ctx->shared_routing);
    ctx->backend->release(ctx->state);
    free(ctx);
}

const char *moefuse_backend_name(const moefuse_context *ctx)
{
    return ctx ? ctx->backend->name : "none";
}

const char *moefuse_device_name(const moefuse_context *ctx)
{
    return ctx ? ctx->backend->device_name(ctx->state) : "none";
}

/* --------------------------------------- streams and buffers, each inside mf_enter/mf_leave */

static moefuse_status set_stream(moefuse_context *ctx, void *stream)
{
    if (ctx->backend->set_stream)
        return ctx->backend->set_stream(ctx, ctx->state, stream);
    if (stream)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "set_stream: the %s backend has no streams; pass NULL", ctx->backend->name);
    return MOEFUSE_OK;
}

static moefuse_status get_stream(moefuse_context *ctx, void **stream)
{
    if (!stream)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "get_stream: stream is NULL");
    *stream = ctx->backend->get_stream ? ctx->backend->get_stream(ctx->state) : NULL;
    return MOEFUSE_OK;
}

static moefuse_status synchronize(moefuse_context *ctx)
{
    return ctx->backend->synchronize ? ctx->backend->synchronize(ctx, ctx->state) : MOEFUSE_OK;
}

static moefuse_status buffer_alloc(moefuse_context *ctx, size_t bytes, void **buffer)
{
    if (!buffer)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "buffer_alloc: buffer is NULL");
    *buffer = NULL;
    return ctx->backend->buffer_alloc(ctx, ctx->state, bytes, buffer);
}

/* Memory the caller allocated. Backends whose tensors may lie in any memory of their device
 * need no import: the default only checks that the buffer is such memory. */
static moefuse_status buffer_import(moefuse_context *ctx, void *buffer)
{
    const moefuse_backend_i *b = ctx->backend;
    if (!buffer)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "buffer_import: buffer is NULL");
    if (b->buffer_import)
        return b->buffer_import(ctx, ctx->state, buffer);
    if (b->owns_pointer && !b->owns_pointer(ctx->state, buffer))
        return mf_error(ctx, MOEFUSE_ERR_WRONG_DEVICE,
                        "buffer_import: buffer is not memory of this context's %s device",
                        b->name);
    return MOEFUSE_OK;
}

static moefuse_status buffer_write(moefuse_context *ctx, void *buffer, size_t offset,
                                   const void *src, size_t bytes)
{
    if (!buffer || (!src && bytes))
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "buffer_write: %s is NULL",
                        buffer ? "src" : "buffer");
    return bytes ? ctx->backend->buffer_write(ctx, ctx->state, buffer, offset, src, bytes)
                 : MOEFUSE_OK;
}

static moefuse_status buffer_read(moefuse_context *ctx, const void *buffer, size_t offset,
                                  void *dst, size_t bytes)
{
    if (!buffer || (!dst && bytes))
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "buffer_read: %s is NULL",
                        buffer ? "dst" : "buffer");
    return bytes ? ctx->backend->buffer_read(ctx, ctx->state, buffer, offset, dst, bytes)
                 : MOEFUSE_OK;
}

moefuse_status moefuse_set_stream(moefuse_context *ctx, void *stream)
{
    MF_TRY(mf_enter(ctx, "set_stream"));
    return mf_leave(ctx, set_stream(ctx, stream));
}

moefuse_status moefuse_get_stream(moefuse_context *ctx, void **stream)
{
    MF_TRY(mf_enter(ctx, "get_stream"));
    return mf_leave(ctx, get_stream(ctx, stream));
}

moefuse_status moefuse_synchronize(moefuse_context *ctx)
{
    MF_TRY(mf_enter(ctx, "synchronize"));
    return mf_leave(ctx, synchronize(ctx));
}

moefuse_status moefuse_buffer_alloc(moefuse_context *ctx, size_t bytes, void **buffer)
{
    MF_TRY(mf_enter(ctx, "buffer_alloc"));
    return mf_leave(ctx, buffer_alloc(ctx, bytes, buffer));
}

moefuse_status moefuse_buffer_free(moefuse_context *ctx, void *buffer)
{
    MF_TRY(mf_enter(ctx, "buffer_free"));
    if (buffer)
        ctx->backend->buffer_free(ctx->state, buffer);
    return mf_leave(ctx, MOEFUSE_OK);
}

moefuse_status moefuse_buffer_import(moefuse_context *ctx, void *buffer)
{
    MF_TRY(mf_enter(ctx, "buffer_import"));
    return mf_leave(ctx, buffer_import(ctx, buffer));
}

moefuse_status moefuse_buffer_write(moefuse_context *ctx, void *buffer, size_t offset,
                                    const void *src, size_t bytes)
{
    MF_TRY(mf_enter(ctx, "buffer_write"));
    return mf_leave(ctx, buffer_write(ctx, buffer, offset, src, bytes));
}

moefuse_status moefuse_buffer_read(moefuse_context *ctx, const void *buffer, size_t offset,
                                   void *dst, size_t bytes)
{
    MF_TRY(mf_enter(ctx, "buffer_read"));
    return mf_leave(ctx, buffer_read(ctx, buffer, offset, dst, bytes));
}
