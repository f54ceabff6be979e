/* test_cuda_graph: the MoE layer and the row operations in a graph. */
#include "test_cuda_graph.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

layer layer_new(int64_t M, int64_t E, int64_t k, int64_t K, int64_t I)
{
    layer L;
    memset(&L, 0, sizeof L);
    L.M = M, L.E = E, L.k = k, L.K = K, L.I = I;
    L.x = tb_new2("x", MOEFUSE_BF16, M, K, 0, 1);
    L.w1 = tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1);
    L.w2 = tb_new3("w2", MOEFUSE_BF16, E, K, I, 0, 1);
    L.ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1);
    L.wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    L.out_eager = tb_new2("out_eager", MOEFUSE_BF16, M, K, 0, 0);
    L.out_graph = tb_new2("out_graph", MOEFUSE_BF16, M, K, 0, 0);
    /* twins on the CPU: every tb_upload of an input reaches them too */
    tb_twin(L.x, g_ref);
    tb_twin(L.w1, g_ref);
    tb_twin(L.w2, g_ref);
    tb_twin(L.ids, g_ref);
    tb_twin(L.wts, g_ref);
    L.out_cpu = tb_twin(L.out_eager, g_ref);
    repoison(L.out_cpu); /* unlike the device's: both sides leaving an element alone fails */
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
    L.R_cpu = L.R;
    L.R_cpu.topk_ids = L.ids->twin->t;
    L.R_cpu.topk_weights = L.wts->twin->t;
    return L;
}

moefuse_status layer_issue(void *arg, int graph)
{
    layer *L = arg;
    return moefuse_moe_forward(g_ctx, T(L->x), T(L->w1), T(L->w2), NULL, NULL, &L->R,
                               graph ? T(L->out_graph) : T(L->out_eager), NULL);
}

/* The layer on the CPU from the current inputs, and `out` (device, read back) against it. */
void layer_vs_cpu(layer *L, tbuf *out, const char *what)
{
    moefuse_status st = moefuse_moe_forward(g_ref, T(L->x->twin), T(L->w1->twin), T(L->w2->twin),
                                            NULL, NULL, &L->R_cpu, T(L->out_cpu), NULL);
    HCHECK(st == MOEFUSE_OK, "moe_forward on the cpu: %s", moefuse_last_error(g_ref));
    h_check_all(0);
    cmp_gemm(out, L->out_cpu, L->M, L->K, what);
}

/* M = 1: the direct (decode) path; M = 96: routed, with route kernels and scratch lists. */
START_TEST(moe_forward_in_a_graph)
{
    static const int64_t Ms[] = {1, 96};
    const int64_t M = Ms[_i];
    cudaStream_t cs = new_stream();
    layer L = layer_new(M, 8, 2, 256, 128);
    /* captured first: the context has no scratch yet */
    cudaGraphExec_t exec = capture(cs, layer_issue, &L);
    replay(exec, cs);
    OK(layer_issue(&L, 0));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    same_bytes(L.out_graph, L.out_eager, "first replay");
    layer_vs_cpu(&L, L.out_graph, "moe_forward, first replay");
    layer_vs_cpu(&L, L.out_eager, "moe_forward, eager");

    /* a larger eager call regrows (frees and reallocates) the context's scratch */
    layer big = layer_new(700, 8, 2, 256, 128);
    OK(layer_issue(&big, 0));
    OK(moefuse_synchronize(g_ctx));

    /* new inputs: the graph reads them, its scratch is still its own */
    tb_upload_unif(L.x, -2.0, 2.0);
    layer_fill_routing(&L);
    for (int r = 0; r < 2; r++) { /* twice: its scratch is allocated and freed inside each replay */
        repoison(L.out_graph);
        replay(exec, cs);
        layer_vs_cpu(&L, L.out_graph, r ? "moe_forward, second replay after new inputs"
                                        : "moe_forward, replay after new inputs and regrown scratch");
    }
    repoison(L.out_eager);
    OK(layer_issue(&L, 0));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    same_bytes(L.out_graph, L.out_eager, "replay after new inputs and regrown scratch");
    layer_vs_cpu(&L, L.out_eager, "moe_forward, eager after new inputs");
    graph_done(exec, cs);
}
END_TEST

typedef struct {
    tbuf *x, *q[SIDES], *s[SIDES];          /* act_quant */
    tbuf *xm, *cnt, *qm[SIDES], *sm[SIDES]; /* act_quant_masked, E above the shared-memory limit */
    tbuf *xq, *qq[SIDES], *sq[SIDES], *dq[SIDES]; /* quant, then dequant of its result */
    tbuf *am[SIDES];                        /* act_mul */
    tbuf *lg, *ids[SIDES], *w[SIDES];       /* topk_softmax */
} rows;

/* An input as the side sees it: the CPU reads its twin. */
tbuf *in(tbuf *input, int side) { return side == CPU ? input->twin : input; }

static moefuse_status rows_run(void *arg, int side)
{
    rows *r = arg;
    moefuse_context *ctx = side == CPU ? g_ref : g_ctx;
    moefuse_act_quant_options aq;
    memset(&aq, 0, sizeof aq);
    moefuse_status st =
        moefuse_act_quant(ctx, T(in(r->x, side)), NULL, T(r->q[side]), T(r->s[side]), &aq);
    aq.zero_tail = 1;
    if (st == MOEFUSE_OK)
        st = moefuse_act_quant_masked(ctx, T(in(r->xm, side)), T(in(r->cnt, side)), NULL, NULL,
                                      T(r->qm[side]), T(r->sm[side]), &aq);
    if (st == MOEFUSE_OK)
        st = moefuse_quant(ctx, T(in(r->xq, side)), T(r->qq[side]), T(r->sq[side]), NULL);
    if (st == MOEFUSE_OK)
        st = moefuse_dequant(ctx, T(r->qq[side]), T(r->sq[side]), T(r->dq[side]), NULL);
    if (st == MOEFUSE_OK)
        st = moefuse_act_mul(ctx, T(in(r->x, side)), NULL, T(r->am[side]), NULL);
    if (st == MOEFUSE_OK)
        st = moefuse_topk_softmax(ctx, T(in(r->lg, side)), 1, T(r->ids[side]), T(r->w[side]));
    return st;
}

static moefuse_status rows_issue(void *arg, int graph) { return rows_run(arg, graph ? GRAPH : EAGER); }

/* The CPU's output beside a device one: its twin, named for the CPU. */
tbuf *cpu_output(tbuf *dev, const char *what)
{
    tbuf *c = tb_twin(dev, g_ref);
    snprintf(c->name, sizeof c->name, "%s_cpu", what);
    repoison(c); /* unlike the device's: both sides leaving an element alone fails */
    return c;
}

/* An output on each side, of `rank` dims: "<what>_eager" and "<what>_graph" on the device, and
 * the CPU's. */
void side_outputs(tbuf *out[SIDES], const char *what, moefuse_dtype dt, int rank,
                  const int64_t *shape)
{
    out[EAGER] = tb_new(h_fmt("%s_eager", what), dt, rank, shape, 0, 0);
    out[GRAPH] = tb_new(h_fmt("%s_graph", what), dt, rank, shape, 0, 0);
    out[CPU] = cpu_output(out[EAGER], what);
}

/* Each row operation of the eager call and of the replay against the CPU's. */
static void rows_vs_cpu(rows *r, int64_t Tn, int64_t H, int64_t E, int64_t Tmax, int64_t k)
{
    versus q[2], s[2], qm[2], sm[2];
    for (int d = EAGER; d <= GRAPH; d++) {
        q[d] = versus_new(r->q[d], r->q[CPU], h_fmt("act_quant, %s", side_name[d]));
        s[d] = versus_new(r->s[d], r->s[CPU], q[d].what);
        qm[d] = versus_new(r->qm[d], r->qm[CPU], h_fmt("act_quant_masked, %s", side_name[d]));
        sm[d] = versus_new(r->sm[d], r->sm[CPU], qm[d].what);
    }
    cmp_act_quant_rows(q, s, 2, r->x, -1, Tn, H, 128);
    for (int64_t e = 0; e < E; e++) { /* rows past the clamped count: zeros, as the CPU's */
        const int64_t n = (int64_t)tb_get(r->cnt, e, 0, 0);
        cmp_act_quant_rows(qm, sm, 2, r->xm, e, n < 0 ? 0 : n > Tmax ? Tmax : n, H, 128);
    }
    for (int d = EAGER; d <= GRAPH; d++) {
        versus_end(&q[d]), versus_end(&s[d]), versus_end(&qm[d]), versus_end(&sm[d]);
        /* quant and dequant: no exp on the way, bit-equal */
        same_as_cpu(r->qq[d], r->qq[CPU], h_fmt("quant, %s", side_name[d]));
        same_as_cpu(r->sq[d], r->sq[CPU], h_fmt("quant, %s", side_name[d]));
        same_as_cpu(r->dq[d], r->dq[CPU], h_fmt("dequant, %s", side_name[d]));
        cmp_act_mul(r->am[d], r->am[CPU], Tn, H, h_fmt("act_mul, %s", side_name[d]));
        same_as_cpu(r->ids[d], r->ids[CPU], h_fmt("topk_softmax ids, %s", side_name[d]));
        cmp_topk_weights(r->w[d], r->w[CPU], Tn, k,
                         h_fmt("topk_softmax weights, %s", side_name[d]));
    }
}

/* With the caller's workspace the captured layer allocates nothing: the graph has no memory
 * nodes, and its replays give the eager call's bytes. */
START_TEST(moe_forward_in_a_graph_with_workspace)
{
    static const int64_t Ms[] = {1, 96};
    const int64_t M = Ms[_i];
    cudaStream_t cs = new_stream();
    layer L = layer_new(M, 8, 2, 256, 128);
    size_t bytes = 0;
    OK(moefuse_moe_forward_workspace_size(g_ctx, T(L.x), T(L.w1), T(L.w2), NULL, NULL, &L.R,
                                          T(L.out_graph), NULL, &bytes));
    HCHECK(bytes > 0, "moe_forward M=%lld: the query says it takes no workspace", (long long)M);
    void *buf = NULL;
    CU(cudaMalloc(&buf, bytes));
    const int64_t n = (int64_t)bytes;
    const moefuse_tensor ws = moefuse_tensor_dense(buf, MOEFUSE_U8, 1, &n);
    OK(moefuse_set_workspace(g_ctx, &ws));

    cudaGraph_t graph = capture_graph(cs, layer_issue, &L);
    size_t count = 0;
    CU(cudaGraphGetNodes(graph, NULL, &count));
    cudaGraphNode_t *nodes = calloc(count ? count : 1, sizeof *nodes);
    CU(cudaGraphGetNodes(graph, nodes, &count));
    for (size_t i = 0; i < count; i++) {
        enum cudaGraphNodeType type;
        CU(cudaGraphNodeGetType(nodes[i], &type));
        HCHECK(type != cudaGraphNodeTypeMemAlloc && type != cudaGraphNodeTypeMemFree,
               "node %zu of %zu of the captured layer allocates or frees memory", i, count);
    }
    free(nodes);
    cudaGraphExec_t exec = NULL;
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphDestroy(graph));

    for (int r = 0; r < 2; r++) {
        if (r) { /* new inputs */
            tb_upload_unif(L.x, -2.0, 2.0);
            layer_fill_routing(&L);
            repoison(L.out_graph);
            repoison(L.out_eager);
        }
        replay(exec, cs);
        OK(layer_issue(&L, 0)); /* eager, in the same workspace */
        OK(moefuse_synchronize(g_ctx));
        h_check_all(0);
        same_bytes(L.out_graph, L.out_eager, r ? "replay after new inputs" : "first replay");
        layer_vs_cpu(&L, L.out_graph, "moe_forward in a graph, caller's workspace");
    }
    OK(moefuse_set_workspace(g_ctx, NULL));
    graph_done(exec, cs);
    CU(cudaFree(buf));
}
END_TEST

START_TEST(row_ops_in_a_graph)
{
    const int64_t Tn = 37, H = 256, Gn = H / 128, E = 4100, Tmax = 2, Ex = 64, k = 6;
    rows r;
    r.x = tb_new2("x", MOEFUSE_BF16, Tn, 2 * H, 0, 1);
    r.xm = tb_new3("x_masked", MOEFUSE_BF16, E, Tmax, 2 * H, 0, 1);
    r.cnt = tb_new1("counts", MOEFUSE_I32, E, 1);
    r.xq = tb_new2("x_quant", MOEFUSE_F16, Tn, H, 0, 1);
    r.lg = tb_new2("logits", MOEFUSE_F32, Tn, Ex, 0, 1);
    tbuf *inputs[] = {r.x, r.xm, r.cnt, r.xq, r.lg};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) tb_twin(inputs[i], g_ref);
    const int64_t rows_h[2] = {Tn, H}, rows_g[2] = {Tn, Gn}, rows_k[2] = {Tn, k};
    side_outputs(r.q, "q", MOEFUSE_F8_E4M3, 2, rows_h);
    side_outputs(r.s, "scales", MOEFUSE_F32, 2, rows_g);
    side_outputs(r.qm, "q_masked", MOEFUSE_F8_E4M3, 3, (int64_t[]){E, Tmax, H});
    side_outputs(r.sm, "scales_masked", MOEFUSE_F32, 3, (int64_t[]){E, Tmax, Gn});
    side_outputs(r.qq, "q_quant", MOEFUSE_I8, 2, rows_h);
    side_outputs(r.sq, "scales_quant", MOEFUSE_F32, 2, rows_g);
    side_outputs(r.dq, "dequant", MOEFUSE_F32, 2, rows_h);
    side_outputs(r.am, "act_mul", MOEFUSE_BF16, 2, rows_h);
    side_outputs(r.ids, "ids", MOEFUSE_I32, 2, rows_k);
    side_outputs(r.w, "weights", MOEFUSE_F32, 2, rows_k);
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

    cudaStream_t cs = new_stream();
    cudaGraphExec_t exec = capture(cs, rows_issue, &r);
    replay_eager_cpu(exec, cs, rows_run, &r, "row operations");
    tbuf *pairs[][2] = {{r.q[1], r.q[0]},   {r.s[1], r.s[0]},     {r.qm[1], r.qm[0]},
                        {r.sm[1], r.sm[0]}, {r.qq[1], r.qq[0]},   {r.sq[1], r.sq[0]},
                        {r.dq[1], r.dq[0]}, {r.am[1], r.am[0]},   {r.ids[1], r.ids[0]},
                        {r.w[1], r.w[0]}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        same_bytes(pairs[i][0], pairs[i][1], "row operations, graph vs eager");
    rows_vs_cpu(&r, Tn, H, E, Tmax, k);
    graph_done(exec, cs);
}
END_TEST

void cuda_graph_layer_tests(TCase *tc)
{
    tcase_add_loop_test(tc, moe_forward_in_a_graph, 0, 2);
    tcase_add_loop_test(tc, moe_forward_in_a_graph_with_workspace, 0, 2);
    tcase_add_test(tc, row_ops_in_a_graph);
}
