/*
 * Wide tiles on GPUs (ops_moe.c takes them above 8 slots per expert, where
 * the rows allow): a work-group of 16 x 16 computes 128 slots of one expert
 * against 128 weight rows, each work-item an 8 x 8 register tile:
 * tile rows 4 ty + i and 64 + 4 ty + i, weight rows 4 tx + j and 64 + 4 tx + j.
 * A depth step reads four float4 from local memory for 64 fmas, where
 * moe_tiled.cl's 4 x 4 tile reads eight floats for 16.
 * The operands go through two local buffers: the next slab's global loads
 * are issued before this slab's fmas and land in the other buffer after
 * them (converted to f32 only then), so one barrier a slab suffices.
 * The gate's 128 weight rows are the gate rows of 64 h columns, then their
 * up rows: a work-item holds both dot products of its 4 h columns.
 * Work-groups go column block fastest, as in moe_tiled.cl: those at work
 * together share their tile's activation rows. (Walking an expert's
 * m-tiles fastest instead, to share a block of weight rows, measured 3-5%
 * slower on an H200.)
 *
 * Every output is the same fma chain over k = 0, 1, ... as in moe_tiled.cl
 * (only real k enter it): the same bits. The host takes this path only when
 * every operand row starts at a multiple of 8 elements (mf_ocl_chunks_aligned),
 * so that a work-item stages 8 elements of a row with 16-byte loads, on
 * little-endian devices.
 */
#define MF_WM 128         /* slots of a tile, and weight rows of a work-group */
#define MF_WK 16          /* depth of a staged slab: a work-item stages 8 of a row */
#define MF_WP (MF_WM + 4) /* local pitch of one depth row of a slab (float4-aligned) */
#define MF_WSLAB (MF_WK * MF_WP / 4) /* float4s of one slab */

/*
 * Elements k .. k + 7 of the row at element offset `row`, as loaded: 8 f32 words, or 4 words
 * of two 16-bit elements each. They become f32 only when staged (mf_wide_stage): a conversion
 * here would wait for the load, where the words can stay in flight during a slab's fmas.
 * Returns how the words hold them: MF_F32 or the row's dtype. Zeros for row < 0 and past
 * depth (staged, never multiplied: the fma chains stop at depth).
 */
inline int mf_wide_fetch(__global const uchar *p, int dt, long row, long k, long depth,
                         uint *w)
{
    if (row >= 0 && k + 8 <= depth) {
        if (dt == MF_F32) {
            __global const uint4 *q = (__global const uint4 *)((__global const float *)p + row + k);
            const uint4 lo = q[0], hi = q[1];
            w[0] = lo.s0, w[1] = lo.s1, w[2] = lo.s2, w[3] = lo.s3;
            w[4] = hi.s0, w[5] = hi.s1, w[6] = hi.s2, w[7] = hi.s3;
        } else {
            const uint4 u = *(__global const uint4 *)((__global const ushort *)p + row + k);
            w[0] = u.s0, w[1] = u.s1, w[2] = u.s2, w[3] = u.s3;
        }
        return dt;
    }
    for (int i = 0; i < 8; i++)
        w[i] = as_uint((row >= 0 && k + i < depth) ? mf_load(p, dt, row + k + i) : 0.0f);
    return MF_F32;
}

/* Work-item lid stages tile row lid % 128, depth 8 (lid / 128) .. + 7 of a slab, from the
 * words of mf_wide_fetch (how: what it returned). */
inline void mf_wide_stage(__local float4 *slab, int lid, int how, const uint *w)
{
    float v[8];
    if (how == MF_F32) {
        for (int i = 0; i < 8; i++)
            v[i] = as_float(w[i]);
    } else if (how == MF_BF16) { /* little-endian: element 2 i in the low half */
        for (int i = 0; i < 4; i++) {
            v[2 * i] = mf_bf16_to_f32(w[i] & 0xFFFFu);
            v[2 * i + 1] = mf_bf16_to_f32(w[i] >> 16);
        }
    } else {
        for (int i = 0; i < 4; i++) {
            v[2 * i] = mf_f16_to_f32(w[i] & 0xFFFFu);
            v[2 * i + 1] = mf_f16_to_f32(w[i] >> 16);
        }
    }
    __local float *s = (__local float *)slab;
    const int r = lid & (MF_WM - 1), k = 8 * (lid >> 7);
    for (int i = 0; i < 8; i++) /* a warp's 32 rows side by side: no bank conflict */
        s[(k + i) * MF_WP + r] = v[i];
}

/* One depth step of the register tile, from depth row kk of the staged slabs, for its rows
 * i < rows: 8, or 4 for a tile of at most 64 slots (rows 64.. are padding, stored nowhere). */
inline void mf_wide_step(__local const float4 *sa, __local const float4 *sb, int kk, int tx,
                         int ty, int rows, float (*acc)[8])
{
    const int at = kk * (MF_WP / 4);
    const float4 a0 = sa[at + ty], a1 = sa[at + 16 + ty];
    const float4 b0 = sb[at + tx], b1 = sb[at + 16 + tx];
    const float av[8] = {a0.s0, a0.s1, a0.s2, a0.s3, a1.s0, a1.s1, a1.s2, a1.s3};
    const float bv[8] = {b0.s0, b0.s1, b0.s2, b0.s3, b1.s0, b1.s1, b1.s2, b1.s3};
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 8; j++)
            acc[i][j] = fma(av[i], bv[j], acc[i][j]);
}

/*
 * acc[i][j] = the fma chain over k = 0 .. depth - 1, in order, of A[tile row of i, k] *
 * B[weight row of j, k], i and j as in the header. This work-item stages A's tile row
 * lid % 128 (element offset arow of its k = 0, -1: none) and B's weight row brow. tail:
 * the tile holds at most 64 slots, so full slabs multiply only rows i < 4 (Qwen3-30B-A3B's
 * experts average 256 slots: their third tile is mostly such a tail).
 */
inline void mf_wide_gemm(__local float4 *as, __local float4 *bs, __global const uchar *a,
                         long arow, __global const uchar *w, long brow, int dt, long depth,
                         int tail, int tx, int ty, int lid, float (*acc)[8])
{
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++)
            acc[i][j] = 0.0f;
    const long kh = 8 * (lid >> 7);
    uint wa[8], wb[8];
    int ha = mf_wide_fetch(a, dt, arow, kh, depth, wa);
    int hb = mf_wide_fetch(w, dt, brow, kh, depth, wb);
    mf_wide_stage(as, lid, ha, wa);
    mf_wide_stage(bs, lid, hb, wb);
    barrier(CLK_LOCAL_MEM_FENCE);
    int buf = 0;
    for (long k0 = 0; k0 < depth; k0 += MF_WK) {
        const int kn = depth - k0 < MF_WK ? (int)(depth - k0) : MF_WK;
        const bool more = k0 + MF_WK < depth;
        if (more) { /* in flight during the fmas below */
            ha = mf_wide_fetch(a, dt, arow, k0 + MF_WK + kh, depth, wa);
            hb = mf_wide_fetch(w, dt, brow, k0 + MF_WK + kh, depth, wb);
        }
        __local const float4 *sa = as + buf * MF_WSLAB, *sb = bs + buf * MF_WSLAB;
        if (kn == MF_WK && !tail) {
#pragma unroll
            for (int kk = 0; kk < MF_WK; kk++)
                mf_wide_step(sa, sb, kk, tx, ty, 8, acc);
        } else if (kn == MF_WK) {
#pragma unroll
            for (int kk = 0; kk < MF_WK; kk++)
                mf_wide_step(sa, sb, kk, tx, ty, 4, acc);
        } else {
            for (int kk = 0; kk < kn; kk++) /* only real k: the chains match the CPU's */
                mf_wide_step(sa, sb, kk, tx, ty, 8, acc);
        }
        if (more) { /* the other buffer: every work-item left it behind the last barrier */
            mf_wide_stage(as + (buf ^ 1) * MF_WSLAB, lid, ha, wa);
            mf_wide_stage(bs + (buf ^ 1) * MF_WSLAB, lid, hb, wb);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        buf ^= 1;
    }
}

/* Tile row of this work-item's accumulator row i. */
inline int mf_wide_row(int ty, int i) { return (i < 4 ? 0 : 64) + 4 * ty + (i & 3); }

__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void mf_moe_gate_wide(__global const uchar *x, long xo, long xs0, int xdt,
                      __global const uchar *w1, long wo, long ws0, long ws1,
                      __global const uchar *b1, long bo, long bs0, int bdt, int has_b,
                      __global const long *route, long experts, long topk, long kdim, long idim,
                      int act, int order, float limit, float alpha, float beta,
                      __global uchar *h, long ho, long hs0, long hs1, int hdt)
{
    __local float4 as[2 * MF_WSLAB], bs[2 * MF_WSLAB];
    __local long rows[MF_WM];
    const int tx = (int)get_local_id(0), ty = (int)get_local_id(1), lid = ty * 16 + tx;
    long e;
    if (!mf_tile_begin(route, experts, rows, lid, MF_WM, &e))
        return;
    const long i0 = (long)get_group_id(0) * (MF_WM / 2);
    const long grow = mf_gate_at(order, idim), urow = mf_up_at(order, idim);
    const long step = mf_gate_step(order);
    const int r = lid & (MF_WM - 1); /* staged: tile row r, weight row r (gate, then up) */
    const long s = rows[r], col = i0 + (r & 63);
    const long arow = s >= 0 ? xo + (s / topk) * xs0 : -1;
    const long brow = col < idim ? wo + e * ws0 + ((r < 64 ? grow : urow) + col * step) * ws1 : -1;
    float acc[8][8]; /* columns c < 4: gate of h column i0 + 4 tx + c, c + 4: its up */
    mf_wide_gemm(as, bs, x, arow, w1, brow, xdt, kdim, rows[MF_WM / 2] < 0, tx, ty, lid, acc);
    for (int i = 0; i < 8; i++) {
        const long si = rows[mf_wide_row(ty, i)];
        if (si < 0)
            continue; /* past the tile's slots */
        const long m = si / topk, j = si % topk;
        for (int c = 0; c < 4; c++) {
            const long hc = i0 + 4 * tx + c;
            if (hc >= idim)
                continue;
            mf_store(h, hdt, ho + m * hs0 + j * hs1 + hc,
                     mf_gate_out(acc[i][c], acc[i][c + 4], b1, bdt, bo + e * bs0, has_b, grow,
                                 urow, step, hc, mf_gate_fn_of(act, alpha, limit, beta)));
        }
    }
}

/* y = h[m, j] @ w2[e]^T (+ b2[e]) for one tile, stored by mf_final_out (moe_tiled.cl). */
__kernel __attribute__((reqd_work_group_size(16, 16, 1)))
void mf_moe_final_wide(__global const uchar *hp, long ho, long hs0, long hs1, int hdt,
                       __global const uchar *w2, long wo, long ws0, long ws1,
                       __global const uchar *b2, long bo, long bs0, int bdt, int has_b,
                       __global const long *route, long experts, long topk, long kdim, long idim,
                       int reduce, long s0, __global float *ybuf, long ybo,
                       __global uchar *out, long oo, long os0, long os1, int odt)
{
    __local float4 as[2 * MF_WSLAB], bs[2 * MF_WSLAB];
    __local long rows[MF_WM];
    const int tx = (int)get_local_id(0), ty = (int)get_local_id(1), lid = ty * 16 + tx;
    long e;
    if (!mf_tile_begin(route, experts, rows, lid, MF_WM, &e))
        return;
    const long r0 = (long)get_group_id(0) * MF_WM;
    const int r = lid & (MF_WM - 1);
    const long s = rows[r];
    const long arow = s >= 0 ? ho + (s / topk) * hs0 + (s % topk) * hs1 : -1;
    const long brow = r0 + r < kdim ? wo + e * ws0 + (r0 + r) * ws1 : -1;
    float acc[8][8];
    mf_wide_gemm(as, bs, hp, arow, w2, brow, hdt, idim, rows[MF_WM / 2] < 0, tx, ty, lid, acc);
    for (int i = 0; i < 8; i++) {
        const long si = rows[mf_wide_row(ty, i)];
        if (si < 0)
            continue; /* past the tile's slots */
        for (int c = 0; c < 8; c++) {
            const long col = r0 + (c < 4 ? 0 : 64) + 4 * tx + (c & 3);
            if (col < kdim)
                mf_final_out(acc[i][c], si, col, topk, kdim, b2, bdt, bo + e * bs0, has_b,
                             reduce, s0, ybuf, ybo, out, oo, os0, os1, odt);
        }
    }
}
