/*
 * The row kernels' staged items (rows.cu): the ring of items in shared memory and the
 * quant and act_mul of a staged item, the table kernels' fast items among them.
 */
#ifndef MOEFUSE_CUDA_ROWS_STAGE_CUH
#define MOEFUSE_CUDA_ROWS_STAGE_CUH

#include "cuda/rows_quant.cuh"

/* ------------------------------------------------------------- staging */

/*
 * The staged kernels copy items to shared memory with cp.async (16-byte
 * copies that hold no registers while in flight): a ring of MF_STAGES items
 * per warp, so the loads of the next item overlap the arithmetic of this
 * one, and the item is read back one 256-channel slot at a time (few live
 * registers, so items can be 1024 channels: less per-item overhead). Each
 * lane copies and later reads only its own 16-byte chunks, so it needs
 * cp.async.wait_group and no barrier. Chunk (half hh, slot k, part j) of
 * lane l sits at 16 * (hh * slots * parts * 32 + (k * parts + j) * 32 + l);
 * parts = 2 for f32 (8 channels = 32 bytes), 1 for bf16/f16.
 */
#ifndef MF_STAGES
#define MF_STAGES 2
#endif
#ifndef MF_ST_SLOTS
#define MF_ST_SLOTS 4 /* slots of 256 channels in a staged item */
#endif
#define MF_ST_ITEM (MF_ST_SLOTS * 256)

static __device__ __forceinline__ void cp_async16(void *dst, const void *src)
{
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}

static __device__ __forceinline__ void cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/* Wait until at most MF_STAGES - 1 groups (the newer items) are in flight. */
static __device__ __forceinline__ void cp_async_wait_oldest(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(MF_STAGES - 1) : "memory");
}

/*
 * The sm_90 staging of 2-byte x (bf16/f16, whose staged layout is the row's
 * own: slot k, lane l at byte 16 (32 k + l)): one lane copies the item's gate
 * and up ranges with two bulk copies (cp.async.bulk, the TMA engine) that
 * complete on an mbarrier per ring slot, instead of every lane issuing
 * 16-byte cp.async copies and computing their addresses: a handful of
 * instructions per item where the per-lane copies cost ~5 per channel.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MF_BULK 1
#else
#define MF_BULK 0
#endif

static __device__ __forceinline__ void mbar_init(uint64_t *bar)
{
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(a) : "memory");
}

static __device__ __forceinline__ void mbar_init_fence(void)
{
#if MF_BULK
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

/* Lane 0: the item's bytes (gate, then up when activate) to stage, completing on bar. */
static __device__ __forceinline__ void bulk_fetch(char *stage, uint64_t *bar, const char *g,
                                                  const char *u, unsigned bytes, int activate)
{
#if MF_BULK
    const unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    const unsigned d = (unsigned)__cvta_generic_to_shared(stage);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b),
                 "r"(activate ? 2 * bytes : bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];\n" ::"r"(d),
                 "l"(g), "r"(bytes), "r"(b)
                 : "memory");
    if (activate)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                     "[%1], %2, [%3];\n" ::"r"(d + MF_ST_SLOTS * 32 * 16),
                     "l"(u), "r"(bytes), "r"(b)
                     : "memory");
#else
    (void)stage, (void)bar, (void)g, (void)u, (void)bytes, (void)activate;
#endif
}

/* Every lane: wait until the bulk copies of the slot's phase have landed. */
static __device__ __forceinline__ void mbar_wait(uint64_t *bar, unsigned phase)
{
#if MF_BULK
    const unsigned b = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n"
                 "}\n" ::"r"(b),
                 "r"(phase)
                 : "memory");
#else
    (void)bar, (void)phase;
#endif
}

/* Bytes of one staged item of one warp. */
static __host__ __device__ __forceinline__ int64_t stage_bytes(int64_t xes, int activate)
{
    return (activate ? 2 : 1) * MF_ST_SLOTS * (xes / 2) * 32 * 16;
}

static __device__ __forceinline__ void stage_fetch(const rows_params &p, int xdt, char *stage,
                                                   const char *xrow, int64_t ch, int lane)
{
    const int parts = xdt == MF_DT_F32 ? 2 : 1;
    const int64_t xes = xdt == MF_DT_F32 ? 4 : 2;
    const int half = MF_ST_SLOTS * parts * 32 * 16;
    const char *g = xrow + p.goff * xes, *u = xrow + p.uoff * xes;
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        const int64_t c0 = ch * MF_ST_ITEM + k * 256 + lane * 8;
        if (c0 >= p.H)
            break;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (j < parts) {
                char *d = stage + ((k * parts + j) * 32 + lane) * 16;
                cp_async16(d, g + c0 * xes + j * 16);
                if (p.activate)
                    cp_async16(d + half, u + c0 * xes + j * 16);
            }
        }
    }
}

/* The 8 values of (slot k, half hh) of a staged item; zeros past the row (n = 0). */
static __device__ __forceinline__ void stage_read8(const char *stage, int xdt, int activate,
                                                   int k, int hh, int n, int lane, float v[8])
{
    (void)activate;
    if (n == 0) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[i] = 0.0f;
        return;
    }
    if (xdt == MF_DT_F32) {
        const float4 *c = (const float4 *)stage + hh * MF_ST_SLOTS * 2 * 32 + k * 2 * 32 + lane;
        const float4 a = c[0], b = c[32];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
        const uint4 w = ((const uint4 *)stage)[hh * MF_ST_SLOTS * 32 + k * 32 + lane];
        unpack16(w.x, xdt, &v[0], &v[1]);
        unpack16(w.y, xdt, &v[2], &v[3]);
        unpack16(w.z, xdt, &v[4], &v[5]);
        unpack16(w.w, xdt, &v[6], &v[7]);
    }
}

/* max(a, b), NaN when either is NaN (one instruction from sm_80 on). */
static __device__ __forceinline__ float max_keep_nan(float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return (mf_is_nan(a) || mf_is_nan(b)) ? a + b : fmaxf(a, b);
#endif
}

/*
 * One slot of a quantizing item: h of 8 channels per lane from c0 (n = 8 or 0 past the row).
 * lpg: lanes per group (uniform; a constant in the hot kernels). The group's scale comes back
 * in *s_out / *ue_out (every lane of the group has it); store_item_scales writes it.
 */
static __device__ __forceinline__ void quant_slot(const rows_params &p, int lpg,
                                                  const char *xrow, char *qrow, float rs,
                                                  float es, int64_t c0, int n, const float h[8],
                                                  float *s_out, uint32_t *ue_out)
{
    /*
     * amax over the lane's finite values, then over its group's lanes. The fast
     * test: a maximum that keeps NaN is finite exactly when every h is; only
     * then is the finite filter skipped.
     */
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++)
        m = max_keep_nan(m, fabsf(h[i]));
    const int special = !mf_is_finite(m);
    if (special) {
        m = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++)
            m = mf_is_finite(h[i]) ? fmaxf(m, fabsf(h[i])) : m;
    }
#pragma unroll
    for (int off = 1; off < 16; off <<= 1) /* every lane takes part (lpg is uniform) */
        if (off < lpg)
            m = fmaxf(m, __shfl_xor_sync(MF_FULL, m, off));
    uint32_t ue;
    const float s = group_scale(p, m, &ue);
    *s_out = s;
    *ue_out = ue;
    if (n == 0)
        return;
    const int fast = mf_scale_fast_ok(s);
    uint32_t w[2];
    if (!special && fast && p.ue8m0) {
        /* s = 2^(ue - 127) with ue in [67, 187] here: 1/s is 2^(127 - ue), exact and normal */
        codes8_pow2(p.fp8, h, mf_bits_f32((254u - ue) << 23), w);
    } else {
        const float y = fast ? mf_div_fast(1.0f, s) : 1.0f / s;
        if (!special && fast) {
            codes8(p.fp8, h, s, y, w);
        } else {
            vals8 hv;
#pragma unroll
            for (int i = 0; i < 8; i++)
                hv.v[i] = h[i];
            const uint2 c = codes8_slow(make_opts(p, xrow, rs, es), c0, hv, s, y, p.fp8);
            w[0] = c.x;
            w[1] = c.y;
        }
    }
    if (p.vec_q) {
        *(uint2 *)(qrow + c0) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++)
            qrow[c0 + i] = (char)(w[i >> 2] >> ((i & 3) * 8));
    }
}

/*
 * The scales of an item of S slots, written once per item rather than once per slot (the
 * address arithmetic would cost a whole slot's worth of instructions each time): slot k left
 * group k * gps + j (gps = 32 / lpg groups per slot) in the lanes of j; lane i gathers group
 * i by one shuffle per slot and writes it. Groups past the row are skipped, but for the
 * unused bytes of the row's last packed word, which are written as 0.
 */
template <int S>
static __device__ __forceinline__ void store_item_scales(const rows_params &p, int lpg,
                                                         int64_t sbase, int64_t g0,
                                                         const float s[S], const uint32_t ue[S],
                                                         int lane)
{
    const int gps = 32 / lpg;
    const int src = (lane % gps) * lpg, slot = lane / gps;
    float sv = 0.0f;
    uint32_t uv = 0u;
#pragma unroll
    for (int k = 0; k < S; k++) {
        const float a = __shfl_sync(MF_FULL, s[k], src);
        const uint32_t b = p.ue8m0 ? __shfl_sync(MF_FULL, ue[k], src) : 0u;
        sv = k == slot ? a : sv;
        uv = k == slot ? b : uv;
    }
    const int64_t g = g0 + lane;
    if (slot >= S)
        return;
    if (g < p.Gn)
        put_scale_at(p, sbase, g, sv, uv);
    else if (p.layout == MF_LAYOUT_PACKED && g < p.Gw * 4)
        put_scale_at(p, sbase, g, 0.0f, 0u);
}

/* One warp item of the quantizing ops, from memory: row (e, t), 512 channels from ch * 512. */
static __device__ __forceinline__ void quant_item(const rows_params &p, int xdt, int act,
                                                  int plain, const float *tab, int64_t e,
                                                  int64_t t, int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *qrow = p.q + e * p.qs0 + t * p.qs1;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
    float h[2][8], u[2][8];
    int64_t c0[2];
    int n[2];
    /* every load of the item first: 2 KiB (bf16) in flight per warp */
#pragma unroll
    for (int k = 0; k < 2; k++) {
        c0[k] = ch * MF_ITEM + k * 256 + lane * 8;
        n[k] = c0[k] < p.H ? 8 : 0; /* H is a multiple of 32 here: all 8 or none */
        load8_values(p, xrow, p.goff, c0[k], xdt, n[k], h[k]);
        if (p.activate)
            load8_values(p, xrow, p.uoff, c0[k], xdt, n[k], u[k]);
    }
    float sc[2];
    uint32_t ue[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        if (p.activate)
            act8(p, act, plain, tab, h[k], u[k], rs, es);
        quant_slot(p, p.lpg, xrow, qrow, rs, es, c0[k], n[k], h[k], &sc[k], &ue[k]);
    }
    store_item_scales<2>(p, p.lpg, scale_base(p, e, t), (ch * MF_ITEM) >> p.glog, sc, ue, lane);
}

/*
 * act(g) * u of 8 channels computed for gates the table does not cover (zero, tiny, huge,
 * Inf, NaN: rare), with no options. Out of line, so the hot loop keeps none of its registers;
 * a NaN result is redone with the CPU's bits later, as on the computed path. (An activation
 * with a table takes no alpha.)
 */
static __device__ __noinline__ vals8 act8_missed(int act, vals8 g, vals8 u)
{
    vals8 h;
    for (int i = 0; i < 8; i++)
        h.v[i] = mf_activate_f32(act, 0.0f, g.v[i]) * u.v[i];
    return h;
}

/*
 * h of slot k of a staged item: 8 channels, or zeros past the row (n = 0). In the table
 * kernels (atab: bf16 x, no options) act(g) comes from the table, else from act8.
 */
static __device__ __forceinline__ void staged_h(const rows_params &p, int xdt, int act, int plain,
                                                const float *tab, const char *atab,
                                                const char *stage, int k, int n, int lane,
                                                float rs, float es, float h[8])
{
    if (!p.activate || n == 0) {
        stage_read8(stage, xdt, p.activate, k, 0, n, lane, h);
        return;
    }
    float u[8];
    stage_read8(stage, xdt, 1, k, 1, n, lane, u);
    if (atab) { /* a constant: NULL except in the table kernels */
        const uint4 w = ((const uint4 *)stage)[k * 32 + lane]; /* the gate half, bf16 */
        const uint32_t gw[4] = {w.x, w.y, w.z, w.w};
        if (mf_act8_table(atab, gw, u, h))
            return;
        vals8 gv, uv;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            gv.v[i] = mf_bits_f32(i & 1 ? gw[i >> 1] & 0xFFFF0000u : gw[i >> 1] << 16);
            uv.v[i] = u[i];
        }
        const vals8 hv = act8_missed(act, gv, uv);
#pragma unroll
        for (int i = 0; i < 8; i++)
            h[i] = hv.v[i];
        return;
    }
    stage_read8(stage, xdt, 1, k, 0, n, lane, h);
    act8(p, act, plain, tab, h, u, rs, es);
}

/* The same from a staged item (MF_ST_SLOTS slots of 256 channels), slot by slot. */
static __device__ __forceinline__ void quant_item_st(const rows_params &p, int xdt, int act,
                                                     int plain, int lpgc, const float *tab,
                                                     const char *atab, const char *stage,
                                                     int64_t e, int64_t t, int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *qrow = p.q + e * p.qs0 + t * p.qs1;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
    const int lpg = lpgc ? lpgc : p.lpg;
    float sc[MF_ST_SLOTS];
    uint32_t ue[MF_ST_SLOTS];
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        const int64_t c0 = ch * MF_ST_ITEM + k * 256 + lane * 8;
        const int n = c0 < p.H ? 8 : 0;
        float h[8];
        staged_h(p, xdt, act, plain, tab, atab, stage, k, n, lane, rs, es, h);
        quant_slot(p, lpg, xrow, qrow, rs, es, c0, n, h, &sc[k], &ue[k]);
    }
    store_item_scales<MF_ST_SLOTS>(p, lpg, scale_base(p, e, t), (ch * MF_ST_ITEM) >> p.glog, sc,
                                   ue, lane);
}

/*
 * The table kernels' item for G = 128 and e4m3 codes, of nv whole slots (4 but in a row's
 * last item; nv is not a template argument, since a second instance made ptxas spill): the
 * h of every slot first (act(g) from the table when ACT, else x itself), then the amax of
 * the item's groups by one transposing reduction (lane l ends with the
 * group of slot l & 3 in its half of the warp: 14 instructions where four separate
 * reductions take 32), one scale per lane instead of one per slot, the codes slot by slot.
 * Returns 0, having written nothing, when the item needs quant_item_st: a gate outside the
 * table, an h that is not finite, a scale outside the fast division's range (a uniform
 * vote each). The same bits as quant_item_st: the same h, an amax of the same values (a
 * maximum of finite values in any order), group_scale, and codes8 / codes8_pow2.
 */
template <int ACT>
static __device__ __forceinline__ int quant_item_fast(const rows_params &p, const char *atab,
                                                      const char *stage, int64_t e, int64_t t,
                                                      int64_t ch, int nv, int lane)
{
    static_assert(MF_ST_SLOTS == 4, "the transposing reduction takes four slots");
    float h[MF_ST_SLOTS][8], m[MF_ST_SLOTS];
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        m[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++)
            h[k][i] = 0.0f;
        if (k >= nv) /* past the row: a group of zeros, never stored */
            continue;
        const uint4 gv = ((const uint4 *)stage)[k * 32 + lane];
        const uint32_t g[4] = {gv.x, gv.y, gv.z, gv.w};
        if (ACT) {
            const uint4 uv = ((const uint4 *)stage)[(MF_ST_SLOTS + k) * 32 + lane];
            const uint32_t u[4] = {uv.x, uv.y, uv.z, uv.w};
            uint32_t off[8];
            if (__any_sync(MF_FULL, mf_tab_offsets8(g, off))) /* before any read of the table */
                return 0;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                h[k][2 * i] = *(const float *)(atab + off[2 * i]) * mf_bits_f32(u[i] << 16);
                h[k][2 * i + 1] =
                    *(const float *)(atab + off[2 * i + 1]) * mf_bits_f32(u[i] & 0xFFFF0000u);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                h[k][2 * i] = mf_bits_f32(g[i] << 16);
                h[k][2 * i + 1] = mf_bits_f32(g[i] & 0xFFFF0000u);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            m[k] = max_keep_nan(m[k], fabsf(h[k][i]));
    }
    const float all = max_keep_nan(max_keep_nan(m[0], m[1]), max_keep_nan(m[2], m[3]));
    if (__any_sync(MF_FULL, !(all <= FLT_MAX))) /* an Inf or a NaN */
        return 0;
    /* pairs of slots over lanes l, l ^ 1, then pairs of pairs over l, l ^ 2: each lane keeps
     * the half its partner sends it the other of */
    const int odd = lane & 1, two = lane & 2;
    const float s01 = odd ? m[0] : m[1], k01 = odd ? m[1] : m[0];
    const float s23 = odd ? m[2] : m[3], k23 = odd ? m[3] : m[2];
    const float r01 = fmaxf(k01, __shfl_xor_sync(MF_FULL, s01, 1)); /* slot odd */
    const float r23 = fmaxf(k23, __shfl_xor_sync(MF_FULL, s23, 1)); /* slot 2 + odd */
    float amax = fmaxf(two ? r23 : r01, __shfl_xor_sync(MF_FULL, two ? r01 : r23, 2));
    amax = fmaxf(amax, __shfl_xor_sync(MF_FULL, amax, 4));
    amax = fmaxf(amax, __shfl_xor_sync(MF_FULL, amax, 8)); /* slot lane & 3, group lane >> 4 */
    const int mine = (lane & 3) < nv; /* a group of the row */
    uint32_t ue;
    const float s = group_scale(p, amax, &ue);
    if (__any_sync(MF_FULL, mine && !mf_scale_fast_ok(s)))
        return 0;
    /* ue8m0: s = 2^(ue - 127), ue in [67, 187] here, so 1/s = 2^(127 - ue) is exact */
    const float y = p.ue8m0 ? mf_bits_f32((254u - ue) << 23) : mf_div_fast(1.0f, s);
    if ((lane & 12) == 0) {
        const int64_t g = ((ch * MF_ST_ITEM) >> 7) + 2 * (lane & 3) + (lane >> 4);
        if (mine)
            put_scale_at(p, scale_base(p, e, t), g, s, ue);
        else if (p.layout == MF_LAYOUT_PACKED && g < p.Gw * 4) /* the last word's unused bytes */
            put_scale_at(p, scale_base(p, e, t), g, 0.0f, 0u);
    }
    char *q = p.q + e * p.qs0 + t * p.qs1 + ch * MF_ST_ITEM + lane * 8;
    uint32_t w[MF_ST_SLOTS][2];
    if (p.ue8m0) {
#pragma unroll
        for (int k = 0; k < MF_ST_SLOTS; k++)
            codes8_pow2(1, h[k], __shfl_sync(MF_FULL, y, (lane & 16) | k), w[k]);
    } else {
#pragma unroll
        for (int k = 0; k < MF_ST_SLOTS; k++) {
            const int src = (lane & 16) | k;
            codes8(1, h[k], __shfl_sync(MF_FULL, s, src), __shfl_sync(MF_FULL, y, src), w[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++)
        if (k < nv)
            *(uint2 *)(q + k * 256) = make_uint2(w[k][0], w[k][1]);
    return 1;
}

/* One slot of act_mul: h of n (<= 8) channels from c0 (in g), rounded to out's (x's) dtype;
 * a NaN is redone with the CPU's bits. */
static __device__ __forceinline__ void mul_store(const rows_params &p, int xdt, const char *xrow,
                                                 char *orow, float rs, float es, int64_t c0,
                                                 int n, float g[8])
{
    if (n == 0)
        return;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (mf_is_nan(g[i]) && i < n)
            g[i] = h_exact(make_opts(p, xrow, rs, es), c0 + i);
    store8(orow, c0, xdt, p.vec_q, n, g);
}

/* One warp item of act_mul, from memory: 512 channels from ch * 512 (H may be odd). */
static __device__ __forceinline__ void mul_item(const rows_params &p, int xdt, int act,
                                                int plain, const float *tab, int64_t e,
                                                int64_t t, int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *orow = p.q + (e * p.qs0 + t * p.qs1) * p.qes;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
    float g[2][8], u[2][8];
    int64_t c0[2];
    int n[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        c0[k] = ch * MF_ITEM + k * 256 + lane * 8;
        const int64_t left = p.H - c0[k]; /* the last vector of an odd row is partial */
        n[k] = left >= 8 ? 8 : (left > 0 ? (int)left : 0);
        load8_values(p, xrow, p.goff, c0[k], xdt, n[k], g[k]);
        load8_values(p, xrow, p.uoff, c0[k], xdt, n[k], u[k]);
    }
#pragma unroll
    for (int k = 0; k < 2; k++) {
        if (n[k] == 0)
            continue;
        act8(p, act, plain, tab, g[k], u[k], rs, es);
        mul_store(p, xdt, xrow, orow, rs, es, c0[k], n[k], g[k]);
    }
}

/*
 * Slot k of a table kernel's act_mul (bf16 x and out, no options, 16-byte stores): act(g)
 * from the table times u, rounded by the hardware conversion. Returns 0, having written
 * nothing, when the slot needs staged_h and mul_store: a gate outside the table, or a NaN
 * (whose bits the reference chooses). A uniform vote each.
 */
static __device__ __forceinline__ int mul_slot_fast(const char *atab, const char *stage, int k,
                                                    int lane, char *out)
{
    const uint4 gv = ((const uint4 *)stage)[k * 32 + lane];
    const uint4 uv = ((const uint4 *)stage)[(MF_ST_SLOTS + k) * 32 + lane];
    const uint32_t g[4] = {gv.x, gv.y, gv.z, gv.w}, u[4] = {uv.x, uv.y, uv.z, uv.w};
    uint32_t off[8];
    if (__any_sync(MF_FULL, mf_tab_offsets8(g, off))) /* before any read of the table */
        return 0;
    float h[8], any = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        h[2 * i] = *(const float *)(atab + off[2 * i]) * mf_bits_f32(u[i] << 16);
        h[2 * i + 1] = *(const float *)(atab + off[2 * i + 1]) * mf_bits_f32(u[i] & 0xFFFF0000u);
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        any = max_keep_nan(any, h[i]);
    if (__any_sync(MF_FULL, mf_is_nan(any)))
        return 0;
    *(uint4 *)out = make_uint4(mf_bf16x2_rn(h[0], h[1]), mf_bf16x2_rn(h[2], h[3]),
                               mf_bf16x2_rn(h[4], h[5]), mf_bf16x2_rn(h[6], h[7]));
    return 1;
}

/* The same from a staged item (H is a multiple of 8 there: n is 8 or 0). */
static __device__ __forceinline__ void mul_item_st(const rows_params &p, int xdt, int act,
                                                   int plain, const float *tab, const char *atab,
                                                   const char *stage, int64_t e, int64_t t,
                                                   int64_t ch, int lane)
{
    const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
    char *orow = p.q + (e * p.qs0 + t * p.qs1) * p.qes;
    float rs, es;
    row_factors(p, e, t, &rs, &es);
#pragma unroll
    for (int k = 0; k < MF_ST_SLOTS; k++) {
        const int64_t c0 = ch * MF_ST_ITEM + k * 256 + lane * 8;
        const int n = c0 < p.H ? 8 : 0;
        /* the vote sends a slot that runs partly past the row to the general path */
        if (atab && p.vec_q && __all_sync(MF_FULL, n == 8) &&
            mul_slot_fast(atab, stage, k, lane, orow + c0 * 2))
            continue;
        float h[8];
        staged_h(p, xdt, act, plain, tab, atab, stage, k, n, lane, rs, es, h);
        mul_store(p, xdt, xrow, orow, rs, es, c0, n, h);
    }
}


#endif /* MOEFUSE_CUDA_ROWS_STAGE_CUH */
