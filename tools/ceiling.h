/* Ceilings that `moefuse bench` measures in the same run as the operation. */
#ifndef MOEFUSE_TOOLS_CEILING_H
#define MOEFUSE_TOOLS_CEILING_H

#include <moefuse.h>

#include <stdint.h>

/* Size of each of the two buffers of the copy ceiling. */
#define CEILING_COPY_MIB 1024

/* Host copy bandwidth in GB/s (bytes read + bytes written), best of several memcpy runs. */
double ceiling_copy_gbs(void);

/*
 * Dense GEMM of the same FLOPs as the MoE op, C[rows, n] = A[rows, inner] B[inner, n], through
 * OpenBLAS, in GFLOP/s (best of `reps`). `what` receives a description of the call made
 * ("cblas_sbgemm 256x4608x2048"); returns 0 (and says why in `what`) when no BLAS is built in.
 */
double ceiling_gemm_gflops(moefuse_dtype dtype, int64_t rows, int64_t inner, int64_t n, int reps,
                           char *what, size_t what_size);

#endif
