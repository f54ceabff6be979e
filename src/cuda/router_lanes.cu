/*
 * topk_route for many rows of the common routers (E = 128, 256 or 384; n_group 1, 2, 4, 8 or
 * 16; k <= 32): LANES lanes per row (32 for E = 256, else 16), lane s holding the
 * VPT = E / LANES experts s * VPT ... from one contiguous stretch of the row (vector loads
 * where aligned). Against the warp per row (router_warp.cu, lane l holding l, l + 32, ...),
 * groups are whole lanes and the picks need no sorted lists; a lane's chains are VPT long.
 * The same bits (router_keys.cuh):
 *  - a lane scores its experts in registers; the softmax's maximum and counts are butterflies
 *    over the row's lanes, its index-order sum a chain passed from lane to lane;
 *  - a group is a whole number of lanes: its top-2 is a lane's own, then a butterfly; each
 *    lane ranks its group's key against the others' (keys are unique);
 *  - an expert's rank is one 32-bit word: 0 not a candidate, 1 unranked (NaN), else its
 *    ordered choice score (>= 2^23 - 1), ties to the lower index. A pick is the best word of
 *    each lane (a max tree, then the first index holding it), then a butterfly; the winner
 *    clears its word.
 */
#include "cuda/cuda_internal.h"
#include "cuda/pdl.cuh"
#include "cuda/router_keys.cuh"

#define RL_THREADS 128 /* RL_THREADS / LANES rows a block */

/* The largest of v[0..N), by a tree (short chains). */
template <int N>
static __device__ __forceinline__ uint32_t rl_tree_max(const uint32_t *v)
{
    if constexpr (N == 1)
        return v[0];
    else {
        const uint32_t a = rl_tree_max<N / 2>(v), b = rl_tree_max<N - N / 2>(v + N / 2);
        return a > b ? a : b;
    }
}

/* x[0..VPT) = elements off .. off + VPT of a row of dtype dt; vec: 16-byte aligned. */
template <int VPT>
static __device__ __forceinline__ void rl_load(const void *base, int dt, int64_t off, bool vec,
                                               float x[VPT])
{
    if (dt == MF_DT_F32) {
        const float *q = (const float *)base + off;
        if (VPT % 4 == 0 && vec) {
#pragma unroll
            for (int v = 0; v < VPT / 4; v++) {
                const float4 f = __ldg((const float4 *)q + v);
                x[4 * v] = f.x;
                x[4 * v + 1] = f.y;
                x[4 * v + 2] = f.z;
                x[4 * v + 3] = f.w;
            }
        } else {
#pragma unroll
            for (int j = 0; j < VPT; j++)
                x[j] = __ldg(q + j);
        }
        return;
    }
    const unsigned short *q = (const unsigned short *)base + off;
    uint32_t h[VPT];
    if (VPT % 8 == 0 && vec) {
#pragma unroll
        for (int v = 0; v < VPT / 8; v++) {
            const uint4 r = __ldg((const uint4 *)q + v);
            const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int t = 0; t < 4; t++) {
                h[8 * v + 2 * t] = w[t] & 0xFFFFu;
                h[8 * v + 2 * t + 1] = w[t] >> 16;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < VPT; j++)
            h[j] = __ldg(q + j);
    }
    const bool bf = dt == MF_DT_BF16;
#pragma unroll
    for (int j = 0; j < VPT; j++)
        x[j] = bf ? mf_bf16_to_f32(h[j]) : __half2float(__ushort_as_half((unsigned short)h[j]));
}

/* A butterfly over the row's LANES lanes (xor 1, 2, ...: the row's lanes stay together). */
template <int LANES>
static __device__ __forceinline__ float rl_max(float v)
{
#pragma unroll
    for (int off = 1; off < LANES; off <<= 1)
        v = fmaxf(v, __shfl_xor_sync(RW_FULL, v, off));
    return v;
}

template <int LANES>
static __device__ __forceinline__ unsigned rl_add(unsigned v)
{
#pragma unroll
    for (int off = 1; off < LANES; off <<= 1)
        v += __shfl_xor_sync(RW_FULL, v, off);
    return v;
}

template <int VPT, int LANES>
__global__ void __launch_bounds__(RL_THREADS) mf_k_route_lanes(const RouteParams p)
{
    constexpr int RL_LANES = LANES, RL_ROWS = RL_THREADS / LANES;
    constexpr int E = VPT * RL_LANES, SROW = E + 4 * RL_LANES; /* padded: fewer bank clashes */
    __shared__ __align__(8) float exp_tab[64]; /* read as pairs (ld.shared.v2) */
    __shared__ float s_sm[RL_ROWS * SROW]; /* the rows' scores, lane s at s * (VPT + 4) */
    __shared__ uint32_t o_sm[RL_ROWS][E]; /* the rows' rank words (the listed picks) */
    __shared__ int32_t list_e[RL_ROWS][32];
    __shared__ uint32_t list_u[RL_ROWS][32];
    __shared__ int32_t ids_sm[RL_ROWS][32];
    __shared__ float w_sm[RL_ROWS][32];
    if (threadIdx.x < 64)
        exp_tab[threadIdx.x] = mf_exp_table_dev[threadIdx.x];
    mf_pdl_wait(); /* the logits may come from the kernel before */
    mf_pdl_trigger();
    __syncthreads();
    const int vec = p.vec;
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(exp_tab);
    const int lane = (int)(threadIdx.x & 31), sub = lane & (RL_LANES - 1);
    const int row = (int)(threadIdx.x / RL_LANES), first = lane & ~(RL_LANES - 1);
    int64_t m = (int64_t)blockIdx.x * RL_ROWS + row;
    const bool live = m < p.M;
    m = live ? m : p.M - 1; /* a past-the-end row repeats the last one and stores nothing */
    const int K = (int)p.k, G = (int)p.groups, e0 = sub * VPT;
    float *srow = s_sm + row * SROW + sub * (VPT + 4);

    /* step 1: the logits plus the logit bias */
    float x[VPT];
    rl_load<VPT>(p.l, p.ldt, m * p.ls0 + e0, vec & 1, x);
    if (p.lb) {
        float b[VPT];
        rl_load<VPT>(p.lb, p.lbdt, e0, vec & 2, b);
#pragma unroll
        for (int j = 0; j < VPT; j++)
            x[j] = __fadd_rn(x[j], b[j]);
    }
    uint32_t nan_bits[(VPT + 31) / 32] = {}; /* which logits are NaN */
#pragma unroll
    for (int j = 0; j < VPT; j++)
        nan_bits[j / 32] |= (uint32_t)mf_is_nan(x[j]) << (j % 32);
#define RL_NAN(j) ((nan_bits[(j) / 32] >> ((j) % 32)) & 1u)

    /* step 2: the scores s, into x and the row's shared memory (the picks' weights) */
    if (p.scoring == MOEFUSE_ROUTER_SIGMOID) {
        float sg[VPT];
        rw_sigmoid<VPT>(x, sg, tabs);
#pragma unroll
        for (int j = 0; j < VPT; j++)
            x[j] = sg[j];
    } else if (p.scoring == MOEFUSE_ROUTER_SOFTMAX) {
        float mx = -INFINITY;
        unsigned num = 0u;
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            mx = RL_NAN(j) ? mx : fmaxf(mx, x[j]);
            num += !RL_NAN(j);
        }
        mx = rl_max<LANES>(mx); /* the order of a max does not matter: +0 and -0 give the same */
        num = rl_add<LANES>(num);
        unsigned cnt = 0u;
#pragma unroll
        for (int j = 0; j < VPT; j++)
            cnt += x[j] == mx;
        cnt = rl_add<LANES>(cnt);
        /* +-Inf maxima share 1; else exps (0 for NaN, all 0 with no number), summed in index
           order: the sum passes from lane to lane, each adding its stretch. Every row runs the
           chain (its shuffles take the whole warp); a row of shares ignores it */
        const bool shares = num > 0u && !mf_is_finite(mx);
        const float share = shares ? __fdiv_rn(1.0f, (float)cnt) : 0.0f;
#pragma unroll
        for (int j = 0; j < VPT; j++)
            x[j] = shares              ? (x[j] == mx ? share : 0.0f)
                   : RL_NAN(j) || num == 0u ? 0.0f
                                           : mf_exp_shared(__fsub_rn(x[j], mx), tabs);
        float sum = 0.0f;
#pragma unroll 1
        for (int q = 0; q < RL_LANES; q++) {
            if (sub == q)
#pragma unroll
                for (int j = 0; j < VPT; j++)
                    sum = __fadd_rn(sum, x[j]);
            sum = __shfl_sync(RW_FULL, sum, first | q);
        }
        if (!shares && num > 0u)
#pragma unroll
            for (int j = 0; j < VPT; j++)
                x[j] = RL_NAN(j) ? 0.0f : __fdiv_rn(x[j], sum);
    } /* TOPK_SOFTMAX: the logit itself */
#pragma unroll
    for (int j = 0; j < VPT; j++)
        srow[j] = x[j];

    /* step 3: choice scores as ordered words (0: unranked, NaN) */
    uint32_t o[VPT];
    {
        float b[VPT];
        if (p.cb)
            rl_load<VPT>(p.cb, p.cbdt, e0, vec & 4, b);
#pragma unroll
        for (int j = 0; j < VPT; j++) {
            const float c = p.cb ? __fadd_rn(x[j], b[j]) : x[j];
            o[j] = RL_NAN(j) || mf_is_nan(c) ? 0u : rw_ordered(c);
        }
    }
#undef RL_NAN

    /* step 4: the kept groups (each of LANES / G whole lanes) */
    bool kept = true;
    if (G > 1) {
        uint32_t a1 = 0u, a2 = 0u;
#pragma unroll
        for (int j = 0; j < VPT; j++)
            rw_top2_merge(&a1, &a2, o[j], 0u);
        const int span = RL_LANES / G; /* lanes per group */
#pragma unroll 1
        for (int off = 1; off < span; off <<= 1) {
            const uint32_t b1 = __shfl_xor_sync(RW_FULL, a1, off);
            const uint32_t b2 = __shfl_xor_sync(RW_FULL, a2, off);
            rw_top2_merge(&a1, &a2, b1, b2);
        }
        const uint64_t gkey = rw_group_key(p, a1, a2, sub / span);
        int larger = 0;
#pragma unroll
        for (int g = 0; g < 16; g++) /* G <= 16 (mf_route_lanes_takes) */
            if (g < G)
                larger += __shfl_sync(RW_FULL, gkey, first | (g * span)) > gkey;
        kept = larger < (int)p.kept;
    }
#pragma unroll
    for (int j = 0; j < VPT; j++)
        o[j] = !kept ? 0u : o[j] == 0u ? 1u : o[j];

    /* step 5: the k picks; ids_sm[row][j] = pick j (-1: none left). The k-th best of the
       lanes' bests is a floor that k experts reach, so the picks are among those at or above
       it. When every row of the warp has at most 32 of them (wide ties have more), they are
       listed and each counts the listed ones ahead of it: that is its place. Otherwise k
       rounds of the row's best. */
    bool listed = K <= RL_LANES;
    if (listed) {
        const uint32_t best = rl_tree_max<VPT>(o);
        uint32_t floor;
        if constexpr (LANES == 32) { /* the k-th best: k - 1 maxima out, a lane each */
            uint32_t left = best;
#pragma unroll 1
            for (int r = 0; r < K - 1; r++) {
                const uint32_t mx = __reduce_max_sync(RW_FULL, left);
                left = lane == __ffs(__ballot_sync(RW_FULL, left == mx)) - 1 ? 0u : left;
            }
            floor = __reduce_max_sync(RW_FULL, left);
        } else {
            int ahead = 0; /* lanes whose best is ahead of mine (the lower lane among equals) */
#pragma unroll
            for (int q = 0; q < RL_LANES; q++) {
                const uint32_t v = __shfl_sync(RW_FULL, best, first | q);
                ahead += v > best || (v == best && q < sub);
            }
            const unsigned rows_lanes = ((1u << (LANES & 31)) - 1u) << first;
            const unsigned at = __ballot_sync(RW_FULL, ahead == K - 1) & rows_lanes;
            floor = __shfl_sync(RW_FULL, best, __ffs(at) - 1);
        }
        uint32_t reach = 0u;
#pragma unroll
        for (int t = 0; t < VPT; t++)
            reach |= (uint32_t)(o[t] >= floor) << t;
        const int mine = __popc(reach);
        int before = mine; /* the row's reaching experts in lanes up to mine */
#pragma unroll
        for (int off = 1; off < RL_LANES; off <<= 1) {
            const int v = __shfl_up_sync(RW_FULL, before, off, RL_LANES);
            before += sub >= off ? v : 0;
        }
        const int n = __shfl_sync(RW_FULL, before, first | (RL_LANES - 1));
        listed = __all_sync(RW_FULL, n <= 32);
        if (listed) {
#pragma unroll
            for (int t = 0; t < VPT; t++)
                o_sm[row][e0 + t] = o[t];
            int at_list = before - mine;
            while (reach) { /* in index order: a lane's stretch after the lanes before it */
                const int e = e0 + __ffs(reach) - 1;
                reach &= reach - 1u;
                list_e[row][at_list] = e;
                list_u[row][at_list++] = o_sm[row][e]; /* its own write */
            }
            __syncwarp();
            for (int a = sub; a < n; a += RL_LANES) {
                const int e = list_e[row][a];
                const uint32_t v = list_u[row][a];
                int place = 0;
#pragma unroll 4
                for (int d = 0; d < n; d++) {
                    const uint32_t w = list_u[row][d];
                    place += w > v || (w == v && list_e[row][d] < e);
                }
                if (place < K)
                    ids_sm[row][place] = v != 0u ? e : -1;
            }
        }
    }
#pragma unroll 1
    for (int j = 0; j < K && !listed; j++) {
        uint32_t bu = rl_tree_max<VPT>(o), at = 0u;
#pragma unroll
        for (int t = 0; t < VPT; t++)
            at |= (uint32_t)(o[t] == bu) << t;
        const int bj = __ffs(at) - 1; /* the lowest index holding the lane's best */
        int gi = e0 + bj;
#pragma unroll
        for (int off = 1; off < RL_LANES; off <<= 1) {
            const uint32_t ou = __shfl_xor_sync(RW_FULL, bu, off);
            const int oi = __shfl_xor_sync(RW_FULL, gi, off);
            const bool take = ou > bu || (ou == bu && oi < gi);
            bu = take ? ou : bu;
            gi = take ? oi : gi;
        }
        const bool mine = bu != 0u && gi == e0 + bj; /* the row's best is its lane's best */
#pragma unroll
        for (int t = 0; t < VPT; t++)
            o[t] = mine && t == bj ? 0u : o[t];
        if (sub == 0)
            ids_sm[row][j] = bu != 0u ? gi : -1;
    }
    __syncwarp();

    /* steps 6-8: w = s of each pick, then rw_store_picks (router_keys.cuh) */
    const float *scores = s_sm + row * SROW;
#pragma unroll 1
    for (int j = sub; j < K; j += RL_LANES) {
        const int32_t id = ids_sm[row][j];
        w_sm[row][j] = id >= 0 ? scores[(id / VPT) * (VPT + 4) + id % VPT] : 0.0f;
    }
    __syncwarp();
    rw_store_picks<LANES>(p, m, sub, first, live, ids_sm[row], w_sm[row], K);
}

/* 16-byte alignment of every element a lane's vector load starts at. */
static bool rl_aligned(const void *base, int dt, int64_t row_stride)
{
    const int64_t size = dt == MF_DT_F32 ? 4 : 2;
    return base && (uintptr_t)base % 16 == 0 && (row_stride * size) % 16 == 0;
}

bool mf_route_lanes_takes(const RouteParams *p)
{
    const bool experts = p->E == 128 || p->E == 256 || p->E == 384;
    const bool groups = p->groups >= 1 && p->groups <= 16 && 16 % p->groups == 0;
    return experts && groups && p->k <= 32;
}

template <int LANES>
static void rl_launch(const RouteParams *p, cudaStream_t stream, int pdl)
{
    const dim3 grid((unsigned)((p->M + RL_THREADS / LANES - 1) / (RL_THREADS / LANES)));
    if (p->E == 128)
        mf_launch_pdl(mf_k_route_lanes<128 / LANES, LANES>, grid, RL_THREADS, 0, stream, pdl, *p);
    else if (p->E == 256)
        mf_launch_pdl(mf_k_route_lanes<256 / LANES, LANES>, grid, RL_THREADS, 0, stream, pdl, *p);
    else
        mf_launch_pdl(mf_k_route_lanes<384 / LANES, LANES>, grid, RL_THREADS, 0, stream, pdl, *p);
}

void mf_route_lanes_launch(RouteParams *p, cudaStream_t stream, int pdl)
{
    p->vec = (rl_aligned(p->l, p->ldt, p->ls0) ? 1 : 0) |
                    (rl_aligned(p->lb, p->lbdt, 0) ? 2 : 0) |
                    (rl_aligned(p->cb, p->cbdt, 0) ? 4 : 0);
    /* the most lanes whose stretch is a multiple of 8 experts (whole 16-byte loads of bf16):
       32 for E = 256, 16 for 128 and 384 (measured: docs/PERFORMANCE.md) */
    if (p->E == 256)
        rl_launch<32>(p, stream, pdl);
    else
        rl_launch<16>(p, stream, pdl);
}
