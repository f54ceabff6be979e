/*
 * Row operations of the CUDA backend: act_quant (2-D and 3-D masked), quant
 * and act_mul, bit for bit the CPU reference (src/cpu/rows.c): the same
 * activation text (src/numerics), fast paths proved equal to it.
 *
 * Work unit ("item"): one warp, one row, 1024 consecutive channels (staged
 * kernels) or 512 (direct kernels) in slots of 256; in a slot, lane l owns
 * channels [slot + 8l, slot + 8l + 8): one 16-byte load of gate and one of up
 * (bf16/f16; two each for f32). A quantization group of G channels is G/8
 * neighbouring lanes, reduced with __shfl_xor; codes leave as one 8-byte
 * store per lane and slot. Items are walked grid-stride over the flattened
 * valid rows, so the masked 3-D call costs sum(n[e]) rows whatever E * Tmax
 * is or however the tokens spread: each block turns the clamped counts into
 * row offsets in shared memory (never on the host) and finds an item's
 * expert by a search that starts from the warp's last expert.
 *
 * Kernels: the staged ones (x 16-byte aligned) copy each warp's next item to
 * shared memory while computing the current one (walk_staged): two bulk
 * copies (TMA) on an mbarrier for 2-byte x on sm_90, cp.async otherwise;
 * the direct ones (any alignment: narrower loads) load from memory
 * (walk_items). Each comes as "plain silu" (silu without clamp, factors or
 * rounding, or quant with no activation: every option a constant; bf16 also
 * a constant in the hottest one) and "any" (everything else). silu is
 * branch-free (table exp, division without nvcc's range check) for |g| < 64,
 * proved bit-equal to the reference path by src/cuda/tools/device_check.cu.
 * The table kernels (bf16 x, no options) also have a fast item for G = 128
 * and e4m3 (quant_item_fast: one scale computation per lane and item, the
 * rare cases sent back to the general item by a vote) and a fast act_mul
 * slot, and are launched with programmatic dependent launch.
 * G = H (other than 32/64/128) takes a block per row instead. Rows that are
 * zeroed rather than computed (zero_tail, and the padding rows of the
 * column-major and packed layouts) are a second kernel.
 *
 * Here: the kernels and the host side. Their pieces, each including the one before:
 * rows.cuh (launch shapes, rows_params), rows_values.cuh (factors, activation, loads),
 * rows_quant.cuh (scales and codes), rows_stage.cuh (staged items), rows_walk.cuh (walks).
 */
#include "cuda/rows_walk.cuh"


/*
 * Each op has a kernel for plain silu (the hot path: silu without clamp,
 * factors or intermediate rounding, and quant, which has no activation;
 * every option is a constant there, and no register goes to the gelu code)
 * and one for everything else. bf16 x without options (any activation, or
 * quant) takes the table kernels: one block of MF_TAB_WARPS warps per SM,
 * so that one copy of the activation's table serves them all.
 */
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_quant_silu(rows_params p)
{
    walk_items(p, MODE_QUANT, p.xdt, MF_ACT_SILU, 1);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_quant_any(rows_params p)
{
    walk_items(p, MODE_QUANT, p.xdt, p.act, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_act_mul_silu(rows_params p)
{
    walk_items(p, MODE_MUL, p.xdt, MF_ACT_SILU, 1);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_act_mul_any(rows_params p)
{
    walk_items(p, MODE_MUL, p.xdt, p.act, 0);
}

/* The staged versions of the four, for 16-byte aligned x. */
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_quant_silu_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_QUANT, p.xdt, MF_ACT_SILU, 1, 0, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_quant_any_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_QUANT, p.xdt, p.act, 0, 0, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_act_mul_silu_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_MUL, p.xdt, MF_ACT_SILU, 1, 0, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_act_mul_any_st(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_MUL, p.xdt, p.act, 0, 0, 0);
}

/* bf16 x, plain silu (or quant), staged; the dtype and the lanes per group (G / 8) constants
 * too: the hot path while the table kernels are off. */
template <int LPG>
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_quant_silu_st_bf16(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_QUANT, MF_DT_BF16, MF_ACT_SILU, 1, LPG, 0);
}

__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_PER_SM) mf_k_act_mul_silu_st_bf16(rows_params p)
{
    walk_staged<MF_WARPS>(p, MODE_MUL, MF_DT_BF16, MF_ACT_SILU, 1, 0, 0);
}

/* The table kernels: bf16 x staged, act(g) from the table, the lanes per group a constant. */
template <int LPG>
__global__ void __launch_bounds__(MF_TAB_THREADS, 1) mf_k_quant_tab(rows_params p)
{
    walk_staged<MF_TAB_WARPS>(p, MODE_QUANT, MF_DT_BF16, p.act, 1, LPG, 1);
}

__global__ void __launch_bounds__(MF_TAB_THREADS, 1) mf_k_act_mul_tab(rows_params p)
{
    walk_staged<MF_TAB_WARPS>(p, MODE_MUL, MF_DT_BF16, p.act, 1, 0, 1);
}

/*
 * G = H (not 32, 64 or 128): one block per row, grid-stride over the valid
 * rows. h is kept in shared memory between the amax and the codes when it
 * fits (hcache), else computed again (the same bits).
 */
__global__ void __launch_bounds__(MF_THREADS, MF_BLOCKS_ANY) mf_k_quant_row(rows_params p, int hcache)
{
    extern __shared__ int64_t mf_smem[];
    __shared__ float red[MF_WARPS];
    __shared__ __align__(8) float tab[64]; /* read as pairs (ld.shared.v2) */
    load_exp_table(tab);
    const int64_t *offs;
    const int64_t rows = setup_rows(p, mf_smem, &offs);
    float *hc = (float *)(mf_smem + ((p.counts && !p.offs_g) ? p.E + 1 : 0));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        int64_t e = 0, t = row;
        if (offs) {
            e = find_expert(offs, p.E, row);
            t = row - offs[e];
        }
        const char *xrow = p.x + (e * p.xs0 + t * p.xs1) * p.xes;
        char *qrow = p.q + e * p.qs0 + t * p.qs1;
        float rs, es;
        row_factors(p, e, t, &rs, &es);
        float m = 0.0f;
        for (int64_t c = tid; c < p.H; c += MF_THREADS) {
            const float v = h_one(p, tab, xrow, c, rs, es);
            const float a = fabsf(v);
            m = (mf_is_finite(v) && a > m) ? a : m;
            if (hcache)
                hc[c] = v;
        }
        for (int off = 16; off > 0; off >>= 1)
            m = fmaxf(m, __shfl_xor_sync(MF_FULL, m, off));
        if (lane == 0)
            red[warp] = m;
        __syncthreads();
        float amax = 0.0f;
        for (int w = 0; w < MF_WARPS; w++)
            amax = fmaxf(amax, red[w]);
        uint32_t ue;
        const float s = group_scale(p, amax, &ue);
        const float y = 1.0f / s;
        const int fast = mf_scale_fast_ok(s);
        for (int64_t c = tid; c < p.H; c += MF_THREADS) {
            const float v = hcache ? hc[c] : h_one(p, tab, xrow, c, rs, es);
            qrow[c] = (char)code1(p.fp8, v, s, y, fast);
        }
        if (tid == 0) {
            if (p.layout == MF_LAYOUT_PACKED) /* one group: the whole word, bytes 1..3 zero */
                ((int32_t *)p.sc)[e * p.ss0 + t] = (int32_t)ue;
            else
                put_scale(p, e, t, 0, s, ue);
        }
        __syncthreads(); /* red (and hc) are rewritten for the next row */
    }
}

/* Row offsets in global memory for E > MF_SMEM_EXPERTS: one block. */
__global__ void __launch_bounds__(1024) mf_k_count_prefix(const int32_t *counts, int64_t cs0,
                                                          int64_t E, int64_t T, int64_t *offs)
{
    block_prefix(counts, cs0, E, T, offs);
}

/*
 * Rows t in [t_begin, t_end) of every expert that are zeroed rather than
 * computed: with zero_tail the rows t >= n[e] (codes and scales), and the
 * padding rows T..Ta-1 of the column-major and packed layouts (scales). One
 * warp per row.
 */
__global__ void __launch_bounds__(MF_THREADS) mf_k_rows_tail(rows_params p, int64_t t_begin,
                                                             int64_t t_end, int zero_tail,
                                                             int vec16)
{
    const int lane = threadIdx.x & 31;
    const int64_t span = t_end - t_begin, items = p.E * span;
    for (int64_t it = (int64_t)blockIdx.x * MF_WARPS + (threadIdx.x >> 5); it < items;
         it += (int64_t)gridDim.x * MF_WARPS) {
        const int64_t e = it / span, t = t_begin + it % span;
        if (t < p.T) {
            if (!zero_tail)
                continue;
            const int64_t c = p.counts ? (int64_t)p.counts[e * p.cs0] : p.T;
            const int64_t n = c < 0 ? 0 : (c > p.T ? p.T : c);
            if (t < n)
                continue; /* a computed row */
            char *qrow = p.q + e * p.qs0 + t * p.qs1;
            int64_t c16 = 0;
            if (vec16) {
                c16 = p.H / 16 * 16;
                for (int64_t c = (int64_t)lane * 16; c < c16; c += 32 * 16)
                    *(uint4 *)(qrow + c) = make_uint4(0u, 0u, 0u, 0u);
            }
            for (int64_t c = c16 + lane; c < p.H; c += 32)
                qrow[c] = 0;
        }
        if (p.layout == MF_LAYOUT_PACKED) {
            for (int64_t w = lane; w < p.Gw; w += 32)
                ((int32_t *)p.sc)[e * p.ss0 + w * p.ss1 + t] = 0;
        } else {
            for (int64_t g = lane; g < p.Gn; g += 32)
                put_scale(p, e, t, g, 0.0f, 0u);
        }
    }
}

/* ------------------------------------------------------------------ host */

moefuse_status mf_cuda_build_act_tables(moefuse_context *ctx, cuda_state *s)
{
    const size_t bytes = (size_t)MF_TAB_ACTS * MF_TAB_BYTES;
    cudaError_t e = mf_fault_hit(MF_FAULT_DEVICE_ALLOC) ? cudaErrorMemoryAllocation
                                                        : cudaMalloc((void **)&s->act_tables, bytes);
    if (e != cudaSuccess) {
        s->act_tables = NULL;
        return mf_cuda_fail(ctx, e, NULL, "cudaMalloc(activation tables)");
    }
    mf_k_build_act_tables<<<MF_TAB_ACTS * MF_TAB_ENTRIES / 256, 256, 0, s->own_stream>>>(s->act_tables);
    MF_TRY(mf_cuda_launched(ctx, "context creation", "mf_k_build_act_tables"));
    e = cudaStreamSynchronize(s->own_stream);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, NULL, "cudaStreamSynchronize");
}

/*
 * Can every row of t be accessed `align` bytes at a time? The data start and
 * the row strides (in bytes) must be multiples of align; the expert stride
 * matters only when there is more than one expert. The core guarantees only
 * element alignment, so the kernels fall back to narrower accesses.
 */
static int rows_aligned(const moefuse_tensor *t, int64_t align, int64_t experts)
{
    const int64_t es = (int64_t)moefuse_dtype_size(t->dtype);
    if ((uintptr_t)mf_cuda_base(t) % (uintptr_t)align != 0)
        return 0;
    if ((t->stride[1] * es) % align != 0)
        return 0;
    return experts <= 1 || (t->stride[0] * es) % align == 0;
}

/* The fields every row op shares: x, the activation options, the factors, the shapes. */
static void fill_common(rows_params *p, const mf_rows_args *a)
{
    memset(p, 0, sizeof *p);
    p->x = mf_cuda_base(&a->x);
    p->xs0 = a->x.stride[0];
    p->xs1 = a->x.stride[1];
    p->xdt = (int)a->x.dtype;
    p->xes = (int64_t)moefuse_dtype_size(a->x.dtype);
    p->activate = a->activate;
    const int order = a->activate ? (int)a->act.order : MOEFUSE_GATE_FIRST;
    p->goff = mf_gate_at(order, a->hidden);
    p->uoff = mf_up_at(order, a->hidden);
    p->cstep = mf_gate_step(order);
    p->act = (int)a->act.activation;
    p->alpha = a->act.alpha;
    p->limit = a->activate ? a->act.limit : 0.0f;
    p->beta = a->activate ? a->act.up_offset : 0.0f;
    p->round_bf16 = a->activate && a->act.intermediate == MOEFUSE_ROUND_BF16;
    if (a->row_scale.data) {
        p->has_rs = 1;
        p->rs = mf_cuda_base(&a->row_scale);
        p->rss0 = a->row_scale.stride[0];
        p->rss1 = a->row_scale.stride[1];
    }
    if (a->expert_scale.data) {
        p->has_es = 1;
        p->es = mf_cuda_base(&a->expert_scale);
        p->ess0 = a->expert_scale.stride[0];
        p->esdt = (int)a->expert_scale.dtype;
    }
    if (a->counts.data) {
        p->counts = (const int32_t *)mf_cuda_base(&a->counts);
        p->cs0 = a->counts.stride[0];
    }
    p->E = a->experts;
    p->T = a->rows;
    p->H = a->hidden;
    p->chunks = (a->hidden + MF_ITEM - 1) / MF_ITEM;
    p->q = mf_cuda_base(&a->out);
    p->qs0 = a->out.stride[0];
    p->qs1 = a->out.stride[1];
    p->qdt = (int)a->out.dtype;
    p->qes = (int64_t)moefuse_dtype_size(a->out.dtype);
}

/* An activation without clamp, up offset, intermediate rounding or factors, its gate and up
 * halves apart (or no activation at all)? */
static int no_options(const rows_params *p)
{
    return !p->activate || (!(p->limit > 0.0f) && p->beta == 0.0f && p->cstep == 1 &&
                            !p->round_bf16 && !p->has_rs && !p->has_es);
}

/* Can the plain kernels take the call: silu without options, or no activation at all? */
static int plain_silu(const rows_params *p)
{
    return no_options(p) && (!p->activate || p->act == MF_ACT_SILU);
}

/*
 * Can a table kernel take the call: bf16 x staged (16-byte aligned), no options, an
 * activation that has a table (not silu_alpha, whose values depend on alpha)? It reads the
 * activation's table (built at context creation, act_table.cuh), set here in p->atab.
 */
static int table_kernel(const cuda_state *s, rows_params *p)
{
    if (p->xdt != MF_DT_BF16 || !p->vec_x || !no_options(p) || !s->act_tables ||
        (p->activate && !mf_act_table_has(p->act)))
        return 0;
    p->atab = p->activate ? s->act_tables + (size_t)p->act * MF_TAB_ENTRIES : NULL;
    return 1;
}

/* The masked layout's row offsets go to scratch past MF_SMEM_EXPERTS experts: their bytes, or
 * 0 (2-D calls, or offsets in shared memory). */
static size_t offsets_scratch_bytes(bool masked, int64_t experts)
{
    return masked && experts > MF_SMEM_EXPERTS ? (size_t)(experts + 1) * sizeof(int64_t) : 0;
}

extern "C" moefuse_status mf_cuda_rows_workspace(moefuse_context *ctx, void *state,
                                                 const mf_rows_args *a, size_t *bytes)
{
    (void)ctx;
    (void)state;
    *bytes = offsets_scratch_bytes(a->counts.data != NULL, a->experts);
    return MOEFUSE_OK;
}

/* Row offsets of the masked layout: shared memory (dynamic bytes in *smem) or global scratch
 * (`given`, a caller's share of its own scratch, or this call's request). */
static moefuse_status masked_offsets(moefuse_context *ctx, cuda_state *s, rows_params *p,
                                     const char *op, void *given, size_t *smem)
{
    *smem = 0;
    if (!p->counts)
        return MOEFUSE_OK;
    const size_t bytes = offsets_scratch_bytes(true, p->E);
    if (bytes == 0) {
        *smem = (size_t)(p->E + 1) * sizeof(int64_t);
        return MOEFUSE_OK;
    }
    void *offs = given;
    if (!offs)
        MF_TRY(mf_cuda_scratch(ctx, s, bytes, op, &offs));
    mf_k_count_prefix<<<1, 1024, 0, s->stream>>>(p->counts, p->cs0, p->E, p->T, (int64_t *)offs);
    MF_TRY(mf_cuda_launched(ctx, op, "mf_k_count_prefix"));
    p->offs_g = (const int64_t *)offs;
    return MOEFUSE_OK;
}

/*
 * Dynamic shared memory of a staged kernel of `warps` warps in *bytes: the rings (and the
 * activation table for a table kernel that activates) as ring_offset lays them out, then
 * the row offsets (offs_bytes); 0 when even the device's opt-in limit is too small (the
 * unstaged kernel runs instead). Above the default 48 KiB the kernel's limit is raised once
 * per context (bit: its bit in s->rows_smem_raised), not on every call: the attribute call
 * costs host time that a decode-sized call would notice.
 */
static moefuse_status staged_smem(moefuse_context *ctx, cuda_state *s, const rows_params *p,
                                  size_t offs_bytes, const void *kernel, uint32_t bit, int warps,
                                  int table, const char *op, size_t *bytes)
{
    /* the kernels' static shared memory (exp table, mbarriers, the prefix sum's) stays under
     * 2 KiB (832 bytes with MF_TAB_WARPS = 20: ptxas -v) */
    const size_t stat = 2048;
    *bytes = 0;
    if (s->smem_optin <= stat)
        return MOEFUSE_OK;
    const size_t limit = s->smem_optin - stat;
    const int64_t sb = stage_bytes(p->xes, p->activate);
    const size_t need = (size_t)offs_offset(sb, table && p->activate, warps) +
                        (offs_bytes + 15) / 16 * 16;
    if (need > limit)
        return MOEFUSE_OK;
    if (need + stat > 48 * 1024 && !(s->rows_smem_raised & bit)) {
        cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)limit);
        if (e != cudaSuccess)
            return mf_cuda_fail(ctx, e, op, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
        s->rows_smem_raised |= bit;
    }
    *bytes = need;
    return MOEFUSE_OK;
}

void mf_cuda_probe_pdl(cuda_state *s)
{
    struct cudaFuncAttributes fa;
    s->pdl = s->cc_major >= 9 &&
             cudaFuncGetAttributes(&fa, (const void *)mf_k_act_mul_tab) == cudaSuccess &&
             fa.ptxVersion >= 90;
    s->clusters = s->pdl; /* the same condition: code built for sm_90 on an sm_90 device */
    (void)cudaGetLastError(); /* a failed query leaves PDL off, not an error for the next call */
}

static moefuse_status rows_quant(moefuse_context *ctx, cuda_state *s, const mf_rows_args *a,
                                 const char *op, void *offs_scratch)
{
    rows_params p;
    fill_common(&p, a);
    const int masked = p.counts != NULL;
    if (!masked && p.E != 1)
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: %lld experts without counts", op,
                        (long long)p.E);
    const int64_t G = a->group;
    p.Gn = a->groups;
    p.Gw = (a->groups + 3) / 4;
    p.eps = a->quant.eps;
    p.fp8 = a->out.dtype == MOEFUSE_F8_E4M3;
    p.layout = (int)a->quant.scale_layout;
    p.ue8m0 = a->quant.ue8m0 || p.layout == MF_LAYOUT_PACKED;
    p.sc = mf_cuda_base(&a->scales);
    p.ss0 = a->scales.stride[0];
    p.ss1 = a->scales.stride[1];
    p.sc_f32 = a->scales.dtype == MOEFUSE_F32;
    p.qes = 1;
    const int warp_path = G == 32 || G == 64 || G == 128;
    if (warp_path) {
        p.lpg = (int)(G / 8);
        p.glog = G == 32 ? 5 : (G == 64 ? 6 : 7);
    }
    const int64_t E = p.E, T = p.T;
    const int64_t Ta = a->rows_padded;
    if (E > 0 && T > 0) {
        /* 16-byte x loads need every gate/up vector aligned: rows, and the half at H; the
         * interleaved order loads element by element in the direct kernels (no staging) */
        p.vec_x = rows_aligned(&a->x, 16, E) && (p.H * p.xes) % 16 == 0 && p.cstep == 1;
        p.vec_q = rows_aligned(&a->out, 8, E);
        size_t smem;
        MF_TRY(masked_offsets(ctx, s, &p, op, offs_scratch, &smem));
        if (warp_path) {
            /* quant (no activation) runs in the plain kernels, which never call act8 for it */
            const int tab = table_kernel(s, &p);
            const int silu = plain_silu(&p);
            const int bf16 = p.xdt == MF_DT_BF16;
            void (*tabk)(rows_params) = p.lpg == 16  ? mf_k_quant_tab<16>
                                        : p.lpg == 8 ? mf_k_quant_tab<8>
                                                     : mf_k_quant_tab<4>;
            void (*hot)(rows_params) = p.lpg == 16  ? mf_k_quant_silu_st_bf16<16>
                                       : p.lpg == 8 ? mf_k_quant_silu_st_bf16<8>
                                                    : mf_k_quant_silu_st_bf16<4>;
            void (*k)(rows_params) = tab    ? tabk
                                     : silu ? (bf16 ? hot : mf_k_quant_silu_st)
                                            : mf_k_quant_any_st;
            const char *kname = tab ? "mf_k_quant_tab" : silu ? "mf_k_quant_silu_st" : "mf_k_quant_any_st";
            const int warps = tab ? MF_TAB_WARPS : MF_WARPS;
            const int per_sm = tab ? 1 : silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY;
            /* the kernel's bit in s->rows_smem_raised */
            const uint32_t lbit = p.lpg == 16 ? 0 : p.lpg == 8 ? 1 : 2;
            const uint32_t bit = tab ? 1u << (8 + lbit) : !silu ? 1u << 4 : bf16 ? 1u << lbit : 1u << 3;
            size_t bytes = 0;
            if (p.vec_x)
                MF_TRY(staged_smem(ctx, s, &p, smem, (const void *)k, bit, warps, tab, op, &bytes));
            /* staged items are 1024 channels, the others 512 */
            p.chunks = (p.H + (bytes ? MF_ST_ITEM : MF_ITEM) - 1) / (bytes ? MF_ST_ITEM : MF_ITEM);
            if (bytes) {
                /* masked: a persistent grid (the valid rows are known on the device only) */
                const unsigned grid = masked ? (unsigned)s->sm_count * (unsigned)per_sm
                                             : mf_cuda_grid(s, T * p.chunks, warps, per_sm);
                /* the table kernels with programmatic dependent launch (mf_pdl_wait) */
                mf_launch_pdl(k, dim3(grid), (unsigned)warps * 32u, bytes, s->stream,
                              tab && s->pdl, p);
                MF_TRY(mf_cuda_launched(ctx, op, kname));
            } else {
                const int per_sm_d = silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY;
                const unsigned grid = masked ? (unsigned)s->sm_count * (unsigned)per_sm_d
                                             : mf_cuda_grid(s, T * p.chunks, MF_WARPS, per_sm_d);
                if (silu) {
                    mf_k_quant_silu<<<grid, MF_THREADS, smem, s->stream>>>(p);
                    MF_TRY(mf_cuda_launched(ctx, op, "mf_k_quant_silu"));
                } else {
                    mf_k_quant_any<<<grid, MF_THREADS, smem, s->stream>>>(p);
                    MF_TRY(mf_cuda_launched(ctx, op, "mf_k_quant_any"));
                }
            }
        } else {
            const int hcache = smem + (size_t)p.H * sizeof(float) <= MF_SMEM_BYTES;
            const size_t bytes = smem + (hcache ? (size_t)p.H * sizeof(float) : 0);
            const unsigned grid = masked ? (unsigned)s->sm_count * MF_BLOCKS_ANY
                                         : mf_cuda_grid(s, T, 1, MF_BLOCKS_ANY);
            mf_k_quant_row<<<grid, MF_THREADS, bytes, s->stream>>>(p, hcache);
            MF_TRY(mf_cuda_launched(ctx, op, "mf_k_quant_row"));
        }
    }
    /* rows zeroed rather than computed: the tail (zero_tail) and the layout's padding rows */
    const int tail = a->zero_tail && masked;
    const int64_t t_begin = tail ? 0 : T;
    const int64_t t_end = p.layout == MF_LAYOUT_ROW ? T : Ta;
    if (E > 0 && t_end > t_begin) {
        const int vec16 = rows_aligned(&a->out, 16, E);
        const unsigned grid =
            mf_cuda_grid(s, E * (t_end - t_begin), MF_WARPS, MF_BLOCKS_PER_SM);
        mf_k_rows_tail<<<grid, MF_THREADS, 0, s->stream>>>(p, t_begin, t_end, tail, vec16);
        MF_TRY(mf_cuda_launched(ctx, op, "mf_k_rows_tail"));
    }
    return MOEFUSE_OK;
}

moefuse_status mf_cuda_act_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    return rows_quant(ctx, (cuda_state *)state, a,
                      a->counts.data ? "act_quant_masked" : "act_quant", NULL);
}

moefuse_status mf_cuda_quant(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    return rows_quant(ctx, (cuda_state *)state, a, "quant", NULL);
}

size_t mf_cuda_quant_scratch_bytes(const mf_rows_args *a)
{
    return offsets_scratch_bytes(a->counts.data != NULL, a->experts);
}

moefuse_status mf_cuda_quant_in_call(moefuse_context *ctx, cuda_state *s, const mf_rows_args *a,
                                     const char *op, void *scratch)
{
    return rows_quant(ctx, s, a, op, scratch);
}

moefuse_status mf_cuda_act_mul(moefuse_context *ctx, void *state, const mf_rows_args *a)
{
    static const char op[] = "act_mul";
    cuda_state *s = (cuda_state *)state;
    rows_params p;
    fill_common(&p, a);
    if (p.counts || p.E != 1)
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: expects the 2-D form", op);
    if (p.T == 0)
        return MOEFUSE_OK;
    p.vec_x = rows_aligned(&a->x, 16, 1) && (p.H * p.xes) % 16 == 0 && p.cstep == 1;
    p.vec_q = rows_aligned(&a->out, 16, 1);
    const int silu = plain_silu(&p);
    size_t bytes = 0;
    /* staged items move 8 channels per lane (mul_item_st): an f32 row of 8n + 4 channels
     * passes the 16-byte test above but would be written 4 channels past its end */
    const int staged = p.vec_x && p.H % 8 == 0;
    const int tab = staged && table_kernel(s, &p);
    const int bf16 = p.xdt == MF_DT_BF16;
    void (*k)(rows_params) = tab    ? mf_k_act_mul_tab
                             : silu ? (bf16 ? mf_k_act_mul_silu_st_bf16 : mf_k_act_mul_silu_st)
                                    : mf_k_act_mul_any_st;
    const int warps = tab ? MF_TAB_WARPS : MF_WARPS;
    const uint32_t bit = tab ? 1u << 11 : !silu ? 1u << 7 : bf16 ? 1u << 5 : 1u << 6;
    if (staged)
        MF_TRY(staged_smem(ctx, s, &p, 0, (const void *)k, bit, warps, tab, op, &bytes));
    p.chunks = (p.H + (bytes ? MF_ST_ITEM : MF_ITEM) - 1) / (bytes ? MF_ST_ITEM : MF_ITEM);
    if (bytes) {
        const int per_sm = tab ? 1 : silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY;
        const unsigned grid = mf_cuda_grid(s, p.T * p.chunks, warps, per_sm);
        mf_launch_pdl(k, dim3(grid), (unsigned)warps * 32u, bytes, s->stream, tab && s->pdl, p);
        return mf_cuda_launched(ctx, op, tab ? "mf_k_act_mul_tab" : silu ? "mf_k_act_mul_silu_st" : "mf_k_act_mul_any_st");
    }
    p.atab = NULL;
    const unsigned grid = mf_cuda_grid(s, p.T * p.chunks, MF_WARPS, silu ? MF_BLOCKS_PER_SM : MF_BLOCKS_ANY);
    if (silu) {
        mf_k_act_mul_silu<<<grid, MF_THREADS, 0, s->stream>>>(p);
        return mf_cuda_launched(ctx, op, "mf_k_act_mul_silu");
    }
    mf_k_act_mul_any<<<grid, MF_THREADS, 0, s->stream>>>(p);
    return mf_cuda_launched(ctx, op, "mf_k_act_mul_any");
}
