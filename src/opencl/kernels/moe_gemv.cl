/*
 * moe_gate and moe_final for few token slots per expert (decode and small
 * batches, up to 8 per expert on average: ops_moe.c), matrix-vector shaped.
 * A work-group of 256 is 8 teams of 32 work-items; a team computes one output
 * column, its 32 work-items reading a weight row side by side, 8 elements each
 * per step, so a team streams 256 contiguous elements of the row at a time
 * (the one-column kernels of moe.cl read one element per work-item, rows
 * apart, which no GPU coalesces). Each work-item's partial sum is an fma
 * chain over its own elements in order; the 32 partials are then added in a
 * fixed tree. The order depends on the sizes only: results are reproducible
 * run to run (NUMERICS.md), though not the bits of the other two paths.
 * mf_slot_expert and the argument lists (MF_MOE_GATE_PARAMS, MF_MOE_FINAL_PARAMS) are moe.cl's.
 */
#define MF_GV_LANES 32
#define MF_GV_TEAMS 8
#define MF_GV_VEC 8
#define MF_GV_STEP (MF_GV_LANES * MF_GV_VEC)

/* Elements i .. i+7 of an f32/f16/bf16 buffer as f32 (inner stride 1). */
inline float8 mf_load8(__global const uchar *base, int dt, long i)
{
    if (dt == MF_F32)
        return vload8(0, (__global const float *)base + i);
    const ushort8 h = vload8(0, (__global const ushort *)base + i);
    if (dt == MF_BF16)
        return as_float8(convert_uint8(h) << (uint8)16u);
    return (float8)(mf_f16_to_f32(h.s0), mf_f16_to_f32(h.s1), mf_f16_to_f32(h.s2),
                    mf_f16_to_f32(h.s3), mf_f16_to_f32(h.s4), mf_f16_to_f32(h.s5),
                    mf_f16_to_f32(h.s6), mf_f16_to_f32(h.s7));
}

inline float mf_fma8(float8 a, float8 b, float acc)
{
    acc = fma(a.s0, b.s0, acc);
    acc = fma(a.s1, b.s1, acc);
    acc = fma(a.s2, b.s2, acc);
    acc = fma(a.s3, b.s3, acc);
    acc = fma(a.s4, b.s4, acc);
    acc = fma(a.s5, b.s5, acc);
    acc = fma(a.s6, b.s6, acc);
    return fma(a.s7, b.s7, acc);
}

/*
 * Partial sums of one work-item for up to two weight rows against the vector
 * a: elements lane*8 .. lane*8+7 of every 256, then the tail one by one.
 * w1b < 0: one row only (the second sum stays 0).
 */
inline float2 mf_gv_partial(__global const uchar *a, long ab, __global const uchar *w, long w0b,
                            long w1b, int dt, long n, int lane)
{
    float s0 = 0.0f, s1 = 0.0f;
    const long full = n / MF_GV_STEP * MF_GV_STEP;
    for (long k = (long)lane * MF_GV_VEC; k < full; k += MF_GV_STEP) {
        const float8 av = mf_load8(a, dt, ab + k);
        s0 = mf_fma8(av, mf_load8(w, dt, w0b + k), s0);
        if (w1b >= 0)
            s1 = mf_fma8(av, mf_load8(w, dt, w1b + k), s1);
    }
    for (long k = full + lane; k < n; k += MF_GV_LANES) {
        const float av = mf_load(a, dt, ab + k);
        s0 = fma(av, mf_load(w, dt, w0b + k), s0);
        if (w1b >= 0)
            s1 = fma(av, mf_load(w, dt, w1b + k), s1);
    }
    return (float2)(s0, s1);
}

/* Adds the 32 partials of each team (fixed tree); every work-item must call it. */
inline float2 mf_gv_reduce(__local float2 *part, float2 mine, int lid, int lane)
{
    barrier(CLK_LOCAL_MEM_FENCE); /* the previous reduction's reads are done */
    part[lid] = mine;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int off = MF_GV_LANES / 2; off > 0; off >>= 1) {
        if (lane < off)
            part[lid] = part[lid] + part[lid + off];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return part[lid - lane];
}

/* Gate: global (ceil(I / 8) * 256, M * k), local (256, 1); moe.cl's mf_moe_gate otherwise. */
__kernel __attribute__((reqd_work_group_size(MF_GV_LANES * MF_GV_TEAMS, 1, 1)))
void mf_moe_gate_gemv(MF_MOE_GATE_PARAMS)
{
    __local float2 part[MF_GV_LANES * MF_GV_TEAMS];
    const int lid = (int)get_local_id(0), lane = lid % MF_GV_LANES;
    const long slot = (long)get_group_id(1);
    const long m = slot / topk, j = slot % topk;
    const long col = (long)get_group_id(0) * MF_GV_TEAMS + lid / MF_GV_LANES;
    const int live = col < idim;
    const long e = mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts,
                                  global_experts);
    if (e < 0) { /* the same for the whole work-group: no barrier is skipped by some */
        if (live && lane == 0)
            mf_store(h, hdt, ho + m * hs0 + j * hs1 + col, 0.0f);
        return;
    }
    const long grow = mf_gate_at(order, idim), urow = mf_up_at(order, idim);
    const long step = mf_gate_step(order);
    float2 mine = (float2)(0.0f, 0.0f);
    if (live)
        mine = mf_gv_partial(x, xo + m * xs0, w1, wo + e * ws0 + (grow + col * step) * ws1,
                             wo + e * ws0 + (urow + col * step) * ws1, xdt, kdim, lane);
    const float2 a = mf_gv_reduce(part, mine, lid, lane);
    if (live && lane == 0)
        mf_store(h, hdt, ho + m * hs0 + j * hs1 + col,
                 mf_gate_out(a.x, a.y, b1, bdt, bo + e * bs0, has_b, grow, urow, step, col,
                             mf_gate_fn_of(act, alpha, limit, beta)));
}

/*
 * Final: global (ceil(K / 8) * 256, M) when reduce (the slots of token m added
 * in j order by each team's first work-item), else (ceil(K / 8) * 256, M * k).
 */
__kernel __attribute__((reqd_work_group_size(MF_GV_LANES * MF_GV_TEAMS, 1, 1)))
void mf_moe_final_gemv(MF_MOE_FINAL_PARAMS)
{
    __local float2 part[MF_GV_LANES * MF_GV_TEAMS];
    const int lid = (int)get_local_id(0), lane = lid % MF_GV_LANES;
    const long r = (long)get_group_id(0) * MF_GV_TEAMS + lid / MF_GV_LANES;
    const int live = r < kdim;
    const long row = (long)get_group_id(1);
    const long m = reduce ? row : row / topk;
    const long j0 = reduce ? 0 : row % topk, j1 = reduce ? topk : j0 + 1;
    float acc = 0.0f;
    for (long j = j0; j < j1; j++) {
        const long e = mf_slot_expert(ids, io, is0, m, j, map, mo, ms0, has_map, experts,
                                      global_experts);
        if (e < 0) /* the same for the whole work-group */
            continue;
        float2 mine = (float2)(0.0f, 0.0f);
        if (live)
            mine = mf_gv_partial(hp, ho + m * hs0 + j * hs1, w2, wo + e * ws0 + r * ws1, -1,
                                 hdt, idim, lane);
        float y = mf_gv_reduce(part, mine, lid, lane).x;
        if (!live || lane != 0)
            continue;
        if (has_b)
            y = y + mf_load(b2, bdt, bo + e * bs0 + r);
        if (!reduce) {
            acc = y;
        } else {
            const float prod = tw[two + m * tws0 + j] * y;
            acc = acc + prod;
        }
    }
    if (live && lane == 0) /* an invalid slot's un-reduced row is 0, as is a token's without any */
        mf_store(out, odt, reduce ? oo + m * os0 + r : oo + m * os0 + j0 * os1 + r, acc);
}
