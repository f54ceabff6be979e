/*
 * The FP8 gate's codes off the consumers (moe_fp8_ws.cu, which includes this file, with A by
 * TMA): the consumers leave each tile's h in shared memory after the activation and go on to
 * the next tile's MMAs, and two producer warps, idle when TMA loads A, take each row's amax,
 * its scale and its codes from there while the tensor cores run. The same steps and bits as
 * f8_gate_out; only who computes them and when differs. sm_90a device code only.
 *
 * Staging buffer: F8_STG_SLOTS floats a consumer thread, slot-major (slot s of thread t at
 * s * F8_CONSUMERS + column(t)), so that each consumer thread's chunks go through its own column
 * as in f8_gate_out: chunk c = 4 w + q writes its gate values to slots 8 c .. 8 c + 7, its up
 * values to the next eight, and h comes back over the gate values; the last chunk's up values
 * are why a thread has 72 slots and not 64. Slot 32 w + 8 q + x holds wave w's gate slot
 * i = 2 q + (x >> 2), value x & 3 (moe_fp8_ws_epi.cuh's accumulator map). The buffer's size
 * and the handoff's barriers: moe_fp8_ws.cu (F8_STG_BYTES, F8Handoff).
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_WS_CODES_CUH
#define MOEFUSE_CUDA_MOE_FP8_WS_CODES_CUH

/* Consumer thread ctid's column: its warp's lanes permuted in fours, so that the 32 rows a
 * coder warp reads at once fall in 32 banks. */
static __device__ __forceinline__ int f8_stg_col(int ctid) { return ctid ^ ((ctid >> 5) & 3); }

/*
 * A consumer's half: the bias and activation of WAVES waves of m as in f8_gate_out, h left in
 * the thread's column `col` of the staging buffer (see above). half: as in f8_gate_out.
 */
template <int WAVES>
static __device__ __forceinline__ void f8_gate_stage(const Fp8Gemm &p, long long e, long long nb,
                                                     const float (&m)[128], float *col, int lane,
                                                     uint32_t tabs, int half)
{
    const long long c0 = nb * 128 + 64 * half + 2 * (lane & 3);
    const long long gb = e * p.bias_s0 + p.gate_row + c0, ub = e * p.bias_s0 + p.up_row + c0;
    const int act = p.act, bias_dt = p.bias_dt;
    const float alpha = p.alpha, limit = p.limit, beta = p.up_offset;
    const void *bias = p.bias;
    const long long ncols = p.ncols;
#pragma unroll
    for (int w = 0; w < WAVES; w++)
#pragma unroll
        for (int q = 0; q < 4; q++)
            f8_act_chunk(m, w, q, col + (32 * w + 8 * q) * F8_CONSUMERS, act, alpha, limit, beta,
                         bias, bias_dt, gb, ub, c0, ncols, tabs);
}

/*
 * Value t (0..15) of 16-column group j (h columns 16 j + t) of a coder's row, where the
 * consumer thread that holds it staged it. base: the row's slot and column of its consumer warp
 * and lane quad (f8_coders); x: each lane of the quad as f8_stg_col permutes it.
 */
static __device__ __forceinline__ float f8_stg_value(const float *base, int half, int j, int t,
                                                     const int (&x)[4])
{
    const int p = j >> 2; /* full tile: wave p of the row's warpgroup; half: warpgroup p */
    const int off = (half ? 128 * p : 32 * F8_CONSUMERS * p) + 8 * (j & 3) * F8_CONSUMERS +
                    ((t >> 3) << 2) * F8_CONSUMERS + (t & 1) * F8_CONSUMERS + x[(t >> 1) & 3];
    return base[off];
}

/* One row's amax, scale and 128 codes (f8_gate_out's steps and bits). */
static __device__ __noinline__ void f8_code_row_staged(const Fp8Gemm &p, long long div,
                                                       const float *base, int wc, long long nb,
                                                       int half, long long row)
{
    const int x[4] = {0 ^ wc, 1 ^ wc, 2 ^ wc, 3 ^ wc};
    float amax = 0.0f;
#pragma unroll 1
    for (int j = 0; j < 8; j++) {
#pragma unroll
        for (int t = 0; t < 16; t++) {
            const float h = f8_stg_value(base, half, j, t, x);
            const float a = fabsf(h);
            if (mf_is_finite(h) && a > amax)
                amax = a;
        }
    }
    float s, y;
    uint8_t *dst = f8_h_row(p, div, row, nb, amax, true, &s, &y);
    const bool fast = mf_scale_fast_ok(s) != 0;
    const bool vec = ((uintptr_t)dst & 15u) == 0;
#pragma unroll 1
    for (int j = 0; j < 8; j++) {
        uint32_t word[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            word[k] = f8_code2(f8_stg_value(base, half, j, 4 * k, x),
                               f8_stg_value(base, half, j, 4 * k + 1, x), s, y, fast) |
                      (f8_code2(f8_stg_value(base, half, j, 4 * k + 2, x),
                                f8_stg_value(base, half, j, 4 * k + 3, x), s, y, fast)
                       << 16);
        if (vec) {
            *(uint4 *)(dst + 16 * j) = make_uint4(word[0], word[1], word[2], word[3]);
        } else {
#pragma unroll
            for (int b = 0; b < 16; b++)
                dst[16 * j + b] = (uint8_t)(word[b >> 2] >> (8 * (b & 3)));
        }
    }
}

/*
 * The coders (threads 64..127 of the producer warpgroup, wt = 0..63): each tile staged, the
 * rows of a coder warp's row half ww (so that its 32 reads of a value fall in 32 banks), two
 * rows a thread in a full tile and one in a half tile.
 */
static __device__ __forceinline__ void f8_coders(const Fp8Gemm &p, long long div,
                                                 const float *stg, F8Handoff &ho, int wt)
{
    const int ww = wt >> 5, lane = wt & 31, wc = lane >> 3, lh = lane & 7;
    const int rr = wc * 16 + ww * 8 + lh;
    unsigned phase = 0u;
    for (;;) {
        hp_mbar_wait(smem_u32(&ho.full), phase);
        phase ^= 1u;
        if (ho.done)
            break;
        const long long nb = ho.nb;
        const int half = ho.half;
        for (int pass = 0; pass < (half ? 1 : 2); pass++) {
            const long long row = ho.row[pass * 64 + rr];
            /* slot 2 ww (the consumer's row half) of lane quad lh of warp wc of warpgroup
             * `pass` (a half tile: warpgroup j >> 2, f8_stg_value) */
            const float *base = stg + 2 * ww * F8_CONSUMERS + (half ? 0 : pass * 128) + wc * 32 +
                                lh * 4;
            if (row >= 0)
                f8_code_row_staged(p, div, base, wc, nb, half, row);
        }
        hp_mbar_arrive(smem_u32(&ho.empty)); /* release: this thread's reads are done */
    }
}

#endif /* MOEFUSE_CUDA_MOE_FP8_WS_CODES_CUH */
