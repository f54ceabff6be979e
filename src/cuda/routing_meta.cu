/*
 * routing_metadata of the CUDA backend: integers only, so the CPU's bytes by construction
 * (docs/NUMERICS.md, "Routing metadata"); and the shared experts' slots the core asks for
 * (mf_k_moe_shared_routing). The metadata's three paths:
 *  - on sm_90, for E up to 1024 and up to 32768 slots, one launch of a cluster of 8 or 16
 *    blocks (routing_meta_cluster.cu): the blocks share their counts through distributed
 *    shared memory, so the call costs about one launch (a launch costs the host about 3.5 us
 *    on the H200);
 *  - for E up to about 3000, two launches over spans of 2048 slots or more: the first counts
 *    each span per expert into scratch; the second (a programmatic dependent launch, which
 *    counts its span warp by warp while the first ends) sums the spans before its own and all
 *    of them, scans the padded counts into offsets, and places its span warp by warp, a slot's
 *    rank among the lanes of the same expert from ballots (meta_peers): the order is ascending in
 *    the slot, as the contract asks, and no atomic decides it. Graph-capturable (the scratch is
 *    the call's, see mf_cuda_scratch).
 *  - the reference, for larger E: a thread per expert scanning every slot in order.
 */
#include "cuda/pdl.cuh"
#include "cuda/routing_meta.cuh"

#include <stdlib.h>
#include <string.h>

/* -------------------------------------------------------- the reference, any E */

__global__ void mf_k_meta_count(const MetaParams p)
{
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= p.rt.E)
        return;
    int64_t n = 0;
    for (int64_t s = 0; s < p.rt.S; s++)
        n += meta_expert(p, s) == e;
    p.counts[e] = (int32_t)n;
}

__global__ void mf_k_meta_place(const MetaParams p)
{
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e > p.rt.E)
        return;
    int64_t start = 0;
    for (int64_t f = 0; f < e; f++)
        start += (p.counts[f] + p.block - 1) / p.block * p.block;
    if (p.offsets)
        p.offsets[e] = (int32_t)start;
    if (e == p.rt.E) {
        if (p.order)
            for (int64_t q = start; q < p.length; q++)
                p.order[q] = -1;
        return;
    }
    const int64_t k = p.rt.topk;
    int64_t n = 0;
    for (int64_t s = 0; s < p.rt.S; s++) {
        if (meta_expert(p, s) != e)
            continue;
        if (p.order)
            p.order[start + n] = (int32_t)s;
        if (p.position)
            p.position[(s / k) * p.ps0 + s % k] = (int32_t)(start + n);
        if (p.mrow)
            p.mrow[(s / k) * p.ws0 + s % k] = (int32_t)n;
        n++;
    }
    if (p.order)
        for (int64_t q = start + n; q < start + (n + p.block - 1) / p.block * p.block; q++)
            p.order[q] = -1;
}

__global__ void mf_k_meta_invalid(const MetaParams p)
{
    const int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= p.rt.S || meta_expert(p, s) >= 0)
        return;
    const int64_t k = p.rt.topk;
    if (p.position)
        p.position[(s / k) * p.ps0 + s % k] = -1;
    if (p.mrow)
        p.mrow[(s / k) * p.ws0 + s % k] = -1;
}

/* --------------------------------------------- two launches over spans, E <= about 3000 */

/* Rows of a block's [rows, E] histogram (one per warp) that fit beside its other arrays
   (offsets, counts, the scan's warp sums); 0: too many experts, the reference's case. */
static int64_t meta_rows(int64_t E)
{
    if (E <= 0)
        return 0;
    const int64_t w = (RM_SMEM_INTS - 2 * E - 1 - (RM_WARPS + 1)) / E;
    return w < 0 ? 0 : (w > RM_WARPS ? RM_WARPS : w);
}


/*
 * The offsets, once each thread holds in `mine` the padded counts of its experts [e0, e1)
 * (consecutive by thread): the block's scan of them; off[e] holds the slots of the blocks
 * before this one on entry and the expert's offset on return (off[E] the total), and each of
 * the `rows` histogram rows' counts becomes that row's first position. The block writes the
 * offsets when `write` (one block of the grid). Ends with a barrier.
 */
static __device__ void meta_offsets(const MetaParams &p, int32_t *hist, int rows,
                                    const int32_t *cnt, int32_t *off, int64_t e0, int64_t e1,
                                    int32_t mine, int32_t *warp_sums, bool write)
{
    const int64_t E = p.rt.E;
    int32_t total;
    int32_t at = meta_block_scan(mine, warp_sums, &total);
    for (int64_t e = e0; e < e1; e++) {
        int32_t next = at + off[e];
        off[e] = at;
        for (int w = 0; w < rows; w++) {
            const int32_t n = hist[w * E + e];
            hist[w * E + e] = next;
            next += n;
        }
        at += meta_padded(p, cnt[e]);
    }
    if (threadIdx.x == 0)
        off[E] = total;
    __syncthreads();
    if (p.offsets && write)
        for (int64_t e = threadIdx.x; e <= E; e += RM_THREADS)
            p.offsets[e] = off[e];
}

/*
 * A warp places its slots [wlo, whi) 32 at a time: a slot's place is the warp's next position
 * of its expert (row[e]) plus its rank among the round's lanes of the same expert, so the order
 * is ascending in the slot and no atomic decides it.
 */
static __device__ void meta_place_walk(const MetaParams &p, int32_t *row, const int32_t *off,
                                       int64_t wlo, int64_t whi, int bits)
{
    const int lane = (int)(threadIdx.x & 31);
    for (int64_t s0 = wlo; s0 < whi; s0 += 32) {
        const int64_t s = s0 + lane;
        const int e = s < whi ? meta_expert32(p, s) : -2;
        const unsigned same = meta_peers(e, bits);
        const int rank = __popc(same & ((1u << lane) - 1u));
        if (e >= 0)
            meta_place(p, s, e, row[e] + rank, off[e]);
        else
            meta_place(p, s, e, -1, 0);
        __syncwarp();
        if (e >= 0 && rank == 0)
            row[e] += __popc(same);
        __syncwarp();
    }
}

/*
 * Counts block b's span [b * span, (b + 1) * span) into rows of a shared [rows, E] histogram,
 * warp w's part [w * part, (w + 1) * part) into row w; rows == 1 gives the span's counts.
 */
static __device__ void meta_count_span(const MetaParams &p, int32_t *hist, int rows,
                                       int64_t span, int64_t lo, int64_t hi)
{
    const int64_t E = p.rt.E, part = span / rows;
    for (int64_t q = threadIdx.x; q < rows * E; q += RM_THREADS)
        hist[q] = 0;
    __syncthreads();
    /* RM_BATCH ids a thread loaded together, their latencies overlapped, then counted */
    for (int64_t s0 = lo + threadIdx.x; s0 < hi; s0 += (int64_t)RM_THREADS * RM_BATCH) {
        int e[RM_BATCH];
#pragma unroll
        for (int r = 0; r < RM_BATCH; r++) {
            const int64_t s = s0 + (int64_t)r * RM_THREADS;
            e[r] = s < hi ? meta_expert32(p, s) : -1;
        }
#pragma unroll
        for (int r = 0; r < RM_BATCH; r++) {
            const int64_t s = s0 + (int64_t)r * RM_THREADS;
            if (e[r] >= 0) /* 32-bit: a 64-bit division is a long loop */
                atomicAdd(&hist[(uint32_t)(s - lo) / (uint32_t)part * E + e[r]], 1);
        }
    }
    __syncthreads();
}

/* The span path's arguments: the call's, the histogram rows a block, the span, the sums. */
typedef struct MetaSpan {
    MetaParams p;
    int rows;
    int64_t span;
    int32_t *sums; /* [blocks, E] scratch */
} MetaSpan;

/* Launch 1: each block's counts per expert into sums[b, E] (the scratch). */
__global__ void __launch_bounds__(RM_THREADS) mf_k_meta_span_count(const MetaSpan q)
{
    extern __shared__ int32_t sm[];
    const MetaParams &p = q.p;
    const int64_t span = q.span;
    int32_t *sums = q.sums;
    const int64_t E = p.rt.E, S = p.rt.S;
    const int64_t lo = (int64_t)blockIdx.x * span, hi = lo + span < S ? lo + span : S;
    mf_pdl_wait(); /* the ids may come from the kernel before (launch 2 relies on this wait) */
    meta_count_span(p, sm, 1, span, lo, hi);
    for (int64_t e = threadIdx.x; e < E; e += RM_THREADS)
        sums[blockIdx.x * E + e] = sm[e];
    mf_pdl_trigger();
}

/*
 * Launch 2 (programmatic: it counts its own span by warps while launch 1 ends; the ids are
 * final by then, since launch 1 lets it launch only after its own wait): the offsets
 * from every block's sums, each warp's first positions, then its slots 32 at a time, a slot's
 * place its row's next position plus its rank among the lanes of the same expert
 * (meta_peers), so the order is ascending in the slot and no atomic decides it.
 */
__global__ void __launch_bounds__(RM_THREADS) mf_k_meta_span_place(const MetaSpan q)
{
    extern __shared__ int32_t sm[];
    const MetaParams &p = q.p;
    const int rows = q.rows;
    const int64_t span = q.span;
    const int32_t *sums = q.sums;
    const int64_t E = p.rt.E, S = p.rt.S;
    int32_t *hist = sm;               /* [rows, E]: counts, then each row's next position */
    int32_t *cnt = hist + rows * E;   /* [E]: each expert's count */
    int32_t *off = cnt + E;           /* [E + 1] */
    int32_t *warp_sums = off + E + 1; /* [RM_WARPS + 1] */
    const int tid = (int)threadIdx.x, warp = tid >> 5;
    const int64_t lo = (int64_t)blockIdx.x * span, hi = lo + span < S ? lo + span : S;
    const int64_t part = span / rows;
    const int bits = meta_peer_bits(E);
    meta_count_span(p, hist, rows, span, lo, hi);
    mf_pdl_wait(); /* launch 1's sums */
    /* thread t takes experts [e0, e1): the slots before this span, and in all */
    const int64_t per = (E + RM_THREADS - 1) / RM_THREADS;
    const int64_t e0 = tid * per < E ? tid * per : E, e1 = e0 + per < E ? e0 + per : E;
    int32_t mine = 0;
    for (int64_t e = e0; e < e1; e++) {
        int32_t before = 0, n = 0;
        /* 16 span sums loaded together: one L2 latency for 16, not 16 in a row */
        for (int64_t b0 = 0; b0 < (int64_t)gridDim.x; b0 += 16) {
            int32_t c[16];
#pragma unroll
            for (int u = 0; u < 16; u++)
                c[u] = b0 + u < (int64_t)gridDim.x ? __ldcg(sums + (b0 + u) * E + e) : 0;
#pragma unroll
            for (int u = 0; u < 16; u++) {
                before += b0 + u < (int64_t)blockIdx.x ? c[u] : 0;
                n += c[u];
            }
        }
        if (blockIdx.x == 0)
            p.counts[e] = n;
        cnt[e] = n;
        off[e] = before; /* for now */
        mine += meta_padded(p, n);
    }
    meta_offsets(p, hist, rows, cnt, off, e0, e1, mine, warp_sums, blockIdx.x == 0);
    const int64_t wlo = lo + warp * part, whi = wlo + part < hi ? wlo + part : hi;
    if (warp < rows && (p.order || p.position || p.mrow))
        meta_place_walk(p, hist + warp * E, off, wlo, whi, bits);
    if (p.order)
        meta_fill_padding(p, cnt, off, blockIdx.x, gridDim.x);
}

/* The span path's shape for these args: rows per block (0: the reference), span, blocks. */
static int64_t meta_plan(const mf_meta_args *a, int64_t *span, int64_t *blocks)
{
    const int64_t E = a->route.experts, S = a->route.tokens * a->route.topk;
    const int64_t rows = meta_rows(E);
    if (rows == 0)
        return 0;
    int64_t b = (S + RM_SPAN - 1) / RM_SPAN;
    b = b < 1 ? 1 : (b > RM_MAX_BLOCKS ? RM_MAX_BLOCKS : b);
    const int64_t unit = 32 * rows; /* whole rounds of every warp's part */
    int64_t sp = ((S + b - 1) / b + unit - 1) / unit * unit;
    sp = sp > 0 ? sp : unit;
    *span = sp;
    *blocks = S > 0 ? (S + sp - 1) / sp : 1;
    return rows;
}

/* The scratch of the span path: each block's sums (none for the cluster path). */
static size_t meta_scratch_bytes(cuda_state *s, const mf_meta_args *a)
{
    int64_t span, blocks;
    if (mf_meta_cluster_fits(s, a) || s->forced_meta == META_REFERENCE ||
        meta_plan(a, &span, &blocks) == 0)
        return 0;
    return (size_t)(blocks * a->route.experts) * sizeof(int32_t);
}

moefuse_status mf_cuda_meta_workspace(moefuse_context *ctx, void *state, const mf_meta_args *a,
                                      size_t *bytes)
{
    (void)ctx;
    *bytes = meta_scratch_bytes((cuda_state *)state, a);
    return MOEFUSE_OK;
}

extern "C" int mf_cuda_meta_from_env(void)
{
    static const char *const names[] = {"cluster16", "cluster8", "spans", "reference"};
    const char *v = getenv("MOEFUSE_CUDA_META");
    if (!v || !*v)
        return META_AUTO;
    for (int c = 0; c < 4; c++)
        if (strcmp(v, names[c]) == 0)
            return META_CLUSTER16 + c;
    return -1;
}

/* ------------------------------------------------ shared experts as ordinary slots */

typedef struct SharedParams {
    MoeRoute rt;        /* the routed slots: topk = k */
    const float *w;     /* topk_weights [M, k] or NULL (a gate) */
    int64_t ws0;
    int64_t n;          /* shared experts, the last n of E */
    float scale;
    const float *sw;    /* shared_weights [M] or NULL */
    int64_t sws0;
    int32_t *ids;       /* [M, k + n] */
    float *ow;          /* [M, k + n] or NULL */
} SharedParams;

/* Thread m writes token m's k + n slots (backend.h, mf_shared_args; the CPU's moe_slots.c). */
__global__ void mf_k_moe_shared_routing(const SharedParams p, int64_t M)
{
    const int64_t m = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (m >= M)
        return;
    const int64_t k = p.rt.topk, slots = k + p.n, shared0 = p.rt.E - p.n;
    for (int64_t j = 0; j < k; j++) {
        const int64_t e = moe_slot_expert(p.rt, m, j);
        p.ids[m * slots + j] = e >= 0 && e < shared0 ? (int32_t)e : -1;
        if (p.ow)
            p.ow[m * slots + j] = p.w[m * p.ws0 + j];
    }
    const float f = p.sw ? mf_mul(p.scale, p.sw[m * p.sws0]) : p.scale; /* x86 NaN bits */
    for (int64_t s = 0; s < p.n; s++) {
        p.ids[m * slots + k + s] = (int32_t)(shared0 + s);
        if (p.ow)
            p.ow[m * slots + k + s] = f;
    }
}

moefuse_status mf_cuda_moe_shared_routing(moefuse_context *ctx, void *state,
                                          const mf_shared_args *a)
{
    cuda_state *s = (cuda_state *)state;
    const mf_moe_args *r = &a->route;
    if (r->tokens == 0)
        return MOEFUSE_OK;
    SharedParams p;
    memset(&p, 0, sizeof p);
    p.rt = mf_route_of(r);
    p.w = r->topk_weights.data ? (const float *)mf_cuda_base(&r->topk_weights) : NULL;
    p.ws0 = r->topk_weights.data ? r->topk_weights.stride[0] : 0;
    p.n = a->n_shared;
    p.scale = a->scale;
    p.sw = a->shared_weights.data ? (const float *)mf_cuda_base(&a->shared_weights) : NULL;
    p.sws0 = a->shared_weights.data ? a->shared_weights.stride[0] : 0;
    p.ids = (int32_t *)mf_cuda_base(&a->ids);
    p.ow = a->weights.data ? (float *)mf_cuda_base(&a->weights) : NULL;
    const unsigned grid = (unsigned)((r->tokens + 127) / 128);
    mf_k_moe_shared_routing<<<grid, 128, 0, s->stream>>>(p, r->tokens);
    return mf_cuda_launched(ctx, "moe_shared_routing", "mf_k_moe_shared_routing");
}

moefuse_status mf_cuda_routing_metadata(moefuse_context *ctx, void *state, const mf_meta_args *a)
{
    cuda_state *s = (cuda_state *)state;
    const mf_moe_args *r = &a->route;
    MetaParams p;
    memset(&p, 0, sizeof p);
    p.rt = mf_route_of(r);
    p.M = r->tokens;
    p.block = a->block;
    p.length = a->length;
    p.counts = (int32_t *)mf_cuda_base(&a->counts);
    p.offsets = a->offsets.data ? (int32_t *)mf_cuda_base(&a->offsets) : NULL;
    p.order = a->order.data ? (int32_t *)mf_cuda_base(&a->order) : NULL;
    p.position = a->position.data ? (int32_t *)mf_cuda_base(&a->position) : NULL;
    p.ps0 = a->position.data ? a->position.stride[0] : 0;
    p.mrow = a->masked_row.data ? (int32_t *)mf_cuda_base(&a->masked_row) : NULL;
    p.ws0 = a->masked_row.data ? a->masked_row.stride[0] : 0;
    int taken = 0;
    MF_TRY(mf_meta_cluster_launch(ctx, s, a, &p, &taken));
    if (taken)
        return MOEFUSE_OK;
    int64_t span, blocks;
    const int64_t rows = s->forced_meta == META_REFERENCE ? 0 : meta_plan(a, &span, &blocks);
    if (rows > 0) {
        void *scratch = NULL;
        MF_TRY(mf_cuda_scratch(ctx, s, meta_scratch_bytes(s, a), "routing_metadata", &scratch));
        MetaSpan q;
        q.p = p;
        q.rows = (int)rows;
        q.span = span;
        q.sums = (int32_t *)scratch;
        const int64_t E = p.rt.E;
        mf_launch_pdl(mf_k_meta_span_count, dim3((unsigned)blocks), RM_THREADS, (size_t)E * 4,
                      s->stream, s->pdl, q);
        MF_TRY(mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_span_count"));
        const size_t smem = (size_t)((rows + 2) * E + 1 + RM_WARPS + 1) * 4;
        mf_launch_pdl(mf_k_meta_span_place, dim3((unsigned)blocks), RM_THREADS, smem, s->stream,
                      s->pdl, q);
        return mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_span_place");
    }
    if (p.rt.E > 0) {
        mf_k_meta_count<<<(unsigned)((p.rt.E + 63) / 64), 64, 0, s->stream>>>(p);
        MF_TRY(mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_count"));
    }
    mf_k_meta_place<<<(unsigned)((p.rt.E + 64) / 64), 64, 0, s->stream>>>(p);
    MF_TRY(mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_place"));
    if ((p.position || p.mrow) && p.rt.S > 0) {
        mf_k_meta_invalid<<<(unsigned)((p.rt.S + 255) / 256), 256, 0, s->stream>>>(p);
        MF_TRY(mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_invalid"));
    }
    return MOEFUSE_OK;
}
