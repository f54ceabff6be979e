/*
 * The plan of an FP8 MoE call of the CUDA backend (moe_fp8.cu runs it): which kernel, which
 * tile height, and where each buffer lies in the call's one scratch request, from the shapes,
 * the options and the device alone, so that a layer's gate and final and the workspace
 * queries agree.
 */
#include "cuda/moe_fp8.h"
#include "cuda/moe_fp8_decode.h"
#include "cuda/moe_fp8_plan.h"
#include "cuda/moe_fp8_ws.h"

#include <string.h>

/*
 * The FP8 GEMM a call runs: what MOEFUSE_CUDA_FP8 forces, else by device. The one place to
 * choose: the Hopper kernel, once written, goes here (sm_90a built and a 9.0 device), and
 * both steps of a layer ask it the same way, so a layer's gate and final agree.
 */
static int fp8_gemm_for(const cuda_state *s)
{
    if (s->fp8_gemm != FP8_GEMM_PORTABLE && moe_fp8_ws_usable(s))
        return FP8_GEMM_WGMMA;
    return FP8_GEMM_PORTABLE;
}

static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/* fp8_ws_a_copied: the weight rows from which a routed GEMM's A copy pays */
#define WS_A_COPY_MIN_ROWS 16384

/*
 * Whether a call runs the decode kernel (moe_fp8_decode.cu): few rows per expert, where a GEMM
 * is a read of the weights. From the shapes and the device alone, so a layer's gate and final
 * and its workspace query agree; MOEFUSE_CUDA_FP8=decode takes it wherever it can run.
 */
static int dec_for(const cuda_state *s, const mf_moe_args *a)
{
    if (s->fp8_gemm == FP8_GEMM_PORTABLE || s->fp8_gemm == FP8_GEMM_WGMMA ||
        !moe_fp8_dec_usable(s))
        return 0;
    /* its tensor copies take 128 consecutive w1 rows as one half: the interleaved order's
     * gate and up rows alternate (the other kernels take it, from the options alone) */
    if (a->opt.order == MOEFUSE_GATE_INTERLEAVED)
        return 0;
    const int forced = s->fp8_gemm == FP8_GEMM_DECODE;
    /* measured (H200, graph replay of the layer, docs/PERFORMANCE.md "which kernel for few
     * rows"): the large-tile kernel streams the weights as fast from 4 slots per expert on
     * (DeepSeek-V3 M = 128: 2.74 against 2.80 ms; Qwen3-30B-A3B M = 64: 0.241 against 0.258),
     * and far faster from 8 (DeepSeek-V3 M = 512: 2.87 against 4.77 ms); the decode kernel
     * leads up to 3 (DeepSeek-V3 M = 80: 2.56 against 2.62 ms), and up to 8 where the experts
     * are Mixtral's (Mixtral M = 32: 0.417 against 0.427 ms; at 12 it is behind). Masked: it
     * led DeepSeek-V3's experts at 1 to 8 valid rows and was behind from 16; the valid counts
     * are device data, so only Tmax, the rows an expert can have, decides. */
    if (a->masked)
        return forced || a->tokens <= DEC_MASKED_TMAX;
    const int64_t S = a->tokens * a->topk;
    if (S <= DEC_DIRECT_S)
        return S > 0;
    if (a->experts > DEC_MAX_E)
        return 0; /* the route kernel counts the experts in shared memory */
    const int64_t busy = a->experts < S ? a->experts : S, per_expert = (S + busy - 1) / busy;
    const int64_t expert_weights = a->model_dim * a->inter_dim; /* e4m3 bytes of its final */
    return forced || per_expert <= DEC_FEW_SLOTS ||
           (per_expert <= DEC_LARGE_SLOTS && expert_weights >= DEC_LARGE_EXPERT);
}

/* Reserve `n` (= a * b * c bytes) at *at; false on overflow. */
static bool reserve(size_t *at, size_t *off, size_t a, size_t b, size_t c)
{
    size_t n;
    if (__builtin_mul_overflow(a, b, &n) || __builtin_mul_overflow(n, c, &n))
        return false;
    *off = align256(*at);
    return !__builtin_add_overflow(*off, n, at);
}

/*
 * Whether a routed GEMM on the Hopper kernel copies A's rows into list order once (S x depth
 * bytes) to load them by TMA rather than gather them by cp.async. Measured (H200,
 * docs/PERFORMANCE.md, stop 49): TMA saves the kernel 1-4%, and the copy costs about 1/(2N) of
 * the GEMM, N its weight rows an expert; the layer gained where N was 28672 (Mixtral's gate)
 * and gained nothing or lost up to 4% at 1536 to 7168. From the shapes alone, so that the
 * workspace query agrees.
 */
int fp8_ws_a_copied(const cuda_state *s, int gate, const mf_moe_args *a)
{
    if (s->fp8_a != FP8_A_AUTO)
        return s->fp8_a == FP8_A_TMA;
    const int64_t weight_rows = gate ? 2 * a->inter_dim : a->model_dim;
    return weight_rows >= WS_A_COPY_MIN_ROWS;
}

/* Tile height: from the rows per touched expert (routed) or Tmax (masked). */
static int pick_bm(int gate, int64_t per_expert)
{
    if (per_expert <= 8)
        return 8; /* decode: the weights stream through, 8 rows each */
    if (gate || per_expert <= 32)
        return 32;
    return 64;
}

/* Rows of the A operand's scales: x's tokens (routed gate), slots (routed final), Tmax. */
int64_t fp8_a_rows(const mf_moe_args *a, const fp8_plan *pl)
{
    return pl->gate && !a->masked ? a->tokens : pl->rows;
}

moefuse_status fp8_plan_call(moefuse_context *ctx, cuda_state *s, const char *op,
                               const mf_moe_args *a, int gate, fp8_plan *pl)
{
    memset(pl, 0, sizeof *pl);
    pl->wgmma = fp8_gemm_for(s) == FP8_GEMM_WGMMA;
    const int64_t E = a->experts, K = a->model_dim, M = a->tokens;
    pl->gate = gate;
    pl->reduce = !gate && a->reduce;
    pl->S = a->masked ? 0 : M * a->topk;
    pl->rows = a->masked ? a->tokens : pl->S;
    pl->blocks = a->masked ? E : 1;
    pl->quant_x = gate && a->x.dtype != MOEFUSE_F8_E4M3;
    if (a->masked) {
        pl->bm = pick_bm(gate, M);
    } else {
        const int64_t busy = E < pl->S ? E : pl->S;
        pl->bm = pick_bm(gate, busy > 0 ? (pl->S + busy - 1) / busy : 1);
    }
    if (!a->masked && pl->S == 0)
        return MOEFUSE_OK; /* nothing to multiply; no scratch */
    /* tiles of 8 rows or more: the route's bound for either kernel */
    pl->tiles_bound = pl->S / 8 + (E < pl->S ? E : pl->S);
    size_t at = 0;
    bool ok = true;
    pl->dec = dec_for(s, a);
    if (pl->dec) {
        /* first, at the same offsets in the gate's and the final's scratch: a layer's final
         * finds the gate's route and zeroed counters there (mf_moe_args.layer) */
        const int64_t depth = gate ? K : a->inter_dim, nblk = (gate ? a->inter_dim : K) / FP8_BLOCK;
        const int64_t busy = a->masked ? E : (E < pl->S ? E : pl->S);
        pl->dec_mode = a->masked ? DEC_MASKED : pl->S <= DEC_DIRECT_S ? DEC_DIRECT : DEC_ROUTED;
        pl->dec_tiles_bound = a->masked ? E * ((M + DEC_NS - 1) / DEC_NS)
                              : pl->dec_mode == DEC_DIRECT ? busy
                                                           : pl->S / DEC_NS + busy;
        pl->dec_split = moe_fp8_dec_split(s, gate, busy, nblk, depth / FP8_BLOCK);
        pl->dec_clusters =
            moe_fp8_dec_clusters(s, gate, pl->dec_tiles_bound * nblk, pl->dec_split);
        if (!a->masked)
            ok = ok && reserve(&at, &pl->off_dec_arrivals, (size_t)M, (size_t)(K / FP8_BLOCK), 4);
        if (pl->dec_mode == DEC_ROUTED) {
            ok = ok && reserve(&at, &pl->off_dec_ntiles, 1, 4, 1);
            ok = ok && reserve(&at, &pl->off_dec_tiles, (size_t)pl->dec_tiles_bound,
                               sizeof(DecTile), 1);
            ok = ok && reserve(&at, &pl->off_dec_list, (size_t)pl->S, 8, 1);
        }
        ok = ok && reserve(&at, &pl->off_dec_part,
                           moe_fp8_dec_part_bytes(gate, pl->dec_clusters, pl->dec_split), 1, 1);
    }
    if (!a->masked) {
        const size_t S = (size_t)pl->S;
        ok = ok && reserve(&at, &pl->off_count, (size_t)E, 8, 1);
        ok = ok && reserve(&at, &pl->off_fill, (size_t)E, 8, 1);
        ok = ok && reserve(&at, &pl->off_offs, (size_t)E + 1, 8, 1);
        ok = ok && reserve(&at, &pl->off_tiles, (size_t)E + 1, 8, 1);
        ok = ok && reserve(&at, &pl->off_tile_expert, (size_t)pl->tiles_bound, 4, 1);
        ok = ok && reserve(&at, &pl->off_expert_of, S, 4, 1);
        ok = ok && reserve(&at, &pl->off_list, S, 8, 1);
        ok = ok && reserve(&at, &pl->off_tok_valid, (size_t)M, 4, 1);
    }
    if (pl->quant_x) {
        /* x's codes [blocks, T, K] and row-major f32 scales [blocks, T, K / 128] */
        const int64_t T = M, groups = K / FP8_BLOCK; /* T: M routed, Tmax masked */
        mf_rows_args *q = &pl->q;
        q->x = mf_tensor_lift3(&a->x);
        if (a->masked)
            q->counts = a->counts; /* the valid rows only; routed: absent (data NULL) */
        q->experts = pl->blocks;
        q->rows = T;
        q->hidden = K;
        q->group = FP8_BLOCK;
        q->groups = groups;
        q->rows_padded = (T + 3) / 4 * 4;
        q->activate = false;
        q->quant = a->act;
        q->quant.group_size = FP8_BLOCK;
        q->quant.ue8m0 = a->act.ue8m0 || a->act.scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
        q->quant.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
        q->zero_tail = false;
        const int64_t qshape[3] = {pl->blocks, T, K}, sshape[3] = {pl->blocks, T, groups};
        q->out = moefuse_tensor_dense(NULL, MOEFUSE_F8_E4M3, 3, qshape);
        q->scales = moefuse_tensor_dense(NULL, MOEFUSE_F32, 3, sshape);
        pl->qscratch = mf_cuda_quant_scratch_bytes(q);
        ok = ok && reserve(&at, &pl->off_qscratch, pl->qscratch, 1, 1);
        ok = ok && reserve(&at, &pl->off_xq, (size_t)pl->blocks * (size_t)T, (size_t)K, 1);
        ok = ok && reserve(&at, &pl->off_xs, (size_t)pl->blocks * (size_t)T, (size_t)groups, 4);
    }
    if (pl->reduce)
        ok = ok && reserve(&at, &pl->off_y, (size_t)pl->S, (size_t)K, 4);
    if (pl->wgmma) {
        /* the Hopper kernel's tile counter, masked tile table and f32 A scales; kept even when
         * a call's operands send it to the portable kernel, so that the size never depends on
         * pointers */
        const moefuse_tensor *as = gate ? &a->x_scales : &a->h_scales;
        pl->dense_a = !pl->quant_x && !(a->act.scale_layout == MOEFUSE_SCALE_ROW_MAJOR &&
                                        as->dtype == MOEFUSE_F32);
        const int64_t depth = gate ? K : a->inter_dim;
        ok = ok && reserve(&at, &pl->off_ws_ctr, 1, 4, 1);
        if (a->masked) {
            pl->mtiles = E * ((M + F8_BM - 1) / F8_BM);
            ok = ok && reserve(&at, &pl->off_ws_tiles, (size_t)E + 1, 8, 1);
            ok = ok && reserve(&at, &pl->off_ws_start, (size_t)E, 8, 1);
            ok = ok && reserve(&at, &pl->off_ws_end, (size_t)E, 8, 1);
            ok = ok && reserve(&at, &pl->off_ws_tile_expert, (size_t)pl->mtiles + 1, 4, 1);
        }
        /* A's f32 scales: dense rows (the gather), or by TMA a stage's rows consecutive */
        const int64_t sc_rows = fp8_a_rows(a, pl) > pl->rows ? fp8_a_rows(a, pl) : pl->rows;
        /* (and a stage's bulk copy of 132 from the 16-byte boundary at or before its first row
         * reads up to 128 past the last column) */
        if (pl->dense_a || !pl->dec) {
            size_t cols = 0, slack_at;
            ok = ok && !__builtin_mul_overflow((size_t)pl->blocks, (size_t)(depth / FP8_BLOCK),
                                               &cols);
            ok = ok && reserve(&at, &pl->off_ws_sc, cols, (size_t)(sc_rows + 3) / 4 * 4, 4);
            ok = ok && reserve(&at, &slack_at, F8_BM, 4, 1);
        }
        pl->copy_a = !a->masked && !pl->dec && fp8_ws_a_copied(s, gate, a);
        if (pl->copy_a)
            ok = ok && reserve(&at, &pl->off_ws_a, (size_t)pl->S, (size_t)depth, 1);
    }
    if (!ok)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: the scratch overflows size_t", op);
    pl->bytes = at;
    if (gate && a->layer && (pl->dec || !a->masked)) {
        /* the layer's final must not regrow (and so lose) the scratch, and the route, the gate
         * leaves: ask for the most it can take, its reduced form */
        mf_moe_args f = *a;
        f.reduce = !a->masked;
        fp8_plan fp;
        MF_TRY(fp8_plan_call(ctx, s, op, &f, 0, &fp));
        pl->bytes = pl->bytes > fp.bytes ? pl->bytes : fp.bytes;
    }
    return MOEFUSE_OK;
}
