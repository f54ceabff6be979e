/* Every validation rule: the status, a message naming the operation and the
 * argument, and outputs (poisoned) plus canaries untouched (checked by CALL). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "test_api_errors.h"

void expect_msg(moefuse_status got, moefuse_status want, const char *op, const char *arg,
                const char *desc, const char *msg)
{
    HCHECK(got == want, "%s: %s returned %s, want %s (message: \"%s\")", op, desc, moefuse_status_name(got),
           moefuse_status_name(want), msg);
    HCHECK(*msg, "%s: %s: moefuse_last_error is empty", op, desc);
    HCHECK(strstr(msg, op) != NULL, "%s: %s: message \"%s\" does not name the operation", op, desc, msg);
    if (arg) HCHECK(strstr(msg, arg) != NULL, "%s: %s: message \"%s\" does not name \"%s\"", op, desc, msg, arg);
}

/* ------------------------------------------------------------ topk, context */
START_TEST(t_topk)
{
    tbuf *lg = tb_upload_unif(tb_new2("logits", MOEFUSE_F32, 4, 6, 0, 1), -1, 1);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, 4, 2, 0, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, 4, 2, 0, 0);
    const char *op = "topk_softmax";
    EXPECT_CTX(moefuse_topk_softmax(NULL, T(lg), 0, T(ids), T(w)), MOEFUSE_ERR_NULL_POINTER, op, NULL, "ctx NULL", NULL);
    EXPECT(moefuse_topk_softmax(g_ctx, NULL, 0, T(ids), T(w)), MOEFUSE_ERR_NULL_POINTER, op, "logits", "logits NULL");
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), NULL), MOEFUSE_ERR_NULL_POINTER, op, "weights", "weights NULL");
    moefuse_tensor a = ids->t, b = w->t;
    a.shape[1] = 0; b.shape[1] = 0;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, &a, &b), MOEFUSE_ERR_SHAPE, op, NULL, "k = 0");
    tbuf *ids7 = tb_new2("ids7", MOEFUSE_I32, 4, 7, 0, 0);
    tbuf *w7 = tb_new2("w7", MOEFUSE_F32, 4, 7, 0, 0);
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids7), T(w7)), MOEFUSE_ERR_SHAPE, op, NULL, "k > E");
    a = ids->t; a.dtype = MOEFUSE_F32;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, &a, T(w)), MOEFUSE_ERR_DTYPE, op, "ids", "ids f32");
    b = w->t; b.dtype = MOEFUSE_BF16;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), &b), MOEFUSE_ERR_DTYPE, op, "weights", "weights bf16");
    a = lg->t; a.dtype = MOEFUSE_I32;
    EXPECT(moefuse_topk_softmax(g_ctx, &a, 0, T(ids), T(w)), MOEFUSE_ERR_DTYPE, op, "logits", "logits i32");
    a = ids->t; a.shape[0] = 3;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, &a, T(w)), MOEFUSE_ERR_SHAPE, op, "ids", "ids rows");
    b = w->t; b.shape[1] = 1;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), &b), MOEFUSE_ERR_SHAPE, op, "weights", "weights k");
    a = lg->t; a.rank = 3; a.shape[2] = 1; a.stride[2] = 1;
    EXPECT(moefuse_topk_softmax(g_ctx, &a, 0, T(ids), T(w)), MOEFUSE_ERR_SHAPE, op, "logits", "logits rank 3");
    a = lg->t; a.stride[0] = 3;
    EXPECT(moefuse_topk_softmax(g_ctx, &a, 0, T(ids), T(w)), MOEFUSE_ERR_STRIDE, op, "logits", "logits overlap");
    a = w->t; a.offset += 1;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), &a), MOEFUSE_ERR_ALIGNMENT, op, "weights", "weights misaligned");
}
END_TEST

/* ---------------------------------------------- empty tensors with NULL data */
/* torch.empty(0, K) has data NULL: an operand with a zero dimension touches no memory,
 * so NULL data is accepted there (an expert-parallel rank may get no tokens), and the
 * non-empty operands are still read as usual; a non-empty NULL stays an error. */
static moefuse_tensor empty_tensor(moefuse_dtype dt, int32_t rank, int64_t d0, int64_t d1,
                                   int64_t d2)
{
    const int64_t shape[3] = {d0, d1, d2};
    return moefuse_tensor_dense(NULL, dt, rank, shape);
}

START_TEST(t_empty_null_data)
{
    const int64_t H = 128, E = 4, k = 2, K = 16, I = 8;
    moefuse_tensor x = empty_tensor(MOEFUSE_BF16, 2, 0, 2 * H, 0);
    moefuse_tensor q = empty_tensor(MOEFUSE_F8_E4M3, 2, 0, H, 0);
    moefuse_tensor sc = empty_tensor(MOEFUSE_F32, 2, 0, 1, 0);
    moefuse_tensor o = empty_tensor(MOEFUSE_BF16, 2, 0, H, 0);
    moefuse_tensor xh = empty_tensor(MOEFUSE_BF16, 2, 0, H, 0);
    moefuse_tensor qh = empty_tensor(MOEFUSE_I8, 2, 0, H, 0);
#define OKCALL(call, what)                                                                     \
    do {                                                                                       \
        moefuse_status st_ = CALL(call);                                                       \
        HCHECK(st_ == MOEFUSE_OK, "%s with NULL empty operands: %s (%s)", what,                \
               moefuse_status_name(st_), moefuse_last_error(g_ctx));                           \
    } while (0)
    OKCALL(moefuse_act_quant(g_ctx, &x, NULL, &q, &sc, NULL), "act_quant T=0");
    moefuse_tensor cs = empty_tensor(MOEFUSE_F32, 2, 1, 0, 0); /* column-major [Gn, Ta = 0] */
    moefuse_act_quant_options col;
    memset(&col, 0, sizeof col);
    col.quant.scale_layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    OKCALL(moefuse_act_quant(g_ctx, &x, NULL, &q, &cs, &col), "act_quant T=0, column-major");
    OKCALL(moefuse_act_mul(g_ctx, &x, NULL, &o, NULL), "act_mul T=0");
    OKCALL(moefuse_quant(g_ctx, &xh, &qh, &sc, NULL), "quant T=0");
    OKCALL(moefuse_dequant(g_ctx, &qh, &sc, &xh, NULL), "dequant T=0");

    /* masked, Tmax = 0: the counts are real memory and still read (and clamped) */
    tbuf *cnt = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int64_t e = 0; e < E; e++) tb_set(cnt, e, 0, 0, (double)(e - 1));
    tb_upload(cnt);
    moefuse_tensor xm = empty_tensor(MOEFUSE_BF16, 3, E, 0, 2 * H);
    moefuse_tensor qm = empty_tensor(MOEFUSE_F8_E4M3, 3, E, 0, H);
    moefuse_tensor sm = empty_tensor(MOEFUSE_F32, 3, E, 0, 1);
    moefuse_act_quant_options zt;
    memset(&zt, 0, sizeof zt);
    zt.zero_tail = 1;
    OKCALL(moefuse_act_quant_masked(g_ctx, &xm, T(cnt), NULL, NULL, &qm, &sm, &zt),
           "act_quant_masked Tmax=0");

    moefuse_tensor lg = empty_tensor(MOEFUSE_F32, 2, 0, E, 0);
    moefuse_tensor ids = empty_tensor(MOEFUSE_I32, 2, 0, k, 0);
    moefuse_tensor wts = empty_tensor(MOEFUSE_F32, 2, 0, k, 0);
    OKCALL(moefuse_topk_softmax(g_ctx, &lg, 1, &ids, &wts), "topk_softmax M=0");

    /* the MoE calls with M = 0: weights are real, everything per token is empty */
    tbuf *w1 = tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1);
    tbuf *w2 = tb_new3("w2", MOEFUSE_BF16, E, K, I, 0, 1);
    tb_fill_unif(w1, -1, 1);
    tb_fill_unif(w2, -1, 1);
    tb_upload(w1);
    tb_upload(w2);
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = ids;
    r.topk_weights = wts;
    moefuse_tensor mx = empty_tensor(MOEFUSE_BF16, 2, 0, K, 0);
    moefuse_tensor mh = empty_tensor(MOEFUSE_BF16, 3, 0, k, I);
    moefuse_tensor mo = empty_tensor(MOEFUSE_BF16, 2, 0, K, 0);
    OKCALL(moefuse_moe_gate(g_ctx, &mx, T(w1), NULL, &r, &mh, NULL), "moe_gate M=0");
    OKCALL(moefuse_moe_final(g_ctx, &mh, T(w2), NULL, &r, &mo, NULL), "moe_final M=0");
    OKCALL(moefuse_moe_forward(g_ctx, &mx, T(w1), T(w2), NULL, NULL, &r, &mo, NULL),
           "moe_forward M=0");
#undef OKCALL

    /* NULL is still refused where there are elements */
    moefuse_tensor w1null = w1->t;
    w1null.data = NULL;
    EXPECT(moefuse_moe_forward(g_ctx, &mx, &w1null, T(w2), NULL, NULL, &r, &mo, NULL),
           MOEFUSE_ERR_NULL_POINTER, "moe_forward", "w1", "w1 data NULL with M = 0");
}
END_TEST

/* moefuse_context_create_on: a device needs a named backend that has devices to choose. */
static void expect_device_refused(const char *backend, const char *device, const char *needle)
{
    moefuse_context *c = (moefuse_context *)0x1;
    const moefuse_status st = moefuse_context_create_on(&c, backend, device);
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_INVALID_ARGUMENT, "create_on(%s, '%s') returned %s",
           backend ? backend : "NULL", device, moefuse_status_name(st));
    HCHECK(c == NULL, "create_on(%s, '%s') failed but left *out set", backend ? backend : "NULL",
           device);
    HCHECK(strstr(msg, needle) != NULL, "create_on(%s, '%s'): message \"%s\" lacks \"%s\"",
           backend ? backend : "NULL", device, msg, needle);
}

START_TEST(t_context_on_device)
{
    expect_device_refused(NULL, "0", "needs a backend name");
    expect_device_refused("auto", "0", "needs a backend name");
    expect_device_refused("cpu", "0", "one device");
    expect_device_refused("cpu", "", "empty");
    moefuse_context *c = NULL;
    const moefuse_status st = moefuse_context_create_on(&c, "cpu", NULL);
    HCHECK(st == MOEFUSE_OK && c != NULL, "create_on(cpu, NULL): %s", moefuse_last_error(NULL));
    HCHECK(strcmp(moefuse_backend_name(c), "cpu") == 0, "create_on(cpu, NULL) gave %s",
           moefuse_backend_name(c));
    moefuse_context_destroy(c);
    HCHECK(moefuse_context_create_on(NULL, "cpu", NULL) == MOEFUSE_ERR_NULL_POINTER,
           "create_on(NULL out) was not refused");
}
END_TEST

/* moefuse_context_create_opencl refuses what it can judge without touching a handle, on every
 * build; a library without OpenCL refuses any handles (never looked at). test_opencl adopts
 * real ones. */
static void expect_adopt_refused(void *context, void *queue, moefuse_status want,
                                 const char *needle)
{
    moefuse_context *c = (moefuse_context *)0x1;
    const moefuse_status st = moefuse_context_create_opencl(&c, context, queue);
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == want, "create_opencl(%p, %p) returned %s, want %s (%s)", context, queue,
           moefuse_status_name(st), moefuse_status_name(want), msg);
    HCHECK(c == NULL, "create_opencl(%p, %p) failed but left *out set", context, queue);
    HCHECK(strstr(msg, "context_create_opencl") && strstr(msg, needle),
           "create_opencl(%p, %p): message \"%s\" should name the call and \"%s\"", context,
           queue, msg, needle);
}

START_TEST(t_context_create_opencl)
{
    int dummy[2];
    HCHECK(moefuse_context_create_opencl(NULL, &dummy[0], &dummy[1]) == MOEFUSE_ERR_NULL_POINTER,
           "create_opencl(NULL out) was not refused");
    HCHECK(strstr(moefuse_last_error(NULL), "out is NULL"), "NULL out: message \"%s\"",
           moefuse_last_error(NULL));
    expect_adopt_refused(NULL, &dummy[1], MOEFUSE_ERR_NULL_POINTER, "cl_context");
    expect_adopt_refused(&dummy[0], NULL, MOEFUSE_ERR_NULL_POINTER, "cl_queue");
    expect_adopt_refused(NULL, NULL, MOEFUSE_ERR_NULL_POINTER, "cl_context");
    if (strstr(moefuse_built_backends(), "opencl") == NULL)
        expect_adopt_refused(&dummy[0], &dummy[1], MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                             "not built");
    else
        fprintf(stderr, "note: OpenCL is built in; the refusal of a library without it is "
                        "tested in builds without it\n");
}
END_TEST

/*
 * moefuse_buffer_import: NULL refused everywhere; on the CPU any host pointer is memory of the
 * device (accepted, untouched); on CUDA device memory is, a host pointer is not; on OpenCL a
 * buffer of the context's own is already known (test_opencl imports the caller's cl_mem).
 */
START_TEST(t_buffer_import)
{
    EXPECT(moefuse_buffer_import(g_ctx, NULL), MOEFUSE_ERR_NULL_POINTER, "buffer_import",
           "buffer is NULL", "a NULL buffer");
    static unsigned char host[64];
    HCHECK(moefuse_buffer_import(NULL, host) == MOEFUSE_ERR_NULL_POINTER,
           "buffer_import(NULL ctx) was not refused");
    const char *be = moefuse_backend_name(g_ctx);
    void *own = NULL;
    HCHECK(moefuse_buffer_alloc(g_ctx, 64, &own) == MOEFUSE_OK, "alloc: %s",
           moefuse_last_error(g_ctx));
    HCHECK(moefuse_buffer_import(g_ctx, own) == MOEFUSE_OK, "import of a buffer of ctx: %s",
           moefuse_last_error(g_ctx));
    if (strcmp(be, "cpu") == 0) {
        memset(host, 0x5C, sizeof host);
        HCHECK(moefuse_buffer_import(g_ctx, host) == MOEFUSE_OK,
               "cpu: import of a host array: %s", moefuse_last_error(g_ctx));
        HCHECK(host[0] == 0x5C && host[63] == 0x5C, "cpu: import changed the array");
        /* and a tensor on it is taken, as before the import */
        int64_t shape[2] = {1, 16};
        moefuse_tensor x = moefuse_tensor_dense(host, MOEFUSE_F32, 2, shape);
        moefuse_tensor q = moefuse_tensor_dense(own, MOEFUSE_F8_E4M3, 2, (int64_t[2]){1, 8});
        moefuse_tensor sc = moefuse_tensor_dense((char *)own + 32, MOEFUSE_F32, 2,
                                                 (int64_t[2]){1, 1});
        moefuse_act_quant_options o = {0};
        o.quant.group_size = 8;
        HCHECK(moefuse_act_quant(g_ctx, &x, NULL, &q, &sc, &o) == MOEFUSE_OK,
               "cpu: act_quant on the imported array: %s", moefuse_last_error(g_ctx));
    } else if (strcmp(be, "cuda") == 0) {
        EXPECT(moefuse_buffer_import(g_ctx, host), MOEFUSE_ERR_WRONG_DEVICE, "buffer_import",
               "not memory", "a host array on cuda");
    }
    moefuse_buffer_free(g_ctx, own);
}
END_TEST

/* The library reports the version of the header it was built with: this build's, here. */
START_TEST(t_version)
{
    HCHECK(moefuse_version() == MOEFUSE_VERSION, "moefuse_version() is %u, the header says %d",
           moefuse_version(), MOEFUSE_VERSION);
    HCHECK(MOEFUSE_VERSION_MINOR < 100 && MOEFUSE_VERSION_PATCH < 100,
           "version %d.%d.%d does not fit MOEFUSE_VERSION's encoding", MOEFUSE_VERSION_MAJOR,
           MOEFUSE_VERSION_MINOR, MOEFUSE_VERSION_PATCH);
}
END_TEST

START_TEST(t_context)
{
    moefuse_context *c = (moefuse_context *)0x1;
    moefuse_status st = moefuse_context_create(&c, "tpu");
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_BACKEND_UNAVAILABLE, "context_create(tpu) returned %s", moefuse_status_name(st));
    HCHECK(c == NULL, "context_create failure left *out non-NULL");
    HCHECK(msg && strstr(msg, "tpu") && strstr(msg, "cpu"), "message \"%s\" should name tpu and list built backends",
           msg ? msg : "(null)");
    HCHECK(strstr(moefuse_built_backends(), "cpu") != NULL, "built backends \"%s\" lacks cpu", moefuse_built_backends());
    st = moefuse_context_create(NULL, "cpu");
    HCHECK(st == MOEFUSE_ERR_NULL_POINTER, "context_create(NULL out) returned %s", moefuse_status_name(st));
    if (strcmp(moefuse_backend_name(g_ctx), "cpu") == 0) {
        int dummy;
        st = moefuse_set_stream(g_ctx, &dummy);
        HCHECK(st == MOEFUSE_ERR_UNSUPPORTED, "set_stream(non-NULL) on cpu returned %s", moefuse_status_name(st));
        HCHECK(moefuse_last_error(g_ctx)[0] != 0, "set_stream: empty message");
        HCHECK(moefuse_set_stream(g_ctx, NULL) == MOEFUSE_OK, "set_stream(NULL) failed");
    }
    HCHECK(moefuse_synchronize(g_ctx) == MOEFUSE_OK, "synchronize failed");
    /* get_stream: a NULL out pointer is refused; the cpu backend has no stream */
    st = moefuse_get_stream(g_ctx, NULL);
    HCHECK(st == MOEFUSE_ERR_NULL_POINTER, "get_stream(ctx, NULL) returned %s", moefuse_status_name(st));
    HCHECK(strstr(moefuse_last_error(g_ctx), "get_stream") != NULL, "get_stream: message \"%s\" does not name the call",
           moefuse_last_error(g_ctx));
    void *stream = &st;
    st = moefuse_get_stream(NULL, &stream);
    HCHECK(st == MOEFUSE_ERR_NULL_POINTER, "get_stream(NULL ctx) returned %s", moefuse_status_name(st));
    HCHECK(moefuse_get_stream(g_ctx, &stream) == MOEFUSE_OK, "get_stream: %s", moefuse_last_error(g_ctx));
    if (strcmp(moefuse_backend_name(g_ctx), "cpu") == 0)
        HCHECK(stream == NULL, "get_stream on cpu gave %p, want NULL", stream);
    else
        HCHECK(stream != NULL && stream != (void *)&st, "get_stream on %s gave %p, want its queue/stream",
               moefuse_backend_name(g_ctx), stream);
    HCHECK(strcmp(moefuse_status_name(MOEFUSE_ERR_SHAPE), "MOEFUSE_ERR_SHAPE") == 0, "status_name");
    HCHECK(strcmp(moefuse_status_name((moefuse_status)999), "unknown status") == 0, "status_name out of range");
    HCHECK(moefuse_dtype_size(MOEFUSE_BF16) == 2 && moefuse_dtype_size(MOEFUSE_U8) == 1, "dtype_size");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("api_errors");
    TCase *tc = h_add_tcase(s, "errors", h_setup, 60);
    api_errors_rows_tests(tc);
    api_errors_moe_tests(tc);
    api_errors_sizes_tests(tc);
    tcase_add_test(tc, t_topk);
    tcase_add_test(tc, t_empty_null_data);
    tcase_add_test(tc, t_version);
    tcase_add_test(tc, t_context_on_device);
    tcase_add_test(tc, t_context_create_opencl);
    tcase_add_test(tc, t_buffer_import);
    tcase_add_test(tc, t_context);
    return h_run(s);
}
