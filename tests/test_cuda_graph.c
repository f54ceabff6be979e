/*
 * The CUDA backend under CUDA graphs and foreign streams:
 *  - every operation captured into a graph (global capture mode, with no eager
 *    call before it) replays to the same bits as the eager call, again after
 *    the inputs change and after the context's scratch has been regrown;
 *  - the stream is attached while it is capturing, as torch.cuda.graph does;
 *  - calls alternating between streams, with no host wait between them, give
 *    the results of calls on one stream (the scratch orders itself).
 * Runs on "cuda" only; skipped without a device (h_run).
 */
#include <cuda_runtime.h>
#include <string.h>

#include "harness.h"

#define CU(call)                                                                                 \
    do {                                                                                         \
        cudaError_t e_ = (call);                                                                 \
        HCHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                      \
    } while (0)

#define OK(call)                                                                                 \
    do {                                                                                         \
        moefuse_status s_ = (call);                                                              \
        HCHECK(s_ == MOEFUSE_OK, "%s: %s (%s)", #call, moefuse_status_name(s_),                  \
               moefuse_last_error(g_ctx));                                                       \
    } while (0)

/* Two tensors made alike (same shape, pads and dtype): every element byte equal. */
static void same_bytes(tbuf *got, tbuf *want, const char *what)
{
    HCHECK(got->total == want->total, "%s: %s and %s differ in size", what, got->name, want->name);
    for (size_t i = 0; i < got->total; i++)
        if (got->logical[i])
            HCHECK(got->full[i] == want->full[i],
                   "%s: %s byte %zu is 0x%02x, %s has 0x%02x", what, got->name, i - got->pad,
                   got->full[i], want->name, want->full[i]);
}

/* ------------------------------------------------------------------ capture */

typedef moefuse_status (*issue_fn)(void *arg, int graph);

/* Captures issue(arg, 1) on stream cs, attaching cs to the context mid-capture. */
static cudaGraphExec_t capture(cudaStream_t cs, issue_fn issue, void *arg)
{
    CU(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
    moefuse_status st = moefuse_set_stream(g_ctx, cs);
    if (st == MOEFUSE_OK)
        st = issue(arg, 1);
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(cs, &graph);
    HCHECK(st == MOEFUSE_OK, "captured call: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(g_ctx));
    HCHECK(e == cudaSuccess && graph, "cudaStreamEndCapture: %s", cudaGetErrorString(e));
    cudaGraphExec_t exec = NULL;
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphDestroy(graph));
    OK(moefuse_set_stream(g_ctx, NULL));
    return exec;
}

static void replay(cudaGraphExec_t exec, cudaStream_t cs)
{
    CU(cudaGraphLaunch(exec, cs));
    CU(cudaStreamSynchronize(cs));
}

/* --------------------------------------------------------------- the layer */

typedef struct {
    int64_t M, E, k, K, I;
    tbuf *x, *w1, *w2, *ids, *wts, *out_eager, *out_graph;
    moefuse_routing R;
} layer;

static void layer_fill_routing(layer *L)
{
    for (int64_t m = 0; m < L->M; m++)
        for (int64_t j = 0; j < L->k; j++) {
            /* invalid ids now and then: the kernels skip them */
            int64_t id = h_randint(0, 19) == 0 ? h_randint(-2, -1) : h_randint(0, L->E + 1);
            tb_set(L->ids, m, j, 0, (double)id);
        }
    tb_fill_unif(L->wts, 0.0, 1.0);
    tb_upload(L->ids);
    tb_upload(L->wts);
}

static layer layer_new(int64_t M, int64_t E, int64_t k, int64_t K, int64_t I)
{
    layer L = {M, E, k, K, I};
    L.x = tb_new2("x", MOEFUSE_BF16, M, K, 0, 1);
    L.w1 = tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1);
    L.w2 = tb_new3("w2", MOEFUSE_BF16, E, K, I, 0, 1);
    L.ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1);
    L.wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    L.out_eager = tb_new2("out_eager", MOEFUSE_BF16, M, K, 0, 0);
    L.out_graph = tb_new2("out_graph", MOEFUSE_BF16, M, K, 0, 0);
    tb_fill_unif(L.x, -1.0, 1.0);
    tb_fill_unif(L.w1, -0.1, 0.1);
    tb_fill_unif(L.w2, -0.1, 0.1);
    tb_upload(L.x);
    tb_upload(L.w1);
    tb_upload(L.w2);
    layer_fill_routing(&L);
    memset(&L.R, 0, sizeof L.R);
    L.R.topk_ids = L.ids->t;
    L.R.topk_weights = L.wts->t;
    return L;
}

static moefuse_status layer_issue(void *arg, int graph)
{
    layer *L = arg;
    return moefuse_moe_forward(g_ctx, T(L->x), T(L->w1), T(L->w2), NULL, NULL, &L->R,
                               graph ? T(L->out_graph) : T(L->out_eager), NULL);
}

/* M = 1: the direct (decode) path; M = 96: routed, with route kernels and scratch lists. */
START_TEST(moe_forward_in_a_graph)
{
    static const int64_t Ms[] = {1, 96};
    const int64_t M = Ms[_i];
    cudaStream_t cs;
    CU(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    layer L = layer_new(M, 8, 2, 256, 128);
    /* captured first: the context has no scratch yet */
    cudaGraphExec_t exec = capture(cs, layer_issue, &L);
    replay(exec, cs);
    OK(layer_issue(&L, 0));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    same_bytes(L.out_graph, L.out_eager, "first replay");

    /* a larger eager call regrows (frees and reallocates) the context's scratch */
    layer big = layer_new(700, 8, 2, 256, 128);
    OK(layer_issue(&big, 0));
    OK(moefuse_synchronize(g_ctx));

    /* new inputs: the graph reads them, its scratch is still its own */
    tb_fill_unif(L.x, -2.0, 2.0);
    tb_upload(L.x);
    layer_fill_routing(&L);
    replay(exec, cs);
    replay(exec, cs); /* twice: its scratch is allocated and freed inside each replay */
    OK(layer_issue(&L, 0));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    same_bytes(L.out_graph, L.out_eager, "replay after new inputs and regrown scratch");
    CU(cudaGraphExecDestroy(exec));
    CU(cudaStreamDestroy(cs));
    tb_free_all();
}
END_TEST

/* ---------------------------------------------------------- the row operations */

typedef struct {
    tbuf *x, *q[2], *s[2];                /* act_quant */
    tbuf *xm, *cnt, *qm[2], *sm[2];       /* act_quant_masked, E above the shared-memory limit */
    tbuf *xq, *qq[2], *sq[2], *dq[2];     /* quant, then dequant of its result */
    tbuf *am[2];                          /* act_mul */
    tbuf *lg, *ids[2], *w[2];             /* topk_softmax */
} rows;

static moefuse_status rows_issue(void *arg, int g)
{
    rows *r = arg;
    moefuse_act_quant_options aq;
    memset(&aq, 0, sizeof aq);
    moefuse_status st = moefuse_act_quant(g_ctx, T(r->x), NULL, T(r->q[g]), T(r->s[g]), &aq);
    aq.zero_tail = 1;
    if (st == MOEFUSE_OK)
        st = moefuse_act_quant_masked(g_ctx, T(r->xm), T(r->cnt), NULL, NULL, T(r->qm[g]),
                                      T(r->sm[g]), &aq);
    if (st == MOEFUSE_OK)
        st = moefuse_quant(g_ctx, T(r->xq), T(r->qq[g]), T(r->sq[g]), NULL);
    if (st == MOEFUSE_OK)
        st = moefuse_dequant(g_ctx, T(r->qq[g]), T(r->sq[g]), T(r->dq[g]), NULL);
    if (st == MOEFUSE_OK)
        st = moefuse_act_mul(g_ctx, T(r->x), NULL, T(r->am[g]), NULL);
    if (st == MOEFUSE_OK)
        st = moefuse_topk_softmax(g_ctx, T(r->lg), 1, T(r->ids[g]), T(r->w[g]));
    return st;
}

START_TEST(row_ops_in_a_graph)
{
    const int64_t Tn = 37, H = 256, Gn = H / 128, E = 4100, Tmax = 2, Ex = 64, k = 6;
    static const char *side[2] = {"eager", "graph"};
    rows r;
    r.x = tb_new2("x", MOEFUSE_BF16, Tn, 2 * H, 0, 1);
    r.xm = tb_new3("x_masked", MOEFUSE_BF16, E, Tmax, 2 * H, 0, 1);
    r.cnt = tb_new1("counts", MOEFUSE_I32, E, 1);
    r.xq = tb_new2("x_quant", MOEFUSE_F16, Tn, H, 0, 1);
    r.lg = tb_new2("logits", MOEFUSE_F32, Tn, Ex, 0, 1);
    for (int g = 0; g < 2; g++) {
        char n[48];
#define NAME(what) (snprintf(n, sizeof n, "%s_%s", what, side[g]), n)
        r.q[g] = tb_new2(NAME("q"), MOEFUSE_F8_E4M3, Tn, H, 0, 0);
        r.s[g] = tb_new2(NAME("scales"), MOEFUSE_F32, Tn, Gn, 0, 0);
        r.qm[g] = tb_new3(NAME("q_masked"), MOEFUSE_F8_E4M3, E, Tmax, H, 0, 0);
        r.sm[g] = tb_new3(NAME("scales_masked"), MOEFUSE_F32, E, Tmax, Gn, 0, 0);
        r.qq[g] = tb_new2(NAME("q_quant"), MOEFUSE_I8, Tn, H, 0, 0);
        r.sq[g] = tb_new2(NAME("scales_quant"), MOEFUSE_F32, Tn, Gn, 0, 0);
        r.dq[g] = tb_new2(NAME("dequant"), MOEFUSE_F32, Tn, H, 0, 0);
        r.am[g] = tb_new2(NAME("act_mul"), MOEFUSE_BF16, Tn, H, 0, 0);
        r.ids[g] = tb_new2(NAME("ids"), MOEFUSE_I32, Tn, k, 0, 0);
        r.w[g] = tb_new2(NAME("weights"), MOEFUSE_F32, Tn, k, 0, 0);
#undef NAME
    }
    tb_fill_unif(r.x, -4.0, 4.0);
    tb_fill_unif(r.xm, -4.0, 4.0);
    tb_fill_unif(r.xq, -3.0, 3.0);
    tb_fill_unif(r.lg, -5.0, 5.0);
    for (int64_t e = 0; e < E; e++) /* untrusted counts: negative and above Tmax too */
        tb_set(r.cnt, e, 0, 0, (double)h_randint(-1, Tmax + 1));
    tb_upload(r.x);
    tb_upload(r.xm);
    tb_upload(r.cnt);
    tb_upload(r.xq);
    tb_upload(r.lg);

    cudaStream_t cs;
    CU(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    cudaGraphExec_t exec = capture(cs, rows_issue, &r);
    replay(exec, cs);
    OK(rows_issue(&r, 0));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    tbuf *pairs[][2] = {{r.q[1], r.q[0]},   {r.s[1], r.s[0]},     {r.qm[1], r.qm[0]},
                        {r.sm[1], r.sm[0]}, {r.qq[1], r.qq[0]},   {r.sq[1], r.sq[0]},
                        {r.dq[1], r.dq[0]}, {r.am[1], r.am[0]},   {r.ids[1], r.ids[0]},
                        {r.w[1], r.w[0]}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        same_bytes(pairs[i][0], pairs[i][1], "row operations, graph vs eager");
    CU(cudaGraphExecDestroy(exec));
    CU(cudaStreamDestroy(cs));
    tb_free_all();
}
END_TEST

/* ------------------------------------------------------------ two streams */

/* A large call on stream a, a small one on stream b right after (same scratch,
 * no host wait), then both again on the context's own stream: same bits. */
START_TEST(streams_switch_without_waiting)
{
    cudaStream_t a, b;
    CU(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    CU(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    layer big = layer_new(2048, 8, 2, 512, 256);
    layer small = layer_new(96, 8, 2, 512, 256);
    for (int round = 0; round < 3; round++) {
        OK(moefuse_set_stream(g_ctx, a));
        OK(layer_issue(&big, 1));
        OK(moefuse_set_stream(g_ctx, b));
        OK(layer_issue(&small, 1));
        OK(moefuse_set_stream(g_ctx, a));
        OK(layer_issue(&small, 0)); /* b may still be routing in the scratch */
    }
    CU(cudaStreamSynchronize(a));
    CU(cudaStreamSynchronize(b));
    OK(moefuse_set_stream(g_ctx, NULL));
    h_check_all(0);
    same_bytes(small.out_eager, small.out_graph, "the small layer on stream a after stream b");
    tbuf *one_stream = tb_new2("big_one_stream", MOEFUSE_BF16, 2048, 512, 0, 0);
    OK(moefuse_moe_forward(g_ctx, T(big.x), T(big.w1), T(big.w2), NULL, NULL, &big.R,
                           T(one_stream), NULL));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    same_bytes(big.out_graph, one_stream, "the large layer on stream a, against one stream");
    CU(cudaStreamDestroy(a));
    CU(cudaStreamDestroy(b));
    tb_free_all();
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cuda_graph");
    TCase *tc = tcase_create("cuda_graph");
    tcase_add_checked_fixture(tc, h_setup, h_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, moe_forward_in_a_graph, 0, 2);
    tcase_add_test(tc, row_ops_in_a_graph);
    tcase_add_test(tc, streams_switch_without_waiting);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return h_run(suite()); }
