/*
 * The OpenCL backend's own plumbing: device choice (MOEFUSE_OPENCL_DEVICE),
 * handles that belong to something else, the caller's queue
 * (moefuse_get_stream / moefuse_set_stream), contexts over the caller's
 * cl_context and queue with tensors on the caller's cl_mem
 * (moefuse_context_create_opencl, moefuse_buffer_import), and the on-disk cache
 * of program binaries (MOEFUSE_OPENCL_CACHE). Always runs on "opencl"; without an OpenCL
 * platform it is skipped (h_run). Environment variables are set before the
 * contexts that read them are created, and restored afterwards.
 */

#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/fault.h" /* mf_fault_arm: adoption's failure paths */
#include "test_opencl.h"

saved_env env_save(const char *name)
{
    const char *v = getenv(name);
    saved_env s = {name, v ? strdup(v) : NULL};
    return s;
}

void env_restore(saved_env *s)
{
    if (s->value)
        setenv(s->name, s->value, 1);
    else
        unsetenv(s->name);
    free(s->value);
    s->value = NULL;
}

/*
 * A context on "opencl" on `device`: by_arg 0 through MOEFUSE_OPENCL_DEVICE (NULL: unset);
 * by_arg 1 through moefuse_context_create_on, with the variable naming no device at all, so
 * that the argument must win.
 */
static int by_arg;
static moefuse_status context_on(moefuse_context **c, const char *device)
{
    if (by_arg) {
        setenv("MOEFUSE_OPENCL_DEVICE", "no-such-device-moefuse", 1);
        return moefuse_context_create_on(c, "opencl", device);
    }
    if (device)
        setenv("MOEFUSE_OPENCL_DEVICE", device, 1);
    else
        unsetenv("MOEFUSE_OPENCL_DEVICE");
    return moefuse_context_create(c, "opencl");
}

/* ------------------------------------------------------- device selection */

/* Name of device 0 of platform 0, the first device in MOEFUSE_OPENCL_DEVICE's order. */
static void first_device_name(char *name, size_t size)
{
    cl_platform_id p;
    cl_device_id d;
    name[0] = '\0';
    cl_uint np = 0, nd = 0;
    HCHECK(clGetPlatformIDs(1, &p, &np) == CL_SUCCESS && np > 0, "no OpenCL platform");
    HCHECK(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 1, &d, &nd) == CL_SUCCESS && nd > 0,
           "platform 0 has no device");
    HCHECK(clGetDeviceInfo(d, CL_DEVICE_NAME, size - 1, name, NULL) == CL_SUCCESS, "CL_DEVICE_NAME failed");
    name[size - 1] = '\0';
}

static void expect_bad_device(const char *value)
{
    moefuse_context *c = (moefuse_context *)&c;
    moefuse_status st = context_on(&c, value);
    const char *msg = moefuse_last_error(NULL);
    const char *via = by_arg ? "device" : "MOEFUSE_OPENCL_DEVICE";
    HCHECK(st == MOEFUSE_ERR_BACKEND_UNAVAILABLE, "%s %s gave %s, want BACKEND_UNAVAILABLE", via,
           value, moefuse_status_name(st));
    HCHECK(c == NULL, "%s %s: failed create left *out set", via, value);
    HCHECK(strstr(msg, via) && strstr(msg, value),
           "%s %s: message \"%s\" should name the %s and its value", via, value, msg,
           by_arg ? "argument" : "variable");
}

/* _i = 0: MOEFUSE_OPENCL_DEVICE; 1: moefuse_context_create_on's device, over the variable. */
START_TEST(t_device_selection)
{
    by_arg = _i;
    saved_env dev = env_save("MOEFUSE_OPENCL_DEVICE");
    char name[256];
    first_device_name(name, sizeof name);
    moefuse_context *c = NULL;
    HCHECK(context_on(&c, "0:0") == MOEFUSE_OK, "MOEFUSE_OPENCL_DEVICE=0:0: %s", moefuse_last_error(NULL));
    HCHECK(strncmp(moefuse_device_name(c), name, strlen(name)) == 0, "0:0 gave \"%s\", want device \"%s\"",
           moefuse_device_name(c), name);
    moefuse_context_destroy(c);

    /* a piece of the name in the other case: matched case-insensitively */
    char part[8];
    size_t n = strlen(name) < 5 ? strlen(name) : 5;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)name[i];
        part[i] = (char)(ch >= 'a' && ch <= 'z' ? ch - 32 : ch >= 'A' && ch <= 'Z' ? ch + 32 : ch);
    }
    part[n] = '\0';
    c = NULL;
    HCHECK(context_on(&c, part) == MOEFUSE_OK, "MOEFUSE_OPENCL_DEVICE=%s: %s", part, moefuse_last_error(NULL));
    HCHECK(strncmp(moefuse_device_name(c), name, strlen(name)) == 0, "\"%s\" gave \"%s\", want device \"%s\"",
           part, moefuse_device_name(c), name);
    moefuse_context_destroy(c);

    expect_bad_device("no-such-device-moefuse");
    expect_bad_device("0:999");
    expect_bad_device("999:0");
    expect_bad_device("0:"); /* not "p:d": a name that matches nothing */
    env_restore(&dev);
}
END_TEST

static int any_gpu(void)
{
    cl_platform_id plats[16];
    cl_uint np = 0, nd = 0;
    if (clGetPlatformIDs(16, plats, &np) != CL_SUCCESS) return 0;
    for (cl_uint p = 0; p < np && p < 16; p++)
        if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_GPU, 0, NULL, &nd) == CL_SUCCESS && nd > 0) return 1;
    return 0;
}

/* auto takes OpenCL only for a GPU (a CPU device such as PoCL is slower than the cpu backend). */
START_TEST(t_auto_needs_gpu)
{
    moefuse_context *c = NULL;
    HCHECK(moefuse_context_create(&c, "auto") == MOEFUSE_OK, "auto: %s", moefuse_last_error(NULL));
    const char *be = moefuse_backend_name(c);
    if (any_gpu())
        HCHECK(strcmp(be, "cpu") != 0, "auto chose cpu although an OpenCL platform has a GPU");
    else
        HCHECK(strcmp(be, "opencl") != 0, "auto chose opencl without a GPU (%s)", moefuse_device_name(c));
    moefuse_context_destroy(c);
}
END_TEST

/* ------------------------------------------------------------- GEMM paths */

/* got and want made alike (twins): every element byte equal. */
static void same_elements(tbuf *got, tbuf *want, const char *what)
{
    for (size_t i = 0; i < got->total; i++)
        if (got->logical[i])
            HCHECK(got->full[i] == want->full[i], "%s: %s byte %zu is 0x%02x, %s has 0x%02x",
                   what, got->name, i - got->pad, got->full[i], want->name, want->full[i]);
}

/*
 * What the backend's README promises: the simple, tiled and wide GEMM paths give
 * the same bits (the matrix-vector path adds in its own order), with invalid ids,
 * biases, an expert map, a padded x, both outputs of the final. The rows start at
 * multiples of 8 elements (K and I multiples of 8, x padded by 8), so that `wide` runs
 * its own kernels rather than the 64-slot tiles it falls back to.
 */
static void paths_agree(const char *other)
{
    const char *const paths[2] = {"simple", other};
    const int64_t M = 7, E = 5, Eg = 7, k = 2, K = 304, I = 72;
    saved_env sv = env_save("MOEFUSE_OPENCL_GEMM");
    moefuse_context *outer = g_ctx, *c[2];
    for (int i = 0; i < 2; i++) {
        setenv("MOEFUSE_OPENCL_GEMM", paths[i], 1);
        moefuse_status st = moefuse_context_create(&c[i], "opencl");
        HCHECK(st == MOEFUSE_OK, "context with %s: %s", paths[i], moefuse_last_error(NULL));
    }
    env_restore(&sv);
    g_ctx = c[0]; /* tb_new allocates in g_ctx; the twins live in c[1] */
    tbuf *all[11] = {
        tb_new2("x", MOEFUSE_BF16, M, K, 8, 1),          tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1),
        tb_new3("w2", MOEFUSE_BF16, E, K, I, 0, 1),      tb_new2("b1", MOEFUSE_F32, E, 2 * I, 0, 1),
        tb_new2("b2", MOEFUSE_F32, E, K, 0, 1),          tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1),
        tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1), tb_new1("expert_map", MOEFUSE_I32, Eg, 1),
        tb_new3("h", MOEFUSE_BF16, M, k, I, 0, 0),       tb_new3("y", MOEFUSE_F32, M, k, K, 0, 0),
        tb_new2("out", MOEFUSE_BF16, M, K, 0, 0)};
    tb_fill_unif(all[0], -2, 2);
    tb_fill_unif(all[1], -0.2, 0.2);
    tb_fill_unif(all[2], -0.2, 0.2);
    tb_fill_unif(all[3], -1, 1);
    tb_fill_unif(all[4], -1, 1);
    tb_fill_unif(all[6], 0, 1);
    for (int64_t g = 0; g < Eg; g++) /* 1 and 4 unmapped, 6 maps outside [0, E) */
        tb_set(all[7], g, 0, 0, g == 1 || g == 4 ? -1 : (g == 6 ? (double)E : (double)(g % E)));
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++)
            tb_set(all[5], m, j, 0, (double)h_randint(-1, Eg));
    tbuf *twin[11];
    for (int i = 0; i < 11; i++) {
        twin[i] = tb_twin(all[i], c[1]);
        tb_upload(all[i]);
    }
    const moefuse_moe_options o = {.activation = MOEFUSE_ACT_SILU, .order = MOEFUSE_GATE_FIRST};
    for (int i = 0; i < 2; i++) {
        tbuf *const *t = i ? twin : all;
        moefuse_routing r;
        memset(&r, 0, sizeof r);
        r.topk_ids = t[5]->t;
        r.topk_weights = t[6]->t;
        r.expert_map = t[7]->t;
        moefuse_status st = moefuse_moe_gate(c[i], T(t[0]), T(t[1]), T(t[3]), &r, T(t[8]), &o);
        if (st == MOEFUSE_OK)
            st = moefuse_moe_final(c[i], T(t[8]), T(t[2]), T(t[4]), &r, T(t[9]), &o);
        if (st == MOEFUSE_OK)
            st = moefuse_moe_forward(c[i], T(t[0]), T(t[1]), T(t[2]), T(t[3]), T(t[4]), &r,
                                     T(t[10]), &o);
        HCHECK(st == MOEFUSE_OK, "%s: %s", paths[i], moefuse_last_error(c[i]));
    }
    h_check_all(0);
    for (int i = 8; i < 11; i++)
        same_elements(twin[i], all[i], other);
    tb_free_all();
    g_ctx = outer;
    moefuse_context_destroy(c[0]);
    moefuse_context_destroy(c[1]);
}

START_TEST(t_simple_and_tiled_agree) { paths_agree("tiled"); }
END_TEST

START_TEST(t_simple_and_wide_agree) { paths_agree("wide"); }
END_TEST

int main(void)
{
    setenv("MOEFUSE_TEST_BACKEND", "opencl", 1);
    Suite *s = suite_create("opencl");
    TCase *tc = h_add_tcase(s, "opencl", h_setup, 120);
    tcase_add_loop_test(tc, t_device_selection, 0, 2);
    tcase_add_test(tc, t_auto_needs_gpu);
    opencl_handles_tests(tc);
    opencl_caller_tests(tc);
    opencl_import_tests(tc);
    tcase_add_test(tc, t_simple_and_tiled_agree);
    tcase_add_test(tc, t_simple_and_wide_agree);
    opencl_cache_tests(tc);
    return h_run(s);
}
