/*
 * Building the embedded kernel program for one context and device, with
 * options chosen from what the device reports, and looking the kernels up.
 */
#include "opencl/ocl_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const kernel_names[MF_K_COUNT_] = {
    [MF_K_COUNT_PREFIX] = "mf_count_prefix",   [MF_K_ROWS_QUANT] = "mf_rows_quant",
    [MF_K_ROWS_QUANT_SILU] = "mf_rows_quant_silu", [MF_K_ROWS_QUANT_H] = "mf_rows_quant_h",
    [MF_K_ROWS_QUANT_TAB_LOCAL] = "mf_rows_quant_tab_local",
    [MF_K_ROWS_QUANT_TAB_GLOBAL] = "mf_rows_quant_tab_global",
    [MF_K_BUILD_ACT_TABLES] = "mf_build_act_tables",
    [MF_K_ROWS_ACT_MUL] = "mf_rows_act_mul",   [MF_K_ROWS_TAIL] = "mf_rows_tail",
    [MF_K_DEQUANT] = "mf_dequant",             [MF_K_TOPK_SOFTMAX] = "mf_topk_softmax",
    [MF_K_TOPK_ROUTE] = "mf_topk_route",
    [MF_K_ROUTING_META_COUNT] = "mf_routing_meta_count",
    [MF_K_ROUTING_META_PLACE] = "mf_routing_meta_place",
    [MF_K_ROUTING_META_INVALID] = "mf_routing_meta_invalid",
    [MF_K_ROUTING_META_SPAN_COUNT] = "mf_routing_meta_span_count",
    [MF_K_ROUTING_META_SPAN_PLACE] = "mf_routing_meta_span_place",
    [MF_K_MOE_SHARED_ROUTING] = "mf_moe_shared_routing",
    [MF_K_MOE_GATE] = "mf_moe_gate",           [MF_K_MOE_FINAL] = "mf_moe_final",
    [MF_K_MOE_ROUTE_COUNT] = "mf_moe_route_count", [MF_K_MOE_ROUTE_SCAN] = "mf_moe_route_scan",
    [MF_K_MOE_ROUTE_FILL] = "mf_moe_route_fill", [MF_K_MOE_ZERO_INVALID] = "mf_moe_zero_invalid",
    [MF_K_MOE_GATE_TILED] = "mf_moe_gate_tiled", [MF_K_MOE_FINAL_TILED] = "mf_moe_final_tiled",
    [MF_K_MOE_GATE_WIDE] = "mf_moe_gate_wide",   [MF_K_MOE_FINAL_WIDE] = "mf_moe_final_wide",
    [MF_K_MOE_REDUCE] = "mf_moe_reduce",
    [MF_K_MOE_GATE_GEMV] = "mf_moe_gate_gemv", [MF_K_MOE_FINAL_GEMV] = "mf_moe_final_gemv",
    [MF_K_MOE_FP8_GATE] = "mf_moe_fp8_gate",   [MF_K_MOE_FP8_FINAL] = "mf_moe_fp8_final",
    [MF_K_MOE_FP8_GATE_TILED] = "mf_moe_fp8_gate_tiled",
    [MF_K_MOE_FP8_FINAL_TILED] = "mf_moe_fp8_final_tiled",
};

/* Both kernels of a fixed work-group size can run it on this device. */
static bool kernels_take(ocl_state *s, enum mf_ocl_kernel a, enum mf_ocl_kernel b, size_t wg)
{
    const enum mf_ocl_kernel ks[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        size_t kmax = 0;
        if (clGetKernelWorkGroupInfo(s->kernels[ks[i]], s->device, CL_KERNEL_WORK_GROUP_SIZE,
                                     sizeof kmax, &kmax, NULL) != CL_SUCCESS ||
            kmax < wg)
            return false;
    }
    return true;
}

/* The matrix-vector kernels need work-groups of 256 (their 2 KiB of local memory is
 * within every device's minimum). */
static bool gemv_fits(ocl_state *s)
{
    const char *env = getenv("MOEFUSE_OPENCL_GEMM");
    s->force_gemv = env && strcmp(env, "gemv") == 0;
    if (env && (strcmp(env, "simple") == 0 || strcmp(env, "tiled") == 0 ||
                strcmp(env, "wide") == 0))
        return false;
    size_t dims[3] = {0, 0, 0};
    clGetDeviceInfo(s->device, CL_DEVICE_MAX_WORK_ITEM_SIZES, sizeof dims, dims, NULL);
    return dims[0] >= 256 && kernels_take(s, MF_K_MOE_GATE_GEMV, MF_K_MOE_FINAL_GEMV, 256);
}

/* The tiled GEMMs need 16 x 16 work-groups and ~9 KiB of local memory. */
static bool tiled_fits(ocl_state *s)
{
    /* (first: the table kernels' choice reads it too, whatever MOEFUSE_OPENCL_GEMM says) */
    cl_device_type type = 0;
    clGetDeviceInfo(s->device, CL_DEVICE_TYPE, sizeof type, &type, NULL);
    s->cpu_device = (type & CL_DEVICE_TYPE_CPU) != 0;
    const char *env = getenv("MOEFUSE_OPENCL_GEMM");
    if (env && strcmp(env, "simple") == 0)
        return false;
    s->force_tiled = env && strcmp(env, "tiled") == 0;
    size_t dims[3] = {0, 0, 0};
    cl_ulong local = 0;
    clGetDeviceInfo(s->device, CL_DEVICE_MAX_WORK_ITEM_SIZES, sizeof dims, dims, NULL);
    clGetDeviceInfo(s->device, CL_DEVICE_LOCAL_MEM_SIZE, sizeof local, &local, NULL);
    if (dims[0] < 16 || dims[1] < 16 || local < 12 * 1024)
        return false;
    return kernels_take(s, MF_K_MOE_GATE_TILED, MF_K_MOE_FINAL_TILED, 256);
}

/* The wide tiles need 16 x 16 work-groups, 34 KiB of local memory (two slabs of both operands,
 * the tile's slots) and a little-endian device (two 16-bit elements read as one word); only
 * GPU devices take them unless forced (moe_tiled.cl's reasons for CPU devices hold). */
static bool wide_fits(ocl_state *s)
{
    const char *env = getenv("MOEFUSE_OPENCL_GEMM");
    s->force_wide = env && strcmp(env, "wide") == 0;
    clGetDeviceInfo(s->device, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof s->max_alloc, &s->max_alloc,
                    NULL);
    if (!s->tiled || s->force_tiled) /* (simple leaves s->tiled false; gemv forced comes first) */
        return false;
    cl_ulong local = 0;
    cl_bool little = CL_FALSE;
    clGetDeviceInfo(s->device, CL_DEVICE_LOCAL_MEM_SIZE, sizeof local, &local, NULL);
    clGetDeviceInfo(s->device, CL_DEVICE_ENDIAN_LITTLE, sizeof little, &little, NULL);
    return local >= 36 * 1024 && little == CL_TRUE &&
           kernels_take(s, MF_K_MOE_GATE_WIDE, MF_K_MOE_FINAL_WIDE, 256);
}

/* The FP8 kernels need work-groups of 128 (gate: one h group) and 64 (final); the tiled ones
 * take 25 KiB of local memory, within the 32 KiB every device has. */
static bool fp8_fits(ocl_state *s)
{
    return kernels_take(s, MF_K_MOE_FP8_GATE, MF_K_MOE_FP8_GATE_TILED, 128) &&
           kernels_take(s, MF_K_MOE_FP8_FINAL, MF_K_MOE_FP8_FINAL_TILED, 64);
}

/* The build log, cut to what fits in a status message. */
static void build_log(ocl_state *s, char *buf, size_t size)
{
    size_t n = 0;
    buf[0] = '\0';
    if (clGetProgramBuildInfo(s->program, s->device, CL_PROGRAM_BUILD_LOG, 0, NULL, &n) !=
            CL_SUCCESS ||
        n == 0)
        return;
    char *log = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : malloc(n + 1);
    if (!log)
        return;
    if (clGetProgramBuildInfo(s->program, s->device, CL_PROGRAM_BUILD_LOG, n, log, NULL) ==
        CL_SUCCESS) {
        log[n] = '\0';
        snprintf(buf, size, "%s", log);
    }
    free(log);
}

/* Options per device. Correctly rounded f32 division makes s = amax / 448 and
 * h / s match the CPU bit for bit; without it OpenCL allows 2.5 ulp. (exp, erf
 * and tanh are the library's own f32 code, src/numerics: no doubles needed.) */
static moefuse_status choose_options(moefuse_context *ctx, ocl_state *s, char *opts, size_t size)
{
    (void)ctx;
    cl_device_fp_config fp = 0;
    clGetDeviceInfo(s->device, CL_DEVICE_SINGLE_FP_CONFIG, sizeof fp, &fp, NULL);
    s->fp_correct_div = (fp & CL_FP_CORRECTLY_ROUNDED_DIVIDE_SQRT) != 0;
    snprintf(opts, size, "-cl-std=CL1.2%s",
             s->fp_correct_div ? " -cl-fp32-correctly-rounded-divide-sqrt" : "");
    return MOEFUSE_OK;
}

/* Can the table kernel with a local copy (32 KiB, about 41 KiB of local memory in all) run
 * groups of s->wg on this device? Not on CPU devices, where a copy per work-group costs more
 * than reading the table in place, unless MOEFUSE_OPENCL_ACT_TABLE=local asks for it (the
 * tests, so that PoCL runs the GPUs' kernel too). */
static bool table_local_fits(const ocl_state *s)
{
    const char *env = getenv("MOEFUSE_OPENCL_ACT_TABLE");
    const bool force = env && strcmp(env, "local") == 0;
    cl_ulong local = 0;
    size_t kmax = 0;
    if ((s->cpu_device && !force) ||
        clGetDeviceInfo(s->device, CL_DEVICE_LOCAL_MEM_SIZE, sizeof local, &local, NULL) !=
            CL_SUCCESS ||
        clGetKernelWorkGroupInfo(s->kernels[MF_K_ROWS_QUANT_TAB_LOCAL], s->device,
                                 CL_KERNEL_WORK_GROUP_SIZE, sizeof kmax, &kmax, NULL) != CL_SUCCESS)
        return false;
    return local >= 48 * 1024 && kmax >= s->wg; /* the table, the row offsets, the rest */
}

/* Compile the embedded source; the build log goes into the message on failure. */
static moefuse_status build_source(moefuse_context *ctx, ocl_state *s, const char *opts)
{
    cl_int e;
    const char *src = mf_ocl_source;
    s->program = clCreateProgramWithSource(s->context, 1, &src, NULL, &e);
    if (e != CL_SUCCESS) {
        s->program = NULL;
        return mf_ocl_fail(ctx, e, NULL, "clCreateProgramWithSource");
    }
    const bool injected = mf_fault_hit(MF_FAULT_PROGRAM_BUILD); /* a test's (core/fault.h) */
    e = injected ? CL_BUILD_PROGRAM_FAILURE
                 : clBuildProgram(s->program, 1, &s->device, opts, NULL, NULL);
    if (e != CL_SUCCESS) {
        char log[700] = "(failure injected by a test)";
        if (!injected)
            build_log(s, log, sizeof log);
        return mf_error(ctx, MOEFUSE_ERR_BACKEND_FAILURE,
                        "opencl: clBuildProgram(%s) failed with %s (%d): %s", opts,
                        mf_ocl_error_name(e), (int)e, log[0] ? log : "(empty build log)");
    }
    return MOEFUSE_OK;
}

moefuse_status mf_ocl_build(moefuse_context *ctx, ocl_state *s)
{
    cl_int e;
    char opts[128], path[1100];
    MF_TRY(choose_options(ctx, s, opts, sizeof opts));
    s->from_cache = mf_ocl_cache_load(s, opts, path, sizeof path);
    if (!s->from_cache) {
        moefuse_status st = build_source(ctx, s, opts);
        if (st != MOEFUSE_OK)
            return st;
        mf_ocl_cache_store(s, opts, path);
    }
    for (int k = 0; k < MF_K_COUNT_; k++) {
        s->kernels[k] = clCreateKernel(s->program, kernel_names[k], &e);
        if (e != CL_SUCCESS) {
            char call[80];
            snprintf(call, sizeof call, "clCreateKernel(%s)", kernel_names[k]);
            return mf_ocl_fail(ctx, e, NULL, call);
        }
    }
    /* One work-group size for the row and GEMM kernels: at most 128 (MF_MAX_WG of
     * kernels/rows.cl sizes local arrays by it), within what the device and every
     * kernel allow, a power of two (the amax reduction halves it). */
    size_t wg = 128, dev_max = 1;
    clGetDeviceInfo(s->device, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof dev_max, &dev_max, NULL);
    if (dev_max < wg)
        wg = dev_max;
    for (int k = 0; k < MF_K_COUNT_; k++) {
        size_t kmax = 0;
        if (k == MF_K_MOE_GATE_TILED || k == MF_K_MOE_FINAL_TILED || k == MF_K_MOE_GATE_WIDE ||
            k == MF_K_MOE_FINAL_WIDE || k == MF_K_MOE_GATE_GEMV || k == MF_K_MOE_FINAL_GEMV ||
            k == MF_K_ROWS_QUANT_TAB_LOCAL || k == MF_K_MOE_FP8_GATE || k == MF_K_MOE_FP8_FINAL ||
            k == MF_K_MOE_FP8_GATE_TILED || k == MF_K_MOE_FP8_FINAL_TILED)
            continue; /* fixed sizes: tiled_fits, wide_fits, gemv_fits, table_local_fits,
                       * fp8_fits */
        if (clGetKernelWorkGroupInfo(s->kernels[k], s->device, CL_KERNEL_WORK_GROUP_SIZE,
                                     sizeof kmax, &kmax, NULL) == CL_SUCCESS &&
            kmax > 0 && kmax < wg)
            wg = kmax;
    }
    size_t p2 = 1;
    while (p2 * 2 <= wg)
        p2 *= 2;
    s->wg = p2;
    s->tiled = tiled_fits(s);
    s->wide = wide_fits(s);
    s->gemv = gemv_fits(s);
    s->table_local = table_local_fits(s);
    s->fp8 = fp8_fits(s);
    return MOEFUSE_OK;
}
