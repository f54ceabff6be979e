/* test_opencl: handles that belong to something else, and the caller's queue. */
#include "test_opencl.h"

#include <stdlib.h>
#include <string.h>

/* --------------------------------------------------------- foreign handles */

static tbuf *X, *Q, *SC;

/* act_quant operands on g_ctx: x [4, 256] f32, q [4, 128] f8, scales [4, 1] f32 */
static void operands(void)
{
    X = tb_upload_unif(tb_new2("x", MOEFUSE_F32, 4, 256, 0, 1), -2, 2);
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

cl_command_queue current_queue(void)
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

void opencl_handles_tests(TCase *tc)
{
    tcase_add_test(tc, t_buffer_bounds);
    tcase_add_test(tc, t_wrong_device);
    tcase_add_test(tc, t_caller_queue);
}
