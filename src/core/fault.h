/*
 * Fault injection, a test hook: make the Nth allocation (or program build) of
 * one kind fail on the calling thread, so that a test walks the error path a
 * real failure takes (same status, same message path, same cleanup). Arming
 * is per thread, so contexts used by other threads meanwhile are unaffected.
 *
 * Not part of the API in include/moefuse.h. The library exports the arming
 * calls for the test programs (tests/test_faults.c includes this header).
 * Every allocation site in src/ asks mf_fault_hit first; while nothing is
 * armed that costs one thread-local load.
 */
#ifndef MOEFUSE_CORE_FAULT_H
#define MOEFUSE_CORE_FAULT_H

#include "moefuse.h" /* MOEFUSE_API */

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus /* called from the CUDA backend's .cu files */
extern "C" {
#endif

typedef enum mf_fault_kind {
    MF_FAULT_HOST_ALLOC,    /* the library's own host memory: states, per-call scratch, tables */
    MF_FAULT_DEVICE_ALLOC,  /* a backend's buffer_alloc: host (cpu), clCreateBuffer, cudaMalloc */
    MF_FAULT_SCRATCH_GROW,  /* growing a context's scratch: moe_forward's workspace, OpenCL, CUDA */
    MF_FAULT_PROGRAM_BUILD, /* clBuildProgram, from source or from the binary cache */
    MF_FAULT_KIND_COUNT_
} mf_fault_kind;

/* Fail the nth hit of `kind` from now on, on this thread only, once; nth = 0 disarms. */
MOEFUSE_API void mf_fault_arm(mf_fault_kind kind, int64_t nth);
/* Disarm every kind on this thread and forget what fired. */
MOEFUSE_API void mf_fault_disarm_all(void);
/* Whether the fault armed for `kind` on this thread has fired. */
MOEFUSE_API bool mf_fault_fired(mf_fault_kind kind);
/* "host allocation", "device allocation", ... */
MOEFUSE_API const char *mf_fault_kind_name(mf_fault_kind kind);

/* At an allocation site: true when this hit must fail as if the allocation had failed. */
bool mf_fault_hit(mf_fault_kind kind);

#ifdef __cplusplus
}
#endif

#endif /* MOEFUSE_CORE_FAULT_H */
