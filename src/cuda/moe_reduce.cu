/*
 * The reduced final's top-k sum, after a routed final's GEMM (bf16, f16, f32 and FP8 alike;
 * docs/NUMERICS.md "MoE" and "FP8 MoE"): out[m, c] = the sum over the valid slots
 * j = 0..k-1 of w[m, j] * y[m, j, c], from 0, in f32 with the CPU's NaN bits, rounded once to
 * out's dtype (a token without a valid slot gets 0). y [M * k, K] is f32 scratch written by
 * the GEMM. (Decode-sized calls sum inside their GEMM instead: one launch less.)
 *
 * A pure stream (K * 4 bytes a slot in, a row of out back), so the kernel is shaped for the
 * memory's pace: four columns a thread by 16-byte loads where K is a multiple of 4 (y's rows
 * lie in 256-byte aligned scratch), and a token's slot rows loaded RED_AHEAD at a time before they
 * are summed in slot order, so that many loads are in flight a thread.
 */
#include "cuda/fp8.cuh"
#include "cuda/moe_internal.h"

#define RED_THREADS 256
#define RED_AHEAD 8 /* slot rows in flight a thread */
/* at most 64 registers a thread (76 without the bound): 4 blocks an SM rather than 3. A probe
 * on an H200 (y of 32768 slots): 75.3 -> 70.1 us at K = 2048 (3.8 -> 4.1 TB/s), 249 -> 234 at
 * K = 7168, where a read of y alone takes 62 and 209 */
#define RED_MIN_BLOCKS 4

/*
 * A block takes items (token m, RED_THREADS * 4 columns), where K is a multiple of 4 and y
 * 16-byte aligned (every FP8 call, the models' shapes). vec_out: out's rows take one 16-byte
 * (f32) or 8-byte (bf16, f16) store of four values.
 */
__global__ void __launch_bounds__(RED_THREADS, RED_MIN_BLOCKS)
    moe_reduce_topk(const float *y, const int *expert_of, const float *tw, long long tw_s0,
                    long long M, long long k, long long K, void *out, long long out_s0,
                    int out_dt, int vec_out)
{
    const long long K4 = K / 4, spans = (K4 + RED_THREADS - 1) / RED_THREADS;
    for (long long it = blockIdx.x; it < M * spans; it += gridDim.x) {
        const long long m = it / spans, c4 = (it - m * spans) * RED_THREADS + threadIdx.x;
        if (c4 >= K4)
            continue;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (long long j0 = 0; j0 < k; j0 += RED_AHEAD) {
            float4 v[RED_AHEAD];
            float w[RED_AHEAD];
            bool ok[RED_AHEAD];
#pragma unroll
            for (int u = 0; u < RED_AHEAD; u++) {
                const long long j = j0 + u;
                /* an invalid slot's row is never read, nor added: not even a signed zero */
                ok[u] = j < k && expert_of[m * k + j] >= 0;
                w[u] = ok[u] ? tw[m * tw_s0 + j] : 0.0f;
                v[u] = ok[u] ? ((const float4 *)(y + (m * k + j) * K))[c4]
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < RED_AHEAD; u++) {
                if (!ok[u])
                    continue;
                acc[0] = fp8_add(acc[0], mf_mul(w[u], v[u].x));
                acc[1] = fp8_add(acc[1], mf_mul(w[u], v[u].y));
                acc[2] = fp8_add(acc[2], mf_mul(w[u], v[u].z));
                acc[3] = fp8_add(acc[3], mf_mul(w[u], v[u].w));
            }
        }
        const long long at = m * out_s0 + 4 * c4;
        if (vec_out && out_dt == MF_DT_F32) {
            *(float4 *)((float *)out + at) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        } else if (vec_out) {
            uint32_t h[4];
#pragma unroll
            for (int u = 0; u < 4; u++)
                h[u] = out_dt == MF_DT_BF16 ? mf_f32_to_bf16(acc[u]) : mf_f32_to_f16(acc[u]);
            *(uint2 *)((uint16_t *)out + at) = make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
        } else {
#pragma unroll
            for (int u = 0; u < 4; u++)
                mfm_store(out, out_dt, at + u, acc[u]);
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
    const long long width = w4 ? K / 4 : K;
    const unsigned grid = mf_cuda_grid(s, M * ((width + RED_THREADS - 1) / RED_THREADS), 1, 8);
    if (w4)
        moe_reduce_topk<<<grid, RED_THREADS, 0, s->stream>>>(y, expert_of, tw, tw_s0, M, k, K,
                                                             out, out_s0, out_dt, vec_out);
    else
        moe_reduce_topk_any<<<grid, RED_THREADS, 0, s->stream>>>(y, expert_of, tw, tw_s0, M, k,
                                                                 K, out, out_s0, out_dt);
    return mf_cuda_launched(ctx, op, "moe_reduce_topk");
}
