/*
 * Hopper tensor-core instructions (sm_90a only): wgmma.mma_async m64n256k16 (m64n128k16 for
 * half tiles) and the narrow e4m3 m64n8..32k32 (the decode kernel's few slots), with f32
 * accumulators in registers and both operands read from shared memory, and the fences and
 * waits around them.
 * Shared by the bf16/f16 and FP8 tensor-core kernels. Everything here exists only in sm_90a
 * device code (MOE_WGMMA_DEVICE); the host checks the device before launching.
 */
#ifndef MOEFUSE_CUDA_WGMMA_CUH
#define MOEFUSE_CUDA_WGMMA_CUH

#include "cuda/hopper.cuh"

#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOE_WGMMA_DEVICE 1
#endif

/* k16 steps of one staged depth tile: 64 elements (128 bytes) of every row. */
#define WG_K16_STEPS 4

#ifdef MOE_WGMMA_DEVICE
/*
 * Shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte
 * swizzle, 8-row groups 1024 bytes apart (stride byte offset); the leading
 * byte offset is unused for swizzled K-major layouts (1 by convention).
 */
static __device__ __forceinline__ uint64_t wg_desc(uint32_t saddr)
{
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* The accumulator operands of a wgmma with 64 f32 a thread (m64n128: %0..%63) and with 128
 * (m64n256: %0..%127), as asm operand lists and "+f" outputs; the A and B descriptors follow. */
#define WG_DREGS_64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, " \
    "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, " \
    "%60, %61, %62, %63"
#define WG_DREGS WG_DREGS_64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, " \
    "%76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, " \
    "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, " \
    "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
    "%124, %125, %126, %127"
#define WG_DOUTS_64(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), \
    "+f"((d)[6]), "+f"((d)[7]), "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), \
    "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), "+f"((d)[16]), "+f"((d)[17]), \
    "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), \
    "+f"((d)[30]), "+f"((d)[31]), "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), \
    "+f"((d)[36]), "+f"((d)[37]), "+f"((d)[38]), "+f"((d)[39]), "+f"((d)[40]), "+f"((d)[41]), \
    "+f"((d)[42]), "+f"((d)[43]), "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), \
    "+f"((d)[48]), "+f"((d)[49]), "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), \
    "+f"((d)[54]), "+f"((d)[55]), "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), \
    "+f"((d)[60]), "+f"((d)[61]), "+f"((d)[62]), "+f"((d)[63])
#define WG_DOUTS(d) WG_DOUTS_64(d), WG_DOUTS_64((d) + 64)
/* A bf16 / f16 (T) wgmma of SHAPE whose accumulators are DREGS, descriptors operands %A and %B,
 * the scale-d flag %P. */
#define WG_MMA_SHAPE(SHAPE, T, DREGS, A, B, P)                                                    \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                               \
    "wgmma.mma_async.sync.aligned." SHAPE ".f32." T "." T " {" DREGS "}, %" A ", %" B ", p, 1, "  \
    "1, 0, 0;\n}\n"
#define WG_MMA(T) WG_MMA_SHAPE("m64n256k16", T, WG_DREGS, "128", "129", "130")
#define WG_MMA_N128(T) WG_MMA_SHAPE("m64n128k16", T, WG_DREGS_64, "64", "65", "66")

/* d += A (64 x 16, smem descriptor da) * B (16 x 256, smem descriptor db), K-major both. */
template <bool F16>
static __device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db)
{
    if (F16)
        asm volatile(WG_MMA("f16") : WG_DOUTS(d) : "l"(da), "l"(db), "n"(1));
    else
        asm volatile(WG_MMA("bf16") : WG_DOUTS(d) : "l"(da), "l"(db), "n"(1));
}

/* d += A (64 x 16, da) * B (16 x 128, db), K-major both: moe_ws.cu's half tiles, where each
 * warpgroup takes half of B's 256 rows. Each d element is the same sum, in the same order, as
 * m64n256k16 makes of it. */
template <bool F16>
static __device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db)
{
    if (F16)
        asm volatile(WG_MMA_N128("f16") : WG_DOUTS_64(d) : "l"(da), "l"(db), "n"(1));
    else
        asm volatile(WG_MMA_N128("bf16") : WG_DOUTS_64(d) : "l"(da), "l"(db), "n"(1));
}

/*
 * d = (accumulate ? d : 0) + A (64 x 32 e4m3, descriptor da) * B (32 x 8 NC e4m3, db), K-major:
 * the decode kernel's few slots as NC n8 columns (1..4); d[4 nt + v] is what mma.sync's m16n8
 * tile nt holds in d[v] for the thread's warp of the group (rows 16 w + lane / 4, and + 8).
 */
template <int NC>
static __device__ __forceinline__ void wgmma_e4m3_narrow(float (&d)[16], uint64_t da, uint64_t db,
                                                         int accumulate);
template <>
__device__ __forceinline__ void wgmma_e4m3_narrow<1>(float (&d)[16], uint64_t da, uint64_t db,
                                                     int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, "
                 "1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_e4m3_narrow<2>(float (&d)[16], uint64_t da, uint64_t db,
                                                     int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7}, %8, %9, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_e4m3_narrow<3>(float (&d)[16], uint64_t da, uint64_t db,
                                                     int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %14, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n24k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7, %8, %9, %10, %11}, %12, %13, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                 : "l"(da), "l"(db), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_e4m3_narrow<4>(float (&d)[16], uint64_t da, uint64_t db,
                                                     int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, "
                 "%6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "r"(accumulate));
}

static __device__ __forceinline__ void wgmma_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

static __device__ __forceinline__ void wgmma_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N> static __device__ __forceinline__ void wgmma_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/*
 * One depth tile as one commit group: d += A (64 rows, K-major at shared
 * address a0) x B (2 N rows at b0: 256 for 128 accumulators, m64n256k16;
 * 128 for 64, m64n128k16), its k16 steps in order. The caller waits for the
 * group (wgmma_wait) before it reuses the stage.
 */
template <bool F16, int N>
static __device__ __forceinline__ void wgmma_tile(float (&d)[N], uint32_t a0, uint32_t b0)
{
    static_assert(N == 128 || N == 64, "m64n256 or m64n128 accumulators");
    uint64_t da[WG_K16_STEPS], db[WG_K16_STEPS]; /* k16 steps: 32 bytes along the rows */
#pragma unroll
    for (int kk = 0; kk < WG_K16_STEPS; kk++) {
        da[kk] = wg_desc(a0 + kk * 32);
        db[kk] = wg_desc(b0 + kk * 32);
    }
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < WG_K16_STEPS; kk++) {
        if constexpr (N == 128)
            wgmma_m64n256k16<F16>(d, da[kk], db[kk]);
        else
            wgmma_m64n128k16<F16>(d, da[kk], db[kk]);
    }
    wgmma_commit();
}

/* Keeps the compiler from moving accumulator accesses across wgmma fences and waits. */
static __device__ __forceinline__ void pin(float (&d)[128])
{
#pragma unroll
    for (int i = 0; i < 128; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

static __device__ __forceinline__ void pin(float (&d)[64])
{
#pragma unroll
    for (int i = 0; i < 64; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* d = (accumulate ? d : 0) + A (64 x 32 e4m3, descriptor da) * B (32 x 128, db), K-major
 * (the FP8 large tile's wave step, moe_fp8_ws.cu). */
static __device__ __forceinline__ void wgmma_e4m3_m64n128k32(float (&d)[64], uint64_t da,
                                                             uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" WG_DREGS_64 "}, %64, "
                 "%65, p, 1, 1;\n}\n"
                 : WG_DOUTS_64(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}
#endif /* MOE_WGMMA_DEVICE */

#endif /* MOEFUSE_CUDA_WGMMA_CUH */
