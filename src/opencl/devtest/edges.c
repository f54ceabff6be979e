/*
 * Development check of the OpenCL backend's plumbing: device selection,
 * wrong-device handles, the caller's queue, empty shapes and larger shapes
 * against the CPU backend. Build like compare.c:
 *   cc -std=c11 -O2 -Iinclude src/opencl/devtest/edges.c BUILD/src/libmoefuse.a \
 *      -fopenmp -lOpenCL -lm -o /tmp/mf_edges && /tmp/mf_edges
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include "moefuse.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fails;

#define EXPECT(cond, ...)                                                                         \
    do {                                                                                          \
        if (!(cond)) {                                                                            \
            fails++;                                                                              \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                           \
            printf(__VA_ARGS__);                                                                  \
            printf("\n");                                                                         \
        }                                                                                         \
    } while (0)

static moefuse_status make_ctx(moefuse_context **c, const char *backend, const char *device)
{
    if (device)
        setenv("MOEFUSE_OPENCL_DEVICE", device, 1);
    else
        unsetenv("MOEFUSE_OPENCL_DEVICE");
    return moefuse_context_create(c, backend);
}

static void device_selection(void)
{
    moefuse_context *c = NULL;
    EXPECT(make_ctx(&c, "opencl", "0:0") == MOEFUSE_OK, "p:d 0:0: %s", moefuse_last_error(NULL));
    if (c)
        printf("0:0 -> %s\n", moefuse_device_name(c));
    moefuse_context_destroy(c);
    EXPECT(make_ctx(&c, "opencl", "PTHREAD") == MOEFUSE_OK, "name substring: %s",
           moefuse_last_error(NULL));
    moefuse_context_destroy(c);
    moefuse_status st = make_ctx(&c, "opencl", "no-such-device");
    EXPECT(st == MOEFUSE_ERR_BACKEND_UNAVAILABLE, "bad name gave %s", moefuse_status_name(st));
    printf("bad name -> %s\n", moefuse_last_error(NULL));
    st = make_ctx(&c, "opencl", "0:9");
    EXPECT(st == MOEFUSE_ERR_BACKEND_UNAVAILABLE, "bad index gave %s", moefuse_status_name(st));
    printf("bad index -> %s\n", moefuse_last_error(NULL));
    EXPECT(make_ctx(&c, "auto", NULL) == MOEFUSE_OK, "auto");
    printf("auto (no GPU here) -> %s\n", moefuse_backend_name(c));
    moefuse_context_destroy(c);
    printf("built: %s\n", moefuse_built_backends());
}

static void wrong_device_and_queue(void)
{
    moefuse_context *cpu = NULL, *ocl = NULL, *ocl2 = NULL;
    make_ctx(&cpu, "cpu", NULL);
    make_ctx(&ocl, "opencl", NULL);
    make_ctx(&ocl2, "opencl", NULL);
    void *hb = NULL, *ob = NULL, *ob2 = NULL;
    moefuse_buffer_alloc(cpu, 4096, &hb);
    moefuse_buffer_alloc(ocl, 4096, &ob);
    moefuse_buffer_alloc(ocl2, 4096, &ob2);
    memset(hb, 0, 4096);
    int64_t shx[2] = {4, 256}, shq[2] = {4, 128}, shs[2] = {4, 1};
    moefuse_tensor x = moefuse_tensor_dense(hb, MOEFUSE_F32, 2, shx);
    moefuse_tensor q = moefuse_tensor_dense(ob, MOEFUSE_F8_E4M3, 2, shq);
    moefuse_tensor s = moefuse_tensor_dense(ob, MOEFUSE_F32, 2, shs);
    s.offset = 1024;
    moefuse_status st = moefuse_act_quant(ocl, &x, NULL, &q, &s, NULL);
    EXPECT(st == MOEFUSE_ERR_WRONG_DEVICE, "host pointer gave %s", moefuse_status_name(st));
    printf("host pointer -> %s\n", moefuse_last_error(ocl));
    x.data = ob2;
    st = moefuse_act_quant(ocl, &x, NULL, &q, &s, NULL);
    EXPECT(st == MOEFUSE_ERR_WRONG_DEVICE, "other context gave %s", moefuse_status_name(st));
    char tmp[16];
    st = moefuse_buffer_read(ocl, hb, 0, tmp, 16);
    EXPECT(st == MOEFUSE_ERR_WRONG_DEVICE, "buffer_read of a host pointer gave %s",
           moefuse_status_name(st));
    st = moefuse_buffer_read(ocl, ob, 4090, tmp, 16);
    EXPECT(st == MOEFUSE_ERR_BACKEND_FAILURE, "read past the end gave %s", moefuse_status_name(st));
    printf("read past end -> %s\n", moefuse_last_error(ocl));

    /* the caller's queue on our context, then one of another context */
    cl_context cc = NULL, cc2 = NULL;
    cl_device_id dev = NULL;
    clGetMemObjectInfo((cl_mem)ob, CL_MEM_CONTEXT, sizeof cc, &cc, NULL);
    clGetMemObjectInfo((cl_mem)ob2, CL_MEM_CONTEXT, sizeof cc2, &cc2, NULL);
    clGetContextInfo(cc, CL_CONTEXT_DEVICES, sizeof dev, &dev, NULL);
    cl_int e;
    cl_command_queue mine = clCreateCommandQueue(cc, dev, 0, &e);
    cl_command_queue other = clCreateCommandQueue(cc2, dev, 0, &e);
    EXPECT(moefuse_set_stream(ocl, mine) == MOEFUSE_OK, "set_stream(own context): %s",
           moefuse_last_error(ocl));
    x.data = ob;
    x.offset = 2048;
    float ones[256 * 2];
    for (int i = 0; i < 512; i++)
        ones[i] = 1.0f;
    moefuse_buffer_write(ocl, ob, 2048, ones, sizeof ones - 1024);
    int64_t sx1[2] = {1, 256}, sq1[2] = {1, 128}, ss1[2] = {1, 1};
    moefuse_tensor x1 = moefuse_tensor_dense(ob, MOEFUSE_F32, 2, sx1);
    x1.offset = 2048;
    moefuse_tensor q1 = moefuse_tensor_dense(ob, MOEFUSE_F8_E4M3, 2, sq1);
    moefuse_tensor s1 = moefuse_tensor_dense(ob, MOEFUSE_F32, 2, ss1);
    s1.offset = 1024;
    EXPECT(moefuse_act_quant(ocl, &x1, NULL, &q1, &s1, NULL) == MOEFUSE_OK, "act_quant on caller queue: %s",
           moefuse_last_error(ocl));
    EXPECT(moefuse_synchronize(ocl) == MOEFUSE_OK, "synchronize");
    unsigned char code;
    moefuse_buffer_read(ocl, ob, 0, &code, 1);
    EXPECT(code == 0x7E, "silu(1)*1 quantized alone should be 448 (0x7e), got %02x", code);
    st = moefuse_set_stream(ocl, other);
    EXPECT(st == MOEFUSE_ERR_WRONG_DEVICE, "foreign queue gave %s", moefuse_status_name(st));
    EXPECT(moefuse_set_stream(ocl, NULL) == MOEFUSE_OK, "set_stream(NULL)");
    clReleaseCommandQueue(mine);
    clReleaseCommandQueue(other);

    /* empty shapes: nothing to launch, still OK */
    int64_t z2[2] = {0, 256}, zq[2] = {0, 128}, zs[2] = {0, 1};
    moefuse_tensor xz = moefuse_tensor_dense(ob, MOEFUSE_F32, 2, z2);
    moefuse_tensor qz = moefuse_tensor_dense(ob, MOEFUSE_F8_E4M3, 2, zq);
    moefuse_tensor sz = moefuse_tensor_dense(ob, MOEFUSE_F32, 2, zs);
    st = moefuse_act_quant(ocl, &xz, NULL, &qz, &sz, NULL);
    printf("T = 0 act_quant -> %s %s\n", moefuse_status_name(st), moefuse_last_error(ocl));
    moefuse_buffer_free(ocl, hb); /* not ours: ignored */
    moefuse_buffer_free(cpu, hb);
    moefuse_buffer_free(ocl, ob);
    moefuse_context_destroy(cpu);
    moefuse_context_destroy(ocl);
    moefuse_context_destroy(ocl2); /* ob2 never freed: released with the context */
}

int main(void)
{
    device_selection();
    wrong_device_and_queue();
    printf("%s (%d failures)\n", fails ? "FAILED" : "ok", fails);
    return fails != 0;
}
