/*
 * fuzz_api: a seeded random driver for the public API, meant to run under
 * ASan + UBSan (CI runs it on the release and the sanitizer builds).
 *
 * All operands of a call live in one arena from moefuse_buffer_alloc, so the
 * same code drives host memory (cpu: data pointer + offset) and a cl_mem
 * (opencl: handle + byte offset). Calls are mostly near-valid: a valid call
 * (random sizes, row padding, odd strides of size-1 dims, offsets, dtypes,
 * options, absent optional operands, empty tensors) with one thing perturbed
 * (a dim, the rank, the dtype, a stride, the offset, an alias onto another
 * operand, NULL, a foreign pointer, a position past the end, an option), so
 * that the kernels really run; some calls are left valid, some get several
 * perturbations.
 *
 * What every call is checked for (include/moefuse.h, docs/API.md):
 *  - refused: no byte of the arena changed, and moefuse_last_error is set;
 *  - accepted: only bytes of elements of its outputs changed, the message is
 *    empty, and nothing was wrong that the API says must be refused (negative
 *    dims, bad strides, offsets or alignment, NULL data, an output sharing a
 *    byte with another operand, a tensor past the end of its OpenCL buffer,
 *    an invalid option, ...);
 *  - a call the generator left valid is accepted;
 *  - every HEALTH_EVERY calls a fixed valid call gives the bytes it gave at
 *    the start (the context keeps working).
 *
 * Environment:
 *  MOEFUSE_TEST_BACKEND   cpu (default), opencl or cuda
 *  MOEFUSE_FUZZ_SEED      seed (default: random; printed)
 *  MOEFUSE_FUZZ_SECONDS   time bound (default 15, or none when only a call count is given)
 *  MOEFUSE_FUZZ_CALLS     call bound (default none)
 *  MOEFUSE_FUZZ_START     index of the first call: each call draws from its own stream, so
 *                         MOEFUSE_FUZZ_START=i MOEFUSE_FUZZ_CALLS=1 replays call i alone
 *  MOEFUSE_FUZZ_VERBOSE   1: describe every call
 * Exit status: 0 clean, 1 on any violation, 77 (Meson's SKIP) when the backend
 * is built but has no device.
 */
#include "moefuse.h"

#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define FUZZ_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUZZ_ASAN 1
#endif
#endif
#ifdef FUZZ_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#define ARENA_BYTES (96 * 1024)
#define MAX_OPERANDS 9
#define HEALTH_EVERY 1000  /* calls between two known-good calls */
#define REPORTS_PER_KIND 3 /* violations of one kind described in full; the rest are counted */
#define DEFAULT_SECONDS 15.0

/* ----------------------------------------------------------------- random numbers */

typedef struct rng {
    uint64_t state;
} rng;

static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* splitmix64 */
static uint64_t rng_next(rng *r) { return mix64(r->state += 0x9E3779B97F4A7C15ull); }

/* lo..hi inclusive; lo when the range is empty. Unsigned arithmetic: any bounds are fine. */
static int64_t rng_int(rng *r, int64_t lo, int64_t hi)
{
    if (hi <= lo)
        return lo;
    uint64_t width = (uint64_t)hi - (uint64_t)lo;
    uint64_t pick = width == UINT64_MAX ? rng_next(r) : rng_next(r) % (width + 1);
    return (int64_t)((uint64_t)lo + pick); /* two's complement, as every target has */
}

static bool rng_percent(rng *r, int percent) { return (int)(rng_next(r) % 100) < percent; }

static double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) * 0x1p-53; }

#define COUNT_OF(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))
#define PICK(r, a) ((a)[rng_int((r), 0, COUNT_OF(a) - 1)])

/* Each call draws from its own stream, so one call can be replayed alone. */
static rng call_rng(uint64_t seed, uint64_t index)
{
    rng r = {mix64(seed) ^ mix64(index + 0x632BE59BD9B4E019ull)};
    return r;
}

/* ----------------------------------------------------------------- dtypes */

typedef unsigned dtype_set;
#define DT(d) (1u << (unsigned)(d))
#define FLOATS (DT(MOEFUSE_F32) | DT(MOEFUSE_F16) | DT(MOEFUSE_BF16))
#define CODES (DT(MOEFUSE_F8_E4M3) | DT(MOEFUSE_I8))

static bool dtype_valid(moefuse_dtype d) { return (unsigned)d < MOEFUSE_DTYPE_COUNT_; }

static bool dtype_in(moefuse_dtype d, dtype_set set) { return dtype_valid(d) && (set & DT(d)); }

/* An invalid dtype counts as the widest, so footprints stay conservative. */
static int64_t elem_bytes(moefuse_dtype d)
{
    size_t size = moefuse_dtype_size(d);
    return size ? (int64_t)size : 4;
}

static moefuse_dtype pick_float(rng *r)
{
    static const moefuse_dtype floats[] = {MOEFUSE_F32, MOEFUSE_F16, MOEFUSE_BF16};
    return PICK(r, floats);
}

/* ----------------------------------------------------------------- calls */

enum op {
    OP_ACT_QUANT,
    OP_ACT_QUANT_MASKED,
    OP_ACT_MUL,
    OP_QUANT,
    OP_DEQUANT,
    OP_TOPK_SOFTMAX,
    OP_MOE_GATE,
    OP_MOE_FINAL,
    OP_MOE_FORWARD,
    OP_TOPK_ROUTE,
    OP_ROUTING_META,
    OP_COUNT
};

static const char *const op_names[OP_COUNT] = {
    "act_quant", "act_quant_masked", "act_mul",  "quant",       "dequant",
    "topk_softmax", "moe_gate",      "moe_final", "moe_forward", "topk_route",
    "routing_metadata",
};

/* Operand slots, in the order each builder adds them. */
enum { AQ_X, AQ_ROW_SCALE, AQ_Q, AQ_SCALES };
enum { MQ_X, MQ_COUNTS, MQ_ROW_SCALE, MQ_EXPERT_SCALE, MQ_Q, MQ_SCALES };
enum { AM_X, AM_ROW_SCALE, AM_OUT };
enum { QU_X, QU_Q, QU_SCALES };
enum { DQ_Q, DQ_SCALES, DQ_OUT };
enum { TK_LOGITS, TK_IDS, TK_WEIGHTS };
enum { GA_X, GA_W1, GA_B1, GA_IDS, GA_WEIGHTS, GA_MAP, GA_H };
enum { FI_H, FI_W2, FI_B2, FI_IDS, FI_WEIGHTS, FI_MAP, FI_OUT };
enum { FW_X, FW_W1, FW_W2, FW_B1, FW_B2, FW_IDS, FW_WEIGHTS, FW_MAP, FW_OUT };
enum { TR_LOGITS, TR_LOGIT_BIAS, TR_CHOICE_BIAS, TR_IDS, TR_WEIGHTS };
enum { RM_IDS, RM_WEIGHTS, RM_MAP, RM_COUNTS, RM_OFFSETS, RM_ORDER, RM_POSITION, RM_MASKED_ROW };

enum role { ROLE_INPUT, ROLE_OUTPUT, ROLE_IGNORED };
enum data_kind { DATA_ARENA, DATA_NULL, DATA_FOREIGN };
enum fill_kind { FILL_BYTES, FILL_FLOATS, FILL_PROBS, FILL_IDS, FILL_MAP, FILL_COUNTS };

typedef struct operand {
    const char *name;
    enum role role;
    bool optional;
    bool in_routing;         /* a member of moefuse_routing (or moefuse_routing_meta), handed
                                over by value */
    bool only_when_reduced;  /* moe_final's topk_weights: read only for out [M, K] */
    bool passed;             /* a non-NULL pointer is handed over */
    enum data_kind data;
    int64_t pos;             /* arena byte of element 0 */
    int64_t host_split;      /* host pointers: bytes of pos carried by data, the rest by offset */
    int64_t negative_offset; /* > 0: the offset field is -negative_offset (same element 0) */
    int32_t want_rank, alt_rank;
    dtype_set allowed;       /* dtypes this slot takes in some valid call */
    enum fill_kind fill;
    int64_t fill_limit;      /* ids: E_global; map: E; counts: Tmax */
    moefuse_tensor t;        /* data and offset are set by bind_operand */
} operand;

typedef struct fuzz_call {
    enum op op;
    operand v[MAX_OPERANDS];
    int count;
    moefuse_act_quant_options aq; /* .act for act_mul, .quant for quant and dequant */
    moefuse_moe_options moe;
    int32_t renormalize;
    moefuse_router_options route; /* topk_route */
    int32_t block_size;           /* routing_metadata */
    int32_t n_shared;             /* routing.n_shared: 0, or a perturbation's bad value */
    float shared_scale;
    bool null_options, null_context, null_routing;
    bool maybe_invalid; /* a perturbation that may or may not break the call */
    int64_t hidden;     /* H of the valid call (group_size = H is valid) */
    int perturbations;
    char notes[320];    /* what was perturbed, for reports */
} fuzz_call;

static void note(fuzz_call *c, const char *fmt, ...)
{
    size_t used = strlen(c->notes);
    if (used + 2 >= sizeof c->notes)
        return;
    if (used) {
        c->notes[used++] = ';';
        c->notes[used++] = ' ';
        c->notes[used] = '\0';
    }
    va_list args;
    va_start(args, fmt);
    vsnprintf(c->notes + used, sizeof c->notes - used, fmt, args);
    va_end(args);
}

static bool is_moe(enum op op)
{
    return op == OP_MOE_GATE || op == OP_MOE_FINAL || op == OP_MOE_FORWARD;
}

static bool takes_act_options(enum op op)
{
    return op == OP_ACT_QUANT || op == OP_ACT_QUANT_MASKED || op == OP_ACT_MUL;
}

static bool takes_quant_options(enum op op)
{
    return op == OP_ACT_QUANT || op == OP_ACT_QUANT_MASKED || op == OP_QUANT || op == OP_DEQUANT;
}

/* The operand holding the codes whose dtype decides what ue8m0 may do. */
static const operand *code_operand(const fuzz_call *c)
{
    switch (c->op) {
    case OP_ACT_QUANT: return &c->v[AQ_Q];
    case OP_ACT_QUANT_MASKED: return &c->v[MQ_Q];
    case OP_QUANT: return &c->v[QU_Q];
    case OP_DEQUANT: return &c->v[DQ_Q];
    default: return NULL;
    }
}

/* ----------------------------------------------------------------- tensor geometry */

static bool rank_ok(const moefuse_tensor *t) { return t->rank >= 1 && t->rank <= MOEFUSE_MAX_RANK; }

static bool has_negative_dim(const moefuse_tensor *t)
{
    for (int d = 0; d < t->rank && d < MOEFUSE_MAX_RANK; d++)
        if (t->shape[d] < 0)
            return true;
    return false;
}

/* Some dimension is 0 and none is negative: the tensor has no element. */
static bool is_empty(const moefuse_tensor *t)
{
    if (!rank_ok(t) || has_negative_dim(t))
        return false;
    for (int d = 0; d < t->rank; d++)
        if (t->shape[d] == 0)
            return true;
    return false;
}

/* Has elements we can place: sensible rank, every dim > 0. */
static bool has_elements(const moefuse_tensor *t)
{
    return rank_ok(t) && !has_negative_dim(t) && !is_empty(t);
}

/* Perturbations stack and widths can be huge: arithmetic on them saturates. */
static int64_t add_sat(int64_t a, int64_t b)
{
    int64_t sum;
    return __builtin_add_overflow(a, b, &sum) ? (b > 0 ? INT64_MAX : INT64_MIN) : sum;
}

static int64_t mul_sat(int64_t a, int64_t b)
{
    int64_t product;
    return __builtin_mul_overflow(a, b, &product) ? ((a < 0) != (b < 0) ? INT64_MIN : INT64_MAX)
                                                  : product;
}

static void set_dense_strides(moefuse_tensor *t)
{
    int64_t step = 1;
    for (int d = t->rank - 1; d >= 0; d--) {
        t->stride[d] = step;
        step = mul_sat(step, t->shape[d] > 0 ? t->shape[d] : 1);
    }
}

/* Bytes [lo, hi) relative to element 0 that the elements cover; false on overflow. */
static bool relative_reach(const moefuse_tensor *t, int64_t *lo, int64_t *hi)
{
    int64_t below = 0, above = 0, step;
    for (int d = 0; d < t->rank; d++) {
        if (__builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &step))
            return false;
        if (__builtin_add_overflow(step < 0 ? below : above, step, step < 0 ? &below : &above))
            return false;
    }
    int64_t es = elem_bytes(t->dtype);
    return !__builtin_add_overflow(above, 1, &above) && !__builtin_mul_overflow(below, es, lo) &&
           !__builtin_mul_overflow(above, es, hi);
}

/* Arena bytes [lo, hi) of a non-empty operand; false when unknown (overflow, bad rank, dims). */
static bool arena_reach(const operand *o, int64_t *lo, int64_t *hi)
{
    int64_t rel_lo, rel_hi;
    if (!has_elements(&o->t) || !relative_reach(&o->t, &rel_lo, &rel_hi))
        return false;
    return !__builtin_add_overflow(o->pos, rel_lo, lo) &&
           !__builtin_add_overflow(o->pos, rel_hi, hi);
}

/* Elements spanned by one step of dim d (1 + reach of the inner dims); -1 on overflow or
   negative dims. */
static int64_t inner_extent(const moefuse_tensor *t, int d)
{
    int64_t extent = 1, step;
    for (int i = t->rank - 1; i > d; i--)
        if (t->shape[i] < 0 || __builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &step) ||
            __builtin_add_overflow(extent, step, &extent))
            return -1;
    return extent;
}

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

/* ----------------------------------------------------------------- the fuzzer */

enum violation_kind {
    V_ACCEPTED_OVERLAP,     /* an output shares bytes with another operand (rule 4) */
    V_ACCEPTED_OUT_OF_BOUNDS, /* a tensor runs past the end of its buffer (rule 3) */
    V_ACCEPTED_INVALID,     /* anything else the API says must be refused */
    V_REFUSED_VALID,
    V_WROTE_OUTSIDE_OUTPUTS,
    V_REFUSED_BUT_WROTE,
    V_MESSAGE,              /* refused without a message, or accepted with one */
    V_STATUS,               /* not a status; INTERNAL, BACKEND_FAILURE or OUT_OF_MEMORY */
    V_CONTEXT,              /* the context stopped working */
    V_KIND_COUNT
};

static const char *const violation_names[V_KIND_COUNT] = {
    "accepted overlap", "accepted out of bounds", "accepted invalid", "refused valid",
    "wrote outside outputs", "refused but wrote", "message", "status", "context broke",
};

typedef struct op_stats {
    uint64_t calls, ok, refused;
} op_stats;

typedef struct fuzzer {
    moefuse_context *ctx;
    const char *backend;
    const char *program;
    bool handles;          /* opencl: data is a cl_mem, the offset carries the position */
    bool knows_sizes;      /* the library can tell a tensor past the end of its buffer */
    bool checks_ownership; /* a foreign pointer must be refused */
    void *arena;
    int64_t arena_bytes;
    unsigned char *image;  /* bytes uploaded before a call */
    unsigned char *before; /* read back before the call */
    unsigned char *after;  /* read back after it */
    unsigned char *writable;
    uint64_t seed;
    bool verbose;
    op_stats stats[OP_COUNT];
    uint64_t violations;
    uint64_t violations_of[V_KIND_COUNT];
    /* the known-good call */
    void *health;
    int64_t health_bytes;
    unsigned char *health_image, *health_reference, *health_now;
    bool health_recorded;
} fuzzer;

static unsigned char foreign_bytes[256]; /* host memory handed where a device buffer belongs */

/* ----------------------------------------------------------------- building valid calls */

static int add_operand(fuzz_call *c, const char *name, enum role role, bool optional,
                       moefuse_dtype dtype, dtype_set allowed, enum fill_kind fill, int rank,
                       const int64_t *shape)
{
    operand *o = &c->v[c->count];
    memset(o, 0, sizeof *o);
    o->name = name;
    o->role = role;
    o->optional = optional;
    o->passed = true;
    o->data = DATA_ARENA;
    o->want_rank = o->alt_rank = rank;
    o->allowed = allowed;
    o->fill = fill;
    o->t.dtype = dtype;
    o->t.rank = rank;
    for (int d = 0; d < rank; d++)
        o->t.shape[d] = shape[d];
    set_dense_strides(&o->t);
    return c->count++;
}

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

/* An optional operand left out: as a NULL pointer or as a tensor with NULL data. */
static void maybe_absent(rng *r, fuzz_call *c, int slot, int percent)
{
    operand *o = &c->v[slot];
    if (!rng_percent(r, percent))
        return;
    if (o->in_routing || rng_percent(r, 50))
        o->data = DATA_NULL;
    else
        o->passed = false;
}

/* A call without rows touches no memory whatever its width: sometimes a huge one, so that
   backends that size work or scratch by the width before looking at the rows show it. */
static bool go_wide(rng *r, int64_t rows) { return rows == 0 && rng_percent(r, 25); }

/* Gated inputs are 2H wide: their H stays below 2^62. */
static int64_t huge_width(rng *r, bool gated)
{
    static const int64_t huge[] = {(int64_t)1 << 31, (int64_t)1 << 40, (int64_t)1 << 60,
                                   (int64_t)1 << 62};
    return huge[rng_int(r, 0, COUNT_OF(huge) - (gated ? 2 : 1))];
}

/* Token counts: mostly small, sometimes none. */
static int64_t pick_rows(rng *r, int64_t most)
{
    if (rng_percent(r, 6))
        return 0;
    return rng_percent(r, 60) ? rng_int(r, 1, 4) : rng_int(r, 1, most);
}

static float pick_eps(rng *r)
{
    static const float valid[] = {1e-10f, 1e-6f, 1e-3f, 1e-30f, 1e-34f, 0.5f, 1.0f};
    return rng_percent(r, 50) ? 0.0f : PICK(r, valid);
}

/* silu_alpha's alpha (0: the default) and an up offset, both valid. */
static void pick_gated_extras(rng *r, moefuse_activation act, float *alpha, float *up_offset)
{
    static const float alphas[] = {0.0f, 1.702f, 0.3f, 1e30f}, offsets[] = {1.0f, -1.0f, 1e30f};
    *alpha = act == MOEFUSE_ACT_SILU_ALPHA ? PICK(r, alphas) : 0.0f;
    *up_offset = rng_percent(r, 60) ? 0.0f : PICK(r, offsets);
}

static void pick_act_options(rng *r, moefuse_act_options *a)
{
    static const float limits[] = {0.25f, 1.0f, 7.0f, 1e30f};
    a->activation = (moefuse_activation)rng_int(r, 0, MOEFUSE_ACT_COUNT_ - 1);
    a->order = (moefuse_gate_order)rng_int(r, 0, MOEFUSE_GATE_ORDER_COUNT_ - 1);
    a->limit = rng_percent(r, 60) ? 0.0f : PICK(r, limits);
    a->intermediate = (moefuse_rounding)rng_int(r, 0, MOEFUSE_ROUNDING_COUNT_ - 1);
    pick_gated_extras(r, a->activation, &a->alpha, &a->up_offset);
}

typedef struct quant_config {
    int64_t hidden, group, groups;
    moefuse_dtype code_dtype, scale_dtype;
    moefuse_scale_layout layout;
} quant_config;

/* H, G and a scale layout that fit together, and the options that ask for them. */
static void pick_quant_config(rng *r, int64_t max_hidden, quant_config *q,
                              moefuse_quant_options *opt)
{
    static const int64_t groups[] = {32, 64, 128};
    if (rng_percent(r, 25)) { /* G = H: any width */
        q->hidden = q->group = rng_int(r, 1, 80);
        opt->group_size = q->group;
    } else {
        q->group = PICK(r, groups);
        if (q->group > max_hidden)
            q->group = 32;
        q->hidden = q->group * rng_int(r, 1, max_hidden / q->group);
        opt->group_size = q->group == 128 && rng_percent(r, 50) ? 0 : q->group;
    }
    q->groups = q->hidden / q->group;
    q->code_dtype = rng_percent(r, 70) ? MOEFUSE_F8_E4M3 : MOEFUSE_I8;
    q->layout = (moefuse_scale_layout)rng_int(r, 0, MOEFUSE_SCALE_LAYOUT_COUNT_ - 1);
    if (q->code_dtype == MOEFUSE_I8 && q->layout == MOEFUSE_SCALE_PACKED_UE8M0)
        q->layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    bool packed = q->layout == MOEFUSE_SCALE_PACKED_UE8M0;
    bool ue8m0 = packed || (q->code_dtype == MOEFUSE_F8_E4M3 && rng_percent(r, 40));
    opt->scale_layout = q->layout;
    opt->ue8m0 = !ue8m0 ? 0 : packed && rng_percent(r, 50) ? 0 : rng_percent(r, 80) ? 1 : 7;
    opt->eps = pick_eps(r);
    if (packed)
        q->scale_dtype = MOEFUSE_I32;
    else
        q->scale_dtype = ue8m0 && rng_percent(r, 60) ? MOEFUSE_U8 : MOEFUSE_F32;
}

/* H huge, G = 128 or H: for calls without rows. */
static void widen_quant(rng *r, bool gated, quant_config *q, moefuse_quant_options *opt)
{
    q->hidden = huge_width(r, gated);
    q->group = rng_percent(r, 50) ? 128 : q->hidden;
    q->groups = q->hidden / q->group;
    opt->group_size = q->group == 128 && rng_percent(r, 50) ? 0 : q->group;
}

/* The scales operand of a layout; experts < 0: the 2-D form. */
static int add_scales(fuzz_call *c, const quant_config *q, enum role role, int64_t experts,
                      int64_t rows)
{
    int64_t padded = (rows + 3) / 4 * 4, a, b;
    switch (q->layout) {
    case MOEFUSE_SCALE_ROW_MAJOR: a = rows, b = q->groups; break;
    case MOEFUSE_SCALE_COLUMN_MAJOR: a = q->groups, b = padded; break;
    default: a = (q->groups + 3) / 4, b = padded; break;
    }
    const dtype_set allowed = DT(MOEFUSE_F32) | DT(MOEFUSE_U8) | DT(MOEFUSE_I32);
    enum fill_kind fill = q->scale_dtype == MOEFUSE_F32 ? FILL_FLOATS : FILL_BYTES;
    if (experts < 0)
        return add_operand(c, "scales", role, false, q->scale_dtype, allowed, fill, 2, SHAPE(a, b));
    return add_operand(c, "scales", role, false, q->scale_dtype, allowed, fill, 3,
                       SHAPE(experts, a, b));
}

static void build_act_quant(rng *r, fuzz_call *c)
{
    quant_config q;
    pick_quant_config(r, 256, &q, &c->aq.quant);
    pick_act_options(r, &c->aq.act);
    c->aq.zero_tail = rng_percent(r, 20); /* 2-D: ignored */
    int64_t T = pick_rows(r, 12);
    if (go_wide(r, T))
        widen_quant(r, true, &q, &c->aq.quant);
    int64_t H = q.hidden;
    c->hidden = H;
    add_operand(c, "x", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(T, 2 * H));
    add_operand(c, "row_scale", ROLE_INPUT, true, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_FLOATS, 1,
                SHAPE(T));
    add_operand(c, "q", ROLE_OUTPUT, false, q.code_dtype, CODES, FILL_BYTES, 2, SHAPE(T, H));
    add_scales(c, &q, ROLE_OUTPUT, -1, T);
    maybe_absent(r, c, AQ_ROW_SCALE, 50);
}

static void build_act_quant_masked(rng *r, fuzz_call *c)
{
    static const int32_t zero_tails[] = {0, 0, 1, 1, -3, 1000};
    quant_config q;
    pick_quant_config(r, 128, &q, &c->aq.quant);
    pick_act_options(r, &c->aq.act);
    c->aq.zero_tail = PICK(r, zero_tails);
    int64_t E = rng_percent(r, 5) ? 0 : rng_int(r, 1, 4), Tmax = pick_rows(r, 8);
    if (go_wide(r, Tmax))
        widen_quant(r, true, &q, &c->aq.quant);
    int64_t H = q.hidden;
    c->hidden = H;
    add_operand(c, "x", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 3,
                SHAPE(E, Tmax, 2 * H));
    int counts = add_operand(c, "counts", ROLE_INPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32),
                             FILL_COUNTS, 1, SHAPE(E));
    c->v[counts].fill_limit = Tmax;
    add_operand(c, "row_scale", ROLE_INPUT, true, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_FLOATS, 2,
                SHAPE(E, Tmax));
    add_operand(c, "expert_scale", ROLE_INPUT, true,
                rng_percent(r, 50) ? MOEFUSE_F32 : MOEFUSE_BF16,
                DT(MOEFUSE_F32) | DT(MOEFUSE_BF16), FILL_FLOATS, 1, SHAPE(E));
    add_operand(c, "q", ROLE_OUTPUT, false, q.code_dtype, CODES, FILL_BYTES, 3, SHAPE(E, Tmax, H));
    add_scales(c, &q, ROLE_OUTPUT, E, Tmax);
    maybe_absent(r, c, MQ_ROW_SCALE, 50);
    maybe_absent(r, c, MQ_EXPERT_SCALE, 50);
}

static void build_act_mul(rng *r, fuzz_call *c)
{
    pick_act_options(r, &c->aq.act);
    int64_t T = pick_rows(r, 12), H = rng_percent(r, 50) ? rng_int(r, 1, 32) : rng_int(r, 1, 256);
    if (go_wide(r, T))
        H = huge_width(r, true);
    moefuse_dtype dt = pick_float(r);
    add_operand(c, "x", ROLE_INPUT, false, dt, FLOATS, FILL_FLOATS, 2, SHAPE(T, 2 * H));
    add_operand(c, "row_scale", ROLE_INPUT, true, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_FLOATS, 1,
                SHAPE(T));
    add_operand(c, "out", ROLE_OUTPUT, false, dt, FLOATS, FILL_BYTES, 2, SHAPE(T, H));
    maybe_absent(r, c, AM_ROW_SCALE, 50);
}

static void build_quant(rng *r, fuzz_call *c)
{
    quant_config q;
    pick_quant_config(r, 256, &q, &c->aq.quant);
    int64_t T = pick_rows(r, 12);
    if (go_wide(r, T))
        widen_quant(r, false, &q, &c->aq.quant);
    int64_t H = q.hidden;
    c->hidden = H;
    add_operand(c, "x", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(T, H));
    add_operand(c, "q", ROLE_OUTPUT, false, q.code_dtype, CODES, FILL_BYTES, 2, SHAPE(T, H));
    add_scales(c, &q, ROLE_OUTPUT, -1, T);
}

static void build_dequant(rng *r, fuzz_call *c)
{
    quant_config q;
    pick_quant_config(r, 256, &q, &c->aq.quant);
    int64_t T = pick_rows(r, 12);
    if (go_wide(r, T))
        widen_quant(r, false, &q, &c->aq.quant);
    int64_t H = q.hidden;
    c->hidden = H;
    add_operand(c, "q", ROLE_INPUT, false, q.code_dtype, CODES, FILL_BYTES, 2, SHAPE(T, H));
    add_scales(c, &q, ROLE_INPUT, -1, T);
    add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 2, SHAPE(T, H));
}

static void build_topk_softmax(rng *r, fuzz_call *c)
{
    static const int32_t renormalize[] = {0, 0, 1, 1, -1, 7, INT32_MIN};
    int64_t E = rng_percent(r, 70) ? rng_int(r, 1, 16) : rng_int(r, 17, 64);
    int64_t M = pick_rows(r, 16);
    if (go_wide(r, M))
        E = huge_width(r, false);
    int64_t k = rng_percent(r, 90) ? rng_int(r, 1, E < 8 ? E : 8) : E;
    c->renormalize = PICK(r, renormalize);
    add_operand(c, "logits", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(M, E));
    add_operand(c, "ids", ROLE_OUTPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32), FILL_BYTES, 2,
                SHAPE(M, k));
    add_operand(c, "weights", ROLE_OUTPUT, false, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_BYTES, 2,
                SHAPE(M, k));
}

typedef struct moe_sizes {
    int64_t M, K, I, E, k, E_global;
    bool map;
    moefuse_dtype dtype;
} moe_sizes;

static void pick_moe(rng *r, fuzz_call *c, moe_sizes *s)
{
    static const float limits[] = {0.5f, 3.0f, 1e20f};
    s->M = pick_rows(r, 6);
    s->K = rng_int(r, 1, 32);
    s->I = rng_int(r, 1, 16);
    s->E = rng_int(r, 1, 4);
    s->k = go_wide(r, s->M) ? huge_width(r, false) : rng_int(r, 1, 4);
    s->map = rng_percent(r, 40);
    s->E_global = s->map ? rng_int(r, 1, 8) : s->E;
    s->dtype = pick_float(r);
    c->moe.activation = (moefuse_activation)rng_int(r, 0, MOEFUSE_ACT_COUNT_ - 1);
    c->moe.order = (moefuse_gate_order)rng_int(r, 0, MOEFUSE_GATE_ORDER_COUNT_ - 1);
    c->moe.limit = rng_percent(r, 70) ? 0.0f : PICK(r, limits);
    pick_gated_extras(r, c->moe.activation, &c->moe.alpha, &c->moe.up_offset);
}

/* topk_ids, topk_weights, expert_map, in that order. */
static void add_routing(rng *r, fuzz_call *c, const moe_sizes *s, enum role weights_role)
{
    int ids = add_operand(c, "topk_ids", ROLE_INPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32),
                          FILL_IDS, 2, SHAPE(s->M, s->k));
    int weights = add_operand(c, "topk_weights", weights_role, false, MOEFUSE_F32,
                              DT(MOEFUSE_F32), FILL_PROBS, 2, SHAPE(s->M, s->k));
    int map = add_operand(c, "expert_map", ROLE_INPUT, true, MOEFUSE_I32, DT(MOEFUSE_I32),
                          FILL_MAP, 1, SHAPE(s->E_global));
    c->v[ids].fill_limit = s->E_global;
    c->v[map].fill_limit = s->E;
    c->v[ids].in_routing = c->v[weights].in_routing = c->v[map].in_routing = true;
    if (!s->map)
        c->v[map].data = DATA_NULL;
    /* moe_gate ignores the weights: often the zeroed tensor callers pass */
    if (weights_role == ROLE_IGNORED && rng_percent(r, 50)) {
        memset(&c->v[weights].t, 0, sizeof c->v[weights].t);
        c->v[weights].data = DATA_NULL;
    }
}

static void build_moe_gate(rng *r, fuzz_call *c)
{
    moe_sizes s;
    pick_moe(r, c, &s);
    add_operand(c, "x", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 2, SHAPE(s.M, s.K));
    add_operand(c, "w1", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3,
                SHAPE(s.E, 2 * s.I, s.K));
    add_operand(c, "b1", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2,
                SHAPE(s.E, 2 * s.I));
    add_routing(r, c, &s, ROLE_IGNORED);
    add_operand(c, "h", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 3,
                SHAPE(s.M, s.k, s.I));
    maybe_absent(r, c, GA_B1, 50);
}

static void build_moe_final(rng *r, fuzz_call *c)
{
    moe_sizes s;
    pick_moe(r, c, &s);
    add_operand(c, "h", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3, SHAPE(s.M, s.k, s.I));
    add_operand(c, "w2", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3, SHAPE(s.E, s.K, s.I));
    add_operand(c, "b2", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(s.E, s.K));
    add_routing(r, c, &s, ROLE_INPUT);
    c->v[FI_WEIGHTS].only_when_reduced = true;
    int out;
    if (rng_percent(r, 50))
        out = add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 2,
                          SHAPE(s.M, s.K));
    else
        out = add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 3,
                          SHAPE(s.M, s.k, s.K));
    c->v[out].alt_rank = c->v[out].want_rank == 2 ? 3 : 2; /* reduced or not */
    maybe_absent(r, c, FI_B2, 50);
}

static void build_moe_forward(rng *r, fuzz_call *c)
{
    moe_sizes s;
    pick_moe(r, c, &s);
    add_operand(c, "x", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 2, SHAPE(s.M, s.K));
    add_operand(c, "w1", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3,
                SHAPE(s.E, 2 * s.I, s.K));
    add_operand(c, "w2", ROLE_INPUT, false, s.dtype, FLOATS, FILL_FLOATS, 3, SHAPE(s.E, s.K, s.I));
    add_operand(c, "b1", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2,
                SHAPE(s.E, 2 * s.I));
    add_operand(c, "b2", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(s.E, s.K));
    add_routing(r, c, &s, ROLE_INPUT);
    add_operand(c, "out", ROLE_OUTPUT, false, pick_float(r), FLOATS, FILL_BYTES, 2,
                SHAPE(s.M, s.K));
    maybe_absent(r, c, FW_B1, 50);
    maybe_absent(r, c, FW_B2, 50);
}

/* topk_route: valid options (groups that divide E, k within the kept groups), biases or not. */
static void build_topk_route(rng *r, fuzz_call *c)
{
    static const float scales[] = {0.0f, 1.0f, 2.5f, 16.0f};
    /* no huge E (topk_softmax's calls try those): [E] biases, even absent, need a place */
    const int64_t E = rng_percent(r, 70) ? rng_int(r, 1, 16) : rng_int(r, 17, 64);
    const int64_t M = pick_rows(r, 16);
    moefuse_router_options *o = &c->route;
    o->scoring = (moefuse_router_scoring)rng_int(r, 0, MOEFUSE_ROUTER_TOPK_SOFTMAX);
    o->group_scoring = (moefuse_group_scoring)rng_int(r, 0, MOEFUSE_GROUP_MAX);
    o->renormalize = (int32_t)rng_int(r, 0, 1);
    o->scale = PICK(r, scales);
    int64_t kept = E;
    if (E <= 64 && rng_percent(r, 50)) {
        int32_t g = (int32_t)rng_int(r, 1, E);
        while (E % g)
            g--;
        o->n_group = g;
        o->topk_group = g > 1 ? (int32_t)rng_int(r, 1, g) : (int32_t)rng_int(r, 0, 1);
        kept = g > 1 ? o->topk_group * (E / g) : E;
    }
    const int64_t most = kept < 8 ? kept : 8;
    const int64_t k = rng_percent(r, 90) ? rng_int(r, 1, most > 0 ? most : 1) : kept;
    add_operand(c, "logits", ROLE_INPUT, false, pick_float(r), FLOATS, FILL_FLOATS, 2, SHAPE(M, E));
    add_operand(c, "logit_bias", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 1, SHAPE(E));
    add_operand(c, "choice_bias", ROLE_INPUT, true, pick_float(r), FLOATS, FILL_FLOATS, 1,
                SHAPE(E));
    add_operand(c, "ids", ROLE_OUTPUT, false, MOEFUSE_I32, DT(MOEFUSE_I32), FILL_BYTES, 2,
                SHAPE(M, k));
    add_operand(c, "weights", ROLE_OUTPUT, false, MOEFUSE_F32, DT(MOEFUSE_F32), FILL_BYTES, 2,
                SHAPE(M, k));
    maybe_absent(r, c, TR_LOGIT_BIAS, 60);
    maybe_absent(r, c, TR_CHOICE_BIAS, 50);
}

/* routing_metadata: the routing of a MoE call, every output or some, blocks of 1 to 16. */
static void build_routing_meta(rng *r, fuzz_call *c)
{
    static const int32_t blocks[] = {1, 1, 4, 16, 7};
    moe_sizes s;
    pick_moe(r, c, &s);
    c->block_size = PICK(r, blocks);
    add_routing(r, c, &s, ROLE_IGNORED);
    const int64_t S = mul_sat(s.M, s.k);
    const int64_t L = add_sat(add_sat(S, s.E * (c->block_size - 1)), rng_int(r, 0, 3));
    const struct {
        const char *name;
        int rank;
        int64_t a, b;
    } outs[] = {{"counts", 1, s.E, 0},        {"offsets", 1, s.E + 1, 0}, {"order", 1, L, 0},
                {"position", 2, s.M, s.k},   {"masked_row", 2, s.M, s.k}};
    for (int i = 0; i < 5; i++) {
        const int slot = add_operand(c, outs[i].name, ROLE_OUTPUT, i > 0, MOEFUSE_I32,
                                     DT(MOEFUSE_I32), FILL_BYTES, outs[i].rank,
                                     outs[i].rank == 1 ? SHAPE(outs[i].a) : SHAPE(outs[i].a, outs[i].b));
        c->v[slot].in_routing = true; /* members of moefuse_routing_meta */
        if (i > 0)
            maybe_absent(r, c, slot, 30);
    }
}

static void (*const builders[OP_COUNT])(rng *, fuzz_call *) = {
    build_act_quant, build_act_quant_masked, build_act_mul,   build_quant,      build_dequant,
    build_topk_softmax, build_moe_gate,      build_moe_final, build_moe_forward,
    build_topk_route,   build_routing_meta,
};

/* Row padding, padded outer dims and free strides of size-1 dims: all legal. */
static void pick_strides(rng *r, moefuse_tensor *t)
{
    if (!rank_ok(t))
        return;
    bool pad = rng_percent(r, 35);
    t->stride[t->rank - 1] = 1;
    for (int d = t->rank - 2; d >= 0; d--) {
        int64_t inner = t->shape[d + 1] > 0 ? t->shape[d + 1] : 1;
        int64_t row_pad = pad && rng_percent(r, 60) ? rng_int(r, 1, 8) : 0;
        t->stride[d] = add_sat(mul_sat(t->stride[d + 1], inner), row_pad);
    }
    for (int d = 0; d < t->rank - 1; d++)
        if (t->shape[d] == 1 && rng_percent(r, 10))
            t->stride[d] = rng_int(r, 0, 5000);
}

/* Bytes an operand's elements cover when placed at 0 (0 when it has none). */
static int64_t placed_bytes(const operand *o)
{
    int64_t lo, hi, bytes;
    if (!has_elements(&o->t) || !relative_reach(&o->t, &lo, &hi) ||
        __builtin_sub_overflow(hi, lo, &bytes))
        return 0;
    return bytes;
}

/* Disjoint random positions in the arena, in random order; false when they do not fit. */
static bool place_operands(const fuzzer *f, rng *r, fuzz_call *c)
{
    int order[MAX_OPERANDS];
    int64_t reserve = 0;
    for (int i = 0; i < c->count; i++) {
        order[i] = i;
        reserve += placed_bytes(&c->v[i]) + 64 + 256; /* alignment, gap */
    }
    if (reserve > f->arena_bytes)
        return false;
    for (int i = c->count - 1; i > 0; i--) {
        int j = (int)rng_int(r, 0, i), swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
    int64_t cursor = rng_int(r, 0, f->arena_bytes - reserve);
    for (int i = 0; i < c->count; i++) {
        operand *o = &c->v[order[i]];
        cursor = round_up(cursor, rng_percent(r, 50) ? 64 : elem_bytes(o->t.dtype));
        o->pos = cursor;
        cursor += placed_bytes(o) + (rng_percent(r, 30) ? 0 : rng_int(r, 0, 256));
        int64_t choice = rng_int(r, 0, 9);
        o->host_split = choice < 5 ? 0 : choice < 8 ? o->pos : rng_int(r, 0, o->pos);
        /* frameworks hand empty tensors over with NULL data */
        if (is_empty(&o->t) && o->data == DATA_ARENA && rng_percent(r, 30))
            o->data = DATA_NULL;
    }
    return true;
}

/* ----------------------------------------------------------------- perturbations */

typedef bool operand_filter(const fuzz_call *c, const operand *o);

static bool any_operand(const fuzz_call *c, const operand *o) { return (void)c, o->passed; }

static bool shaped_operand(const fuzz_call *c, const operand *o)
{
    return (void)c, o->passed && rank_ok(&o->t);
}

/* In the arena, with elements whose reach is known. */
static bool placed_operand(const fuzz_call *c, const operand *o)
{
    return (void)c, o->passed && o->data == DATA_ARENA && placed_bytes(o) > 0;
}

static bool empty_operand(const fuzz_call *c, const operand *o)
{
    return (void)c, o->passed && is_empty(&o->t);
}

/* A random operand that passes the filter, or -1. */
static int pick_operand(rng *r, const fuzz_call *c, operand_filter *filter)
{
    int candidates[MAX_OPERANDS], n = 0;
    for (int i = 0; i < c->count; i++)
        if (filter(c, &c->v[i]))
            candidates[n++] = i;
    return n ? candidates[rng_int(r, 0, n - 1)] : -1;
}

static bool perturb_dim(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int64_t odd[] = {0, -1, -7, INT64_MIN, INT64_MAX, (int64_t)1 << 40,
                                  (int64_t)1 << 31, 3};
    int i = pick_operand(r, c, shaped_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    int d = (int)rng_int(r, 0, t->rank - 1);
    int64_t old = t->shape[d];
    switch (rng_int(r, 0, 3)) {
    case 0: t->shape[d] = add_sat(old, 1); break;
    case 1: t->shape[d] = add_sat(old, -1); break;
    case 2: t->shape[d] = mul_sat(old, 2); break;
    default: t->shape[d] = PICK(r, odd); break;
    }
    note(c, "%s shape[%d] %lld -> %lld", c->v[i].name, d, (long long)old, (long long)t->shape[d]);
    c->maybe_invalid = true;
    return t->shape[d] != old;
}

static bool perturb_rank(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int32_t odd[] = {0, -1, 5, 64, INT32_MIN};
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    int32_t old = t->rank, rank;
    int64_t choice = rng_int(r, 0, 9);
    int64_t step = choice < 4 ? -1 : 1;
    rank = choice < 8 && old > INT32_MIN && old < INT32_MAX ? (int32_t)(old + step) : PICK(r, odd);
    if (rank > old && rank <= MOEFUSE_MAX_RANK && old >= 0)
        for (int d = old; d < rank; d++)
            t->shape[d] = 1, t->stride[d] = 1;
    t->rank = rank;
    note(c, "%s rank %d -> %d", c->v[i].name, (int)old, (int)rank);
    c->maybe_invalid = true;
    return rank != old;
}

static bool perturb_dtype(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int odd[] = {-1, MOEFUSE_DTYPE_COUNT_, 1000, INT32_MIN};
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    moefuse_dtype old = t->dtype;
    t->dtype = rng_percent(r, 75) ? (moefuse_dtype)rng_int(r, 0, MOEFUSE_DTYPE_COUNT_ - 1)
                                  : (moefuse_dtype)PICK(r, odd);
    note(c, "%s dtype %d -> %d", c->v[i].name, (int)old, (int)t->dtype);
    c->maybe_invalid = true;
    return t->dtype != old;
}

/* Whether the stride is legal is judged from the result (expected_outcome). */
static bool perturb_stride(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int64_t innermost[] = {0, 2, -1, 3, (int64_t)1 << 40};
    static const int64_t odd[] = {0, -1, (int64_t)1 << 40, INT64_MIN, INT64_MAX};
    int i = pick_operand(r, c, shaped_operand);
    if (i < 0)
        return false;
    moefuse_tensor *t = &c->v[i].t;
    int d = (int)rng_int(r, 0, t->rank - 1);
    int64_t old = t->stride[d];
    if (d == t->rank - 1) {
        t->stride[d] = PICK(r, innermost);
    } else {
        switch (rng_int(r, 0, 4)) {
        case 0: t->stride[d] = inner_extent(t, d) - 1; break; /* rows overlap by one element */
        case 1: t->stride[d] = mul_sat(old, -1); break;
        case 2: t->stride[d] = add_sat(old, rng_int(r, 1, 64)); break; /* more padding: legal */
        default: t->stride[d] = PICK(r, odd); break;
        }
    }
    note(c, "%s stride[%d] %lld -> %lld", c->v[i].name, d, (long long)old, (long long)t->stride[d]);
    return t->stride[d] != old;
}

/* Elsewhere in the arena: legal unless it now overlaps an operand it must not. */
static bool perturb_move(const fuzzer *f, rng *r, fuzz_call *c)
{
    int i = pick_operand(r, c, placed_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    int64_t span = placed_bytes(o), es = elem_bytes(o->t.dtype);
    if (span > f->arena_bytes)
        return false;
    o->pos = rng_int(r, 0, f->arena_bytes - span) / es * es;
    o->host_split = rng_percent(r, 50) ? 0 : o->pos;
    note(c, "%s moved to %lld", o->name, (long long)o->pos);
    return true;
}

static bool perturb_misalign(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int i = pick_operand(r, c, placed_operand);
    if (i < 0 || elem_bytes(c->v[i].t.dtype) < 2)
        return false;
    operand *o = &c->v[i];
    o->pos += rng_int(r, 1, elem_bytes(o->t.dtype) - 1);
    o->host_split = rng_percent(r, 50) ? 0 : o->pos;
    note(c, "%s misaligned to %lld", o->name, (long long)o->pos);
    return true;
}

static bool perturb_negative_offset(const fuzzer *f, rng *r, fuzz_call *c)
{
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    int64_t room = f->handles ? 1 << 20 : f->arena_bytes - o->pos; /* host: data stays inside */
    if (room < 1)
        return false;
    o->negative_offset = rng_int(r, 1, room < 4096 ? room : 4096);
    note(c, "%s offset -%lld", o->name, (long long)o->negative_offset);
    return true;
}

/* Only where the library knows buffer sizes: elsewhere it cannot tell, and must not be asked. */
static bool perturb_past_end(const fuzzer *f, rng *r, fuzz_call *c)
{
    if (!f->knows_sizes)
        return false;
    int i = pick_operand(r, c, placed_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    int64_t span = placed_bytes(o), es = elem_bytes(o->t.dtype);
    switch (rng_int(r, 0, 2)) {
    case 0: /* straddles the end */
        o->pos = round_up(f->arena_bytes - span + rng_int(r, 1, span), es);
        break;
    case 1: o->pos = round_up(f->arena_bytes + rng_int(r, 0, 4096), es); break;
    default: o->pos = (int64_t)1 << 40; break;
    }
    note(c, "%s past the end at %lld", o->name, (long long)o->pos);
    return true;
}

/* One operand onto another (in place, or shifted): legal only between inputs. */
static bool perturb_alias(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int a = pick_operand(r, c, placed_operand), b = pick_operand(r, c, placed_operand);
    if (a < 0 || b < 0 || a == b)
        return false;
    operand *moved = &c->v[a];
    const operand *onto = &c->v[b];
    int64_t delta = 0;
    if (rng_percent(r, 60))
        delta = rng_int(r, -placed_bytes(moved) + 1, placed_bytes(onto) - 1) / 4 * 4;
    moved->pos = onto->pos + delta;
    moved->host_split = moved->pos >= 0 && rng_percent(r, 50) ? moved->pos : 0;
    note(c, "%s aliased onto %s%+lld", moved->name, onto->name, (long long)delta);
    return true;
}

static bool perturb_null_data(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int i = pick_operand(r, c, any_operand);
    if (i < 0 || c->v[i].data == DATA_NULL)
        return false;
    c->v[i].data = DATA_NULL;
    note(c, "%s data NULL", c->v[i].name);
    return true;
}

static bool perturb_null_pointer(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    if (o->in_routing) { /* handed by value: the zeroed tensor */
        memset(&o->t, 0, sizeof o->t);
        o->data = DATA_NULL;
        note(c, "%s zeroed", o->name);
    } else {
        o->passed = false;
        note(c, "%s NULL", o->name);
    }
    return true;
}

static bool perturb_foreign(const fuzzer *f, rng *r, fuzz_call *c)
{
    if (!f->checks_ownership)
        return false;
    int i = pick_operand(r, c, any_operand);
    if (i < 0)
        return false;
    c->v[i].data = DATA_FOREIGN;
    c->v[i].pos = c->v[i].pos % 64; /* inside foreign_bytes for the first element */
    note(c, "%s foreign host pointer", c->v[i].name);
    if (is_empty(&c->v[i].t))
        c->maybe_invalid = true; /* an empty tensor's pointer may or may not be looked at */
    return true;
}

/* Any strides and maybe NULL data on an empty tensor: numpy and torch hand those over. */
static bool perturb_empty_strides(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    static const int64_t odd[] = {-5, 0, 7, 1, (int64_t)1 << 40, -((int64_t)1 << 40), INT64_MIN,
                                  INT64_MAX};
    int i = pick_operand(r, c, empty_operand);
    if (i < 0)
        return false;
    operand *o = &c->v[i];
    for (int d = 0; d < o->t.rank; d++)
        o->t.stride[d] = PICK(r, odd);
    if (rng_percent(r, 50) && o->data == DATA_ARENA)
        o->data = DATA_NULL;
    note(c, "empty %s: odd strides%s", o->name, o->data == DATA_NULL ? ", NULL data" : "");
    return true;
}

static float garbage_float(rng *r)
{
    static const float odd[] = {NAN, -NAN, INFINITY, -INFINITY, -1.0f, -1e-10f, -0.0f,
                                1e-36f, 1e-40f, 1e-45f, 1e-38f, 1e-35f * 0.5f};
    return PICK(r, odd);
}

static int32_t garbage_enum(rng *r, int32_t count)
{
    static const int32_t odd[] = {-1, 1000, INT32_MIN, INT32_MAX};
    return rng_percent(r, 40) ? count : rng_percent(r, 30) ? (int32_t)rng_int(r, 0, count - 1)
                                                          : PICK(r, odd);
}

static void perturb_act_option(rng *r, fuzz_call *c, moefuse_act_options *a)
{
    switch (rng_int(r, 0, 5)) {
    case 0: a->activation = (moefuse_activation)garbage_enum(r, MOEFUSE_ACT_COUNT_); break;
    case 1: a->order = (moefuse_gate_order)garbage_enum(r, MOEFUSE_GATE_ORDER_COUNT_); break;
    case 2: a->intermediate = (moefuse_rounding)garbage_enum(r, MOEFUSE_ROUNDING_COUNT_); break;
    case 3: a->alpha = rng_percent(r, 30) ? 1.702f : garbage_float(r); break; /* any activation */
    case 4: a->up_offset = garbage_float(r); break;
    default: a->limit = garbage_float(r); break;
    }
    note(c, "act options {%d, %d, %g, %d, alpha %g, up_offset %g}", (int)a->activation,
         (int)a->order, (double)a->limit, (int)a->intermediate, (double)a->alpha,
         (double)a->up_offset);
}

static void perturb_quant_option(rng *r, fuzz_call *c, moefuse_quant_options *q)
{
    static const int64_t groups[] = {0, 32, 64, 128, 16, 127, 256, -32, (int64_t)1 << 40,
                                     INT64_MIN};
    static const int32_t ue8m0[] = {0, 1, -1, 7};
    switch (rng_int(r, 0, 3)) {
    case 0: /* shapes depend on these: the call may or may not still fit */
        q->group_size = PICK(r, groups);
        c->maybe_invalid = true;
        break;
    case 1:
        q->scale_layout = (moefuse_scale_layout)garbage_enum(r, MOEFUSE_SCALE_LAYOUT_COUNT_);
        c->maybe_invalid = true;
        break;
    case 2:
        q->ue8m0 = PICK(r, ue8m0);
        c->maybe_invalid = true;
        break;
    default: q->eps = garbage_float(r); break;
    }
    note(c, "quant options {G %lld, layout %d, ue8m0 %d, eps %g}", (long long)q->group_size,
         (int)q->scale_layout, (int)q->ue8m0, (double)q->eps);
}

static bool perturb_option(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    if (rng_percent(r, 10)) {
        c->null_options = true;
        note(c, "options NULL");
        if (takes_quant_options(c->op)) /* defaults: G = 128, row-major */
            c->maybe_invalid = true;
        return true;
    }
    if (c->op == OP_TOPK_SOFTMAX) {
        static const int32_t odd[] = {2, -1, INT32_MAX, INT32_MIN};
        c->renormalize = PICK(r, odd);
        note(c, "renormalize %d", (int)c->renormalize);
        return true;
    }
    if (c->op == OP_TOPK_ROUTE) {
        moefuse_router_options *o = &c->route;
        switch (rng_int(r, 0, 5)) {
        case 0: o->scoring = (moefuse_router_scoring)garbage_enum(r, 3); break;
        case 1: o->group_scoring = (moefuse_group_scoring)garbage_enum(r, 2); break;
        case 2: o->n_group = (int32_t)rng_int(r, -2, 70); break;
        case 3: o->topk_group = (int32_t)rng_int(r, -2, 70); break;
        case 4: o->scale = garbage_float(r); break;
        default: o->reserved[rng_int(r, 0, 3)] = (uint32_t)rng_int(r, 1, 1000); break;
        }
        c->maybe_invalid = true;
        note(c, "router options {scoring %d, groups %d/%d (%d), scale %g}", (int)o->scoring,
             (int)o->topk_group, (int)o->n_group, (int)o->group_scoring, (double)o->scale);
        return true;
    }
    if (c->op == OP_ROUTING_META) {
        static const int32_t odd[] = {0, -1, INT32_MIN, 2, 1 << 30};
        c->block_size = PICK(r, odd);
        c->maybe_invalid = true;
        note(c, "block_size %d", (int)c->block_size);
        return true;
    }
    if (is_moe(c->op)) {
        moefuse_act_options a = {.activation = c->moe.activation, .order = c->moe.order,
                                 .limit = c->moe.limit, .alpha = c->moe.alpha,
                                 .up_offset = c->moe.up_offset};
        perturb_act_option(r, c, &a);
        c->moe.activation = a.activation;
        c->moe.order = a.order;
        c->moe.limit = a.limit;
        c->moe.alpha = a.alpha;
        c->moe.up_offset = a.up_offset;
        return true;
    }
    bool act = takes_act_options(c->op), quant = takes_quant_options(c->op);
    if (c->op == OP_ACT_QUANT_MASKED && rng_percent(r, 15)) {
        static const int32_t odd[] = {2, -1, INT32_MIN};
        c->aq.zero_tail = PICK(r, odd);
        note(c, "zero_tail %d", (int)c->aq.zero_tail);
    } else if (act && (!quant || rng_percent(r, 50))) {
        perturb_act_option(r, c, &c->aq.act);
    } else {
        perturb_quant_option(r, c, &c->aq.quant);
    }
    return true;
}

static bool perturb_null_routing(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f, (void)r;
    if (!is_moe(c->op) && c->op != OP_ROUTING_META)
        return false;
    c->null_routing = true;
    note(c, "routing NULL");
    return true;
}

/* Shared experts no call can take: a negative count, more than any E, a NaN scale (with one
 * shared expert, h or out also lack its slot), or any at all in routing_metadata. */
static bool perturb_shared(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f;
    if (!is_moe(c->op) && c->op != OP_ROUTING_META)
        return false;
    switch (rng_int(r, 0, 2)) {
    case 0: c->n_shared = (int32_t)rng_int(r, INT32_MIN, -1); break;
    case 1: c->n_shared = (int32_t)rng_int(r, 1 << 20, INT32_MAX); break;
    default:
        c->n_shared = 1;
        c->shared_scale = NAN;
        break;
    }
    note(c, "routing.n_shared %d, shared_scale %g", (int)c->n_shared, (double)c->shared_scale);
    return true;
}

static bool perturb_null_context(const fuzzer *f, rng *r, fuzz_call *c)
{
    (void)f, (void)r;
    c->null_context = true;
    note(c, "ctx NULL");
    return true;
}

typedef bool perturb_fn(const fuzzer *f, rng *r, fuzz_call *c);

static const struct {
    perturb_fn *fn;
    int weight;
} perturbations[] = {
    {perturb_dim, 12},          {perturb_rank, 4},          {perturb_dtype, 8},
    {perturb_stride, 10},       {perturb_move, 8},          {perturb_misalign, 5},
    {perturb_negative_offset, 3}, {perturb_past_end, 7},    {perturb_alias, 14},
    {perturb_null_data, 5},     {perturb_null_pointer, 4},  {perturb_foreign, 2},
    {perturb_option, 16},       {perturb_empty_strides, 6}, {perturb_null_routing, 1},
    {perturb_null_context, 1},  {perturb_shared, 3},
};

static perturb_fn *pick_perturbation(rng *r)
{
    int total = 0;
    for (int i = 0; i < COUNT_OF(perturbations); i++)
        total += perturbations[i].weight;
    int64_t at = rng_int(r, 0, total - 1);
    for (int i = 0; i < COUNT_OF(perturbations); i++) {
        if (at < perturbations[i].weight)
            return perturbations[i].fn;
        at -= perturbations[i].weight;
    }
    return perturbations[0].fn;
}

/* Host memory cannot be bounds-checked by the library: no tensor may reach outside the arena. */
static bool stays_inside(const fuzzer *f, const fuzz_call *c)
{
    if (f->knows_sizes)
        return true;
    for (int i = 0; i < c->count; i++) {
        const operand *o = &c->v[i];
        if (!o->passed || o->data != DATA_ARENA)
            continue;
        if (o->pos < 0 || o->pos > f->arena_bytes || o->host_split < 0 || o->host_split > o->pos ||
            o->pos + o->negative_offset > f->arena_bytes)
            return false;
        int64_t lo, hi;
        if (!has_elements(&o->t))
            continue;
        if (!arena_reach(o, &lo, &hi) || lo < 0 || hi > f->arena_bytes)
            return false;
    }
    return true;
}

static void apply_perturbation(const fuzzer *f, rng *r, fuzz_call *c)
{
    for (int attempt = 0; attempt < 12; attempt++) {
        fuzz_call trial = *c;
        if (pick_perturbation(r)(f, r, &trial) && stays_inside(f, &trial)) {
            *c = trial;
            c->perturbations++;
            return;
        }
    }
}

/* ----------------------------------------------------------------- what the API must do */

enum expectation { EXPECT_OK, EXPECT_EITHER, EXPECT_REFUSAL };

typedef struct verdict {
    enum expectation expect;
    enum violation_kind kind; /* what accepting it would be */
    char why[200];
} verdict;

static void must_refuse_as(verdict *v, enum violation_kind kind, const char *fmt, ...)
{
    if (v->expect == EXPECT_REFUSAL)
        return; /* the first reason is enough */
    v->expect = EXPECT_REFUSAL;
    v->kind = kind;
    va_list args;
    va_start(args, fmt);
    vsnprintf(v->why, sizeof v->why, fmt, args);
    va_end(args);
}

#define must_refuse(v, ...) must_refuse_as((v), V_ACCEPTED_INVALID, __VA_ARGS__)

static void may_refuse(verdict *v)
{
    if (v->expect == EXPECT_OK)
        v->expect = EXPECT_EITHER;
}

static bool operand_used(const fuzz_call *c, const operand *o)
{
    if (o->role == ROLE_IGNORED)
        return false;
    if (o->only_when_reduced) {
        const operand *out = &c->v[FI_OUT];
        return out->passed && out->t.rank == 2;
    }
    return true;
}

/* Handed over and not absent (an optional operand with NULL data is absent). */
static bool operand_present(const operand *o)
{
    return o->passed && !(o->optional && o->data == DATA_NULL);
}

/* Element 0 off its element size (the arena itself is 64-byte aligned). */
static bool misaligned(const operand *o) { return o->pos % elem_bytes(o->t.dtype) != 0; }

/* Layout rules of a non-empty tensor: strides, offset, alignment, bounds. */
static void judge_layout(const fuzzer *f, const operand *o, verdict *v)
{
    const moefuse_tensor *t = &o->t;
    const int last = t->rank - 1;
    if (t->stride[last] != 1) {
        if (t->shape[last] > 1)
            must_refuse(v, "%s: innermost stride %lld", o->name, (long long)t->stride[last]);
        else
            may_refuse(v);
    }
    for (int d = 0; d < last; d++) {
        if (t->shape[d] == 1) {
            if (t->stride[d] < 0)
                may_refuse(v);
            continue;
        }
        int64_t extent = inner_extent(t, d);
        if (extent < 0)
            must_refuse(v, "%s: extent overflows", o->name);
        else if (t->stride[d] < extent)
            must_refuse(v, "%s: stride[%d] %lld < %lld (rows overlap or run backwards)", o->name,
                        d, (long long)t->stride[d], (long long)extent);
    }
    if (o->negative_offset)
        must_refuse(v, "%s: negative offset", o->name);
    if (misaligned(o))
        must_refuse(v, "%s: misaligned", o->name);
    int64_t lo, hi;
    if (!arena_reach(o, &lo, &hi))
        must_refuse(v, "%s: extent overflows", o->name);
    else if (f->knows_sizes && o->data == DATA_ARENA && (lo < 0 || hi > f->arena_bytes))
        must_refuse_as(v, V_ACCEPTED_OUT_OF_BOUNDS,
                       "%s: bytes [%lld, %lld) outside its %lld-byte buffer",
                       o->name, (long long)lo, (long long)hi, (long long)f->arena_bytes);
}

static void judge_operand(const fuzzer *f, const operand *o, verdict *v)
{
    const moefuse_tensor *t = &o->t;
    if (!o->passed) {
        if (!o->optional)
            must_refuse(v, "%s: NULL", o->name);
        return;
    }
    if (!operand_present(o))
        return;
    if (t->rank != o->want_rank && t->rank != o->alt_rank) {
        must_refuse(v, "%s: rank %d", o->name, (int)t->rank);
        return;
    }
    if (has_negative_dim(t))
        must_refuse(v, "%s: negative dim", o->name);
    else if (!dtype_in(t->dtype, o->allowed))
        must_refuse(v, "%s: dtype %d", o->name, (int)t->dtype);
    else if (is_empty(t)) { /* any strides, NULL data (rule 1); the rest is unspecified */
        if (o->negative_offset || misaligned(o) || o->data == DATA_FOREIGN ||
            (f->knows_sizes && o->data == DATA_ARENA && o->pos >= f->arena_bytes))
            may_refuse(v);
    } else if (o->data == DATA_NULL)
        must_refuse(v, "%s: NULL data", o->name);
    else if (o->data == DATA_FOREIGN)
        must_refuse(v, "%s: foreign pointer", o->name);
    else
        judge_layout(f, o, v);
}

/* No output may share a byte with another operand of the call (rule 4). */
static void judge_overlap(const fuzz_call *c, verdict *v)
{
    for (int i = 0; i < c->count; i++) {
        const operand *out = &c->v[i];
        int64_t lo, hi;
        if (out->role != ROLE_OUTPUT || !operand_present(out) || out->data != DATA_ARENA ||
            !arena_reach(out, &lo, &hi))
            continue;
        for (int j = 0; j < c->count; j++) {
            const operand *other = &c->v[j];
            int64_t other_lo, other_hi;
            if (j == i || !operand_used(c, other) || !operand_present(other) ||
                other->data != DATA_ARENA || !arena_reach(other, &other_lo, &other_hi))
                continue;
            if (lo < other_hi && other_lo < hi)
                must_refuse_as(v, V_ACCEPTED_OVERLAP,
                               "output %s [%lld, %lld) overlaps %s [%lld, %lld)", out->name,
                               (long long)lo, (long long)hi, other->name, (long long)other_lo,
                               (long long)other_hi);
        }
    }
}

static void judge_act_options(const moefuse_act_options *a, verdict *v)
{
    if ((unsigned)a->activation >= MOEFUSE_ACT_COUNT_)
        must_refuse(v, "activation %d", (int)a->activation);
    if ((unsigned)a->order >= MOEFUSE_GATE_ORDER_COUNT_)
        must_refuse(v, "order %d", (int)a->order);
    if ((unsigned)a->intermediate >= MOEFUSE_ROUNDING_COUNT_)
        must_refuse(v, "intermediate %d", (int)a->intermediate);
    if (isnan(a->limit) || a->limit < 0.0f)
        must_refuse(v, "limit %g", (double)a->limit);
    else if (isinf(a->limit) || (a->limit == 0.0f && signbit(a->limit)))
        may_refuse(v);
    if (a->alpha != 0.0f && a->activation != MOEFUSE_ACT_SILU_ALPHA)
        must_refuse(v, "alpha %g with activation %d", (double)a->alpha, (int)a->activation);
    if (a->activation == MOEFUSE_ACT_SILU_ALPHA && a->alpha != 0.0f &&
        !(a->alpha > 0.0f && isfinite(a->alpha)))
        must_refuse(v, "alpha %g", (double)a->alpha);
    if (!isfinite(a->up_offset))
        must_refuse(v, "up_offset %g", (double)a->up_offset);
}

static void judge_quant_options(const fuzz_call *c, const moefuse_quant_options *q, verdict *v)
{
    if ((unsigned)q->scale_layout >= MOEFUSE_SCALE_LAYOUT_COUNT_)
        must_refuse(v, "scale_layout %d", (int)q->scale_layout);
    float eps = q->eps;
    if (eps != 0.0f && (isnan(eps) || isinf(eps) || eps < 1e-35f))
        must_refuse(v, "eps %g", (double)eps); /* rule 2 */
    else if (eps == 0.0f && signbit(eps))
        may_refuse(v);
    if (q->group_size < 0)
        must_refuse(v, "group_size %lld", (long long)q->group_size);
    else if (q->group_size != 0 && q->group_size != 32 && q->group_size != 64 &&
             q->group_size != 128 && q->group_size != c->hidden)
        may_refuse(v); /* depends on H */
    const operand *codes = code_operand(c);
    bool ue8m0 = q->ue8m0 != 0 || q->scale_layout == MOEFUSE_SCALE_PACKED_UE8M0;
    if (codes->passed && codes->t.dtype == MOEFUSE_I8 && ue8m0)
        must_refuse(v, "UE8M0 scales with i8 codes");
}

static void judge_options(const fuzz_call *c, verdict *v)
{
    if (c->null_options)
        return;
    if (takes_act_options(c->op))
        judge_act_options(&c->aq.act, v);
    if (takes_quant_options(c->op))
        judge_quant_options(c, &c->aq.quant, v);
    if (is_moe(c->op)) {
        moefuse_act_options a = {.activation = c->moe.activation, .order = c->moe.order,
                                 .limit = c->moe.limit, .alpha = c->moe.alpha,
                                 .up_offset = c->moe.up_offset};
        judge_act_options(&a, v);
    }
    if (c->op == OP_TOPK_ROUTE) {
        const moefuse_router_options *o = &c->route;
        if ((unsigned)o->scoring > MOEFUSE_ROUTER_TOPK_SOFTMAX)
            must_refuse(v, "scoring %d", (int)o->scoring);
        if ((unsigned)o->group_scoring > MOEFUSE_GROUP_MAX)
            must_refuse(v, "group_scoring %d", (int)o->group_scoring);
        if (!isfinite(o->scale))
            must_refuse(v, "scale %g", (double)o->scale);
        if (o->n_group < 0 || o->n_group > MOEFUSE_ROUTER_MAX_GROUPS)
            must_refuse(v, "n_group %d", (int)o->n_group);
        for (int i = 0; i < 4; i++)
            if (o->reserved[i])
                must_refuse(v, "router options reserved[%d]", i);
    }
}

/* routing_metadata's block size: refused below 1 whatever the tensors. */
static void judge_block_size(const fuzz_call *c, verdict *v)
{
    if (c->op == OP_ROUTING_META && c->block_size < 1)
        must_refuse(v, "block_size %d", (int)c->block_size);
}

/* Shared experts: the fuzzer's calls have none, so any it was given must be refused
 * (perturb_shared gives only counts and scales no call takes). */
static void judge_shared(const fuzz_call *c, verdict *v)
{
    if (c->n_shared != 0)
        must_refuse(v, "routing.n_shared %d", (int)c->n_shared);
}

static verdict expected_outcome(const fuzzer *f, const fuzz_call *c)
{
    verdict v = {c->maybe_invalid ? EXPECT_EITHER : EXPECT_OK, V_ACCEPTED_INVALID, ""};
    if (c->null_context)
        must_refuse(&v, "ctx NULL");
    if (c->null_routing)
        must_refuse(&v, "routing NULL");
    for (int i = 0; i < c->count; i++)
        if (operand_used(c, &c->v[i]))
            judge_operand(f, &c->v[i], &v);
    judge_overlap(c, &v);
    judge_options(c, &v);
    judge_block_size(c, &v);
    judge_shared(c, &v);
    return v;
}

/* ----------------------------------------------------------------- arena contents */

typedef void element_fn(void *opaque, int64_t byte, int64_t bytes);

/* fn for every element of o that lies wholly inside the arena. */
static void for_each_element(const fuzzer *f, const operand *o, element_fn *fn, void *opaque)
{
    const moefuse_tensor *t = &o->t;
    if (!o->passed || o->data != DATA_ARENA || o->negative_offset || !has_elements(t))
        return;
    int64_t count = 1, es = elem_bytes(t->dtype);
    for (int d = 0; d < t->rank; d++)
        if (__builtin_mul_overflow(count, t->shape[d], &count) || count > f->arena_bytes)
            return; /* more elements than bytes: refused anyway, nothing sensible to visit */
    int64_t index[MOEFUSE_MAX_RANK] = {0};
    for (int64_t n = 0; n < count; n++) {
        int64_t off = 0, step;
        bool fits = true;
        for (int d = 0; d < t->rank && fits; d++)
            fits = !__builtin_mul_overflow(index[d], t->stride[d], &step) &&
                   !__builtin_add_overflow(off, step, &off);
        int64_t byte;
        if (fits && !__builtin_mul_overflow(off, es, &byte) &&
            !__builtin_add_overflow(byte, o->pos, &byte) && byte >= 0 &&
            byte <= f->arena_bytes - es)
            fn(opaque, byte, es);
        for (int d = t->rank - 1; d >= 0 && ++index[d] == t->shape[d]; d--)
            index[d] = 0;
    }
}

static float sane_f32(rng *r)
{
    static const float special[] = {0.0f, -0.0f, NAN, INFINITY, -INFINITY, 1e30f, -3e38f,
                                    1e-40f, 448.0f, 1e-30f};
    return rng_percent(r, 3) ? PICK(r, special) : (float)(rng_unit(r) * 8.0 - 4.0);
}

static uint16_t sane_f16(rng *r)
{
    static const uint16_t special[] = {0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x0001, 0x7BFF};
    if (rng_percent(r, 3))
        return PICK(r, special);
    return (uint16_t)((rng_int(r, 0, 1) << 15) | (rng_int(r, 10, 17) << 10) | rng_int(r, 0, 1023));
}

static uint16_t sane_bf16(rng *r)
{
    static const uint16_t special[] = {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x7F7F};
    if (rng_percent(r, 3))
        return PICK(r, special);
    return (uint16_t)((rng_int(r, 0, 1) << 15) | (rng_int(r, 120, 129) << 7) | rng_int(r, 0, 127));
}

/* Device data is never trusted: some ids, map entries and counts are out of range. */
static int32_t routing_value(rng *r, enum fill_kind kind, int64_t limit)
{
    const int32_t top = (int32_t)limit;
    switch (kind) {
    case FILL_IDS: {
        const int32_t odd[] = {-1, -2, top, top + 3, INT32_MIN, INT32_MAX};
        return rng_percent(r, 85) ? (int32_t)rng_int(r, 0, limit - 1) : PICK(r, odd);
    }
    case FILL_MAP: {
        const int32_t odd[] = {top, -7, INT32_MIN, INT32_MAX};
        int64_t choice = rng_int(r, 0, 9);
        return choice < 7 ? (int32_t)rng_int(r, 0, limit - 1) : choice < 9 ? -1 : PICK(r, odd);
    }
    default: { /* counts: clamped to [0, Tmax] by the kernels */
        const int32_t odd[] = {-1, -100, top + 1, top + 50, INT32_MIN, INT32_MAX};
        return rng_percent(r, 75) ? (int32_t)rng_int(r, 0, limit) : PICK(r, odd);
    }
    }
}

typedef struct fill_job {
    unsigned char *image;
    rng *r;
    const operand *o;
} fill_job;

static void fill_element(void *opaque, int64_t byte, int64_t bytes)
{
    fill_job *job = opaque;
    unsigned char *dst = job->image + byte;
    const moefuse_dtype dt = job->o->t.dtype;
    (void)bytes;
    switch (job->o->fill) {
    case FILL_FLOATS:
    case FILL_PROBS:
        if (dt == MOEFUSE_F32) {
            float v = job->o->fill == FILL_PROBS ? (float)rng_unit(job->r) : sane_f32(job->r);
            memcpy(dst, &v, 4);
        } else if (dt == MOEFUSE_F16 || dt == MOEFUSE_BF16) {
            uint16_t v = dt == MOEFUSE_F16 ? sane_f16(job->r) : sane_bf16(job->r);
            memcpy(dst, &v, 2);
        }
        break;
    case FILL_IDS:
    case FILL_MAP:
    case FILL_COUNTS:
        if (dt == MOEFUSE_I32 && job->o->fill_limit > 0) {
            int32_t value = routing_value(job->r, job->o->fill, job->o->fill_limit);
            memcpy(dst, &value, 4);
        } else if (dt == MOEFUSE_I32 && job->o->fill == FILL_COUNTS) {
            int32_t value = (int32_t)rng_int(job->r, -2, 2);
            memcpy(dst, &value, 4);
        }
        break;
    default: break; /* the random bytes already there */
    }
}

/* Random bytes everywhere, then input values that make the kernels do real work. */
static void compose_image(fuzzer *f, rng *r, const fuzz_call *c)
{
    uint64_t word = rng_next(r) | 1; /* xorshift64: the bulk of the bytes, cheaply */
    for (int64_t i = 0; i + 8 <= f->arena_bytes; i += 8) {
        word ^= word << 13, word ^= word >> 7, word ^= word << 17;
        memcpy(f->image + i, &word, 8);
    }
    for (int i = 0; i < c->count; i++) {
        const operand *o = &c->v[i];
        if (o->role == ROLE_OUTPUT || o->fill == FILL_BYTES)
            continue;
        if (o->fill == FILL_FLOATS && rng_percent(r, 25))
            continue; /* raw bytes: NaN, Inf and huge values too */
        fill_job job = {f->image, r, o};
        for_each_element(f, o, fill_element, &job);
    }
}

static void mark_writable(void *opaque, int64_t byte, int64_t bytes)
{
    memset((unsigned char *)opaque + byte, 1, (size_t)bytes);
}

/* ----------------------------------------------------------------- making the call */

static void bind_operand(const fuzzer *f, operand *o)
{
    switch (o->data) {
    case DATA_NULL:
        o->t.data = NULL;
        o->t.offset = o->pos;
        break;
    case DATA_FOREIGN:
        o->t.data = foreign_bytes;
        o->t.offset = o->pos;
        break;
    default:
        if (f->handles) {
            o->t.data = f->arena;
            o->t.offset = o->pos;
        } else {
            o->t.data = (unsigned char *)f->arena + o->host_split;
            o->t.offset = o->pos - o->host_split;
        }
        break;
    }
    if (o->negative_offset) {
        if (!f->handles && o->data == DATA_ARENA) /* same element 0, offset field negative */
            o->t.data = (unsigned char *)f->arena + o->pos + o->negative_offset;
        o->t.offset = -o->negative_offset;
    }
}

static const moefuse_tensor *arg(const fuzz_call *c, int slot)
{
    return c->v[slot].passed ? &c->v[slot].t : NULL;
}

static moefuse_routing routing_of(const fuzz_call *c, int ids, int weights, int map)
{
    moefuse_routing routing = {0}; /* no shared experts, unless perturbed */
    routing.n_shared = c->n_shared;
    routing.shared_scale = c->shared_scale;
    routing.topk_ids = c->v[ids].t;
    routing.topk_weights = c->v[weights].t;
    routing.expert_map = c->v[map].t;
    return routing;
}

static moefuse_status invoke(const fuzzer *f, const fuzz_call *c)
{
    moefuse_context *ctx = c->null_context ? NULL : f->ctx;
    const moefuse_act_quant_options *aq = c->null_options ? NULL : &c->aq;
    const moefuse_act_options *act = c->null_options ? NULL : &c->aq.act;
    const moefuse_quant_options *quant = c->null_options ? NULL : &c->aq.quant;
    const moefuse_moe_options *moe = c->null_options ? NULL : &c->moe;
    moefuse_routing routing;
    switch (c->op) {
    case OP_ACT_QUANT:
        return moefuse_act_quant(ctx, arg(c, AQ_X), arg(c, AQ_ROW_SCALE), arg(c, AQ_Q),
                                 arg(c, AQ_SCALES), aq);
    case OP_ACT_QUANT_MASKED:
        return moefuse_act_quant_masked(ctx, arg(c, MQ_X), arg(c, MQ_COUNTS), arg(c, MQ_ROW_SCALE),
                                        arg(c, MQ_EXPERT_SCALE), arg(c, MQ_Q), arg(c, MQ_SCALES),
                                        aq);
    case OP_ACT_MUL:
        return moefuse_act_mul(ctx, arg(c, AM_X), arg(c, AM_ROW_SCALE), arg(c, AM_OUT), act);
    case OP_QUANT:
        return moefuse_quant(ctx, arg(c, QU_X), arg(c, QU_Q), arg(c, QU_SCALES), quant);
    case OP_DEQUANT:
        return moefuse_dequant(ctx, arg(c, DQ_Q), arg(c, DQ_SCALES), arg(c, DQ_OUT), quant);
    case OP_TOPK_SOFTMAX:
        return moefuse_topk_softmax(ctx, arg(c, TK_LOGITS), c->renormalize, arg(c, TK_IDS),
                                    arg(c, TK_WEIGHTS));
    case OP_MOE_GATE:
        routing = routing_of(c, GA_IDS, GA_WEIGHTS, GA_MAP);
        return moefuse_moe_gate(ctx, arg(c, GA_X), arg(c, GA_W1), arg(c, GA_B1),
                                c->null_routing ? NULL : &routing, arg(c, GA_H), moe);
    case OP_MOE_FINAL:
        routing = routing_of(c, FI_IDS, FI_WEIGHTS, FI_MAP);
        return moefuse_moe_final(ctx, arg(c, FI_H), arg(c, FI_W2), arg(c, FI_B2),
                                 c->null_routing ? NULL : &routing, arg(c, FI_OUT), moe);
    case OP_TOPK_ROUTE:
        return moefuse_topk_route(ctx, arg(c, TR_LOGITS), arg(c, TR_LOGIT_BIAS),
                                  arg(c, TR_CHOICE_BIAS), c->null_options ? NULL : &c->route,
                                  arg(c, TR_IDS), arg(c, TR_WEIGHTS));
    case OP_ROUTING_META: {
        routing = routing_of(c, RM_IDS, RM_WEIGHTS, RM_MAP);
        const moefuse_routing_meta meta = {c->v[RM_COUNTS].t, c->v[RM_OFFSETS].t, c->v[RM_ORDER].t,
                                           c->v[RM_POSITION].t, c->v[RM_MASKED_ROW].t};
        return moefuse_routing_metadata(ctx, c->null_routing ? NULL : &routing, c->block_size,
                                        &meta);
    }
    default:
        routing = routing_of(c, FW_IDS, FW_WEIGHTS, FW_MAP);
        return moefuse_moe_forward(ctx, arg(c, FW_X), arg(c, FW_W1), arg(c, FW_W2), arg(c, FW_B1),
                                   arg(c, FW_B2), c->null_routing ? NULL : &routing, arg(c, FW_OUT),
                                   moe);
    }
}

static void build_call(const fuzzer *f, rng *r, fuzz_call *c)
{
    enum op op = (enum op)rng_int(r, 0, OP_COUNT - 1);
    for (int attempt = 0;; attempt++) {
        memset(c, 0, sizeof *c);
        c->op = op;
        builders[op](r, c);
        for (int i = 0; i < c->count; i++)
            pick_strides(r, &c->v[i].t);
        if (place_operands(f, r, c))
            break;
        if (attempt == 100) {
            fprintf(stderr, "fuzz_api: cannot place a %s call in the arena (a bug here)\n",
                    op_names[op]);
            exit(2);
        }
    }
    int64_t choice = rng_int(r, 0, 99);
    int count = choice < 30 ? 0 : choice < 85 ? 1 : (int)rng_int(r, 2, 3);
    for (int i = 0; i < count; i++)
        apply_perturbation(f, r, c);
    for (int i = 0; i < c->count; i++)
        bind_operand(f, &c->v[i]);
}

/* ----------------------------------------------------------------- reports */

static const char *shape_text(char *buf, size_t size, int rank, const int64_t *v)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int d = 0; d < rank && d < MOEFUSE_MAX_RANK && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld", (long long)v[d]);
    if (used < size)
        snprintf(buf + used, size - used, "]");
    return buf;
}

static void describe_operand(const fuzz_call *c, const operand *o)
{
    static const char *const roles[] = {"input", "output", "ignored"};
    char shape[128], stride[128];
    printf("    %-13s %-7s ", o->name, roles[o->role]);
    if (!o->passed) {
        printf("NULL pointer\n");
        return;
    }
    printf("%s rank %d shape %s stride %s", moefuse_dtype_name(o->t.dtype), (int)o->t.rank,
           shape_text(shape, sizeof shape, o->t.rank, o->t.shape),
           shape_text(stride, sizeof stride, o->t.rank, o->t.stride));
    if (o->data == DATA_NULL)
        printf(", data NULL");
    else if (o->data == DATA_FOREIGN)
        printf(", foreign pointer");
    else
        printf(", at arena byte %lld", (long long)o->pos);
    printf(" (offset %lld)", (long long)o->t.offset);
    int64_t lo, hi;
    if (o->data == DATA_ARENA && arena_reach(o, &lo, &hi))
        printf(", bytes [%lld, %lld)", (long long)lo, (long long)hi);
    if (!operand_used(c, o))
        printf(", not read by this call");
    printf("\n");
}

static void describe_options(const fuzz_call *c)
{
    const moefuse_act_options *a = &c->aq.act;
    const moefuse_quant_options *q = &c->aq.quant;
    if (c->null_options) {
        printf("    options NULL\n");
        return;
    }
    if (takes_act_options(c->op))
        printf("    act {activation %d, order %d, limit %g, intermediate %d, alpha %g, "
               "up_offset %g}\n",
               (int)a->activation, (int)a->order, (double)a->limit, (int)a->intermediate,
               (double)a->alpha, (double)a->up_offset);
    if (takes_quant_options(c->op))
        printf("    quant {group_size %lld, layout %d, ue8m0 %d, eps %g}%s\n",
               (long long)q->group_size, (int)q->scale_layout, (int)q->ue8m0, (double)q->eps,
               c->op == OP_ACT_QUANT_MASKED ? (c->aq.zero_tail ? " zero_tail" : "") : "");
    if (is_moe(c->op))
        printf("    moe {activation %d, order %d, limit %g, alpha %g, up_offset %g}%s\n",
               (int)c->moe.activation, (int)c->moe.order, (double)c->moe.limit,
               (double)c->moe.alpha, (double)c->moe.up_offset,
               c->null_routing ? " routing NULL" : "");
    if (c->op == OP_TOPK_SOFTMAX)
        printf("    renormalize %d\n", (int)c->renormalize);
    if (c->op == OP_TOPK_ROUTE)
        printf("    router {scoring %d, n_group %d, topk_group %d, group_scoring %d, renormalize "
               "%d, scale %g}\n",
               (int)c->route.scoring, (int)c->route.n_group, (int)c->route.topk_group,
               (int)c->route.group_scoring, (int)c->route.renormalize, (double)c->route.scale);
    if (c->op == OP_ROUTING_META)
        printf("    block_size %d%s\n", (int)c->block_size, c->null_routing ? " routing NULL" : "");
}

static void describe_call(const fuzz_call *c)
{
    printf("  %s%s, perturbed: %s\n", op_names[c->op], c->null_context ? " (ctx NULL)" : "",
           c->perturbations ? c->notes : "nothing");
    for (int i = 0; i < c->count; i++)
        describe_operand(c, &c->v[i]);
    describe_options(c);
}

typedef struct call_record {
    uint64_t index;
    moefuse_status status;
    char message[1024];
} call_record;

static void violation(fuzzer *f, enum violation_kind kind, const fuzz_call *c,
                      const call_record *rec, const char *fmt, ...)
{
    f->violations++;
    if (++f->violations_of[kind] > REPORTS_PER_KIND)
        return;
    printf("VIOLATION (%s): seed %llu call %llu on %s: ", violation_names[kind],
           (unsigned long long)f->seed, (unsigned long long)rec->index, f->backend);
    va_list args;
    va_start(args, fmt);
    vprintf(fmt, args);
    va_end(args);
    printf("\n  returned %s: \"%s\"\n", moefuse_status_name(rec->status), rec->message);
    if (c)
        describe_call(c);
    printf("  replay: MOEFUSE_TEST_BACKEND=%s MOEFUSE_FUZZ_SEED=%llu MOEFUSE_FUZZ_START=%llu "
           "MOEFUSE_FUZZ_CALLS=1 MOEFUSE_FUZZ_VERBOSE=1 %s\n",
           f->backend, (unsigned long long)f->seed, (unsigned long long)rec->index, f->program);
    fflush(stdout);
}

/* Names of the operands whose bytes hold arena byte b, for reports. */
static const char *owners_of(const fuzz_call *c, int64_t b, char *buf, size_t size)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < c->count; i++) {
        int64_t lo, hi;
        const operand *o = &c->v[i];
        if (o->passed && o->data == DATA_ARENA && arena_reach(o, &lo, &hi) && lo <= b && b < hi &&
            used < size)
            used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? ", " : "", o->name);
    }
    if (!used)
        snprintf(buf, size, "no operand");
    return buf;
}

/* Changed bytes that were not allowed to change; reports the first few. */
static void check_writes(fuzzer *f, const fuzz_call *c, const call_record *rec, bool accepted)
{
    if (memcmp(f->before, f->after, (size_t)f->arena_bytes) == 0)
        return;
    memset(f->writable, 0, (size_t)f->arena_bytes);
    if (accepted)
        for (int i = 0; i < c->count; i++)
            if (c->v[i].role == ROLE_OUTPUT && operand_present(&c->v[i]))
                for_each_element(f, &c->v[i], mark_writable, f->writable);
    char where[400] = "", owners[96];
    size_t used = 0;
    int64_t bad = 0;
    for (int64_t b = 0; b < f->arena_bytes; b++) {
        if (b % 64 == 0 && memcmp(f->before + b, f->after + b, 64) == 0) {
            b += 63; /* ARENA_BYTES is a multiple of 64 */
            continue;
        }
        if (f->before[b] == f->after[b] || f->writable[b])
            continue;
        if (bad++ < 4 && used < sizeof where)
            used += (size_t)snprintf(where + used, sizeof where - used,
                                     "%sbyte %lld (in %s) 0x%02x -> 0x%02x", used ? "; " : "",
                                     (long long)b, owners_of(c, b, owners, sizeof owners),
                                     f->before[b], f->after[b]);
    }
    if (bad)
        violation(f, accepted ? V_WROTE_OUTSIDE_OUTPUTS : V_REFUSED_BUT_WROTE, c, rec,
                  "%s call changed %lld bytes %s: %s", accepted ? "an accepted" : "a refused",
                  (long long)bad, accepted ? "outside its outputs" : "of the arena", where);
}

static void check_call(fuzzer *f, const fuzz_call *c, const call_record *rec, const verdict *v)
{
    moefuse_status st = rec->status;
    if ((unsigned)st >= MOEFUSE_STATUS_COUNT_) {
        violation(f, V_STATUS, c, rec, "status %d is not a moefuse_status", (int)st);
        return;
    }
    if (st == MOEFUSE_OK) {
        if (rec->message[0])
            violation(f, V_MESSAGE, c, rec, "accepted, yet the last error is set");
        if (v->expect == EXPECT_REFUSAL)
            violation(f, v->kind, c, rec, "accepted a call it must refuse: %s", v->why);
    } else {
        if (!rec->message[0])
            violation(f, V_MESSAGE, c, rec, "refused without a message");
        if (v->expect == EXPECT_OK)
            violation(f, V_REFUSED_VALID, c, rec, "refused a valid call");
        /* every tensor fits in the arena: no scratch worth failing for, no device error */
        else if (st == MOEFUSE_ERR_INTERNAL || st == MOEFUSE_ERR_BACKEND_FAILURE ||
                 st == MOEFUSE_ERR_OUT_OF_MEMORY)
            violation(f, V_STATUS, c, rec, "%s on a call whose tensors fit in %d KiB",
                      moefuse_status_name(st), ARENA_BYTES / 1024);
    }
    check_writes(f, c, rec, st == MOEFUSE_OK);
}

/* ----------------------------------------------------------------- one call */

static uint64_t current_call = UINT64_MAX; /* for the crash message */

static bool upload_and_snapshot(fuzzer *f)
{
    return moefuse_buffer_write(f->ctx, f->arena, 0, f->image, (size_t)f->arena_bytes) ==
               MOEFUSE_OK &&
           moefuse_buffer_read(f->ctx, f->arena, 0, f->before, (size_t)f->arena_bytes) ==
               MOEFUSE_OK;
}

static void run_call(fuzzer *f, uint64_t index)
{
    rng r = call_rng(f->seed, index);
    fuzz_call c;
    call_record rec = {index, MOEFUSE_OK, ""};
    current_call = index;
    build_call(f, &r, &c);
    verdict v = expected_outcome(f, &c);
    compose_image(f, &r, &c);
    if (!upload_and_snapshot(f)) {
        snprintf(rec.message, sizeof rec.message, "%s", moefuse_last_error(f->ctx));
        violation(f, V_CONTEXT, &c, &rec, "cannot upload the arena");
        return;
    }
    if (f->verbose) { /* before the call, so that a crash shows what it was */
        printf("call %llu: expected %s%s%s\n", (unsigned long long)index,
               v.expect == EXPECT_OK ? "ok" : v.expect == EXPECT_REFUSAL ? "refusal" : "either",
               v.why[0] ? ": " : "", v.why);
        describe_call(&c);
        fflush(stdout);
    }
    rec.status = invoke(f, &c);
    snprintf(rec.message, sizeof rec.message, "%s",
             moefuse_last_error(c.null_context ? NULL : f->ctx));
    moefuse_status sync = moefuse_synchronize(f->ctx);
    moefuse_status read =
        moefuse_buffer_read(f->ctx, f->arena, 0, f->after, (size_t)f->arena_bytes);
    op_stats *s = &f->stats[c.op];
    s->calls++;
    if (rec.status == MOEFUSE_OK)
        s->ok++;
    else
        s->refused++;
    if (f->verbose)
        printf("  -> %s \"%s\"\n", moefuse_status_name(rec.status), rec.message);
    if (sync != MOEFUSE_OK || read != MOEFUSE_OK) {
        violation(f, V_CONTEXT, &c, &rec, "the context broke: synchronize %s, buffer_read %s",
                  moefuse_status_name(sync), moefuse_status_name(read));
        return;
    }
    check_call(f, &c, &rec, &v);
}

/* ----------------------------------------------------------------- the known-good call */

typedef struct health_layout {
    int64_t cursor;
    unsigned char *image;
    void *buffer;
    bool handles;
} health_layout;

/* A dense tensor in the health buffer with deterministic contents (generator seeded per tensor). */
static moefuse_tensor health_tensor(health_layout *h, moefuse_dtype dt, int rank,
                                    const int64_t *shape, uint64_t seed)
{
    moefuse_tensor t = moefuse_tensor_dense(NULL, dt, rank, shape);
    h->cursor = round_up(h->cursor, 64);
    t.data = h->handles ? h->buffer : (unsigned char *)h->buffer + h->cursor;
    t.offset = h->handles ? h->cursor : 0;
    rng r = {seed};
    int64_t n = moefuse_tensor_numel(&t);
    for (int64_t i = 0; i < n; i++) {
        unsigned char *p = h->image + h->cursor + i * (int64_t)moefuse_dtype_size(dt);
        if (dt == MOEFUSE_F32) {
            float v = (float)(rng_unit(&r) * 2.0 - 1.0);
            memcpy(p, &v, 4);
        } else if (dt == MOEFUSE_I32) { /* ids: experts 0..3 */
            int32_t v = (int32_t)rng_int(&r, 0, 3);
            memcpy(p, &v, 4);
        } else {
            *p = (unsigned char)rng_next(&r);
        }
    }
    h->cursor += moefuse_tensor_span_bytes(&t);
    return t;
}

static moefuse_status health_calls(fuzzer *f)
{
    health_layout h = {0, f->health_image, f->health, f->handles};
    moefuse_tensor x = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 256), 1);
    moefuse_tensor q = health_tensor(&h, MOEFUSE_F8_E4M3, 2, SHAPE(4, 128), 2);
    moefuse_tensor s = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 1), 3);
    moefuse_tensor logits = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 8), 4);
    moefuse_tensor top_ids = health_tensor(&h, MOEFUSE_I32, 2, SHAPE(4, 2), 5);
    moefuse_tensor top_w = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 2), 6);
    moefuse_tensor mx = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(3, 16), 7);
    moefuse_tensor w1 = health_tensor(&h, MOEFUSE_F32, 3, SHAPE(4, 16, 16), 8);
    moefuse_tensor w2 = health_tensor(&h, MOEFUSE_F32, 3, SHAPE(4, 16, 8), 9);
    moefuse_routing routing = {.topk_ids = health_tensor(&h, MOEFUSE_I32, 2, SHAPE(3, 2), 10),
                               .topk_weights = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(3, 2), 11)};
    moefuse_tensor out = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(3, 16), 12);
    f->health_bytes = h.cursor;
    moefuse_status st;
    if ((st = moefuse_buffer_write(f->ctx, f->health, 0, f->health_image, (size_t)h.cursor)) ||
        (st = moefuse_act_quant(f->ctx, &x, NULL, &q, &s, NULL)) ||
        (st = moefuse_topk_softmax(f->ctx, &logits, 1, &top_ids, &top_w)) ||
        (st = moefuse_moe_forward(f->ctx, &mx, &w1, &w2, NULL, NULL, &routing, &out, NULL)) ||
        (st = moefuse_synchronize(f->ctx)))
        return st;
    return moefuse_buffer_read(f->ctx, f->health, 0, f->health_now, (size_t)h.cursor);
}

/* The same valid calls give the same bytes as at the start: the context still works. */
static void health_check(fuzzer *f, uint64_t index)
{
    call_record rec = {index, MOEFUSE_OK, ""};
    rec.status = health_calls(f);
    if (rec.status != MOEFUSE_OK) {
        snprintf(rec.message, sizeof rec.message, "%s", moefuse_last_error(f->ctx));
        violation(f, V_CONTEXT, NULL, &rec, "the known-good calls failed after call %llu",
                  (unsigned long long)index);
        return;
    }
    if (!f->health_recorded) {
        memcpy(f->health_reference, f->health_now, (size_t)f->health_bytes);
        f->health_recorded = true;
    } else if (memcmp(f->health_reference, f->health_now, (size_t)f->health_bytes) != 0) {
        violation(f, V_CONTEXT, NULL, &rec,
                  "the known-good calls give other bytes than at the start");
    }
}

/* ----------------------------------------------------------------- setup and main */

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t env_u64(const char *name, uint64_t fallback, bool *given)
{
    const char *s = getenv(name);
    if (given)
        *given = s && *s;
    return s && *s ? strtoull(s, NULL, 0) : fallback;
}

static uint64_t random_seed(void)
{
    uint64_t seed = 0;
    FILE *urandom = fopen("/dev/urandom", "rb");
    if (!urandom || fread(&seed, sizeof seed, 1, urandom) != 1)
        seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    if (urandom)
        fclose(urandom);
    return seed & 0xFFFFFFFFFFFFull;
}

static bool backend_built(const char *name)
{
    const char *list = moefuse_built_backends();
    size_t n = strlen(name);
    for (const char *p = list; (p = strstr(p, name)) != NULL; p += n)
        if ((p == list || p[-1] == ',') && (p[n] == '\0' || p[n] == ','))
            return true;
    return false;
}

/* 0: ready; 77: built but no device (Meson's SKIP); 1: failure. */
static int open_context(fuzzer *f)
{
    moefuse_status st = moefuse_context_create(&f->ctx, f->backend);
    if (st == MOEFUSE_OK) {
        const char *name = moefuse_backend_name(f->ctx);
        f->handles = strcmp(name, "opencl") == 0;
        f->knows_sizes = f->handles;
        f->checks_ownership = strcmp(name, "cpu") != 0;
        return 0;
    }
    if (st == MOEFUSE_ERR_BACKEND_UNAVAILABLE && backend_built(f->backend)) {
        printf("SKIP: backend %s unavailable: %s\n", f->backend, moefuse_last_error(NULL));
        return 77;
    }
    printf("FAIL: no context on backend %s (built: %s): %s: %s\n", f->backend,
           moefuse_built_backends(), moefuse_status_name(st), moefuse_last_error(NULL));
    return 1;
}

static bool allocate(fuzzer *f)
{
    f->arena_bytes = ARENA_BYTES;
    f->image = malloc(ARENA_BYTES);
    f->before = malloc(ARENA_BYTES);
    f->after = malloc(ARENA_BYTES);
    f->writable = malloc(ARENA_BYTES);
    f->health_image = calloc(1, 16384);
    f->health_reference = malloc(16384);
    f->health_now = malloc(16384);
    return f->image && f->before && f->after && f->writable && f->health_image &&
           f->health_reference && f->health_now &&
           moefuse_buffer_alloc(f->ctx, ARENA_BYTES, &f->arena) == MOEFUSE_OK &&
           moefuse_buffer_alloc(f->ctx, 16384, &f->health) == MOEFUSE_OK;
}

static void release(fuzzer *f)
{
    moefuse_buffer_free(f->ctx, f->arena);
    moefuse_buffer_free(f->ctx, f->health);
    moefuse_context_destroy(f->ctx);
    free(f->image);
    free(f->before);
    free(f->after);
    free(f->writable);
    free(f->health_image);
    free(f->health_reference);
    free(f->health_now);
}

static uint64_t crash_seed;
static const char *crash_backend = "";

static void write_text(const char *s) { (void)!write(2, s, strlen(s)); }

static void write_number(uint64_t v)
{
    char digits[24];
    int n = 0;
    do
        digits[n++] = (char)('0' + v % 10);
    while ((v /= 10) && n < 24);
    while (n)
        (void)!write(2, &digits[--n], 1);
}

/* A crash is a failure too: say which call, so that it can be replayed. */
static void report_crash(void)
{
    static volatile sig_atomic_t reported;
    if (reported)
        return; /* ASan's death callback, then its abort */
    reported = 1;
    write_text("\nfuzz_api: crashed in call ");
    write_number(current_call);
    write_text(" (replay: MOEFUSE_TEST_BACKEND=");
    write_text(crash_backend);
    write_text(" MOEFUSE_FUZZ_SEED=");
    write_number(crash_seed);
    write_text(" MOEFUSE_FUZZ_START=");
    write_number(current_call);
    write_text(" MOEFUSE_FUZZ_CALLS=1 MOEFUSE_FUZZ_VERBOSE=1)\n");
}

static void on_fatal_signal(int sig)
{
    report_crash();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_crash_report(const fuzzer *f)
{
    crash_seed = f->seed;
    crash_backend = f->backend;
#ifdef FUZZ_ASAN
    /* keep ASan's own SEGV report; a separate UBSan runtime (gcc) comes through SIGABRT
       when UBSAN_OPTIONS has abort_on_error=1, as tests/meson.build sets */
    __sanitizer_set_death_callback(report_crash);
#else
    signal(SIGSEGV, on_fatal_signal);
    signal(SIGBUS, on_fatal_signal);
    signal(SIGFPE, on_fatal_signal);
    signal(SIGILL, on_fatal_signal);
#endif
    signal(SIGABRT, on_fatal_signal);
}

static void print_summary(const fuzzer *f, double seconds)
{
    op_stats total = {0, 0, 0};
    for (int op = 0; op < OP_COUNT; op++) {
        const op_stats *s = &f->stats[op];
        printf("  %-17s %8llu calls (%llu ok, %llu refused)\n", op_names[op],
               (unsigned long long)s->calls, (unsigned long long)s->ok,
               (unsigned long long)s->refused);
        total.calls += s->calls, total.ok += s->ok, total.refused += s->refused;
    }
    if (f->violations) {
        printf("violations by kind (the first %d of each are described above):", REPORTS_PER_KIND);
        for (int k = 0; k < V_KIND_COUNT; k++)
            if (f->violations_of[k])
                printf(" %s %llu;", violation_names[k], (unsigned long long)f->violations_of[k]);
        printf("\n");
    }
    printf("fuzz_api on %s: %llu calls (%llu ok, %llu refused) in %.1f s, %.0f calls/s, "
           "seed %llu, %llu violations\n",
           f->backend, (unsigned long long)total.calls, (unsigned long long)total.ok,
           (unsigned long long)total.refused, seconds,
           seconds > 0 ? (double)total.calls / seconds : 0.0,
           (unsigned long long)f->seed, (unsigned long long)f->violations);
}

int main(int argc, char **argv)
{
    fuzzer f;
    memset(&f, 0, sizeof f);
    const char *backend = getenv("MOEFUSE_TEST_BACKEND");
    f.backend = backend && *backend ? backend : "cpu";
    f.program = argc > 0 ? argv[0] : "fuzz_api";
    int gate = open_context(&f);
    if (gate != 0)
        return gate;
    if (!allocate(&f)) {
        printf("FAIL: cannot allocate the arena: %s\n", moefuse_last_error(f.ctx));
        return 1;
    }
    bool seed_given, calls_given;
    f.seed = env_u64("MOEFUSE_FUZZ_SEED", 0, &seed_given);
    if (!seed_given)
        f.seed = random_seed();
    uint64_t calls = env_u64("MOEFUSE_FUZZ_CALLS", 0, &calls_given);
    uint64_t start = env_u64("MOEFUSE_FUZZ_START", 0, NULL);
    const char *seconds_text = getenv("MOEFUSE_FUZZ_SECONDS");
    /* a call count alone means exactly that many calls, whatever the time */
    double seconds = seconds_text && *seconds_text ? strtod(seconds_text, NULL)
                     : calls_given                 ? 0.0
                                                   : DEFAULT_SECONDS;
    f.verbose = env_u64("MOEFUSE_FUZZ_VERBOSE", 0, NULL) != 0;
    printf("fuzz_api: backend %s (%s), MOEFUSE_FUZZ_SEED=%llu, from call %llu", f.backend,
           moefuse_device_name(f.ctx), (unsigned long long)f.seed, (unsigned long long)start);
    if (seconds > 0)
        printf(", for %g s", seconds);
    if (calls_given)
        printf(", at most %llu calls", (unsigned long long)calls);
    printf("\n");
    fflush(stdout);
    install_crash_report(&f);

    health_check(&f, start);
    double began = now_seconds();
    uint64_t index = start;
    for (; !calls_given || index - start < calls; index++) {
        if (seconds > 0 && now_seconds() - began >= seconds)
            break;
        run_call(&f, index);
        if ((index + 1) % HEALTH_EVERY == 0)
            health_check(&f, index);
    }
    double elapsed = now_seconds() - began;
    health_check(&f, index);
    print_summary(&f, elapsed);
    release(&f);
    return f.violations ? 1 : 0;
}
