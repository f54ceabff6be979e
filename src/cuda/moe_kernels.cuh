/*
 * Device code shared by the MoE GEMM kernels (moe_mma.cu, moe_simt.cu):
 * which slots a block works on (its tile), and the epilogues that turn f32
 * accumulators into h (gate) or y (final).
 *
 * A tile is up to BM slots s = m * k + j of one local expert e and one block
 * of output columns. Tiles come from one of two places:
 *  - routed: the route kernels (moe_route.cu) listed the valid slots grouped
 *    by expert; linear tile index lin enumerates (expert, column block,
 *    m-tile) with the m-tile fastest, so the blocks that read the same
 *    weight rows run side by side and share them through L2;
 *  - direct (S <= 16 slots, decode): no route kernels at all; every block
 *    looks at the S slots itself and takes the blockIdx.y-th distinct valid
 *    expert (in order of first appearance). Saves three launches at M = 1.
 * Every output element is one accumulation chain over the depth in a fixed
 * order, whatever tile or row of a tile its slot lands in, so the order of
 * slots inside an expert's list (filled with atomics) changes no bit.
 */
#ifndef MOEFUSE_CUDA_MOE_KERNELS_CUH
#define MOEFUSE_CUDA_MOE_KERNELS_CUH

#include "cuda/moe_internal.h"
#include "cuda/moe_math.cuh"
#include "cuda/pdl.cuh"

/*
 * Development timing (-DMOE_TIMING only, never in a normal build): thread 0 of
 * each block adds the cycles of each phase of a tile to moe_timing[kind][phase].
 */
#ifdef MOE_TIMING
static __device__ unsigned long long moe_timing[4][8]; /* [kind][phase], [kind][7] tiles */
#define MOE_TSTART(v) long long v = clock64()
#define MOE_TMARK(kind, phase, v)                                                                  \
    do {                                                                                           \
        if (threadIdx.x == 0) {                                                                    \
            const long long now_ = clock64();                                                      \
            atomicAdd(&moe_timing[kind][phase], (unsigned long long)(now_ - (v)));                 \
            if ((phase) == 0)                                                                      \
                atomicAdd(&moe_timing[kind][7], 1ull);                                             \
            v = now_;                                                                              \
        }                                                                                          \
    } while (0)
#else
#define MOE_TSTART(v)
#define MOE_TMARK(kind, phase, v)
#endif

/*
 * The grid of a GEMM kernel: direct routing takes blocks x (p->split of the depth) x one row a
 * touched expert (at most S of them); listed tiles one block a tile, up to INT_MAX.
 */
static inline dim3 moe_grid(const MoeGemm *p)
{
    if (p->rt.direct) {
        const int64_t ranks = p->rt.E < p->rt.S ? p->rt.E : p->rt.S;
        const int64_t split = p->split > 1 ? p->split : 1;
        return dim3((unsigned)(p->nblk * split), (unsigned)(ranks > 0 ? ranks : 1));
    }
    return dim3((unsigned)(p->lin_bound < INT_MAX ? p->lin_bound : INT_MAX));
}

/*
 * Launch a GEMM kernel on s->stream: with programmatic stream serialization
 * when p->pdl (sm_90: it may start before the previous kernel ends and waits
 * for it with griddepcontrol.wait where it needs its results), in clusters of
 * p->split blocks when the depth is split (moe_mma.cu's decode).
 */
static inline void moe_launch(void (*kern)(const MoeGemm), dim3 grid, unsigned threads,
                              size_t smem, cudaStream_t stream, const MoeGemm *p)
{
    mf_launch_pdl(kern, grid, threads, smem, stream, p->pdl, *p,
                  p->split > 1 ? (unsigned)p->split : 1u);
}

/*
 * Make a GEMM kernel launchable with `dyn` bytes of dynamic shared memory
 * (`total` with its static part): once per context, remembered as `bit` in
 * *raised, so threads with contexts of their own share no state. A device
 * whose opt-in limit is below `total` refuses with UNSUPPORTED.
 */
template <typename Kernel>
static inline moefuse_status moe_ready_smem(moefuse_context *ctx, const cuda_state *s,
                                            const char *op, Kernel kern, size_t dyn,
                                            size_t total, uint32_t *raised, uint32_t bit,
                                            const char *call)
{
    if (*raised & bit)
        return MOEFUSE_OK;
    if (total > s->smem_optin)
        return mf_error(ctx, MOEFUSE_ERR_UNSUPPORTED,
                        "%s: the tile needs %zu bytes of shared memory; the device allows %zu", op,
                        total, s->smem_optin);
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)dyn);
    if (e != cudaSuccess)
        return mf_cuda_fail(ctx, e, op, call);
    *raised |= bit;
    return MOEFUSE_OK;
}

/* Local expert of slot (m, j), or -1 when the slot is invalid (NUMERICS.md, MoE). */
static __device__ __forceinline__ int64_t moe_slot_expert(const MoeRoute &rt, int64_t m, int64_t j)
{
    const int64_t id = __ldg(rt.ids + m * rt.ids_s0 + j);
    if (id < 0 || id >= rt.Eg)
        return -1;
    if (!rt.map)
        return id < rt.E ? id : -1;
    const int64_t e = __ldg(rt.map + id * rt.map_s0);
    return (e >= 0 && e < rt.E) ? e : -1;
}

/* Shared-memory description of the current tile. */
struct MoeTileSmem {
    long long arow[MOE_MAX_BM]; /* element offset of the slot's A row, -1: padding row */
    long long orow[MOE_MAX_BM]; /* element offset of the slot's output row, -1: padding */
    long long tok[MOE_MAX_BM];  /* the slot's token (fused reduction) */
    int tokvalid[MOE_MAX_BM];   /* valid slots of that token (fused reduction) */
    long long last[MOE_MAX_BM]; /* tokens whose sum this block makes (fused reduction) */
    long long e, nb, count, first;
    unsigned zero_mask;     /* direct mode: invalid slots whose rows this block zeroes */
    unsigned zero_tok_mask; /* direct mode, fused: tokens without a valid slot (out rows zeroed) */
    unsigned valid_mask;    /* direct mode: the valid slots */
    int nlast;
    __align__(8) float exp_tab[64]; /* mf_exp_tab_fast's table, gate silu (mf_exp_tab_fill) */
};

/* Offsets of slot s's A row and output row; its token. */
static __device__ __forceinline__ long long moe_row_offsets(const MoeGemm &p, long long s,
                                                            long long *arow, long long *orow)
{
    const long long m = s / p.rt.topk, j = s - m * p.rt.topk;
    *arow = m * p.a_s0 + j * p.a_s1;
    *orow = m * p.o_s0 + j * p.o_s1;
    return m;
}

/* Direct mode: the slots of token m as bits of the slot mask (S <= 16). */
static __device__ __forceinline__ unsigned moe_token_bits(long long m, long long k)
{
    return ((1u << k) - 1u) << (m * k);
}

/* Routed mode: what tile `lin` covers; e = -1 past the last tile (the route wrote how many). */
struct MoeTileAt {
    long long e, nb;     /* local expert, column block */
    long long first;     /* its first entry in the route's slot list */
    long long count;     /* its slots, 1..BM */
};

template <int BM>
static __device__ __forceinline__ MoeTileAt moe_tile_at(const MoeGemm &p, long long lin)
{
    const MoeRoute &rt = p.rt;
    const long long nblk = p.nblk, total = rt.tiles[rt.E] * nblk;
    MoeTileAt at = {-1, 0, 0, 0};
    if (lin < total) {
        const long long e = rt.tile_expert[lin / nblk];
        const long long t0 = rt.tiles[e], mtc = rt.tiles[e + 1] - t0;
        const long long r = lin - t0 * nblk, mt = r % mtc;
        at.e = e;
        at.nb = r / mtc;
        at.first = rt.offs[e] + mt * BM;
        const long long count = rt.offs[e + 1] - at.first;
        at.count = count < BM ? count : BM;
    }
    return at;
}

/*
 * Fill t for tile `lin` (routed) or for this block (direct); all threads call
 * it. Returns false when there is no tile (the whole block agrees). Ends with
 * a barrier: t is then read-only until the caller's next barrier.
 */
template <int BM>
static __device__ bool moe_fetch_tile(const MoeGemm &p, long long lin, MoeTileSmem &t)
{
    const int tid = threadIdx.x;
    const MoeRoute &rt = p.rt;
    if (p.zero_cnt && blockIdx.x == 0 && blockIdx.y == 0 && lin == 0)
        for (long long i = tid; i < p.zero_cnt_n; i += blockDim.x) /* M <= 16 rows (direct) */
            p.zero_cnt[i] = 0u;
    if (rt.direct) {
        /* split depth: blocks nb * split .. nb * split + split - 1 share a tile; the first
         * of them does the tile's writes outside the product (zeroed rows) */
        const int split = p.split > 1 ? p.split : 1;
        const bool head = blockIdx.x % (unsigned)split == 0u;
        if (tid < 32) {
            const int lane = tid;
            long long e_l = -2; /* -2: no slot at this lane, -1: invalid slot */
            if (lane < rt.S)
                e_l = moe_slot_expert(rt, lane / rt.topk, lane % rt.topk);
            const unsigned same = __match_any_sync(0xFFFFFFFFu, e_l);
            const bool lead = e_l >= 0 && (same & ((1u << lane) - 1u)) == 0u;
            unsigned leaders = __ballot_sync(0xFFFFFFFFu, lead);
            const unsigned inval = __ballot_sync(0xFFFFFFFFu, e_l == -1);
            const unsigned valid = __ballot_sync(0xFFFFFFFFu, e_l >= 0);
            const int r = (int)blockIdx.y;
            long long e = -1;
            unsigned members = 0;
            if (__popc(leaders) > r) { /* warp-uniform */
                for (int i = 0; i < r; i++)
                    leaders &= leaders - 1u;
                e = __shfl_sync(0xFFFFFFFFu, e_l, __ffs(leaders) - 1);
                members = __ballot_sync(0xFFFFFFFFu, e_l == e);
            }
            for (int i = lane; i < BM; i += 32) {
                unsigned mm = members;
                for (int q = 0; q < i && mm; q++)
                    mm &= mm - 1u;
                long long ar = -1, orr = -1, m = -1;
                if (mm)
                    m = moe_row_offsets(p, (long long)(__ffs(mm) - 1), &ar, &orr);
                t.arow[i] = ar;
                t.orow[i] = orr;
                t.tok[i] = m;
                t.tokvalid[i] = m >= 0 ? __popc(valid & moe_token_bits(m, rt.topk)) : 0;
            }
            if (lane == 0) {
                unsigned ztok = 0u;
                if (p.fuse && r == 0 && head)
                    for (long long m = 0; m < rt.S / rt.topk; m++)
                        if ((valid & moe_token_bits(m, rt.topk)) == 0u)
                            ztok |= 1u << m;
                t.e = e;
                t.nb = blockIdx.x / (unsigned)split;
                t.count = __popc(members);
                t.first = 0;
                t.zero_mask = (p.zero_invalid && r == 0 && head) ? inval : 0u;
                t.zero_tok_mask = ztok;
                t.valid_mask = valid;
            }
        }
        __syncthreads();
        return t.e >= 0;
    }
    if (tid == 0) {
        const MoeTileAt at = moe_tile_at<BM>(p, lin);
        t.e = at.e;
        t.nb = at.nb;
        t.count = at.count;
        t.first = at.first;
        t.zero_mask = 0u;
        t.zero_tok_mask = 0u;
        t.valid_mask = 0u;
    }
    __syncthreads();
    if (t.e < 0)
        return false;
    for (int i = tid; i < BM; i += blockDim.x) {
        long long ar = -1, orr = -1, m = -1;
        if (i < t.count)
            m = moe_row_offsets(p, rt.list[t.first + i], &ar, &orr);
        t.arow[i] = ar;
        t.orow[i] = orr;
        t.tok[i] = m;
        t.tokvalid[i] = (m >= 0 && p.fuse) ? p.tok_valid[m] : 0;
    }
    __syncthreads();
    return true;
}

/*
 * Direct mode: zero this block's columns [c0, c0 + cols) of the rows of
 * invalid slots (h, un-reduced y) and, fused, of tokens without a valid slot.
 */
static __device__ void moe_zero_invalid(const MoeGemm &p, const MoeTileSmem &t, long long cols)
{
    const long long c0 = t.nb * cols;
    long long c1 = c0 + cols;
    c1 = c1 < p.ncols ? c1 : p.ncols;
    unsigned mask = t.zero_mask;
    while (mask) {
        const long long s = __ffs(mask) - 1;
        mask &= mask - 1u;
        long long ar, orr;
        moe_row_offsets(p, s, &ar, &orr);
        for (long long c = c0 + threadIdx.x; c < c1; c += blockDim.x)
            mfm_store(p.out, p.out_dt, orr + c, 0.0f);
    }
    mask = t.zero_tok_mask;
    while (mask) {
        const long long m = __ffs(mask) - 1;
        mask &= mask - 1u;
        for (long long c = c0 + threadIdx.x; c < c1; c += blockDim.x)
            mfm_store(p.rout, p.rout_dt, m * p.rout_s0 + c, 0.0f);
    }
}

/*
 * What the epilogue needs of the kernel parameter for one tile, copied out once:
 * the epilogue stores through generic pointers, after which the compiler
 * would load every field of p again for each element.
 */
struct MoeOut {
    void *out;
    const void *bias;
    long long bias_g, bias_u; /* element offsets of the tile's bias: gate / up value 0 (final: _g) */
    long long bias_step;      /* elements between the biases of columns c and c + 1 */
    long long ncols;
    int out_dt, bias_dt, act, vec;
    float alpha, limit, beta;
};

static __device__ __forceinline__ MoeOut moe_out_params(const MoeGemm &p, long long e)
{
    MoeOut o;
    o.out = p.out;
    o.bias = p.bias;
    o.bias_g = e * p.bias_s0 + p.gate_row; /* the final's gate_row is 0 */
    o.bias_u = e * p.bias_s0 + p.up_row;
    o.bias_step = p.row_step; /* the final's is 1 */
    o.ncols = p.ncols;
    o.out_dt = p.out_dt;
    o.bias_dt = p.bias_dt;
    o.act = p.act;
    o.vec = p.vec_out;
    o.alpha = p.alpha;
    o.limit = p.limit;
    o.beta = p.up_offset;
    return o;
}

/* Bias (if any) added to columns [c, c + N) (those below ncols), bias row at element b. */
template <int N>
static __device__ __forceinline__ void moe_add_bias_n(const MoeOut &o, long long b, long long c,
                                                      float (&v)[N])
{
    if (o.bias)
#pragma unroll
        for (int u = 0; u < N; u++)
            if (c + u < o.ncols)
                v[u] = __fadd_rn(v[u], mfm_load(o.bias, o.bias_dt, b + (c + u) * o.bias_step));
}

static __device__ __forceinline__ void moe_add_bias4(const MoeOut &o, long long b, long long c,
                                                     float (&v)[4])
{
    moe_add_bias_n<4>(o, b, c, v);
}

/*
 * Columns [c, c + N) (N = 2 or 4) of the output row at orow, each rounded
 * once; one store of N elements when the row is 4-element aligned (c is a
 * multiple of N) and all N are in range.
 */
template <int N>
static __device__ __forceinline__ void moe_store_n(const MoeOut &o, long long orow, long long c,
                                                   const float (&v)[N])
{
    static_assert(N == 2 || N == 4, "2 or 4 columns");
    const long long i = orow + c;
    if (o.vec && c + N <= o.ncols) {
        if (o.out_dt == MF_DT_F32) {
            if constexpr (N == 4)
                *(float4 *)((float *)o.out + i) = make_float4(v[0], v[1], v[2], v[3]);
            else
                *(float2 *)((float *)o.out + i) = make_float2(v[0], v[1]);
        } else {
            uint32_t h[N];
#pragma unroll
            for (int u = 0; u < N; u++)
                h[u] = o.out_dt == MF_DT_BF16 ? mf_f32_to_bf16(v[u]) : mf_f32_to_f16(v[u]);
            if constexpr (N == 4)
                *(uint2 *)((uint16_t *)o.out + i) =
                    make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
            else
                *(uint32_t *)((uint16_t *)o.out + i) = h[0] | (h[1] << 16);
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < N; u++)
        if (c + u < o.ncols)
            mfm_store(o.out, o.out_dt, i + u, v[u]);
}

static __device__ __forceinline__ void moe_store4(const MoeOut &o, long long orow, long long c,
                                                  const float (&v)[4])
{
    moe_store_n<4>(o, orow, c, v);
}

/* Final epilogue of one (slot, output column): bias, then y in f32 (reduced) or rounded. */
static __device__ __forceinline__ void moe_store_final(const MoeOut &o, long long orow,
                                                       long long col, float y)
{
    if (o.bias)
        y = __fadd_rn(y, mfm_load(o.bias, o.bias_dt, o.bias_g + col));
    mfm_store(o.out, o.out_dt, orow + col, y);
}

#endif /* MOEFUSE_CUDA_MOE_KERNELS_CUH */
