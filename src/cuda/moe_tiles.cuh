/*
 * Staging of GEMM operands shared by the tensor-core kernels (moe_mma.cu,
 * moe_wgmma.cu; moe_ws.cu takes the epilogue helpers and the fused
 * reduction): cp.async copies into 128-byte shared-memory rows with the
 * 128-byte XOR swizzle (the layout wgmma reads and ldmatrix reads without
 * bank conflicts), and the epilogue that turns the block's f32 tile into h
 * or y. 2-byte elements (bf16 / f16) only.
 */
#ifndef MOEFUSE_CUDA_MOE_TILES_CUH
#define MOEFUSE_CUDA_MOE_TILES_CUH

#include "cuda/moe_kernels.cuh"

static __device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte copy global -> shared; bytes < 16 reads only that many and zero-fills the rest. */
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, int bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}

/* 4-byte copy global -> shared; bytes 0 writes a zero instead (src is then not read). */
static __device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N> static __device__ __forceinline__ void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

static __device__ __forceinline__ void st_shared16(uint32_t dst, uint4 v)
{
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

/*
 * Slow path for rows whose start or stride is not 16-byte aligned: the eight
 * 2-byte elements [kcol, kcol + 8) of a row, those at or past `rem` (and all
 * of a NULL row) as zero.
 */
static __device__ __forceinline__ uint4 load8(const char *row, long long kcol, long long rem)
{
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (row) {
        const uint16_t *q = (const uint16_t *)row + kcol;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < rem)
                v[i / 2] |= (uint32_t)__ldg(q + i) << (16 * (i % 2));
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}


/*
 * Copies depth tile kt of the block's BM A rows (activations of its slots)
 * and BN B rows (weight rows) into one stage: A rows first, then B rows, 128
 * bytes each, chunk c of row r at chunk c ^ (r & 7). Thread tid copies chunk
 * tid % 8 of rows tid / 8 + i * THREADS / 8. Rows past the tile or the matrix,
 * and depth past the row, become zeros (cp.async zero-fill: no global read).
 * GATE: B rows come in groups of WTN, the first WTN / 2 the gate rows of h
 * columns nb * BN / 2 + g * WTN / 2 + q, the next WTN / 2 their up rows, so
 * that one warp (mma) or one thread (wgmma) holds both halves of a column.
 */
template <int BM, int BN, int THREADS, int WTN, bool GATE> struct MoeStageLoader {
    static constexpr int ROWSTEP = THREADS / 8, CA = BM / ROWSTEP, CB = BN / ROWSTEP;
    static_assert(BM % ROWSTEP == 0 && BN % ROWSTEP == 0 && ROWSTEP % 8 == 0, "loader shape");
    static_assert(!GATE || (BN % WTN == 0 && WTN % 16 == 0), "gate groups");
    const char *arow[CA];
    const char *brow[CB];
    uint32_t dst; /* this thread's chunk in a stage */
    int chunk;

    __device__ __forceinline__ void init(const MoeGemm &p, const MoeTileSmem &t)
    {
        const int crow = threadIdx.x >> 3;
        chunk = threadIdx.x & 7;
        dst = (uint32_t)crow * 128u + (uint32_t)((chunk ^ (crow & 7)) << 4);
#pragma unroll
        for (int i = 0; i < CA; i++) {
            const long long off = t.arow[crow + i * ROWSTEP];
            arow[i] = off >= 0 ? (const char *)p.a + off * 2 : nullptr;
        }
#pragma unroll
        for (int i = 0; i < CB; i++) {
            const int r = crow + i * ROWSTEP;
            long long col, wrow;
            if (GATE) {
                const int q = r % WTN;
                col = t.nb * (BN / 2) + (r / WTN) * (WTN / 2) + q % (WTN / 2);
                wrow = (q < WTN / 2 ? p.gate_row : p.up_row) + col * p.row_step;
            } else {
                col = t.nb * BN + r;
                wrow = col;
            }
            brow[i] = col < p.ncols ? (const char *)p.w + (t.e * p.w_s0 + wrow * p.w_s1) * 2
                                    : nullptr;
        }
    }

    /* stage: shared-memory address of the stage (A rows, then B rows) */
    __device__ __forceinline__ void load(const MoeGemm &p, uint32_t stage, long long kt) const
    {
        load_a(p, stage, kt);
        load_b(p, stage, kt);
    }

    /* The A rows (activations) of depth tile kt. */
    __device__ __forceinline__ void load_a(const MoeGemm &p, uint32_t stage, long long kt) const
    {
        const uint32_t sa = stage + dst;
        const long long kcol = kt * MOE_BK + chunk * 8, rem = p.depth - kcol;
        const int bytes = rem >= 8 ? 16 : (rem > 0 ? (int)rem * 2 : 0);
        if (p.vec_a) { /* the usual case, one uniform branch: only cp.async */
            const long long koff = kcol * 2;
#pragma unroll
            for (int i = 0; i < CA; i++)
                cp_async16(sa + (uint32_t)(i * ROWSTEP * 128),
                           arow[i] && bytes ? arow[i] + koff : (const char *)p.a,
                           arow[i] ? bytes : 0);
            return;
        }
#pragma unroll
        for (int i = 0; i < CA; i++)
            st_shared16(sa + (uint32_t)(i * ROWSTEP * 128), load8(arow[i], kcol, rem));
    }

    /* The B rows (weights) of depth tile kt. */
    __device__ __forceinline__ void load_b(const MoeGemm &p, uint32_t stage, long long kt) const
    {
        const uint32_t sb = stage + dst + (uint32_t)(BM * 128);
        const long long kcol = kt * MOE_BK + chunk * 8, rem = p.depth - kcol;
        const int bytes = rem >= 8 ? 16 : (rem > 0 ? (int)rem * 2 : 0);
        if (p.vec_b) {
            const long long koff = kcol * 2;
#pragma unroll
            for (int i = 0; i < CB; i++)
                cp_async16(sb + (uint32_t)(i * ROWSTEP * 128),
                           brow[i] && bytes ? brow[i] + koff : (const char *)p.w,
                           brow[i] ? bytes : 0);
            return;
        }
#pragma unroll
        for (int i = 0; i < CB; i++)
            st_shared16(sb + (uint32_t)(i * ROWSTEP * 128), load8(brow[i], kcol, rem));
    }
};

/*
 * Epilogue from the block's f32 tile cs [BM][CST] (column c = B row c of the
 * stage) after a barrier: each thread takes 4 consecutive output columns
 * (four independent activations, one wide store), consecutive threads the
 * next four. CST and the gate groups are multiples of 4, so the reads of cs
 * are 16-byte aligned. Out of line: its registers stay out of the main loop's.
 */
template <int BM, int BN, int THREADS, int WTN, int CST, bool GATE>
static __device__ __noinline__ void moe_epilogue(const MoeGemm &p, const MoeTileSmem &t,
                                                 const float *cs)
{
    constexpr int NC = GATE ? BN / 2 : BN; /* output columns of the tile */
    constexpr int NQ = NC / 4;
    static_assert(CST % 4 == 0 && (!GATE || (WTN / 2) % 4 == 0) && NC % 4 == 0, "quads");
    const MoeOut o = moe_out_params(p, t.e);
    const long long c0 = t.nb * NC;
    const uint32_t tabs = (uint32_t)__cvta_generic_to_shared(t.exp_tab);
    for (int idx = threadIdx.x; idx < BM * NQ; idx += THREADS) {
        const int r = idx / NQ, l = (idx % NQ) * 4;
        const long long orow = t.orow[r], c = c0 + l;
        if (orow < 0 || c >= o.ncols)
            continue;
        float v[4];
        if (GATE) {
            /* h column l of the block: gate in tile column (l / (WTN/2)) * WTN + l % (WTN/2),
             * up WTN / 2 further */
            const float *cr = cs + r * CST + (l / (WTN / 2)) * WTN + l % (WTN / 2);
            const float4 g4 = *(const float4 *)cr, u4 = *(const float4 *)(cr + WTN / 2);
            float g[4] = {g4.x, g4.y, g4.z, g4.w}, u[4] = {u4.x, u4.y, u4.z, u4.w};
            moe_add_bias4(o, o.bias_g, c, g);
            moe_add_bias4(o, o.bias_u, c, u);
#pragma unroll
            for (int q = 0; q < 4; q++)
                v[q] = mfm_gated_tab(o.act, o.alpha, o.limit, o.beta, g[q], u[q], tabs);
        } else {
            const float4 y4 = *(const float4 *)(cs + r * CST + l);
            v[0] = y4.x, v[1] = y4.y, v[2] = y4.z, v[3] = y4.w;
            moe_add_bias4(o, o.bias_g, c, v);
        }
        moe_store4(o, orow, c, v);
    }
}

/*
 * Barrier of the threads that run a tile's epilogue: the whole block (BAR 0),
 * or named barrier BAR among THREADS threads (the consumer warpgroups of a
 * warp-specialised kernel, whose producer warps must not be waited for).
 */
template <int BAR, int THREADS> static __device__ __forceinline__ void moe_sync(void)
{
    if constexpr (BAR == 0)
        __syncthreads();
    else
        asm volatile("bar.sync %0, %1;\n" ::"n"(BAR), "n"(THREADS) : "memory");
}

/* What the fused reduction needs of p, copied out once (see MoeOut). */
struct MoeRed {
    const float *y, *tw;
    const int *expert_of; /* NULL in direct mode: the block's slot mask says */
    void *rout;
    long long k, K, tw_s0, rout_s0;
    int rout_dt;
    unsigned mask;
};

/* Whether slot (m, j) of a token the fused reduction sums is valid. */
static __device__ __forceinline__ bool moe_reduce_valid(const MoeRed &q, long long m, long long j)
{
    return q.expert_of ? q.expert_of[m * q.k + j] >= 0 : ((q.mask >> (m * q.k + j)) & 1u) != 0u;
}

/*
 * The sums of the fused reduction without shared memory (sm_floats = 0): for
 * a kernel whose shared memory is busy with its producer's stages. A thread
 * takes 4 columns of RED_ITEMS (token, column quad) items at a time and
 * loads all their k rows (16 bytes each, through L2) before it adds any, so
 * that RED_ITEMS * k loads a thread are in flight; the sums keep the order
 * j = 0..k-1 (the registers the accumulators left are plenty at this point).
 */
#define RED_ITEMS 2
#define RED_KB 8 /* slots loaded per batch; k > RED_KB takes several batches, in order */
template <int THREADS>
static __device__ __forceinline__ void moe_reduce_direct(const MoeRed &q, const MoeTileSmem &t,
                                                         int n, long long c0, int width, int tid)
{
    const long long k = q.k, K = q.K;
    const bool vec = (K & 3) == 0; /* every row piece 16-byte aligned (c0 is a multiple of 4) */
    const long long quads = (width + 3) / 4, items = (long long)n * quads;
    for (long long it0 = tid; it0 < items; it0 += (long long)THREADS * RED_ITEMS) {
        long long m[RED_ITEMS], c[RED_ITEMS];
        float acc[RED_ITEMS][4];
#pragma unroll
        for (int u = 0; u < RED_ITEMS; u++) {
            const long long it = it0 + (long long)u * THREADS;
            m[u] = it < items ? t.last[it / quads] : -1;
            c[u] = c0 + 4 * (it % quads);
#pragma unroll
            for (int x = 0; x < 4; x++)
                acc[u][x] = 0.0f;
        }
        for (long long j0 = 0; j0 < k; j0 += RED_KB) {
            float4 yv[RED_ITEMS][RED_KB];
            float w[RED_ITEMS][RED_KB];
            bool ok[RED_ITEMS][RED_KB];
#pragma unroll
            for (int u = 0; u < RED_ITEMS; u++)
#pragma unroll
                for (int b = 0; b < RED_KB; b++) {
                    const long long j = j0 + b;
                    ok[u][b] = m[u] >= 0 && j < k && moe_reduce_valid(q, m[u], j);
                    w[u][b] = ok[u][b] ? q.tw[m[u] * q.tw_s0 + j] : 0.0f;
                    yv[u][b] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (!ok[u][b])
                        continue;
                    const float *row = q.y + (m[u] * k + j) * K + c[u];
                    if (vec && c[u] + 4 <= K) {
                        yv[u][b] = __ldcg((const float4 *)row);
                    } else {
                        float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        for (int x = 0; x < 4 && c[u] + x < K; x++)
                            e[x] = __ldcg(row + x);
                        yv[u][b] = make_float4(e[0], e[1], e[2], e[3]);
                    }
                }
#pragma unroll
            for (int u = 0; u < RED_ITEMS; u++)
#pragma unroll
                for (int b = 0; b < RED_KB; b++) {
                    if (!ok[u][b])
                        continue; /* an invalid slot adds nothing, not even a signed zero */
                    acc[u][0] = __fadd_rn(acc[u][0], __fmul_rn(w[u][b], yv[u][b].x));
                    acc[u][1] = __fadd_rn(acc[u][1], __fmul_rn(w[u][b], yv[u][b].y));
                    acc[u][2] = __fadd_rn(acc[u][2], __fmul_rn(w[u][b], yv[u][b].z));
                    acc[u][3] = __fadd_rn(acc[u][3], __fmul_rn(w[u][b], yv[u][b].w));
                }
        }
#pragma unroll
        for (int u = 0; u < RED_ITEMS; u++) {
            if (m[u] < 0)
                continue;
            for (int x = 0; x < 4 && c[u] + x < c0 + width; x++)
                mfm_store(q.rout, q.rout_dt, m[u] * q.rout_s0 + c[u] + x, acc[u][x]);
        }
    }
}

/*
 * Fused top-k reduction, after the block wrote its y rows (f32, p.out, row of
 * slot s at s * K) for columns [c0, c0 + cols). Each row counts one arrival
 * for its (token, column block); the block that brings the last one sums the
 * token's k rows there in slot order j = 0..k-1 (invalid slots skipped: no
 * router weight read) and writes out[m] rounded once. Which block does it
 * changes nothing: the sum reads the same f32 values in the same order.
 * Fences: each writer's y stores are visible device-wide before its barrier
 * and the counting atomics; the summing block fences again, then reads the
 * other blocks' rows through L2 (cp.async.cg / __ldcg).
 * The reads are all in flight at once: per group of tokens, validity and
 * weights, then the k row pieces by cp.async into sm (sm_floats floats of
 * free shared memory, 16-byte aligned), one wait, then the ordered sums;
 * with sm NULL, straight into registers (moe_reduce_direct).
 * Run by THREADS threads, threadIdx.x FIRST onwards, that meet at moe_sync<BAR>.
 * Out of line: once per tile, and it keeps its registers out of the main loop's.
 */
template <int BM, int THREADS, int BAR = 0, int FIRST = 0>
static __device__ __noinline__ void moe_fused_reduce(const MoeGemm &p, MoeTileSmem &t,
                                                     long long cols, float *sm, int sm_floats)
{
    const int tid = (int)threadIdx.x - FIRST;
    __threadfence();
    if (tid == 0)
        t.nlast = 0;
    moe_sync<BAR, THREADS>();
    for (int r = tid; r < BM; r += THREADS) { /* rows past BM are not the tile's */
        if (t.orow[r] < 0)
            continue;
        const long long m = t.tok[r];
        const unsigned old = atomicAdd(p.cnt + m * p.nblk + t.nb, 1u);
        if ((int)old == t.tokvalid[r] - 1)
            t.last[atomicAdd(&t.nlast, 1)] = m;
    }
    moe_sync<BAR, THREADS>();
    const int n = t.nlast;
    if (n == 0)
        return;
    __threadfence();
    MoeRed q;
    q.y = (const float *)p.out;
    q.tw = p.tw;
    q.expert_of = p.rt.direct ? nullptr : p.expert_of;
    q.rout = p.rout;
    q.k = p.rt.topk;
    q.K = p.ncols;
    q.tw_s0 = p.tw_s0;
    q.rout_s0 = p.rout_s0;
    q.rout_dt = p.rout_dt;
    q.mask = t.valid_mask;
    const long long k = q.k, K = q.K, c0 = t.nb * cols;
    const int width = (int)(c0 + cols < K ? cols : K - c0);
    const int ws = (width + 3) & ~3; /* floats per staged row piece: whole 16-byte chunks */
    const float *y = q.y;
    /* per token: k weights, k validity words, k row pieces (+ 3 floats to align the pieces) */
    const long long per_tok = k * (2 + (long long)ws);
    if (!sm) {
        moe_reduce_direct<THREADS>(q, t, n, c0, width, tid);
        return;
    }
    const int G = per_tok + 4 <= sm_floats ? (int)((sm_floats - 4) / per_tok) : 0;
    if (G == 0) { /* k too large to stage: direct loads (correct, slow; not a model shape) */
        for (long long it = tid; it < (long long)n * width; it += THREADS) {
            const long long m = t.last[it / width], c = c0 + it % width;
            float acc = 0.0f;
            for (long long j = 0; j < k; j++)
                if (moe_reduce_valid(q, m, j))
                    acc = __fadd_rn(acc, __fmul_rn(q.tw[m * q.tw_s0 + j],
                                                   __ldcg(y + (m * k + j) * K + c)));
            mfm_store(q.rout, q.rout_dt, m * q.rout_s0 + c, acc);
        }
        return;
    }
    const bool vec = (K & 3) == 0; /* row pieces 16-byte aligned: c0 is a multiple of 4 */
    const int kk = (int)k, chunks = ws / 4, warp = tid >> 5, lane = tid & 31;
    for (int g0 = 0; g0 < n; g0 += G) {
        const int g = n - g0 < G ? n - g0 : G, gk = g * kk; /* gk * (2 + ws) <= sm_floats */
        float *wsm = sm;                           /* [gk] weights */
        unsigned *vsm = (unsigned *)(sm + gk);     /* [gk] validity */
        float *ysm = sm + ((2 * gk + 3) & ~3);     /* [gk][ws] row pieces */
        for (int i = tid; i < gk; i += THREADS) {
            const int tl = i / kk, j = i - tl * kk;
            const long long m = t.last[g0 + tl];
            const bool v = moe_reduce_valid(q, m, j);
            vsm[i] = v;
            wsm[i] = v ? q.tw[m * q.tw_s0 + j] : 0.0f;
        }
        moe_sync<BAR, THREADS>();
        /* a warp per row piece, its lanes over the 16-byte chunks: every copy in flight */
        for (int row = warp; row < gk; row += THREADS / 32) {
            if (!vsm[row])
                continue; /* warp-uniform */
            const int tl = row / kk, j = row - tl * kk;
            const float *src = y + (t.last[g0 + tl] * k + j) * K + c0;
            float *dst = ysm + (long long)row * ws;
            for (int ch = lane; ch < chunks; ch += 32) {
                const int left = width - ch * 4;
                if (vec) {
                    cp_async16(smem_u32(dst + ch * 4), src + ch * 4, left >= 4 ? 16 : left * 4);
                } else {
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        dst[ch * 4 + u] = u < left ? __ldcg(src + ch * 4 + u) : 0.0f;
                }
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        moe_sync<BAR, THREADS>();
        for (int tl = 0; tl < g; tl++) {
            const long long m = t.last[g0 + tl];
            const unsigned *vt = vsm + tl * kk;
            const float *wt = wsm + tl * kk, *yt = ysm + (long long)tl * kk * ws;
            for (int c = tid; c < width; c += THREADS) {
                float acc = 0.0f;
                for (int j = 0; j < kk; j++)
                    if (vt[j])
                        acc = __fadd_rn(acc, __fmul_rn(wt[j], yt[j * ws + c]));
                mfm_store(q.rout, q.rout_dt, m * q.rout_s0 + c0 + c, acc);
            }
        }
        moe_sync<BAR, THREADS>(); /* the next group reuses sm */
    }
}

#endif /* MOEFUSE_CUDA_MOE_TILES_CUH */
