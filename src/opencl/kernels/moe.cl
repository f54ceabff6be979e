/*
 * moe_gate and moe_final, first version: one work-group per token slot (gate)
 * or token (reduced final) and a block of output columns, one output column
 * per work-item. The activation row (x[m] or h[m, j]) is staged in local
 * memory in chunks and shared by the work-group; each work-item walks its
 * weight row. Every dot product is one work-item's fma chain in the order
 * k = 0, 1, ..., so results are reproducible run to run (and, with a correct
 * fma, equal to the CPU backend's).
 * The reduction over top-k slots runs inside the work-item in j order: no
 * atomics, nothing depends on scheduling.
 */

/* Local expert of slot (m, j), or -1 when invalid (NUMERICS.md "Routing"). */
inline long mf_slot_expert(__global const int *ids, long io, long is0, long m, long j,
                           __global const int *map, long mo, long ms0, int has_map, long experts,
                           long global_experts)
{
    const long id = ids[io + m * is0 + j];
    if (id < 0 || id >= global_experts)
        return -1;
    if (!has_map)
        return id < experts ? id : -1;
    const long e = map[mo + id * ms0];
    return (e >= 0 && e < experts) ? e : -1;
}

/* The gate's activation options, as the kernels take them (moefuse_moe_options). */
typedef struct mf_gate_fn {
    int act;
    float alpha, limit, beta;
} mf_gate_fn;

inline mf_gate_fn mf_gate_fn_of(int act, float alpha, float limit, float beta)
{
    mf_gate_fn f = {act, alpha, limit, beta};
    return f;
}

/*
 * Column col of h from its two f32 dot products (every gate kernel ends here):
 * plus the bias rows grow + col * step and urow + col * step of b1[e] (at
 * bbase), clamped when limit > 0, the up offset, then act(gate) * up
 * (NUMERICS.md "MoE").
 */
inline float mf_gate_out(float ag, float au, __global const uchar *b1, int bdt, long bbase,
                         int has_b, long grow, long urow, long step, long col, mf_gate_fn f)
{
    if (has_b) {
        ag = ag + mf_load(b1, bdt, bbase + grow + col * step);
        au = au + mf_load(b1, bdt, bbase + urow + col * step);
    }
    if (f.limit > 0.0f) {
        ag = mf_clamp_gate(ag, f.limit);
        au = mf_clamp_up(au, f.limit);
    }
    au = mf_add_up_offset(au, f.beta);
    return mf_mul(mf_activate_f32(f.act, f.alpha, ag), au);
}

/* Stage elements [k0, k0 + n) of an activation row into local memory as f32. */
inline void mf_stage(__local float *buf, __global const uchar *a, int adt, long base, long k0,
                     long n)
{
    for (long c = (long)get_local_id(0); c < n; c += (long)get_local_size(0))
        buf[c] = mf_load(a, adt, base + k0 + c);
}

/*
 * The argument lists of the gate and final kernels, here and in moe_gemv.cl: ops_moe.c fills
 * them with the same calls for both (this file's kernels take a local buffer and its length
 * after them), so they are written once.
 */
#define MF_MOE_GATE_PARAMS                                                                     \
    __global const uchar *x, long xo, long xs0, int xdt,                                       \
    __global const uchar *w1, long wo, long ws0, long ws1,                                     \
    __global const uchar *b1, long bo, long bs0, int bdt, int has_b,                           \
    __global const int *ids, long io, long is0,                                                \
    __global const int *map, long mo, long ms0, int has_map,                                   \
    long topk, long kdim, long idim, long experts, long global_experts,                        \
    int act, int order, float limit, float alpha, float beta,                                  \
    __global uchar *h, long ho, long hs0, long hs1, int hdt

#define MF_MOE_FINAL_PARAMS                                                                    \
    __global const uchar *hp, long ho, long hs0, long hs1, int hdt,                            \
    __global const uchar *w2, long wo, long ws0, long ws1,                                     \
    __global const uchar *b2, long bo, long bs0, int bdt, int has_b,                           \
    __global const int *ids, long io, long is0,                                                \
    __global const float *tw, long two, long tws0,                                             \
    __global const int *map, long mo, long ms0, int has_map,                                   \
    long topk, long kdim, long idim, long experts, long global_experts,                        \
    int reduce, __global uchar *out, long oo, long os0, long os1, int odt

/*
 * Gate: global (round_up(I, wg), M * k). Column i of slot (m, j) needs the
 * gate row and the up row of w1[e].
 */
__kernel void mf_moe_gate(MF_MOE_GATE_PARAMS, __local float *xs, long chunk)
{
    const long slot = (long)get_group_id(1);
    const long m = slot / topk, j = slot % topk;
    const long col = (long)get_global_id(0);
    const int live = col < idim;
    const long hidx = ho + m * hs0 + j * hs1 + col;
    const long e = mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts,
                                  global_experts);
    if (e < 0) { /* the whole work-group leaves together: no barrier is skipped by some */
        if (live)
            mf_store(h, hdt, hidx, 0.0f);
        return;
    }
    const long grow = mf_gate_at(order, idim), urow = mf_up_at(order, idim);
    const long step = mf_gate_step(order);
    const long wg_base = wo + e * ws0 + (grow + col * step) * ws1;
    const long wu_base = wo + e * ws0 + (urow + col * step) * ws1;
    float ag = 0.0f, au = 0.0f;
    for (long k0 = 0; k0 < kdim; k0 += chunk) {
        const long n = kdim - k0 < chunk ? kdim - k0 : chunk;
        mf_stage(xs, x, xdt, xo + m * xs0, k0, n);
        barrier(CLK_LOCAL_MEM_FENCE);
        if (live)
            for (long c = 0; c < n; c++) {
                ag = fma(xs[c], mf_load(w1, xdt, wg_base + k0 + c), ag);
                au = fma(xs[c], mf_load(w1, xdt, wu_base + k0 + c), au);
            }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (live)
        mf_store(h, hdt, hidx,
                 mf_gate_out(ag, au, b1, bdt, bo + e * bs0, has_b, grow, urow, step, col,
                             mf_gate_fn_of(act, alpha, limit, beta)));
}

/*
 * y[r] of slot (m, j) with expert e: h[m, j] @ w2[e, r]^T (row wbase), plus b2[e, r] (element
 * bidx) when has_b. Every work-item calls it (barriers); only a live one's result is y.
 */
inline float mf_final_y(__local float *hsl, __global const uchar *hp, long hbase, int hdt,
                        __global const uchar *w2, long wbase, __global const uchar *b2, int bdt,
                        long bidx, int has_b, long idim, long chunk, int live)
{
    float acc = 0.0f;
    for (long k0 = 0; k0 < idim; k0 += chunk) {
        const long n = idim - k0 < chunk ? idim - k0 : chunk;
        mf_stage(hsl, hp, hdt, hbase, k0, n);
        barrier(CLK_LOCAL_MEM_FENCE);
        if (live)
            for (long c = 0; c < n; c++)
                acc = fma(hsl[c], mf_load(w2, hdt, wbase + k0 + c), acc);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (live && has_b) /* a dead item's r is past K: no b2 element there */
        acc = acc + mf_load(b2, bdt, bidx);
    return acc;
}

/*
 * Final: global (round_up(K, wg), M) when reduce (out [M, K]), else
 * (round_up(K, wg), M * k) (out [M, k, K], y un-reduced).
 */
__kernel void mf_moe_final(MF_MOE_FINAL_PARAMS, __local float *hsl, long chunk)
{
    const long r = (long)get_global_id(0);
    const int live = r < kdim;
    if (!reduce) {
        const long slot = (long)get_group_id(1);
        const long m = slot / topk, j = slot % topk;
        const long oidx = oo + m * os0 + j * os1 + r;
        const long e = mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts,
                                      global_experts);
        if (e < 0) {
            if (live)
                mf_store(out, odt, oidx, 0.0f);
            return;
        }
        const float y = mf_final_y(hsl, hp, ho + m * hs0 + j * hs1, hdt, w2, wo + e * ws0 + r * ws1,
                                   b2, bdt, bo + e * bs0 + r, has_b, idim, chunk, live);
        if (live)
            mf_store(out, odt, oidx, y);
        return;
    }
    const long m = (long)get_group_id(1);
    float acc = 0.0f;
    for (long j = 0; j < topk; j++) {
        const long e = mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts,
                                      global_experts);
        if (e < 0)
            continue; /* same decision for the whole work-group */
        const float y = mf_final_y(hsl, hp, ho + m * hs0 + j * hs1, hdt, w2, wo + e * ws0 + r * ws1,
                                   b2, bdt, bo + e * bs0 + r, has_b, idim, chunk, live);
        if (!live)
            continue;
        const float prod = tw[two + m * tws0 + j] * y;
        acc = acc + prod;
    }
    if (live)
        mf_store(out, odt, oo + m * os0 + r, acc);
}
