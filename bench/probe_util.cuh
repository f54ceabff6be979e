/*
 * What the standalone probes of bench/ share: a failed CUDA call ends the probe with its name,
 * and every probe starts from the SM count, a pool of bytes to read (filled, so that no page is
 * untouched) and a small sink for the results nobody reads.
 */
#ifndef MOEFUSE_BENCH_PROBE_UTIL_CUH
#define MOEFUSE_BENCH_PROBE_UTIL_CUH

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

static void check(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

/* The device's SM count, a pool of pool_bytes filled with ones, and a 1 MiB sink. */
static int probe_setup(long long pool_bytes, char **pool, unsigned **sink)
{
    int dev = 0, sms = 0;
    check(cudaGetDevice(&dev), "device");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "sms");
    check(cudaMalloc(pool, pool_bytes), "pool");
    check(cudaMemset(*pool, 1, pool_bytes), "fill");
    check(cudaMalloc(sink, 1 << 20), "sink");
    return sms;
}

#endif
