/*
 * topk_route for many rows (E <= 512, every model's router; router_block.cu takes few rows): a
 * warp per row, lane l holding experts l, l + 32, ... (NV of them, a power of two). The CPU's
 * bits (docs/NUMERICS.md, "Router (topk_route)"; the shared pieces in router_keys.cuh):
 *  - each expert's rank is one 64-bit key (tier, ordered choice score, complemented index),
 *    so a pick is a warp max of two 32-bit reductions and ties go to the lower index;
 *  - a group's two best scores come from warp reductions (groups of 32 or more experts) or a
 *    butterfly over its lanes (fewer, a power of two); other group sizes scan shared memory;
 *    lane g then holds group g's key and ranks it against the others' (up to 32 groups);
 *  - sigmoid scores are unrolled over a lane's experts; the softmax's loops take one expert
 *    per lane at a time; every loop runs on 32-bit indices (E <= 512).
 * The softmax's index-order sum runs on lane 0.
 */
#include "cuda/cuda_internal.h"
#include "cuda/pdl.cuh"
#include "cuda/router_keys.cuh"

#define RW_WARPS 4 /* rows per block */

/* 8-byte words of shared memory a warp uses: the group keys, then l, s, c and the ids. */
static __host__ __device__ constexpr size_t rw_warp_smem_words(int nv)
{
    return MOEFUSE_ROUTER_MAX_GROUPS + (size_t)4 * nv * 32 / 2;
}

template <int NV>
__global__ void __launch_bounds__(RW_WARPS * 32) mf_k_route_warp(const RouteParams p)
{
    extern __shared__ uint64_t rw_smem[]; /* each warp's share: rw_warp_smem_words */
    __shared__ __align__(8) float exp_tab[64]; /* mf_exp_f32's table (lanes index it freely) */
    if (threadIdx.x < 64)
        exp_tab[threadIdx.x] = mf_exp_table_dev[threadIdx.x];
    mf_pdl_wait(); /* the logits may come from the kernel before */
    mf_pdl_trigger();
    __syncthreads();
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(exp_tab);
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31);
    const int64_t m = (int64_t)blockIdx.x * RW_WARPS + warp;
    if (m >= p.M)
        return; /* the whole warp: no block-wide barrier follows */
    const int E = (int)p.E, K = (int)p.k, G = (int)p.groups, per = E / G;
    const int Ep = NV * 32;
    uint64_t *gk = rw_smem + (size_t)warp * rw_warp_smem_words(NV); /* the groups' keys */
    float *lv = (float *)(gk + MOEFUSE_ROUTER_MAX_GROUPS); /* the logits l */
    float *sv = lv + Ep;                                   /* the scores s */
    float *cv = sv + Ep; /* the choice scores c (group scans), then the weights */
    int32_t *ids = (int32_t *)(cv + Ep);
    const bool softmax = p.scoring == MOEFUSE_ROUTER_SOFTMAX;

    /* step 1: the logits (plus the logit bias), their loads issued together */
    float l[NV];
    rw_load<NV>(p.l, p.ldt, m * p.ls0, lane, E, l);
    if (p.lb) {
        float b[NV];
        rw_load<NV>(p.lb, p.lbdt, 0, lane, E, b);
#pragma unroll
        for (int t = 0; t < NV; t++)
            l[t] = __fadd_rn(l[t], b[t]);
    }
    float mx = -INFINITY;
#pragma unroll
    for (int t = 0; t < NV; t++) {
        if (t * 32 + lane < E)
            lv[t * 32 + lane] = l[t];
        mx = mf_is_nan(l[t]) ? mx : fmaxf(mx, l[t]);
    }
    __syncwarp();

    /* step 2: the scores (sigmoid unrolled; the softmax's loops one expert per lane at a time) */
    int mode = 2; /* softmax: 0 no number, 1 the +-Inf maxima share 1, 2 exps */
    float share = 0.0f;
    if (softmax) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(RW_FULL, mx, off));
        unsigned cnt = 0u, num = 0u;
#pragma unroll 1
        for (int i = lane; i < E; i += 32) {
            cnt += lv[i] == mx;
            num += !mf_is_nan(lv[i]);
        }
        num = __reduce_add_sync(RW_FULL, num);
        if (num == 0u) {
            mode = 0;
        } else if (!mf_is_finite(mx)) {
            share = __fdiv_rn(1.0f, (float)__reduce_add_sync(RW_FULL, cnt));
            mode = 1;
        }
    }
    if (p.scoring == MOEFUSE_ROUTER_SIGMOID) {
        float sg[NV];
        rw_sigmoid<NV>(l, sg, tabs);
#pragma unroll
        for (int t = 0; t < NV; t++)
            if (t * 32 + lane < E)
                sv[t * 32 + lane] = sg[t];
    } else if (softmax && mode == 2) { /* the exps, divided by their sum below */
#pragma unroll 1
        for (int i = lane; i < E; i += 32) {
            const float x = lv[i];
            sv[i] = mf_is_nan(x) ? 0.0f : mf_exp_shared(__fsub_rn(x, mx), tabs);
        }
    } else {
#pragma unroll 1
        for (int i = lane; i < E; i += 32) {
            const float x = lv[i]; /* TOPK_SOFTMAX: the logit itself */
            sv[i] = !softmax ? x : mode == 1 && x == mx ? share : 0.0f;
        }
    }
    __syncwarp();
    if (softmax && mode == 2) { /* the sum in index order, on lane 0 */
        float sum = 0.0f;
        if (lane == 0)
#pragma unroll 1
            for (int i = 0; i < E; i++)
                sum = __fadd_rn(sum, sv[i]);
        __syncwarp(); /* lane 0's reads before the divisions below overwrite sv */
        sum = __shfl_sync(RW_FULL, sum, 0);
#pragma unroll 1
        for (int i = lane; i < E; i += 32)
            sv[i] = mf_is_nan(lv[i]) ? 0.0f : __fdiv_rn(sv[i], sum);
        __syncwarp();
    }

    /* step 3: choice scores; NaN marks an unranked expert */
    float c[NV];
    if (p.cb)
        rw_load<NV>(p.cb, p.cbdt, 0, lane, E, c);
#pragma unroll
    for (int t = 0; t < NV; t++) {
        const int i = t * 32 + lane;
        const float s = i < E ? sv[i] : NAN;
        c[t] = p.cb ? __fadd_rn(s, c[t]) : s;
        c[t] = mf_is_nan(l[t]) ? NAN : c[t];
    }

    /* step 4: the kept groups; lane g < G ends with group g's key (G <= 32) */
    uint64_t keep = ~0ull;
    if (G > 1) {
        uint64_t gkey = 0ull;
        uint32_t t1[NV], t2[NV]; /* a lane's ordered choice scores (0: unranked) */
#pragma unroll
        for (int t = 0; t < NV; t++) {
            t1[t] = mf_is_nan(c[t]) ? 0u : rw_ordered(c[t]);
            t2[t] = 0u;
        }
        if (per % 32 == 0) {
            /* a register's two best by two warp reductions; a group's over its q registers
               (counted down, not divided: a division by a runtime value is a long loop) */
            /* (G <= E / 32 <= 16: lane g gathers group g's registers, then makes its key) */
            const int q = per / 32;
            uint32_t a1 = 0u, a2 = 0u;
            int left = q, g = 0;
#pragma unroll
            for (int t = 0; t < NV; t++)
                if (t * 32 < E) {
                    const uint32_t m1 = __reduce_max_sync(RW_FULL, t1[t]);
                    const unsigned at_max = __ballot_sync(RW_FULL, t1[t] == m1);
                    const uint32_t m2 =
                        __popc(at_max) > 1
                            ? m1
                            : __reduce_max_sync(RW_FULL, t1[t] == m1 ? 0u : t1[t]);
                    if (lane == g)
                        rw_top2_merge(&a1, &a2, m1, m2);
                    if (--left == 0) { /* the group's last register */
                        left = q;
                        g++;
                    }
                }
            if (lane < G)
                gkey = rw_group_key(p, a1, a2, lane);
        } else if (32 % per == 0) {
            /* groups within a register: a butterfly over each group's lanes */
#pragma unroll 1
            for (int off = 1; off < per; off <<= 1)
#pragma unroll
                for (int t = 0; t < NV; t++) {
                    const uint32_t o1 = __shfl_xor_sync(RW_FULL, t1[t], off);
                    const uint32_t o2 = __shfl_xor_sync(RW_FULL, t2[t], off);
                    rw_top2_merge(&t1[t], &t2[t], o1, o2);
                }
            const int lg = 31 - __clz(per); /* per divides 32: a power of two */
#pragma unroll
            for (int t = 0; t < NV; t++) {
                const int g = (t * 32 + lane) >> lg;
                if ((lane & (per - 1)) == 0 && g < G)
                    gk[g] = rw_group_key(p, t1[t], t2[t], g);
            }
        } else {
#pragma unroll
            for (int t = 0; t < NV; t++)
                if (t * 32 + lane < E)
                    cv[t * 32 + lane] = c[t];
            __syncwarp();
#pragma unroll 1
            for (int g = lane; g < G; g += 32)
                gk[g] = rw_group_scan(p, cv, g, per);
        }
        __syncwarp();
        if (G <= 32) {
            /* group g is kept when fewer than topk_group keys are larger (keys are unique) */
            if (per % 32 != 0)
                gkey = lane < G ? gk[lane] : 0ull;
            int larger = 0;
#pragma unroll 4
            for (int g = 0; g < G; g++)
                larger += __shfl_sync(RW_FULL, gkey, g) > gkey;
            keep = __ballot_sync(RW_FULL, lane < G && larger < (int)p.kept);
        } else {
            uint64_t g0 = lane < G ? gk[lane] : 0ull, g1 = lane + 32 < G ? gk[lane + 32] : 0ull;
            keep = 0ull;
#pragma unroll 1
            for (int t = 0; t < (int)p.kept; t++) {
                const uint64_t best = rw_warp_max(g0 > g1 ? g0 : g1);
                const int g = rw_index(best);
                keep |= 1ull << g;
                g0 = g == lane ? 0ull : g0;
                g1 = g == lane + 32 ? 0ull : g1;
            }
        }
    }
    /* the group of expert i: a shift where the group size is a power of two */
    const bool pow2 = (per & (per - 1)) == 0;
    const int lg = 31 - __clz(per);
    uint64_t key[NV];
#pragma unroll
    for (int t = 0; t < NV; t++) {
        const int i = t * 32 + lane;
        const int g = G == 1 ? 0 : pow2 ? i >> lg : i / per;
        const bool cand = i < E && ((keep >> g) & 1ull);
        key[t] = rw_key(cand, mf_is_nan(c[t]), c[t], i);
    }

    /* step 5: the picks. Each lane sorts its keys once (largest first); a pick is then the
       warp max of the lanes' first keys, and its lane moves on to its next (keys are unique:
       the index is in them) */
#pragma unroll
    for (int size = 2; size <= NV; size <<= 1)
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1)
#pragma unroll
            for (int t = 0; t < NV; t++) {
                const int u = t ^ stride;
                if (u > t) {
                    const bool down = (t & size) == 0; /* this pair's order: larger first */
                    const uint64_t a = key[t], b = key[u];
                    const bool swap = down ? b > a : a > b;
                    key[t] = swap ? b : a;
                    key[u] = swap ? a : b;
                }
            }
#pragma unroll 1
    for (int j = 0; j < K; j++) {
        const uint64_t best = rw_warp_max(key[0]);
        const bool mine = key[0] == best;
#pragma unroll
        for (int t = 0; t + 1 < NV; t++)
            key[t] = mine ? key[t + 1] : key[t];
        key[NV - 1] = mine ? 0ull : key[NV - 1];
        if (lane == 0)
            ids[j] = best ? (int32_t)rw_index(best) : -1;
    }
    __syncwarp();

    /* steps 6-8 (router_keys.cuh), w over the choice scores, which are used up */
    rw_finish(p, m, lane, ids, cv, sv, K);
}

template <int NV>
static void rw_launch(const RouteParams *p, unsigned grid, cudaStream_t stream, int pdl)
{
    const size_t smem = rw_warp_smem_words(NV) * 8 * RW_WARPS; /* 35 KB at most */
    mf_launch_pdl(mf_k_route_warp<NV>, dim3(grid), RW_WARPS * 32, smem, stream, pdl, *p);
}

void mf_route_warp_launch(const RouteParams *p, cudaStream_t stream, int pdl)
{
    const unsigned grid = (unsigned)((p->M + RW_WARPS - 1) / RW_WARPS);
    const int nv = (int)((p->E + 31) / 32);
    if (nv <= 1)
        rw_launch<1>(p, grid, stream, pdl);
    else if (nv <= 2)
        rw_launch<2>(p, grid, stream, pdl);
    else if (nv <= 4)
        rw_launch<4>(p, grid, stream, pdl);
    else if (nv <= 8)
        rw_launch<8>(p, grid, stream, pdl);
    else /* a power of two: the keys' sorting network */
        rw_launch<16>(p, grid, stream, pdl);
}
