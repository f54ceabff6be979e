/*
 * topk_route for few rows (E <= 512, k <= 32): a block per row, thread i holding expert i, so
 * the row's latency is a few short chains instead of one warp's walk over every expert
 * (router_warp.cu, the kernel for many rows). The same bits (router_keys.cuh):
 *  - each thread scores its expert once; the softmax's maximum is a block reduction, its
 *    index-order sum runs on thread 0;
 *  - a group's top-2 comes from warp reductions (groups of 32 or more; a group of 32 is its
 *    warp, which writes the key itself), a butterfly (fewer, a power of two) or a scan of
 *    shared memory (other sizes), as in the warp kernel; every thread then ranks its group's
 *    key against the others' (a ballot when its warp is one group) and keeps its expert when
 *    fewer than topk_group are larger: one barrier between the keys and the picks;
 *  - each warp picks its best min(k, 32) candidates (warp maxima of the 64-bit keys, stopping
 *    when none are left). When those lists hold at most 64 keys (DeepSeek-V3: 8 warps of 8),
 *    warp 0 takes the k largest by warp maxima, two keys a lane, and goes on to the weights;
 *    otherwise each pick counts the larger keys in every list, which is its place.
 * Nsight Compute, H200, DeepSeek-V3 at M = 1: 6.53 us against 7.10 with a barrier for the
 * warps' top-2, one for the kept mask and one after the ranks (cold caches, one launch).
 */
#include "cuda/cuda_internal.h"
#include "cuda/moe_math.cuh"
#include "cuda/pdl.cuh"
#include "cuda/router_keys.cuh"

#define RB_MAX_WARPS (ROUTE_WARP_MAX_E / 32)

/* What a block shares: the scores, the groups, the warps' picks, the final picks. */
typedef struct RouteBlockSmem {
    __align__(8) float exp_tab[64];               /* mf_exp_f32's table (lanes index it freely) */
    float sv[ROUTE_WARP_MAX_E];                   /* the scores s */
    float cv[ROUTE_WARP_MAX_E];                   /* choice scores (group scans) */
    uint64_t gk[MOEFUSE_ROUTER_MAX_GROUPS];       /* the groups' keys */
    uint32_t top2[RB_MAX_WARPS][2];               /* each warp's two best (groups of 32+) */
    uint64_t picks[RB_MAX_WARPS * 32];            /* each warp's best min(k, 32) keys */
    float red_max[RB_MAX_WARPS];                  /* the softmax's reductions */
    unsigned red_num[RB_MAX_WARPS], red_cnt[RB_MAX_WARPS];
    float sum;                                    /* the softmax's index-order sum */
    int32_t ids[32];                              /* the picks */
    float w[32];                                  /* their weights */
} RouteBlockSmem;

__global__ void __launch_bounds__(ROUTE_WARP_MAX_E) mf_k_route_block(const RouteParams p)
{
    __shared__ RouteBlockSmem sm;
    const int i = (int)threadIdx.x, warp = i >> 5, lane = i & 31;
    const int nw = (int)(blockDim.x >> 5);
    const int64_t m = blockIdx.x;
    const int E = (int)p.E, K = (int)p.k, G = (int)p.groups, per = E / G;
    const bool valid = i < E;
    const bool softmax = p.scoring == MOEFUSE_ROUTER_SOFTMAX;

    /* exp's table to shared memory while the kernel before ends; then every load at once:
       the logit and both biases */
    for (int t = i; t < 64; t += (int)blockDim.x) /* a block may have 32 threads */
        sm.exp_tab[t] = mf_exp_table_dev[t];
    mf_pdl_wait(); /* the logits may come from the kernel before */
    mf_pdl_trigger();
    float l = NAN, lb = 0.0f, cb = 0.0f;
    if (valid) {
        l = mfm_load(p.l, p.ldt, m * p.ls0 + i);
        if (p.lb)
            lb = mfm_load(p.lb, p.lbdt, i);
        if (p.cb)
            cb = mfm_load(p.cb, p.cbdt, i);
    }
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(sm.exp_tab);
    __syncthreads();

    /* step 1: the logit plus the logit bias; NaN past E */
    if (valid && p.lb)
        l = __fadd_rn(l, lb);

    /* step 2: the score */
    float s;
    if (p.scoring == MOEFUSE_ROUTER_SIGMOID) {
        rw_sigmoid<1>(&l, &s, tabs);
    } else if (!softmax) {
        s = l; /* TOPK_SOFTMAX: the logit itself */
    } else {
        /* the maximum of the numbers and how many there are (block-uniform afterwards) */
        float mx = mf_is_nan(l) ? -INFINITY : l;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(RW_FULL, mx, off));
        const unsigned num = __reduce_add_sync(RW_FULL, mf_is_nan(l) ? 0u : 1u);
        if (lane == 0) {
            sm.red_max[warp] = mx;
            sm.red_num[warp] = num;
        }
        __syncthreads();
        unsigned total = 0u;
        for (int v = 0; v < nw; v++) {
            mx = fmaxf(mx, sm.red_max[v]);
            total += sm.red_num[v];
        }
        if (total == 0u) {
            s = 0.0f;
        } else if (!mf_is_finite(mx)) { /* the +-Inf maxima share 1 */
            const unsigned cnt = __reduce_add_sync(RW_FULL, l == mx ? 1u : 0u);
            if (lane == 0)
                sm.red_cnt[warp] = cnt;
            __syncthreads();
            unsigned all = 0u;
            for (int v = 0; v < nw; v++)
                all += sm.red_cnt[v];
            s = l == mx ? __fdiv_rn(1.0f, (float)all) : 0.0f;
        } else { /* the exps, divided by their sum in index order */
            s = mf_is_nan(l) ? 0.0f : mf_exp_shared(__fsub_rn(l, mx), tabs);
            if (valid)
                sm.sv[i] = s;
            __syncthreads();
            if (i == 0) {
                float sum = 0.0f;
#pragma unroll 1
                for (int e = 0; e < E; e++)
                    sum = __fadd_rn(sum, sm.sv[e]);
                sm.sum = sum;
            }
            __syncthreads();
            s = mf_is_nan(l) ? 0.0f : __fdiv_rn(s, sm.sum);
        }
    }
    if (valid)
        sm.sv[i] = s; /* read by the weights of the picks */

    /* step 3: the choice score; NaN marks an unranked expert */
    float c = valid ? s : NAN;
    if (valid && p.cb)
        c = __fadd_rn(s, cb);
    c = mf_is_nan(l) ? NAN : c;

    /* step 4: the kept groups */
    bool kept = true;
    if (G > 1) {
        const uint32_t o = mf_is_nan(c) ? 0u : rw_ordered(c);
        if (per == 32) { /* the warp is the group: its two best, its key */
            const uint32_t m1 = __reduce_max_sync(RW_FULL, o);
            const unsigned at_max = __ballot_sync(RW_FULL, o == m1);
            const uint32_t m2 =
                __popc(at_max) > 1 ? m1 : __reduce_max_sync(RW_FULL, o == m1 ? 0u : o);
            if (lane == 0)
                sm.gk[warp] = rw_group_key(p, m1, m2, warp);
        } else if (per % 32 == 0) { /* a warp's two best, then a group's over its warps */
            const uint32_t m1 = __reduce_max_sync(RW_FULL, o);
            const unsigned at_max = __ballot_sync(RW_FULL, o == m1);
            const uint32_t m2 =
                __popc(at_max) > 1 ? m1 : __reduce_max_sync(RW_FULL, o == m1 ? 0u : o);
            if (lane == 0) {
                sm.top2[warp][0] = m1;
                sm.top2[warp][1] = m2;
            }
            __syncthreads();
            if (i < G) {
                const int q = per / 32;
                uint32_t a1 = 0u, a2 = 0u;
                for (int v = i * q; v < (i + 1) * q; v++)
                    rw_top2_merge(&a1, &a2, sm.top2[v][0], sm.top2[v][1]);
                sm.gk[i] = rw_group_key(p, a1, a2, i);
            }
        } else if (32 % per == 0) { /* a butterfly over each group's lanes */
            uint32_t t1 = o, t2 = 0u;
            for (int off = 1; off < per; off <<= 1) {
                const uint32_t o1 = __shfl_xor_sync(RW_FULL, t1, off);
                const uint32_t o2 = __shfl_xor_sync(RW_FULL, t2, off);
                rw_top2_merge(&t1, &t2, o1, o2);
            }
            if ((i & (per - 1)) == 0 && i / per < G)
                sm.gk[i / per] = rw_group_key(p, t1, t2, i / per);
        } else { /* other sizes: group g's thread scans its choice scores */
            if (valid)
                sm.cv[i] = c;
            __syncthreads();
            if (i < G)
                sm.gk[i] = rw_group_scan(p, sm.cv, i, per);
        }
        __syncthreads();
        /* each thread's group is kept when fewer than topk_group keys are larger (keys are
           unique): a ballot when the warp is in one group, else a scan of the G keys */
        int larger = 0;
        if (per % 32 == 0) {
            const uint64_t mine = sm.gk[i / per];
            for (int h = lane; h - lane < G; h += 32)
                larger += __popc(__ballot_sync(RW_FULL, h < G && sm.gk[h] > mine));
        } else if (valid) {
            const uint64_t mine = sm.gk[i / per];
#pragma unroll 8
            for (int h = 0; h < G; h++)
                larger += sm.gk[h] > mine;
        }
        kept = valid && larger < (int)p.kept;
    }
    uint64_t key = rw_key(valid && kept, mf_is_nan(c), c, i);

    /* step 5: each warp's best min(k, 32) in order (warp maxima; 0 fills the rest), then the
       k largest of all those lists: warp 0 takes them by maxima when they fit two a lane,
       else each pick counts the larger keys in every list, which is its place */
    const int local = K < 32 ? K : 32;
    const uint64_t mine = key;
    int n = 0, my_rank = -1;
#pragma unroll 1
    for (; n < local; n++) {
        const uint64_t best = rw_warp_max(key);
        if (best == 0ull)
            break; /* the warp has no candidates left */
        if (lane == 0)
            sm.picks[warp * local + n] = best;
        my_rank = key == best ? n : my_rank;
        key = key == best ? 0ull : key;
    }
    if (lane >= n && lane < local)
        sm.picks[warp * local + lane] = 0ull;
    const int lists = nw * local;
    if (lists > 64 && i < K)
        sm.ids[i] = -1; /* slots no candidate reaches */
    __syncthreads();
    if (lists <= 64) {
        if (warp != 0)
            return;
        uint64_t a = lane < lists ? sm.picks[lane] : 0ull;
        uint64_t b = lane + 32 < lists ? sm.picks[lane + 32] : 0ull;
        int32_t id = -1;
#pragma unroll 1
        for (int j = 0; j < K; j++) {
            const uint64_t best = rw_warp_max(a > b ? a : b);
            if (best == 0ull)
                break; /* no candidates left: the rest stay -1 */
            id = lane == j ? rw_index(best) : id;
            a = a == best ? 0ull : a;
            b = b == best ? 0ull : b;
        }
        if (lane < K)
            sm.ids[lane] = id;
        __syncwarp();
    } else {
        if (my_rank >= 0) {
            int larger = 0; /* the keys are unique: those above mine in every warp's list */
#pragma unroll 1
            for (int v = 0; v < lists; v += 8) {
#pragma unroll
                for (int r = 0; r < 8; r++)
                    larger += v + r < lists && sm.picks[v + r] > mine;
            }
            if (larger < K)
                sm.ids[larger] = i;
        }
        __syncthreads();
        if (warp != 0)
            return;
    }

    /* steps 6-8 (router_keys.cuh) */
    rw_finish(p, m, lane, sm.ids, sm.w, sm.sv, K);
}

bool mf_route_block_takes(const RouteParams *p)
{
    return p->E <= ROUTE_WARP_MAX_E && p->k <= 32 && p->M <= 0x7FFFFFFF;
}

void mf_route_block_launch(const RouteParams *p, cudaStream_t stream, int pdl)
{
    const unsigned threads = (unsigned)((p->E + 31) / 32) * 32;
    mf_launch_pdl(mf_k_route_block, dim3((unsigned)p->M), threads, 0, stream, pdl, *p);
}
