/*
 * The OpenCL backend's vtable: context and queue lifetime, the caller's
 * queue, and buffers (tensors are cl_mem handles plus a byte offset).
 */
#include "opencl/ocl_internal.h"
#include "numerics/mf_act_table.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool ocl_probe(void) { return mf_ocl_any_gpu(); }

/* Drops every reference the state holds. For an adopted context, its cl_context and own queue
 * are the caller's, retained by adopt: releasing them drops ours only, and clFinish waits for
 * our work on the caller's queue (and whatever the caller put there before it). */
static void ocl_release(void *state)
{
    ocl_state *s = state;
    if (!s)
        return;
    if (s->queue && s->queue != s->own_queue)
        clReleaseCommandQueue(s->queue);
    if (s->own_queue) {
        clFinish(s->own_queue);
        clReleaseCommandQueue(s->own_queue);
    }
    if (s->scratch)
        clReleaseMemObject(s->scratch);
    if (s->act_tables)
        clReleaseMemObject(s->act_tables);
    for (int k = 0; k < MF_K_COUNT_; k++)
        if (s->kernels[k])
            clReleaseKernel(s->kernels[k]);
    if (s->program)
        clReleaseProgram(s->program);
    /* buffers the caller never freed go with the context */
    for (size_t i = 0; i < s->buffers.cap; i++)
        if (mf_ptrset_at(&s->buffers, i))
            clReleaseMemObject((cl_mem)mf_ptrset_at(&s->buffers, i));
    mf_ptrset_free(&s->buffers);
    if (s->context)
        clReleaseContext(s->context);
    free(s);
}

static void describe(ocl_state *s)
{
    char dev[160] = "", plat[96] = "";
    clGetDeviceInfo(s->device, CL_DEVICE_NAME, sizeof dev - 1, dev, NULL);
    clGetPlatformInfo(s->platform, CL_PLATFORM_NAME, sizeof plat - 1, plat, NULL);
    clGetDeviceInfo(s->device, CL_DEVICE_MAX_COMPUTE_UNITS, sizeof s->compute_units,
                    &s->compute_units, NULL);
    if (s->compute_units == 0)
        s->compute_units = 1;
    snprintf(s->device_name, sizeof s->device_name, "%s (OpenCL, %s, %u compute units%s)", dev,
             plat, (unsigned)s->compute_units, s->adopted ? ", caller's cl_context" : "");
}

/* What the program build chose, for `moefuse info` and bug reports. */
static void describe_build(ocl_state *s)
{
    size_t n = strlen(s->device_name);
    if (n > 0 && s->device_name[n - 1] == ')')
        snprintf(s->device_name + n - 1, sizeof s->device_name - (n - 1),
                 ", %s GEMM%s%s%s%s%s)",
                 !s->tiled                                          ? "simple"
                 : s->cpu_device && !s->force_tiled && !s->force_wide ? "simple (CPU device)"
                                                                      : "tiled",
                 s->wide && (!s->cpu_device || s->force_wide) ? ", wide tiles for large batches"
                                                              : "",
                 s->gemv && (!s->cpu_device || s->force_gemv) ? ", matrix-vector for small batches"
                                                              : "",
                 !s->act_tables ? ", act(g) computed"
                 : s->table_local ? ", act(g) from a table in local memory"
                                  : ", act(g) from a table in global memory",
                 s->fp_correct_div ? "" : ", division not correctly rounded",
                 s->from_cache ? ", cached binary" : "");
}

/*
 * The activation tables of the table kernels (kernels/rows_kernels.cl, MF_SPEC_TAB_*), filled
 * on the device by the shared text and waited for; MOEFUSE_OPENCL_ACT_TABLE=0 leaves them out
 * (the computed kernels run, with the same bits).
 */
static moefuse_status build_act_tables(moefuse_context *ctx, ocl_state *s)
{
    const char *env = getenv("MOEFUSE_OPENCL_ACT_TABLE");
    if (env && strcmp(env, "0") == 0)
        return MOEFUSE_OK;
    cl_int e;
    const size_t bytes = (size_t)MF_TAB_ACTS * MF_TAB_BYTES;
    s->act_tables = mf_ocl_create_buffer(s, bytes, MF_FAULT_DEVICE_ALLOC, &e);
    if (e != CL_SUCCESS) {
        s->act_tables = NULL;
        return mf_ocl_fail(ctx, e, NULL, "clCreateBuffer(activation tables)");
    }
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_BUILD_ACT_TABLES]);
    mf_karg_mem(&k, s->act_tables);
    const size_t global = MF_TAB_ACTS * MF_TAB_ENTRIES;
    MF_TRY(mf_ocl_launch(ctx, s, &k, "context creation", 1, &global, &s->wg));
    e = clFinish(s->queue);
    return e == CL_SUCCESS ? MOEFUSE_OK : mf_ocl_fail(ctx, e, NULL, "clFinish(activation tables)");
}

static moefuse_status new_state(moefuse_context *ctx, ocl_state **out)
{
    *out = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : calloc(1, sizeof **out);
    if (!*out)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "opencl: cannot allocate %zu bytes of state", sizeof **out);
    return MOEFUSE_OK;
}

/* What init and adopt share once the context and the queue exist: the program, the tables and
 * the description. On failure the state is released (with the references it holds). */
static moefuse_status finish_state(moefuse_context *ctx, ocl_state *s, void **state)
{
    describe(s);
    moefuse_status st = mf_ocl_build(ctx, s);
    if (st == MOEFUSE_OK)
        st = build_act_tables(ctx, s);
    if (st != MOEFUSE_OK) {
        ocl_release(s);
        return st;
    }
    describe_build(s);
    *state = s;
    return MOEFUSE_OK;
}

static moefuse_status ocl_init(moefuse_context *ctx, const char *device, void **state)
{
    ocl_state *s;
    MF_TRY(new_state(ctx, &s));
    moefuse_status st = mf_ocl_pick_device(ctx, device, &s->platform, &s->device);
    if (st != MOEFUSE_OK) {
        free(s);
        return st;
    }
    cl_int e;
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)s->platform, 0};
    s->context = clCreateContext(props, 1, &s->device, NULL, NULL, &e);
    if (e != CL_SUCCESS) {
        s->context = NULL;
        ocl_release(s);
        return mf_ocl_fail(ctx, e, NULL, "clCreateContext");
    }
    /* in order: kernels of one call and buffer copies follow each other */
    s->own_queue = clCreateCommandQueue(s->context, s->device, 0, &e);
    if (e != CL_SUCCESS) {
        s->own_queue = NULL;
        ocl_release(s);
        return mf_ocl_fail(ctx, e, NULL, "clCreateCommandQueue");
    }
    s->queue = s->own_queue;
    return finish_state(ctx, s, state);
}

/* The caller's queue must belong to the caller's context and keep its commands in order (the
 * backend relies on the order of its own). Fills the device and platform from it. */
static moefuse_status check_adopted(moefuse_context *ctx, cl_context c, cl_command_queue q,
                                    cl_device_id *device, cl_platform_id *platform)
{
    cl_context qc = NULL;
    cl_command_queue_properties qp = 0;
    cl_int e = clGetCommandQueueInfo(q, CL_QUEUE_CONTEXT, sizeof qc, &qc, NULL);
    if (e == CL_SUCCESS)
        e = clGetCommandQueueInfo(q, CL_QUEUE_DEVICE, sizeof *device, device, NULL);
    if (e == CL_SUCCESS)
        e = clGetCommandQueueInfo(q, CL_QUEUE_PROPERTIES, sizeof qp, &qp, NULL);
    if (e != CL_SUCCESS)
        return mf_ocl_fail(ctx, e, NULL, "clGetCommandQueueInfo(cl_queue)");
    if (qc != c)
        return mf_error(ctx, MOEFUSE_ERR_WRONG_DEVICE,
                        "opencl: cl_queue belongs to another cl_context than the one passed as "
                        "cl_context");
    if (qp & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "opencl: cl_queue is out-of-order; moefuse needs an in-order queue");
    e = clGetDeviceInfo(*device, CL_DEVICE_PLATFORM, sizeof *platform, platform, NULL);
    return e == CL_SUCCESS ? MOEFUSE_OK
                           : mf_ocl_fail(ctx, e, NULL, "clGetDeviceInfo(CL_DEVICE_PLATFORM)");
}

/* The caller's context and queue, each retained: release drops these references as it drops
 * the ones init created, so the caller's stay valid. */
static moefuse_status ocl_adopt(moefuse_context *ctx, void *native_context, void *native_queue,
                                void **state)
{
    cl_context c = native_context;
    cl_command_queue q = native_queue;
    cl_device_id device = NULL;
    cl_platform_id platform = NULL;
    MF_TRY(check_adopted(ctx, c, q, &device, &platform));
    ocl_state *s;
    MF_TRY(new_state(ctx, &s));
    s->platform = platform;
    s->device = device;
    s->adopted = true;
    cl_int e = clRetainContext(c);
    if (e != CL_SUCCESS) {
        free(s);
        return mf_ocl_fail(ctx, e, NULL, "clRetainContext(cl_context)");
    }
    s->context = c;
    e = clRetainCommandQueue(q);
    if (e != CL_SUCCESS) {
        ocl_release(s);
        return mf_ocl_fail(ctx, e, NULL, "clRetainCommandQueue(cl_queue)");
    }
    s->own_queue = q;
    s->queue = q;
    return finish_state(ctx, s, state);
}

static const char *ocl_device_name(void *state)
{
    return state ? ((const ocl_state *)state)->device_name : "OpenCL";
}

/* The caller's queue must belong to our context and device; it must be in-order
 * (the backend relies on the order of its own commands). */
static moefuse_status ocl_set_stream(moefuse_context *ctx, void *state, void *stream)
{
    ocl_state *s = state;
    cl_command_queue q = stream;
    if (q) {
        cl_context qc = NULL;
        cl_device_id qd = NULL;
        cl_command_queue_properties qp = 0;
        cl_int e = clGetCommandQueueInfo(q, CL_QUEUE_CONTEXT, sizeof qc, &qc, NULL);
        if (e == CL_SUCCESS)
            e = clGetCommandQueueInfo(q, CL_QUEUE_DEVICE, sizeof qd, &qd, NULL);
        if (e == CL_SUCCESS)
            e = clGetCommandQueueInfo(q, CL_QUEUE_PROPERTIES, sizeof qp, &qp, NULL);
        if (e != CL_SUCCESS)
            return mf_ocl_fail(ctx, e, "set_stream", "clGetCommandQueueInfo");
        if (qc != s->context || qd != s->device)
            return mf_error(ctx, MOEFUSE_ERR_WRONG_DEVICE,
                            "set_stream: the queue belongs to another OpenCL context or device");
        if (qp & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE)
            return mf_error(
                ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                "set_stream: the queue is out-of-order; moefuse needs an in-order queue");
        e = clRetainCommandQueue(q);
        if (e != CL_SUCCESS)
            return mf_ocl_fail(ctx, e, "set_stream", "clRetainCommandQueue");
    } else {
        q = s->own_queue;
    }
    /* Work already queued may still use the context's scratch; the next call on
     * another queue would not wait for it. */
    cl_int fe = q != s->queue ? clFinish(s->queue) : CL_SUCCESS;
    if (fe != CL_SUCCESS) {
        if (q != s->own_queue)
            clReleaseCommandQueue(q);
        return mf_ocl_fail(ctx, fe, "set_stream", "clFinish(previous queue)");
    }
    if (s->queue != s->own_queue)
        clReleaseCommandQueue(s->queue);
    s->queue = q;
    return MOEFUSE_OK;
}

static void *ocl_get_stream(void *state) { return ((ocl_state *)state)->queue; }

static moefuse_status ocl_synchronize(moefuse_context *ctx, void *state)
{
    ocl_state *s = state;
    cl_int e = clFinish(s->queue);
    return e == CL_SUCCESS ? MOEFUSE_OK : mf_ocl_fail(ctx, e, "synchronize", "clFinish");
}

static moefuse_status ocl_buffer_alloc(moefuse_context *ctx, void *state, size_t bytes,
                                       void **buffer)
{
    ocl_state *s = state;
    cl_int e;
    cl_mem m = mf_ocl_create_buffer(s, bytes ? bytes : 1, MF_FAULT_DEVICE_ALLOC, &e);
    if (e != CL_SUCCESS) {
        char call[64];
        snprintf(call, sizeof call, "clCreateBuffer(%zu bytes)", bytes);
        return mf_ocl_fail(ctx, e, "buffer_alloc", call);
    }
    if (!mf_ptrset_add(&s->buffers, m)) {
        clReleaseMemObject(m);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "buffer_alloc: out of host memory for the table of buffers");
    }
    *buffer = m;
    return MOEFUSE_OK;
}

/* Only handles in the set (ours, or imported: then our reference) are released; anything else
 * is ignored (never a crash). */
static void ocl_buffer_free(void *state, void *buffer)
{
    ocl_state *s = state;
    if (mf_ptrset_remove(&s->buffers, buffer))
        clReleaseMemObject((cl_mem)buffer); /* OpenCL defers the free until queued work is done */
}

/*
 * The caller's cl_mem, retained once and kept in the set of handles beside ours: from then on
 * ownership, copies, bounds (CL_MEM_SIZE) and buffer_free treat it as one of ours. Only here is
 * OpenCL asked about a handle moefuse did not make: the caller promises it is a cl_mem.
 */
static moefuse_status ocl_buffer_import(moefuse_context *ctx, void *state, void *buffer)
{
    ocl_state *s = state;
    cl_mem m = buffer;
    if (mf_ptrset_has(&s->buffers, m))
        return MOEFUSE_OK; /* imported before, or allocated here: one reference is enough */
    cl_context owner = NULL;
    cl_mem_object_type type = 0;
    cl_int e = clGetMemObjectInfo(m, CL_MEM_CONTEXT, sizeof owner, &owner, NULL);
    if (e == CL_SUCCESS)
        e = clGetMemObjectInfo(m, CL_MEM_TYPE, sizeof type, &type, NULL);
    if (e != CL_SUCCESS)
        return mf_ocl_fail(ctx, e, "buffer_import", "clGetMemObjectInfo(buffer)");
    if (owner != s->context)
        return mf_error(ctx, MOEFUSE_ERR_WRONG_DEVICE,
                        "buffer_import: buffer is a cl_mem of another cl_context than this "
                        "context's");
    if (type != CL_MEM_OBJECT_BUFFER)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "buffer_import: buffer is an image or pipe (cl_mem type 0x%x), not a "
                        "buffer object",
                        (unsigned)type);
    e = clRetainMemObject(m);
    if (e != CL_SUCCESS)
        return mf_ocl_fail(ctx, e, "buffer_import", "clRetainMemObject(buffer)");
    if (!mf_ptrset_add(&s->buffers, m)) {
        clReleaseMemObject(m);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "buffer_import: out of host memory for the table of buffers");
    }
    return MOEFUSE_OK;
}

static moefuse_status not_ours(moefuse_context *ctx, const char *op)
{
    return mf_error(ctx, MOEFUSE_ERR_WRONG_DEVICE,
                    "%s: the buffer was neither allocated by this opencl context nor imported "
                    "into it (moefuse_buffer_import)",
                    op);
}

static moefuse_status ocl_buffer_write(moefuse_context *ctx, void *state, void *buffer,
                                       size_t offset, const void *src, size_t bytes)
{
    ocl_state *s = state;
    if (!mf_ptrset_has(&s->buffers, buffer))
        return not_ours(ctx, "buffer_write");
    cl_int e = clEnqueueWriteBuffer(s->queue, (cl_mem)buffer, CL_TRUE, offset, bytes, src, 0, NULL,
                                    NULL);
    return e == CL_SUCCESS ? MOEFUSE_OK
                           : mf_ocl_fail(ctx, e, "buffer_write", "clEnqueueWriteBuffer");
}

static moefuse_status ocl_buffer_read(moefuse_context *ctx, void *state, const void *buffer,
                                      size_t offset, void *dst, size_t bytes)
{
    ocl_state *s = state;
    if (!mf_ptrset_has(&s->buffers, buffer))
        return not_ours(ctx, "buffer_read");
    cl_int e = clEnqueueReadBuffer(s->queue, (cl_mem)buffer, CL_TRUE, offset, bytes, dst, 0, NULL,
                                   NULL);
    return e == CL_SUCCESS ? MOEFUSE_OK : mf_ocl_fail(ctx, e, "buffer_read", "clEnqueueReadBuffer");
}

/*
 * A cl_mem this context allocated or imported. Asking OpenCL (CL_MEM_CONTEXT) would also
 * accept the caller's cl_mem of our context, but crashes inside the ICD loader when handed a
 * host pointer: the caller's handles come in through buffer_import instead.
 */
static bool ocl_owns_pointer(void *state, const void *data)
{
    const ocl_state *s = state;
    return mf_ptrset_has(&s->buffers, data);
}

/* The size of a cl_mem in the set (a sub-buffer's own size): the core asks only after
 * ocl_owns_pointer found it there, so data is a real cl_mem and OpenCL may be asked about it. */
static bool ocl_buffer_extent(void *state, const void *data, uint64_t *bytes)
{
    (void)state;
    size_t size = 0;
    if (clGetMemObjectInfo((cl_mem)data, CL_MEM_SIZE, sizeof size, &size, NULL) != CL_SUCCESS)
        return false;
    *bytes = size;
    return true;
}

const moefuse_backend_i mf_backend_opencl = {
    .name = "opencl",
    .probe = ocl_probe,
    .init = ocl_init,
    .adopt = ocl_adopt,
    .release = ocl_release,
    .device_name = ocl_device_name,
    .set_stream = ocl_set_stream,
    .get_stream = ocl_get_stream,
    .synchronize = ocl_synchronize,
    .buffer_alloc = ocl_buffer_alloc,
    .buffer_free = ocl_buffer_free,
    .buffer_write = ocl_buffer_write,
    .buffer_read = ocl_buffer_read,
    .owns_pointer = ocl_owns_pointer,
    .buffer_extent = ocl_buffer_extent,
    .buffer_import = ocl_buffer_import,
    .data_is_handle = true,
    .act_quant = mf_ocl_act_quant,
    .act_mul = mf_ocl_act_mul,
    .quant = mf_ocl_quant,
    .dequant = mf_ocl_dequant,
    .topk_softmax = mf_ocl_topk_softmax,
    .topk_route = mf_ocl_topk_route,
    .routing_metadata = mf_ocl_routing_metadata,
    .moe_shared_routing = mf_ocl_moe_shared_routing,
    .moe_gate = mf_ocl_moe_gate,
    .moe_final = mf_ocl_moe_final,
    .rows_workspace = mf_ocl_rows_workspace,
    .meta_workspace = mf_ocl_meta_workspace,
    .moe_gate_workspace = mf_ocl_moe_gate_workspace,
    .moe_final_workspace = mf_ocl_moe_final_workspace,
    .moe_gate_fp8 = mf_ocl_moe_gate_fp8,
    .moe_final_fp8 = mf_ocl_moe_final_fp8,
    .moe_gate_fp8_workspace = mf_ocl_moe_gate_fp8_workspace,
    .moe_final_fp8_workspace = mf_ocl_moe_final_fp8_workspace,
    .moe_forward = NULL,
};
