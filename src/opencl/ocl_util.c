/* OpenCL error reporting, kernel arguments and launches for the OpenCL backend. */
#include "opencl/ocl_internal.h"

#include <stdio.h>

const char *mf_ocl_error_name(cl_int err)
{
    switch (err) {
#define MF_CL_ERR(name) case name: return #name;
    MF_CL_ERR(CL_SUCCESS)
    MF_CL_ERR(CL_DEVICE_NOT_FOUND)
    MF_CL_ERR(CL_DEVICE_NOT_AVAILABLE)
    MF_CL_ERR(CL_COMPILER_NOT_AVAILABLE)
    MF_CL_ERR(CL_MEM_OBJECT_ALLOCATION_FAILURE)
    MF_CL_ERR(CL_OUT_OF_RESOURCES)
    MF_CL_ERR(CL_OUT_OF_HOST_MEMORY)
    MF_CL_ERR(CL_BUILD_PROGRAM_FAILURE)
    MF_CL_ERR(CL_INVALID_VALUE)
    MF_CL_ERR(CL_INVALID_PLATFORM)
    MF_CL_ERR(CL_INVALID_DEVICE)
    MF_CL_ERR(CL_INVALID_CONTEXT)
    MF_CL_ERR(CL_INVALID_COMMAND_QUEUE)
    MF_CL_ERR(CL_INVALID_MEM_OBJECT)
    MF_CL_ERR(CL_INVALID_BUILD_OPTIONS)
    MF_CL_ERR(CL_INVALID_PROGRAM)
    MF_CL_ERR(CL_INVALID_PROGRAM_EXECUTABLE)
    MF_CL_ERR(CL_INVALID_KERNEL_NAME)
    MF_CL_ERR(CL_INVALID_KERNEL)
    MF_CL_ERR(CL_INVALID_ARG_INDEX)
    MF_CL_ERR(CL_INVALID_ARG_VALUE)
    MF_CL_ERR(CL_INVALID_ARG_SIZE)
    MF_CL_ERR(CL_INVALID_KERNEL_ARGS)
    MF_CL_ERR(CL_INVALID_WORK_DIMENSION)
    MF_CL_ERR(CL_INVALID_WORK_GROUP_SIZE)
    MF_CL_ERR(CL_INVALID_WORK_ITEM_SIZE)
    MF_CL_ERR(CL_INVALID_GLOBAL_OFFSET)
    MF_CL_ERR(CL_INVALID_BUFFER_SIZE)
    MF_CL_ERR(CL_INVALID_GLOBAL_WORK_SIZE)
    MF_CL_ERR(CL_INVALID_OPERATION)
    MF_CL_ERR(CL_MISALIGNED_SUB_BUFFER_OFFSET)
    MF_CL_ERR(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST)
#undef MF_CL_ERR
    default: return "unknown OpenCL error";
    }
}

moefuse_status mf_ocl_fail(moefuse_context *ctx, cl_int err, const char *op, const char *call)
{
    /* allocation failures are the caller's to handle differently from driver faults */
    moefuse_status st = (err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_HOST_MEMORY)
                            ? MOEFUSE_ERR_OUT_OF_MEMORY
                            : MOEFUSE_ERR_BACKEND_FAILURE;
    /* op is NULL during context creation: the core already prefixes "context_create: " */
    return mf_error(ctx, st, "%s%sopencl: %s failed with %s (%d)", op ? op : "", op ? ": " : "",
                    call, mf_ocl_error_name(err), (int)err);
}

mf_kargs mf_kargs_begin(cl_kernel k)
{
    mf_kargs a = {k, 0, CL_SUCCESS, 0};
    return a;
}

static void set_arg(mf_kargs *a, size_t size, const void *value)
{
    if (a->err == CL_SUCCESS) {
        cl_int e = clSetKernelArg(a->kernel, a->next, size, value);
        if (e != CL_SUCCESS) {
            a->err = e;
            a->failed_at = a->next;
        }
    }
    a->next++;
}

void mf_karg_mem(mf_kargs *a, const void *mem)
{
    cl_mem m = (cl_mem)mem; /* NULL is a legal value: the kernel sees a null pointer */
    set_arg(a, sizeof m, &m);
}

void mf_karg_long(mf_kargs *a, int64_t v)
{
    cl_long x = (cl_long)v;
    set_arg(a, sizeof x, &x);
}

void mf_karg_int(mf_kargs *a, int32_t v)
{
    cl_int x = (cl_int)v;
    set_arg(a, sizeof x, &x);
}

void mf_karg_float(mf_kargs *a, float v)
{
    cl_float x = v;
    set_arg(a, sizeof x, &x);
}

void mf_karg_local(mf_kargs *a, size_t bytes) { set_arg(a, bytes, NULL); }

void mf_karg_tensor(mf_kargs *a, const moefuse_tensor *t)
{
    mf_karg_mem(a, t->data);
    const int64_t es = (int64_t)moefuse_dtype_size(t->dtype);
    mf_karg_long(a, t->data ? t->offset / (es ? es : 1) : 0);
}

bool mf_ocl_chunks_aligned(const moefuse_tensor *t, int strides)
{
    const int64_t es = (int64_t)moefuse_dtype_size(t->dtype);
    if (es == 0 || t->offset % (es * MF_OCL_CHUNK) != 0)
        return false;
    for (int d = 0; d < strides; d++)
        if (t->stride[d] % MF_OCL_CHUNK != 0)
            return false;
    return true;
}

void mf_karg_operand(mf_kargs *a, const moefuse_tensor *t, int strides, bool dtype)
{
    mf_karg_tensor(a, t);
    for (int d = 0; d < strides; d++)
        mf_karg_long(a, t->stride[d]);
    if (dtype)
        mf_karg_int(a, (int32_t)t->dtype);
}

moefuse_status mf_ocl_launch(moefuse_context *ctx, ocl_state *s, mf_kargs *a, const char *op,
                             cl_uint dims, const size_t *global, const size_t *local)
{
    if (a->err != CL_SUCCESS) {
        char call[64];
        snprintf(call, sizeof call, "clSetKernelArg(argument %u)", (unsigned)a->failed_at);
        return mf_ocl_fail(ctx, a->err, op, call);
    }
    for (cl_uint d = 0; d < dims; d++)
        if (global[d] == 0)
            return MOEFUSE_OK; /* nothing to do; an empty NDRange is an error in OpenCL 1.2 */
    cl_int e =
        clEnqueueNDRangeKernel(s->queue, a->kernel, dims, NULL, global, local, 0, NULL, NULL);
    if (e != CL_SUCCESS)
        return mf_ocl_fail(ctx, e, op, "clEnqueueNDRangeKernel");
    return MOEFUSE_OK;
}

cl_mem mf_ocl_create_buffer(ocl_state *s, size_t bytes, mf_fault_kind kind, cl_int *err)
{
    if (mf_fault_hit(kind)) {
        *err = CL_MEM_OBJECT_ALLOCATION_FAILURE;
        return NULL;
    }
    return clCreateBuffer(s->context, CL_MEM_READ_WRITE, bytes, NULL, err);
}

moefuse_status mf_ocl_scratch(moefuse_context *ctx, ocl_state *s, size_t bytes, const char *op,
                              cl_mem *out)
{
    mf_region ws;
    bool given;
    MF_TRY(mf_caller_scratch(ctx, op, bytes, &ws, &given));
    if (given) { /* a whole cl_mem: the core refuses an offset */
        *out = (cl_mem)ws.data;
        return MOEFUSE_OK;
    }
    if (bytes == 0)
        bytes = 1;
    if (s->scratch == NULL || s->scratch_bytes < bytes) {
        if (s->scratch) /* released now, freed by OpenCL once queued work no longer uses it */
            clReleaseMemObject(s->scratch);
        s->scratch = NULL;
        s->scratch_bytes = 0;
        cl_int e;
        cl_mem m = mf_ocl_create_buffer(s, bytes, MF_FAULT_SCRATCH_GROW, &e);
        if (e != CL_SUCCESS) {
            char call[64];
            snprintf(call, sizeof call, "clCreateBuffer(scratch of %zu bytes)", bytes);
            return mf_ocl_fail(ctx, e, op, call);
        }
        s->scratch = m;
        s->scratch_bytes = bytes;
    }
    *out = s->scratch;
    return MOEFUSE_OK;
}
