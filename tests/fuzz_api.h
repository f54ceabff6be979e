/* fuzz_api's parts (fuzz_api.c says what it checks): the call it builds, the fuzzer, and
 * what each file gives the others. */
#ifndef MOEFUSE_FUZZ_API_H
#define MOEFUSE_FUZZ_API_H

#include "moefuse.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define ARENA_BYTES (96 * 1024)
#define MAX_OPERANDS 9
#define HEALTH_EVERY 1000  /* calls between two known-good calls */
#define REPORTS_PER_KIND 3 /* violations of one kind described in full; the rest are counted */
#define DEFAULT_SECONDS 15.0

/* ----------------------------------------------------------------- random numbers */

typedef struct rng {
    uint64_t state;
} rng;

static inline uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* splitmix64 */
static inline uint64_t rng_next(rng *r) { return mix64(r->state += 0x9E3779B97F4A7C15ull); }

/* lo..hi inclusive; lo when the range is empty. Unsigned arithmetic: any bounds are fine. */
static inline int64_t rng_int(rng *r, int64_t lo, int64_t hi)
{
    if (hi <= lo)
        return lo;
    uint64_t width = (uint64_t)hi - (uint64_t)lo;
    uint64_t pick = width == UINT64_MAX ? rng_next(r) : rng_next(r) % (width + 1);
    return (int64_t)((uint64_t)lo + pick); /* two's complement, as every target has */
}

static inline bool rng_percent(rng *r, int percent) { return (int)(rng_next(r) % 100) < percent; }

static inline double rng_unit(rng *r) { return (double)(rng_next(r) >> 11) * 0x1p-53; }

#define COUNT_OF(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))
#define PICK(r, a) ((a)[rng_int((r), 0, COUNT_OF(a) - 1)])
#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})

/* Each call draws from its own stream, so one call can be replayed alone. */
static inline rng call_rng(uint64_t seed, uint64_t index)
{
    rng r = {mix64(seed) ^ mix64(index + 0x632BE59BD9B4E019ull)};
    return r;
}

/* ----------------------------------------------------------------- dtypes */

typedef unsigned dtype_set;
#define DT(d) (1u << (unsigned)(d))
#define FLOATS (DT(MOEFUSE_F32) | DT(MOEFUSE_F16) | DT(MOEFUSE_BF16))
#define CODES (DT(MOEFUSE_F8_E4M3) | DT(MOEFUSE_I8))

static inline bool dtype_valid(moefuse_dtype d) { return (unsigned)d < MOEFUSE_DTYPE_COUNT_; }

static inline bool dtype_in(moefuse_dtype d, dtype_set set) { return dtype_valid(d) && (set & DT(d)); }

/* An invalid dtype counts as the widest, so footprints stay conservative. */
static inline int64_t elem_bytes(moefuse_dtype d)
{
    size_t size = moefuse_dtype_size(d);
    return size ? (int64_t)size : 4;
}

static inline moefuse_dtype pick_float(rng *r)
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

extern const char *const op_names[OP_COUNT];

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

static inline void note(fuzz_call *c, const char *fmt, ...)
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

static inline bool is_moe(enum op op)
{
    return op == OP_MOE_GATE || op == OP_MOE_FINAL || op == OP_MOE_FORWARD;
}

static inline bool takes_act_options(enum op op)
{
    return op == OP_ACT_QUANT || op == OP_ACT_QUANT_MASKED || op == OP_ACT_MUL;
}

static inline bool takes_quant_options(enum op op)
{
    return op == OP_ACT_QUANT || op == OP_ACT_QUANT_MASKED || op == OP_QUANT || op == OP_DEQUANT;
}

/* The operand holding the codes whose dtype decides what ue8m0 may do. */
static inline const operand *code_operand(const fuzz_call *c)
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

static inline bool rank_ok(const moefuse_tensor *t) { return t->rank >= 1 && t->rank <= MOEFUSE_MAX_RANK; }

static inline bool has_negative_dim(const moefuse_tensor *t)
{
    for (int d = 0; d < t->rank && d < MOEFUSE_MAX_RANK; d++)
        if (t->shape[d] < 0)
            return true;
    return false;
}

/* Some dimension is 0 and none is negative: the tensor has no element. */
static inline bool is_empty(const moefuse_tensor *t)
{
    if (!rank_ok(t) || has_negative_dim(t))
        return false;
    for (int d = 0; d < t->rank; d++)
        if (t->shape[d] == 0)
            return true;
    return false;
}

/* Has elements we can place: sensible rank, every dim > 0. */
static inline bool has_elements(const moefuse_tensor *t)
{
    return rank_ok(t) && !has_negative_dim(t) && !is_empty(t);
}

/* Perturbations stack and widths can be huge: arithmetic on them saturates. */
static inline int64_t add_sat(int64_t a, int64_t b)
{
    int64_t sum;
    return __builtin_add_overflow(a, b, &sum) ? (b > 0 ? INT64_MAX : INT64_MIN) : sum;
}

static inline int64_t mul_sat(int64_t a, int64_t b)
{
    int64_t product;
    return __builtin_mul_overflow(a, b, &product) ? ((a < 0) != (b < 0) ? INT64_MIN : INT64_MAX)
                                                  : product;
}

static inline void set_dense_strides(moefuse_tensor *t)
{
    int64_t step = 1;
    for (int d = t->rank - 1; d >= 0; d--) {
        t->stride[d] = step;
        step = mul_sat(step, t->shape[d] > 0 ? t->shape[d] : 1);
    }
}

/* Bytes [lo, hi) relative to element 0 that the elements cover; false on overflow. */
static inline bool relative_reach(const moefuse_tensor *t, int64_t *lo, int64_t *hi)
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
static inline bool arena_reach(const operand *o, int64_t *lo, int64_t *hi)
{
    int64_t rel_lo, rel_hi;
    if (!has_elements(&o->t) || !relative_reach(&o->t, &rel_lo, &rel_hi))
        return false;
    return !__builtin_add_overflow(o->pos, rel_lo, lo) &&
           !__builtin_add_overflow(o->pos, rel_hi, hi);
}

/* Elements spanned by one step of dim d (1 + reach of the inner dims); -1 on overflow or
   negative dims. */
static inline int64_t inner_extent(const moefuse_tensor *t, int d)
{
    int64_t extent = 1, step;
    for (int i = t->rank - 1; i > d; i--)
        if (t->shape[i] < 0 || __builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &step) ||
            __builtin_add_overflow(extent, step, &extent))
            return -1;
    return extent;
}

static inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

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

extern const char *const violation_names[V_KIND_COUNT];

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

/* ----------------------------------------------------------------- operands a call uses */

static inline bool operand_used(const fuzz_call *c, const operand *o)
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
static inline bool operand_present(const operand *o)
{
    return o->passed && !(o->optional && o->data == DATA_NULL);
}

/* Element 0 off its element size (the arena itself is 64-byte aligned). */
static inline bool misaligned(const operand *o) { return o->pos % elem_bytes(o->t.dtype) != 0; }

/* ----------------------------------------------------------------- what the files give each other */

enum expectation { EXPECT_OK, EXPECT_EITHER, EXPECT_REFUSAL };

typedef struct verdict {
    enum expectation expect;
    enum violation_kind kind; /* what accepting it would be */
    char why[200];
} verdict;

typedef struct call_record {
    uint64_t index;
    moefuse_status status;
    char message[1024];
} call_record;

typedef void element_fn(void *opaque, int64_t byte, int64_t bytes);

/* fuzz_api_build.c: a near-valid call, placed in the arena, perturbed, bound */
void build_call(const fuzzer *f, rng *r, fuzz_call *c);

/* bytes an operand's elements cover when placed at 0 (0 when it has none) */
int64_t placed_bytes(const operand *o);

/* fuzz_api_perturb.c: one perturbation that keeps host tensors inside the arena */
void apply_perturbation(const fuzzer *f, rng *r, fuzz_call *c);

/* fuzz_api_judge.c: what the API must do with the call */
verdict expected_outcome(const fuzzer *f, const fuzz_call *c);

/* fuzz_api_invoke.c: arena contents, operands bound to it, the call made */
void for_each_element(const fuzzer *f, const operand *o, element_fn *fn, void *opaque);
void mark_writable(void *opaque, int64_t byte, int64_t bytes);
void compose_image(fuzzer *f, rng *r, const fuzz_call *c);
void bind_operand(const fuzzer *f, operand *o);
moefuse_status invoke(const fuzzer *f, const fuzz_call *c);

/* fuzz_api_report.c: describing calls and violations */
void describe_call(const fuzz_call *c);
void violation(fuzzer *f, enum violation_kind kind, const fuzz_call *c, const call_record *rec,
               const char *fmt, ...);
void check_call(fuzzer *f, const fuzz_call *c, const call_record *rec, const verdict *v);

#endif
