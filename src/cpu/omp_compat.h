/* OpenMP pragmas that vanish cleanly (no -Wunknown-pragmas) when built without OpenMP. */
#ifndef MOEFUSE_CPU_OMP_COMPAT_H
#define MOEFUSE_CPU_OMP_COMPAT_H

#define MF_OMP_STR_(...) #__VA_ARGS__
#if defined(_OPENMP) || defined(MOEFUSE_OPENMP_SIMD)
#define MF_OMP(...) _Pragma(MF_OMP_STR_(omp __VA_ARGS__))
#else
#define MF_OMP(...)
#endif

#endif /* MOEFUSE_CPU_OMP_COMPAT_H */
