/*
 * routing_metadata in one launch of a cluster of NB blocks (8, or 16 where the device allows a
 * cluster that large), for E <= MC_MAX_E and up to NB x 1024 x MC_MAX_ROUNDS slots. The
 * cluster's blocks are resident together by construction, so they can exchange their counts
 * through distributed shared memory between two cluster barriers: one launch, no scratch.
 * (A cooperative grid with two grid barriers, tried first, ran 19.3 us at M = 64 on the H200,
 * where the cluster ran 5.8.)
 *
 * Block r takes slots [r * 1024 R, (r + 1) * 1024 R), its warp w the R rounds of 32 from
 * (r * 32 + w) * 32 R:
 *  1. each lane loads its R slots' experts at once and finds its peers in each round (the
 *     lanes of the same expert, from ballots); the round's first peer adds their count to
 *     the warp's row of a [warps, E] table;
 *  2. four threads an expert (one for E > 256) turn column e of the table into each warp's
 *     first rank among the block's slots of e, and the block's count of e; cluster barrier;
 *     they read every block's count of e (distributed shared memory, each a quarter): the
 *     total, and the slots of the blocks before (one thread an expert left 8 warps of 32 at
 *     work in these steps, each walking its column and 16 remote counts);
 *  3. one scan gives the offsets (of the padded totals) and, for the block's own slots, where
 *     each expert's run starts in the block's part of order;
 *  4. the rounds again, from registers: a slot's rank among the block's slots of its expert
 *     is its warp's next rank plus its rank among its peers (ascending in the slot; no atomic
 *     decides it). position and masked_row are stored at once (consecutive slots, coalesced);
 *     order's entry goes to the block's runs in shared memory first, then out run by run, so
 *     that neighbouring lanes store neighbouring entries (a warp's scattered store of 32
 *     experts' entries costs 32 cache lines);
 * A block leaves only after every block has read its counts (the last cluster barrier).
 */
#include "cuda/pdl.cuh"
#include "cuda/routing_meta.cuh"

#include <cooperative_groups.h>

#define MC_MAX_ROUNDS 2 /* rounds of 32 slots a warp; past them the span path */
#define MC_MAX_E 1024   /* the warps' table, 32 x E ints, in opt-in shared memory */
#define MC_ID_BITS 11   /* e + 2 < 2^11 for every e of up to MC_MAX_E experts */
/* The table's row pitch: P = 1 (mod 4), so that the TPE = 4 threads of an expert, reading
   rows 8 apart, hit banks 8 apart (no conflicts among a warp's 8 experts x 4 threads). */
#define MC_PITCH(E) ((((E) + 3) & ~3) + 1)
/* Shared memory: the table, the scan's sums (64-bit), cnt, tot, off (E + 1), base, run, and
   the staged order entries (slot and expert) of R rounds. */
#define MC_SMEM(E, R)                                                                      \
    ((size_t)(RM_WARPS * MC_PITCH(E) + 5 * (E) + 1 + 2 * (RM_WARPS + 1) +                  \
              2 * RM_THREADS * (R)) *                                                      \
     4)

typedef struct MetaCluster {
    MetaParams p;
    /* s / k as __umulhi(s, k_magic), k_magic = ceil(2^32 / k) (0: k = 1), exact for
       s * k < 2^32: here s < 2^15 (S <= 32768) and k <= S when any slot is loaded */
    uint32_t k_magic;
} MetaCluster;

/* meta_peers without a branch: the bits of e + 2 past E + 1's are 0 in every lane, and a
   ballot of zeros leaves the peers as they are. */
static __device__ __forceinline__ unsigned mc_peers(int e)
{
    const uint32_t u = (uint32_t)(e + 2);
    unsigned peers = RM_FULL;
#pragma unroll
    for (int b = 0; b < MC_ID_BITS; b++) {
        const bool one = (u >> b) & 1u;
        const unsigned set = __ballot_sync(RM_FULL, one);
        peers &= one ? set : ~set;
    }
    return peers;
}

/* Local expert of a loaded id (moe_slot_expert's rules): -1 invalid. */
static __device__ __forceinline__ int mc_local(const MoeRoute &rt, int32_t id)
{
    if (id < 0 || id >= rt.Eg)
        return -1;
    if (!rt.map)
        return id < rt.E ? id : -1;
    const int32_t e = __ldg(rt.map + (int64_t)id * rt.map_s0);
    return e >= 0 && e < rt.E ? e : -1;
}

/* TPE threads an expert in the per-expert steps (4 for E <= 256, else 1). */
template <int R, int NB, int TPE>
__global__ void __launch_bounds__(RM_THREADS) mf_k_meta_cluster(const MetaCluster c)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    extern __shared__ __align__(16) int32_t sm[];
    const MetaParams &p = c.p;
    const int E = (int)p.rt.E;
    const uint32_t S = (uint32_t)p.rt.S, k = (uint32_t)p.rt.topk;
    const int P = MC_PITCH(E);
    int32_t *table = sm; /* [RM_WARPS, P]: the warps' counts, then their first ranks */
    unsigned long long *warp_sums = (unsigned long long *)(table + RM_WARPS * P); /* [33] */
    int32_t *cnt = (int32_t *)(warp_sums + RM_WARPS + 1); /* [E]: the block's, read by all */
    int32_t *tot = cnt + E;                   /* [E]: every block's */
    int32_t *off = tot + E;                   /* [E + 1]: the offsets */
    int32_t *base = off + E + 1;              /* [E]: the position of the block's first slot */
    int32_t *run = base + E;                  /* [E]: where e's run starts in the stage */
    int32_t *stage_s = run + E;               /* [RM_THREADS * R]: the block's slots, by run */
    int32_t *stage_e = stage_s + RM_THREADS * R;
    cg::cluster_group cluster = cg::this_cluster();
    const unsigned r = cluster.block_rank();
    const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned below = (1u << lane) - 1u;
    const uint32_t wlo = (r * RM_WARPS + (unsigned)warp) * (32u * R);
    int32_t *row = table + warp * P;
    for (int i = tid; i < RM_WARPS * P / 4; i += RM_THREADS) /* 32 P: whole int4s */
        ((int4 *)table)[i] = make_int4(0, 0, 0, 0);
    mf_pdl_wait(); /* the ids may come from the kernel before */
    mf_pdl_trigger();
    /* 1. the R slots' ids loaded together, then their experts (-1 invalid, -2 past the end) */
    uint32_t m[R], j[R];
    int32_t id[R];
    int ev[R];
#pragma unroll
    for (int t = 0; t < R; t++) {
        const uint32_t s = wlo + t * 32 + lane;
        m[t] = c.k_magic ? __umulhi(s, c.k_magic) : s;
        j[t] = s - m[t] * k;
        id[t] = s < S ? __ldg(p.rt.ids + (int64_t)m[t] * p.rt.ids_s0 + j[t]) : 0;
    }
#pragma unroll
    for (int t = 0; t < R; t++)
        ev[t] = wlo + t * 32 + lane < S ? mc_local(p.rt, id[t]) : -2;
    unsigned peers[R];
#pragma unroll
    for (int t = 0; t < R; t++)
        peers[t] = mc_peers(ev[t]);
    __syncthreads(); /* the table is zero */
#pragma unroll
    for (int t = 0; t < R; t++) {
        if (ev[t] >= 0 && (peers[t] & below) == 0u)
            row[ev[t]] += __popc(peers[t]);
        __syncwarp(); /* the next round's lanes may add to the same expert */
    }
    __syncthreads();
    /* 2. TPE threads an expert (consecutive lanes), thread q the warps [q W, q W + W): column
       e of the table becomes each warp's first rank among the block's slots of e; their sum is
       the block's count */
    constexpr int W = RM_WARPS / TPE;
    const int q = tid & (TPE - 1), e = tid / TPE;
    const bool on = e < E;
    int32_t *col = table + q * W * P + e;
    int32_t part = 0;
    if (on)
#pragma unroll 8
        for (int w = 0; w < W; w++)
            part += col[w * P];
    int32_t inc = part;
#pragma unroll
    for (int d = 1; d < TPE; d <<= 1) {
        const int32_t o = __shfl_up_sync(RM_FULL, inc, d, TPE);
        inc += q >= d ? o : 0;
    }
    const int32_t mine = __shfl_sync(RM_FULL, inc, TPE - 1, TPE); /* the block's count of e */
    if (on) {
        int32_t at = inc - part;
#pragma unroll 8
        for (int w = 0; w < W; w++) {
            const int32_t n = col[w * P];
            col[w * P] = at;
            at += n;
        }
        if (q == 0)
            cnt[e] = mine;
    }
    cluster.sync(); /* every block's cnt complete */
    /* every block's count of e (distributed shared memory), NB / TPE blocks a thread */
    int32_t n[NB / TPE], before = 0, all = 0;
#pragma unroll
    for (int i = 0; i < NB / TPE; i++) /* the loads together, then the sums */
        n[i] = on ? *cluster.map_shared_rank(cnt + e, (unsigned)(i * TPE + q)) : 0;
#pragma unroll
    for (int i = 0; i < NB / TPE; i++) {
        before += i * TPE + q < (int)r ? n[i] : 0;
        all += n[i];
    }
#pragma unroll
    for (int d = 1; d < TPE; d <<= 1) {
        before += __shfl_xor_sync(RM_FULL, before, d, TPE);
        all += __shfl_xor_sync(RM_FULL, all, d, TPE);
    }
    cluster.barrier_arrive(); /* this block has read the others; the wait is at the end */
    /* 3. one scan of (padded total, the block's count) over the experts' first threads */
    const bool lead = on && q == 0;
    const int32_t padded = meta_padded(p, all);
    const unsigned long long v =
        lead ? ((unsigned long long)(uint32_t)padded << 32) | (uint32_t)mine : 0ull;
    unsigned long long total;
    const unsigned long long at = meta_block_scan<unsigned long long>(v, warp_sums, &total);
    if (lead) {
        off[e] = (int32_t)(at >> 32);
        run[e] = (int32_t)(uint32_t)at;
        base[e] = (int32_t)(at >> 32) + before;
        tot[e] = all;
        if (r == 0)
            p.counts[e] = all;
    }
    if (tid == 0)
        off[E] = (int32_t)(total >> 32);
    __syncthreads();
    if (p.offsets && r == 0)
        for (int i = tid; i <= E; i += RM_THREADS)
            p.offsets[i] = off[i];
    /* 4. the rounds again: a slot's rank among the block's slots of its expert */
#pragma unroll
    for (int t = 0; t < R; t++) {
        const int et = ev[t];
        const int64_t at_p = (int64_t)m[t] * p.ps0 + j[t], at_w = (int64_t)m[t] * p.ws0 + j[t];
        if (et >= 0) {
            const int32_t rank = row[et] + __popc(peers[t] & below), pos = base[et] + rank;
            if (p.order) {
                stage_s[run[et] + rank] = (int32_t)(wlo + t * 32 + lane);
                stage_e[run[et] + rank] = et;
            }
            if (p.position)
                p.position[at_p] = pos;
            if (p.mrow)
                p.mrow[at_w] = pos - off[et];
        } else if (et == -1) {
            if (p.position)
                p.position[at_p] = -1;
            if (p.mrow)
                p.mrow[at_w] = -1;
        }
        __syncwarp();
        if (et >= 0 && (peers[t] & below) == 0u)
            row[et] += __popc(peers[t]);
        __syncwarp();
    }
    if (p.order) {
        __syncthreads(); /* the stage is complete */
        const int32_t staged = (int32_t)(uint32_t)total;
        for (int32_t i = tid; i < staged; i += RM_THREADS) {
            const int es = stage_e[i];
            p.order[base[es] + (i - run[es])] = stage_s[i];
        }
        meta_fill_padding(p, tot, off, r, NB);
    }
    cluster.barrier_wait();
#endif
}

/* The rounds of 32 slots a warp of NB blocks take for S slots (0: more than MC_MAX_ROUNDS). */
static int meta_cluster_rounds(int64_t S, int nb)
{
    const int64_t one = (int64_t)nb * RM_WARPS * 32;
    const int64_t rounds = (S + one - 1) / one;
    return rounds <= MC_MAX_ROUNDS ? (rounds > 0 ? (int)rounds : 1) : 0;
}

/* Whether clusters of 16 of these blocks can be resident on this device (asked once). */
static int meta_cluster16(cuda_state *s)
{
    if (s->meta_cluster16 == 0) {
        int n = 0;
        void (*kern)(const MetaCluster) = mf_k_meta_cluster<MC_MAX_ROUNDS, 16, 1>;
        const size_t smem = MC_SMEM(MC_MAX_E, MC_MAX_ROUNDS);
        if (smem <= s->smem_optin &&
            cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
                cudaSuccess &&
            cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)smem) == cudaSuccess) {
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute at = {};
            at.id = cudaLaunchAttributeClusterDimension;
            at.val.clusterDim.x = 16;
            at.val.clusterDim.y = at.val.clusterDim.z = 1;
            cfg.gridDim = dim3(16);
            cfg.blockDim = dim3(RM_THREADS);
            cfg.dynamicSmemBytes = smem;
            cfg.attrs = &at;
            cfg.numAttrs = 1;
            if (cudaOccupancyMaxActiveClusters(&n, kern, &cfg) != cudaSuccess)
                n = 0;
        }
        (void)cudaGetLastError(); /* a refusal here leaves no error for the next launch check */
        s->meta_cluster16 = n > 0 ? 1 : -1;
    }
    return s->meta_cluster16 > 0;
}

/* The cluster size for these args: 8 while one round of 8 blocks holds the slots, else 16
   where the device allows it, else 8 again (MOEFUSE_CUDA_META may force 8, or no cluster);
   0: the cluster path does not take them. */
static int meta_cluster_blocks(cuda_state *s, const mf_meta_args *a)
{
    const int64_t E = a->route.experts, S = a->route.tokens * a->route.topk;
    const int forced = s->forced_meta;
    if (!s->clusters || E <= 0 || E > MC_MAX_E || forced == META_SPANS ||
        forced == META_REFERENCE || MC_SMEM(MC_MAX_E, MC_MAX_ROUNDS) > s->smem_optin)
        return 0;
    const bool small = S <= 8 * RM_THREADS && forced != META_CLUSTER16;
    if (!small && forced != META_CLUSTER8 && meta_cluster16(s) && meta_cluster_rounds(S, 16))
        return 16;
    return meta_cluster_rounds(S, 8) ? 8 : 0;
}

int mf_meta_cluster_fits(cuda_state *s, const mf_meta_args *a)
{
    return meta_cluster_blocks(s, a) > 0;
}

template <int R, int NB>
static moefuse_status meta_cluster_go(moefuse_context *ctx, cuda_state *s, const MetaCluster *c)
{
    const bool few = c->p.rt.E <= 256; /* four threads an expert */
    void (*kern)(const MetaCluster) =
        few ? mf_k_meta_cluster<R, NB, 4> : mf_k_meta_cluster<R, NB, 1>;
    const uint32_t bit = 1u << ((NB == 16 ? 4 : 0) + (few ? 2 : 0) + R - 1);
    if (!(s->meta_smem_raised & bit) && NB == 16) {
        const cudaError_t e =
            cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        if (e != cudaSuccess)
            return mf_cuda_fail(ctx, e, "routing_metadata",
                                "cudaFuncSetAttribute(mf_k_meta_cluster, non-portable size)");
    }
    MF_TRY(moe_ready_smem(ctx, s, "routing_metadata", kern, MC_SMEM(MC_MAX_E, R),
                          MC_SMEM(MC_MAX_E, R), &s->meta_smem_raised, bit,
                          "cudaFuncSetAttribute(mf_k_meta_cluster)"));
    mf_launch_pdl(kern, dim3(NB), RM_THREADS, MC_SMEM(c->p.rt.E, R), s->stream, s->pdl, *c,
                  (unsigned)NB);
    return mf_cuda_launched(ctx, "routing_metadata", "mf_k_meta_cluster");
}

moefuse_status mf_meta_cluster_launch(moefuse_context *ctx, cuda_state *s,
                                      const mf_meta_args *a, const MetaParams *p, int *taken)
{
    const int nb = meta_cluster_blocks(s, a);
    *taken = nb > 0;
    if (nb == 0)
        return MOEFUSE_OK;
    MetaCluster c;
    c.p = *p;
    const uint64_t k = (uint64_t)p->rt.topk;
    c.k_magic = k > 1 ? (uint32_t)(((1ull << 32) + k - 1) / k) : 0u;
    const int R = meta_cluster_rounds(p->rt.S, nb);
    if (nb == 8)
        return R == 1 ? meta_cluster_go<1, 8>(ctx, s, &c) : meta_cluster_go<2, 8>(ctx, s, &c);
    return R == 1 ? meta_cluster_go<1, 16>(ctx, s, &c) : meta_cluster_go<2, 16>(ctx, s, &c);
}
