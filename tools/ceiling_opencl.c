/*
 * The OpenCL backend's ceilings, measured on the very queue the moefuse context runs on:
 * clEnqueueCopyBuffer bandwidth between two device buffers, and a CLBlast sgemm of the MoE
 * op's FLOPs. CLBlast is loaded at run time, so neither the library nor this tool needs it to
 * build, and a machine without it gets "n/a" and the reason.
 */
#ifndef CL_TARGET_OPENCL_VERSION
#define CL_TARGET_OPENCL_VERSION 120 /* the API level the backend relies on: OpenCL 1.2 */
#endif
#include <CL/cl.h>

#include "ceiling.h"
#include "random.h"
#include "median.h"
#include "timer.h"

#ifdef MOEFUSE_HAVE_DLOPEN
#include <dlfcn.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Timed runs of the GEMM ceiling; the median is kept. */
#define GEMM_RUNS 5

/* The moefuse context's queue and the OpenCL context and device behind it. */
typedef struct cl_target {
    cl_command_queue queue;
    cl_context context;
    cl_device_id device;
    cl_ulong max_alloc; /* CL_DEVICE_MAX_MEM_ALLOC_SIZE: the largest single buffer */
} cl_target;

static const char *cl_error_name(cl_int e)
{
#define NAME(code) \
    case code:     \
        return #code;
    switch (e) {
        NAME(CL_DEVICE_NOT_FOUND)
        NAME(CL_DEVICE_NOT_AVAILABLE)
        NAME(CL_MEM_OBJECT_ALLOCATION_FAILURE)
        NAME(CL_OUT_OF_RESOURCES)
        NAME(CL_OUT_OF_HOST_MEMORY)
        NAME(CL_INVALID_VALUE)
        NAME(CL_INVALID_DEVICE)
        NAME(CL_INVALID_CONTEXT)
        NAME(CL_INVALID_COMMAND_QUEUE)
        NAME(CL_INVALID_MEM_OBJECT)
        NAME(CL_INVALID_OPERATION)
        NAME(CL_INVALID_BUFFER_SIZE)
        NAME(CL_MEM_COPY_OVERLAP)
    default:
        return "OpenCL error";
    }
#undef NAME
}

/* Names the failed call in `what` and returns -1, for the caller to fall back to "n/a". */
static int cl_failed(char *what, size_t what_size, const char *call, cl_int e)
{
    snprintf(what, what_size, "%s failed: %s (%d)", call, cl_error_name(e), (int)e);
    return -1;
}

/* A ceiling's buffers go whatever happened; a failure to release costs nothing but is said. */
static void release(cl_mem m)
{
    if (!m)
        return;
    cl_int e = clReleaseMemObject(m);
    if (e != CL_SUCCESS)
        fprintf(stderr, "moefuse bench: clReleaseMemObject failed: %s (%d)\n", cl_error_name(e),
                (int)e);
}

static int target_of(moefuse_context *ctx, cl_target *t, char *what, size_t what_size)
{
    void *stream = NULL;
    moefuse_status st = moefuse_get_stream(ctx, &stream);
    if (st != MOEFUSE_OK || !stream) {
        snprintf(what, what_size, "moefuse_get_stream failed: %s",
                 st != MOEFUSE_OK ? moefuse_last_error(ctx) : "no queue");
        return -1;
    }
    t->queue = (cl_command_queue)stream;
    cl_int e = clGetCommandQueueInfo(t->queue, CL_QUEUE_CONTEXT, sizeof t->context, &t->context,
                                     NULL);
    if (e != CL_SUCCESS)
        return cl_failed(what, what_size, "clGetCommandQueueInfo(CL_QUEUE_CONTEXT)", e);
    e = clGetCommandQueueInfo(t->queue, CL_QUEUE_DEVICE, sizeof t->device, &t->device, NULL);
    if (e != CL_SUCCESS)
        return cl_failed(what, what_size, "clGetCommandQueueInfo(CL_QUEUE_DEVICE)", e);
    e = clGetDeviceInfo(t->device, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof t->max_alloc,
                        &t->max_alloc, NULL);
    if (e != CL_SUCCESS)
        return cl_failed(what, what_size, "clGetDeviceInfo(CL_DEVICE_MAX_MEM_ALLOC_SIZE)", e);
    return 0;
}

static cl_mem new_buffer(const cl_target *t, size_t bytes, char *what, size_t what_size)
{
    cl_int e;
    cl_mem m = clCreateBuffer(t->context, CL_MEM_READ_WRITE, bytes, NULL, &e);
    if (e != CL_SUCCESS) {
        cl_failed(what, what_size, "clCreateBuffer", e);
        return NULL;
    }
    return m;
}

/* Host-side seconds of one enqueued command, up to clFinish: how cmd_bench times the op. */
static int finish_timed(const cl_target *t, double t0, double *seconds, char *what,
                        size_t what_size)
{
    cl_int e = clFinish(t->queue);
    if (e != CL_SUCCESS)
        return cl_failed(what, what_size, "clFinish", e);
    *seconds = now_seconds() - t0;
    return 0;
}

/* ---------------------------------------------------------------- copy */

static double opencl_copy_gbs(moefuse_context *ctx, char *what, size_t what_size)
{
    cl_target t;
    if (target_of(ctx, &t, what, what_size) != 0)
        return 0.0;
    /* 1 GiB, beyond any device cache, unless the device caps a single buffer lower. */
    size_t bytes = (size_t)CEILING_COPY_MIB << 20;
    const int capped = t.max_alloc < (cl_ulong)bytes;
    if (capped)
        bytes = (size_t)(t.max_alloc >> 20) << 20;
    if (bytes == 0) {
        snprintf(what, what_size, "CL_DEVICE_MAX_MEM_ALLOC_SIZE is below 1 MiB");
        return 0.0;
    }
    double gbs = 0.0, best = 1e30;
    const cl_uint pattern = 0x3F800000u; /* 1.0f */
    cl_int e;
    cl_mem src = new_buffer(&t, bytes, what, what_size);
    cl_mem dst = src ? new_buffer(&t, bytes, what, what_size) : NULL;
    if (!dst)
        goto done;
    /* Write both first: a runtime may place a buffer in memory only when a command touches it. */
    e = clEnqueueFillBuffer(t.queue, src, &pattern, sizeof pattern, 0, bytes, 0, NULL, NULL);
    if (e == CL_SUCCESS)
        e = clEnqueueFillBuffer(t.queue, dst, &pattern, sizeof pattern, 0, bytes, 0, NULL, NULL);
    if (e != CL_SUCCESS) {
        cl_failed(what, what_size, "clEnqueueFillBuffer", e);
        goto done;
    }
    e = clFinish(t.queue);
    if (e != CL_SUCCESS) {
        cl_failed(what, what_size, "clFinish", e);
        goto done;
    }
    for (int r = -1; r < 5; r++) { /* r = -1: warm-up */
        double seconds;
        const double t0 = now_seconds();
        e = clEnqueueCopyBuffer(t.queue, src, dst, 0, 0, bytes, 0, NULL, NULL);
        if (e != CL_SUCCESS) {
            cl_failed(what, what_size, "clEnqueueCopyBuffer", e);
            goto done;
        }
        if (finish_timed(&t, t0, &seconds, what, what_size) != 0)
            goto done;
        if (r >= 0 && seconds < best)
            best = seconds;
    }
    gbs = 2.0 * (double)bytes / best / 1e9;
    snprintf(what, what_size, "clEnqueueCopyBuffer of %zu MiB%s, read + write, best of 5",
             bytes >> 20, capped ? " (capped by CL_DEVICE_MAX_MEM_ALLOC_SIZE)" : "");
done:
    release(src);
    release(dst);
    return gbs;
}

/* ---------------------------------------------------------------- CLBlast */

/* The few declarations of CLBlast's C API (clblast_c.h) used here, so its header is not needed. */
/* CLBlastStatusCode: 0 is success, -1..-70 are OpenCL errors, the rest are CLBlast's own. */
typedef int clblast_status;
enum { CLBLAST_LAYOUT_ROW_MAJOR = 101, CLBLAST_TRANSPOSE_NO = 111 };
typedef clblast_status (*clblast_sgemm_fn)(int layout, int a_transpose, int b_transpose, size_t m,
                                           size_t n, size_t k, float alpha, cl_mem a_buffer,
                                           size_t a_offset, size_t a_ld, cl_mem b_buffer,
                                           size_t b_offset, size_t b_ld, float beta,
                                           cl_mem c_buffer, size_t c_offset, size_t c_ld,
                                           cl_command_queue *queue, cl_event *event);
typedef clblast_status (*clblast_clear_cache_fn)(void);

typedef struct clblast_api {
    const char *soname;
    clblast_sgemm_fn sgemm;
    clblast_clear_cache_fn clear_cache; /* optional: lets go of the programs CLBlast built */
} clblast_api;

#ifdef MOEFUSE_HAVE_DLOPEN
static void *symbol(void *lib, const char *name)
{
    dlerror(); /* clear a stale error so a NULL result is reported correctly */
    return dlsym(lib, name);
}
#endif

/*
 * Opens CLBlast by its runtime name, then the development link. It stays loaded: the tool exits
 * soon after, and unloading a library that may still hold OpenCL objects gains nothing.
 */
static int clblast_load(clblast_api *api, char *what, size_t what_size)
{
    memset(api, 0, sizeof *api);
#ifndef MOEFUSE_HAVE_DLOPEN
    snprintf(what, what_size, "CLBlast not found: this build has no dlopen");
    return -1;
#else
    static const char *const names[] = {"libclblast.so.1", "libclblast.so"};
    char first_error[256] = "";
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++) {
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (lib)
            api->soname = names[i];
        else if (i == 0) { /* the runtime name's error says most */
            const char *err = dlerror();
            snprintf(first_error, sizeof first_error, "%s", err ? err : "unknown dlopen error");
        }
    }
    if (!lib) {
        snprintf(what, what_size, "CLBlast not found: %s", first_error);
        return -1;
    }
    /* Through memcpy: ISO C has no conversion from void * to a function pointer. */
    void *sym = symbol(lib, "CLBlastSgemm");
    if (!sym) {
        const char *err = dlerror();
        snprintf(what, what_size, "CLBlast (%s) has no CLBlastSgemm: %s", api->soname,
                 err ? err : "symbol is NULL");
        return -1;
    }
    memcpy(&api->sgemm, &sym, sizeof sym);
    sym = symbol(lib, "CLBlastClearCache");
    if (sym)
        memcpy(&api->clear_cache, &sym, sizeof sym);
    return 0;
#endif
}

static int clblast_failed(char *what, size_t what_size, clblast_status s)
{
    if (s < 0 && s >= -70) /* CLBlast passes OpenCL's own errors on unchanged */
        return cl_failed(what, what_size, "CLBlastSgemm", s);
    snprintf(what, what_size, "CLBlastSgemm failed: CLBlast status %d", (int)s);
    return -1;
}

/* A new device buffer of `count` floats, uniform in [-1, 1): zeros would flatter no kernel. */
static cl_mem random_buffer(const cl_target *t, size_t count, uint64_t seed, char *what,
                            size_t what_size)
{
    cl_mem m = new_buffer(t, count * sizeof(float), what, what_size);
    if (!m)
        return NULL;
    const size_t chunk = (size_t)1 << 20;
    float *host = malloc((count < chunk ? count : chunk) * sizeof *host);
    if (!host) {
        snprintf(what, what_size, "out of host memory filling the GEMM's matrices");
        release(m);
        return NULL;
    }
    rng r = rng_seed(seed);
    for (size_t at = 0; at < count; at += chunk) {
        const size_t len = count - at < chunk ? count - at : chunk;
        for (size_t i = 0; i < len; i++)
            host[i] = rng_uniform(&r);
        cl_int e = clEnqueueWriteBuffer(t->queue, m, CL_TRUE, at * sizeof(float),
                                        len * sizeof(float), host, 0, NULL, NULL);
        if (e != CL_SUCCESS) {
            cl_failed(what, what_size, "clEnqueueWriteBuffer", e);
            free(host);
            release(m);
            return NULL;
        }
    }
    free(host);
    return m;
}

/*
 * Row-major C[rows, n] = A[rows, inner] B[inner, n] in f32 through CLBlastSgemm on the
 * context's queue: one untimed call (CLBlast compiles, and may tune, its kernels on the first
 * one), then the median of GEMM_RUNS.
 */
static double opencl_gemm_gflops(moefuse_context *ctx, moefuse_dtype dtype, int64_t rows,
                                 int64_t inner, int64_t n, char *what, size_t what_size)
{
    clblast_api blas;
    cl_target t;
    if (clblast_load(&blas, what, what_size) != 0 || target_of(ctx, &t, what, what_size) != 0)
        return 0.0;
    const size_t m_ = (size_t)rows, k_ = (size_t)inner, n_ = (size_t)n;
    const size_t largest = (k_ * n_ > m_ * k_ ? (k_ * n_ > m_ * n_ ? k_ * n_ : m_ * n_)
                                              : (m_ * k_ > m_ * n_ ? m_ * k_ : m_ * n_)) *
                           sizeof(float);
    if ((cl_ulong)largest > t.max_alloc) {
        snprintf(what, what_size,
                 "the %lldx%lldx%lld GEMM needs a %zu MiB matrix, more than "
                 "CL_DEVICE_MAX_MEM_ALLOC_SIZE (%llu MiB)",
                 (long long)rows, (long long)inner, (long long)n, largest >> 20,
                 (unsigned long long)(t.max_alloc >> 20));
        return 0.0;
    }
    double gflops = 0.0, times[GEMM_RUNS];
    cl_command_queue queue = t.queue; /* CLBlast takes a pointer to it */
    cl_mem a = random_buffer(&t, m_ * k_, 99, what, what_size);
    cl_mem b = a ? random_buffer(&t, k_ * n_, 100, what, what_size) : NULL;
    cl_mem c = b ? new_buffer(&t, m_ * n_ * sizeof(float), what, what_size) : NULL;
    if (!c)
        goto done;
    for (int r = -1; r < GEMM_RUNS; r++) { /* r = -1: CLBlast's compile (and tuning) run */
        double seconds;
        const double t0 = now_seconds();
        clblast_status s = blas.sgemm(CLBLAST_LAYOUT_ROW_MAJOR, CLBLAST_TRANSPOSE_NO,
                                      CLBLAST_TRANSPOSE_NO, m_, n_, k_, 1.0f, a, 0, k_, b, 0, n_,
                                      0.0f, c, 0, n_, &queue, NULL);
        if (s != 0) {
            clblast_failed(what, what_size, s);
            goto done;
        }
        if (finish_timed(&t, t0, &seconds, what, what_size) != 0)
            goto done;
        if (r >= 0)
            times[r] = seconds;
    }
    gflops = 2.0 * (double)rows * (double)inner * (double)n / median_sort(times, GEMM_RUNS) / 1e9;
    snprintf(what, what_size, "CLBlastSgemm (%s) %lldx%lldx%lld, median of %d%s", blas.soname,
             (long long)rows, (long long)inner, (long long)n, GEMM_RUNS,
             dtype == MOEFUSE_F32 ? ""
                                  : " (f32: the OpenCL kernels compute in f32 on every dtype)");
done:
    release(a);
    release(b);
    release(c);
    if (blas.clear_cache) {
        clblast_status s = blas.clear_cache();
        if (s != 0)
            fprintf(stderr, "moefuse bench: CLBlastClearCache failed: CLBlast status %d\n",
                    (int)s);
    }
    return gflops;
}

const ceiling_provider ceiling_opencl = {
    .backend = "opencl",
    .summary = "clEnqueueCopyBuffer + CLBlast sgemm (libclblast.so.1, loaded at run time)",
    .copy_gbs = opencl_copy_gbs,
    .gemm_gflops = opencl_gemm_gflops,
};
