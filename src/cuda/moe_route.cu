/*
 * Routing on the device and the top-k reduction (no host round trip).
 *
 * moe_route lists the valid slots s = m * k + j grouped by local expert:
 * count, one-block scan into offs / tiles / tile_expert, fill (the order of
 * slots inside an expert is unspecified, which changes no bit, see
 * moe_kernels.cuh). The count kernel also counts each token's valid slots,
 * for the final's fused top-k reduction (moe_kernels.cuh, moe_fused_reduce).
 *
 * Count and fill count a block's slots per expert in shared memory, so that
 * each block adds to an expert's global counter once: one atomic a slot on E
 * counters (a few kilobytes) set the pace of both kernels on an H200
 * (Qwen3-30B-A3B M = 4096, 32768 slots on 128 counters: 12.4 and 11.7 us).
 * A block takes ROUTE_CHUNK slots a round, but a count that zeroes invalid
 * slots' rows takes ROUTE_THREADS, so that as many blocks as before share
 * that stream of stores. Past ROUTE_LOCAL_E experts, one atomic a slot.
 */
#include "cuda/moe_kernels.cuh"

#define ROUTE_THREADS 256
#define ROUTE_PER_THREAD 8 /* slots a thread a round, their loads in flight together */
#define ROUTE_CHUNK (ROUTE_THREADS * ROUTE_PER_THREAD)
#define ROUTE_LOCAL_E 4096 /* experts counted in shared memory (16 KB) */
#define SCAN_THREADS 1024

/* The block's per-expert counters, zeroed (local: E <= ROUTE_LOCAL_E). */
static __device__ __forceinline__ void route_hist_zero(unsigned *hist, long long E)
{
    for (long long e = threadIdx.x; e < E; e += ROUTE_THREADS)
        hist[e] = 0u;
}

/* Expert of slot s (its token m = s / k), or -2 past the last slot. */
static __device__ __forceinline__ long long route_expert(const MoeRoute &rt, long long s)
{
    if (s >= rt.S)
        return -2;
    const long long m = s / rt.topk;
    return moe_slot_expert(rt, m, s - m * rt.topk);
}

/*
 * Count the valid slots of each expert; keep each slot's expert; zero invalid
 * rows of z. Then per token: its valid slots into tok_valid, and its row of zt
 * zeroed when it has none (the fused reduction never visits such a token).
 * PER slots a thread a round.
 */
template <int PER>
__global__ void __launch_bounds__(ROUTE_THREADS)
moe_route_count(MoeRoute rt, long long M, unsigned long long *count, int *expert_of,
                int *tok_valid, MoeZero z, MoeZero zt)
{
    __shared__ long long inval[ROUTE_THREADS * PER];
    __shared__ unsigned hist[ROUTE_LOCAL_E];
    __shared__ int ninval;
    const bool local = rt.E <= ROUTE_LOCAL_E;
    if (local)
        route_hist_zero(hist, rt.E);
    const long long step = (long long)gridDim.x * ROUTE_THREADS * PER;
    for (long long base = (long long)blockIdx.x * ROUTE_THREADS * PER; base < rt.S; base += step) {
        if (threadIdx.x == 0)
            ninval = 0;
        __syncthreads(); /* (the first round: hist zeroed too) */
        long long e[PER];
#pragma unroll
        for (int u = 0; u < PER; u++)
            e[u] = route_expert(rt, base + u * ROUTE_THREADS + threadIdx.x);
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const long long s = base + u * ROUTE_THREADS + threadIdx.x;
            if (e[u] == -2)
                continue;
            expert_of[s] = (int)e[u];
            if (e[u] >= 0) {
                if (local)
                    atomicAdd(hist + e[u], 1u);
                else
                    atomicAdd(count + e[u], 1ull);
            } else if (z.p) {
                inval[atomicAdd(&ninval, 1)] = s;
            }
        }
        __syncthreads();
        /* the whole block zeroes the invalid rows, coalesced along the row */
        const int n = ninval;
        for (int i = 0; i < n; i++) {
            const long long si = inval[i], m = si / rt.topk, j = si - m * rt.topk;
            const long long row = m * z.s0 + j * z.s1;
            for (long long c = threadIdx.x; c < z.width; c += ROUTE_THREADS)
                mfm_store(z.p, z.dt, row + c, 0.0f);
        }
        __syncthreads(); /* ninval and inval are rewritten next round */
    }
    if (local) {
        __syncthreads();
        for (long long x = threadIdx.x; x < rt.E; x += ROUTE_THREADS)
            if (hist[x])
                atomicAdd(count + x, (unsigned long long)hist[x]);
    }
    for (long long base = (long long)blockIdx.x * ROUTE_THREADS; base < M;
         base += (long long)gridDim.x * ROUTE_THREADS) {
        if (threadIdx.x == 0)
            ninval = 0;
        __syncthreads();
        const long long m = base + threadIdx.x;
        if (m < M) {
            int nv = 0;
            for (long long j = 0; j < rt.topk; j++)
                nv += moe_slot_expert(rt, m, j) >= 0;
            tok_valid[m] = nv;
            if (nv == 0 && zt.p)
                inval[atomicAdd(&ninval, 1)] = m;
        }
        __syncthreads();
        const int n = ninval;
        for (int i = 0; i < n; i++)
            for (long long c = threadIdx.x; c < zt.width; c += ROUTE_THREADS)
                mfm_store(zt.p, zt.dt, inval[i] * zt.s0 + c, 0.0f);
        __syncthreads();
    }
}

/* Inclusive scan of v over the 1024 threads of the block; *total gets the block's sum. */
static __device__ long long block_scan(long long v, long long *sums, long long *total)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const long long n = __shfl_up_sync(0xFFFFFFFFu, v, o);
        if (lane >= o)
            v += n;
    }
    if (lane == 31)
        sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        long long w = sums[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const long long n = __shfl_up_sync(0xFFFFFFFFu, w, o);
            if (lane >= o)
                w += n;
        }
        sums[lane] = w;
    }
    __syncthreads();
    if (warp > 0)
        v += sums[warp - 1];
    *total = sums[31];
    __syncthreads(); /* sums is reused by the next scan */
    return v;
}

/* Prefix sums of the counts (slots and tiles of bm slots), then the expert of every tile. */
__global__ void __launch_bounds__(SCAN_THREADS)
moe_route_scan(long long E, int bm, const unsigned long long *count, unsigned long long *fill,
               long long *offs, long long *tiles, int *tile_expert)
{
    __shared__ long long sums[32];
    long long carry_n = 0, carry_t = 0;
    for (long long base = 0; base < E; base += SCAN_THREADS) {
        const long long e = base + threadIdx.x;
        const long long n = e < E ? (long long)count[e] : 0;
        const long long t = (n + bm - 1) / bm;
        long long tot_n, tot_t;
        const long long in = block_scan(n, sums, &tot_n);
        const long long it = block_scan(t, sums, &tot_t);
        if (e < E) {
            offs[e] = carry_n + in - n;
            fill[e] = (unsigned long long)(carry_n + in - n);
            tiles[e] = carry_t + it - t;
        }
        carry_n += tot_n;
        carry_t += tot_t;
    }
    if (threadIdx.x == 0) {
        offs[E] = carry_n;
        tiles[E] = carry_t;
    }
    __syncthreads(); /* tiles[] written above is read back below by other threads */
    for (long long t = threadIdx.x; t < carry_t; t += SCAN_THREADS) {
        long long lo = 0, hi = E - 1; /* last e with tiles[e] <= t: the one that has tile t */
        while (lo < hi) {
            const long long mid = (lo + hi + 1) / 2;
            if (tiles[mid] <= t)
                lo = mid;
            else
                hi = mid - 1;
        }
        tile_expert[t] = (int)lo;
    }
}

/*
 * The list: each valid slot at its expert's next free entry. A block takes ROUTE_CHUNK slots:
 * their ranks among the chunk's slots of their expert in shared memory, then one global atomic
 * an expert for the chunk's run of entries.
 */
__global__ void __launch_bounds__(ROUTE_THREADS)
moe_route_fill(long long S, long long E, const int *expert_of, unsigned long long *fill,
               long long *list)
{
    __shared__ unsigned hist[ROUTE_LOCAL_E];
    __shared__ unsigned long long first[ROUTE_LOCAL_E];
    const bool local = E <= ROUTE_LOCAL_E;
    const long long step = (long long)gridDim.x * ROUTE_CHUNK;
    for (long long base = (long long)blockIdx.x * ROUTE_CHUNK; base < S; base += step) {
        if (local)
            route_hist_zero(hist, E);
        __syncthreads();
        int e[ROUTE_PER_THREAD];
        unsigned rank[ROUTE_PER_THREAD];
#pragma unroll
        for (int u = 0; u < ROUTE_PER_THREAD; u++) {
            const long long s = base + u * ROUTE_THREADS + threadIdx.x;
            e[u] = s < S ? expert_of[s] : -1;
        }
#pragma unroll
        for (int u = 0; u < ROUTE_PER_THREAD; u++) {
            if (e[u] < 0)
                continue;
            if (local)
                rank[u] = atomicAdd(hist + e[u], 1u);
            else
                list[atomicAdd(fill + e[u], 1ull)] = base + u * ROUTE_THREADS + threadIdx.x;
        }
        if (!local)
            continue; /* (block-uniform) */
        __syncthreads();
        for (long long x = threadIdx.x; x < E; x += ROUTE_THREADS)
            if (hist[x])
                first[x] = atomicAdd(fill + x, (unsigned long long)hist[x]);
        __syncthreads();
#pragma unroll
        for (int u = 0; u < ROUTE_PER_THREAD; u++)
            if (e[u] >= 0)
                list[first[e[u]] + rank[u]] = base + u * ROUTE_THREADS + threadIdx.x;
        __syncthreads(); /* hist and first are rewritten next round */
    }
}

moefuse_status moe_route(moefuse_context *ctx, cuda_state *s, const char *op, const MoeRoute *rt,
                         const MoeRouteBufs *b, int bm, int64_t M, const MoeZero *zero,
                         const MoeZero *zero_tok)
{
    /* the expert counts and the fused reduction's arrival counters are adjacent: one memset */
    const size_t zbytes = b->cnt ? (size_t)((char *)(b->cnt + b->cnt_n) - (char *)b->count)
                                 : (size_t)rt->E * sizeof *b->count;
    cudaError_t e = cudaMemsetAsync(b->count, 0, zbytes, s->stream);
    if (e != cudaSuccess)
        return mf_cuda_fail(ctx, e, op, "cudaMemsetAsync(route counts)");
    const unsigned grid = mf_cuda_grid(s, rt->S, ROUTE_CHUNK, 1);
    if (zero->p)
        moe_route_count<1><<<mf_cuda_grid(s, rt->S, ROUTE_THREADS, 8), ROUTE_THREADS, 0,
                             s->stream>>>(*rt, M, b->count, b->expert_of, b->tok_valid, *zero,
                                          *zero_tok);
    else
        moe_route_count<ROUTE_PER_THREAD><<<grid, ROUTE_THREADS, 0, s->stream>>>(
            *rt, M, b->count, b->expert_of, b->tok_valid, *zero, *zero_tok);
    MF_TRY(mf_cuda_launched(ctx, op, "moe_route_count"));
    moe_route_scan<<<1, SCAN_THREADS, 0, s->stream>>>(rt->E, bm, b->count, b->fill, b->offs,
                                                      b->tiles, b->tile_expert);
    MF_TRY(mf_cuda_launched(ctx, op, "moe_route_scan"));
    moe_route_fill<<<grid, ROUTE_THREADS, 0, s->stream>>>(rt->S, rt->E, b->expert_of, b->fill,
                                                         b->list);
    return mf_cuda_launched(ctx, op, "moe_route_fill");
}
