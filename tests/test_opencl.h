/* test_opencl's parts (test_opencl.c says what it covers): the caller's OpenCL objects, and
 * what each file gives the others. */
#ifndef MOEFUSE_TEST_OPENCL_H
#define MOEFUSE_TEST_OPENCL_H

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <stdbool.h>

#include "harness.h"

/* ------------------------------------------------------------ environment */

typedef struct {
    const char *name;
    char *value; /* NULL: was unset */
} saved_env;

/* ------------------------------------------- the caller's cl_context, queue and cl_mem */

/* OpenCL objects an engine made itself, on the device of g_ctx (MOEFUSE_OPENCL_DEVICE's). */
typedef struct caller_cl {
    cl_platform_id platform;
    cl_device_id device;
    cl_context context;
    cl_command_queue queue; /* in-order */
} caller_cl;

/* Reference counts of the caller's context and queue (unless c is NULL) and of one cl_mem
 * (unless m is NULL); what is not asked stays 0. */
typedef struct ref_counts {
    cl_uint context, queue, mem;
} ref_counts;
enum { CANARY = 64 }; /* canary bytes before and after each tensor in the caller's cl_mem */

/*
 * A cl_mem of the caller's: a plain buffer, or a sub-buffer (at an origin aligned as the device
 * asks, with bytes of the parent after it too) of a bigger one. Every byte of the parent starts
 * as canary; a tensor lies at byte CANARY of `mem`.
 */
typedef struct caller_mem {
    cl_mem parent; /* what the caller allocated */
    cl_mem mem;    /* what moefuse gets: parent itself, or its sub-buffer */
    size_t origin; /* of mem in parent */
    size_t size;   /* of mem: CANARY + payload + CANARY */
    size_t total;  /* of parent */
    unsigned char *bytes; /* what parent holds, as far as the test knows */
} caller_mem;

/* act_quant (x [5, 512] f32 -> q [5, 256] f8, scales [5, 2]) and moe_gate (x [6, 64] f32,
 * w1 [4, 64, 64], ids [6, 2] with invalid slots, h [6, 2, 32] f32): the operands, in order. */
enum { OP_X, OP_Q, OP_SC, OP_MX, OP_W1, OP_IDS, OP_H, OP_COUNT };
enum { AQ_T = 5, AQ_H = 256, MG_M = 6, MG_K = 64, MG_I = 32, MG_E = 4, MG_TOPK = 2 };
static const size_t op_bytes[OP_COUNT] = {
    AQ_T * 2 * AQ_H * 4, AQ_T * AQ_H, AQ_T * (AQ_H / 128) * 4,  MG_M * MG_K * 4,
    MG_E * 2 * MG_I * MG_K * 4, MG_M * MG_TOPK * 4, MG_M * MG_TOPK * MG_I * 4};
static const bool op_output[OP_COUNT] = {false, true, true, false, false, false, true};
static const char *const op_names[OP_COUNT] = {"x", "q", "scales", "moe x", "w1", "topk_ids",
                                               "h"};

/* test_opencl_handles.c */
cl_command_queue current_queue(void);

/* test_opencl_caller.c */
caller_cl caller_open(void);
void caller_close(caller_cl *c);
ref_counts counts_settled(const caller_cl *c, cl_mem m, const ref_counts *want);
void expect_counts(const caller_cl *c, cl_mem m, ref_counts want, const char *what);
caller_mem caller_mem_new(const caller_cl *c, size_t payload, bool sub);
void caller_mem_put(const caller_cl *c, caller_mem *m, const void *src, size_t bytes);
void caller_mem_check(const caller_cl *c, caller_mem *m, size_t written, void *out,
                      const char *what);
void caller_mem_free(caller_mem *m);
void make_inputs(unsigned char *in[OP_COUNT]);
void free_ops(unsigned char *ops[OP_COUNT]);
moefuse_tensor op_tensor(void *const buf[OP_COUNT], int op, int64_t offset);
void outputs_on(moefuse_context *ctx, unsigned char *const in[OP_COUNT],
                unsigned char *out[OP_COUNT]);
void same_bytes(const void *got, const void *want, size_t n, const char *what);
moefuse_context *adopt(const caller_cl *c);
void import_ok(moefuse_context *ctx, cl_mem m, const char *what);
void expect_status(moefuse_context *ctx, moefuse_status st, moefuse_status want,
                   const char *needle, const char *what);

/* test_opencl.c */
saved_env env_save(const char *name);
void env_restore(saved_env *s);

void opencl_handles_tests(TCase *tc); /* test_opencl_handles.c */
void opencl_caller_tests(TCase *tc); /* test_opencl_caller.c */
void opencl_import_tests(TCase *tc); /* test_opencl_import.c */
void opencl_cache_tests(TCase *tc); /* test_opencl_cache.c */

#endif
