/*
 * Programmatic dependent launch (sm_90): a kernel launched with the attribute may start
 * while the kernel before it in the stream finishes; it must call mf_pdl_wait before it
 * reads or writes anything that kernel may touch. mf_pdl_trigger lets the next such kernel
 * launch (counted per block). Both are no-ops in code compiled for older architectures,
 * which is why the host asks s->pdl (mf_cuda_probe_pdl) before setting the attribute.
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

#endif /* MOEFUSE_CUDA_PDL_CUH */
