/* test_cuda_graph: a decode layer (router, then MoE), and the grouped router with its metadata, in a graph. */
#include "test_cuda_graph.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------- a decode layer */

/* Router then MoE layer, as a decode step runs them: one graph for both. */
typedef struct {
    int64_t M, E, k, K, I;
    tbuf *lg, *x, *w1, *w2;                     /* inputs, with twins on the cpu */
    tbuf *ids[SIDES], *wts[SIDES], *out[SIDES]; /* the router's result feeds the layer */
    moefuse_routing R[SIDES];
} decode;

static moefuse_status decode_run(void *arg, int side)
{
    decode *D = arg;
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
    decode D;
    memset(&D, 0, sizeof D);
    D.M = M, D.E = E, D.k = k, D.K = K, D.I = I;
    D.lg = tb_new2("logits", MOEFUSE_F32, M, E, 0, 1);
    D.x = tb_new2("x", MOEFUSE_BF16, M, K, 0, 1);
    D.w1 = tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1);
    D.w2 = tb_new3("w2", MOEFUSE_BF16, E, K, I, 0, 1);
    tbuf *inputs[] = {D.lg, D.x, D.w1, D.w2};
    for (size_t i = 0; i < sizeof inputs / sizeof inputs[0]; i++) tb_twin(inputs[i], g_ref);
    side_outputs(D.ids, "ids", MOEFUSE_I32, 2, (int64_t[]){M, k});
    side_outputs(D.wts, "weights", MOEFUSE_F32, 2, (int64_t[]){M, k});
    side_outputs(D.out, "out", MOEFUSE_BF16, 2, (int64_t[]){M, K});
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
    char what[96]; /* a copy: h_fmt's buffers are reused */
    for (int d = EAGER; d <= GRAPH; d++) {
        same_as_cpu(D->ids[d], D->ids[CPU],
                    h_fmt("decode layer topk ids, %s, %s", side_name[d], when));
        cmp_topk_weights(D->wts[d], D->wts[CPU], D->M, D->k,
                         h_fmt("decode layer topk weights, %s, %s", side_name[d], when));
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
    cudaStream_t cs = new_stream();
    decode D = decode_new(M, 8, 2, 256, 512);
    cudaGraphExec_t exec = capture(cs, decode_issue, &D);
    for (int r = 0; r < 2; r++) {
        char when[48];
        snprintf(when, sizeof when, "replay %d on new x and logits", r + 1);
        for (int d = EAGER; d <= GRAPH; d++) {
            repoison(D.ids[d]);
            repoison(D.wts[d]);
            repoison(D.out[d]);
        }
        refill_on_stream(D.lg, -4.0, 4.0, cs);
        refill_on_stream(D.x, -1.0, 1.0, cs);
        /* the replay launched behind the copies on cs, no wait in between */
        replay_eager_cpu(exec, cs, decode_run, &D, "decode layer");
        same_bytes(D.ids[GRAPH], D.ids[EAGER], when);
        same_bytes(D.wts[GRAPH], D.wts[EAGER], when);
        same_bytes(D.out[GRAPH], D.out[EAGER], when);
        decode_vs_cpu(&D, when);
    }
    graph_done(exec, cs);
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

static moefuse_status routed_run(void *arg, int side)
{
    routed *r = arg;
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
    const int64_t slots[2] = {r.M, r.k};
    side_outputs(r.ids, "ids", MOEFUSE_I32, 2, slots);
    side_outputs(r.wts, "weights", MOEFUSE_F32, 2, slots);
    side_outputs(r.cnt, "counts", MOEFUSE_I32, 1, &r.E);
    side_outputs(r.off, "offsets", MOEFUSE_I32, 1, (int64_t[]){r.E + 1});
    side_outputs(r.ord, "order", MOEFUSE_I32, 1, &L);
    side_outputs(r.pos, "position", MOEFUSE_I32, 2, slots);
    side_outputs(r.row, "masked_row", MOEFUSE_I32, 2, slots);
    tbuf **outs[] = {r.ids, r.wts, r.cnt, r.off, r.ord, r.pos, r.row};
    static const char *names[] = {"ids", "weights", "counts", "offsets", "order", "position",
                                  "masked_row"};
    cudaStream_t cs = new_stream();
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
        replay_eager_cpu(exec, cs, routed_run, &r, "router and metadata");
        for (size_t i = 0; i < 7; i++) {
            same_bytes(outs[i][GRAPH], outs[i][EAGER], h_fmt("%s, replay %d", names[i], rep));
            same_bytes(outs[i][EAGER], outs[i][CPU], h_fmt("%s vs the cpu, %d", names[i], rep));
        }
    }
    graph_done(exec, cs);
}
END_TEST

void cuda_graph_decode_tests(TCase *tc)
{
    tcase_add_loop_test(tc, decode_layer_in_a_graph, 0, 2);
    tcase_add_loop_test(tc, router_and_metadata_in_a_graph, 0, 2);
}
