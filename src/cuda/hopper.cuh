/*
 * Hopper (sm_90) asynchronous-copy primitives for the warp-specialised GEMM
 * (moe_ws.cu): mbarriers, TMA tensor loads, cp.async arrivals on mbarriers,
 * the proxy fence and register reallocation, plus HpPipe, the
 * position (stage, phase) of a role in a ring of shared-memory stages; and
 * the thread-block-cluster pieces of the split-depth decode (moe_mma.cu).
 *
 * Only sm_90 device code uses them; in other device passes they compile to
 * nothing, and the host never launches their callers there.
 */
#ifndef MOEFUSE_CUDA_HOPPER_CUH
#define MOEFUSE_CUDA_HOPPER_CUH

#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define HP_ASM(...) asm volatile(__VA_ARGS__)
#else
#define HP_ASM(...) ((void)0)
#endif

/* Generic-proxy writes to shared memory (stores, cp.async) made visible to the async proxy
 * (wgmma operand reads, TMA). */
static __device__ __forceinline__ void hp_fence_proxy_async(void)
{
    HP_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* An mbarrier in shared memory that completes a phase after `count` arrivals. */
static __device__ __forceinline__ void hp_mbar_init(uint32_t bar, unsigned count)
{
    HP_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/* After the inits and before the barrier that publishes them to the block. */
static __device__ __forceinline__ void hp_mbar_init_fence(void)
{
    HP_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

static __device__ __forceinline__ void hp_mbar_arrive(uint32_t bar)
{
    HP_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

/* One arrival that also announces `bytes` of TMA data the phase waits for. */
static __device__ __forceinline__ void hp_mbar_arrive_tx(uint32_t bar, unsigned bytes)
{
    HP_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
           : "memory");
}

/*
 * Waits until the phase of parity `parity` has completed (a fresh barrier: parity 1 passes).
 * CLUSTER: a phase that other blocks of the cluster complete, acquiring at cluster scope what
 * they released (hp_mbar_arrive_cluster).
 */
template <bool CLUSTER>
static __device__ __forceinline__ void hp_mbar_wait_scoped(uint32_t bar, unsigned parity)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done;
    do {
        if constexpr (CLUSTER)
            asm volatile("{\n.reg .pred p;\n"
                         "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(bar), "r"(parity)
                         : "memory");
        else
            asm volatile("{\n.reg .pred p;\n"
                         "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done)
                         : "r"(bar), "r"(parity)
                         : "memory");
    } while (!done);
#else
    (void)bar, (void)parity;
#endif
}

static __device__ __forceinline__ void hp_mbar_wait(uint32_t bar, unsigned parity)
{
    hp_mbar_wait_scoped<false>(bar, parity);
}

static __device__ __forceinline__ void hp_mbar_wait_cluster(uint32_t bar, unsigned parity)
{
    hp_mbar_wait_scoped<true>(bar, parity);
}

/* The barrier's current phase also waits for `bytes` of transactions (no arrival). */
static __device__ __forceinline__ void hp_mbar_expect_tx(uint32_t bar, unsigned bytes)
{
    HP_ASM("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
           : "memory");
}

/* One arrival on an mbarrier of another block of the cluster (an address from
 * hp_cluster_map), releasing at cluster scope what this thread has written or seen. */
static __device__ __forceinline__ void hp_mbar_arrive_cluster(uint32_t bar)
{
    HP_ASM("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar)
           : "memory");
}

/*
 * The barrier receives one arrival once every cp.async this thread issued
 * before has landed. noinc: the arrival is one of those the barrier was
 * initialised to expect.
 */
static __device__ __forceinline__ void hp_cp_async_arrive(uint32_t bar)
{
    HP_ASM("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

/* Pulls a tensor map (kernel parameter) into the descriptor cache ahead of its first use. */
static __device__ __forceinline__ void hp_tma_prefetch(const void *map)
{
    HP_ASM("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

/*
 * TMA: the box at coordinates (c0, c1, c2) of a 3-D tensor map into shared
 * memory at dst; completes `bytes` on bar (announced by hp_mbar_arrive_tx).
 * Parts of the box outside the tensor arrive as zeros.
 */
static __device__ __forceinline__ void hp_tma_load_3d(uint32_t dst, const void *map, uint32_t bar,
                                                      int c0, int c1, int c2)
{
    HP_ASM("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
           " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
           "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
           : "memory");
}

/*
 * A bulk copy of `bytes` (a multiple of 16) from global src to shared dst, both 16-byte
 * aligned; completes the bytes on bar (announced by hp_mbar_arrive_tx).
 */
static __device__ __forceinline__ void hp_bulk_load(uint32_t dst, const void *src, unsigned bytes,
                                                    uint32_t bar)
{
    HP_ASM("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
           "[%3];\n" ::"r"(dst),
           "l"(src), "r"(bytes), "r"(bar)
           : "memory");
}

/* An L2 policy under which lines go first: for data read once (a weight stream). */
static __device__ __forceinline__ uint64_t hp_policy_evict_first(void)
{
    uint64_t pol = 0;
    HP_ASM("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}

/* hp_tma_load_3d under an L2 policy (hp_policy_evict_first). */
static __device__ __forceinline__ void hp_tma_load_3d_hint(uint32_t dst, const void *map,
                                                           uint32_t bar, int c0, int c1, int c2,
                                                           uint64_t policy)
{
    HP_ASM("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
           ".L2::cache_hint [%0], [%1, {%3, %4, %5}], [%2], %6;\n" ::"r"(dst),
           "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "l"(policy)
           : "memory");
}

/* Register reallocation between warpgroups (every warp of the warpgroup executes it). */
template <int N> static __device__ __forceinline__ void hp_regs_dec(void)
{
    HP_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <int N> static __device__ __forceinline__ void hp_regs_inc(void)
{
    HP_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/*
 * Where a role stands in a ring of STAGES entries: the entry it uses next and
 * the parity of that entry's barrier phase it waits for. Producer and
 * consumers each keep one per ring (moe_ws.cu: the operand stages, advanced
 * once per depth tile across tiles, and the tile slots, once per tile).
 */
template <int STAGES> struct HpPipe {
    int stage;
    unsigned phase;

    __device__ __forceinline__ void advance(void)
    {
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1u;
        }
    }
};

/*
 * Thread block clusters (sm_90): every thread of every block of the cluster
 * arrives, then waits for all; release / acquire order the shared-memory
 * writes before the barrier with the reads of other blocks after it.
 */
static __device__ __forceinline__ void hp_cluster_sync(void)
{
    HP_ASM("barrier.cluster.arrive.release.aligned;\n"
           "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

/* The address in block `rank` of the cluster of this block's shared address `addr`. */
static __device__ __forceinline__ uint32_t hp_cluster_map(uint32_t addr, unsigned rank)
{
    uint32_t out = 0;
    HP_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
}

/* Four floats from another block's shared memory (an address from hp_cluster_map). */
static __device__ __forceinline__ float4 hp_cluster_ld4(uint32_t addr)
{
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    HP_ASM("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
           : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
           : "r"(addr)
           : "memory");
    return v;
}

#endif /* MOEFUSE_CUDA_HOPPER_CUH */
