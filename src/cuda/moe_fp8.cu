/*
 * moe_gate_fp8 and moe_final_fp8 of the CUDA backend: the host side (docs/NUMERICS.md "FP8
 * MoE"). As moe_ops.cu: everything is enqueued on s->stream, no device data is read on the
 * host, and each call makes one scratch request sized from the shapes alone, so the calls are
 * graph-capturable with a caller's workspace (no allocation, no synchronisation).
 *
 * A call, routed: the route kernels (moe_route.cu) list the valid slots by expert in tiles of
 * bm; an f32/f16/bf16 x is quantized into scratch by quant's own kernels (rows.cu, row-major
 * f32 scales: the same codes and scale values as any act layout); one GEMM; the gate fills
 * what no tile writes (invalid slots, scale padding rows); the reduced final sums y [S, K]
 * (f32 scratch) in slot order. Masked: tiles (expert, rows t0..t0+bm-1) whose rows past n[e]
 * (clamped on the device) exit at once; x is quantized for the valid rows only.
 * The kernel: the plan's (moe_fp8_plan.cu); the portable one (moe_fp8_portable.cu) is exact,
 * any sm_80+.
 */
#include "cuda/moe_fp8.h"
#include "cuda/moe_fp8_decode.h"
#include "cuda/moe_fp8_plan.h"
#include "cuda/moe_fp8_ws.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

extern "C" int mf_cuda_fp8_gemm_from_env(void)
{
    const char *v = getenv("MOEFUSE_CUDA_FP8");
    if (!v || !*v) {
        /* MOEFUSE_CUDA_GEMM=decode forces the decode path of both dtypes */
        const char *g = getenv("MOEFUSE_CUDA_GEMM");
        return g && strcmp(g, "decode") == 0 ? FP8_GEMM_DECODE : FP8_GEMM_AUTO;
    }
    if (strcmp(v, "portable") == 0)
        return FP8_GEMM_PORTABLE;
    if (strcmp(v, "wgmma") == 0)
        return FP8_GEMM_WGMMA;
    if (strcmp(v, "decode") == 0)
        return FP8_GEMM_DECODE;
    return -1;
}

extern "C" int mf_cuda_fp8_a_from_env(void)
{
    const char *v = getenv("MOEFUSE_CUDA_FP8_A");
    if (!v || !*v)
        return FP8_A_AUTO;
    if (strcmp(v, "gather") == 0)
        return FP8_A_GATHER;
    return strcmp(v, "tma") == 0 ? FP8_A_TMA : -1;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

static Fp8ActScales act_view(const moefuse_tensor *t, const mf_moe_args *a)
{
    Fp8ActScales v;
    v.p = mf_cuda_base(t);
    v.s0 = t->stride[0];
    v.s1 = t->stride[1];
    v.layout = (int)a->act.scale_layout;
    v.u8 = t->dtype != MOEFUSE_F32;
    return v;
}

static Fp8WScales w_view(const moefuse_tensor *t)
{
    Fp8WScales v;
    v.p = mf_cuda_base(t);
    v.s0 = t->stride[0];
    v.s1 = t->stride[1];
    v.s2 = t->stride[2];
    v.u8 = t->dtype == MOEFUSE_U8;
    return v;
}

/* The route over the scratch (routed), or the masked layout's expert count (rt.E). */
static MoeRoute route_view(const mf_moe_args *a, const fp8_plan *pl, char *scratch,
                           MoeRouteBufs *b)
{
    MoeRoute rt;
    memset(&rt, 0, sizeof rt);
    memset(b, 0, sizeof *b);
    rt.E = a->experts;
    if (a->masked || pl->S == 0)
        return rt;
    b->count = (unsigned long long *)(scratch + pl->off_count);
    b->fill = (unsigned long long *)(scratch + pl->off_fill);
    b->offs = (long long *)(scratch + pl->off_offs);
    b->tiles = (long long *)(scratch + pl->off_tiles);
    b->tile_expert = (int *)(scratch + pl->off_tile_expert);
    b->expert_of = (int *)(scratch + pl->off_expert_of);
    b->list = (long long *)(scratch + pl->off_list);
    b->tok_valid = (int *)(scratch + pl->off_tok_valid);
    rt = mf_route_of(a);
    rt.offs = b->offs;
    rt.tiles = b->tiles;
    rt.tile_expert = b->tile_expert;
    rt.list = b->list;
    return rt;
}

/* What both GEMMs share: layout, route, weights, bias, tiles. */
static Fp8Gemm common_params(const mf_moe_args *a, const fp8_plan *pl, const MoeRoute *rt,
                             const moefuse_tensor *w, const moefuse_tensor *ws,
                             const moefuse_tensor *bias, int64_t depth, int64_t ncols)
{
    Fp8Gemm g;
    memset(&g, 0, sizeof g);
    g.rt = *rt;
    g.masked = a->masked;
    if (a->masked) {
        g.counts = (const int32_t *)mf_cuda_base(&a->counts);
        g.counts_s0 = a->counts.stride[0];
        g.tmax = a->tokens;
    }
    g.w = (const uint8_t *)mf_cuda_base(w);
    g.w_s0 = w->stride[0];
    g.w_s1 = w->stride[1];
    g.ws = w_view(ws);
    g.vec_w = aligned16(g.w) && g.w_s0 % 16 == 0 && g.w_s1 % 16 == 0;
    g.depth = depth;
    g.ncols = ncols;
    g.nblk = ncols / FP8_BLOCK;
    if (bias->data) {
        g.bias = mf_cuda_base(bias);
        g.bias_s0 = bias->stride[0];
        g.bias_dt = (int)bias->dtype;
    }
    g.act = (int)a->opt.activation;
    g.alpha = a->opt.alpha;
    g.limit = a->opt.limit;
    g.up_offset = a->opt.up_offset;
    g.row_step = 1; /* the final's rows; the gate's are set by gate_h_out */
    long long lb;
    if (__builtin_mul_overflow((long long)pl->tiles_bound, (long long)g.nblk, &lb))
        lb = LLONG_MAX; /* blocks stop at the first index past the real tiles */
    g.lin_bound = lb;
    return g;
}

static void set_a(Fp8Gemm *g, const uint8_t *codes, int64_t s0, int64_t s1)
{
    g->a = codes;
    g->a_s0 = s0;
    g->a_s1 = s1;
    g->vec_a = aligned16(codes) && s0 % 16 == 0 && s1 % 16 == 0;
}

extern "C" moefuse_status mf_cuda_moe_gate_fp8_workspace(moefuse_context *ctx, void *state,
                                                         const mf_moe_args *a, size_t *bytes)
{
    fp8_plan pl;
    MF_TRY(fp8_plan_call(ctx, (cuda_state *)state, "moe_gate_fp8", a, 1, &pl));
    *bytes = pl.bytes;
    return MOEFUSE_OK;
}

extern "C" moefuse_status mf_cuda_moe_final_fp8_workspace(moefuse_context *ctx, void *state,
                                                          const mf_moe_args *a, size_t *bytes)
{
    fp8_plan pl;
    MF_TRY(fp8_plan_call(ctx, (cuda_state *)state, "moe_final_fp8", a, 0, &pl));
    *bytes = pl.bytes;
    return MOEFUSE_OK;
}

static moefuse_status take_scratch(moefuse_context *ctx, cuda_state *s, const char *op,
                                   const fp8_plan *pl, char **scratch)
{
    *scratch = NULL;
    if (pl->bytes > 0)
        MF_TRY(mf_cuda_scratch(ctx, s, pl->bytes, op, (void **)scratch));
    return MOEFUSE_OK;
}

/*
 * Whether this call's GEMM runs on the Hopper kernel: the device has it, a tensor map
 * describes the weights (16-byte aligned rows) and the gate's rows are not interleaved (its
 * 128-row boxes take a half's rows consecutively); else the portable kernel, which takes any.
 */
static bool ws_suits(const cuda_state *s, const fp8_plan *pl, const Fp8Gemm *g)
{
    /* any A rows and h rows: the kernel loads and stores them byte by byte where they are not
     * aligned, so a layer's forward and its two steps take the same path */
    return pl->wgmma && g->row_step == 1 && moe_fp8_ws_weights_ok(s, g, pl->gate);
}

/*
 * Whether the Hopper kernel loads A by TMA (x's tma_* set): where A's rows are 16-byte aligned,
 * the plan holds the scratch (fp8_ws_a_copied when routed) and the driver takes the map.
 */
static bool ws_a_by_tma(const cuda_state *s, const mf_moe_args *a, const fp8_plan *pl,
                        char *scratch, const Fp8Gemm *g, Fp8WsExtra *x)
{
    if (pl->dec || !g->vec_a || s->fp8_a == FP8_A_GATHER || (!a->masked && !pl->copy_a))
        return false;
    if (a->masked) {
        x->tma_a = g->a; /* [E, Tmax, depth] in place */
        x->tma_rows = a->tokens;
        x->tma_blocks = a->experts;
        x->tma_row_s = g->a_s1;
        x->tma_block_s = g->a_s0;
    } else {
        x->tma_a = (const uint8_t *)(scratch + pl->off_ws_a);
        x->tma_rows = pl->S;
        x->tma_blocks = 1;
        x->tma_row_s = g->depth;
        x->tma_block_s = pl->S * g->depth;
    }
    x->tma_sc = (const float *)(scratch + pl->off_ws_sc);
    x->tma_rows_pad = (x->tma_rows + 3) / 4 * 4;
    return moe_fp8_ws_a_tma_ok(s, x, g->depth) != 0;
}

/* The GEMM on the Hopper kernel: its tile table, its counter, A's f32 scales, the launch. */
static moefuse_status launch_ws(moefuse_context *ctx, cuda_state *s, const char *op,
                                const mf_moe_args *a, const fp8_plan *pl, char *scratch,
                                const Fp8Gemm *g)
{
    Fp8WsExtra x;
    memset(&x, 0, sizeof x);
    long long mtiles;
    if (a->masked) {
        x.tiles = (long long *)(scratch + pl->off_ws_tiles);
        x.row_start = (long long *)(scratch + pl->off_ws_start);
        x.row_end = (long long *)(scratch + pl->off_ws_end);
        x.tile_expert = (int *)(scratch + pl->off_ws_tile_expert);
        MF_TRY(moe_fp8_ws_masked_tiles(ctx, s, op, g, (long long *)x.tiles, (int *)x.tile_expert,
                                       (long long *)x.row_start, (long long *)x.row_end));
        x.div = a->tokens;
        mtiles = pl->mtiles;
    } else {
        x.tiles = g->rt.tiles;
        x.tile_expert = g->rt.tile_expert;
        x.row_start = g->rt.offs;
        x.row_end = g->rt.offs + 1;
        x.list = g->rt.list;
        x.div = a->topk;
        mtiles = pl->S / F8_BM + (a->experts < pl->S ? a->experts : pl->S);
    }
    x.nblk = pl->gate ? a->inter_dim / FP8_BLOCK : (a->model_dim + 255) / 256;
    if (__builtin_mul_overflow(mtiles, x.nblk, &x.lin_bound))
        x.lin_bound = LLONG_MAX;
    x.tile_ctr = (unsigned *)(scratch + pl->off_ws_ctr);
    cudaError_t e = cudaMemsetAsync(x.tile_ctr, 0, 4, s->stream);
    if (e != cudaSuccess)
        return mf_cuda_fail(ctx, e, op, "cudaMemsetAsync(tile counter)");
    if (ws_a_by_tma(s, a, pl, scratch, g, &x)) {
        /* routed: the rows and scales in list order; masked: the scales a stage's rows
         * consecutive. The same codes and scale values as the gather reads: the same bits */
        Fp8WsASource src;
        memset(&src, 0, sizeof src);
        src.a = g->a;
        src.a_s0 = g->a_s0;
        src.a_s1 = g->a_s1;
        src.as = g->as;
        src.div = x.div;
        src.scale_by_p = pl->gate && !a->masked; /* x's scale rows are tokens */
        MF_TRY(moe_fp8_ws_a_copy(ctx, s, op, &x, &src, a->masked ? NULL : g->rt.offs + a->experts,
                                 g->depth));
        x.a_tma = 1;
        return moe_fp8_ws_launch(ctx, s, op, pl->gate, g, &x);
    }
    const int64_t nkb = g->depth / FP8_BLOCK;
    const float *base = (const float *)g->as.p;
    int64_t row_s = g->as.s1, block_s = g->as.s0; /* row-major f32: element (b, t, g) */
    if (pl->dense_a) {
        float *d = (float *)(scratch + pl->off_ws_sc);
        MF_TRY(moe_fp8_ws_dense_scales(ctx, s, op, &g->as, d, pl->blocks, fp8_a_rows(a, pl), nkb));
        base = d;
        row_s = nkb;
        block_s = fp8_a_rows(a, pl) * nkb;
    }
    x.a_sc = base;
    if (a->masked)
        x.sc_p = block_s, x.sc_q = row_s; /* (e, t) */
    else if (pl->gate)
        x.sc_p = row_s, x.sc_q = 0; /* token m of slot (m, j) */
    else
        x.sc_p = a->topk * row_s, x.sc_q = row_s; /* slot row m * k + j */
    return moe_fp8_ws_launch(ctx, s, op, pl->gate, g, &x);
}

/* Whether a layer's gate and final share the decode route (routed calls on kept scratch). */
static bool dec_share(moefuse_context *ctx, const cuda_state *s, const mf_moe_args *a,
                      const fp8_plan *pl)
{
    return a->layer && pl->dec && !a->masked && mf_cuda_scratch_kept(ctx, s);
}

/* What a decode launch takes from the plan. */
static Fp8DecExtra dec_extra(const cuda_state *s, const fp8_plan *pl)
{
    Fp8DecExtra x;
    memset(&x, 0, sizeof x);
    x.mode = pl->dec_mode;
    x.split = pl->dec_split;
    x.clusters = pl->dec_clusters;
    x.tiles_bound = pl->dec_tiles_bound;
    x.pdl = x.trigger = s->pdl;
    return x;
}

/* The split sums' buffer of a decode launch, when its tiles are split. */
static void *dec_part(const fp8_plan *pl, char *scratch)
{
    return pl->dec_split > 1 ? scratch + pl->off_dec_part : NULL;
}

/* The route kernel of the routed decode mode, over the plan's buffers. */
static Fp8DecRoute dec_route_args(const cuda_state *s, const mf_moe_args *a, const fp8_plan *pl,
                                  char *scratch, const MoeRoute *rt)
{
    Fp8DecRoute r;
    memset(&r, 0, sizeof r);
    r.rt = *rt;
    r.ntiles = (int *)(scratch + pl->off_dec_ntiles);
    r.tiles = (DecTile *)(scratch + pl->off_dec_tiles);
    r.list = (long long *)(scratch + pl->off_dec_list);
    r.M = a->tokens;
    r.K = a->model_dim;
    r.pdl = s->pdl;
    return r;
}

static void dec_tiles_from(Fp8DecExtra *x, const Fp8DecRoute *r)
{
    x->ntiles = r->ntiles;
    x->tiles = r->tiles;
    x->list = r->list;
}

/*
 * The gate on the decode kernel. x of f32/f16/bf16 is quantized first by the route kernel, as
 * `quant` does (its valid rows only, masked), which also lists the tiles (routed mode).
 */
static moefuse_status gate_decode(moefuse_context *ctx, cuda_state *s, const char *op,
                                  const mf_moe_args *a, const fp8_plan *pl, char *scratch,
                                  bool share, Fp8Gemm *g)
{
    Fp8DecExtra x = dec_extra(s, pl);
    x.part = dec_part(pl, scratch);
    /* a layer's final counts arrivals in counters the gate zeroes */
    unsigned *arrivals = share ? (unsigned *)(scratch + pl->off_dec_arrivals) : NULL;
    const long long arrivals_n = a->tokens * (a->model_dim / FP8_BLOCK);
    Fp8DecRoute r = dec_route_args(s, a, pl, scratch, &g->rt);
    r.route = pl->dec_mode == DEC_ROUTED;
    if (r.route) {
        r.arrivals = arrivals;
        r.arrivals_n = arrivals ? arrivals_n : 0;
    } else {
        x.zero_arrivals = arrivals;
        x.zero_arrivals_n = arrivals ? arrivals_n : 0;
    }
    if (pl->quant_x) {
        const int64_t K = a->model_dim, groups = K / FP8_BLOCK;
        r.x = mf_cuda_base(&a->x);
        r.x_dt = (int)a->x.dtype;
        r.x_s0 = a->x.stride[0];
        r.x_s1 = a->masked ? a->x.stride[1] : 0;
        if (a->masked) {
            r.counts = (const int32_t *)mf_cuda_base(&a->counts);
            r.counts_s0 = a->counts.stride[0];
            r.tmax = a->tokens;
        }
        r.rows = a->masked ? pl->blocks * pl->rows : a->tokens; /* x's rows: E * Tmax, or M */
        r.xq = (uint8_t *)(scratch + pl->off_xq);
        r.xs = (float *)(scratch + pl->off_xs);
        r.q_eps = a->act.eps;
        r.q_ue8m0 = a->act.ue8m0 || a->act.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
        /* codes [blocks, T, K], scales [blocks, T, groups], rows as x's */
        set_a(g, r.xq, a->masked ? pl->rows * K : K, a->masked ? K : 0);
        g->as.p = r.xs;
        g->as.s0 = a->masked ? pl->rows * groups : 0;
        g->as.s1 = groups;
        g->as.layout = MF_LAYOUT_ROW;
        g->as.u8 = 0;
    }
    MF_TRY(moe_fp8_dec_route(ctx, s, op, &r));
    if (r.route)
        dec_tiles_from(&x, &r);
    /* the quantization before it lets it launch only once the ids are complete, and writes no
     * tile (direct mode) */
    x.early = !r.route && pl->quant_x;
    return moe_fp8_dec_launch(ctx, s, op, 1, g, &x);
}

/*
 * The final on the decode kernel: reduced, y goes to f32 scratch and the last slot of each
 * token to arrive sums the token's row (no pass of its own); the counters and the rows no tile
 * writes are zeroed by the route kernel (routed), by the kernel's block 0 (direct rows) and a
 * memset (direct counters: the blocks that count cannot also zero). In a layer whose scratch
 * is kept (share), the gate routed and zeroed the counters: no kernel but the GEMM.
 */
static moefuse_status final_decode(moefuse_context *ctx, cuda_state *s, const char *op,
                                   const mf_moe_args *a, const fp8_plan *pl, char *scratch,
                                   bool share, Fp8Gemm *g)
{
    Fp8DecExtra x = dec_extra(s, pl);
    x.part = dec_part(pl, scratch);
    MoeZero zs, zt;
    memset(&zs, 0, sizeof zs);
    memset(&zt, 0, sizeof zt);
    const long long nblk = g->nblk;
    if (pl->reduce) {
        x.arrivals = (unsigned *)(scratch + pl->off_dec_arrivals);
        x.tw = (const float *)mf_cuda_base(&a->topk_weights);
        x.tw_s0 = a->topk_weights.stride[0];
        x.rout = mf_cuda_base(&a->out);
        x.rout_s0 = a->out.stride[0];
        x.rout_dt = (int)a->out.dtype;
        zt.p = x.rout;
        zt.s0 = x.rout_s0;
        zt.width = a->model_dim;
        zt.dt = x.rout_dt;
    } else if (!a->masked) {
        zs.p = mf_cuda_base(&a->out);
        zs.s0 = a->out.stride[0];
        zs.s1 = a->out.stride[1];
        zs.width = a->model_dim;
        zs.dt = (int)a->out.dtype;
    }
    if (share) {
        /* a layer's gate listed the tiles and zeroed the counters; block 0 zeroes the rows */
        Fp8DecRoute r = dec_route_args(s, a, pl, scratch, &g->rt);
        dec_tiles_from(&x, &r);
        x.zero_slot = zs;
        x.zero_tok = zt;
        x.early = 1; /* the gate before it lets it launch once the tiles and ids are complete */
    } else if (pl->dec_mode == DEC_ROUTED) {
        Fp8DecRoute r = dec_route_args(s, a, pl, scratch, &g->rt);
        r.route = 1;
        r.arrivals = x.arrivals;
        r.arrivals_n = x.arrivals ? a->tokens * nblk : 0;
        r.zero_slot = zs;
        r.zero_tok = zt;
        MF_TRY(moe_fp8_dec_route(ctx, s, op, &r));
        dec_tiles_from(&x, &r);
    } else if (pl->dec_mode == DEC_DIRECT) {
        x.zero_slot = zs;
        x.zero_tok = zt;
        if (x.arrivals) {
            cudaError_t e = cudaMemsetAsync(x.arrivals, 0, (size_t)(a->tokens * nblk) * 4,
                                            s->stream);
            if (e != cudaSuccess)
                return mf_cuda_fail(ctx, e, op, "cudaMemsetAsync(arrivals)");
        }
    } else if (pl->dec_mode == DEC_MASKED) {
        /* after the layer's gate, which lets it launch only once the counts are complete */
        x.early = 1;
    }
    return moe_fp8_dec_launch(ctx, s, op, 0, g, &x);
}

/* The gate's epilogue: the h rows, their scales in the act layout, the activation. */
static void gate_h_out(const mf_moe_args *a, Fp8Gemm *g)
{
    const int64_t I = a->inter_dim;
    g->a_scale_slot = 0; /* routed: x's scale rows are tokens */
    g->gate_row = mf_gate_at((int)a->opt.order, I);
    g->up_row = mf_up_at((int)a->opt.order, I);
    g->row_step = mf_gate_step((int)a->opt.order);
    g->epi = FP8_EPI_GATE;
    g->h.q = (uint8_t *)mf_cuda_base(&a->h);
    g->h.sc = act_view(&a->h_scales, a);
    g->h.groups = I / FP8_BLOCK;
    g->h.eps = a->act.eps;
    g->h.ue8m0 = a->act.ue8m0 || a->act.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
    g->o_s0 = a->h.stride[0];
    g->o_s1 = a->h.stride[1];
}

/* What no gate tile writes: invalid slots, and the scale padding rows of the column-major and
 * packed layouts; nothing in a layer, whose final reads neither. */
static moefuse_status gate_fill(moefuse_context *ctx, cuda_state *s, const char *op,
                                const mf_moe_args *a, const fp8_plan *pl, const MoeRoute *rt,
                                const Fp8Gemm *g)
{
    if (a->layer)
        return MOEFUSE_OK;
    const int64_t padded = a->act.scale_layout == MOEFUSE_SCALE_ROW_MAJOR
                               ? pl->rows
                               : (pl->rows + 3) / 4 * 4;
    return fp8_launch_gate_fill(ctx, s, op, rt, &a->h, &g->h, pl->rows, padded, pl->blocks);
}

extern "C" moefuse_status mf_cuda_moe_gate_fp8(moefuse_context *ctx, void *state,
                                               const mf_moe_args *a)
{
    static const char op[] = "moe_gate_fp8";
    cuda_state *s = (cuda_state *)state;
    fp8_plan pl;
    s->fp8_route_left = NULL;
    MF_TRY(fp8_plan_call(ctx, s, op, a, 1, &pl));
    if (!a->masked && pl.S == 0)
        return MOEFUSE_OK; /* h has no rows */
    const int64_t K = a->model_dim, I = a->inter_dim;
    if (pl.dec)
        MF_TRY(moe_fp8_dec_launch(ctx, s, op, 1, NULL, NULL)); /* refusals before any write */
    char *scratch;
    MF_TRY(take_scratch(ctx, s, op, &pl, &scratch));
    MoeRouteBufs b;
    const MoeRoute rt = route_view(a, &pl, scratch, &b);
    Fp8Gemm g = common_params(a, &pl, &rt, &a->w1, &a->w1_scales, &a->b1, K, I);
    if (pl.dec) {
        set_a(&g, (const uint8_t *)mf_cuda_base(&a->x), a->x.stride[0],
              a->masked ? a->x.stride[1] : 0);
        if (a->x.dtype == MOEFUSE_F8_E4M3)
            g.as = act_view(&a->x_scales, a);
        gate_h_out(a, &g);
        MF_TRY(gate_decode(ctx, s, op, a, &pl, scratch, dec_share(ctx, s, a, &pl), &g));
        return gate_fill(ctx, s, op, a, &pl, &rt, &g);
    }
    if (pl.quant_x) {
        mf_rows_args q = pl.q;
        q.out.data = scratch + pl.off_xq;
        q.scales.data = scratch + pl.off_xs;
        MF_TRY(mf_cuda_quant_in_call(ctx, s, &q, op, pl.qscratch ? scratch + pl.off_qscratch
                                                                  : NULL));
        /* row-major codes [blocks, T, K] and f32 scales [blocks, T, K / 128] */
        set_a(&g, (const uint8_t *)q.out.data, a->masked ? pl.rows * K : K,
              a->masked ? K : 0);
        g.as.p = q.scales.data;
        g.as.s0 = q.scales.stride[0];
        g.as.s1 = q.scales.stride[1];
        g.as.layout = MF_LAYOUT_ROW;
        g.as.u8 = 0;
    } else {
        set_a(&g, (const uint8_t *)mf_cuda_base(&a->x), a->x.stride[0],
              a->masked ? a->x.stride[1] : 0);
        g.as = act_view(&a->x_scales, a);
    }
    gate_h_out(a, &g);
    const bool ws = ws_suits(s, &pl, &g);
    if (!a->masked) {
        const MoeZero none = {NULL, 0, 0, 0, 0}; /* the fill below zeroes h's invalid rows */
        const int bm = ws ? F8_BM : pl.bm;
        MF_TRY(moe_route(ctx, s, op, &rt, &b, bm, a->tokens, &none, &none));
        if (a->layer && mf_cuda_scratch_kept(ctx, s)) {
            /* the route lies first in the scratch, where the final's plan puts it too */
            s->fp8_route_left = scratch;
            s->fp8_route_bm = bm;
        }
    }
    if (ws)
        MF_TRY(launch_ws(ctx, s, op, a, &pl, scratch, &g));
    else
        MF_TRY(fp8_launch_portable(ctx, s, op, pl.bm, 1, &g));
    return gate_fill(ctx, s, op, a, &pl, &rt, &g);
}

extern "C" moefuse_status mf_cuda_moe_final_fp8(moefuse_context *ctx, void *state,
                                                const mf_moe_args *a)
{
    static const char op[] = "moe_final_fp8";
    cuda_state *s = (cuda_state *)state;
    fp8_plan pl;
    const void *route_left = s->fp8_route_left; /* the layer's gate's route, taken once */
    s->fp8_route_left = NULL;
    MF_TRY(fp8_plan_call(ctx, s, op, a, 0, &pl));
    const int64_t K = a->model_dim, I = a->inter_dim;
    if (!a->masked && pl.S == 0) {
        if (!a->reduce || a->tokens == 0)
            return MOEFUSE_OK;
        /* k = 0: every token's sum is empty, 0 */
        const size_t es = moefuse_dtype_size(a->out.dtype);
        cudaError_t e = cudaMemset2DAsync(mf_cuda_base(&a->out), (size_t)a->out.stride[0] * es, 0,
                                          (size_t)K * es, (size_t)a->tokens, s->stream);
        return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, op, "cudaMemset2DAsync(out)");
    }
    if (pl.dec)
        MF_TRY(moe_fp8_dec_launch(ctx, s, op, 0, NULL, NULL)); /* refusals before any write */
    char *scratch;
    MF_TRY(take_scratch(ctx, s, op, &pl, &scratch));
    MoeRouteBufs b;
    const MoeRoute rt = route_view(a, &pl, scratch, &b);
    Fp8Gemm g = common_params(a, &pl, &rt, &a->w2, &a->w2_scales, &a->b2, I, K);
    set_a(&g, (const uint8_t *)mf_cuda_base(&a->h), a->h.stride[0], a->h.stride[1]);
    g.as = act_view(&a->h_scales, a);
    g.a_scale_slot = 1; /* h's scale rows are slots m * k + j */
    if (pl.reduce) {
        g.epi = FP8_EPI_Y_F32;
        g.out = scratch + pl.off_y;
        g.o_s0 = a->topk * K; /* row of slot s = m * k + j at s * K */
        g.o_s1 = K;
        g.out_dt = MF_DT_F32;
    } else {
        g.epi = FP8_EPI_OUT;
        g.out = mf_cuda_base(&a->out);
        g.o_s0 = a->out.stride[0];
        g.o_s1 = a->out.stride[1];
        g.out_dt = (int)a->out.dtype;
    }
    if (pl.dec)
        return final_decode(ctx, s, op, a, &pl, scratch, dec_share(ctx, s, a, &pl), &g);
    const bool ws = ws_suits(s, &pl, &g);
    if (!a->masked) {
        const MoeZero none = {NULL, 0, 0, 0, 0};
        MoeZero z = none; /* un-reduced: the rows of invalid slots are 0 */
        if (!a->reduce) {
            z.p = mf_cuda_base(&a->out);
            z.s0 = a->out.stride[0];
            z.s1 = a->out.stride[1];
            z.width = K;
            z.dt = (int)a->out.dtype;
        }
        const int bm = ws ? F8_BM : pl.bm;
        /* a layer's final (reduced: no rows to zero) takes the route its gate listed in this
         * scratch for the same tile height */
        const bool listed = a->layer && a->reduce && !pl.dec && route_left == scratch &&
                            s->fp8_route_bm == bm;
        if (!listed)
            MF_TRY(moe_route(ctx, s, op, &rt, &b, bm, a->tokens, &z, &none));
    }
    if (ws)
        MF_TRY(launch_ws(ctx, s, op, a, &pl, scratch, &g));
    else
        MF_TRY(fp8_launch_portable(ctx, s, op, pl.bm, 0, &g));
    if (!pl.reduce)
        return MOEFUSE_OK;
    return moe_launch_reduce(ctx, s, op, (const float *)g.out, b.expert_of, a);
}
