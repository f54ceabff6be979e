/*
 * moe_gate, moe_final and moe_forward of the CUDA backend: the host side.
 * Everything is enqueued on s->stream; nothing waits for the device and no
 * device data is read on the host. Scratch comes from one mf_cuda_scratch
 * request per call, sized from M, k, E and K alone.
 *
 * Per call, from the shapes (and the device) only, so moe_forward takes the
 * same decisions as moe_gate then moe_final and gives the same bits:
 *  - f32 operands: FMA kernels (moe_simt.cu); bf16 / f16: tensor cores,
 *    mma.sync (moe_mma.cu) or, for more than 8 slots per expert on sm_90a,
 *    wgmma (moe_wgmma.cu); on sm_90a, routed calls with large experts take the
 *    warp-specialised persistent kernel (moe_ws.cu) at every tile height;
 *  - MOEFUSE_CUDA_GEMM (read at context creation) forces a configuration for
 *    routed calls, where it fits the dtype and the device (forced_cfg);
 *  - tile height from the average slots per touched expert, S / min(E, S):
 *    16 (decode: weight streaming), 64 (128 on sm_90a), or 128;
 *  - S <= 16: direct mode, the GEMM blocks route themselves (no route
 *    kernels: a decode layer is two launches, gate and final); on sm_90 the
 *    bf16 / f16 tiles' depth may be split over a cluster (decode_split).
 * The reduced final's f32 y rows go through scratch, so the sum order is fixed
 * (j = 0..k-1): in direct mode the GEMM sums a token's slots itself, the last
 * block to finish one of its column blocks (fused, moe_tiles.cuh); routed
 * finals leave the sums to moe_reduce.cu, a stream at memory speed, while the
 * fused sums held a tile's consumers (and its tensor cores) for as long as
 * the loads of k rows took.
 */
#include "cuda/moe_internal.h"
#include "numerics/mf_activation.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int moe_cfg_bm(int cfg)
{
    switch (cfg) {
    case MOE_SIMT16: return 16;
    case MOE_SIMT64: return 64;
    case MOE_MMA_S: return 16;
    case MOE_MMA_M: return 64;
    default: return 128;
    }
}

int moe_cfg_cols(int cfg, int gate)
{
    /* weight rows per block; the gate's block makes half as many h columns */
    const int bn = (cfg == MOE_WGMMA_L || cfg == MOE_WS_L)  ? 256
                   : (cfg == MOE_MMA_M || cfg == MOE_MMA_L) ? 128
                   : cfg == MOE_MMA_S                       ? MOE_S_BN
                                                            : 64;
    return gate ? bn / 2 : bn;
}

/* MOEFUSE_CUDA_GEMM's names, in enum moe_cfg order. */
static const char *const gemm_names[MOE_CFG_COUNT] = {"simt16", "simt64", "mma_s", "mma_m",
                                                      "mma_l",  "wgmma",  "ws"};

extern "C" int mf_cuda_gemm_from_env(void)
{
    const char *v = getenv("MOEFUSE_CUDA_GEMM");
    if (!v || !*v)
        return -1;
    if (strcmp(v, "decode") == 0)
        return MOE_MMA_S; /* the decode tiles (and moe_fp8.cu's decode kernel for FP8) */
    for (int c = 0; c < MOE_CFG_COUNT; c++)
        if (strcmp(v, gemm_names[c]) == 0)
            return c;
    return -2;
}

extern "C" int mf_cuda_split_from_env(void)
{
    const char *v = getenv("MOEFUSE_CUDA_SPLIT");
    if (!v || !*v)
        return 0;
    char *end;
    const long n = strtol(v, &end, 10);
    return (*end == '\0' && n >= 1 && n <= MOE_SPLIT_MAX) ? (int)n : -1;
}

/*
 * The forced configuration when it fits the call: simt* for f32 operands,
 * the others for bf16 / f16, the Hopper ones on a Hopper device; else `cfg`.
 */
static int forced_cfg(const cuda_state *s, int simt, int cfg)
{
    const int f = s->forced_gemm;
    if (f < 0 || simt != (f == MOE_SIMT16 || f == MOE_SIMT64))
        return cfg;
    if (f == MOE_WGMMA_L && !moe_wgmma_usable(s))
        return cfg;
    if (f == MOE_WS_L && !moe_ws_usable(s))
        return cfg;
    return f;
}

/* Elements of one expert's weight matrix (K x I) from which routed calls take moe_ws.cu. On
 * an H200, once its epilogue held a chunk's values side by side, it beat moe_wgmma.cu and the
 * mma.sync tiles on Qwen3-30B-A3B's 2048 x 768 experts (1.5 M) at every routed M measured,
 * 32 to 4096 (by 2% to 14%), as it did on Mixtral's and DeepSeek-V3's; smaller experts were
 * not measured and keep the other kernels. */
#define MOE_WS_MIN_EXPERT ((int64_t)1 << 20)

/* Largest S handled in direct mode (one warp looks at every slot; tile height 16). */
#define MOE_DIRECT_MAX_SLOTS 16

/* Fewest depth tiles (MOE_BK each) a block of a split decode tile multiplies: below, the
 * fill of its pipeline costs more than the split saves (H100: Qwen3-30B-A3B's final, 12
 * depth tiles split 2 ways, and its gate split 4 ways, 8 each: 14-19% slower). */
#define MOE_SPLIT_MIN_TILES 16

/*
 * Blocks sharing the depth of each decode tile (direct mode, sm_90 clusters). Decode streams
 * each weight once, so what matters is that every SM streams until the end: with `tiles`
 * tiles and `resident` blocks in flight, the smallest split that makes at least two blocks
 * per place, so that blocks finishing unevenly leave no SM without the next. Measured on the
 * H100 (docs/PERFORMANCE.md): Mixtral's final (128 tiles) split 8 ways takes 11% off the
 * M = 1 layer's time; split 2 ways, the 896 tiles of Mixtral's gate and of DeepSeek-V3's
 * final were 2% and 6% slower.
 */
static int decode_split(int64_t tiles, int64_t kt, int64_t resident)
{
    int sp = 1;
    while (sp < MOE_SPLIT_MAX && tiles * sp < 2 * resident &&
           (kt + 2 * sp - 1) / (2 * sp) >= MOE_SPLIT_MIN_TILES)
        sp *= 2;
    return sp;
}

typedef struct moe_plan {
    int cfg, bm, direct, f16, simt;
    int fused; /* the reduced final's GEMM sums the slots itself (direct mode) */
    int split_gate, split_final; /* blocks sharing a decode tile's depth (MoeGemm.split) */
    int64_t S, tiles_bound;
    int64_t nblk_final; /* column blocks of the final GEMM (fused reduction counters) */
    size_t off_count, off_cnt, off_fill, off_offs, off_tiles, off_tile_expert, off_expert_of;
    size_t off_list, off_tok_valid, off_y, bytes;
    size_t cnt_n;
    int tile_ctrs; /* 2: the warp-specialised kernels' tile counters follow the arrival counters */
} moe_plan;

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/*
 * Configuration and scratch layout. reduce: the reduced final runs in this
 * call (f32 y [S, K]; in direct mode arrival counters [M, nblk]).
 * Routed mode: count u64 [E] | cnt: tile counters [2] (zeroed with the counts) |
 * fill [E] | offs [E+1] | tiles [E+1] | tile_expert [S/bm + min(E,S)] |
 * expert_of [S] | list [S] | tok_valid [M] | y. Direct mode: cnt u32 [M, nblk] (the fused
 * sums' arrival counters) | y.
 */
static moefuse_status plan_call(moefuse_context *ctx, const cuda_state *s, const char *op,
                                const mf_moe_args *a, moefuse_dtype a_dt, int reduce, moe_plan *pl)
{
    memset(pl, 0, sizeof *pl);
    const int64_t M = a->tokens, S = a->tokens * a->topk, E = a->experts, K = a->model_dim;
    pl->S = S;
    pl->f16 = a_dt == MOEFUSE_F16;
    pl->simt = a_dt == MOEFUSE_F32;
    const int64_t busy = E < S ? E : S;
    const int64_t avg = busy > 0 ? (S + busy - 1) / busy : 1;
    if (S <= MOE_DIRECT_MAX_SLOTS) {
        pl->cfg = pl->simt ? MOE_SIMT16 : MOE_MMA_S;
        pl->direct = 1;
    } else if (pl->simt) {
        pl->cfg = avg <= 8 ? MOE_SIMT16 : MOE_SIMT64;
    } else {
        pl->cfg = avg <= 8 ? MOE_MMA_S : (avg <= 48 ? MOE_MMA_M : MOE_MMA_L);
        /* sm_90a: the 128-slot wgmma tile from 9 slots per expert on, padding and all; on the
         * H100 it beat the 64-slot mma.sync tile by 1-9% at 9 to 48 slots per expert
         * (Qwen3-30B-A3B M = 256 and 512; 64 experts of 2048 x 1408, k = 6, M = 96 to 512),
         * and lost 1% to the 16-slot tile at 6 and 8 */
        if ((pl->cfg == MOE_MMA_M || pl->cfg == MOE_MMA_L) && moe_wgmma_usable(s))
            pl->cfg = MOE_WGMMA_L;
        /* large experts: the warp-specialised kernel whatever the slots per expert; its TMA
         * streams the weights at copy bandwidth even when most of a 128-row tile is padding,
         * and the padding's tensor work hides under that stream (docs/PERFORMANCE.md). From
         * the shapes alone, so that moe_forward decides as moe_gate and moe_final do: operands
         * it cannot load (unaligned rows) send a launch to moe_wgmma.cu, which gives its bits */
        if ((int64_t)a->model_dim * a->inter_dim >= MOE_WS_MIN_EXPERT && moe_ws_usable(s))
            pl->cfg = MOE_WS_L;
    }
    if (!pl->direct)
        pl->cfg = forced_cfg(s, pl->simt, pl->cfg);
    pl->bm = moe_cfg_bm(pl->cfg);
    pl->split_gate = pl->split_final = 1;
    if (pl->direct && !pl->simt && s->clusters) {
        const int64_t resident = (int64_t)s->sm_count * MOE_S_MINB, bk = MOE_BK;
        const int64_t gate_tiles = busy * ((a->inter_dim + MOE_S_BN / 2 - 1) / (MOE_S_BN / 2));
        const int64_t final_tiles = busy * ((K + MOE_S_BN - 1) / MOE_S_BN);
        pl->split_gate = s->forced_split ? s->forced_split
                                         : decode_split(gate_tiles, (K + bk - 1) / bk, resident);
        pl->split_final = s->forced_split
                              ? s->forced_split
                              : decode_split(final_tiles, (a->inter_dim + bk - 1) / bk, resident);
    }
    /* sum over experts of ceil(n_e / bm) <= S / bm + (experts touched) */
    pl->tiles_bound = S / pl->bm + busy;
    const int64_t cols = moe_cfg_cols(pl->cfg, 0);
    pl->nblk_final = (K + cols - 1) / cols;
    pl->tile_ctrs = !pl->direct && pl->cfg == MOE_WS_L ? 2 : 0;
    pl->fused = reduce && pl->direct;
    pl->cnt_n = (pl->fused ? (size_t)M * (size_t)pl->nblk_final : 0) + (size_t)pl->tile_ctrs;

    size_t at = 0;
    if (!pl->direct) {
        pl->off_count = at, at += (size_t)E * 8;
        pl->off_cnt = at, at = align256(at + pl->cnt_n * 4);
        pl->off_fill = at, at = align256(at + (size_t)E * 8);
        pl->off_offs = at, at = align256(at + (size_t)(E + 1) * 8);
        pl->off_tiles = at, at = align256(at + (size_t)(E + 1) * 8);
        pl->off_tile_expert = at, at = align256(at + (size_t)pl->tiles_bound * 4);
        pl->off_expert_of = at, at = align256(at + (size_t)S * 4);
        pl->off_list = at, at = align256(at + (size_t)S * 8);
        pl->off_tok_valid = at, at = align256(at + (size_t)M * 4);
    } else {
        pl->off_cnt = at, at = align256(at + pl->cnt_n * 4);
    }
    if (reduce) {
        size_t y;
        if (__builtin_mul_overflow((size_t)S, (size_t)K, &y) ||
            __builtin_mul_overflow(y, sizeof(float), &y) || __builtin_add_overflow(at, y, &y))
            return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                            "%s: the f32 [M*k, K] scratch of %lld x %lld overflows size_t", op,
                            (long long)S, (long long)K);
        pl->off_y = at;
        at = y;
    }
    pl->bytes = at;
    return MOEFUSE_OK;
}

static MoeRouteBufs route_bufs(const moe_plan *pl, char *scratch)
{
    MoeRouteBufs b;
    memset(&b, 0, sizeof b);
    if (!scratch)
        return b;
    if (pl->cnt_n) {
        b.cnt = (unsigned *)(scratch + pl->off_cnt);
        b.cnt_n = pl->cnt_n;
        if (pl->tile_ctrs)
            b.tile_ctr = b.cnt + pl->cnt_n - pl->tile_ctrs;
    }
    if (pl->direct)
        return b;
    b.count = (unsigned long long *)(scratch + pl->off_count);
    b.fill = (unsigned long long *)(scratch + pl->off_fill);
    b.offs = (long long *)(scratch + pl->off_offs);
    b.tiles = (long long *)(scratch + pl->off_tiles);
    b.tile_expert = (int *)(scratch + pl->off_tile_expert);
    b.expert_of = (int *)(scratch + pl->off_expert_of);
    b.list = (long long *)(scratch + pl->off_list);
    b.tok_valid = (int *)(scratch + pl->off_tok_valid);
    return b;
}

static MoeRoute route_view(const mf_moe_args *a, const moe_plan *pl, const MoeRouteBufs *b)
{
    MoeRoute rt = mf_route_of(a);
    rt.direct = pl->direct;
    rt.offs = b->offs;
    rt.tiles = b->tiles;
    rt.tile_expert = b->tile_expert;
    rt.list = b->list;
    return rt;
}

static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* 16-byte cp.async needs the row starts 16-byte aligned: base and strides (2-byte elements). */
static int vec_ok(const void *base, int64_t s0, int64_t s1)
{
    return aligned16(base) && s0 % 8 == 0 && s1 % 8 == 0;
}

/* The epilogue's 4-wide stores: every out row starts at a multiple of 4 elements. */
static int vec_out_ok(const void *base, moefuse_dtype dt, int64_t s0, int64_t s1)
{
    const uintptr_t align = (uintptr_t)(4 * moefuse_dtype_size(dt));
    return ((uintptr_t)base % align) == 0 && s0 % 4 == 0 && s1 % 4 == 0;
}

static long long lin_bound(const moe_plan *pl, int64_t nblk)
{
    long long v;
    if (__builtin_mul_overflow((long long)nblk, (long long)pl->tiles_bound, &v))
        return LLONG_MAX; /* blocks loop and stop at the first index past the real tiles */
    return v;
}

static MoeGemm gate_params(const mf_moe_args *a, const moe_plan *pl, const MoeRoute *rt,
                           const moefuse_tensor *h, int zero_invalid)
{
    MoeGemm g;
    memset(&g, 0, sizeof g);
    const int64_t I = a->inter_dim;
    const int64_t cols = moe_cfg_cols(pl->cfg, 1);
    g.rt = *rt;
    g.a = mf_cuda_base(&a->x);
    g.a_s0 = a->x.stride[0];
    g.a_s1 = 0;
    g.w = mf_cuda_base(&a->w1);
    g.w_s0 = a->w1.stride[0];
    g.w_s1 = a->w1.stride[1];
    g.depth = a->model_dim;
    g.ncols = I;
    g.nblk = (I + cols - 1) / cols;
    g.gate_row = mf_gate_at((int)a->opt.order, I);
    g.up_row = mf_up_at((int)a->opt.order, I);
    g.row_step = mf_gate_step((int)a->opt.order);
    if (a->b1.data) {
        g.bias = mf_cuda_base(&a->b1);
        g.bias_s0 = a->b1.stride[0];
        g.bias_dt = (int)a->b1.dtype;
    }
    g.out = mf_cuda_base(h);
    g.o_s0 = h->stride[0];
    g.o_s1 = h->stride[1];
    g.out_dt = (int)h->dtype;
    g.vec_out = vec_out_ok(g.out, h->dtype, g.o_s0, g.o_s1);
    g.act = (int)a->opt.activation;
    g.alpha = a->opt.alpha;
    g.limit = a->opt.limit;
    g.up_offset = a->opt.up_offset;
    g.vec_a = vec_ok(g.a, g.a_s0, 0);
    g.vec_b = vec_ok(g.w, g.w_s0, g.w_s1);
    g.zero_invalid = pl->direct && zero_invalid;
    g.lin_bound = lin_bound(pl, g.nblk);
    g.split = pl->split_gate;
    return g;
}

/*
 * y: f32 [S, K] scratch of the reduced output (summed by the final itself where pl->fused,
 * else by moe_launch_reduce after it), else NULL (un-reduced: y rounded straight into a->out).
 */
static MoeGemm final_params(const mf_moe_args *a, const moe_plan *pl, const MoeRoute *rt,
                            const MoeRouteBufs *b, const moefuse_tensor *h, float *y)
{
    MoeGemm g;
    memset(&g, 0, sizeof g);
    const int64_t K = a->model_dim;
    const int64_t cols = moe_cfg_cols(pl->cfg, 0);
    g.rt = *rt;
    g.a = mf_cuda_base(h);
    g.a_s0 = h->stride[0];
    g.a_s1 = h->stride[1];
    g.w = mf_cuda_base(&a->w2);
    g.w_s0 = a->w2.stride[0];
    g.w_s1 = a->w2.stride[1];
    g.depth = a->inter_dim;
    g.ncols = K;
    g.nblk = (K + cols - 1) / cols;
    g.row_step = 1; /* w2 / b2 rows, consecutive */
    if (a->b2.data) {
        g.bias = mf_cuda_base(&a->b2);
        g.bias_s0 = a->b2.stride[0];
        g.bias_dt = (int)a->b2.dtype;
    }
    if (y) {
        g.out = y;
        g.o_s0 = a->topk * K; /* row of slot s = m * k + j at s * K */
        g.o_s1 = K;
        g.out_dt = (int)MOEFUSE_F32;
        g.fuse = pl->fused;
        g.cnt = b->cnt;
        g.tok_valid = b->tok_valid;
        g.expert_of = b->expert_of;
        g.tw = (const float *)mf_cuda_base(&a->topk_weights);
        g.tw_s0 = a->topk_weights.stride[0];
        g.rout = mf_cuda_base(&a->out);
        g.rout_s0 = a->out.stride[0];
        g.rout_dt = (int)a->out.dtype;
    } else {
        g.out = mf_cuda_base(&a->out);
        g.o_s0 = a->out.stride[0];
        g.o_s1 = a->out.stride[1];
        g.out_dt = (int)a->out.dtype;
        g.zero_invalid = pl->direct;
    }
    g.vec_out = vec_out_ok(g.out, (moefuse_dtype)g.out_dt, g.o_s0, g.o_s1);
    g.act = (int)a->opt.activation;
    g.limit = a->opt.limit;
    g.vec_a = vec_ok(g.a, g.a_s0, g.a_s1);
    g.vec_b = vec_ok(g.w, g.w_s0, g.w_s1);
    g.lin_bound = lin_bound(pl, g.nblk);
    g.tile_ctr = b->tile_ctr ? b->tile_ctr + 1 : NULL;
    g.split = pl->split_final;
    return g;
}

static moefuse_status launch_gemm(moefuse_context *ctx, cuda_state *s, const char *op,
                                  const moe_plan *pl, int gate, const MoeGemm *g)
{
    if (pl->simt)
        return moe_launch_simt(ctx, s, op, pl->cfg, gate, g);
    if (pl->cfg == MOE_WGMMA_L)
        return moe_launch_wgmma(ctx, s, op, gate, pl->f16, g);
    if (pl->cfg == MOE_WS_L)
        return moe_launch_ws(ctx, s, op, gate, pl->f16, g);
    return moe_launch_mma(ctx, s, op, pl->cfg, gate, pl->f16, g);
}

/* Everything a GEMM launch can refuse (shared memory, attributes), before the call writes. */
static moefuse_status ready_gemm(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const moe_plan *pl, int gate)
{
    if (pl->simt)
        return MOEFUSE_OK;
    if (pl->cfg == MOE_WGMMA_L)
        return moe_launch_wgmma(ctx, s, op, gate, pl->f16, NULL);
    if (pl->cfg == MOE_WS_L)
        return moe_launch_ws(ctx, s, op, gate, pl->f16, NULL);
    return moe_launch_mma(ctx, s, op, pl->cfg, gate, pl->f16, NULL);
}

/* Zero `rows` rows of `width` bytes, `pitch` bytes apart (k = 0: the reduced output). */
static moefuse_status zero_rows(moefuse_context *ctx, cuda_state *s, const char *op, void *p,
                                size_t pitch, size_t width, size_t rows)
{
    if (rows == 0 || width == 0)
        return MOEFUSE_OK;
    cudaError_t e = rows == 1 ? cudaMemsetAsync(p, 0, width, s->stream)
                              : cudaMemset2DAsync(p, pitch, 0, width, rows, s->stream);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, op, "cudaMemsetAsync(out)");
}

/* k = 0 (M * k = 0 slots): the reduced output is all zeros. */
static moefuse_status zero_output(moefuse_context *ctx, cuda_state *s, const char *op,
                                  const mf_moe_args *a)
{
    const size_t es = moefuse_dtype_size(a->out.dtype);
    return zero_rows(ctx, s, op, mf_cuda_base(&a->out), (size_t)a->out.stride[0] * es,
                     (size_t)a->model_dim * es, (size_t)a->tokens);
}

/*
 * Scratch and route of one call: route kernels in routed mode (zero: rows of
 * invalid slots to zero; zero_tok: output rows of tokens without a valid slot).
 */
static moefuse_status prepare(moefuse_context *ctx, cuda_state *s, const char *op,
                              const mf_moe_args *a, const moe_plan *pl, const MoeZero *zero,
                              const MoeZero *zero_tok, MoeRouteBufs *b, char **scratch,
                              MoeRoute *rt)
{
    *scratch = NULL;
    if (pl->bytes > 0)
        MF_TRY(mf_cuda_scratch(ctx, s, pl->bytes, op, (void **)scratch));
    *b = route_bufs(pl, *scratch);
    *rt = route_view(a, pl, b);
    if (!pl->direct)
        MF_TRY(moe_route(ctx, s, op, rt, b, pl->bm, a->tokens, zero, zero_tok));
    return MOEFUSE_OK;
}

/* The reduced output's rows, for tokens without a valid slot (routed mode). */
static MoeZero out_rows(const mf_moe_args *a)
{
    MoeZero z = {mf_cuda_base(&a->out), a->out.stride[0], 0, a->model_dim, (int)a->out.dtype};
    return z;
}

extern "C" moefuse_status mf_cuda_moe_gate(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    static const char op[] = "moe_gate";
    cuda_state *s = (cuda_state *)state;
    moe_plan pl;
    MF_TRY(plan_call(ctx, s, op, a, a->x.dtype, 0, &pl));
    if (pl.S == 0)
        return MOEFUSE_OK; /* h is [M, k, I] with M * k = 0: nothing to write */
    const MoeZero z = {mf_cuda_base(&a->h), a->h.stride[0], a->h.stride[1], a->inter_dim,
                       (int)a->h.dtype};
    const MoeZero none = {NULL, 0, 0, 0, 0};
    char *scratch;
    MoeRouteBufs b;
    MoeRoute rt;
    MF_TRY(ready_gemm(ctx, s, op, &pl, 1));
    MF_TRY(prepare(ctx, s, op, a, &pl, &z, &none, &b, &scratch, &rt));
    MoeGemm g = gate_params(a, &pl, &rt, &a->h, 1);
    g.tile_ctr = b.tile_ctr;
    return launch_gemm(ctx, s, op, &pl, 1, &g);
}

extern "C" moefuse_status mf_cuda_moe_final(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    static const char op[] = "moe_final";
    cuda_state *s = (cuda_state *)state;
    moe_plan pl;
    MF_TRY(plan_call(ctx, s, op, a, a->h.dtype, a->reduce, &pl));
    if (pl.S == 0)
        return a->reduce ? zero_output(ctx, s, op, a) : MOEFUSE_OK;
    MoeZero z = {NULL, 0, 0, 0, 0}, ztok = {NULL, 0, 0, 0, 0};
    if (a->reduce) {
        ztok = out_rows(a);
    } else {
        z.p = mf_cuda_base(&a->out);
        z.s0 = a->out.stride[0];
        z.s1 = a->out.stride[1];
        z.width = a->model_dim;
        z.dt = (int)a->out.dtype;
    }
    char *scratch;
    MoeRouteBufs b;
    MoeRoute rt;
    MF_TRY(ready_gemm(ctx, s, op, &pl, 0));
    MF_TRY(prepare(ctx, s, op, a, &pl, &z, &ztok, &b, &scratch, &rt));
    if (pl.direct && b.cnt) { /* routed mode zeroes the counters with the expert counts */
        cudaError_t e = cudaMemsetAsync(b.cnt, 0, b.cnt_n * sizeof *b.cnt, s->stream);
        if (e != cudaSuccess)
            return mf_cuda_fail(ctx, e, op, "cudaMemsetAsync(reduction counters)");
    }
    float *y = a->reduce ? (float *)(scratch + pl.off_y) : NULL;
    const MoeGemm g = final_params(a, &pl, &rt, &b, &a->h, y);
    MF_TRY(launch_gemm(ctx, s, op, &pl, 0, &g));
    return y && !pl.fused ? moe_launch_reduce(ctx, s, op, y, b.expert_of, a) : MOEFUSE_OK;
}

/*
 * moe_forward's scratch: h [M, k, I] in x's dtype lives in the same scratch as the route, after
 * the rest (the core leaves it to us, so growing it is stream-ordered, never a cudaMalloc or
 * cudaFree). Grows pl->bytes and gives h's offset.
 */
static moefuse_status forward_scratch(moefuse_context *ctx, const char *op, const mf_moe_args *a,
                                      moe_plan *pl, size_t *off_h)
{
    *off_h = align256(pl->bytes);
    size_t h_bytes;
    if (__builtin_mul_overflow((size_t)pl->S * moefuse_dtype_size(a->x.dtype),
                               (size_t)a->inter_dim, &h_bytes) ||
        __builtin_add_overflow(*off_h, h_bytes, &pl->bytes))
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "%s: the [M, k, I] intermediate overflows size_t", op);
    return MOEFUSE_OK;
}

/* Each call's scratch, as plan_call lays it out; none when there are no slots. */
extern "C" moefuse_status mf_cuda_moe_gate_workspace(moefuse_context *ctx, void *state,
                                                     const mf_moe_args *a, size_t *bytes)
{
    moe_plan pl;
    MF_TRY(plan_call(ctx, (const cuda_state *)state, "moe_gate", a, a->x.dtype, 0, &pl));
    *bytes = pl.S == 0 ? 0 : pl.bytes;
    return MOEFUSE_OK;
}

extern "C" moefuse_status mf_cuda_moe_final_workspace(moefuse_context *ctx, void *state,
                                                      const mf_moe_args *a, size_t *bytes)
{
    moe_plan pl;
    MF_TRY(plan_call(ctx, (const cuda_state *)state, "moe_final", a, a->h.dtype, a->reduce, &pl));
    *bytes = pl.S == 0 ? 0 : pl.bytes;
    return MOEFUSE_OK;
}

extern "C" moefuse_status mf_cuda_moe_forward_workspace(moefuse_context *ctx, void *state,
                                                        const mf_moe_args *a, size_t *bytes)
{
    static const char op[] = "moe_forward";
    moe_plan pl;
    MF_TRY(plan_call(ctx, (const cuda_state *)state, op, a, a->x.dtype, 1, &pl));
    size_t off_h;
    if (pl.S > 0)
        MF_TRY(forward_scratch(ctx, op, a, &pl, &off_h));
    *bytes = pl.S == 0 ? 0 : pl.bytes;
    return MOEFUSE_OK;
}

/*
 * The layer: one route for both GEMMs, gate into a->h (the core's scratch
 * [M, k, I] in x's dtype, already allocated), then the final and its top-k
 * sum. Same kernels and configuration as moe_gate then moe_final, so the
 * same bits. Direct mode (decode) is two launches: the gate zeroes the final's
 * arrival counters on the way.
 */
extern "C" moefuse_status mf_cuda_moe_forward(moefuse_context *ctx, void *state,
                                              const mf_moe_args *a)
{
    static const char op[] = "moe_forward";
    cuda_state *s = (cuda_state *)state;
    moe_plan pl;
    MF_TRY(plan_call(ctx, s, op, a, a->x.dtype, 1, &pl));
    if (pl.S == 0)
        return zero_output(ctx, s, op, a);
    size_t off_h;
    MF_TRY(forward_scratch(ctx, op, a, &pl, &off_h));
    const MoeZero none = {NULL, 0, 0, 0, 0}; /* h is internal: invalid slots' rows never read */
    const MoeZero ztok = out_rows(a);
    char *scratch;
    MoeRouteBufs b;
    MoeRoute rt;
    MF_TRY(ready_gemm(ctx, s, op, &pl, 1));
    MF_TRY(ready_gemm(ctx, s, op, &pl, 0));
    MF_TRY(prepare(ctx, s, op, a, &pl, &none, &ztok, &b, &scratch, &rt));
    const int64_t h_shape[3] = {a->tokens, a->topk, a->inter_dim};
    const moefuse_tensor h = moefuse_tensor_dense(scratch + off_h, a->x.dtype, 3, h_shape);
    /* sm_90, tensor cores: the final launches while the gate runs and streams its weights */
    const int pdl = s->pdl && !pl.simt;
    MoeGemm gg = gate_params(a, &pl, &rt, &h, 0);
    gg.tile_ctr = b.tile_ctr;
    if (pl.direct) {
        gg.zero_cnt = b.cnt;
        gg.zero_cnt_n = (long long)b.cnt_n;
    }
    gg.trigger = pdl;
    MF_TRY(launch_gemm(ctx, s, op, &pl, 1, &gg));
    float *y = (float *)(scratch + pl.off_y);
    MoeGemm gf = final_params(a, &pl, &rt, &b, &h, y);
    gf.pdl = pdl;
    MF_TRY(launch_gemm(ctx, s, op, &pl, 0, &gf));
    return pl.fused ? MOEFUSE_OK : moe_launch_reduce(ctx, s, op, y, b.expert_of, a);
}
