/*
 * The CUDA backend's ceilings, measured on the stream the moefuse context runs on:
 * device-to-device cudaMemcpyAsync bandwidth, the bandwidth of a read-only sum kernel
 * (ceiling_cuda_read.cu), and a cuBLAS GEMM of the MoE op's FLOPs in the
 * op's dtype (bf16/f16 on the tensor cores with f32 accumulation, f32 in plain f32).
 * cuBLAS is loaded at run time, so the tool starts on machines that have the CUDA toolkit's
 * compiler but not its libraries on the loader path (CI), and says "n/a" and why there.
 */
#include <cuda_runtime.h>

#include "ceiling.h"
#include "convert.h"
#include "random.h"
#include "median.h"
#include "timer.h"

#ifdef MOEFUSE_HAVE_DLOPEN
#include <dlfcn.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GEMM_RUNS 5

static int cuda_failed(char *what, size_t what_size, const char *call, cudaError_t e)
{
    snprintf(what, what_size, "%s failed: %s", call, cudaGetErrorName(e));
    cudaGetLastError();
    return -1;
}

static int stream_of(moefuse_context *ctx, cudaStream_t *stream, char *what, size_t what_size)
{
    void *s = NULL;
    moefuse_status st = moefuse_get_stream(ctx, &s);
    if (st != MOEFUSE_OK) {
        snprintf(what, what_size, "moefuse_get_stream failed: %s", moefuse_last_error(ctx));
        return -1;
    }
    *stream = (cudaStream_t)s;
    return 0;
}

/* The two events that time a run on the device (ev[0] before, ev[1] after); -1 with why. */
static int events_create(cudaEvent_t ev[2], char *what, size_t what_size)
{
    ev[0] = ev[1] = NULL;
    cudaError_t e = cudaEventCreate(&ev[0]);
    if (e == cudaSuccess)
        e = cudaEventCreate(&ev[1]);
    return e == cudaSuccess ? 0 : cuda_failed(what, what_size, "cudaEventCreate", e);
}

/* Records ev[1] after what was queued since ev[0], waits for it and gives the time between. */
static cudaError_t events_elapsed(cudaEvent_t ev[2], cudaStream_t stream, float *ms)
{
    cudaError_t e = cudaEventRecord(ev[1], stream);
    if (e == cudaSuccess)
        e = cudaEventSynchronize(ev[1]);
    if (e == cudaSuccess)
        e = cudaEventElapsedTime(ms, ev[0], ev[1]);
    return e;
}

static void events_destroy(cudaEvent_t ev[2])
{
    for (int i = 0; i < 2; i++)
        if (ev[i])
            cudaEventDestroy(ev[i]);
}

/* Host-side seconds up to the end of the stream's work: how cmd_bench times the op. */
static int sync_timed(cudaStream_t stream, double t0, double *seconds, char *what,
                      size_t what_size)
{
    cudaError_t e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess)
        return cuda_failed(what, what_size, "cudaStreamSynchronize", e);
    *seconds = now_seconds() - t0;
    return 0;
}

/* ---------------------------------------------------------------- copy */

static double cuda_copy_gbs(moefuse_context *ctx, char *what, size_t what_size)
{
    cudaStream_t stream;
    if (stream_of(ctx, &stream, what, what_size) != 0)
        return 0.0;
    const size_t bytes = (size_t)CEILING_COPY_MIB << 20; /* far beyond the L2 */
    double gbs = 0.0, best = 1e30;
    void *src = NULL, *dst = NULL;
    cudaError_t e = cudaMalloc(&src, bytes);
    if (e == cudaSuccess)
        e = cudaMalloc(&dst, bytes);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(src, 0x3F, bytes, stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(dst, 0x3F, bytes, stream);
    if (e != cudaSuccess) {
        cuda_failed(what, what_size, "cudaMalloc/cudaMemsetAsync of the copy buffers", e);
        goto done;
    }
    for (int r = -1; r < 5; r++) { /* r = -1: warm-up */
        double seconds;
        const double t0 = now_seconds();
        e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
        if (e != cudaSuccess) {
            cuda_failed(what, what_size, "cudaMemcpyAsync", e);
            goto done;
        }
        if (sync_timed(stream, t0, &seconds, what, what_size) != 0)
            goto done;
        if (r >= 0 && seconds < best)
            best = seconds;
    }
    gbs = 2.0 * (double)bytes / best / 1e9;
    snprintf(what, what_size, "cudaMemcpyAsync device to device of %zu MiB, read + write, best of 5",
             bytes >> 20);
done:
    cudaFree(src);
    cudaFree(dst);
    return gbs;
}

/* ---------------------------------------------------------------- read */

/* ceiling_cuda_read.cu: the sum kernel, launched on `stream`; one word per block. */
cudaError_t ceiling_cuda_read_launch(const void *src, size_t bytes, unsigned int *partial,
                                     int blocks, int threads, int unroll, cudaStream_t stream);

/*
 * The launch shapes tried, {blocks per SM, threads, loads in flight per thread}. On an H200 the
 * first (the only shape before 29 November 2026) read 2 GiB at 3.9 TB/s and the second at 4.66:
 * a ceiling from one shape can sit 17% under the machine (bench/read_floor_probe.cu).
 */
static const int read_shapes[][3] = {{4, 256, 4}, {8, 512, 4}, {4, 512, 8}, {8, 256, 8}};
#define READ_SHAPES (int)(sizeof read_shapes / sizeof read_shapes[0])
#define READ_MAX_BLOCKS_PER_SM 8 /* the most of read_shapes: partial[] holds one word a block */

/*
 * Read bandwidth on the context's stream: a sum over CEILING_READ_MIB filled with 0x3c bytes
 * that writes one word per block (ceiling_cuda_read.cu), for each launch shape the best of 5
 * after a warm-up, each run timed with events around the one kernel; the fastest shape wins.
 */
static double cuda_read_gbs(moefuse_context *ctx, char *what, size_t what_size)
{
    cudaStream_t stream;
    if (stream_of(ctx, &stream, what, what_size) != 0)
        return 0.0;
    const size_t bytes = (size_t)CEILING_READ_MIB << 20; /* far beyond the L2 */
    double gbs = 0.0;
    float best_ms = 1e30f;
    int best_shape = 0;
    void *src = NULL;
    unsigned int *partial = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    int device = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) {
        cuda_failed(what, what_size, "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)", e);
        return 0.0;
    }
    e = cudaMalloc(&src, bytes);
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&partial, (size_t)READ_MAX_BLOCKS_PER_SM * sms * sizeof *partial);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(src, 0x3c, bytes, stream);
    if (e != cudaSuccess) {
        cuda_failed(what, what_size, "cudaMalloc/cudaMemsetAsync of the read buffer", e);
        goto done;
    }
    if (events_create(ev, what, what_size) != 0)
        goto done;
    for (int shape = 0; shape < READ_SHAPES; shape++)
        for (int r = -1; r < 5; r++) { /* r = -1: warm-up */
            float ms = 0.0f;
            e = cudaEventRecord(ev[0], stream);
            if (e == cudaSuccess)
                e = ceiling_cuda_read_launch(src, bytes, partial, read_shapes[shape][0] * sms,
                                             read_shapes[shape][1], read_shapes[shape][2], stream);
            if (e == cudaSuccess)
                e = events_elapsed(ev, stream, &ms);
            if (e != cudaSuccess) {
                cuda_failed(what, what_size, "the read kernel", e);
                goto done;
            }
            if (r >= 0 && ms < best_ms)
                best_ms = ms, best_shape = shape;
        }
    gbs = (double)bytes / ((double)best_ms * 1e-3) / 1e9;
    snprintf(what, what_size,
             "sum kernel over %zu MiB, bytes read, best of %d launch shapes: %d blocks (%d per "
             "SM) x %d threads, %d 16-byte loads in flight each, best of 5 timed with events",
             bytes >> 20, READ_SHAPES, read_shapes[best_shape][0] * sms,
             read_shapes[best_shape][0], read_shapes[best_shape][1], read_shapes[best_shape][2]);
done:
    events_destroy(ev);
    cudaFree(src);
    cudaFree(partial);
    return gbs;
}

/* ---------------------------------------------------------------- cuBLAS */

/* The few declarations of cuBLAS's API used here (cublas_api.h), so it is not linked. */
typedef int cublas_status; /* CUBLAS_STATUS_SUCCESS = 0 */
typedef void *cublas_handle;
enum { CUBLAS_OP_N_ = 0, CUBLAS_COMPUTE_32F_ = 68, CUBLAS_GEMM_DEFAULT_ = -1 };
enum { CUDA_R_32F_ = 0, CUDA_R_16F_ = 2, CUDA_R_16BF_ = 14 };
typedef cublas_status (*create_fn)(cublas_handle *handle);
typedef cublas_status (*destroy_fn)(cublas_handle handle);
typedef cublas_status (*set_stream_fn)(cublas_handle handle, cudaStream_t stream);
typedef cublas_status (*gemm_ex_fn)(cublas_handle handle, int transa, int transb, int m, int n,
                                    int k, const void *alpha, const void *a, int a_type, int lda,
                                    const void *b, int b_type, int ldb, const void *beta, void *c,
                                    int c_type, int ldc, int compute_type, int algo);

typedef struct cublas_api {
    const char *soname;
    create_fn create;
    destroy_fn destroy;
    set_stream_fn set_stream;
    gemm_ex_fn gemm_ex;
} cublas_api;

#ifdef MOEFUSE_HAVE_DLOPEN
/* Through memcpy: ISO C has no conversion from void * to a function pointer. */
static int bind(void *lib, const char *name, void *fn, char *what, size_t what_size)
{
    dlerror();
    void *sym = dlsym(lib, name);
    if (!sym) {
        const char *err = dlerror();
        snprintf(what, what_size, "cuBLAS has no %s: %s", name, err ? err : "symbol is NULL");
        return -1;
    }
    memcpy(fn, &sym, sizeof sym);
    return 0;
}
#endif

static int cublas_load(cublas_api *api, char *what, size_t what_size)
{
    memset(api, 0, sizeof *api);
#ifndef MOEFUSE_HAVE_DLOPEN
    snprintf(what, what_size, "cuBLAS not loaded: this build has no dlopen");
    return -1;
#else
    static const char *const names[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so",
                                        "/usr/local/cuda/lib64/libcublas.so"};
    char first_error[256] = "";
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++) {
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (lib)
            api->soname = names[i];
        else if (i == 0) {
            const char *err = dlerror();
            snprintf(first_error, sizeof first_error, "%s", err ? err : "unknown dlopen error");
        }
    }
    if (!lib) {
        snprintf(what, what_size, "cuBLAS not found: %s", first_error);
        return -1;
    }
    if (bind(lib, "cublasCreate_v2", &api->create, what, what_size) != 0 ||
        bind(lib, "cublasDestroy_v2", &api->destroy, what, what_size) != 0 ||
        bind(lib, "cublasSetStream_v2", &api->set_stream, what, what_size) != 0 ||
        bind(lib, "cublasGemmEx", &api->gemm_ex, what, what_size) != 0)
        return -1;
    return 0;
#endif
}

/* `count` elements of dtype dt, uniform in [-1, 1): zeros would flatter the tensor cores. */
static void *random_matrix(size_t count, moefuse_dtype dt, uint64_t seed, cudaStream_t stream,
                           char *what, size_t what_size)
{
    const size_t esize = moefuse_dtype_size(dt), chunk = (size_t)1 << 22;
    void *dev = NULL;
    cudaError_t e = cudaMalloc(&dev, count * esize);
    if (e != cudaSuccess) {
        cuda_failed(what, what_size, "cudaMalloc of a GEMM matrix", e);
        return NULL;
    }
    void *host = malloc((count < chunk ? count : chunk) * esize);
    if (!host) {
        snprintf(what, what_size, "out of host memory filling the GEMM's matrices");
        cudaFree(dev);
        return NULL;
    }
    rng r = rng_seed(seed);
    for (size_t at = 0; at < count && e == cudaSuccess; at += chunk) {
        const size_t len = count - at < chunk ? count - at : chunk;
        for (size_t i = 0; i < len; i++)
            store_float(host, dt, (int64_t)i, rng_uniform(&r));
        e = cudaMemcpyAsync((char *)dev + at * esize, host, len * esize, cudaMemcpyHostToDevice,
                            stream);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(stream); /* host buffer is reused */
    }
    free(host);
    if (e != cudaSuccess) {
        cuda_failed(what, what_size, "cudaMemcpyAsync of a GEMM matrix", e);
        cudaFree(dev);
        return NULL;
    }
    return dev;
}

/*
 * Row-major C[rows, n] = A[rows, inner] B[inner, n] in the op's dtype with f32 accumulation,
 * through cublasGemmEx on the context's stream (as column-major C^T = B^T A^T): one untimed
 * call (cuBLAS picks and loads its kernel), then the median of GEMM_RUNS.
 */
static double cuda_gemm_gflops(moefuse_context *ctx, moefuse_dtype dtype, int64_t rows,
                               int64_t inner, int64_t n, char *what, size_t what_size)
{
    cublas_api blas;
    cudaStream_t stream;
    if (cublas_load(&blas, what, what_size) != 0 || stream_of(ctx, &stream, what, what_size) != 0)
        return 0.0;
    if (rows > 0x7FFFFFFF || inner > 0x7FFFFFFF || n > 0x7FFFFFFF) {
        snprintf(what, what_size, "the GEMM's sizes do not fit cuBLAS's int arguments");
        return 0.0;
    }
    const int type = dtype == MOEFUSE_BF16 ? CUDA_R_16BF_ : dtype == MOEFUSE_F16 ? CUDA_R_16F_
                                                                                  : CUDA_R_32F_;
    const float one = 1.0f, zero = 0.0f;
    double gflops = 0.0, times[GEMM_RUNS];
    cublas_handle h = NULL;
    void *a = random_matrix((size_t)rows * (size_t)inner, dtype, 99, stream, what, what_size);
    void *b = a ? random_matrix((size_t)inner * (size_t)n, dtype, 100, stream, what, what_size)
                : NULL;
    void *c = NULL;
    if (!b)
        goto done;
    cudaError_t ce = cudaMalloc(&c, (size_t)rows * (size_t)n * moefuse_dtype_size(dtype));
    if (ce != cudaSuccess) {
        c = NULL;
        cuda_failed(what, what_size, "cudaMalloc of the GEMM's result", ce);
        goto done;
    }
    cublas_status s = blas.create(&h);
    if (s == 0)
        s = blas.set_stream(h, stream);
    if (s != 0) {
        snprintf(what, what_size, "cublasCreate/cublasSetStream failed: status %d", s);
        goto done;
    }
    for (int r = -1; r < GEMM_RUNS; r++) {
        double seconds;
        const double t0 = now_seconds();
        s = blas.gemm_ex(h, CUBLAS_OP_N_, CUBLAS_OP_N_, (int)n, (int)rows, (int)inner, &one, b,
                         type, (int)n, a, type, (int)inner, &zero, c, type, (int)n,
                         CUBLAS_COMPUTE_32F_, CUBLAS_GEMM_DEFAULT_);
        if (s != 0) {
            snprintf(what, what_size, "cublasGemmEx failed: status %d", s);
            goto done;
        }
        if (sync_timed(stream, t0, &seconds, what, what_size) != 0)
            goto done;
        if (r >= 0)
            times[r] = seconds;
    }
    gflops = 2.0 * (double)rows * (double)inner * (double)n / median_sort(times, GEMM_RUNS) / 1e9;
    snprintf(what, what_size, "cublasGemmEx %s (%s) %lldx%lldx%lld, f32 accumulate, median of %d",
             moefuse_dtype_name(dtype), blas.soname, (long long)rows, (long long)inner,
             (long long)n, GEMM_RUNS);
done:
    if (h)
        blas.destroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    return gflops;
}

/* ------------------------------------------------------------- cuBLASLt FP8 */

/*
 * The FP8 dense GEMM ceiling: cuBLASLt e4m3 x e4m3 -> bf16 with f32 compute and precise
 * accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0: cuBLASLt promotes the tensor cores' partial
 * sums to f32 as the FP8 MoE does), per-tensor scales of 1, the TN layout FP8 requires. Types
 * and enums come from cublasLt.h; the library is loaded at run time like cuBLAS.
 */
#include <cublasLt.h>

typedef cublasStatus_t (*lt_create_fn)(cublasLtHandle_t *);
typedef cublasStatus_t (*lt_destroy_fn)(cublasLtHandle_t);
typedef cublasStatus_t (*lt_desc_create_fn)(cublasLtMatmulDesc_t *, cublasComputeType_t,
                                            cudaDataType_t);
typedef cublasStatus_t (*lt_desc_destroy_fn)(cublasLtMatmulDesc_t);
typedef cublasStatus_t (*lt_desc_set_fn)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t,
                                         const void *, size_t);
typedef cublasStatus_t (*lt_layout_create_fn)(cublasLtMatrixLayout_t *, cudaDataType, uint64_t,
                                              uint64_t, int64_t);
typedef cublasStatus_t (*lt_layout_destroy_fn)(cublasLtMatrixLayout_t);
typedef cublasStatus_t (*lt_pref_create_fn)(cublasLtMatmulPreference_t *);
typedef cublasStatus_t (*lt_pref_destroy_fn)(cublasLtMatmulPreference_t);
typedef cublasStatus_t (*lt_pref_set_fn)(cublasLtMatmulPreference_t,
                                         cublasLtMatmulPreferenceAttributes_t, const void *,
                                         size_t);
typedef cublasStatus_t (*lt_heuristic_fn)(cublasLtHandle_t, cublasLtMatmulDesc_t,
                                          cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                          cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                          cublasLtMatmulPreference_t, int,
                                          cublasLtMatmulHeuristicResult_t *, int *);
typedef cublasStatus_t (*lt_matmul_fn)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void *,
                                       const void *, cublasLtMatrixLayout_t, const void *,
                                       cublasLtMatrixLayout_t, const void *, const void *,
                                       cublasLtMatrixLayout_t, void *, cublasLtMatrixLayout_t,
                                       const cublasLtMatmulAlgo_t *, void *, size_t,
                                       cudaStream_t);

typedef struct lt_api {
    const char *soname;
    lt_create_fn create;
    lt_destroy_fn destroy;
    lt_desc_create_fn desc_create;
    lt_desc_destroy_fn desc_destroy;
    lt_desc_set_fn desc_set;
    lt_layout_create_fn layout_create;
    lt_layout_destroy_fn layout_destroy;
    lt_pref_create_fn pref_create;
    lt_pref_destroy_fn pref_destroy;
    lt_pref_set_fn pref_set;
    lt_heuristic_fn heuristic;
    lt_matmul_fn matmul;
} lt_api;

static int lt_load(lt_api *api, char *what, size_t what_size)
{
    memset(api, 0, sizeof *api);
#ifndef MOEFUSE_HAVE_DLOPEN
    snprintf(what, what_size, "cuBLASLt not loaded: this build has no dlopen");
    return -1;
#else
    static const char *const names[] = {"libcublasLt.so.13", "libcublasLt.so.12",
                                        "libcublasLt.so", "/usr/local/cuda/lib64/libcublasLt.so"};
    void *lib = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++)
        if ((lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL)) != NULL)
            api->soname = names[i];
    if (!lib) {
        const char *err = dlerror();
        snprintf(what, what_size, "cuBLASLt not found: %s", err ? err : "unknown dlopen error");
        return -1;
    }
    if (bind(lib, "cublasLtCreate", &api->create, what, what_size) != 0 ||
        bind(lib, "cublasLtDestroy", &api->destroy, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmulDescCreate", &api->desc_create, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmulDescDestroy", &api->desc_destroy, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmulDescSetAttribute", &api->desc_set, what, what_size) != 0 ||
        bind(lib, "cublasLtMatrixLayoutCreate", &api->layout_create, what, what_size) != 0 ||
        bind(lib, "cublasLtMatrixLayoutDestroy", &api->layout_destroy, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmulPreferenceCreate", &api->pref_create, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmulPreferenceDestroy", &api->pref_destroy, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmulPreferenceSetAttribute", &api->pref_set, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmulAlgoGetHeuristic", &api->heuristic, what, what_size) != 0 ||
        bind(lib, "cublasLtMatmul", &api->matmul, what, what_size) != 0)
        return -1;
    return 0;
#endif
}

#define LT_WORKSPACE ((size_t)32 << 20)

/*
 * Row-major C[rows, n] = A[rows, inner] B[inner, n] with e4m3 A and B on random codes: in
 * cuBLASLt's column-major terms D (n x rows) = op(B^T) (n x inner) x op(A^T): the "T" operand
 * is B stored [n, inner] row-major, the "N" one A stored [rows, inner] row-major.
 */
static double cuda_gemm_fp8_gflops(moefuse_context *ctx, int64_t rows, int64_t inner, int64_t n,
                                   char *what, size_t what_size)
{
    lt_api lt;
    cudaStream_t stream;
    if (lt_load(&lt, what, what_size) != 0 || stream_of(ctx, &stream, what, what_size) != 0)
        return 0.0;
    double gflops = 0.0, times[GEMM_RUNS];
    cublasLtHandle_t h = NULL;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    void *a = random_matrix((size_t)rows * (size_t)inner, MOEFUSE_F8_E4M3, 99, stream, what,
                            what_size);
    void *b = a ? random_matrix((size_t)inner * (size_t)n, MOEFUSE_F8_E4M3, 100, stream, what,
                                what_size)
                : NULL;
    void *c = NULL, *ws = NULL, *one_dev = NULL;
    if (!b)
        goto done;
    cudaError_t ce = cudaMalloc(&c, (size_t)rows * (size_t)n * 2);
    if (ce == cudaSuccess)
        ce = cudaMalloc(&ws, LT_WORKSPACE);
    if (ce == cudaSuccess)
        ce = cudaMalloc(&one_dev, sizeof(float));
    const float one = 1.0f, zero = 0.0f;
    if (ce == cudaSuccess)
        ce = cudaMemcpy(one_dev, &one, sizeof one, cudaMemcpyHostToDevice);
    if (ce != cudaSuccess) {
        cuda_failed(what, what_size, "cudaMalloc of the FP8 GEMM's buffers", ce);
        goto done;
    }
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int8_t precise = 0;
    const size_t ws_bytes = LT_WORKSPACE;
    cublasStatus_t st = lt.create(&h);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.desc_set(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &precise, sizeof precise);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.desc_set(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &one_dev, sizeof one_dev);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.desc_set(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &one_dev, sizeof one_dev);
    /* column-major: "A" = B^T as inner x n (ld inner), "B" = A^T as inner x rows */
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.layout_create(&la, CUDA_R_8F_E4M3, (uint64_t)inner, (uint64_t)n, inner);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.layout_create(&lb, CUDA_R_8F_E4M3, (uint64_t)inner, (uint64_t)rows, inner);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.layout_create(&lc, CUDA_R_16BF, (uint64_t)n, (uint64_t)rows, n);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.pref_create(&pref);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                         sizeof ws_bytes);
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
        st = lt.heuristic(h, desc, la, lb, lc, lc, pref, 1, &heur, &found);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        snprintf(what, what_size, "cuBLASLt FP8 setup failed: status %d, %d algorithms", (int)st,
                 found);
        goto done;
    }
    for (int r = -1; r < GEMM_RUNS; r++) {
        double seconds;
        const double t0 = now_seconds();
        st = lt.matmul(h, desc, &one, b, la, a, lb, &zero, c, lc, c, lc, &heur.algo, ws, ws_bytes,
                       stream);
        if (st != CUBLAS_STATUS_SUCCESS) {
            snprintf(what, what_size, "cublasLtMatmul (FP8) failed: status %d", (int)st);
            goto done;
        }
        if (sync_timed(stream, t0, &seconds, what, what_size) != 0)
            goto done;
        if (r >= 0)
            times[r] = seconds;
    }
    gflops = 2.0 * (double)rows * (double)inner * (double)n / median_sort(times, GEMM_RUNS) / 1e9;
    snprintf(what, what_size,
             "cublasLtMatmul e4m3 x e4m3 -> bf16 (%s) %lldx%lldx%lld, f32 compute, precise "
             "accumulation, median of %d",
             lt.soname, (long long)rows, (long long)inner, (long long)n, GEMM_RUNS);
done:
    if (pref)
        lt.pref_destroy(pref);
    if (la)
        lt.layout_destroy(la);
    if (lb)
        lt.layout_destroy(lb);
    if (lc)
        lt.layout_destroy(lc);
    if (desc)
        lt.desc_destroy(desc);
    if (h)
        lt.destroy(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(ws);
    cudaFree(one_dev);
    return gflops;
}

/* ---------------------------------------------------------------- graph */

/*
 * `calls` calls of issue(arg) captured into one graph on a non-blocking stream of this
 * function's, the context attached to it for the capture as an engine attaches its stream
 * (tests/test_cuda_graph.c does the same), then replayed on that stream, each replay between
 * two events.
 */
static int cuda_graph_times(moefuse_context *ctx, moefuse_status (*issue)(void *arg), void *arg,
                            int64_t calls, int64_t warmup, int64_t iters, double *times,
                            char *what, size_t what_size)
{
    int rc = -1;
    cudaStream_t stream = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    moefuse_status st = moefuse_synchronize(ctx); /* the inputs' uploads are done */
    if (st != MOEFUSE_OK) {
        snprintf(what, what_size, "moefuse_synchronize failed: %s", moefuse_last_error(ctx));
        return -1;
    }
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        stream = NULL;
        cuda_failed(what, what_size, "cudaStreamCreateWithFlags", e);
        goto done;
    }
    e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
    if (e != cudaSuccess) {
        cuda_failed(what, what_size, "cudaStreamBeginCapture", e);
        goto done;
    }
    st = moefuse_set_stream(ctx, stream);
    for (int64_t c = 0; c < calls && st == MOEFUSE_OK; c++)
        st = issue(arg);
    if (st != MOEFUSE_OK) /* before the calls below clear the message */
        snprintf(what, what_size, "a call under capture failed: %s", moefuse_last_error(ctx));
    e = cudaStreamEndCapture(stream, &graph); /* ended whatever happened */
    const moefuse_status back = moefuse_set_stream(ctx, NULL);
    if (st != MOEFUSE_OK) {
        cudaGetLastError();
        goto done;
    }
    if (e != cudaSuccess) {
        cuda_failed(what, what_size, "cudaStreamEndCapture", e);
        goto done;
    }
    if (back != MOEFUSE_OK) {
        snprintf(what, what_size, "moefuse_set_stream(NULL) failed: %s", moefuse_last_error(ctx));
        goto done;
    }
    e = cudaGraphInstantiate(&exec, graph, 0);
    if (e != cudaSuccess) {
        exec = NULL;
        cuda_failed(what, what_size, "cudaGraphInstantiate", e);
        goto done;
    }
    if (events_create(ev, what, what_size) != 0)
        goto done;
    for (int64_t r = -warmup; r < iters; r++) {
        float ms = 0.0f;
        e = cudaEventRecord(ev[0], stream);
        if (e == cudaSuccess)
            e = cudaGraphLaunch(exec, stream);
        if (e == cudaSuccess)
            e = events_elapsed(ev, stream, &ms);
        if (e != cudaSuccess) {
            cuda_failed(what, what_size, "a replay of the graph", e);
            goto done;
        }
        if (r >= 0)
            times[r] = (double)ms * 1e-3 / (double)calls;
    }
    snprintf(what, what_size,
             "one CUDA graph of %lld back-to-back calls, replayed, each replay timed with events",
             (long long)calls);
    rc = 0;
done:
    events_destroy(ev);
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    if (stream) {
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
    }
    return rc;
}

const ceiling_provider ceiling_cuda = {
    .backend = "cuda",
    .summary = "cudaMemcpyAsync device to device + a read-only sum kernel + cuBLAS cublasGemmEx "
               "and cuBLASLt FP8 (loaded at run time)",
    .copy_gbs = cuda_copy_gbs,
    .read_gbs = cuda_read_gbs,
    .gemm_gflops = cuda_gemm_gflops,
    .gemm_fp8_gflops = cuda_gemm_fp8_gflops,
    .graph_times = cuda_graph_times,
};
