/*
 * The epilogues of the FP8 decode GEMM (moe_fp8_decode.cu, which includes this file after the
 * pieces they use: DecTileSmem, the consumers' barrier, the tile's accumulators): the gate's
 * activation and h quantization, the final's y, and the reduced final's top-k sums (its own
 * warp). sm_90a device code only, like the rest of the kernel.
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_DECODE_EPI_CUH
#define MOEFUSE_CUDA_MOE_FP8_DECODE_EPI_CUH

/*
 * Gate: the tile's gate and up sums into shared memory (so that the activation's code runs
 * with none of the accumulators live), then h in place of the gate sums, then a warp per slot
 * quantizes its group.
 */
static __device__ __forceinline__ void dec_gate_epilogue(const Fp8Gemm &g, const DecTileSmem &ts,
                                                         long long nb, char *smem,
                                                         const float (&acc)[2][4][4], int warp,
                                                         int lane)
{
    float *hs = (float *)smem, *us = hs + DEC_NS * DEC_HPITCH; /* the h buffer */
    const int gi = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int v = 0; v < 4; v++) {
            const int slot = nt * 8 + 2 * t + (v & 1), hc = warp * 16 + gi + 8 * (v >> 1);
            hs[slot * DEC_HPITCH + hc] = acc[0][nt][v];
            us[slot * DEC_HPITCH + hc] = acc[1][nt][v];
        }
    dec_bar_consumers();
    const long long e = ts.e;
    for (int i = warp * 32 + lane; i < ts.count * 128; i += DEC_CONSUMER_THREADS) {
        const int slot = i >> 7, hc = i & 127;
        float gv = hs[slot * DEC_HPITCH + hc], uv = us[slot * DEC_HPITCH + hc];
        if (g.bias) {
            const long long c = nb * FP8_BLOCK + hc;
            gv = fp8_add(gv, mfm_load(g.bias, g.bias_dt, e * g.bias_s0 + g.gate_row + c));
            uv = fp8_add(uv, mfm_load(g.bias, g.bias_dt, e * g.bias_s0 + g.up_row + c));
        }
        hs[slot * DEC_HPITCH + hc] =
            mfm_gated_tab(g.act, g.alpha, g.limit, g.up_offset, gv, uv, dec_smem(ts.exp_tab));
    }
    dec_bar_consumers();
    for (int i = warp; i < ts.count; i += 8) {
        const float4 h4 = *(const float4 *)(hs + i * DEC_HPITCH + 4 * lane);
        const float hv[4] = {h4.x, h4.y, h4.z, h4.w};
        uint32_t w, ue;
        const float s = fp8_quant_warp4(hv, g.h.eps, g.h.ue8m0, &w, &ue);
        uint8_t *dst = g.h.q + ts.orow[i] + nb * FP8_BLOCK + 4 * lane;
        if (((uintptr_t)dst & 3u) == 0)
            *(uint32_t *)dst = w;
        else
#pragma unroll
            for (int q = 0; q < 4; q++)
                dst[q] = (uint8_t)(w >> (8 * q));
        if (lane == 0) {
            fp8_put_scale(g.h, ts.blk, ts.hrow[i], nb, s, ue);
            if (nb == g.nblk - 1)
                fp8_put_scale_tail(g.h, ts.blk, ts.hrow[i]);
        }
    }
}

/* Final, the consumers: y (+ bias) of the tile's slots, stored (reduced: in f32 for the sums
 * warp, which takes it from here). */
static __device__ __forceinline__ void dec_final_epilogue(const Fp8Gemm &g, const DecTileSmem &ts,
                                                          long long nb,
                                                          const float (&acc)[2][4][4], int warp,
                                                          int lane)
{
    const int gi = lane >> 2, t = lane & 3;
    const long long e = ts.e;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int v = 0; v < 4; v++) {
            const int slot = nt * 8 + 2 * t + (v & 1);
            if (slot >= ts.count)
                continue;
            const long long c = nb * FP8_BLOCK + warp * 16 + gi + 8 * (v >> 1);
            float y = acc[0][nt][v];
            if (g.bias)
                y = fp8_add(y, mfm_load(g.bias, g.bias_dt, e * g.bias_s0 + c));
            if (g.epi == FP8_EPI_Y_F32)
                ((float *)g.out)[ts.orow[slot] + c] = y;
            else
                mfm_store(g.out, g.out_dt, ts.orow[slot] + c, y);
        }
}

/*
 * Final, reduced: the sums warp. For each of the block's items (rank 0, found as the producer
 * finds them) it counts each row's valid slots while the consumers stream, waits for the
 * consumers' y (epi_full), announces each row's arrival at the column block, and the last of a
 * token's valid slots to arrive sums them in slot order. The consumers never wait for these
 * round trips to L2 (fence, counter, the other slots' y): they held every item for most of its
 * epilogue when the consumers made them.
 */
static __device__ __forceinline__ void dec_final_sums(const Fp8Gemm &g, const Fp8DecExtra &x,
                                                      const DecDirect &dd, uint64_t *epi_full,
                                                      uint64_t *epi_free, long long cluster,
                                                      long long items, int lane)
{
    const long long K = g.ncols, k = g.rt.topk;
    unsigned phase = 0;
    int it = 0; /* the block's item, for the timeline */
    for (long long w = cluster; w < items; w += x.clusters, it++) {
        const long long ti = w / g.nblk, nb = w - ti * g.nblk;
        long long e, s;
        if (lane == 0)
            DEC_STAMP(0, it, DT_S_START);
        const int count = dec_tile(g, x, dd, ti, lane, &e, &s);
        if (count == 0)
            continue;
        const long long m = lane < count ? s / k : 0;
        int valid = 0;
        if (lane < count)
            for (long long j = 0; j < k; j++)
                valid += moe_slot_expert(g.rt, m, j) >= 0;
        if (lane == 0)
            DEC_STAMP(0, it, DT_S_WAIT);
        hp_mbar_wait(dec_smem(epi_full), phase); /* the consumers' y of this item are stored */
        if (lane == 0)
            DEC_STAMP(0, it, DT_S_GOT);
        phase ^= 1u;
        bool last = false;
        if (lane < count) {
            __threadfence(); /* those stores (cumulative through the barrier), then the count */
            last = atomicAdd(x.arrivals + m * g.nblk + nb, 1u) + 1u == (unsigned)valid;
        }
        __syncwarp();
        if (lane == 0) {
            hp_mbar_arrive(dec_smem(epi_free));
            DEC_STAMP(0, it, DT_S_FREED);
        }
        unsigned lasts = __ballot_sync(0xFFFFFFFFu, last);
        if (lasts)
            __threadfence(); /* the other blocks' y, after their counts */
        /* lane: four columns; the token's slots eight at a time, their loads issued together,
         * summed in order */
        const long long c = nb * FP8_BLOCK + 4 * lane;
        while (lasts) {
            const int i = __ffs(lasts) - 1;
            lasts &= lasts - 1u;
            const long long mi = __shfl_sync(0xFFFFFFFFu, m, i);
            float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (long long j0 = 0; j0 < k; j0 += 8) {
                float4 y[8];
                float wt[8];
                bool ok[8];
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    const long long j = j0 + q;
                    ok[q] = j < k && moe_slot_expert(g.rt, mi, j) >= 0;
                    y[q] = ok[q] ? __ldcg((const float4 *)((const float *)g.out + (mi * k + j) * K +
                                                           c))
                                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    wt[q] = ok[q] ? x.tw[mi * x.tw_s0 + j] : 0.0f;
                }
#pragma unroll
                for (int q = 0; q < 8; q++) {
                    if (!ok[q])
                        continue; /* an invalid slot adds nothing, not even a signed zero */
                    sum[0] = fp8_add(sum[0], mf_mul(wt[q], y[q].x));
                    sum[1] = fp8_add(sum[1], mf_mul(wt[q], y[q].y));
                    sum[2] = fp8_add(sum[2], mf_mul(wt[q], y[q].z));
                    sum[3] = fp8_add(sum[3], mf_mul(wt[q], y[q].w));
                }
            }
#pragma unroll
            for (int q = 0; q < 4; q++)
                mfm_store(x.rout, x.rout_dt, mi * x.rout_s0 + c + q, sum[q]);
        }
        if (lane == 0)
            DEC_STAMP(0, it, DT_S_END);
    }
}

#endif /* MOEFUSE_CUDA_MOE_FP8_DECODE_EPI_CUH */
