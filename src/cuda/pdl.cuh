/*
 * Programmatic dependent launch (sm_90): a kernel launched with the attribute may start
 * while the kernel before it in the stream finishes; it must call mf_pdl_wait before it
 * reads or writes anything that kernel may touch. mf_pdl_trigger lets the next such kernel
 * launch (counted per block). Both are no-ops in code compiled for older architectures,
 * which is why the host asks s->pdl (mf_cuda_probe_pdl) before setting the attribute
 * (mf_launch_pdl).
 */
#ifndef MOEFUSE_CUDA_PDL_CUH
#define MOEFUSE_CUDA_PDL_CUH

static __device__ __forceinline__ void mf_pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void mf_pdl_trigger(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/*
 * Launches kernel k(p) on stream, with the programmatic-dependent-launch attribute when pdl
 * (the kernel then calls mf_pdl_wait) and in clusters of `cluster` blocks along x when it is
 * above 1 (sm_90; gridDim.x a multiple of it). Errors are left for mf_cuda_launched.
 */
template <typename P>
static inline void mf_launch_pdl(void (*k)(P), dim3 grid, unsigned threads, size_t smem,
                                 cudaStream_t stream, int pdl, const P &p, unsigned cluster = 1)
{
    if (!pdl && cluster <= 1) {
        k<<<grid, threads, smem, stream>>>(p);
        return;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[2] = {};
    unsigned n = 0;
    if (pdl) {
        at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[n].val.programmaticStreamSerializationAllowed = 1;
        n++;
    }
    if (cluster > 1) {
        at[n].id = cudaLaunchAttributeClusterDimension;
        at[n].val.clusterDim.x = cluster;
        at[n].val.clusterDim.y = 1;
        at[n].val.clusterDim.z = 1;
        n++;
    }
    cfg.attrs = at;
    cfg.numAttrs = n;
    (void)cudaLaunchKernelEx(&cfg, k, p);
}

#endif /* MOEFUSE_CUDA_PDL_CUH */
