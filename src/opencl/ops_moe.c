/*
 * Host side of moe_gate and moe_final (moe_forward is the core's default:
 * gate into its scratch, then final). Three paths, chosen from the sizes:
 *  - tiled GEMMs over slots grouped by expert (kernels/moe_tiled.cl), and
 *    their wide tiles for large batches on GPUs (kernels/moe_wide.cl);
 *  - the one-column-per-work-item kernels (kernels/moe.cl), for CPU devices
 *    and devices that cannot run the others; same bits as the tiled path;
 *  - matrix-vector kernels (kernels/moe_gemv.cl) on GPUs up to 8 slots per
 *    expert, which add each dot product in another (fixed) order.
 * MOEFUSE_OPENCL_GEMM=tiled|wide|simple|gemv forces one.
 */
#include "opencl/ocl_internal.h"

/* A tile shape: its kernels, slots a tile, h columns a gate work-group, output columns a final
 * work-group (kernels/moe_tiled.cl, kernels/moe_wide.cl); 16 x 16 work-items either way. */
typedef struct tile_shape {
    enum mf_ocl_kernel gate, final;
    int64_t tm, gate_cols, final_cols;
} tile_shape;

static const tile_shape TILES = {MF_K_MOE_GATE_TILED, MF_K_MOE_FINAL_TILED, 64, 32, 64};
static const tile_shape WIDE = {MF_K_MOE_GATE_WIDE, MF_K_MOE_FINAL_WIDE, 128, 64, 128};

/* f32 y scratch of the reduced final per chunk of tokens (as the CPU backend). For the wide
 * tiles up to 4 times that (within the device's largest buffer) where a chunk would average
 * fewer slots per expert than a wide tile holds: Qwen3-30B-A3B at 64 MiB is 1024 tokens, 64
 * slots per expert, half of every 128-slot tile idle. */
#ifndef MF_OCL_Y_BYTES /* overridable at build time, to test the chunking */
#define MF_OCL_Y_BYTES ((size_t)64 << 20)
#endif
enum { Y_BYTES_GROWTH = 4 };

/* Routing operands shared by both kernels: ids, (weights,) map. */
static void routing_args(mf_kargs *k, const mf_moe_args *a, bool weights)
{
    mf_karg_operand(k, &a->topk_ids, 1, false);
    if (weights) {
        mf_karg_operand(k, &a->topk_weights, 1, false);
    }
    mf_karg_operand(k, &a->expert_map, 1, false);
    mf_karg_int(k, a->expert_map.data != NULL);
    mf_karg_long(k, a->topk);
    mf_karg_long(k, a->model_dim);
    mf_karg_long(k, a->inter_dim);
    mf_karg_long(k, a->experts);
    mf_karg_long(k, a->global_experts);
}

/* x, w1, b1 as both gate kernels take them (tiled and simple). */
static void gate_operand_args(mf_kargs *k, const mf_moe_args *a)
{
    mf_karg_operand(k, &a->x, 1, true);
    mf_karg_operand(k, &a->w1, 2, false);
    mf_karg_operand(k, &a->b1, 1, true);
    mf_karg_int(k, a->b1.data != NULL);
}

/* The gate's activation options, as every gate kernel takes them (kernels/moe.cl). */
static void gate_fn_args(mf_kargs *k, const mf_moe_args *a)
{
    mf_karg_int(k, (int32_t)a->opt.activation);
    mf_karg_int(k, (int32_t)a->opt.order);
    mf_karg_float(k, a->opt.limit);
    mf_karg_float(k, a->opt.alpha);
    mf_karg_float(k, a->opt.up_offset);
}

/* h, w2, b2 as both final kernels take them. */
static void final_operand_args(mf_kargs *k, const mf_moe_args *a)
{
    mf_karg_operand(k, &a->h, 2, true);
    mf_karg_operand(k, &a->w2, 2, false);
    mf_karg_operand(k, &a->b2, 1, true);
    mf_karg_int(k, a->b2.data != NULL);
}

/* Expert map and sizes for the route / zero / reduce kernels. */
static void map_args(mf_kargs *k, const mf_moe_args *a)
{
    mf_karg_operand(k, &a->expert_map, 1, false);
    mf_karg_int(k, a->expert_map.data != NULL);
    mf_karg_long(k, a->topk);
    mf_karg_long(k, a->experts);
}

/* Longs of the route of S slots (offs | tiles | list); the int counters follow. */
static size_t route_longs(const mf_moe_args *a, int64_t S)
{
    return (size_t)(2 * a->experts + 2 + S);
}
size_t mf_ocl_moe_route_bytes(const mf_moe_args *a, int64_t S)
{
    return route_longs(a, S) * sizeof(cl_long) + (size_t)(2 * a->experts) * sizeof(cl_int);
}

/* Route slots [s0, s1) into r in tiles of tm slots: count, scan, fill (kernels/moe_tiled.cl). */
moefuse_status mf_ocl_moe_route(moefuse_context *ctx, ocl_state *s, const mf_moe_args *a,
                                cl_mem r, int64_t s0, int64_t s1, int64_t tm, const char *op)
{
    const int64_t cfo = (int64_t)(route_longs(a, s1 - s0) * 2); /* in ints */
    const cl_int zero = 0;
    if (a->experts > 0) {
        cl_int e = clEnqueueFillBuffer(s->queue, r, &zero, sizeof zero, (size_t)cfo * sizeof zero,
                                       (size_t)a->experts * sizeof zero, 0, NULL, NULL);
        if (e != CL_SUCCESS)
            return mf_ocl_fail(ctx, e, op, "clEnqueueFillBuffer(route counts)");
    }
    const size_t local = 64, global = mf_round_up((size_t)(s1 - s0), local), one = 1;
    for (int pass = 0; pass < 2; pass++) {
        const enum mf_ocl_kernel kid = pass == 0 ? MF_K_MOE_ROUTE_COUNT : MF_K_MOE_ROUTE_FILL;
        mf_kargs k = mf_kargs_begin(s->kernels[kid]);
        mf_karg_operand(&k, &a->topk_ids, 1, false);
        map_args(&k, a);
        mf_karg_long(&k, a->global_experts);
        mf_karg_long(&k, s0);
        mf_karg_long(&k, s1);
        if (pass == 1)
            mf_karg_mem(&k, r);
        mf_karg_mem(&k, r);
        mf_karg_long(&k, cfo);
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 1, &global, &local));
        if (pass == 1)
            break;
        k = mf_kargs_begin(s->kernels[MF_K_MOE_ROUTE_SCAN]);
        mf_karg_mem(&k, r);
        mf_karg_mem(&k, r);
        mf_karg_long(&k, cfo);
        mf_karg_long(&k, a->experts);
        mf_karg_long(&k, tm);
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 1, &one, &one));
    }
    return MOEFUSE_OK;
}

/* Zero the rows of invalid slots of t ([M, k, width]). */
static moefuse_status zero_invalid(moefuse_context *ctx, ocl_state *s, const mf_moe_args *a,
                                   const moefuse_tensor *t, int64_t width, const char *op)
{
    mf_kargs k = mf_kargs_begin(s->kernels[MF_K_MOE_ZERO_INVALID]);
    mf_karg_operand(&k, &a->topk_ids, 1, false);
    map_args(&k, a);
    mf_karg_long(&k, a->global_experts);
    mf_karg_operand(&k, t, 2, true);
    mf_karg_long(&k, width);
    const size_t global[2] = {mf_round_up((size_t)width, 64), (size_t)(a->tokens * a->topk)};
    const size_t local[2] = {64, 1};
    return mf_ocl_launch(ctx, s, &k, op, 2, global, local);
}

/* An upper bound of the tiles of S slots: sum of ceil(n_e / tm) <= S / tm + min(E, S). */
size_t mf_ocl_moe_route_tiles(const mf_moe_args *a, int64_t S, int64_t tm)
{
    return (size_t)(S / tm + (a->experts < S ? a->experts : S));
}

static moefuse_status gate_tiled(moefuse_context *ctx, ocl_state *s, const mf_moe_args *a,
                                 const tile_shape *t)
{
    static const char op[] = "moe_gate";
    const int64_t S = a->tokens * a->topk;
    cl_mem r;
    MF_TRY(mf_ocl_scratch(ctx, s, mf_ocl_moe_route_bytes(a, S), op, &r));
    MF_TRY(zero_invalid(ctx, s, a, &a->h, a->inter_dim, op));
    MF_TRY(mf_ocl_moe_route(ctx, s, a, r, 0, S, t->tm, op));
    mf_kargs k = mf_kargs_begin(s->kernels[t->gate]);
    gate_operand_args(&k, a);
    mf_karg_mem(&k, r);
    mf_karg_long(&k, a->experts);
    mf_karg_long(&k, a->topk);
    mf_karg_long(&k, a->model_dim);
    mf_karg_long(&k, a->inter_dim);
    gate_fn_args(&k, a);
    mf_karg_operand(&k, &a->h, 2, true);
    const size_t global[2] = {(size_t)((a->inter_dim + t->gate_cols - 1) / t->gate_cols) * 16,
                              mf_ocl_moe_route_tiles(a, S, t->tm) * 16};
    const size_t local[2] = {16, 16};
    return mf_ocl_launch(ctx, s, &k, op, 2, global, local);
}

/* The tiled final's scratch: the route of a chunk of tokens, then its f32 y. */
typedef struct final_layout {
    int64_t chunk; /* tokens per chunk: the f32 y of a chunk stays within 4 MF_OCL_Y_BYTES */
    size_t yoff;   /* y after the route, at a float offset that does not move between chunks */
    size_t bytes;
} final_layout;

static final_layout final_scratch(const ocl_state *s, const mf_moe_args *a, bool wide)
{
    const int64_t M = a->tokens, kk = a->topk, K = a->model_dim;
    final_layout L;
    L.chunk = M > 0 ? M : 1;
    if (a->reduce && kk > 0 && K > 0) {
        const size_t row = (size_t)kk * (size_t)K * sizeof(cl_float); /* y of a token */
        int64_t c = (int64_t)(MF_OCL_Y_BYTES / row);
        const int64_t full = (WIDE.tm * a->experts + kk - 1) / kk; /* a wide tile an expert */
        if (wide && c < full) {
            const size_t route = mf_ocl_moe_route_bytes(a, full * kk) + 64;
            size_t most = Y_BYTES_GROWTH * MF_OCL_Y_BYTES;
            if ((cl_ulong)most + route > s->max_alloc)
                most = s->max_alloc > route ? (size_t)(s->max_alloc - route) : 0;
            const int64_t grown = (int64_t)(most / row);
            if (grown > c)
                c = full < grown ? full : grown;
        }
        L.chunk = c < 1 ? 1 : (c < L.chunk ? c : L.chunk);
    }
    L.yoff = mf_round_up(mf_ocl_moe_route_bytes(a, L.chunk * kk), 64);
    L.bytes = L.yoff + (a->reduce ? (size_t)(L.chunk * kk * K) * sizeof(cl_float) : 0);
    return L;
}

static moefuse_status final_tiled(moefuse_context *ctx, ocl_state *s, const mf_moe_args *a,
                                  const tile_shape *t)
{
    static const char op[] = "moe_final";
    const int64_t M = a->tokens, kk = a->topk, K = a->model_dim;
    const final_layout L = final_scratch(s, a, t == &WIDE);
    const int64_t chunk = L.chunk;
    const size_t yoff = L.yoff;
    cl_mem r;
    /* the call's only allocation, before its first write: nothing below allocates, so a
     * failure to get memory leaves out as it was, chunk or no chunk (tests/test_faults.c) */
    MF_TRY(mf_ocl_scratch(ctx, s, L.bytes, op, &r));
    if (!a->reduce)
        MF_TRY(zero_invalid(ctx, s, a, &a->out, K, op));
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t m1 = M - m0 < chunk ? M : m0 + chunk, S = (m1 - m0) * kk;
        MF_TRY(mf_ocl_moe_route(ctx, s, a, r, m0 * kk, m1 * kk, t->tm, op));
        mf_kargs k = mf_kargs_begin(s->kernels[t->final]);
        final_operand_args(&k, a);
        mf_karg_mem(&k, r);
        mf_karg_long(&k, a->experts);
        mf_karg_long(&k, kk);
        mf_karg_long(&k, K);
        mf_karg_long(&k, a->inter_dim);
        mf_karg_int(&k, a->reduce);
        mf_karg_long(&k, m0 * kk);
        mf_karg_mem(&k, r); /* y follows the route in the same scratch */
        mf_karg_long(&k, (int64_t)(yoff / sizeof(cl_float)));
        mf_karg_operand(&k, &a->out, 1, false);
        mf_karg_long(&k, a->reduce ? 0 : a->out.stride[1]);
        mf_karg_int(&k, (int32_t)a->out.dtype);
        const size_t global[2] = {(size_t)((K + t->final_cols - 1) / t->final_cols) * 16,
                                  mf_ocl_moe_route_tiles(a, S, t->tm) * 16};
        const size_t local[2] = {16, 16};
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 2, global, local));
        if (!a->reduce)
            continue;
        k = mf_kargs_begin(s->kernels[MF_K_MOE_REDUCE]);
        mf_karg_operand(&k, &a->topk_ids, 1, false);
        mf_karg_operand(&k, &a->topk_weights, 1, false);
        map_args(&k, a);
        mf_karg_long(&k, a->global_experts);
        mf_karg_long(&k, K);
        mf_karg_long(&k, m0);
        mf_karg_mem(&k, r);
        mf_karg_long(&k, (int64_t)(yoff / sizeof(cl_float)));
        mf_karg_operand(&k, &a->out, 1, true);
        const size_t rg[2] = {mf_round_up((size_t)K, 64), (size_t)(m1 - m0)};
        const size_t rlocal[2] = {64, 1};
        MF_TRY(mf_ocl_launch(ctx, s, &k, op, 2, rg, rlocal));
    }
    return MOEFUSE_OK;
}

/* Elements of the activation row staged in local memory per step. */
static size_t chunk(const ocl_state *s) { return s->wg * 2; }

/* Output columns per 256-wide work-group of kernels/moe_gemv.cl (8 teams of 32). */
enum { GV_TEAMS = 8, GV_WG = 256 };

enum gemm_path { PATH_SIMPLE, PATH_TILED, PATH_WIDE, PATH_GEMV };

/* The matrix-vector kernels up to this many slots per expert on average, tiles above. */
enum { GEMV_MAX_PER_EXPERT = 8 };

/* The wide tiles can take this GEMM: they stage 8 elements of a row at a time, at depths that
 * are multiples of 8, with 16-byte loads. */
static bool wide_takes(const ocl_state *s, const mf_moe_args *a, bool gate)
{
    return s->wide && (gate ? mf_ocl_chunks_aligned(&a->x, 1) && mf_ocl_chunks_aligned(&a->w1, 2)
                            : mf_ocl_chunks_aligned(&a->h, 2) && mf_ocl_chunks_aligned(&a->w2, 2));
}

/*
 * Which GEMMs, from S = M * k slots over E experts. The matrix-vector kernels
 * read each weight row once per slot, coalesced; slots of one expert share
 * the rows through L2. A 64-slot tile holds about S / E real rows and
 * computes the rest for nothing. Measured on an H100 (NVIDIA OpenCL,
 * moe_forward bf16, ms, tiled / matrix-vector): Mixtral M=32 (S = 8E)
 * 13.8/10.5, M=64 (16E) 14.5/20.8; Qwen3 M=32 (2E) 5.08/1.23, M=128 (8E)
 * 5.83/4.82, M=256 (16E) 6.05/9.62; DeepSeek-V3 M=128 (4E) 99.9/41.8.
 * The wide tiles (128 slots, 8 x 8 a work-item) beat the 64-slot ones at
 * every size where both ran (H200, moe_forward, ms, wide / tiled): bf16
 * Qwen3 M=32 (2E) 4.14/4.73, M=128 (8E) 4.68/5.35, f32 M=512 (32E)
 * 4.53/5.59, M=4096 14.4/26.7; f32 Mixtral M=4096 91.0/206.8. So the
 * 64-slot tiles are left to rows the wide loads cannot take. Matrix-vector
 * keeps up to 8E: at 8E it is even with wide (Qwen3 4.83/4.68, Mixtral
 * M=32 10.0/10.2), below it far ahead (Qwen3 M=32: 1.22 against 4.14).
 * The one-column kernels read a row once per slot too, but one element per
 * work-item, rows apart; CPU devices keep them (PoCL measured: they win at
 * every size, 2.5 vs 2.0 GFLOP/s with full tiles), as do devices that can
 * run neither of the others.
 */
static enum gemm_path choose_path(const ocl_state *s, const mf_moe_args *a, bool gate)
{
    if (s->force_gemv && s->gemv)
        return PATH_GEMV;
    const bool wide = wide_takes(s, a, gate);
    if (s->force_wide && s->tiled) /* (rows not aligned: the tiles of the same bits) */
        return wide ? PATH_WIDE : PATH_TILED;
    if (s->tiled && s->force_tiled)
        return PATH_TILED;
    if (s->cpu_device && !s->force_gemv)
        return PATH_SIMPLE;
    const int64_t S = a->tokens * a->topk;
    if (s->gemv && (S <= GEMV_MAX_PER_EXPERT * a->experts || !s->tiled))
        return PATH_GEMV;
    const enum gemm_path tiles = wide ? PATH_WIDE : PATH_TILED;
    if (s->tiled && S >= 2 * a->experts)
        return tiles;
    const int64_t simple_groups = (a->inter_dim + (int64_t)s->wg - 1) / (int64_t)s->wg * S;
    return s->tiled && simple_groups < (int64_t)s->compute_units ? tiles : PATH_SIMPLE;
}

moefuse_status mf_ocl_moe_gate_workspace(moefuse_context *ctx, void *state, const mf_moe_args *a,
                                         size_t *bytes)
{
    (void)ctx;
    const enum gemm_path path = choose_path(state, a, true);
    *bytes = path == PATH_TILED || path == PATH_WIDE
                 ? mf_ocl_moe_route_bytes(a, a->tokens * a->topk)
                 : 0;
    return MOEFUSE_OK;
}

moefuse_status mf_ocl_moe_final_workspace(moefuse_context *ctx, void *state,
                                          const mf_moe_args *a, size_t *bytes)
{
    (void)ctx;
    const enum gemm_path path = choose_path(state, a, false);
    *bytes = path == PATH_TILED || path == PATH_WIDE
                 ? final_scratch(state, a, path == PATH_WIDE).bytes
                 : 0;
    return MOEFUSE_OK;
}

moefuse_status mf_ocl_moe_gate(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    ocl_state *s = state;
    const enum gemm_path path = choose_path(s, a, true);
    if (path == PATH_TILED || path == PATH_WIDE)
        return gate_tiled(ctx, s, a, path == PATH_WIDE ? &WIDE : &TILES);
    const bool gemv = path == PATH_GEMV;
    mf_kargs k = mf_kargs_begin(s->kernels[gemv ? MF_K_MOE_GATE_GEMV : MF_K_MOE_GATE]);
    gate_operand_args(&k, a);
    routing_args(&k, a, false);
    gate_fn_args(&k, a);
    mf_karg_operand(&k, &a->h, 2, true);
    const size_t slots = (size_t)(a->tokens * a->topk);
    if (gemv) {
        const size_t global[2] = {(size_t)((a->inter_dim + GV_TEAMS - 1) / GV_TEAMS) * GV_WG,
                                  slots};
        const size_t local[2] = {GV_WG, 1};
        return mf_ocl_launch(ctx, s, &k, "moe_gate", 2, global, local);
    }
    mf_karg_local(&k, chunk(s) * sizeof(cl_float));
    mf_karg_long(&k, (int64_t)chunk(s));
    const size_t global[2] = {mf_round_up((size_t)a->inter_dim, s->wg), slots};
    const size_t local[2] = {s->wg, 1};
    return mf_ocl_launch(ctx, s, &k, "moe_gate", 2, global, local);
}

moefuse_status mf_ocl_moe_final(moefuse_context *ctx, void *state, const mf_moe_args *a)
{
    ocl_state *s = state;
    const enum gemm_path path = choose_path(s, a, false);
    if (path == PATH_TILED || path == PATH_WIDE)
        return final_tiled(ctx, s, a, path == PATH_WIDE ? &WIDE : &TILES);
    const bool gemv = path == PATH_GEMV;
    mf_kargs k = mf_kargs_begin(s->kernels[gemv ? MF_K_MOE_FINAL_GEMV : MF_K_MOE_FINAL]);
    final_operand_args(&k, a);
    routing_args(&k, a, true);
    mf_karg_int(&k, a->reduce);
    mf_karg_operand(&k, &a->out, 1, false);
    mf_karg_long(&k, a->reduce ? 0 : a->out.stride[1]);
    mf_karg_int(&k, (int32_t)a->out.dtype);
    const size_t rows = (size_t)(a->reduce ? a->tokens : a->tokens * a->topk);
    if (gemv) {
        const size_t global[2] = {(size_t)((a->model_dim + GV_TEAMS - 1) / GV_TEAMS) * GV_WG,
                                  rows};
        const size_t local[2] = {GV_WG, 1};
        return mf_ocl_launch(ctx, s, &k, "moe_final", 2, global, local);
    }
    mf_karg_local(&k, chunk(s) * sizeof(cl_float));
    mf_karg_long(&k, (int64_t)chunk(s));
    const size_t global[2] = {mf_round_up((size_t)a->model_dim, s->wg), rows};
    const size_t local[2] = {s->wg, 1};
    return mf_ocl_launch(ctx, s, &k, "moe_final", 2, global, local);
}
