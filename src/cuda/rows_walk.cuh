/*
 * The row kernels' walks over the valid rows (rows.cu): the masked counts' offsets, the
 * items of the direct kernels and the staged walk.
 */
#ifndef MOEFUSE_CUDA_ROWS_WALK_CUH
#define MOEFUSE_CUDA_ROWS_WALK_CUH

#include "cuda/masked_offsets.cuh"
#include "cuda/rows_stage.cuh"

/* ------------------------------------------------------------ row walk */

/*
 * The same knowing the answer is at least lo (a warp's rows only grow), by the whole warp
 * (every lane calls it): the lanes test the next 32 experts at once, and since offs only
 * grows, the experts at or below the row are a prefix of them. One step unless the row
 * moved past 32 experts.
 */
static __device__ __forceinline__ int64_t find_expert_warp(const int64_t *offs, int64_t E,
                                                           int64_t row, int64_t lo, int lane)
{
    for (;;) {
        const int64_t j = lo + 1 + lane;
        const unsigned below = __ballot_sync(MF_FULL, j < E && offs[j] <= row);
        lo += __popc(below);
        if (below != MF_FULL)
            return lo;
    }
}

/* Row offsets (shared memory, global memory, or none for the 2-D form); returns the valid rows. */
static __device__ __forceinline__ int64_t setup_rows(const rows_params &p, int64_t *smem,
                                                     const int64_t **offs)
{
    if (!p.counts) {
        *offs = NULL;
        return p.T;
    }
    if (p.offs_g) {
        *offs = p.offs_g;
        return p.offs_g[p.E];
    }
    block_prefix(p.counts, p.cs0, p.E, p.T, smem);
    *offs = smem;
    return smem[p.E];
}

enum { MODE_QUANT, MODE_MUL };

/* 2^(j/32) for mf_exp_tab_fast, copied to shared memory by every block (lanes index it freely). */
__constant__ float mf_c_exp2_tab[64] = MF_EXP_TABLE_INIT;

static __device__ __forceinline__ void load_exp_table(float *tab)
{
    if (threadIdx.x < 64)
        tab[threadIdx.x] = mf_c_exp2_tab[threadIdx.x];
    __syncthreads();
}

/*
 * Grid-stride walk of the warps over the items (row, chunk), chunk fastest:
 * neighbouring warps read neighbouring memory. The item index is advanced
 * without a division per step.
 */
static __device__ __forceinline__ void walk_items(const rows_params &p, int mode, int xdt,
                                                  int act, int plain)
{
    extern __shared__ int64_t mf_smem[];
    __shared__ __align__(8) float tab[64]; /* read as pairs (ld.shared.v2) */
    load_exp_table(tab);
    const int64_t *offs;
    const int64_t rows = setup_rows(p, mf_smem, &offs);
    const int lane = threadIdx.x & 31;
    const int64_t W = (int64_t)gridDim.x * MF_WARPS;
    const int64_t it = (int64_t)blockIdx.x * MF_WARPS + (threadIdx.x >> 5);
    int64_t row = it / p.chunks, ch = it % p.chunks;
    const int64_t Wq = W / p.chunks, Wr = W % p.chunks;
    while (row < rows) {
        int64_t e = 0, t = row;
        if (offs) {
            e = find_expert(offs, p.E, row);
            t = row - offs[e];
        }
        if (mode == MODE_QUANT)
            quant_item(p, xdt, act, plain, tab, e, t, ch, lane);
        else
            mul_item(p, xdt, act, plain, tab, e, t, ch, lane);
        ch += Wr;
        row += Wq;
        if (ch >= p.chunks) {
            ch -= p.chunks;
            row++;
        }
    }
}

/* Item iterator of a warp: (row, chunk), advanced by the grid's warp count. */
typedef struct item_it {
    int64_t row, ch;
} item_it;

static __device__ __forceinline__ void it_next(const rows_params &p, item_it *i, int64_t Wq,
                                               int64_t Wr)
{
    i->ch += Wr;
    i->row += Wq;
    if (i->ch >= p.chunks) {
        i->ch -= p.chunks;
        i->row++;
    }
}

/* Stage item (row xrow, chunk ch): bulk copies by lane 0, or 16-byte cp.async by every lane. */
static __device__ __forceinline__ void fetch_item(const rows_params &p, int xdt, int bulk,
                                                  char *stage, uint64_t *bar, const char *xrow,
                                                  int64_t ch, int lane)
{
    if (!bulk) {
        stage_fetch(p, xdt, stage, xrow, ch, lane);
        return;
    }
    __syncwarp(); /* every lane has read what this slot held before */
    if (lane == 0) {
        const int64_t c0 = ch * MF_ST_ITEM;
        const int64_t n = p.H - c0 < MF_ST_ITEM ? p.H - c0 : MF_ST_ITEM;
        bulk_fetch(stage, bar, xrow + (p.goff + c0) * 2, xrow + (p.uoff + c0) * 2,
                   (unsigned)(n * 2), p.activate);
    }
}

/*
 * Dynamic shared memory of the staged kernels: each warp's ring of MF_STAGES items of sb
 * bytes, then the row offsets (masked calls, E small). With an activation table (TABLE:
 * the table kernels when they activate) the table's halves sit at 0 and MF_TAB_NEG
 * (act_table.cuh), the rings of the first warps between them, the others after.
 */
static __host__ __device__ __forceinline__ int64_t ring_offset(int64_t sb, int table, int warp)
{
    const int64_t rb = MF_STAGES * sb;
    if (!table)
        return warp * rb;
    const int64_t fit = (MF_TAB_NEG - MF_TAB_SPAN * 4) / rb; /* rings between the halves */
    return warp < fit ? MF_TAB_SPAN * 4 + warp * rb : MF_TAB_SMEM_SPAN + (warp - fit) * rb;
}

static __host__ __device__ __forceinline__ int64_t offs_offset(int64_t sb, int table, int warps)
{
    const int64_t end = ring_offset(sb, table, warps);
    return table && end < (int64_t)MF_TAB_SMEM_SPAN ? (int64_t)MF_TAB_SMEM_SPAN : end;
}

/*
 * The same walk with the items' x staged in shared memory MF_STAGES - 1
 * items ahead (rows with 16-byte aligned vectors only), by blocks of NW
 * warps; dynamic shared memory as ring_offset says. TABLE: a table kernel,
 * which copies the activation's table (p.atab) to shared memory when the call
 * activates and takes quant_item_fast where it can.
 */
template <int NW>
static __device__ __forceinline__ void walk_staged(const rows_params &p, int mode, int xdt,
                                                   int act, int plain, int lpgc, int table)
{
    extern __shared__ int64_t mf_smem[];
    __shared__ __align__(8) float tab[64]; /* read as pairs (ld.shared.v2) */
    __shared__ uint64_t bars[NW][MF_STAGES];
    char *const base = (char *)mf_smem;
    const int has_tab = table && p.activate; /* (without activation the table is never read) */
    const char *atab = has_tab ? base : NULL;
    if (has_tab) { /* the halves to 0 and MF_TAB_NEG */
        const uint4 *src = (const uint4 *)p.atab;
        for (int i = threadIdx.x; i < (int)(MF_TAB_BYTES / 16); i += NW * 32)
            *(uint4 *)(base + mf_tab_smem_offset((uint32_t)i * 4u)) = __ldg(src + i);
    }
    const int bulk = MF_BULK && xdt != MF_DT_F32;
    if (bulk && (threadIdx.x & 31) == 0) {
#pragma unroll
        for (int i = 0; i < MF_STAGES; i++)
            mbar_init(&bars[threadIdx.x >> 5][i]);
        mbar_init_fence();
    }
    /* programmatic dependent launch (pdl.cuh): the table copy and the barriers overlap the
     * previous kernel's end; no read of the call's tensors, and no write, before this */
    mf_pdl_wait();
    load_exp_table(tab); /* its barrier also publishes the mbarriers and the table */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t sb = stage_bytes(xdt == MF_DT_F32 ? 4 : 2, p.activate);
    const int64_t *offs;
    const int64_t rows = setup_rows(p, (int64_t *)(base + offs_offset(sb, has_tab, NW)), &offs);
    char *ring = base + ring_offset(sb, has_tab, warp);
    /* the fast item: G = 128, e4m3, 8-byte code stores */
    const int fast = table && lpgc == 16 && p.fp8 && p.vec_q;
    const int64_t W = (int64_t)gridDim.x * NW;
    /* The warp's first item: warp-major across the blocks, so that the last, partial round
     * (items W q .. N - 1) falls on a few warps of every SM rather than on every warp of the
     * first SMs (a decode call of 3584 items on 2640 warps: 10.6 -> 9.1 us); the block index
     * rotated by the warp, so that when W and the grid are multiples of the items per row
     * each SM still mixes the row's chunks (a short last chunk would otherwise fall on whole
     * SMs). A bijection from (block, warp) onto 0 .. W - 1. */
    const int64_t it = (int64_t)warp * gridDim.x + (blockIdx.x + warp) % gridDim.x;
    const int64_t Wq = W / p.chunks, Wr = W % p.chunks;
    item_it fetch_i = {it / p.chunks, it % p.chunks}, proc_i = fetch_i;
    /* (e, t) of each staged item, found once at its fetch (register "arrays": every index is
     * compared with constants, so nothing goes to local memory) */
    int64_t ring_e[MF_STAGES], ring_t[MF_STAGES];
    int64_t fe = 0; /* expert of the last fetch: the next is at least that */
    unsigned phases = 0u; /* parity of each ring slot's next mbarrier phase (bulk) */
#pragma unroll
    for (int i = 0; i < MF_STAGES; i++)
        ring_e[i] = ring_t[i] = 0;
    /* prologue: the first MF_STAGES - 1 items (every lane commits a group per item, even empty) */
#pragma unroll
    for (int sidx = 0; sidx < MF_STAGES - 1; sidx++) {
        if (fetch_i.row < rows) {
            int64_t t = fetch_i.row;
            if (offs) {
                fe = find_expert_warp(offs, p.E, fetch_i.row, fe, lane);
                t = fetch_i.row - offs[fe];
            }
            ring_e[sidx] = fe;
            ring_t[sidx] = t;
            fetch_item(p, xdt, bulk, ring + sidx * sb, &bars[warp][sidx],
                       p.x + (fe * p.xs0 + t * p.xs1) * p.xes, fetch_i.ch, lane);
        }
        if (!bulk)
            cp_async_commit();
        it_next(p, &fetch_i, Wq, Wr);
    }
    for (int sidx = 0; proc_i.row < rows; sidx = sidx + 1 == MF_STAGES ? 0 : sidx + 1) {
        /* the next item goes to the slot this lane emptied last iteration */
        const int fslot = sidx == 0 ? MF_STAGES - 1 : sidx - 1;
        if (fetch_i.row < rows) {
            int64_t t = fetch_i.row;
            if (offs) {
                fe = find_expert_warp(offs, p.E, fetch_i.row, fe, lane);
                t = fetch_i.row - offs[fe];
            }
#pragma unroll
            for (int i = 0; i < MF_STAGES; i++) {
                ring_e[i] = i == fslot ? fe : ring_e[i];
                ring_t[i] = i == fslot ? t : ring_t[i];
            }
            fetch_item(p, xdt, bulk, ring + fslot * sb, &bars[warp][fslot],
                       p.x + (fe * p.xs0 + t * p.xs1) * p.xes, fetch_i.ch, lane);
        }
        it_next(p, &fetch_i, Wq, Wr);
        if (bulk) {
            mbar_wait(&bars[warp][sidx], (phases >> sidx) & 1u);
            phases ^= 1u << sidx;
        } else {
            cp_async_commit();
            cp_async_wait_oldest();
        }
        int64_t e = ring_e[0], t = ring_t[0];
#pragma unroll
        for (int i = 1; i < MF_STAGES; i++) {
            e = i == sidx ? ring_e[i] : e;
            t = i == sidx ? ring_t[i] : t;
        }
        if (mode == MODE_QUANT) {
            const char *stage = ring + sidx * sb;
            /* whole slots of the row in the item: 4, or fewer in a row's last item */
            const int64_t left = p.H - proc_i.ch * MF_ST_ITEM;
            const int nv = left >= MF_ST_ITEM ? MF_ST_SLOTS
                           : left % 256 == 0  ? (int)(left / 256)
                                              : 0;
            int done = 0;
            if (fast && nv > 0)
                done = p.activate ? quant_item_fast<1>(p, atab, stage, e, t, proc_i.ch, nv, lane)
                                  : quant_item_fast<0>(p, atab, stage, e, t, proc_i.ch, nv, lane);
            if (!done)
                quant_item_st(p, xdt, act, plain, lpgc, tab, atab, stage, e, t, proc_i.ch, lane);
        } else
            mul_item_st(p, xdt, act, plain, tab, atab, ring + sidx * sb, e, t, proc_i.ch, lane);
        it_next(p, &proc_i, Wq, Wr);
    }
    /* the next kernel may launch once every block got here (the trigger counts per block;
     * at the start instead, it cost the long masked call 1-2% on the H100) */
    mf_pdl_trigger();
}

#endif /* MOEFUSE_CUDA_ROWS_WALK_CUH */
