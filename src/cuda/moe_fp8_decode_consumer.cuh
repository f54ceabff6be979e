/*
 * The FP8 decode GEMM's consumer warps (moe_fp8_decode.cu, which includes this file after its
 * configuration and primitives): the scale windows, one stage's tensor-core sums and their
 * promotion, and the split tiles' sums through L2. sm_90a device code only.
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_DECODE_CONSUMER_CUH
#define MOEFUSE_CUDA_MOE_FP8_DECODE_CONSUMER_CUH

/* ------------------------------------------------------------- consumers */

/*
 * The scales of window [b0, b0 + DEC_SWIN) (blocks below kb1) into registers: element i =
 * tid + q * 256 of the window is block b0 + i / SCOLS, half (i / DEC_NS) % FRAGS, slot
 * i % DEC_NS; ra its slot's activation scale, rw the half's weight scale (0 and 0 past the
 * tile's rows). Their product waits for dec_scales_store: made here, it waited for the loads
 * in the middle of the stream (ncu: DeepSeek-V3 M = 32 gate 5% slower).
 */
template <int GATE>
static __device__ __forceinline__ void dec_scales_load(const Fp8Gemm &g, const DecTileSmem &ts,
                                                       long long nb, long long b0, long long kb1,
                                                       int tid, float (&ra)[DecCfg<GATE>::SREGS],
                                                       float (&rw)[DecCfg<GATE>::SREGS])
{
    using C = DecCfg<GATE>;
#pragma unroll
    for (int q = 0; q < C::SREGS; q++) {
        const int i = tid + q * DEC_CONSUMER_THREADS, c = i % DEC_NS;
        const int f = (i / DEC_NS) % C::FRAGS;
        const long long b = b0 + i / C::SCOLS;
        ra[q] = rw[q] = 0.0f;
        if (b >= kb1 || c >= ts.count)
            continue;
        const long long rb = GATE ? (f == 0 ? g.gate_row : g.up_row) / FP8_BLOCK + nb : nb;
        ra[q] = fp8_act_scale(g.as, ts.blk, ts.srow[c], b);
        rw[q] = fp8_w_scale(g.ws, ts.e, rb, b);
    }
}

/* The window's products sa * sw, with the CPU's NaN bits, each made once. */
template <int N>
static __device__ __forceinline__ void dec_scales_store(float *win, const float (&ra)[N],
                                                        const float (&rw)[N], int tid)
{
#pragma unroll
    for (int q = 0; q < N; q++)
        win[tid + q * DEC_CONSUMER_THREADS] = fp8_scale_mul(ra[q], rw[q]);
}

/* d[f] = half f's 64 weight rows of the thread's warpgroup (at a0 + f * 128 rows) x the
 * stage's NC n8 columns of slots (at b0), over one block, its k32 steps from 0; one commit
 * group. */
template <int GATE, int NC>
static __device__ __forceinline__ void dec_block(float (&d)[2][16], uint32_t a0, uint32_t b0)
{
#pragma unroll
    for (int f = 0; f < DecCfg<GATE>::FRAGS; f++)
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_e4m3_narrow<NC>(d[f], wg_desc(a0 + f * 128 * FP8_BLOCK + kk * 32),
                                  wg_desc(b0 + kk * 32), kk > 0);
}

/* d stays in registers across the wgmma. Both halves, also in the final, which uses one:
 * with only that one pinned, ptxas found too few registers for the wgmma pipeline and waited
 * after every k32 step (C7511; SASS: 16 waits for 16 wgmma). */
static __device__ __forceinline__ void dec_pin(float (&d)[2][16])
{
#pragma unroll
    for (int f = 0; f < 2; f++)
#pragma unroll
        for (int i = 0; i < 16; i++)
            asm volatile("" : "+f"(d[f][i])::"memory");
}

/*
 * One stage into acc[f][nt] (f: gate / up half, nt: n8 column of slots): the block's sums by
 * the tensor cores into d, then each promoted with its scale product from the window row sc.
 * d is the caller's (kept across stages: its values never matter, the first k32 step
 * overwrites them). The promotions are plain fmas, and one sum of each n8 column's says
 * whether any is NaN; only then are they made again with the CPU's NaN bits (fp8_fma).
 * Branching on each (as fp8_fma does) made a third of the stage's instructions.
 */
template <int GATE, int NC>
static __device__ __forceinline__ void dec_consume(uint32_t stage, int warp, int lane,
                                                   const float *sc, float (&d)[2][16],
                                                   float (&acc)[2][4][4])
{
    using C = DecCfg<GATE>;
    const int t = lane & 3;
    const uint32_t a0 = stage + (uint32_t)((warp >> 2) * 64 * FP8_BLOCK), b0 = stage + C::W_BYTES;
    dec_pin(d);
    wgmma_fence();
    dec_block<GATE, NC>(d, a0, b0);
    wgmma_commit();
    wgmma_wait<0>();
    dec_pin(d);
#pragma unroll
    for (int nt = 0; nt < NC; nt++) {
        float2 s[C::FRAGS];
        float next[C::FRAGS][4], probe = 0.0f;
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++) {
            /* this block's products of the thread's two slots and the half */
            s[f] = *(const float2 *)(sc + f * DEC_NS + nt * 8 + 2 * t);
            next[f][0] = __fmaf_rn(d[f][4 * nt + 0], s[f].x, acc[f][nt][0]);
            next[f][1] = __fmaf_rn(d[f][4 * nt + 1], s[f].y, acc[f][nt][1]);
            next[f][2] = __fmaf_rn(d[f][4 * nt + 2], s[f].x, acc[f][nt][2]);
            next[f][3] = __fmaf_rn(d[f][4 * nt + 3], s[f].y, acc[f][nt][3]);
            /* NaN when any of them is (or two infinities cancel) */
            probe += (next[f][0] + next[f][1]) + (next[f][2] + next[f][3]);
        }
        const bool exact = __builtin_expect(mf_is_nan(probe), 0);
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++)
#pragma unroll
            for (int v = 0; v < 4; v++)
                acc[f][nt][v] = exact ? fp8_fma(d[f][4 * nt + v], (v & 1) ? s[f].y : s[f].x,
                                                acc[f][nt][v])
                                      : next[f][v];
    }
}

/* Where the consumers' stream of an item reads and signals: the ring's stages and barriers,
 * their position in it, and the two scale windows. */
template <int STAGES> struct DecStream {
    char *smem;
    float *win;
    uint64_t *full, *empty;
    HpPipe<STAGES> *pipe;
};

/*
 * One item's blocks [kb0, kb1) into acc, NC n8 columns of slots: a copy of the stage loop per
 * column count, so that no stage branches on it and ptxas schedules each copy whole. The
 * scale windows: the block's window (0 or 1) and its row there by int counters (no 64-bit
 * division), each window stored while the next one's scales load. `item`: the block's item,
 * for the timeline (-DMOE_DEC_TRACE).
 */
template <int GATE, int NC>
static __device__ __forceinline__ void dec_stream(const Fp8Gemm &g, const DecTileSmem &ts,
                                                  const DecStream<DecCfg<GATE>::STAGES> &st,
                                                  long long nb, long long kb0, long long kb1,
                                                  int tid, float (&d)[2][16],
                                                  float (&acc)[2][4][4], int item)
{
    using C = DecCfg<GATE>;
    const int warp = tid >> 5, lane = tid & 31;
    HpPipe<C::STAGES> &pipe = *st.pipe;
    float sa[C::SREGS], sw[C::SREGS];
    dec_scales_load<GATE>(g, ts, nb, kb0, kb1, tid, sa, sw);
    const int nblocks = (int)(kb1 - kb0);
    int wsel = 1, wb = DEC_SWIN;
    for (int i = 0; i < nblocks; i++, wb++) {
        if (wb == DEC_SWIN) {
            wb = 0;
            wsel ^= 1;
            /* the other window was last read before the previous window's barrier */
            dec_scales_store(st.win + wsel * (DEC_SWIN * C::SCOLS), sa, sw, tid);
            dec_bar_consumers();
            if (i == 0 && tid == 0)
                DEC_STAMP(GATE, item, DT_C_WIN0);
            if (i + DEC_SWIN < nblocks) /* the next window's latency hides behind this one */
                dec_scales_load<GATE>(g, ts, nb, kb0 + i + DEC_SWIN, kb1, tid, sa, sw);
        }
        const float *row = st.win + wsel * (DEC_SWIN * C::SCOLS) + wb * C::SCOLS;
        const uint32_t stage = dec_smem(st.smem + pipe.stage * C::STAGE);
        hp_mbar_wait(dec_smem(&st.full[pipe.stage]), pipe.phase);
        if (tid == 0 && i < DEC_TRACE_STAGES)
            DEC_STAMP(GATE, item, DT_C_FULL + i);
        hp_fence_proxy_async(); /* the cp.async rows, for the tensor cores' proxy */
        dec_consume<GATE, NC>(stage, warp, lane, row, d, acc);
        __syncwarp();
        if (lane == 0)
            hp_mbar_arrive(dec_smem(&st.empty[pipe.stage]));
        pipe.advance();
    }
}

/*
 * Rank r > 0 of a split tile hands its sums to rank 0 through L2: it waits until rank 0 has
 * read the previous ones (red_free), writes them, and arrives on rank 0's red_full; rank 0
 * waits for all and adds them in rank order, then frees each rank's buffer. mbarriers, not
 * cluster barriers, so that the producer warps never wait for this.
 */
template <int GATE>
static __device__ __forceinline__ void dec_split_sum(float (&acc)[2][4][4], float4 *part,
                                                     uint64_t *red_full, uint64_t *red_free,
                                                     int split, int rank, unsigned phase, int tid)
{
    using C = DecCfg<GATE>;
    if (rank != 0) {
        hp_mbar_wait(dec_smem(red_free), phase ^ 1u);
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
                __stcg(part + rank * C::PART4 + (f * 4 + nt) * DEC_CONSUMER_THREADS + tid,
                       make_float4(acc[f][nt][0], acc[f][nt][1], acc[f][nt][2], acc[f][nt][3]));
        __threadfence();
        dec_bar_consumers();
        if (tid == 0)
            hp_mbar_arrive_cluster(hp_cluster_map(dec_smem(red_full), 0u));
        return;
    }
    hp_mbar_wait_cluster(dec_smem(red_full), phase);
    for (int r = 1; r < split; r++)
#pragma unroll
        for (int f = 0; f < C::FRAGS; f++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const float4 o =
                    __ldcg(part + r * C::PART4 + (f * 4 + nt) * DEC_CONSUMER_THREADS + tid);
                acc[f][nt][0] = fp8_add(acc[f][nt][0], o.x);
                acc[f][nt][1] = fp8_add(acc[f][nt][1], o.y);
                acc[f][nt][2] = fp8_add(acc[f][nt][2], o.z);
                acc[f][nt][3] = fp8_add(acc[f][nt][3], o.w);
            }
    dec_bar_consumers(); /* every rank's sums read */
    if (tid >= 1 && tid < split)
        hp_mbar_arrive_cluster(hp_cluster_map(dec_smem(red_free), (unsigned)tid));
}

#endif /* MOEFUSE_CUDA_MOE_FP8_DECODE_CONSUMER_CUH */
