/* test_opencl: contexts over the caller's cl_context and queue, computing as moefuse's own do. */
#include "test_opencl.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

caller_cl caller_open(void)
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

void caller_close(caller_cl *c)
{
    clReleaseCommandQueue(c->queue);
    clReleaseContext(c->context);
}

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
ref_counts counts_settled(const caller_cl *c, cl_mem m, const ref_counts *want)
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

void expect_counts(const caller_cl *c, cl_mem m, ref_counts want, const char *what)
{
    const ref_counts got = counts_settled(c, m, &want);
    HCHECK(counts_equal(got, want),
           "%s: references of the caller's cl_context %u, queue %u, cl_mem %u; want %u, %u, %u "
           "(0: not counted)",
           what, got.context, got.queue, got.mem, want.context, want.queue, want.mem);
}

caller_mem caller_mem_new(const caller_cl *c, size_t payload, bool sub)
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
void caller_mem_put(const caller_cl *c, caller_mem *m, const void *src, size_t bytes)
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
void caller_mem_check(const caller_cl *c, caller_mem *m, size_t written, void *out,
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

void caller_mem_free(caller_mem *m)
{
    if (m->mem != m->parent)
        clReleaseMemObject(m->mem);
    clReleaseMemObject(m->parent);
    free(m->bytes);
}

/* Host bytes of the inputs (outputs: NULL), freed by free_ops. */
void make_inputs(unsigned char *in[OP_COUNT])
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

void free_ops(unsigned char *ops[OP_COUNT])
{
    for (int i = 0; i < OP_COUNT; i++)
        free(ops[i]);
}

moefuse_tensor op_tensor(void *const buf[OP_COUNT], int op, int64_t offset)
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
void outputs_on(moefuse_context *ctx, unsigned char *const in[OP_COUNT],
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

void same_bytes(const void *got, const void *want, size_t n, const char *what)
{
    const unsigned char *g = got, *w = want;
    for (size_t i = 0; i < n; i++)
        HCHECK(g[i] == w[i], "%s: byte %zu is 0x%02x, want 0x%02x", what, i, g[i], w[i]);
}

/* A context over the caller's cl_context and queue, fetched from it. */
moefuse_context *adopt(const caller_cl *c)
{
    moefuse_context *ctx = NULL;
    moefuse_status st = moefuse_context_create_opencl(&ctx, c->context, c->queue);
    HCHECK(st == MOEFUSE_OK && ctx, "context_create_opencl: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(NULL));
    return ctx;
}

void import_ok(moefuse_context *ctx, cl_mem m, const char *what)
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
void expect_status(moefuse_context *ctx, moefuse_status st, moefuse_status want,
                   const char *needle, const char *what)
{
    const char *msg = moefuse_last_error(ctx);
    HCHECK(st == want, "%s: %s (%s), want %s", what, moefuse_status_name(st), msg,
           moefuse_status_name(want));
    HCHECK(strstr(msg, needle) != NULL, "%s: message \"%s\" does not name %s", what, msg, needle);
}

/* What import accepts and refuses; tensors on imported buffers end inside CL_MEM_SIZE; one
 * reference is held, until buffer_free. */

void opencl_caller_tests(TCase *tc)
{
    tcase_add_test(tc, t_adopted_context_computes_alike);
    tcase_add_test(tc, t_adopt_refusals);
}
