/*
 * The FP8 decode GEMM's tile lookup and its producer warp (moe_fp8_decode.cu, which includes
 * this file after its configuration and primitives): which expert and rows an item is, and the
 * stages of weight boxes and activation rows that feed the ring. sm_90a device code only.
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_DECODE_PRODUCER_CUH
#define MOEFUSE_CUDA_MOE_FP8_DECODE_PRODUCER_CUH

/* ------------------------------------------------------------- the tile */

/*
 * Tile ti, as a warp finds it: its expert (and the expert block of the scale views), its rows,
 * and lane's row (lane < count): a slot s = m * k + j (routed, direct) or a row t (masked).
 */
static __device__ __forceinline__ int dec_tile(const Fp8Gemm &g, const Fp8DecExtra &x,
                                               const DecDirect &dd, long long ti, int lane,
                                               long long *e, long long *row)
{
    int count;
    *row = 0;
    if (x.mode == DEC_DIRECT) {
        unsigned m = dd.mask[ti];
        *e = dd.e[ti];
        count = __popc(m);
        for (int i = 0; i < lane && m; i++)
            m &= m - 1u; /* the lane-th slot of the expert */
        *row = m ? __ffs(m) - 1 : 0;
    } else if (x.mode == DEC_ROUTED) {
        /* past L1: the route kernel wrote it while this grid may already have run (PDL) */
        const longlong2 t = __ldcg((const longlong2 *)(x.tiles + ti));
        *e = (int)(t.y & 0xFFFFFFFFll);
        count = (int)(t.y >> 32);
        if (lane < count)
            *row = __ldcg(x.list + t.x + lane);
    } else {
        /* chunk-major: the first chunks of all experts (usually the only ones with rows) lie
         * side by side, so the clusters' stride deals them out evenly */
        const long long chunks = (g.tmax + DEC_NS - 1) / DEC_NS, experts = x.tiles_bound / chunks;
        const long long ee = ti % experts, t0 = (ti / experts) * DEC_NS;
        const long long n = fp8_masked_rows(g, ee) - t0;
        *e = ee;
        count = n <= 0 ? 0 : (n < DEC_NS ? (int)n : DEC_NS);
        *row = t0 + lane;
    }
    return count;
}

/* The activation row of row s of expert e: element offset (codes, or x's elements). */
static __device__ __forceinline__ long long dec_arow(const Fp8Gemm &g, long long s, long long e)
{
    if (g.masked)
        return e * g.a_s0 + s * g.a_s1;
    const long long m = s / g.rt.topk, j = s - m * g.rt.topk;
    return m * g.a_s0 + j * g.a_s1;
}

/* Consumer warp 0: the tile's rows for the consumers' scales and epilogues. */
static __device__ __forceinline__ void dec_rows(const Fp8Gemm &g, DecTileSmem &ts, int count,
                                                long long e, long long s, int lane)
{
    if (lane == 0) {
        ts.e = e;
        ts.blk = g.masked ? e : 0;
        ts.count = count;
    }
    if (lane >= count)
        return;
    if (g.masked) {
        ts.srow[lane] = s;
        ts.orow[lane] = e * g.o_s0 + s * g.o_s1;
        ts.hrow[lane] = s;
        return;
    }
    const long long m = s / g.rt.topk, j = s - m * g.rt.topk;
    ts.srow[lane] = g.a_scale_slot ? s : m;
    ts.orow[lane] = m * g.o_s0 + j * g.o_s1;
    ts.hrow[lane] = s;
}

/* ------------------------------------------------------------- producer */

/* The first weight row of half f (gate: gate / up rows) of column block nb. */
template <int GATE>
static __device__ __forceinline__ int dec_wrow(const Fp8Gemm &g, int f, long long nb)
{
    return (int)((GATE ? (f == 0 ? g.gate_row : g.up_row) : 0) + nb * 128);
}

/* Stage of depth block b, its weight rows: by tensor copies completing `full` (announced there
 * first), or through the warp's registers. */
template <int GATE>
static __device__ __forceinline__ void dec_produce_weights(const CUtensorMap *map, const Fp8Gemm &g,
                                                           const Fp8DecExtra &x, char *stage,
                                                           uint32_t full, long long e,
                                                           long long nb, long long b, int lane,
                                                           uint64_t policy)
{
    using C = DecCfg<GATE>;
    if (x.w_map) {
        if (lane == 0) {
            hp_mbar_expect_tx(full, C::ROWS * FP8_BLOCK);
            /* one tensor copy per 128 rows: small bulk copies (one per row) are issued far
             * slower than DRAM delivers them */
#pragma unroll
            for (int f = 0; f < C::FRAGS; f++)
                hp_tma_load_3d_hint(dec_smem(stage + f * DEC_BOX_ROWS * FP8_BLOCK), map, full,
                                    (int)(b * FP8_BLOCK), dec_wrow<GATE>(g, f, nb), (int)e,
                                    policy);
        }
    } else { /* rows no tensor map describes: through registers, swizzled as TMA would */
        const uint8_t *wb = g.w + e * g.w_s0 + b * FP8_BLOCK;
        for (int r = lane; r < C::ROWS; r += 32) {
            const long long wr =
                GATE ? (r < 128 ? g.gate_row : g.up_row) + nb * 128 + (r & 127) : nb * 128 + r;
#pragma unroll
            for (int q = 0; q < 8; q++)
                *(uint4 *)(stage + r * FP8_BLOCK + ((q ^ (r & 7)) * 16)) =
                    dec_load16(wb + wr * g.w_s1 + 16 * q);
        }
        hp_fence_proxy_async(); /* stores, read by the tensor cores' proxy */
    }
}

/*
 * Stage of depth block b: the weight rows (unless the early prologue issued them), the
 * activation rows (lane i: row i) by cp.async, every lane's and the tensor bytes completing
 * `full`.
 */
template <int GATE>
static __device__ __forceinline__ void dec_produce(const CUtensorMap *map, const Fp8Gemm &g,
                                                   const Fp8DecExtra &x, char *stage,
                                                   uint32_t full, long long e, int count,
                                                   long long arow, long long nb, long long b,
                                                   bool weights, int lane, uint64_t policy)
{
    using C = DecCfg<GATE>;
    if (weights)
        dec_produce_weights<GATE>(map, g, x, stage, full, e, nb, b, lane, policy);
    uint8_t *act = (uint8_t *)stage + C::W_BYTES + lane * FP8_BLOCK;
    const uint8_t *src = g.a + arow + b * FP8_BLOCK;
    if (g.vec_a) {
#pragma unroll
        for (int q = 0; q < 8; q++) /* rows past the tile's: zeros (no bytes read) */
            cp_async16(dec_smem(act + ((q ^ (lane & 7)) << 4)), lane < count ? src + 16 * q : g.a,
                       lane < count ? 16 : 0);
        hp_cp_async_arrive(full);
    } else {
#pragma unroll
        for (int q = 0; q < 8; q++)
            *(uint4 *)(act + ((q ^ (lane & 7)) << 4)) =
                lane < count ? dec_load16(src + 16 * q) : make_uint4(0u, 0u, 0u, 0u);
        hp_fence_proxy_async(); /* stores, read by the tensor cores' proxy */
        hp_mbar_arrive(full);
    }
    if (lane == 0)
        hp_mbar_arrive(full); /* with the expected bytes announced */
}

/* The tiles of the direct mode, by the producer warp: slot = lane, its local expert; tile i
 * = the i-th distinct valid one. */
static __device__ __forceinline__ void dec_direct_tiles(const Fp8Gemm &g, DecDirect &dd, int lane)
{
    long long ev = -1;
    if (lane < g.rt.S)
        ev = moe_slot_expert(g.rt, lane / g.rt.topk, lane % g.rt.topk);
    const int key = ev >= 0 ? (int)ev : -1 - lane;
    const unsigned same = __match_any_sync(0xFFFFFFFFu, key);
    const bool first = ev >= 0 && (__ffs(same) - 1) == lane;
    const unsigned firsts = __ballot_sync(0xFFFFFFFFu, first);
    if (first) {
        const int i = __popc(firsts & ((1u << lane) - 1u));
        dd.e[i] = (int)ev;
        dd.mask[i] = same;
    }
    if (lane == 0)
        dd.n = __popc(firsts);
    __syncwarp();
}

/* The tiles of the launch: distinct experts (direct), the route's list, or the masked bound. */
static __device__ __forceinline__ long long dec_ntiles(const Fp8DecExtra &x, const DecDirect &dd)
{
    return x.mode == DEC_DIRECT   ? dd.n
           : x.mode == DEC_ROUTED ? (long long)__ldcg(x.ntiles)
                                  : x.tiles_bound;
}

/*
 * Early (x.early, before the kernel waits for the one before it): the weight rows of the first
 * stages of the cluster's first item, whose tile the kernel before did not write (a layer's
 * final after its gate; a gate after the quantization of x in direct mode). The stream starts
 * while that kernel ends. Returns the stages issued.
 */
template <int GATE>
static __device__ __forceinline__ int dec_producer_early(const DecParams &p, const DecDirect &dd,
                                                         char *smem, uint64_t *full,
                                                         long long cluster, long long kb0,
                                                         long long kb1, int lane)
{
    using C = DecCfg<GATE>;
    const Fp8Gemm &g = p.g;
    if (!p.x.w_map || cluster >= dec_ntiles(p.x, dd) * g.nblk)
        return 0;
    const long long ti = cluster / g.nblk, nb = cluster - ti * g.nblk;
    long long e, s;
    if (dec_tile(g, p.x, dd, ti, lane, &e, &s) == 0)
        return 0;
    const int n = (int)(kb1 - kb0 < C::STAGES ? kb1 - kb0 : C::STAGES);
    const uint64_t policy = hp_policy_evict_first();
    if (lane == 0)
        hp_tma_prefetch(&p.map_w);
    for (int i = 0; i < n; i++)
        dec_produce_weights<GATE>(&p.map_w, g, p.x, smem + i * C::STAGE, dec_smem(&full[i]), e,
                                  nb, kb0 + i, lane, policy);
    return n;
}

/* The producer warp: for each item its tile, then its stages, ahead by the ring (the first
 * `pre` stages' weights already on their way). */
template <int GATE>
static __device__ __forceinline__ void dec_producer(const DecParams &p, const DecDirect &dd,
                                                   char *smem, uint64_t *full, uint64_t *empty,
                                                   long long cluster, long long items,
                                                   long long kb0, long long kb1, int pre,
                                                   int lane)
{
    using C = DecCfg<GATE>;
    const Fp8Gemm &g = p.g;
    HpPipe<C::STAGES> pipe = {0, 0u};
    const uint64_t policy = hp_policy_evict_first(); /* each weight is read once */
    if (p.x.w_map && lane == 0 && pre == 0)
        hp_tma_prefetch(&p.map_w);
    int it = 0; /* the block's item, for the timeline */
    for (long long w = cluster; w < items; w += p.x.clusters, it++) {
        const long long ti = w / g.nblk, nb = w - ti * g.nblk;
        long long e, s;
        if (lane == 0)
            DEC_STAMP(GATE, it, DT_P_START);
        const int count = dec_tile(g, p.x, dd, ti, lane, &e, &s);
        const long long arow = lane < count ? dec_arow(g, s, e) : 0;
        if (lane == 0)
            DEC_STAMP(GATE, it, DT_P_TILE);
        if (count > 0)
            for (long long b = kb0; b < kb1; b++) {
                hp_mbar_wait(dec_smem(&empty[pipe.stage]), pipe.phase ^ 1u);
                if (lane == 0 && b - kb0 < DEC_TRACE_STAGES)
                    DEC_STAMP(GATE, it, DT_P_EMPTY + (int)(b - kb0));
                dec_produce<GATE>(&p.map_w, g, p.x, smem + pipe.stage * C::STAGE,
                                  dec_smem(&full[pipe.stage]), e, count, arow, nb, b,
                                  w != cluster || b - kb0 >= pre, lane, policy);
                pipe.advance();
            }
    }
}

#endif /* MOEFUSE_CUDA_MOE_FP8_DECODE_PRODUCER_CUH */
