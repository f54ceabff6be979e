/*
 * The portable FP8 GEMM (any sm_80+): block dot products formed exactly, as the CPU backend
 * forms them (docs/NUMERICS.md "FP8 MoE"), so its h codes, scales and outputs are the CPU's
 * bit for bit.
 *
 * A block of 256 threads makes a tile of BM activation rows x BN weight rows (gate: 128 gate
 * rows and the 128 up rows of the same h columns, so one h group per tile, at rows gate_row +
 * c * row_step and up_row + c * row_step of h column c, the interleaved order's included;
 * final: 128 output columns). The depth goes by in stages of 32 codes: every thread fetches its 16-byte pieces
 * of the next stage into registers while the current one is multiplied, then decodes them
 * into integer counts of 2^-9 in shared memory (so each code is decoded once per tile, not
 * once per product). Each output keeps a 64-bit integer count of 2^-18 per 128-deep block
 * (products of counts < 2^36, 128 of them < 2^43: exact, in any order), converted to f32 once
 * at the block's end and added with fmaf(p_b, sa * sw, acc) in block order. NaN codes count 0
 * and leave a key per row block (fp8_nan_key) that names the NaN the reference would get.
 * Small BM (8) for decode: the tile is little more than the weights streaming through with
 * coalesced 16-byte loads.
 */
#include "cuda/fp8.cuh"
#include "cuda/moe_fp8.h"

#define FP8_THREADS 256
#define FP8_BK 32                   /* depth of a stage */
#define FP8_LD (FP8_BK + 4)         /* shared row pitch in ints: conflict-free 16-byte reads */
#define FP8_SPB (FP8_BLOCK / FP8_BK) /* stages per scale block */

template <int BM, int BN> struct Fp8Smem {
    int a[BM][FP8_LD];      /* activation counts of the stage */
    int b[BN][FP8_LD];      /* weight counts of the stage */
    int key_a[2][BM];       /* first-NaN keys of the current and the next scale block */
    int key_b[2][BN];
    long long arow[BM];     /* element offset of the row's codes, -1: padding row */
    long long orow[BM];     /* output row offset (h codes or y), -1: padding row */
    long long ascale[BM];   /* the row's scale row in A's scales */
    long long oscale[BM];   /* gate: the row's scale row in h's scales */
    long long wrow[BN];     /* element offset of each weight row */
    long long e, nb, count, first;
};

/* Weight row of tile column c of column block nb: gate, c < 128 the gate row and c >= 128 the
 * up row of h column nb * 128 + c % 128; final, output column nb * 128 + c. */
template <int GATE>
static __device__ __forceinline__ long long fp8_tile_row(const Fp8Gemm &p, long long nb, int c)
{
    if (!GATE)
        return nb * FP8_BLOCK + c;
    const long long hc = nb * FP8_BLOCK + (c & (FP8_BLOCK - 1));
    return (c < FP8_BLOCK ? p.gate_row : p.up_row) + hc * p.row_step;
}

/* Decode 16 codes into counts at dst; the smallest NaN key among them into *key. */
static __device__ __forceinline__ void fp8_decode16(uint4 v, int *dst, int k0, int weight,
                                                    int *key)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    int c[16];
    int kmin = FP8_NAN_NONE;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const uint32_t b = (w[i >> 2] >> ((i & 3) * 8)) & 0xFFu;
        c[i] = fp8_count(b);
        if (fp8_is_nan_code(b)) {
            const int kk = fp8_nan_key(k0 + i, weight, b);
            kmin = kk < kmin ? kk : kmin;
        }
    }
#pragma unroll
    for (int q = 0; q < 4; q++)
        *(int4 *)(dst + 4 * q) = make_int4(c[4 * q], c[4 * q + 1], c[4 * q + 2], c[4 * q + 3]);
    *key = kmin;
}

/*
 * The FP8 GEMM: BM rows x BN weight rows per tile, TM x TN outputs per thread (rows
 * ty * TM + i, columns tx + j * TX). GATE: BN = 256 and the epilogue quantizes h.
 */
template <int BM, int TM, int TN, int GATE>
__global__ void __launch_bounds__(FP8_THREADS) fp8_gemm_portable(const Fp8Gemm p)
{
    constexpr int BN = GATE ? 2 * FP8_BLOCK : FP8_BLOCK;
    constexpr int TX = BN / TN;
    static_assert((BM / TM) * TX == FP8_THREADS, "one output tile per block");
    static_assert(!GATE || TX == 32, "the gate's group amax is one warp's");
    constexpr int CHUNKS = 2 * (BM + BN); /* 16-byte pieces of a stage */
    constexpr int CPT = (CHUNKS + FP8_THREADS - 1) / FP8_THREADS;
    __shared__ __align__(16) Fp8Smem<BM, BN> sm;

    const int tid = (int)threadIdx.x, tx = tid % TX, ty = tid / TX;
    const long long nst = p.depth / FP8_BK;
    const long long mtiles = (p.tmax + BM - 1) / BM; /* masked */
    const long long bound =
        p.masked ? (long long)p.rt.E * mtiles * p.nblk : p.lin_bound;

    for (long long lin = blockIdx.x; lin < bound; lin += gridDim.x) {
        __syncthreads(); /* the previous tile is done with sm */
        if (tid == 0) {
            long long e = -1, nb = 0, first = 0, count = 0;
            if (p.masked) {
                e = lin / (mtiles * p.nblk);
                const long long r = lin - e * mtiles * p.nblk;
                nb = r / mtiles;
                first = (r - nb * mtiles) * BM;
                const long long n = fp8_masked_rows(p, e) - first;
                count = n < BM ? n : BM; /* <= 0: no valid row here */
            } else {
                fp8_routed_tile(p.rt, p.nblk, BM, lin, &e, &nb, &first, &count);
            }
            sm.e = e;
            sm.nb = nb;
            sm.count = count;
            sm.first = first;
        }
        __syncthreads();
        const long long e = sm.e, nb = sm.nb, count = sm.count, first = sm.first;
        if (e < 0)
            break; /* routed: past the last tile, and so are the later indices */
        if (count <= 0)
            continue; /* masked: rows past n[e] cost nothing */
        for (int i = tid; i < BM; i += FP8_THREADS) {
            long long ar = -1, orr = -1, as = 0, os = 0;
            if (i < count) {
                if (p.masked) {
                    const long long t = first + i;
                    ar = e * p.a_s0 + t * p.a_s1;
                    orr = e * p.o_s0 + t * p.o_s1;
                    as = os = t;
                } else {
                    const long long s = p.rt.list[first + i];
                    const long long m = s / p.rt.topk, j = s - m * p.rt.topk;
                    ar = m * p.a_s0 + j * p.a_s1;
                    orr = m * p.o_s0 + j * p.o_s1;
                    as = p.a_scale_slot ? s : m;
                    os = s;
                }
            }
            sm.arow[i] = ar;
            sm.orow[i] = orr;
            sm.ascale[i] = as;
            sm.oscale[i] = os;
        }
        for (int c = tid; c < BN; c += FP8_THREADS)
            sm.wrow[c] = e * p.w_s0 + fp8_tile_row<GATE>(p, nb, c) * p.w_s1;
        for (int i = tid; i < 2 * (BM + BN); i += FP8_THREADS) {
            if (i < 2 * BM)
                sm.key_a[i / BM][i % BM] = FP8_NAN_NONE;
            else
                sm.key_b[(i - 2 * BM) / BN][(i - 2 * BM) % BN] = FP8_NAN_NONE;
        }
        __syncthreads();

        /* stage st's pieces into registers (zeros for padding rows) */
        uint4 pre[CPT];
        auto fetch = [&](long long st) {
#pragma unroll
            for (int u = 0; u < CPT; u++) {
                const int c = tid + u * FP8_THREADS;
                pre[u] = make_uint4(0u, 0u, 0u, 0u);
                if (c >= CHUNKS)
                    continue;
                const long long d = st * FP8_BK + (c & 1) * 16;
                if (c < 2 * BM) {
                    const long long ar = sm.arow[c >> 1];
                    if (ar >= 0)
                        pre[u] = fp8_load16(p.a + ar + d, p.vec_a);
                } else {
                    pre[u] = fp8_load16(p.w + sm.wrow[(c - 2 * BM) >> 1] + d, p.vec_w);
                }
            }
        };
        /* decode the registers into sm; NaN keys into the stage's scale block's slot */
        auto put = [&](long long st) {
            const int par = (int)((st / FP8_SPB) & 1), k0 = (int)(st % FP8_SPB) * FP8_BK;
#pragma unroll
            for (int u = 0; u < CPT; u++) {
                const int c = tid + u * FP8_THREADS;
                if (c >= CHUNKS)
                    continue;
                const int half = c & 1;
                int key;
                if (c < 2 * BM) {
                    const int r = c >> 1;
                    fp8_decode16(pre[u], &sm.a[r][half * 16], k0 + half * 16, 0, &key);
                    if (key != FP8_NAN_NONE)
                        atomicMin(&sm.key_a[par][r], key);
                } else {
                    const int r = (c - 2 * BM) >> 1;
                    fp8_decode16(pre[u], &sm.b[r][half * 16], k0 + half * 16, 1, &key);
                    if (key != FP8_NAN_NONE)
                        atomicMin(&sm.key_b[par][r], key);
                }
            }
        };

        long long acc[TM][TN];
        float facc[TM][TN];
#pragma unroll
        for (int i = 0; i < TM; i++)
#pragma unroll
            for (int j = 0; j < TN; j++) {
                acc[i][j] = 0;
                facc[i][j] = 0.0f;
            }
        fetch(0);
        put(0);
        __syncthreads();
        const long long ae = p.masked ? e : 0; /* expert block of A's (and h's) scales */
        for (long long st = 0; st < nst; st++) {
            if (st + 1 < nst)
                fetch(st + 1); /* in flight during the products */
#pragma unroll
            for (int k4 = 0; k4 < FP8_BK; k4 += 4) {
                int4 av[TM], bv[TN];
#pragma unroll
                for (int i = 0; i < TM; i++)
                    av[i] = *(const int4 *)&sm.a[ty * TM + i][k4];
#pragma unroll
                for (int j = 0; j < TN; j++)
                    bv[j] = *(const int4 *)&sm.b[tx + j * TX][k4];
#pragma unroll
                for (int i = 0; i < TM; i++)
#pragma unroll
                    for (int j = 0; j < TN; j++)
                        acc[i][j] += (long long)av[i].x * bv[j].x + (long long)av[i].y * bv[j].y +
                                     (long long)av[i].z * bv[j].z + (long long)av[i].w * bv[j].w;
            }
            if ((st + 1) % FP8_SPB == 0) { /* the end of scale block b: p_b into the sums */
                const long long b = st / FP8_SPB;
                const int par = (int)(b & 1);
                float sa[TM], sw[TN];
#pragma unroll
                for (int i = 0; i < TM; i++) {
                    const int r = ty * TM + i;
                    sa[i] = sm.arow[r] >= 0 ? fp8_act_scale(p.as, ae, sm.ascale[r], b) : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < TN; j++) /* the scale block of the column's weight row */
                    sw[j] = fp8_w_scale(p.ws, e, fp8_tile_row<GATE>(p, nb, tx + j * TX) / FP8_BLOCK, b);
#pragma unroll
                for (int i = 0; i < TM; i++)
#pragma unroll
                    for (int j = 0; j < TN; j++) {
                        const int ka = sm.key_a[par][ty * TM + i];
                        const int kb = sm.key_b[par][tx + j * TX];
                        const float pb = fp8_block_sum(acc[i][j], ka < kb ? ka : kb);
                        facc[i][j] = fp8_fma(pb, fp8_scale_mul(sa[i], sw[j]), facc[i][j]);
                        acc[i][j] = 0;
                    }
            }
            __syncthreads(); /* sm.a / sm.b and this block's keys are read */
            if (st + 1 < nst) {
                const long long nb1 = (st + 1) / FP8_SPB;
                if ((st + 1) % FP8_SPB == 0) /* the keys of block nb1 + 1, last read for nb1 - 1 */
                    for (int i = tid; i < BM + BN; i += FP8_THREADS) {
                        if (i < BM)
                            sm.key_a[(nb1 + 1) & 1][i] = FP8_NAN_NONE;
                        else
                            sm.key_b[(nb1 + 1) & 1][i - BM] = FP8_NAN_NONE;
                    }
                put(st + 1);
            }
            __syncthreads();
        }

        /* epilogue */
        if constexpr (GATE) {
            const Fp8HOut &ho = p.h;
#pragma unroll
            for (int i = 0; i < TM; i++) {
                const int r = ty * TM + i;
                const long long orow = sm.orow[r];
                float hv[4];
                float amax = 0.0f;
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    const long long hc = nb * FP8_BLOCK + tx + jj * TX;
                    float g = facc[i][jj], u = facc[i][jj + 4];
                    if (p.bias) {
                        const long long b0 = e * p.bias_s0 + hc * p.row_step;
                        g = fp8_add(g, mfm_load(p.bias, p.bias_dt, b0 + p.gate_row));
                        u = fp8_add(u, mfm_load(p.bias, p.bias_dt, b0 + p.up_row));
                    }
                    hv[jj] = mfm_gated(p.act, p.alpha, p.limit, p.up_offset, g, u);
                    const float a = fabsf(hv[jj]);
                    amax = (mf_is_finite(hv[jj]) && a > amax) ? a : amax;
                }
                /* the group's 128 columns are this warp's (TX = 32 lanes x 4) */
#pragma unroll
                for (int off = 16; off > 0; off >>= 1)
                    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
                if (orow < 0)
                    continue; /* padding row (warp-uniform: the warp shares r) */
                uint32_t ue;
                const float s = fp8_group_scale(amax, ho.eps, ho.ue8m0, &ue);
#pragma unroll
                for (int jj = 0; jj < 4; jj++)
                    ho.q[orow + nb * FP8_BLOCK + tx + jj * TX] = (uint8_t)fp8_code(hv[jj], s);
                if (tx == 0) {
                    fp8_put_scale(ho, ae, sm.oscale[r], nb, s, ue);
                    if (nb == p.nblk - 1)
                        fp8_put_scale_tail(ho, ae, sm.oscale[r]);
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < TM; i++) {
                const long long orow = sm.orow[ty * TM + i];
                if (orow < 0)
                    continue;
#pragma unroll
                for (int j = 0; j < TN; j++) {
                    const long long col = nb * FP8_BLOCK + tx + j * TX;
                    float y = facc[i][j];
                    if (p.bias)
                        y = fp8_add(y, mfm_load(p.bias, p.bias_dt, e * p.bias_s0 + col));
                    if (p.epi == FP8_EPI_Y_F32)
                        ((float *)p.out)[orow + col] = y;
                    else
                        mfm_store(p.out, p.out_dt, orow + col, y);
                }
            }
        }
    }
}

/*
 * The gate's rows that no tile writes: codes 0 and scale bytes 0 for the invalid slots
 * (routed; rt.ids non-NULL), and the scales' padding rows rows..rows_padded-1 of each of the
 * `blocks` expert blocks (column-major and packed layouts). A warp per row.
 */
__global__ void __launch_bounds__(256) fp8_gate_fill(MoeRoute rt, uint8_t *q, long long q_s0,
                                                     long long q_s1, long long width, Fp8HOut h,
                                                     long long rows, long long rows_padded,
                                                     long long blocks)
{
    const long long slots = rt.ids ? rt.S : 0, pad = rows_padded - rows;
    const long long items = slots + blocks * pad;
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    const long long g_all = h.sc.layout == MF_LAYOUT_PACKED ? (h.groups + 3) / 4 * 4 : h.groups;
    for (long long it = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; it < items;
         it += warps) {
        long long e = 0, t;
        if (it < slots) {
            const long long m = it / rt.topk, j = it - m * rt.topk;
            if (moe_slot_expert(rt, m, j) >= 0)
                continue; /* warp-uniform */
            t = it;
            for (long long c = lane; c < width; c += 32)
                q[m * q_s0 + j * q_s1 + c] = 0u;
        } else {
            const long long r = it - slots;
            e = r / pad;
            t = rows + (r - e * pad);
        }
        for (long long g = lane; g < g_all; g += 32) {
            const int64_t i = fp8_act_scale_index(h.sc, e, t, g);
            if (h.sc.layout == MF_LAYOUT_PACKED || h.sc.u8)
                ((uint8_t *)h.sc.p)[i] = 0u;
            else
                ((float *)h.sc.p)[i] = 0.0f;
        }
    }
}

/* ------------------------------------------------------------- launchers */

template <int BM, int TM, int TN, int GATE>
static moefuse_status launch_cfg(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const Fp8Gemm *p, long long tiles)
{
    const long long cap = (long long)s->sm_count * 8;
    const unsigned grid = (unsigned)(tiles < 1 ? 1 : (tiles < cap ? tiles : cap));
    fp8_gemm_portable<BM, TM, TN, GATE><<<grid, FP8_THREADS, 0, s->stream>>>(*p);
    return mf_cuda_launched(ctx, op, "fp8_gemm_portable");
}

extern "C" moefuse_status fp8_launch_portable(moefuse_context *ctx, cuda_state *s, const char *op,
                                              int bm, int gate, const Fp8Gemm *p)
{
    const long long mt = (p->tmax + bm - 1) / bm;
    const long long tiles = p->masked ? (long long)p->rt.E * mt * p->nblk : p->lin_bound;
    if (gate)
        return bm == 8 ? launch_cfg<8, 1, 8, 1>(ctx, s, op, p, tiles)
                       : launch_cfg<32, 4, 8, 1>(ctx, s, op, p, tiles);
    return bm == 8    ? launch_cfg<8, 1, 4, 0>(ctx, s, op, p, tiles)
           : bm == 32 ? launch_cfg<32, 4, 4, 0>(ctx, s, op, p, tiles)
                      : launch_cfg<64, 8, 4, 0>(ctx, s, op, p, tiles);
}

extern "C" moefuse_status fp8_launch_gate_fill(moefuse_context *ctx, cuda_state *s,
                                               const char *op, const MoeRoute *rt,
                                               const moefuse_tensor *hq, const Fp8HOut *h,
                                               long long rows, long long rows_padded,
                                               long long blocks)
{
    const long long items = (rt->ids ? rt->S : 0) + blocks * (rows_padded - rows);
    if (items <= 0)
        return MOEFUSE_OK;
    const unsigned grid = mf_cuda_grid(s, items, 8, 8);
    fp8_gate_fill<<<grid, 256, 0, s->stream>>>(*rt, (uint8_t *)mf_cuda_base(hq), hq->stride[0],
                                               hq->stride[1], hq->shape[2], *h, rows,
                                               rows_padded, blocks);
    return mf_cuda_launched(ctx, op, "fp8_gate_fill");
}
