/*
 * Ceilings that `moefuse bench` measures in the same run as the operation, on the same
 * backend and device: one provider per backend, looked up by the backend's name.
 */
#ifndef MOEFUSE_TOOLS_CEILING_H
#define MOEFUSE_TOOLS_CEILING_H

#include <moefuse.h>

#include <stddef.h>
#include <stdint.h>

/* Size of each of the two buffers of a copy ceiling (less where the device caps it). */
#define CEILING_COPY_MIB 1024
/* Size of the one buffer of a read ceiling: the memory of the copy's two. */
#define CEILING_READ_MIB (2 * CEILING_COPY_MIB)

/*
 * What one backend can measure. Each function returns the ceiling and describes in `what`
 * how it was measured ("memcpy of 1024 MiB, read + write, best of 5"); or returns 0 and
 * says in `what` why there is none ("CLBlast not found: ..."). Neither ever aborts.
 */
typedef struct ceiling_provider {
    const char *backend; /* as moefuse_backend_name() spells it */
    const char *summary; /* one line for `moefuse info` */
    /* Copy bandwidth of the backend's memory in GB/s, bytes read + bytes written. */
    double (*copy_gbs)(moefuse_context *ctx, char *what, size_t what_size);
    /*
     * [optional, NULL where there is none] Bandwidth of a read-only stream in GB/s (bytes
     * read): what a MoE layer streaming its weights can reach at best, which a copy (half of
     * its traffic writes) understates.
     */
    double (*read_gbs)(moefuse_context *ctx, char *what, size_t what_size);
    /*
     * A dense GEMM of the MoE op's FLOPs, C[rows, n] = A[rows, inner] B[inner, n], in GFLOP/s;
     * `dtype` is the op's input dtype, for providers that have a GEMM in it.
     */
    double (*gemm_gflops)(moefuse_context *ctx, moefuse_dtype dtype, int64_t rows, int64_t inner,
                          int64_t n, char *what, size_t what_size);
    /* [optional, NULL where there is none] the same GEMM on FP8 e4m3 operands, for the FP8
     * MoE ops; without it they are held to gemm_gflops in bf16. */
    double (*gemm_fp8_gflops)(moefuse_context *ctx, int64_t rows, int64_t inner, int64_t n,
                              char *what, size_t what_size);
    /*
     * [optional, NULL where the backend has no graphs] `moefuse bench --graph 1`: times
     * `calls` back-to-back issue(arg) as an engine runs a decode step, captured once into one
     * graph on a stream of its own (the context attached to it for the capture only), then
     * replayed `warmup` times untimed and `iters` times, each replay timed with events;
     * times[i] gets replay i's seconds per call. Returns 0 and describes the timing in `what`
     * ("one CUDA graph of 10 calls, ..."), or -1 with why in `what`, nothing timed.
     */
    int (*graph_times)(moefuse_context *ctx, moefuse_status (*issue)(void *arg), void *arg,
                       int64_t calls, int64_t warmup, int64_t iters, double *times, char *what,
                       size_t what_size);
} ceiling_provider;

/* The provider for `backend`, or NULL when this build measures no ceiling there. */
const ceiling_provider *ceiling_provider_for(const char *backend);

/* The providers ceiling.c chooses from, each in its own file. */
extern const ceiling_provider ceiling_cpu;
#ifdef MOEFUSE_HAVE_OPENCL_CEILING
extern const ceiling_provider ceiling_opencl;
#endif
#ifdef MOEFUSE_HAVE_CUDA_CEILING
extern const ceiling_provider ceiling_cuda;
#endif

#endif
