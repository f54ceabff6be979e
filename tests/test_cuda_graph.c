/*
 * The CUDA backend under CUDA graphs and foreign streams:
 *  - every operation captured into a graph (global capture mode, with no eager
 *    call before it) replays to the same bits as the eager call, again after
 *    the inputs change and after the context's scratch has been regrown;
 *  - the eager call and every replay agree with the CPU golden backend run on
 *    the same inputs (tb_twin), as NUMERICS.md's agreement section requires:
 *    the row ops and the router bit-equal, the bf16 MoE layer within a relative
 *    error of 8e-3; every other element byte equal. So an eager call and a graph that both write nothing, or both
 *    compute the same wrong thing, fail;
 *  - the stream is attached while it is capturing, as torch.cuda.graph does;
 *  - a whole decode layer (the router's topk_softmax, then moe_forward on its
 *    ids and weights) captured as one graph replays as the eager calls do, with
 *    its inputs rewritten by cudaMemcpyAsync on the stream before each replay;
 *  - calls alternating between streams, with no host wait between them, give
 *    the results of calls on one stream (the scratch orders itself);
 *  - the testing switches MOEFUSE_CUDA_GEMM and MOEFUSE_CUDA_SPLIT refuse
 *    values they do not know at context creation;
 *  - moefuse_context_create_on chooses the device by index.
 * Outputs are poisoned again before each replay, so a replay that writes
 * nothing cannot pass on what an earlier one left. Runs on "cuda" only;
 * skipped without a device (h_run).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
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

/* HCHECK inside loops over elements: Check records every assertion that passes, which is slow. */
#define EXPECT(cond, ...)                                                                        \
    do {                                                                                         \
        if (!(cond))                                                                             \
            HCHECK(0, __VA_ARGS__);                                                              \
    } while (0)

/* Two tensors made alike (same shape, pads and dtype): every element byte equal. */
static void same_bytes(tbuf *got, tbuf *want, const char *what)
{
    HCHECK(got->total == want->total, "%s: %s and %s differ in size", what, got->name, want->name);
    for (size_t i = 0; i < got->total; i++)
        if (got->logical[i])
            EXPECT(got->full[i] == want->full[i],
                   "%s: %s byte %zu is 0x%02x, %s has 0x%02x", what, got->name, i - got->pad,
                   got->full[i], want->name, want->full[i]);
}

/* Fresh poison in every element byte of an output (a pattern of its own, unlike tb_new's). */
static void repoison(tbuf *tb)
{
    for (size_t i = 0; i < tb->total; i++)
        if (tb->logical[i]) tb->full[i] = (unsigned char)(0x5C ^ (i * 0x47));
    tb_upload(tb);
}

/* ------------------------------------------------- agreement with the CPU */

/* A device output against the CPU's: bytes judged by a tolerance, all other element bytes equal. */
typedef struct {
    tbuf *dev, *cpu;
    unsigned char *judged;
    char what[96]; /* a copy: h_fmt's buffers are reused */
} versus;

static versus versus_new(tbuf *dev, tbuf *cpu, const char *what)
{
    versus v = {dev, cpu, calloc(dev->total, 1), ""};
    snprintf(v.what, sizeof v.what, "%s", what);
    return v;
}

static void judge(versus *v, const void *dev_el, size_t n)
{
    memset(v->judged + ((const unsigned char *)dev_el - v->dev->full), 1, n);
}

static void versus_end(versus *v)
{
    for (size_t i = 0; i < v->dev->total; i++)
        if (v->dev->logical[i] && !v->judged[i])
            EXPECT(v->dev->full[i] == v->cpu->full[i],
                   "%s: '%s' byte %zu is 0x%02x, on the cpu 0x%02x; they must be equal", v->what,
                   v->dev->name, i - v->dev->pad, v->dev->full[i], v->cpu->full[i]);
    free(v->judged);
}

/* The element of (e, t, c) of a 2-D (e < 0) or 3-D tensor. */
static void *el(tbuf *tb, int64_t e, int64_t t, int64_t c)
{
    return e < 0 ? tb_el(tb, t, c, 0) : tb_el(tb, e, t, c);
}

/*
 * Rows [0, n) of silu act_quant (FP8 codes, row-major f32 scales, group G) of
 * expert e (e < 0: the 2-D call), for each of `sides` device results: scales and
 * codes bit-equal to the cpu's (the inputs are finite).
 */
static void cmp_act_quant_rows(versus *qs, versus *scs, int sides, tbuf *x, int64_t e, int64_t n,
                               int64_t H, int64_t G)
{
    (void)x;
    for (int side = 0; side < sides; side++) {
        versus *q = &qs[side], *sc = &scs[side];
        for (int64_t t = 0; t < n; t++)
            for (int64_t g = 0; g < H / G; g++) {
                float *sd = h_scale_el(sc->dev, MOEFUSE_SCALE_ROW_MAJOR, e, t, g);
                float *scp = h_scale_el(sc->cpu, MOEFUSE_SCALE_ROW_MAJOR, e, t, g);
                judge(sc, sd, 4);
                EXPECT(memcmp(sd, scp, 4) == 0,
                       "%s: e=%lld t=%lld group %lld: scale %a, on the cpu %a: must be bit-equal",
                       sc->what, (long long)e, (long long)t, (long long)g, *sd, *scp);
                for (int64_t c = g * G; c < (g + 1) * G; c++) {
                    uint8_t *cd = el(q->dev, e, t, c), *cc = el(q->cpu, e, t, c);
                    judge(q, cd, 1);
                    EXPECT(*cd == *cc,
                           "%s: e=%lld t=%lld channel %lld: code 0x%02x, on the cpu 0x%02x: must be "
                           "equal", q->what, (long long)e, (long long)t, (long long)c, *cd, *cc);
                }
            }
    }
}

/* silu act_mul, bf16 out [Tn, H]: bit-equal to the cpu's (NUMERICS.md, "Agreement between
 * backends"). */
static void cmp_act_mul(versus *out, int64_t Tn, int64_t H)
{
    for (int64_t t = 0; t < Tn; t++)
        for (int64_t c = 0; c < H; c++) {
            uint16_t bd, bc;
            memcpy(&bd, tb_el(out->dev, t, c, 0), 2);
            memcpy(&bc, tb_el(out->cpu, t, c, 0), 2);
            judge(out, tb_el(out->dev, t, c, 0), 2);
            double vd = tb_get(out->dev, t, c, 0), vc = tb_get(out->cpu, t, c, 0);
            EXPECT(bd == bc, "%s [%lld, %lld]: %.9g, on the cpu %.9g: must be bit-equal",
                   out->what, (long long)t, (long long)c, vd, vc);
        }
}

/* topk_softmax with renormalize, f32 weights: ids (unjudged bytes) and weights bit-equal. */
static void cmp_topk_weights(versus *w, int64_t M, int64_t E, int64_t k)
{
    (void)E;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            double a = tb_get(w->dev, m, j, 0), b = tb_get(w->cpu, m, j, 0);
            judge(w, tb_el(w->dev, m, j, 0), 4);
            EXPECT(memcmp(tb_el(w->dev, m, j, 0), tb_el(w->cpu, m, j, 0), 4) == 0,
                   "%s: row %lld slot %lld: weight %a, on the cpu %a: must be bit-equal", w->what,
                   (long long)m, (long long)j, a, b);
        }
}

/* A bf16 GEMM output [M, K]: finite, and ||dev - cpu|| / ||cpu|| <= 8e-3 (NUMERICS.md, "Agreement between backends"). */
static void cmp_gemm(tbuf *dev, tbuf *cpu, int64_t M, int64_t K, const char *what)
{
    double num = 0, den = 0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K; c++) {
            double a = tb_get(dev, m, c, 0), b = tb_get(cpu, m, c, 0);
            EXPECT(isfinite(a) && isfinite(b), "%s [%lld, %lld]: %a, on the cpu %a", what, (long long)m,
                   (long long)c, a, b);
            num += (a - b) * (a - b);
            den += b * b;
        }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    HCHECK(rel <= 8e-3, "%s: relative error %.3g against the cpu; NUMERICS.md allows 8e-3 for bf16", what, rel);
}

/* ------------------------------------------------------------------ capture */

typedef moefuse_status (*issue_fn)(void *arg, int graph);

/* The graph of issue(arg, 1) captured on stream cs, cs attached to the context mid-capture
 * (and the context's own stream again after it). */
static cudaGraph_t capture_graph(cudaStream_t cs, issue_fn issue, void *arg)
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
    OK(moefuse_set_stream(g_ctx, NULL));
    return graph;
}

/* The same, instantiated. */
static cudaGraphExec_t capture(cudaStream_t cs, issue_fn issue, void *arg)
{
    cudaGraph_t graph = capture_graph(cs, issue, arg);
    cudaGraphExec_t exec = NULL;
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphDestroy(graph));
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
    tbuf *out_cpu; /* the CPU's result from the inputs' twins */
    moefuse_routing R, R_cpu;
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

static moefuse_status layer_issue(void *arg, int graph)
{
    layer *L = arg;
    return moefuse_moe_forward(g_ctx, T(L->x), T(L->w1), T(L->w2), NULL, NULL, &L->R,
                               graph ? T(L->out_graph) : T(L->out_eager), NULL);
}

/* The layer on the CPU from the current inputs, and `out` (device, read back) against it. */
static void layer_vs_cpu(layer *L, tbuf *out, const char *what)
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
    layer_vs_cpu(&L, L.out_graph, "moe_forward, first replay");
    layer_vs_cpu(&L, L.out_eager, "moe_forward, eager");

    /* a larger eager call regrows (frees and reallocates) the context's scratch */
    layer big = layer_new(700, 8, 2, 256, 128);
    OK(layer_issue(&big, 0));
    OK(moefuse_synchronize(g_ctx));

    /* new inputs: the graph reads them, its scratch is still its own */
    tb_fill_unif(L.x, -2.0, 2.0);
    tb_upload(L.x);
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
    CU(cudaGraphExecDestroy(exec));
    CU(cudaStreamDestroy(cs));
    tb_free_all();
}
END_TEST

/* ---------------------------------------------------------- the row operations */

/* Where a row operation runs: the device eagerly, the device in a graph, the CPU golden backend. */
enum { EAGER, GRAPH, CPU, SIDES };

typedef struct {
    tbuf *x, *q[SIDES], *s[SIDES];          /* act_quant */
    tbuf *xm, *cnt, *qm[SIDES], *sm[SIDES]; /* act_quant_masked, E above the shared-memory limit */
    tbuf *xq, *qq[SIDES], *sq[SIDES], *dq[SIDES]; /* quant, then dequant of its result */
    tbuf *am[SIDES];                        /* act_mul */
    tbuf *lg, *ids[SIDES], *w[SIDES];       /* topk_softmax */
} rows;

/* An input as the side sees it: the CPU reads its twin. */
static tbuf *in(tbuf *input, int side) { return side == CPU ? input->twin : input; }

static moefuse_status rows_run(rows *r, int side)
{
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
static tbuf *cpu_output(tbuf *dev, const char *what)
{
    tbuf *c = tb_twin(dev, g_ref);
    snprintf(c->name, sizeof c->name, "%s_cpu", what);
    repoison(c); /* unlike the device's: both sides leaving an element alone fails */
    return c;
}

/* Each row operation of the eager call and of the replay against the CPU's. */
static void rows_vs_cpu(rows *r, int64_t Tn, int64_t H, int64_t E, int64_t Tmax, int64_t Ex,
                        int64_t k)
{
    static const char *const side_name[2] = {"eager", "graph replay"};
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
        versus v = versus_new(r->qq[d], r->qq[CPU], h_fmt("quant, %s", side_name[d]));
        versus_end(&v);
        v = versus_new(r->sq[d], r->sq[CPU], v.what);
        versus_end(&v);
        v = versus_new(r->dq[d], r->dq[CPU], h_fmt("dequant, %s", side_name[d]));
        versus_end(&v);
        v = versus_new(r->am[d], r->am[CPU], h_fmt("act_mul, %s", side_name[d]));
        cmp_act_mul(&v, Tn, H);
        versus_end(&v);
        v = versus_new(r->ids[d], r->ids[CPU], h_fmt("topk_softmax ids, %s", side_name[d]));
        versus_end(&v);
        v = versus_new(r->w[d], r->w[CPU], h_fmt("topk_softmax weights, %s", side_name[d]));
        cmp_topk_weights(&v, Tn, Ex, k);
        versus_end(&v);
    }
}

/* With the caller's workspace the captured layer allocates nothing: the graph has no memory
 * nodes, and its replays give the eager call's bytes. */
START_TEST(moe_forward_in_a_graph_with_workspace)
{
    static const int64_t Ms[] = {1, 96};
    const int64_t M = Ms[_i];
    cudaStream_t cs;
    CU(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
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
            tb_fill_unif(L.x, -2.0, 2.0);
            tb_upload(L.x);
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
    CU(cudaGraphExecDestroy(exec));
    CU(cudaFree(buf));
    CU(cudaStreamDestroy(cs));
    tb_free_all();
}
END_TEST

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
    tbuf *inputs[] = {r.x, r.xm, r.cnt, r.xq, r.lg};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) tb_twin(inputs[i], g_ref);
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
    r.q[CPU] = cpu_output(r.q[EAGER], "q");
    r.s[CPU] = cpu_output(r.s[EAGER], "scales");
    r.qm[CPU] = cpu_output(r.qm[EAGER], "q_masked");
    r.sm[CPU] = cpu_output(r.sm[EAGER], "scales_masked");
    r.qq[CPU] = cpu_output(r.qq[EAGER], "q_quant");
    r.sq[CPU] = cpu_output(r.sq[EAGER], "scales_quant");
    r.dq[CPU] = cpu_output(r.dq[EAGER], "dequant");
    r.am[CPU] = cpu_output(r.am[EAGER], "act_mul");
    r.ids[CPU] = cpu_output(r.ids[EAGER], "ids");
    r.w[CPU] = cpu_output(r.w[EAGER], "weights");
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
    moefuse_status st = rows_run(&r, CPU);
    HCHECK(st == MOEFUSE_OK, "row operations on the cpu: %s", moefuse_last_error(g_ref));
    h_check_all(0);
    tbuf *pairs[][2] = {{r.q[1], r.q[0]},   {r.s[1], r.s[0]},     {r.qm[1], r.qm[0]},
                        {r.sm[1], r.sm[0]}, {r.qq[1], r.qq[0]},   {r.sq[1], r.sq[0]},
                        {r.dq[1], r.dq[0]}, {r.am[1], r.am[0]},   {r.ids[1], r.ids[0]},
                        {r.w[1], r.w[0]}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        same_bytes(pairs[i][0], pairs[i][1], "row operations, graph vs eager");
    rows_vs_cpu(&r, Tn, H, E, Tmax, Ex, k);
    CU(cudaGraphExecDestroy(exec));
    CU(cudaStreamDestroy(cs));
    tb_free_all();
}
END_TEST

/* ---------------------------------------------------------- a decode layer */

/* Router then MoE layer, as a decode step runs them: one graph for both. */
typedef struct {
    int64_t M, E, k, K, I;
    tbuf *lg, *x, *w1, *w2;                     /* inputs, with twins on the cpu */
    tbuf *ids[SIDES], *wts[SIDES], *out[SIDES]; /* the router's result feeds the layer */
    moefuse_routing R[SIDES];
} decode;

static moefuse_status decode_run(decode *D, int side)
{
    moefuse_context *ctx = side == CPU ? g_ref : g_ctx;
    moefuse_status st =
        moefuse_topk_softmax(ctx, T(in(D->lg, side)), 1, T(D->ids[side]), T(D->wts[side]));
    if (st == MOEFUSE_OK)
        st = moefuse_moe_forward(ctx, T(in(D->x, side)), T(in(D->w1, side)), T(in(D->w2, side)),
                                 NULL, NULL, &D->R[side], T(D->out[side]), NULL);
    return st;
}

static moefuse_status decode_issue(void *arg, int graph)
{
    return decode_run(arg, graph ? GRAPH : EAGER);
}

static decode decode_new(int64_t M, int64_t E, int64_t k, int64_t K, int64_t I)
{
    static const char *side[2] = {"eager", "graph"};
    decode D;
    memset(&D, 0, sizeof D);
    D.M = M, D.E = E, D.k = k, D.K = K, D.I = I;
    D.lg = tb_new2("logits", MOEFUSE_F32, M, E, 0, 1);
    D.x = tb_new2("x", MOEFUSE_BF16, M, K, 0, 1);
    D.w1 = tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1);
    D.w2 = tb_new3("w2", MOEFUSE_BF16, E, K, I, 0, 1);
    tbuf *inputs[] = {D.lg, D.x, D.w1, D.w2};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) tb_twin(inputs[i], g_ref);
    for (int g = 0; g < 2; g++) {
        char n[48];
#define NAME(what) (snprintf(n, sizeof n, "%s_%s", what, side[g]), n)
        D.ids[g] = tb_new2(NAME("ids"), MOEFUSE_I32, M, k, 0, 0);
        D.wts[g] = tb_new2(NAME("weights"), MOEFUSE_F32, M, k, 0, 0);
        D.out[g] = tb_new2(NAME("out"), MOEFUSE_BF16, M, K, 0, 0);
#undef NAME
    }
    D.ids[CPU] = cpu_output(D.ids[EAGER], "ids");
    D.wts[CPU] = cpu_output(D.wts[EAGER], "weights");
    D.out[CPU] = cpu_output(D.out[EAGER], "out");
    for (int d = 0; d < SIDES; d++) {
        memset(&D.R[d], 0, sizeof D.R[d]);
        D.R[d].topk_ids = D.ids[d]->t;
        D.R[d].topk_weights = D.wts[d]->t;
    }
    tb_fill_unif(D.lg, -4.0, 4.0);
    tb_fill_unif(D.x, -1.0, 1.0);
    tb_fill_unif(D.w1, -0.1, 0.1);
    tb_fill_unif(D.w2, -0.1, 0.1);
    tb_upload(D.lg);
    tb_upload(D.x);
    tb_upload(D.w1);
    tb_upload(D.w2);
    return D;
}

/* New contents for an input, copied to the device by cudaMemcpyAsync on stream cs, so that
 * they arrive in order with what cs runs next (no host wait); the cpu twin gets them too. */
static void refill_on_stream(tbuf *tb, double lo, double hi, cudaStream_t cs)
{
    tb_fill_unif(tb, lo, hi);
    CU(cudaMemcpyAsync(tb->buf, tb->full, tb->total, cudaMemcpyHostToDevice, cs));
    memcpy(tb->shadow, tb->full, tb->total); /* uploaded: h_check_all holds the input to it */
    memcpy(tb->twin->full, tb->full, tb->total);
    tb_upload(tb->twin);
}

/* The router's ids and weights bit-equal to the cpu's, and the layer's output within
 * NUMERICS.md's agreement bound, for the eager calls and the replay. */
static void decode_vs_cpu(decode *D, const char *when)
{
    static const char *const side_name[2] = {"eager", "graph replay"};
    char what[96];
    for (int d = EAGER; d <= GRAPH; d++) {
        versus v = versus_new(D->ids[d], D->ids[CPU],
                              h_fmt("decode layer topk ids, %s, %s", side_name[d], when));
        versus_end(&v);
        v = versus_new(D->wts[d], D->wts[CPU],
                       h_fmt("decode layer topk weights, %s, %s", side_name[d], when));
        cmp_topk_weights(&v, D->M, D->E, D->k);
        versus_end(&v);
        snprintf(what, sizeof what, "decode layer out, %s, %s", side_name[d], when);
        cmp_gemm(D->out[d], D->out[CPU], D->M, D->K, what);
    }
}

/* M = 1: the router and the direct (decode) path; M = 64: 128 slots, routed. One graph holds
 * both calls; captured before any eager call, replayed twice on new x and logits. */
START_TEST(decode_layer_in_a_graph)
{
    static const int64_t Ms[] = {1, 64};
    const int64_t M = Ms[_i];
    cudaStream_t cs;
    CU(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    decode D = decode_new(M, 8, 2, 256, 512);
    cudaGraphExec_t exec = capture(cs, decode_issue, &D);
    for (int r = 0; r < 2; r++) {
        char when[48];
        snprintf(when, sizeof when, "replay %d on new x and logits", r + 1);
        repoison(D.ids[GRAPH]);
        repoison(D.wts[GRAPH]);
        repoison(D.out[GRAPH]);
        refill_on_stream(D.lg, -4.0, 4.0, cs);
        refill_on_stream(D.x, -1.0, 1.0, cs);
        replay(exec, cs); /* launched behind the copies on cs, no wait in between */
        repoison(D.ids[EAGER]);
        repoison(D.wts[EAGER]);
        repoison(D.out[EAGER]);
        OK(decode_issue(&D, 0));
        OK(moefuse_synchronize(g_ctx));
        moefuse_status st = decode_run(&D, CPU);
        HCHECK(st == MOEFUSE_OK, "decode layer on the cpu: %s", moefuse_last_error(g_ref));
        h_check_all(0);
        same_bytes(D.ids[GRAPH], D.ids[EAGER], when);
        same_bytes(D.wts[GRAPH], D.wts[EAGER], when);
        same_bytes(D.out[GRAPH], D.out[EAGER], when);
        decode_vs_cpu(&D, when);
    }
    CU(cudaGraphExecDestroy(exec));
    CU(cudaStreamDestroy(cs));
    tb_free_all();
}
END_TEST

/* ------------------------------------------- the grouped router and its metadata */

/* DeepSeek-V3's router, then the dispatch metadata of its ids: one graph for both (the
 * metadata's two launches share scratch of the call's own and a programmatic launch). */
typedef struct {
    int64_t M, E, k;
    tbuf *lg, *bias;                        /* inputs, with twins on the cpu */
    tbuf *ids[SIDES], *wts[SIDES];          /* the router's result feeds the metadata */
    tbuf *cnt[SIDES], *off[SIDES], *ord[SIDES], *pos[SIDES], *row[SIDES];
} routed;

static moefuse_status routed_run(routed *r, int side)
{
    moefuse_context *ctx = side == CPU ? g_ref : g_ctx;
    moefuse_router_options o;
    memset(&o, 0, sizeof o);
    o.scoring = MOEFUSE_ROUTER_SIGMOID;
    o.n_group = 8;
    o.topk_group = 4;
    o.renormalize = 1;
    o.scale = 2.5f;
    moefuse_status st = moefuse_topk_route(ctx, T(in(r->lg, side)), NULL, T(in(r->bias, side)),
                                           &o, T(r->ids[side]), T(r->wts[side]));
    if (st != MOEFUSE_OK)
        return st;
    moefuse_routing R;
    memset(&R, 0, sizeof R);
    R.topk_ids = r->ids[side]->t;
    moefuse_routing_meta m;
    memset(&m, 0, sizeof m);
    m.counts = r->cnt[side]->t;
    m.offsets = r->off[side]->t;
    m.order = r->ord[side]->t;
    m.position = r->pos[side]->t;
    m.masked_row = r->row[side]->t;
    return moefuse_routing_metadata(ctx, &R, 16, &m);
}

static moefuse_status routed_issue(void *arg, int graph) { return routed_run(arg, graph ? GRAPH : EAGER); }

/* M = 1 and M = 4096 (the metadata's span path over 16 blocks); replayed twice on new logits. */
START_TEST(router_and_metadata_in_a_graph)
{
    static const int64_t Ms[] = {1, 4096};
    static const char *side[2] = {"eager", "graph"};
    routed r;
    memset(&r, 0, sizeof r);
    r.M = Ms[_i], r.E = 256, r.k = 8;
    const int64_t L = r.M * r.k + r.E * 15;
    r.lg = tb_new2("logits", MOEFUSE_BF16, r.M, r.E, 0, 1);
    r.bias = tb_new1("choice_bias", MOEFUSE_F32, r.E, 1);
    tb_twin(r.lg, g_ref);
    tb_twin(r.bias, g_ref);
    tb_fill_unif(r.lg, -4.0, 4.0);
    tb_fill_unif(r.bias, -0.1, 0.1);
    tb_upload(r.lg); /* and their twins */
    tb_upload(r.bias);
    for (int g = 0; g < 2; g++) {
        char n[48];
#define NAME(what) (snprintf(n, sizeof n, "%s_%s", what, side[g]), n)
        r.ids[g] = tb_new2(NAME("ids"), MOEFUSE_I32, r.M, r.k, 0, 0);
        r.wts[g] = tb_new2(NAME("weights"), MOEFUSE_F32, r.M, r.k, 0, 0);
        r.cnt[g] = tb_new1(NAME("counts"), MOEFUSE_I32, r.E, 0);
        r.off[g] = tb_new1(NAME("offsets"), MOEFUSE_I32, r.E + 1, 0);
        r.ord[g] = tb_new1(NAME("order"), MOEFUSE_I32, L, 0);
        r.pos[g] = tb_new2(NAME("position"), MOEFUSE_I32, r.M, r.k, 0, 0);
        r.row[g] = tb_new2(NAME("masked_row"), MOEFUSE_I32, r.M, r.k, 0, 0);
#undef NAME
    }
    tbuf **outs[] = {r.ids, r.wts, r.cnt, r.off, r.ord, r.pos, r.row};
    static const char *names[] = {"ids", "weights", "counts", "offsets", "order", "position",
                                  "masked_row"};
    for (size_t i = 0; i < 7; i++)
        outs[i][CPU] = cpu_output(outs[i][EAGER], names[i]);
    cudaStream_t cs;
    CU(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    cudaGraphExec_t exec = capture(cs, routed_issue, &r);
    for (int rep = 0; rep < 2; rep++) {
        for (size_t i = 0; i < 7; i++) { /* three patterns: no element may be left alone */
            repoison(outs[i][EAGER]); /* its twin, the cpu's, gets the same: replaced below */
            repoison(outs[i][GRAPH]);
            for (int d = GRAPH; d <= CPU; d++) {
                tbuf *tb = outs[i][d];
                for (size_t b = 0; b < tb->total; b++)
                    if (tb->logical[b])
                        tb->full[b] = (unsigned char)(d == GRAPH ? 0xA3 ^ b : 0x3A ^ (b * 5));
                tb_upload(tb);
            }
        }
        refill_on_stream(r.lg, -4.0, 4.0, cs);
        replay(exec, cs);
        OK(routed_issue(&r, 0));
        OK(moefuse_synchronize(g_ctx));
        moefuse_status st = routed_run(&r, CPU);
        HCHECK(st == MOEFUSE_OK, "router and metadata on the cpu: %s", moefuse_last_error(g_ref));
        h_check_all(0);
        for (size_t i = 0; i < 7; i++) {
            same_bytes(outs[i][GRAPH], outs[i][EAGER], h_fmt("%s, replay %d", names[i], rep));
            same_bytes(outs[i][EAGER], outs[i][CPU], h_fmt("%s vs the cpu, %d", names[i], rep));
        }
    }
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
    layer_vs_cpu(&small, small.out_graph, "the small layer on stream b");
    layer_vs_cpu(&small, small.out_eager, "the small layer on stream a after stream b");
    tbuf *one_stream = tb_new2("big_one_stream", MOEFUSE_BF16, 2048, 512, 0, 0);
    OK(moefuse_moe_forward(g_ctx, T(big.x), T(big.w1), T(big.w2), NULL, NULL, &big.R,
                           T(one_stream), NULL));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    same_bytes(big.out_graph, one_stream, "the large layer on stream a, against one stream");
    layer_vs_cpu(&big, big.out_graph, "the large layer on stream a");
    CU(cudaStreamDestroy(a));
    CU(cudaStreamDestroy(b));
    tb_free_all();
}
END_TEST

/* A testing switch with a value it does not know refuses context creation, naming itself;
 * the switch's own value (a variant of this program sets one) is restored after. */
static void refused_switch(const char *name, const char *value)
{
    const char *was = getenv(name);
    char *saved = was ? strdup(was) : NULL;
    setenv(name, value, 1);
    moefuse_context *c = NULL;
    const moefuse_status st = moefuse_context_create(&c, "cuda");
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_INVALID_ARGUMENT && c == NULL,
           "%s=%s: context creation gave %s", name, value, moefuse_status_name(st));
    HCHECK(strstr(msg, name) != NULL, "%s=%s: the message does not name it: %s", name, value,
           msg);
    if (c)
        moefuse_context_destroy(c);
    if (saved)
        setenv(name, saved, 1);
    else
        unsetenv(name);
    free(saved);
}

/* moefuse_context_create_on picks the CUDA device by index over MOEFUSE_CUDA_DEVICE, and
 * refuses an index no device has, naming it. */
START_TEST(device_by_index)
{
    const char *was = getenv("MOEFUSE_CUDA_DEVICE");
    char *saved = was ? strdup(was) : NULL;
    setenv("MOEFUSE_CUDA_DEVICE", "no-such-device", 1); /* the argument must win */
    moefuse_context *c = NULL;
    moefuse_status st = moefuse_context_create_on(&c, "cuda", "0");
    HCHECK(st == MOEFUSE_OK && c, "create_on(cuda, 0): %s", moefuse_last_error(NULL));
    HCHECK(strstr(moefuse_device_name(c), "CUDA device 0") != NULL, "device 0 is \"%s\"",
           moefuse_device_name(c));
    moefuse_context_destroy(c);
    c = (moefuse_context *)&c;
    st = moefuse_context_create_on(&c, "cuda", "99");
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_BACKEND_UNAVAILABLE && c == NULL, "create_on(cuda, 99) gave %s",
           moefuse_status_name(st));
    HCHECK(strstr(msg, "device") && strstr(msg, "99"), "create_on(cuda, 99): message \"%s\"", msg);
    if (saved)
        setenv("MOEFUSE_CUDA_DEVICE", saved, 1);
    else
        unsetenv("MOEFUSE_CUDA_DEVICE");
    free(saved);
}
END_TEST

START_TEST(unknown_switch_values_refused)
{
    refused_switch("MOEFUSE_CUDA_GEMM", "wgmma2");
    refused_switch("MOEFUSE_CUDA_SPLIT", "0");
    refused_switch("MOEFUSE_CUDA_SPLIT", "9");
    refused_switch("MOEFUSE_CUDA_SPLIT", "2x");
}
END_TEST

static void setup(void)
{
    h_setup_cross(); /* g_ref: the CPU golden backend */
}

static Suite *suite(void)
{
    Suite *s = suite_create("cuda_graph");
    TCase *tc = tcase_create("cuda_graph");
    tcase_add_checked_fixture(tc, setup, h_teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, moe_forward_in_a_graph, 0, 2);
    tcase_add_loop_test(tc, moe_forward_in_a_graph_with_workspace, 0, 2);
    tcase_add_test(tc, row_ops_in_a_graph);
    tcase_add_loop_test(tc, decode_layer_in_a_graph, 0, 2);
    tcase_add_loop_test(tc, router_and_metadata_in_a_graph, 0, 2);
    tcase_add_test(tc, streams_switch_without_waiting);
    tcase_add_test(tc, unknown_switch_values_refused);
    tcase_add_test(tc, device_by_index);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) { return h_run(suite()); }
