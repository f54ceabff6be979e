/* test_cuda_graph: byte checks, agreement with the CPU golden backend, capture and replay. */
#include "test_cuda_graph.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const char *const side_name[2] = {"eager", "graph replay"};

void same_bytes(tbuf *got, tbuf *want, const char *what)
{
    HCHECK(got->total == want->total, "%s: %s and %s differ in size", what, got->name, want->name);
    for (size_t i = 0; i < got->total; i++)
        if (got->logical[i])
            EXPECT(got->full[i] == want->full[i],
                   "%s: %s byte %zu is 0x%02x, %s has 0x%02x", what, got->name, i - got->pad,
                   got->full[i], want->name, want->full[i]);
}

/* Fresh poison in every element byte of an output (a pattern of its own, unlike tb_new's). */
void repoison(tbuf *tb)
{
    for (size_t i = 0; i < tb->total; i++)
        if (tb->logical[i]) tb->full[i] = (unsigned char)(0x5C ^ (i * 0x47));
    tb_upload(tb);
}

versus versus_new(tbuf *dev, tbuf *cpu, const char *what)
{
    versus v = {dev, cpu, calloc(dev->total, 1), ""};
    snprintf(v.what, sizeof v.what, "%s", what);
    return v;
}

static void judge(versus *v, const void *dev_el, size_t n)
{
    memset(v->judged + ((const unsigned char *)dev_el - v->dev->full), 1, n);
}

void versus_end(versus *v)
{
    for (size_t i = 0; i < v->dev->total; i++)
        if (v->dev->logical[i] && !v->judged[i])
            EXPECT(v->dev->full[i] == v->cpu->full[i],
                   "%s: '%s' byte %zu is 0x%02x, on the cpu 0x%02x; they must be equal", v->what,
                   v->dev->name, i - v->dev->pad, v->dev->full[i], v->cpu->full[i]);
    free(v->judged);
}

/* Every element byte equal to the CPU's: a result with no exp on the way (NUMERICS.md). */
void same_as_cpu(tbuf *dev, tbuf *cpu, const char *what)
{
    versus v = versus_new(dev, cpu, what);
    versus_end(&v);
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
void cmp_act_quant_rows(versus *qs, versus *scs, int sides, tbuf *x, int64_t e, int64_t n,
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
 * backends"), every other element byte too. */
void cmp_act_mul(tbuf *dev, tbuf *cpu, int64_t Tn, int64_t H, const char *what)
{
    versus v = versus_new(dev, cpu, what), *out = &v;
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
    versus_end(out);
}

/* The weights [M, k] (f32) of topk_softmax with renormalize: bit-equal, every other element
 * byte too. */
void cmp_topk_weights(tbuf *dev, tbuf *cpu, int64_t M, int64_t k, const char *what)
{
    versus v = versus_new(dev, cpu, what), *w = &v;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            double a = tb_get(w->dev, m, j, 0), b = tb_get(w->cpu, m, j, 0);
            judge(w, tb_el(w->dev, m, j, 0), 4);
            EXPECT(memcmp(tb_el(w->dev, m, j, 0), tb_el(w->cpu, m, j, 0), 4) == 0,
                   "%s: row %lld slot %lld: weight %a, on the cpu %a: must be bit-equal", w->what,
                   (long long)m, (long long)j, a, b);
        }
    versus_end(w);
}

/* A bf16 GEMM output [M, K]: finite, and ||dev - cpu|| / ||cpu|| <= 8e-3 (NUMERICS.md, "Agreement between backends"). */
void cmp_gemm(tbuf *dev, tbuf *cpu, int64_t M, int64_t K, const char *what)
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

/* A non-blocking stream of the test's own. */
cudaStream_t new_stream(void)
{
    cudaStream_t cs;
    CU(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    return cs;
}

/* The graph of issue(arg, 1) captured on stream cs, cs attached to the context mid-capture
 * (and the context's own stream again after it). */
cudaGraph_t capture_graph(cudaStream_t cs, issue_fn issue, void *arg)
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
cudaGraphExec_t capture(cudaStream_t cs, issue_fn issue, void *arg)
{
    cudaGraph_t graph = capture_graph(cs, issue, arg);
    cudaGraphExec_t exec = NULL;
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphDestroy(graph));
    return exec;
}

void replay(cudaGraphExec_t exec, cudaStream_t cs)
{
    CU(cudaGraphLaunch(exec, cs));
    CU(cudaStreamSynchronize(cs));
}

/* One step of every side: the graph replayed on cs, the same calls eagerly on the device, then
 * on the CPU; every tensor read back. */
void replay_eager_cpu(cudaGraphExec_t exec, cudaStream_t cs, side_fn run, void *arg,
                      const char *what)
{
    replay(exec, cs);
    OK(run(arg, EAGER));
    OK(moefuse_synchronize(g_ctx));
    const moefuse_status st = run(arg, CPU);
    HCHECK(st == MOEFUSE_OK, "%s on the cpu: %s", what, moefuse_last_error(g_ref));
    h_check_all(0);
}

/* A graph test's end: its graph and stream destroyed, its tensors freed. */
void graph_done(cudaGraphExec_t exec, cudaStream_t cs)
{
    CU(cudaGraphExecDestroy(exec));
    CU(cudaStreamDestroy(cs));
    tb_free_all();
}
