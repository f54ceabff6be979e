/*
 * The reduced final's top-k sum, after a routed final's GEMM (bf16, f16, f32 and FP8 alike;
 * docs/NUMERICS.md "MoE" and "FP8 MoE"): out[m, c] = the sum over the valid slots
 * j = 0..k-1 of w[m, j] * y[m, j, c], from 0, in f32 with the CPU's NaN bits, rounded once to
 * out's dtype (a token without a valid slot gets 0). y [M * k, K] is f32 scratch written by
 * the GEMM. (Decode-sized calls sum inside their GEMM instead: one launch less.)
 *
 * A pure stream (K * 4 bytes a slot in, a row of out back), so the kernel is shaped for the
 * memory's pace: four columns a thread by 16-byte loads where K is a multiple of 4 (y's rows
 * lie in 256-byte aligned scratch), and RED_AHEAD slot rows loaded at a time (of one token, or
 * of 2 or 4 where k is small) before they are summed in slot order, so that many loads are in
 * flight a thread.
 */
#include "cuda/fp8.cuh"
#include "cuda/moe_internal.h"

#define RED_THREADS 256
#define RED_AHEAD 8 /* slot rows in flight a thread */
/* at most 64 registers a thread (76 without the bound): 4 blocks an SM rather than 3. A probe
 * on an H200 (y of 32768 slots): 75.3 -> 70.1 us at K = 2048 (3.8 -> 4.1 TB/s), 249 -> 234 at
 * K = 7168, where a read of y alone takes 62 and 209 */
#define RED_MIN_BLOCKS 4
/* four tokens an item hold 16 sums a thread: at 64 registers they spilled, at 85 (3 blocks
 * an SM) they do not, and 3 x 256 threads still have 8 rows in flight each */
#define RED_MIN_BLOCKS_4 3

/*
 * A block takes items (TOK consecutive tokens, RED_THREADS * 4 columns), where K is a multiple
 * of 4 and y 16-byte aligned (every FP8 call, the models' shapes). A thread has RED_AHEAD
 * slot rows in flight: RED_AHEAD / TOK slots of each of its TOK tokens, so that a small k
 * (Mixtral's 2) keeps as many loads in flight as k = 8 does with one token. Each token's sum
 * still runs over its slots in order. vec_out: out's rows take one 16-byte (f32) or 8-byte
 * (bf16, f16) store of four values.
 */
template <int TOK>
__global__ void __launch_bounds__(RED_THREADS, TOK == 4 ? RED_MIN_BLOCKS_4 : RED_MIN_BLOCKS)
    moe_reduce_topk(const float *y, const int *expert_of, const float *tw, long long tw_s0,
                    long long M, long long k, long long K, void *out, long long out_s0,
                    int out_dt, int vec_out)
{
    constexpr int J = RED_AHEAD / TOK; /* slots of a token a round */
    const long long K4 = K / 4, spans = (K4 + RED_THREADS - 1) / RED_THREADS;
    const long long groups = (M + TOK - 1) / TOK;
    for (long long it = blockIdx.x; it < groups * spans; it += gridDim.x) {
        const long long g = it / spans, c4 = (it - g * spans) * RED_THREADS + threadIdx.x;
        if (c4 >= K4)
            continue;
        float acc[TOK][4];
#pragma unroll
        for (int t = 0; t < TOK; t++)
            acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
        for (long long j0 = 0; j0 < k; j0 += J) {
            float4 v[TOK][J];
            float w[TOK][J];
            bool ok[TOK][J];
#pragma unroll
            for (int t = 0; t < TOK; t++) {
                const long long m = g * TOK + t;
#pragma unroll
                for (int u = 0; u < J; u++) {
                    const long long j = j0 + u;
                    /* an invalid slot's row is never read, nor added: not even a signed zero */
                    ok[t][u] = (TOK == 1 || m < M) && j < k && expert_of[m * k + j] >= 0;
                    w[t][u] = ok[t][u] ? tw[m * tw_s0 + j] : 0.0f;
                    v[t][u] = ok[t][u] ? ((const float4 *)(y + (m * k + j) * K))[c4]
                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
#pragma unroll
            for (int t = 0; t < TOK; t++) {
#pragma unroll
                for (int u = 0; u < J; u++) {
                    if (!ok[t][u])
                        continue;
                    acc[t][0] = fp8_add(acc[t][0], mf_mul(w[t][u], v[t][u].x));
                    acc[t][1] = fp8_add(acc[t][1], mf_mul(w[t][u], v[t][u].y));
                    acc[t][2] = fp8_add(acc[t][2], mf_mul(w[t][u], v[t][u].z));
                    acc[t][3] = fp8_add(acc[t][3], mf_mul(w[t][u], v[t][u].w));
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TOK; t++) {
            const long long m = g * TOK + t;
            if (TOK > 1 && m >= M)
                break;
            const long long at = m * out_s0 + 4 * c4;
            if (vec_out && out_dt == MF_DT_F32) {
                *(float4 *)((float *)out + at) =
                    make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
            } else if (vec_out) {
                uint32_t h[4];
#pragma unroll
                for (int u = 0; u < 4; u++)
                    h[u] = out_dt == MF_DT_BF16 ? mf_f32_to_bf16(acc[t][u])
                                                : mf_f32_to_f16(acc[t][u]);
                *(uint2 *)((uint16_t *)out + at) =
                    make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
            } else {
#pragma unroll
                for (int u = 0; u < 4; u++)
                    mfm_store(out, out_dt, at + u, acc[t][u]);
            }
        }
    }
}

/* Any K (bf16 calls of odd sizes): a column a thread, the same sums. */
__global__ void __launch_bounds__(RED_THREADS)
    moe_reduce_topk_any(const float *y, const int *expert_of, const float *tw, long long tw_s0,
                        long long M, long long k, long long K, void *out, long long out_s0,
                        int out_dt)
{
    const long long spans = (K + RED_THREADS - 1) / RED_THREADS;
    for (long long it = blockIdx.x; it < M * spans; it += gridDim.x) {
        const long long m = it / spans, c = (it - m * spans) * RED_THREADS + threadIdx.x;
        if (c >= K)
            continue;
        float acc = 0.0f;
        for (long long j = 0; j < k; j++)
            if (expert_of[m * k + j] >= 0)
                acc = fp8_add(acc, mf_mul(tw[m * tw_s0 + j], y[(m * k + j) * K + c]));
        mfm_store(out, out_dt, m * out_s0 + c, acc);
    }
}

moefuse_status moe_launch_reduce(moefuse_context *ctx, cuda_state *s, const char *op,
                                 const float *y, const int *expert_of, const mf_moe_args *a)
{
    const long long M = a->tokens, K = a->model_dim, k = a->topk;
    const float *tw = (const float *)mf_cuda_base(&a->topk_weights);
    const long long tw_s0 = a->topk_weights.stride[0], out_s0 = a->out.stride[0];
    void *out = mf_cuda_base(&a->out);
    const int out_dt = (int)a->out.dtype;
    const int w4 = K % 4 == 0 && ((uintptr_t)y & 15u) == 0;
    const uintptr_t vec_bytes = out_dt == MF_DT_F32 ? 16u : 8u;
    const int vec_out = ((uintptr_t)out & (vec_bytes - 1)) == 0 && out_s0 % 4 == 0;
    const long long width = w4 ? K / 4 : K, spans = (width + RED_THREADS - 1) / RED_THREADS;
    /* tokens an item: as many as keep RED_AHEAD slot rows in flight a thread */
    const int tok = !w4 ? 1 : k <= RED_AHEAD / 4 ? 4 : k <= RED_AHEAD / 2 ? 2 : 1;
    const unsigned grid = mf_cuda_grid(s, (M + tok - 1) / tok * spans, 1, 8);
    void (*vec)(const float *, const int *, const float *, long long, long long, long long,
                long long, void *, long long, int, int) =
        tok == 4 ? moe_reduce_topk<4> : tok == 2 ? moe_reduce_topk<2> : moe_reduce_topk<1>;
    if (w4)
        vec<<<grid, RED_THREADS, 0, s->stream>>>(y, expert_of, tw, tw_s0, M, k, K, out, out_s0,
                                                 out_dt, vec_out);
    else
        moe_reduce_topk_any<<<grid, RED_THREADS, 0, s->stream>>>(y, expert_of, tw, tw_s0, M, k,
                                                                 K, out, out_s0, out_dt);
    return mf_cuda_launched(ctx, op, "moe_reduce_topk");
}
