/* test_cuda_tiles' parts: test_cuda_tiles.c (the bf16/f16 kernels, and main) and
 * test_cuda_tiles_fp8.c (the FP8 kernel's half tiles). */
#ifndef MOEFUSE_TEST_CUDA_TILES_H
#define MOEFUSE_TEST_CUDA_TILES_H

#include "harness.h"

void cuda_tiles_fp8_tests(Suite *s); /* test_cuda_tiles_fp8.c */

#endif
