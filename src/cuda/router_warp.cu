/*
 * topk_route for E <= 512, every model's router: a warp per row, lane l holding experts
 * l, l + 32, ... (NV of them, a power of two). The CPU's bits (docs/NUMERICS.md, "Router (topk_route)"):
 *  - each expert's rank is one 64-bit key (tier, ordered choice score, complemented index),
 *    so a pick is a warp max of two 32-bit reductions and ties go to the lower index;
 *  - a group's two best scores come from warp reductions (groups of 32 or more experts) or a
 *    butterfly over its lanes (fewer, a power of two); other group sizes scan shared memory;
 *  - the scores are computed one expert per lane at a time, not unrolled: a single warp is
 *    bound by fetching the kernel's instructions, so the code is kept short; every loop runs
 *    on 32-bit indices (E <= 512).
 * The softmax's index-order sum and the renormalisation's pick-order sum run on lane 0.
 */
#include "cuda/cuda_internal.h"
#include "cuda/numerics.cuh"
#include "cuda/router.h"

#include <cuda_fp16.h>

#define RW_WARPS 4 /* rows per block */
#define RW_FULL 0xFFFFFFFFu

/* Floats in an order-preserving u32 (-0 is made +0 first: equal scores tie on the index). */
static __device__ __forceinline__ uint32_t rw_ordered(float v)
{
    const uint32_t b = mf_f32_bits(v == 0.0f ? 0.0f : v);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

static __device__ __forceinline__ float rw_unordered(uint32_t o)
{
    return mf_bits_f32((o & 0x80000000u) ? o & 0x7FFFFFFFu : ~o);
}

/*
 * An expert's (or a group's) rank, larger first: bits 63-62 the tier (2 ranked, 1 unranked,
 * 0 not a candidate), 61-30 the ordered choice score (ranked only), 29-0 the complemented
 * index. The order of route_ahead in router.cu.
 */
static __device__ __forceinline__ uint64_t rw_key(bool candidate, bool bad, float c, int i)
{
    const uint32_t oc = bad ? 0u : rw_ordered(c), tier = bad ? 1u : 2u;
    const uint32_t hi = (tier << 30) | (oc >> 2), lo = (oc << 30) | (uint32_t)(0x3FFFFFFF - i);
    return candidate ? ((uint64_t)hi << 32) | lo : 0ull;
}

static __device__ __forceinline__ int rw_index(uint64_t key)
{
    return 0x3FFFFFFF - (int)(key & 0x3FFFFFFFull);
}

/* The warp's largest key: the high words' max, then the low words' of the lanes that hold it. */
static __device__ __forceinline__ uint64_t rw_warp_max(uint64_t k)
{
    const unsigned hi = (unsigned)(k >> 32), lo = (unsigned)k;
    const unsigned mh = __reduce_max_sync(RW_FULL, hi);
    const unsigned ml = __reduce_max_sync(RW_FULL, hi == mh ? lo : 0u);
    return ((uint64_t)mh << 32) | ml;
}

/* (a1, a2): the two largest ordered scores of a set (0: none), merged with another set's. */
static __device__ __forceinline__ void rw_top2_merge(uint32_t *a1, uint32_t *a2, uint32_t b1,
                                                     uint32_t b2)
{
    const uint32_t lo = *a1 < b1 ? *a1 : b1, second = *a2 > b2 ? *a2 : b2;
    *a1 = *a1 > b1 ? *a1 : b1;
    *a2 = lo > second ? lo : second;
}

/* A group's key from its two best ordered choice scores (step 4; a1 = 0: none ranked). */
static __device__ __forceinline__ uint64_t rw_group_key(const RouteParams &p, uint32_t a1,
                                                        uint32_t a2, int g)
{
    float score = rw_unordered(a1);
    if (p.group_scoring == MOEFUSE_GROUP_TOP2_SUM && a2 != 0u)
        score = __fadd_rn(score, rw_unordered(a2));
    return rw_key(true, a1 == 0u || mf_is_nan(score), score, g);
}

/* A group's two best by a scan of its choice scores c (NaN: unranked). */
static __device__ uint64_t rw_group_scan(const RouteParams &p, const float *c, int g, int per)
{
    uint32_t a1 = 0u, a2 = 0u;
#pragma unroll 1
    for (int i = g * per; i < (g + 1) * per; i++)
        rw_top2_merge(&a1, &a2, mf_is_nan(c[i]) ? 0u : rw_ordered(c[i]), 0u);
    return rw_group_key(p, a1, a2, g);
}

/* Element off + t * 32 + lane of a row of dtype dt for t < NV; NaN past E. The hardware's
   f16 conversion: exact, and a NaN's payload means nothing to a router. */
template <int NV>
static __device__ __forceinline__ void rw_load(const void *base, int dt, int64_t off, int lane,
                                               int E, float x[NV])
{
    if (dt == MF_DT_F32) {
        const float *q = (const float *)base + off;
#pragma unroll
        for (int t = 0; t < NV; t++)
            x[t] = t * 32 + lane < E ? __ldg(q + t * 32 + lane) : NAN;
    } else {
        const unsigned short *q = (const unsigned short *)base + off;
        const bool bf = dt == MF_DT_BF16;
#pragma unroll
        for (int t = 0; t < NV; t++) {
            const uint32_t h = t * 32 + lane < E ? __ldg(q + t * 32 + lane) : 0x7FC0u;
            x[t] = bf ? mf_bf16_to_f32(h) : __half2float(__ushort_as_half((unsigned short)h));
        }
    }
}

/* topk_softmax's steps 1-2 over the k picked logits in w (an id of -1 counts as NaN). */
static __device__ void rw_softmax_k(const int32_t *ids, float *w, int k)
{
    bool any = false;
    float mx = -INFINITY;
#pragma unroll 1
    for (int j = 0; j < k; j++) {
        w[j] = ids[j] < 0 ? NAN : w[j];
        if (!mf_is_nan(w[j])) {
            mx = !any || w[j] > mx ? w[j] : mx;
            any = true;
        }
    }
    int cnt = 0;
#pragma unroll 1
    for (int j = 0; j < k; j++)
        cnt += w[j] == mx;
    const float share = any && !mf_is_finite(mx) ? __fdiv_rn(1.0f, (float)cnt) : 0.0f;
    float sum = 0.0f;
#pragma unroll 1
    for (int j = 0; j < k; j++) {
        if (!any)
            w[j] = 0.0f;
        else if (!mf_is_finite(mx))
            w[j] = w[j] == mx ? share : 0.0f;
        else
            w[j] = mf_is_nan(w[j]) ? 0.0f : mf_exp_f32(__fsub_rn(w[j], mx));
        sum = __fadd_rn(sum, w[j]);
    }
    if (any && mf_is_finite(mx))
#pragma unroll 1
        for (int j = 0; j < k; j++)
            w[j] = __fdiv_rn(w[j], sum);
}

/* 8-byte words of shared memory a warp uses: the group keys, then l, s, c and the ids. */
static __host__ __device__ constexpr size_t rw_warp_smem_words(int nv)
{
    return MOEFUSE_ROUTER_MAX_GROUPS + (size_t)4 * nv * 32 / 2;
}

template <int NV>
__global__ void __launch_bounds__(RW_WARPS * 32) mf_k_route_warp(const RouteParams p)
{
    extern __shared__ uint64_t rw_smem[]; /* each warp's share: rw_warp_smem_words */
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

    /* step 2: the scores, one expert per lane at a time (one copy of exp in the code) */
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
#pragma unroll 1
        for (int i = lane; i < E; i += 32) {
            const float x = lv[i];
            const float d = __fadd_rn(1.0f, mf_exp_f32(-x));
            sv[i] = mf_is_nan(x) ? 0.0f : __fdiv_rn(1.0f, d);
        }
    } else if (softmax && mode == 2) { /* the exps, divided by their sum below */
#pragma unroll 1
        for (int i = lane; i < E; i += 32) {
            const float x = lv[i];
            sv[i] = mf_is_nan(x) ? 0.0f : mf_exp_f32(__fsub_rn(x, mx));
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

    /* step 4: the kept groups */
    uint64_t keep = ~0ull;
    if (G > 1) {
        uint32_t t1[NV], t2[NV]; /* a lane's ordered choice scores (0: unranked) */
#pragma unroll
        for (int t = 0; t < NV; t++) {
            t1[t] = mf_is_nan(c[t]) ? 0u : rw_ordered(c[t]);
            t2[t] = 0u;
        }
        if (per % 32 == 0) {
            /* a register's two best by two warp reductions; a group's over its q registers
               (counted down, not divided: a division by a runtime value is a long loop) */
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
                    rw_top2_merge(&a1, &a2, m1, m2);
                    if (--left == 0) { /* the group's last register */
                        if (lane == 0)
                            gk[g] = rw_group_key(p, a1, a2, g);
                        a1 = a2 = 0u;
                        left = q;
                        g++;
                    }
                }
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

    /* steps 6-8: w = s of the pick, then the softmax over the k (TOPK_SOFTMAX), the
       renormalisation and the scale; sums in pick order on lane 0 */
    float *w = cv; /* the choice scores are used up */
#pragma unroll 1
    for (int j = lane; j < K; j += 32)
        w[j] = ids[j] >= 0 ? sv[ids[j]] : 0.0f;
    __syncwarp();
    if (lane == 0 && p.scoring == MOEFUSE_ROUTER_TOPK_SOFTMAX)
        rw_softmax_k(ids, w, K);
    float sum = 0.0f;
    if (lane == 0 && p.renorm)
#pragma unroll 1
        for (int j = 0; j < K; j++)
            sum = __fadd_rn(sum, w[j]);
    __syncwarp(); /* lane 0's writes of w before the other lanes read them */
    sum = __shfl_sync(RW_FULL, sum, 0);
#pragma unroll 1
    for (int j = lane; j < K; j += 32) {
        float wj = w[j];
        if (p.renorm && sum > 0.0f)
            wj = __fdiv_rn(wj, sum);
        if (p.scale != 1.0f)
            wj = __fmul_rn(wj, p.scale);
        p.ids[m * p.is0 + j] = ids[j];
        p.w[m * p.ws0 + j] = wj;
    }
}

template <int NV>
static void rw_launch(const RouteParams *p, unsigned grid, cudaStream_t stream)
{
    const size_t smem = rw_warp_smem_words(NV) * 8 * RW_WARPS; /* 35 KB at most */
    mf_k_route_warp<NV><<<grid, RW_WARPS * 32, smem, stream>>>(*p);
}

void mf_route_warp_launch(const RouteParams *p, cudaStream_t stream)
{
    const unsigned grid = (unsigned)((p->M + RW_WARPS - 1) / RW_WARPS);
    const int nv = (int)((p->E + 31) / 32);
    if (nv <= 1)
        rw_launch<1>(p, grid, stream);
    else if (nv <= 2)
        rw_launch<2>(p, grid, stream);
    else if (nv <= 4)
        rw_launch<4>(p, grid, stream);
    else if (nv <= 8)
        rw_launch<8>(p, grid, stream);
    else /* a power of two: the keys' sorting network */
        rw_launch<16>(p, grid, stream);
}
