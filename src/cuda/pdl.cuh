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
 * (the kernel then calls mf_pdl_wait). Errors are left for mf_cuda_launched.
 */
template <typename P>
static inline void mf_launch_pdl(void (*k)(P), dim3 grid, unsigned threads, size_t smem,
                                 cudaStream_t stream, int pdl, const P &p)
{
    if (!pdl) {
        k<<<grid, threads, smem, stream>>>(p);
        return;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[1] = {};
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    (void)cudaLaunchKernelEx(&cfg, k, p);
}

#endif /* MOEFUSE_CUDA_PDL_CUH */
