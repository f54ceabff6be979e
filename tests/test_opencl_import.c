/* test_opencl: tensors on the caller's cl_mem (moefuse_buffer_import), lifetimes and faults. */
#include "core/fault.h" /* mf_fault_arm: adoption's failure paths */
#include "test_opencl.h"

#include <stdlib.h>
#include <string.h>

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

void opencl_import_tests(TCase *tc)
{
    tcase_add_test(tc, t_buffer_import);
    tcase_add_test(tc, t_adopted_lifetime);
    tcase_add_test(tc, t_adopt_faults);
}
