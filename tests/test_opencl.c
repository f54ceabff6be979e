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
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/fault.h" /* mf_fault_arm: adoption's failure paths */
#include "harness.h"

/* ------------------------------------------------------------ environment */

typedef struct {
    const char *name;
    char *value; /* NULL: was unset */
} saved_env;

static saved_env env_save(const char *name)
{
    const char *v = getenv(name);
    saved_env s = {name, v ? strdup(v) : NULL};
    return s;
}

static void env_restore(saved_env *s)
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

/* --------------------------------------------------------- foreign handles */

static tbuf *X, *Q, *SC;

/* act_quant operands on g_ctx: x [4, 256] f32, q [4, 128] f8, scales [4, 1] f32 */
static void operands(void)
{
    X = tb_new2("x", MOEFUSE_F32, 4, 256, 0, 1);
    tb_fill_unif(X, -2, 2);
    tb_upload(X);
    Q = tb_new2("q", MOEFUSE_F8_E4M3, 4, 128, 0, 0);
    SC = tb_new2("scales", MOEFUSE_F32, 4, 1, 0, 0);
}

/* The call fails with WRONG_DEVICE, names the operand, and writes nothing. */
static void expect_wrong_device(moefuse_status st, const char *operand, const char *desc)
{
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", moefuse_last_error(g_ctx));
    h_check_all(1);
    HCHECK(st == MOEFUSE_ERR_WRONG_DEVICE, "%s: %s (%s), want WRONG_DEVICE", desc, moefuse_status_name(st),
           msg);
    if (operand)
        HCHECK(strstr(msg, operand) != NULL, "%s: message \"%s\" does not name %s", desc, msg, operand);
}

START_TEST(t_wrong_device)
{
    operands();
    moefuse_context *other = NULL, *cpu = NULL;
    HCHECK(moefuse_context_create(&other, "opencl") == MOEFUSE_OK, "second context: %s",
           moefuse_last_error(NULL));
    HCHECK(moefuse_context_create(&cpu, "cpu") == MOEFUSE_OK, "cpu context: %s", moefuse_last_error(NULL));
    void *foreign = NULL, *host_buf = NULL;
    HCHECK(moefuse_buffer_alloc(other, 8192, &foreign) == MOEFUSE_OK, "alloc: %s", moefuse_last_error(other));
    HCHECK(moefuse_buffer_alloc(cpu, 8192, &host_buf) == MOEFUSE_OK, "alloc: %s", moefuse_last_error(cpu));
    unsigned char before[8192], after[8192];
    memset(before, 0x5A, sizeof before);
    HCHECK(moefuse_buffer_write(other, foreign, 0, before, sizeof before) == MOEFUSE_OK, "write");
    static float host_array[4 * 256];

    moefuse_tensor t = X->t;
    t.data = host_array;
    t.offset = 0;
    expect_wrong_device(moefuse_act_quant(g_ctx, &t, NULL, T(Q), T(SC), NULL), "x", "x in host memory");
    t.data = host_buf;
    expect_wrong_device(moefuse_act_quant(g_ctx, &t, NULL, T(Q), T(SC), NULL), "x", "x from a cpu context");
    t.data = foreign;
    expect_wrong_device(moefuse_act_quant(g_ctx, &t, NULL, T(Q), T(SC), NULL), "x",
                        "x from another opencl context");
    t = Q->t;
    t.data = foreign;
    t.offset = 0;
    expect_wrong_device(moefuse_act_quant(g_ctx, T(X), NULL, &t, T(SC), NULL), "q",
                        "q from another opencl context");
    t = SC->t;
    t.data = host_array;
    t.offset = 0;
    expect_wrong_device(moefuse_act_quant(g_ctx, T(X), NULL, T(Q), &t, NULL), "scales",
                        "scales in host memory");

    char tmp[16] = {0};
    expect_wrong_device(moefuse_buffer_read(g_ctx, foreign, 0, tmp, sizeof tmp), NULL,
                        "buffer_read of a foreign handle");
    expect_wrong_device(moefuse_buffer_write(g_ctx, foreign, 0, tmp, sizeof tmp), NULL,
                        "buffer_write of a foreign handle");
    expect_wrong_device(moefuse_buffer_read(g_ctx, host_array, 0, tmp, sizeof tmp), NULL,
                        "buffer_read of a host pointer");
    /* freeing what is not ours is ignored, and leaves it usable where it belongs */
    HCHECK(moefuse_buffer_free(g_ctx, foreign) == MOEFUSE_OK, "buffer_free(foreign): %s",
           moefuse_last_error(g_ctx));
    HCHECK(moefuse_buffer_read(other, foreign, 0, after, sizeof after) == MOEFUSE_OK, "read back: %s",
           moefuse_last_error(other));
    HCHECK(memcmp(before, after, sizeof before) == 0, "the other context's buffer changed");
    /* and the right operands still work */
    HCHECK(CALL(moefuse_act_quant(g_ctx, T(X), NULL, T(Q), T(SC), NULL)) == MOEFUSE_OK, "act_quant: %s",
           moefuse_last_error(g_ctx));
    moefuse_buffer_free(cpu, host_buf);
    moefuse_context_destroy(cpu);
    moefuse_context_destroy(other); /* frees `foreign` */
}
END_TEST

/* Copies past the end of a buffer fail with the OpenCL call named, and write nothing. */
START_TEST(t_buffer_bounds)
{
    void *buf = NULL;
    unsigned char init[64], data[32], out[32];
    memset(init, 0x11, sizeof init);
    memset(data, 0x22, sizeof data);
    memset(out, 0x33, sizeof out);
    HCHECK(moefuse_buffer_alloc(g_ctx, sizeof init, &buf) == MOEFUSE_OK, "alloc: %s",
           moefuse_last_error(g_ctx));
    HCHECK(moefuse_buffer_write(g_ctx, buf, 0, init, sizeof init) == MOEFUSE_OK, "write: %s",
           moefuse_last_error(g_ctx));
    moefuse_status st = moefuse_buffer_read(g_ctx, buf, 48, out, sizeof out);
    HCHECK(st == MOEFUSE_ERR_BACKEND_FAILURE && strstr(moefuse_last_error(g_ctx), "clEnqueueReadBuffer"),
           "read past the end gave %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    for (size_t i = 0; i < sizeof out; i++)
        HCHECK(out[i] == 0x33, "a read past the end wrote into its destination");
    st = moefuse_buffer_write(g_ctx, buf, 48, data, sizeof data);
    HCHECK(st == MOEFUSE_ERR_BACKEND_FAILURE && strstr(moefuse_last_error(g_ctx), "clEnqueueWriteBuffer"),
           "write past the end gave %s (%s)", moefuse_status_name(st), moefuse_last_error(g_ctx));
    unsigned char back[64];
    HCHECK(moefuse_buffer_read(g_ctx, buf, 0, back, sizeof back) == MOEFUSE_OK, "read: %s",
           moefuse_last_error(g_ctx));
    HCHECK(memcmp(back, init, sizeof init) == 0, "a write past the end changed the buffer");
    moefuse_buffer_free(g_ctx, buf);
}
END_TEST

/* ------------------------------------------------------------ caller's queue */

static cl_command_queue current_queue(void)
{
    void *q = NULL;
    HCHECK(moefuse_get_stream(g_ctx, &q) == MOEFUSE_OK, "get_stream: %s", moefuse_last_error(g_ctx));
    return q;
}

/* quant of x [4, 256] itself (no activation), G = 128 */
static moefuse_status quant_x(tbuf *q, tbuf *sc)
{
    moefuse_quant_options o = {0};
    return moefuse_quant(g_ctx, T(X), T(q), T(sc), &o);
}

/* Work the caller enqueues on its queue runs before moefuse's next call on it. */
static void check_order_on(cl_command_queue mine, tbuf *q, tbuf *sc)
{
    for (int64_t t = 0; t < 4; t++)
        for (int64_t c = 0; c < 256; c++) tb_set(X, t, c, 0, h_unif(-300, 300));
    cl_int e = clEnqueueWriteBuffer(mine, (cl_mem)X->buf, CL_FALSE, 0, X->total, X->full, 0, NULL, NULL);
    HCHECK(e == CL_SUCCESS, "clEnqueueWriteBuffer: %d", (int)e);
    moefuse_status st = quant_x(q, sc); /* no wait in between: the queue orders them */
    HCHECK(st == MOEFUSE_OK, "quant on the caller's queue: %s", moefuse_last_error(g_ctx));
    HCHECK(moefuse_synchronize(g_ctx) == MOEFUSE_OK, "synchronize: %s", moefuse_last_error(g_ctx));
    tb_upload(X); /* the same bytes again, so the canary check knows them */
    h_check_all(0);
    unsigned char *first = malloc(q->total);
    memcpy(first, q->full, q->total);
    HCHECK(CALL(quant_x(q, sc)) == MOEFUSE_OK, "quant: %s", moefuse_last_error(g_ctx));
    int same = memcmp(first, q->full, q->total) == 0;
    free(first);
    HCHECK(same, "quant enqueued after the caller's write did not see the written x");
}

START_TEST(t_caller_queue)
{
    operands();
    tbuf *q = tb_new2("q256", MOEFUSE_F8_E4M3, 4, 256, 0, 0), *sc = tb_new2("s256", MOEFUSE_F32, 4, 2, 0, 0);
    cl_command_queue own = current_queue();
    HCHECK(own != NULL, "get_stream gave NULL on opencl");
    cl_context clctx = NULL;
    cl_device_id dev = NULL;
    HCHECK(clGetCommandQueueInfo(own, CL_QUEUE_CONTEXT, sizeof clctx, &clctx, NULL) == CL_SUCCESS &&
               clGetCommandQueueInfo(own, CL_QUEUE_DEVICE, sizeof dev, &dev, NULL) == CL_SUCCESS,
           "clGetCommandQueueInfo on the context's queue failed");
    cl_int e;
    cl_command_queue mine = clCreateCommandQueue(clctx, dev, 0, &e);
    HCHECK(e == CL_SUCCESS, "clCreateCommandQueue: %d", (int)e);
    HCHECK(moefuse_set_stream(g_ctx, mine) == MOEFUSE_OK, "set_stream(in-order queue): %s",
           moefuse_last_error(g_ctx));
    HCHECK(current_queue() == mine, "get_stream does not return the queue set");
    clReleaseCommandQueue(mine); /* the context holds its own reference until the queue is replaced */
    check_order_on(mine, q, sc);

    /* an out-of-order queue is refused, and the one in use stays */
    cl_command_queue_properties props = 0;
    clGetDeviceInfo(dev, CL_DEVICE_QUEUE_PROPERTIES, sizeof props, &props, NULL);
    if (props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) {
        cl_command_queue ooo = clCreateCommandQueue(clctx, dev, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &e);
        HCHECK(e == CL_SUCCESS, "clCreateCommandQueue(out of order): %d", (int)e);
        moefuse_status st = moefuse_set_stream(g_ctx, ooo);
        HCHECK(st == MOEFUSE_ERR_INVALID_ARGUMENT && strstr(moefuse_last_error(g_ctx), "out-of-order"),
               "set_stream(out-of-order queue) gave %s (%s)", moefuse_status_name(st),
               moefuse_last_error(g_ctx));
        HCHECK(current_queue() == mine, "a refused queue replaced the one in use");
        clReleaseCommandQueue(ooo);
    } else {
        fprintf(stderr, "note: this device has no out-of-order queues; their refusal is not tested\n");
    }

    /* a queue of another cl_context on the same device */
    cl_platform_id plat = NULL;
    clGetDeviceInfo(dev, CL_DEVICE_PLATFORM, sizeof plat, &plat, NULL);
    cl_context_properties cp[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)plat, 0};
    cl_context ctx2 = clCreateContext(cp, 1, &dev, NULL, NULL, &e);
    HCHECK(e == CL_SUCCESS, "clCreateContext: %d", (int)e);
    cl_command_queue stranger = clCreateCommandQueue(ctx2, dev, 0, &e);
    HCHECK(e == CL_SUCCESS, "clCreateCommandQueue: %d", (int)e);
    moefuse_status st = moefuse_set_stream(g_ctx, stranger);
    HCHECK(st == MOEFUSE_ERR_WRONG_DEVICE, "set_stream(queue of another cl_context) gave %s",
           moefuse_status_name(st));
    HCHECK(current_queue() == mine, "a refused queue replaced the one in use");
    clReleaseCommandQueue(stranger);
    clReleaseContext(ctx2);

    HCHECK(moefuse_set_stream(g_ctx, NULL) == MOEFUSE_OK, "set_stream(NULL): %s", moefuse_last_error(g_ctx));
    HCHECK(current_queue() == own, "set_stream(NULL) did not restore the context's own queue");
    HCHECK(CALL(quant_x(q, sc)) == MOEFUSE_OK, "quant on the own queue again: %s", moefuse_last_error(g_ctx));
}
END_TEST

/* ------------------------------------------- the caller's cl_context, queue and cl_mem */

/* OpenCL objects an engine made itself, on the device of g_ctx (MOEFUSE_OPENCL_DEVICE's). */
typedef struct caller_cl {
    cl_platform_id platform;
    cl_device_id device;
    cl_context context;
    cl_command_queue queue; /* in-order */
} caller_cl;

static caller_cl caller_open(void)
{
    caller_cl c;
    memset(&c, 0, sizeof c);
    HCHECK(clGetCommandQueueInfo(current_queue(), CL_QUEUE_DEVICE, sizeof c.device, &c.device,
                                 NULL) == CL_SUCCESS &&
               clGetDeviceInfo(c.device, CL_DEVICE_PLATFORM, sizeof c.platform, &c.platform,
                               NULL) == CL_SUCCESS,
           "cannot find g_ctx's device");
    cl_context_properties cp[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)c.platform, 0};
    cl_int e;
    c.context = clCreateContext(cp, 1, &c.device, NULL, NULL, &e);
    HCHECK(e == CL_SUCCESS, "clCreateContext: %d", (int)e);
    c.queue = clCreateCommandQueue(c.context, c.device, 0, &e);
    HCHECK(e == CL_SUCCESS, "clCreateCommandQueue: %d", (int)e);
    return c;
}

static void caller_close(caller_cl *c)
{
    clReleaseCommandQueue(c->queue);
    clReleaseContext(c->context);
}

/* Reference counts of the caller's context and queue (unless c is NULL) and of one cl_mem
 * (unless m is NULL); what is not asked stays 0. */
typedef struct ref_counts {
    cl_uint context, queue, mem;
} ref_counts;

static ref_counts counts_now(const caller_cl *c, cl_mem m)
{
    ref_counts n = {0, 0, 0};
    cl_int e = CL_SUCCESS;
    if (c) {
        e = clGetContextInfo(c->context, CL_CONTEXT_REFERENCE_COUNT, sizeof n.context, &n.context,
                             NULL);
        if (e == CL_SUCCESS)
            e = clGetCommandQueueInfo(c->queue, CL_QUEUE_REFERENCE_COUNT, sizeof n.queue,
                                      &n.queue, NULL);
    }
    if (m && e == CL_SUCCESS)
        e = clGetMemObjectInfo(m, CL_MEM_REFERENCE_COUNT, sizeof n.mem, &n.mem, NULL);
    HCHECK(e == CL_SUCCESS, "a *_REFERENCE_COUNT query failed: %d", (int)e);
    return n;
}

static bool counts_equal(ref_counts a, ref_counts b)
{
    return a.context == b.context && a.queue == b.queue && a.mem == b.mem;
}

static void sleep_ms(long ms)
{
    struct timespec t = {ms / 1000, ms % 1000 * 1000000L};
    nanosleep(&t, NULL);
}

/*
 * The counts once PoCL has let go of finished commands: it drops a command's references (to
 * its queue, its buffers) from its own threads a moment after clFinish returns, and while a
 * buffer lives its last command keeps the queue. So compare only where no buffer of the
 * caller's has seen a command since the baseline, and wait (up to 2 s) until the counts equal
 * *want, or without want until they stay the same for 20 ms. A reference kept for good never
 * comes back: expect_counts then fails.
 */
static ref_counts counts_settled(const caller_cl *c, cl_mem m, const ref_counts *want)
{
    ref_counts now = counts_now(c, m);
    for (int waited = 0, steady = 0; waited < 2000; waited++) {
        if (want ? counts_equal(now, *want) : steady >= 20)
            break;
        sleep_ms(1);
        const ref_counts next = counts_now(c, m);
        steady = counts_equal(next, now) ? steady + 1 : 0;
        now = next;
    }
    return now;
}

static void expect_counts(const caller_cl *c, cl_mem m, ref_counts want, const char *what)
{
    const ref_counts got = counts_settled(c, m, &want);
    HCHECK(counts_equal(got, want),
           "%s: references of the caller's cl_context %u, queue %u, cl_mem %u; want %u, %u, %u "
           "(0: not counted)",
           what, got.context, got.queue, got.mem, want.context, want.queue, want.mem);
}

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

static caller_mem caller_mem_new(const caller_cl *c, size_t payload, bool sub)
{
    caller_mem m;
    memset(&m, 0, sizeof m);
    cl_uint align_bits = 0;
    clGetDeviceInfo(c->device, CL_DEVICE_MEM_BASE_ADDR_ALIGN, sizeof align_bits, &align_bits,
                    NULL);
    const size_t align = align_bits >= 8 ? align_bits / 8 : 1;
    m.size = payload + 2 * CANARY;
    m.origin = sub ? 2 * align : 0;
    m.total = m.origin + m.size + (sub ? align : 0);
    cl_int e;
    m.parent = clCreateBuffer(c->context, CL_MEM_READ_WRITE, m.total, NULL, &e);
    HCHECK(e == CL_SUCCESS, "clCreateBuffer(%zu): %d", m.total, (int)e);
    m.mem = m.parent;
    if (sub) {
        cl_buffer_region region = {m.origin, m.size};
        m.mem = clCreateSubBuffer(m.parent, CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION,
                                  &region, &e);
        HCHECK(e == CL_SUCCESS, "clCreateSubBuffer(origin %zu, %zu bytes): %d", m.origin, m.size,
               (int)e);
    }
    m.bytes = malloc(m.total);
    for (size_t i = 0; i < m.total; i++)
        m.bytes[i] = (unsigned char)(0xC3 ^ (i * 29));
    e = clEnqueueWriteBuffer(c->queue, m.parent, CL_TRUE, 0, m.total, m.bytes, 0, NULL, NULL);
    HCHECK(e == CL_SUCCESS, "clEnqueueWriteBuffer: %d", (int)e);
    return m;
}

/* An input: `bytes` of src at the tensor's place, written through the caller's queue. */
static void caller_mem_put(const caller_cl *c, caller_mem *m, const void *src, size_t bytes)
{
    memcpy(m->bytes + m->origin + CANARY, src, bytes);
    cl_int e = clEnqueueWriteBuffer(c->queue, m->mem, CL_TRUE, CANARY, bytes, src, 0, NULL, NULL);
    HCHECK(e == CL_SUCCESS, "clEnqueueWriteBuffer: %d", (int)e);
}

/*
 * Reads the whole parent back through the caller's queue (in order after moefuse's work on it,
 * without a moefuse_synchronize): every byte but the `written` ones at the tensor's place must
 * be as before; those go to out (when not NULL) and become the known bytes.
 */
static void caller_mem_check(const caller_cl *c, caller_mem *m, size_t written, void *out,
                             const char *what)
{
    unsigned char *now = malloc(m->total);
    cl_int e = clEnqueueReadBuffer(c->queue, m->parent, CL_TRUE, 0, m->total, now, 0, NULL, NULL);
    HCHECK(e == CL_SUCCESS, "%s: clEnqueueReadBuffer: %d", what, (int)e);
    const size_t lo = m->origin + CANARY, hi = lo + written;
    for (size_t i = 0; i < m->total; i++)
        HCHECK((i >= lo && i < hi) || now[i] == m->bytes[i],
               "%s: byte %zu of the caller's buffer changed (0x%02x, was 0x%02x); the tensor "
               "lies at [%zu, %zu)",
               what, i, now[i], m->bytes[i], lo, hi);
    if (out)
        memcpy(out, now + lo, written);
    memcpy(m->bytes + lo, now + lo, written);
    free(now);
}

static void caller_mem_free(caller_mem *m)
{
    if (m->mem != m->parent)
        clReleaseMemObject(m->mem);
    clReleaseMemObject(m->parent);
    free(m->bytes);
}

/* act_quant (x [5, 512] f32 -> q [5, 256] f8, scales [5, 2]) and moe_gate (x [6, 64] f32,
 * w1 [4, 64, 64], ids [6, 2] with invalid slots, h [6, 2, 32] f32): the operands, in order. */
enum { OP_X, OP_Q, OP_SC, OP_MX, OP_W1, OP_IDS, OP_H, OP_COUNT };
enum { AQ_T = 5, AQ_H = 256, MG_M = 6, MG_K = 64, MG_I = 32, MG_E = 4, MG_TOPK = 2 };
static const size_t op_bytes[OP_COUNT] = {
    AQ_T * 2 * AQ_H * 4, AQ_T * AQ_H, AQ_T * (AQ_H / 128) * 4,  MG_M * MG_K * 4,
    MG_E * 2 * MG_I * MG_K * 4, MG_M * MG_TOPK * 4, MG_M * MG_TOPK * MG_I * 4};
static const bool op_output[OP_COUNT] = {false, true, true, false, false, false, true};

/* Host bytes of the inputs (outputs: NULL), freed by free_ops. */
static void make_inputs(unsigned char *in[OP_COUNT])
{
    for (int i = 0; i < OP_COUNT; i++) {
        in[i] = op_output[i] ? NULL : malloc(op_bytes[i]);
        if (i == OP_IDS) {
            int32_t *ids = (int32_t *)in[i];
            for (int s = 0; s < MG_M * MG_TOPK; s++)
                ids[s] = s == 3 ? -1 : s == 8 ? MG_E + 5 : (int32_t)h_randint(0, MG_E - 1);
        } else if (in[i]) {
            float *f = (float *)in[i];
            for (size_t j = 0; j < op_bytes[i] / 4; j++)
                f[j] = (float)h_unif(i == OP_X ? -6 : -1, i == OP_X ? 6 : 1);
        }
    }
}

static void free_ops(unsigned char *ops[OP_COUNT])
{
    for (int i = 0; i < OP_COUNT; i++)
        free(ops[i]);
}

static moefuse_tensor op_tensor(void *const buf[OP_COUNT], int op, int64_t offset)
{
    static const int32_t rank[OP_COUNT] = {2, 2, 2, 2, 3, 2, 3};
    static const moefuse_dtype dt[OP_COUNT] = {MOEFUSE_F32, MOEFUSE_F8_E4M3, MOEFUSE_F32,
                                               MOEFUSE_F32, MOEFUSE_F32, MOEFUSE_I32,
                                               MOEFUSE_F32};
    static const int64_t shape[OP_COUNT][3] = {
        {AQ_T, 2 * AQ_H}, {AQ_T, AQ_H}, {AQ_T, AQ_H / 128}, {MG_M, MG_K},
        {MG_E, 2 * MG_I, MG_K}, {MG_M, MG_TOPK}, {MG_M, MG_TOPK, MG_I}};
    moefuse_tensor t = moefuse_tensor_dense(buf[op], dt[op], rank[op], shape[op]);
    t.offset = offset;
    return t;
}

/* Both calls on ctx with operand i at byte `offset` of buf[i]. */
static moefuse_status run_ops(moefuse_context *ctx, void *const buf[OP_COUNT], int64_t offset)
{
    moefuse_tensor t[OP_COUNT];
    for (int i = 0; i < OP_COUNT; i++)
        t[i] = op_tensor(buf, i, offset);
    moefuse_status st = moefuse_act_quant(ctx, &t[OP_X], NULL, &t[OP_Q], &t[OP_SC], NULL);
    if (st != MOEFUSE_OK)
        return st;
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = t[OP_IDS];
    return moefuse_moe_gate(ctx, &t[OP_MX], &t[OP_W1], NULL, &r, &t[OP_H], NULL);
}

/* The outputs of run_ops on ctx over buffers of its own (moefuse_buffer_alloc). */
static void outputs_on(moefuse_context *ctx, unsigned char *const in[OP_COUNT],
                       unsigned char *out[OP_COUNT])
{
    void *buf[OP_COUNT];
    for (int i = 0; i < OP_COUNT; i++) {
        HCHECK(moefuse_buffer_alloc(ctx, op_bytes[i], &buf[i]) == MOEFUSE_OK, "alloc: %s",
               moefuse_last_error(ctx));
        if (in[i])
            HCHECK(moefuse_buffer_write(ctx, buf[i], 0, in[i], op_bytes[i]) == MOEFUSE_OK,
                   "write: %s", moefuse_last_error(ctx));
    }
    HCHECK(run_ops(ctx, buf, 0) == MOEFUSE_OK, "%s: %s", moefuse_backend_name(ctx),
           moefuse_last_error(ctx));
    for (int i = 0; i < OP_COUNT; i++) {
        out[i] = NULL;
        if (op_output[i]) {
            out[i] = malloc(op_bytes[i]);
            HCHECK(moefuse_buffer_read(ctx, buf[i], 0, out[i], op_bytes[i]) == MOEFUSE_OK,
                   "read: %s", moefuse_last_error(ctx));
        }
        moefuse_buffer_free(ctx, buf[i]);
    }
}

static const char *const op_names[OP_COUNT] = {"x", "q", "scales", "moe x", "w1", "topk_ids",
                                               "h"};

static void same_bytes(const void *got, const void *want, size_t n, const char *what)
{
    const unsigned char *g = got, *w = want;
    for (size_t i = 0; i < n; i++)
        HCHECK(g[i] == w[i], "%s: byte %zu is 0x%02x, want 0x%02x", what, i, g[i], w[i]);
}

/* A context over the caller's cl_context and queue, fetched from it. */
static moefuse_context *adopt(const caller_cl *c)
{
    moefuse_context *ctx = NULL;
    moefuse_status st = moefuse_context_create_opencl(&ctx, c->context, c->queue);
    HCHECK(st == MOEFUSE_OK && ctx, "context_create_opencl: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(NULL));
    return ctx;
}

static void import_ok(moefuse_context *ctx, cl_mem m, const char *what)
{
    moefuse_status st = moefuse_buffer_import(ctx, m);
    HCHECK(st == MOEFUSE_OK, "buffer_import(%s): %s (%s)", what, moefuse_status_name(st),
           moefuse_last_error(ctx));
}

/*
 * An adopted context computes on the caller's buffers (plain ones and sub-buffers) exactly what
 * a context of moefuse's own computes on its buffers, and the CPU backend for act_quant; it
 * runs on the caller's queue, and writes nothing outside the outputs' elements.
 */
START_TEST(t_adopted_context_computes_alike)
{
    caller_cl c = caller_open();
    moefuse_context *ctx = adopt(&c);
    HCHECK(strcmp(moefuse_backend_name(ctx), "opencl") == 0, "backend %s",
           moefuse_backend_name(ctx));
    void *q = NULL;
    HCHECK(moefuse_get_stream(ctx, &q) == MOEFUSE_OK && q == (void *)c.queue,
           "get_stream gave %p, want the caller's queue %p", q, (void *)c.queue);
    HCHECK(strstr(moefuse_device_name(ctx), "caller's cl_context") != NULL,
           "device name \"%s\" does not say the cl_context is the caller's",
           moefuse_device_name(ctx));

    unsigned char *in[OP_COUNT], *want[OP_COUNT], *got[OP_COUNT];
    make_inputs(in);
    outputs_on(g_ctx, in, want);
    caller_mem m[OP_COUNT];
    void *handles[OP_COUNT];
    for (int i = 0; i < OP_COUNT; i++) {
        /* outputs and w1 in sub-buffers, the other inputs in plain buffers */
        m[i] = caller_mem_new(&c, op_bytes[i], op_output[i] || i == OP_W1);
        if (in[i])
            caller_mem_put(&c, &m[i], in[i], op_bytes[i]);
        import_ok(ctx, m[i].mem, op_names[i]);
        handles[i] = m[i].mem;
    }
    HCHECK(run_ops(ctx, handles, CANARY) == MOEFUSE_OK, "on the caller's buffers: %s",
           moefuse_last_error(ctx));
    for (int i = 0; i < OP_COUNT; i++) {
        got[i] = op_output[i] ? malloc(op_bytes[i]) : NULL;
        caller_mem_check(&c, &m[i], op_output[i] ? op_bytes[i] : 0, got[i], op_names[i]);
        if (got[i])
            same_bytes(got[i], want[i], op_bytes[i],
                       h_fmt("%s of the adopted context vs a context of moefuse's own",
                             op_names[i]));
    }
    if (strstr(moefuse_device_name(g_ctx), "division not correctly rounded") == NULL) {
        moefuse_context *cpu = NULL;
        unsigned char *ref[OP_COUNT];
        HCHECK(moefuse_context_create(&cpu, "cpu") == MOEFUSE_OK, "cpu: %s",
               moefuse_last_error(NULL));
        outputs_on(cpu, in, ref);
        moefuse_context_destroy(cpu);
        same_bytes(got[OP_Q], ref[OP_Q], op_bytes[OP_Q], "q of the adopted context vs cpu");
        same_bytes(got[OP_SC], ref[OP_SC], op_bytes[OP_SC], "scales of the adopted context vs cpu");
        free_ops(ref);
    }
    moefuse_context_destroy(ctx);
    for (int i = 0; i < OP_COUNT; i++)
        caller_mem_free(&m[i]);
    free_ops(in);
    free_ops(want);
    free_ops(got);
    caller_close(&c);
}
END_TEST

/* A refused context_create_opencl: the status, *out NULL, the argument named, no reference
 * kept. */
static void expect_adopt_refused(void *context, void *queue, moefuse_status want,
                                 const char *needle, const char *what)
{
    moefuse_context *ctx = (moefuse_context *)&ctx;
    moefuse_status st = moefuse_context_create_opencl(&ctx, context, queue);
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == want, "%s: %s (%s), want %s", what, moefuse_status_name(st), msg,
           moefuse_status_name(want));
    HCHECK(ctx == NULL, "%s: a refusal left *out set", what);
    HCHECK(strstr(msg, "context_create_opencl") && strstr(msg, needle),
           "%s: message \"%s\" should name the call and %s", what, msg, needle);
}

START_TEST(t_adopt_refusals)
{
    caller_cl c = caller_open(), other = caller_open();
    const ref_counts before = counts_settled(&c, NULL, NULL);
    HCHECK(moefuse_context_create_opencl(NULL, c.context, c.queue) == MOEFUSE_ERR_NULL_POINTER &&
               strstr(moefuse_last_error(NULL), "out"),
           "NULL out: %s", moefuse_last_error(NULL));
    expect_adopt_refused(NULL, c.queue, MOEFUSE_ERR_NULL_POINTER, "cl_context", "NULL cl_context");
    expect_adopt_refused(c.context, NULL, MOEFUSE_ERR_NULL_POINTER, "cl_queue", "NULL cl_queue");
    expect_adopt_refused(c.context, other.queue, MOEFUSE_ERR_WRONG_DEVICE, "cl_queue",
                         "a queue of another cl_context");
    expect_adopt_refused(other.context, c.queue, MOEFUSE_ERR_WRONG_DEVICE, "cl_queue",
                         "a cl_context other than the queue's");

    cl_command_queue_properties props = 0;
    clGetDeviceInfo(c.device, CL_DEVICE_QUEUE_PROPERTIES, sizeof props, &props, NULL);
    if (props & CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE) {
        cl_int e;
        cl_command_queue ooo =
            clCreateCommandQueue(c.context, c.device, CL_QUEUE_OUT_OF_ORDER_EXEC_MODE_ENABLE, &e);
        HCHECK(e == CL_SUCCESS, "clCreateCommandQueue(out of order): %d", (int)e);
        const caller_cl with_ooo = {c.platform, c.device, c.context, ooo};
        const ref_counts ooo_before = counts_settled(&with_ooo, NULL, NULL);
        expect_adopt_refused(c.context, ooo, MOEFUSE_ERR_INVALID_ARGUMENT, "out-of-order",
                             "an out-of-order queue");
        expect_counts(&with_ooo, NULL, ooo_before, "a refused out-of-order queue");
        clReleaseCommandQueue(ooo);
    } else {
        fprintf(stderr, "note: this device has no out-of-order queues; their refusal by "
                        "context_create_opencl is not tested\n");
    }
    expect_counts(&c, NULL, before, "after the refusals");
    caller_close(&other);
    caller_close(&c);
}
END_TEST

/* The call fails with `want`, its message names `needle`, and it wrote nothing (checked by the
 * caller's canaries). */
static void expect_status(moefuse_context *ctx, moefuse_status st, moefuse_status want,
                          const char *needle, const char *what)
{
    const char *msg = moefuse_last_error(ctx);
    HCHECK(st == want, "%s: %s (%s), want %s", what, moefuse_status_name(st), msg,
           moefuse_status_name(want));
    HCHECK(strstr(msg, needle) != NULL, "%s: message \"%s\" does not name %s", what, msg, needle);
}

/* What import accepts and refuses; tensors on imported buffers end inside CL_MEM_SIZE; one
 * reference is held, until buffer_free. */
START_TEST(t_buffer_import)
{
    caller_cl c = caller_open(), other = caller_open();
    moefuse_context *ctx = adopt(&c);
    unsigned char *in[OP_COUNT], *want[OP_COUNT];
    make_inputs(in);
    outputs_on(g_ctx, in, want);
    caller_mem x = caller_mem_new(&c, op_bytes[OP_X], false);
    caller_mem q = caller_mem_new(&c, op_bytes[OP_Q], true);
    caller_mem sc = caller_mem_new(&c, op_bytes[OP_SC], false);
    caller_mem stranger = caller_mem_new(&other, 256, false);
    caller_mem_put(&c, &x, in[OP_X], op_bytes[OP_X]);
    void *h[OP_COUNT] = {x.mem, q.mem, sc.mem};
    moefuse_tensor tx = op_tensor(h, OP_X, CANARY), tq = op_tensor(h, OP_Q, CANARY),
                   ts = op_tensor(h, OP_SC, CANARY);

    /* not imported yet: the caller's cl_mem of the same cl_context is not taken */
    expect_status(ctx, moefuse_act_quant(ctx, &tx, NULL, &tq, &ts, NULL),
                  MOEFUSE_ERR_WRONG_DEVICE, "x is not memory", "x before its import");
    expect_status(ctx, moefuse_buffer_import(ctx, NULL), MOEFUSE_ERR_NULL_POINTER, "buffer",
                  "import of NULL");
    HCHECK(moefuse_buffer_import(NULL, x.mem) == MOEFUSE_ERR_NULL_POINTER, "NULL ctx accepted");
    const ref_counts stranger_before = counts_settled(NULL, stranger.mem, NULL);
    expect_status(ctx, moefuse_buffer_import(ctx, stranger.mem), MOEFUSE_ERR_WRONG_DEVICE,
                  "cl_context", "import of a cl_mem of another cl_context");
    expect_counts(NULL, stranger.mem, stranger_before, "a refused import");
    void *theirs = NULL; /* a buffer of g_ctx: its own cl_context, not the caller's */
    HCHECK(moefuse_buffer_alloc(g_ctx, 64, &theirs) == MOEFUSE_OK, "alloc: %s",
           moefuse_last_error(g_ctx));
    expect_status(ctx, moefuse_buffer_import(ctx, theirs), MOEFUSE_ERR_WRONG_DEVICE, "cl_context",
                  "import of another moefuse context's buffer");

    cl_bool images = CL_FALSE;
    clGetDeviceInfo(c.device, CL_DEVICE_IMAGE_SUPPORT, sizeof images, &images, NULL);
    if (images) {
        cl_image_format fmt = {CL_RGBA, CL_UNORM_INT8};
        cl_image_desc desc;
        memset(&desc, 0, sizeof desc);
        desc.image_type = CL_MEM_OBJECT_IMAGE2D;
        desc.image_width = desc.image_height = 4;
        cl_int e;
        cl_mem image = clCreateImage(c.context, CL_MEM_READ_WRITE, &fmt, &desc, NULL, &e);
        HCHECK(e == CL_SUCCESS, "clCreateImage: %d", (int)e);
        expect_status(ctx, moefuse_buffer_import(ctx, image), MOEFUSE_ERR_INVALID_ARGUMENT,
                      "image", "import of an image");
        clReleaseMemObject(image);
    } else {
        fprintf(stderr, "note: this device has no images; their refusal by buffer_import is "
                        "not tested\n");
    }

    /* imported: one reference of moefuse's, however often */
    const ref_counts q_before = counts_settled(NULL, q.mem, NULL);
    ref_counts q_imported = q_before;
    q_imported.mem++;
    import_ok(ctx, x.mem, "x");
    import_ok(ctx, q.mem, "q (a sub-buffer)");
    import_ok(ctx, q.mem, "q again");
    import_ok(ctx, sc.mem, "scales");
    expect_counts(NULL, q.mem, q_imported, "q imported twice");

    /* one element past CL_MEM_SIZE: refused, nothing written; exactly at the end: computed */
    tq.offset = (int64_t)(q.size - op_bytes[OP_Q]) + 1;
    expect_status(ctx, moefuse_act_quant(ctx, &tx, NULL, &tq, &ts, NULL),
                  MOEFUSE_ERR_OUT_OF_BOUNDS, "q covers", "q one element past its sub-buffer");
    tx.offset = (int64_t)(x.size - op_bytes[OP_X]) + 4;
    tq.offset = CANARY;
    expect_status(ctx, moefuse_act_quant(ctx, &tx, NULL, &tq, &ts, NULL),
                  MOEFUSE_ERR_OUT_OF_BOUNDS, "x covers", "x one element past its buffer");
    caller_mem_check(&c, &q, 0, NULL, "q after refusals");
    caller_mem_check(&c, &sc, 0, NULL, "scales after refusals");
    caller_mem_check(&c, &x, 0, NULL, "x after refusals");
    tx.offset = CANARY;
    tq.offset = (int64_t)(q.size - op_bytes[OP_Q]);
    HCHECK(moefuse_act_quant(ctx, &tx, NULL, &tq, &ts, NULL) == MOEFUSE_OK,
           "q ending at the end of its sub-buffer: %s", moefuse_last_error(ctx));
    unsigned char *got = malloc(q.size);
    HCHECK(clEnqueueReadBuffer(c.queue, q.mem, CL_TRUE, 0, q.size, got, 0, NULL, NULL) ==
               CL_SUCCESS,
           "clEnqueueReadBuffer failed");
    same_bytes(got + q.size - op_bytes[OP_Q], want[OP_Q], op_bytes[OP_Q], "q at the end");

    /* moefuse's copies reach imported buffers too */
    unsigned char back[16], pattern[16];
    memset(pattern, 0x6B, sizeof pattern);
    HCHECK(moefuse_buffer_write(ctx, sc.mem, 0, pattern, sizeof pattern) == MOEFUSE_OK &&
               moefuse_buffer_read(ctx, sc.mem, 0, back, sizeof back) == MOEFUSE_OK,
           "buffer_write / read of an imported buffer: %s", moefuse_last_error(ctx));
    same_bytes(back, pattern, sizeof back, "buffer_read after buffer_write");

    /* buffer_free drops moefuse's reference only: the caller's buffer stays, refused in tensors */
    HCHECK(moefuse_buffer_free(ctx, q.mem) == MOEFUSE_OK, "buffer_free: %s",
           moefuse_last_error(ctx));
    expect_counts(NULL, q.mem, q_before, "q after buffer_free");
    tq.offset = CANARY;
    expect_status(ctx, moefuse_act_quant(ctx, &tx, NULL, &tq, &ts, NULL),
                  MOEFUSE_ERR_WRONG_DEVICE, "q is not memory", "q after buffer_free");
    HCHECK(clEnqueueReadBuffer(c.queue, q.mem, CL_TRUE, 0, q.size, got, 0, NULL, NULL) ==
               CL_SUCCESS,
           "the caller's sub-buffer does not work after buffer_free");
    same_bytes(got + q.size - op_bytes[OP_Q], want[OP_Q], op_bytes[OP_Q],
               "q read by the caller after buffer_free");
    free(got);

    moefuse_buffer_free(g_ctx, theirs);
    moefuse_context_destroy(ctx);
    caller_mem_free(&x);
    caller_mem_free(&q);
    caller_mem_free(&sc);
    caller_mem_free(&stranger);
    free_ops(in);
    free_ops(want);
    caller_close(&other);
    caller_close(&c);
}
END_TEST

/*
 * moefuse holds references of its own: an adopted context works on after the caller has let go
 * of its cl_context and queue, and an import counts once on the caller's cl_mem. Destroy drops
 * them all, buffers left imported included: the caller's cl_context, queue and cl_mem work on,
 * and once the caller's buffers are gone the counts are those of a context and queue that never
 * met moefuse. set_stream(NULL) returns to the adopted queue.
 */
START_TEST(t_adopted_lifetime)
{
    caller_cl gone = caller_open();
    moefuse_context *ctx = adopt(&gone);
    caller_close(&gone); /* the objects live on in moefuse's references */
    unsigned char *in[OP_COUNT], *want[OP_COUNT], *got[OP_COUNT];
    make_inputs(in);
    outputs_on(g_ctx, in, want);
    outputs_on(ctx, in, got);
    for (int i = 0; i < OP_COUNT; i++)
        if (got[i])
            same_bytes(got[i], want[i], op_bytes[i],
                       h_fmt("%s once the caller released its cl_context and queue", op_names[i]));
    moefuse_context_destroy(ctx);
    free_ops(in);
    free_ops(want);
    free_ops(got);

    caller_cl c = caller_open();
    const ref_counts fresh = counts_settled(&c, NULL, NULL);
    caller_mem m = caller_mem_new(&c, 256, true);
    const ref_counts m_before = counts_settled(NULL, m.mem, NULL);
    ref_counts m_imported = m_before;
    m_imported.mem++;
    ctx = adopt(&c);
    import_ok(ctx, m.mem, "a sub-buffer");
    expect_counts(NULL, m.mem, m_imported, "the imported sub-buffer");

    cl_int e;
    cl_command_queue second = clCreateCommandQueue(c.context, c.device, 0, &e);
    HCHECK(e == CL_SUCCESS, "clCreateCommandQueue: %d", (int)e);
    void *q = NULL;
    HCHECK(moefuse_set_stream(ctx, second) == MOEFUSE_OK, "set_stream: %s",
           moefuse_last_error(ctx));
    HCHECK(moefuse_set_stream(ctx, NULL) == MOEFUSE_OK, "set_stream(NULL): %s",
           moefuse_last_error(ctx));
    HCHECK(moefuse_get_stream(ctx, &q) == MOEFUSE_OK && q == (void *)c.queue,
           "set_stream(NULL) gave queue %p, want the adopted %p", q, (void *)c.queue);
    clReleaseCommandQueue(second);

    unsigned char data[256], back[256];
    for (int i = 0; i < 256; i++)
        data[i] = (unsigned char)(i * 7 + 1);
    HCHECK(moefuse_buffer_write(ctx, m.mem, CANARY, data, sizeof data) == MOEFUSE_OK,
           "buffer_write: %s", moefuse_last_error(ctx));
    moefuse_context_destroy(ctx); /* the buffer is still imported */

    expect_counts(NULL, m.mem, m_before, "the sub-buffer after destroy");
    e = clEnqueueReadBuffer(c.queue, m.mem, CL_TRUE, CANARY, sizeof back, back, 0, NULL, NULL);
    HCHECK(e == CL_SUCCESS, "the caller's queue and sub-buffer after destroy: %d", (int)e);
    same_bytes(back, data, sizeof back, "bytes moefuse wrote, read by the caller");
    cl_mem other = clCreateBuffer(c.context, CL_MEM_READ_WRITE, 64, NULL, &e);
    HCHECK(e == CL_SUCCESS, "the caller's cl_context after destroy: clCreateBuffer %d", (int)e);
    clReleaseMemObject(other);
    HCHECK(clFinish(c.queue) == CL_SUCCESS, "clFinish on the caller's queue after destroy");
    caller_mem_free(&m);
    expect_counts(&c, NULL, fresh, "after destroy, with the caller's buffers released");
    caller_close(&c);
}
END_TEST

/* Each allocation and the program build of an adoption failing in turn: refused with *out NULL
 * and every reference given back; the next adoption works. */
START_TEST(t_adopt_faults)
{
    static const mf_fault_kind kinds[] = {MF_FAULT_HOST_ALLOC, MF_FAULT_DEVICE_ALLOC,
                                          MF_FAULT_SCRATCH_GROW, MF_FAULT_PROGRAM_BUILD};
    caller_cl c = caller_open();
    const ref_counts before = counts_settled(&c, NULL, NULL);
    int failures = 0;
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        for (int64_t nth = 1; nth <= 64; nth++) {
            moefuse_context *ctx = (moefuse_context *)&ctx;
            mf_fault_arm(kinds[k], nth);
            moefuse_status st = moefuse_context_create_opencl(&ctx, c.context, c.queue);
            const bool fired = mf_fault_fired(kinds[k]);
            mf_fault_disarm_all();
            const char *what = h_fmt("%s failing at hit %lld", mf_fault_kind_name(kinds[k]),
                                     (long long)nth);
            if (st != MOEFUSE_OK) {
                HCHECK(fired, "%s: failed with nothing injected: %s", what,
                       moefuse_last_error(NULL));
                HCHECK(ctx == NULL, "%s: *out left set", what);
                HCHECK(strstr(moefuse_last_error(NULL), "context_create_opencl") != NULL,
                       "%s: message \"%s\"", what, moefuse_last_error(NULL));
                failures++;
            } else {
                moefuse_context_destroy(ctx); /* a fallback (the binary cache) took over */
            }
            expect_counts(&c, NULL, before, what);
            if (!fired)
                break;
        }
    }
    HCHECK(failures >= 3, "only %d injected failures reached an adoption", failures);
    moefuse_context_destroy(adopt(&c));
    caller_close(&c);
}
END_TEST

/* ------------------------------------------------------------ binary cache */

enum { CQ_T = 4, CQ_H = 256, CQ_BYTES = CQ_T * CQ_H + CQ_T * 2 * 4 };

/* quant of a fixed input on ctx (T = 4, H = 256, G = 128): codes then scales. */
static void quant_on(moefuse_context *ctx, unsigned char *out)
{
    static float x[CQ_T * CQ_H];
    for (int i = 0; i < CQ_T * CQ_H; i++) x[i] = (float)((i * 37 % 1001) - 500) * 0.37f;
    void *xb = NULL, *qb = NULL, *sb = NULL;
    int64_t xs[2] = {CQ_T, CQ_H}, ss[2] = {CQ_T, 2};
    HCHECK(moefuse_buffer_alloc(ctx, sizeof x, &xb) == MOEFUSE_OK &&
               moefuse_buffer_alloc(ctx, CQ_T * CQ_H, &qb) == MOEFUSE_OK &&
               moefuse_buffer_alloc(ctx, CQ_T * 2 * 4, &sb) == MOEFUSE_OK,
           "alloc: %s", moefuse_last_error(ctx));
    HCHECK(moefuse_buffer_write(ctx, xb, 0, x, sizeof x) == MOEFUSE_OK, "write: %s", moefuse_last_error(ctx));
    moefuse_tensor xt = moefuse_tensor_dense(xb, MOEFUSE_F32, 2, xs);
    moefuse_tensor qt = moefuse_tensor_dense(qb, MOEFUSE_F8_E4M3, 2, xs);
    moefuse_tensor st = moefuse_tensor_dense(sb, MOEFUSE_F32, 2, ss);
    HCHECK(moefuse_quant(ctx, &xt, &qt, &st, NULL) == MOEFUSE_OK, "quant: %s", moefuse_last_error(ctx));
    HCHECK(moefuse_buffer_read(ctx, qb, 0, out, CQ_T * CQ_H) == MOEFUSE_OK &&
               moefuse_buffer_read(ctx, sb, 0, out + CQ_T * CQ_H, CQ_T * 2 * 4) == MOEFUSE_OK,
           "read: %s", moefuse_last_error(ctx));
    moefuse_buffer_free(ctx, xb);
    moefuse_buffer_free(ctx, qb);
    moefuse_buffer_free(ctx, sb);
}

/* Files in dir: how many, and the path of the last "*.bin" (entries) or any (all). */
static int count_files(const char *dir, int bins_only, char *last, size_t size)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *nm = e->d_name;
        size_t len = strlen(nm);
        if (strcmp(nm, ".") == 0 || strcmp(nm, "..") == 0) continue;
        if (bins_only && (len < 4 || strcmp(nm + len - 4, ".bin") != 0)) continue;
        n++;
        if (last) snprintf(last, size, "%s/%s", dir, nm);
    }
    closedir(d);
    return n;
}

/* A context built with the cache as it is now: was its program loaded from it? Its quant must equal `want`. */
static int context_from_cache(const unsigned char *want, const char *step)
{
    moefuse_context *c = NULL;
    HCHECK(moefuse_context_create(&c, "opencl") == MOEFUSE_OK, "%s: context_create: %s", step,
           moefuse_last_error(NULL));
    int cached = strstr(moefuse_device_name(c), "cached binary") != NULL;
    unsigned char got[CQ_BYTES];
    quant_on(c, got);
    moefuse_context_destroy(c);
    HCHECK(memcmp(got, want, CQ_BYTES) == 0, "%s: quant differs from the context built from source", step);
    return cached;
}

static long file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

/* Rewrite the entry: garbage of the same size, the first half only, or one payload byte flipped. */
static void damage(const char *path, int how)
{
    long size = file_size(path);
    unsigned char *b = malloc((size_t)size);
    FILE *f = fopen(path, "rb");
    HCHECK(f && fread(b, 1, (size_t)size, f) == (size_t)size, "cannot read %s", path);
    fclose(f);
    if (how == 0)
        for (long i = 0; i < size; i++) b[i] = (unsigned char)h_rand();
    if (how == 2) b[size - 1] ^= 0x40; /* past the 32-byte header: the checksum must catch it */
    f = fopen(path, "wb");
    HCHECK(f && fwrite(b, 1, (size_t)(how == 1 ? size / 2 : size), f) == (size_t)(how == 1 ? size / 2 : size),
           "cannot write %s", path);
    fclose(f);
    free(b);
}

/* rm -r; stops at the first thing it cannot remove */
static int remove_tree(const char *dir)
{
    char path[1200];
    while (count_files(dir, 0, path, sizeof path) > 0) {
        struct stat sb;
        int gone = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode) ? remove_tree(path) : remove(path) == 0;
        if (!gone) break;
    }
    return rmdir(dir) == 0;
}

static void temp_dir(char *out, size_t size, const char *what)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(out, size, "%s/moefuse-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", what);
    HCHECK(mkdtemp(out) != NULL, "mkdtemp %s failed", out);
}

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
 * What the backend's README promises: the simple and tiled GEMM paths give the
 * same bits (the matrix-vector path adds in its own order), with invalid ids,
 * biases, an expert map, a padded x, both outputs of the final.
 */
START_TEST(t_simple_and_tiled_agree)
{
    static const char *const paths[2] = {"simple", "tiled"};
    const int64_t M = 7, E = 5, Eg = 7, k = 2, K = 300, I = 70;
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
        tb_new2("x", MOEFUSE_BF16, M, K, 3, 1),          tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1),
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
        same_elements(twin[i], all[i], "tiled vs simple");
    tb_free_all();
    g_ctx = outer;
    moefuse_context_destroy(c[0]);
    moefuse_context_destroy(c[1]);
}
END_TEST

START_TEST(t_program_cache)
{
    saved_env cache = env_save("MOEFUSE_OPENCL_CACHE"), xdg = env_save("XDG_CACHE_HOME"),
              home = env_save("HOME");
    char root[512], dir[600], entry[1200];
    temp_dir(root, sizeof root, "cache");
    snprintf(dir, sizeof dir, "%s/not/yet/there", root); /* created on first use */
    setenv("MOEFUSE_OPENCL_CACHE", dir, 1);

    unsigned char want[CQ_BYTES];
    moefuse_context *c = NULL;
    HCHECK(moefuse_context_create(&c, "opencl") == MOEFUSE_OK, "first context: %s", moefuse_last_error(NULL));
    HCHECK(strstr(moefuse_device_name(c), "cached binary") == NULL, "first context on an empty cache: \"%s\"",
           moefuse_device_name(c));
    quant_on(c, want);
    moefuse_context_destroy(c);
    HCHECK(count_files(dir, 0, entry, sizeof entry) == 1 && count_files(dir, 1, entry, sizeof entry) == 1,
           "the first context should leave exactly one entry (*.bin) in %s", dir);
    if (strstr(moefuse_device_name(g_ctx), "division not correctly rounded") == NULL) {
        moefuse_context *cpu = NULL;
        unsigned char ref[CQ_BYTES];
        HCHECK(moefuse_context_create(&cpu, "cpu") == MOEFUSE_OK, "cpu: %s", moefuse_last_error(NULL));
        quant_on(cpu, ref);
        moefuse_context_destroy(cpu);
        HCHECK(memcmp(ref, want, CQ_BYTES) == 0,
               "quant from the source-built program differs from the cpu backend");
    }
    HCHECK(context_from_cache(want, "second context"), "the second context did not load the cached binary");

    static const char *const damages[3] = {"garbage", "truncated", "one payload byte flipped"};
    for (int how = 0; how < 3; how++) {
        damage(entry, how);
        HCHECK(!context_from_cache(want, damages[how]), "a %s entry was loaded", damages[how]);
        HCHECK(count_files(dir, 0, NULL, 0) == 1, "%s: the rebuild should leave one file", damages[how]);
        HCHECK(context_from_cache(want, damages[how]), "%s: the entry was not rewritten valid", damages[how]);
    }

    /* off: nothing written, not under XDG_CACHE_HOME or HOME, nor in a folder named "off"
     * (run from inside the empty folder so a relative one would show) */
    char elsewhere[512], cwd[1024];
    temp_dir(elsewhere, sizeof elsewhere, "home");
    setenv("MOEFUSE_OPENCL_CACHE", "off", 1);
    setenv("XDG_CACHE_HOME", elsewhere, 1);
    setenv("HOME", elsewhere, 1);
    HCHECK(getcwd(cwd, sizeof cwd) && chdir(elsewhere) == 0, "cannot enter %s", elsewhere);
    int cached = context_from_cache(want, "cache off");
    HCHECK(chdir(cwd) == 0, "cannot go back to %s", cwd);
    HCHECK(!cached, "MOEFUSE_OPENCL_CACHE=off loaded a cached binary");
    HCHECK(count_files(elsewhere, 0, NULL, 0) == 0, "MOEFUSE_OPENCL_CACHE=off wrote into %s", elsewhere);
    HCHECK(count_files(dir, 0, NULL, 0) == 1, "MOEFUSE_OPENCL_CACHE=off changed %s", dir);

    env_restore(&cache);
    env_restore(&xdg);
    env_restore(&home);
    remove_tree(elsewhere);
    remove_tree(root);
}
END_TEST

int main(void)
{
    setenv("MOEFUSE_TEST_BACKEND", "opencl", 1);
    Suite *s = suite_create("opencl");
    TCase *tc = tcase_create("opencl");
    tcase_add_checked_fixture(tc, h_setup, h_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, t_device_selection, 0, 2);
    tcase_add_test(tc, t_auto_needs_gpu);
    tcase_add_test(tc, t_buffer_bounds);
    tcase_add_test(tc, t_wrong_device);
    tcase_add_test(tc, t_caller_queue);
    tcase_add_test(tc, t_adopted_context_computes_alike);
    tcase_add_test(tc, t_adopt_refusals);
    tcase_add_test(tc, t_buffer_import);
    tcase_add_test(tc, t_adopted_lifetime);
    tcase_add_test(tc, t_adopt_faults);
    tcase_add_test(tc, t_simple_and_tiled_agree);
    tcase_add_test(tc, t_program_cache);
    suite_add_tcase(s, tc);
    return h_run(s);
}
