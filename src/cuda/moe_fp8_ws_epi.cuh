/*
 * The epilogues of the Hopper FP8 GEMM (moe_fp8_ws.cu, which includes this file): the gate's
 * bias, activation and h quantization, and the final's y. sm_90a device code only.
 *
 * Main accumulator 64 w + 4 i + v (wave w): tile row r0 (+ 8 for v >= 2), B row
 * 128 w + 8 i + 2 (lane % 4) + (v & 1). A half tile's warpgroup holds its one wave in wave
 * 0's place, m[4 i + v] (moe_fp8_ws.cu f8_stage_half). Fully unrolled, the activation, the
 * codes and the stores of 128 values are thousands of instructions, fetched from L2 once per
 * tile. So values
 * go in chunks of F8_CHUNK through this thread's own column of `buf` (stride F8_CONSUMERS
 * floats: no bank conflict, no barrier), and one out-of-line function does a chunk's long work,
 * its values side by side so that their latencies overlap. The functions take scalars, not the
 * kernel's parameters, which they would reload through generic pointers value by value.
 */
#ifndef MOEFUSE_CUDA_MOE_FP8_WS_EPI_CUH
#define MOEFUSE_CUDA_MOE_FP8_WS_EPI_CUH

#define F8_BUF(j) buf[(j) * F8_CONSUMERS]

/* One value pair's two codes (low byte: the first); y = 1 / s, fast: s in mf_div_scale's
 * range, where each finite value's h / s costs three instructions. */
static __device__ __forceinline__ uint32_t f8_code2(float h0, float h1, float s, float y,
                                                    bool fast)
{
    if (fast && mf_is_finite(h0) && mf_is_finite(h1))
        return mf_e4m3x2(mf_div_scale(h0, s, y), mf_div_scale(h1, s, y));
    return fp8_code(h0, s) | (fp8_code(h1, s) << 8);
}

/* f8_code2's pair stored at `at`, wherever h's rows start. */
static __device__ __forceinline__ void f8_code_pair(uint8_t *at, float h0, float h1, float s,
                                                    float y, bool fast)
{
    const uint32_t c = f8_code2(h0, h1, s, y, fast);
    if (((uintptr_t)at & 1u) == 0)
        *(uint16_t *)at = (uint16_t)c;
    else {
        at[0] = (uint8_t)c;
        at[1] = (uint8_t)(c >> 8);
    }
}

/*
 * Codes of a chunk's 16 h values: pair (j, j + 1) of row (j & 2) >> 1 at column
 * 8 (j >> 2) of dst0 / dst1 (NULL: no row). y = 1 / s of the row; fast when s is in
 * mf_div_scale's range, where h / s costs three instructions and every |h| is at most the
 * row's amax, as mf_div_scale asks; fp8_code's division elsewhere.
 */
static __device__ __noinline__ void f8_code_chunk(uint8_t *dst0, uint8_t *dst1, float s0,
                                                  float y0, float s1, float y1, const float *buf)
{
    const bool fast0 = mf_scale_fast_ok(s0) != 0, fast1 = mf_scale_fast_ok(s1) != 0;
#pragma unroll
    for (int j = 0; j < F8_CHUNK; j += 2) {
        const bool hi = (j & 2) != 0;
        uint8_t *dst = hi ? dst1 : dst0;
        if (dst)
            f8_code_pair(dst + 8 * (j >> 2), F8_BUF(j), F8_BUF(j + 1), hi ? s1 : s0,
                         hi ? y1 : y0, hi ? fast1 : fast0);
    }
}

/*
 * The gate's bias and activation of chunk (w, q) of m: its 8 gate values (i = 2 q, 2 q + 1)
 * and their 8 up values (i + 8) into buf, h back in F8_BUF(0..7). gb, ub, c0: the bias elements
 * and the h column of the thread's first value of wave 0 (mfm_gate_chunk).
 */
static __device__ __forceinline__ void f8_act_chunk(const float (&m)[128], int w, int q,
                                                    float *buf, int act, float alpha,
                                                    float limit, float beta, const void *bias,
                                                    int bias_dt, long long gb, long long ub,
                                                    long long c0, long long ncols, uint32_t tabs)
{
#pragma unroll
    for (int x = 0; x < 8; x++) {
        F8_BUF(x) = m[64 * w + 4 * (2 * q + (x >> 2)) + (x & 3)];
        F8_BUF(8 + x) = m[64 * w + 4 * (2 * q + 8 + (x >> 2)) + (x & 3)];
    }
    const long long off = 64 * w + 16 * q;
    mfm_gate_chunk<F8_CONSUMERS>(act, alpha, limit, beta, bias, bias_dt, gb + off, ub + off,
                                 c0 + off, ncols, tabs, buf);
}

/*
 * Slot row `row`'s h group scale of column block nb from its amax: *s and *y = 1 / s, the
 * scale stored in the caller's layout where `store`; returns the row's codes at column
 * nb * 128.
 */
static __device__ __forceinline__ uint8_t *f8_h_row(const Fp8Gemm &p, long long div,
                                                    long long row, long long nb, float amax,
                                                    bool store, float *s, float *y)
{
    uint32_t ue;
    *s = fp8_group_scale(amax, p.h.eps, p.h.ue8m0, &ue);
    *y = __fdiv_rn(1.0f, *s);
    const long long pp = row / div, q = row % div;
    if (store) {
        /* routed: row t = m * k + j of the one expert block; masked: row t of block e */
        const long long blk = p.masked ? pp : 0, t = p.masked ? q : row;
        fp8_put_scale(p.h, blk, t, nb, *s, ue);
        if (nb == p.h.groups - 1)
            fp8_put_scale_tail(p.h, blk, t);
    }
    return p.h.q + pp * p.o_s0 + q * p.o_s1 + nb * 128;
}

/*
 * The gate's epilogue of WAVES waves of m (main accumulator 64 w + ...). A full tile: both
 * waves, h columns nb * 128 + [0, 128) (half = 0). A half tile: m[0, 64) holds wave `half`'s
 * of this warpgroup, h columns + 64 half, and the two warpgroups of the tile's rows meet at the
 * consumers' barrier to take the max of their rows' amax (amax_x: [warpgroup][row rw, rw + 8]),
 * so that the scale is that of all 128 columns; warpgroup 0 stores it.
 */
template <int WAVES>
static __device__ __forceinline__ void f8_gate_out(const Fp8Gemm &p, long long div, long long e,
                                                   long long nb, const long long (&row)[2],
                                                   float (&m)[128], float *buf, int lane,
                                                   uint32_t tabs, int half, float (*amax_x)[64],
                                                   int rw)
{
    /* a warp without a slot has nothing to write (the shuffles below want the whole warp);
     * in a half tile it still meets the other warpgroup's warp at the barrier */
    if (!__any_sync(0xFFFFFFFFu, row[0] >= 0 || row[1] >= 0)) {
        if (WAVES == 1)
            moe_sync<F8_BAR, F8_CONSUMERS>();
        return;
    }
    const long long c0 = nb * 128 + 64 * half + 2 * (lane & 3);
    const int act = p.act, bias_dt = p.bias_dt;
    const float alpha = p.alpha, limit = p.limit, beta = p.up_offset;
    const void *bias = p.bias;
    const long long gb = e * p.bias_s0 + p.gate_row + c0, ub = e * p.bias_s0 + p.up_row + c0;
    const long long ncols = p.ncols;
    float amax[2] = {0.0f, 0.0f};
#pragma unroll
    for (int w = 0; w < WAVES; w++) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            f8_act_chunk(m, w, q, buf, act, alpha, limit, beta, bias, bias_dt, gb, ub, c0, ncols,
                         tabs);
#pragma unroll
            for (int x = 0; x < 8; x++) {
                const float h = F8_BUF(x);
                m[64 * w + 4 * (2 * q + (x >> 2)) + (x & 3)] = h;
                const float a = fabsf(h);
                if (mf_is_finite(h) && a > amax[(x & 3) >> 1])
                    amax[(x & 3) >> 1] = a;
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xFFFFFFFFu, amax[h], 1));
        amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xFFFFFFFFu, amax[h], 2));
    }
    if (WAVES == 1) {
        /* both are finite and >= +0, so the max is the same bits in either order */
        if ((lane & 3) == 0) {
            amax_x[half][rw] = amax[0];
            amax_x[half][rw + 8] = amax[1];
        }
        moe_sync<F8_BAR, F8_CONSUMERS>();
        amax[0] = fmaxf(amax[0], amax_x[half ^ 1][rw]);
        amax[1] = fmaxf(amax[1], amax_x[half ^ 1][rw + 8]);
    }
    float sc[2] = {1.0f, 1.0f}, y[2] = {1.0f, 1.0f};
    uint8_t *dst[2] = {nullptr, nullptr};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        if (row[h] >= 0)
            dst[h] = f8_h_row(p, div, row[h], nb, amax[h], (lane & 3) == 0 && half == 0, &sc[h],
                              &y[h]) +
                     (c0 - nb * 128);
    }
    /* chunk (w, q): h of i = 4 q .. 4 q + 3 (gate slots), 16 values */
#pragma unroll
    for (int w = 0; w < WAVES; w++) {
#pragma unroll
        for (int q = 0; q < 2; q++) {
#pragma unroll
            for (int x = 0; x < F8_CHUNK; x++)
                F8_BUF(x) = m[64 * w + 4 * (4 * q + (x >> 2)) + (x & 3)];
            const long long off = 64 * w + 32 * q;
            f8_code_chunk(dst[0] ? dst[0] + off : nullptr, dst[1] ? dst[1] + off : nullptr, sc[0],
                          y[0], sc[1], y[1], buf);
        }
    }
}

/*
 * y + bias of a chunk: pair (j, j + 1) of row (j & 2) >> 1 (output element base0 / base1, -1:
 * no row) at columns c0 + 8 (j >> 2) and the next; rounded once; pairs in one store where they
 * are aligned to it (f32 8 bytes, bf16 and f16 4). bb: the bias element of column c0.
 */
static __device__ __noinline__ void f8_y_chunk(void *out, int out_dt, const void *bias,
                                               int bias_dt, long long bb, long long c0,
                                               long long ncols, long long base0, long long base1,
                                               const float *buf)
{
#pragma unroll
    for (int j = 0; j < F8_CHUNK; j += 2) {
        const long long base = (j & 2) ? base1 : base0;
        const long long c = c0 + 8 * (j >> 2);
        if (base < 0 || c >= ncols)
            continue;
        const bool two = c + 1 < ncols;
        float y0 = F8_BUF(j), y1 = F8_BUF(j + 1);
        if (bias) {
            y0 = __fadd_rn(y0, mfm_load(bias, bias_dt, bb + 8 * (j >> 2)));
            if (two)
                y1 = __fadd_rn(y1, mfm_load(bias, bias_dt, bb + 8 * (j >> 2) + 1));
        }
        const long long at = base + c;
        if (two && out_dt == MF_DT_F32 && (((uintptr_t)((float *)out + at)) & 7u) == 0) {
            *(float2 *)((float *)out + at) = make_float2(y0, y1);
        } else if (two && out_dt != MF_DT_F32 && (((uintptr_t)((uint16_t *)out + at)) & 3u) == 0) {
            const bool bf = out_dt == MF_DT_BF16; /* each rounded once, as mfm_store does */
            *(uint32_t *)((uint16_t *)out + at) =
                (uint32_t)(bf ? mf_f32_to_bf16(y0) : mf_f32_to_f16(y0)) |
                ((uint32_t)(bf ? mf_f32_to_bf16(y1) : mf_f32_to_f16(y1)) << 16);
        } else {
            mfm_store(out, out_dt, at, y0);
            if (two)
                mfm_store(out, out_dt, at + 1, y1);
        }
    }
}

/*
 * Final: y = main + bias in out's dtype, WAVES waves of m: wave w's columns
 * nb * 256 + 128 (w + half) + 8 i + ... (a full tile: both, half = 0; a half tile: m[0, 64)
 * holds wave `half`'s).
 */
template <int WAVES>
static __device__ __forceinline__ void f8_final_out(const Fp8Gemm &p, long long div, long long e,
                                                    long long nb, const long long (&row)[2],
                                                    const float (&m)[128], float *buf, int lane,
                                                    int half)
{
    if (row[0] < 0 && row[1] < 0)
        return;
    long long base[2] = {-1, -1};
#pragma unroll
    for (int h = 0; h < 2; h++)
        if (row[h] >= 0)
            base[h] = (row[h] / div) * p.o_s0 + (row[h] % div) * p.o_s1;
    const long long cols0 = nb * F8_BN + 128 * half, c0 = cols0 + 2 * (lane & 3);
    void *out = p.out;
    const void *bias = p.bias;
    const int out_dt = p.out_dt, bias_dt = p.bias_dt;
    const long long ncols = p.ncols, bb = e * p.bias_s0;
    const float(&mw)[64 * WAVES] = reinterpret_cast<const float(&)[64 * WAVES]>(m);
    if ((out_dt == MF_DT_F32 || out_dt == MF_DT_BF16) && cols0 + 128 * WAVES <= ncols) {
        const uintptr_t pair = out_dt == MF_DT_F32 ? 7u : 3u, esz = out_dt == MF_DT_F32 ? 4 : 2;
        bool aligned = true;
#pragma unroll
        for (int h = 0; h < 2; h++)
            aligned &= base[h] < 0 || (((uintptr_t)out + (uintptr_t)((base[h] + c0) * esz)) &
                                       pair) == 0;
        /* the common case straight from the registers: some six instructions a pair where
         * the chunks below spend twenty, and 64 pairs unrolled fit the instruction cache */
        bool nan = false;
        if (aligned) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (base[h] < 0)
                    continue;
                if (out_dt == MF_DT_BF16)
                    nan |= mfm_y_row<true>(out, bias, bias_dt, bb + c0, base[h] + c0, h, mw);
                else
                    mfm_y_row<false>(out, bias, bias_dt, bb + c0, base[h] + c0, h, mw);
            }
            if (!nan)
                return;
        }
    }
#pragma unroll
    for (int ch = 0; ch < 4 * WAVES; ch++) {
#pragma unroll
        for (int x = 0; x < F8_CHUNK; x++)
            F8_BUF(x) = m[16 * ch + x];
        /* m[16 ch + x]: wave ch / 4, i = 4 (ch % 4) + x / 4 */
        const long long cc = c0 + 128 * (ch >> 2) + 32 * (ch & 3);
        f8_y_chunk(out, out_dt, bias, bias_dt, bb + cc, cc, ncols, base[0], base[1], buf);
    }
}

#endif /* MOEFUSE_CUDA_MOE_FP8_WS_EPI_CUH */
