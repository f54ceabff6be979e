/* Operand checks shared by every entry point: the one place shapes, dtypes and layouts are judged. */
#include "core/core.h"

#include <stdio.h>
#include <string.h>

static const char *dtype_set_str(char *buf, size_t size, mf_dtype_set allowed)
{
    size_t used = 0;
    buf[0] = '\0';
    for (int d = 0; d < MOEFUSE_DTYPE_COUNT_ && used < size; d++)
        if (allowed & MF_DT(d))
            used += (size_t)snprintf(buf + used, size - used, used ? ", %s" : "%s",
                                     moefuse_dtype_name((moefuse_dtype)d));
    return buf;
}

/* Elements spanned by one step of dimension d's inner dims; -1 on overflow. */
static int64_t inner_extent(const moefuse_tensor *t, int32_t d)
{
    int64_t extent = 1;
    for (int32_t i = t->rank - 1; i > d; i--) {
        int64_t reach;
        if (__builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &reach) ||
            __builtin_add_overflow(extent, reach, &extent))
            return -1;
    }
    return extent;
}

static moefuse_status check_layout(moefuse_context *ctx, const char *op, const char *name,
                                   const moefuse_tensor *t)
{
    char sbuf[96];
    bool empty = false;
    for (int32_t d = 0; d < t->rank; d++) {
        if (t->shape[d] < 0)
            return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s has a negative dimension in shape %s",
                            op, name, mf_shape_str(sbuf, sizeof sbuf, t->rank, t->shape));
        empty |= t->shape[d] == 0;
    }
    /* An empty tensor touches no memory, so its strides do not matter: numpy gives a
     * [0, N] array zero strides, and frameworks give others anything. */
    if (empty)
        return MOEFUSE_OK;
    for (int32_t d = 0; d < t->rank; d++)
        if (t->stride[d] < 0)
            return mf_error(ctx, MOEFUSE_ERR_STRIDE, "%s: %s has negative stride %lld in dim %d",
                            op, name, (long long)t->stride[d], (int)d);
    if (t->rank > 0 && t->stride[t->rank - 1] != 1)
        return mf_error(ctx, MOEFUSE_ERR_STRIDE,
                        "%s: %s innermost stride is %lld; it must be 1 (contiguous rows)", op, name,
                        (long long)t->stride[t->rank - 1]);
    for (int32_t d = t->rank - 2; d >= 0; d--) {
        int64_t extent = inner_extent(t, d);
        if (extent < 0)
            return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s is too large for 64-bit offsets", op,
                            name);
        if (t->shape[d] > 1 && t->stride[d] < extent)
            return mf_error(ctx, MOEFUSE_ERR_STRIDE,
                            "%s: %s stride %lld in dim %d is smaller than the %lld elements of "
                            "the inner dims (rows would overlap)",
                            op, name, (long long)t->stride[d], (int)d, (long long)extent);
    }
    int64_t extent = inner_extent(t, -1), bytes;
    if (extent < 0 || __builtin_mul_overflow(extent, (int64_t)moefuse_dtype_size(t->dtype), &bytes) ||
        __builtin_add_overflow(bytes, t->offset, &bytes))
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s is too large for 64-bit offsets", op, name);
    return MOEFUSE_OK;
}

/* First byte of t and one past its last, in one address space per buffer (see overlap). */
typedef struct byte_range {
    const void *space; /* the cl_mem for handle backends, NULL for plain addresses */
    uintptr_t begin, end;
} byte_range;

static byte_range range_of(const moefuse_context *ctx, const moefuse_tensor *t)
{
    byte_range r = {NULL, (uintptr_t)t->offset, 0};
    if (ctx->backend->data_is_handle)
        r.space = t->data;
    else
        r.begin += (uintptr_t)t->data;
    r.end = r.begin + (uintptr_t)moefuse_tensor_span_bytes(t);
    return r;
}

/*
 * The tensor must end inside the memory it lies in, where the backend can tell
 * (a cl_mem's size, a device allocation's end); host pointers cannot be asked.
 * Runs after check_layout, so offset + span does not overflow.
 */
static moefuse_status check_inside_buffer(moefuse_context *ctx, const char *op, const char *name,
                                          const moefuse_tensor *t)
{
    uint64_t have;
    int64_t span = moefuse_tensor_span_bytes(t);
    if (!t->data || span == 0 || !ctx->backend->buffer_extent ||
        !ctx->backend->buffer_extent(ctx->state, t->data, &have))
        return MOEFUSE_OK;
    uint64_t end = (uint64_t)t->offset + (uint64_t)span;
    if (end <= have)
        return MOEFUSE_OK;
    return mf_error(ctx, MOEFUSE_ERR_OUT_OF_BOUNDS,
                    "%s: %s covers bytes [%lld, %llu) of its buffer (offset %lld, %lld bytes of "
                    "elements) but the buffer holds %llu bytes",
                    op, name, (long long)t->offset, (unsigned long long)end, (long long)t->offset,
                    (long long)span, (unsigned long long)have);
}

moefuse_status mf_check_outputs(moefuse_context *ctx, const char *op, const mf_operand *ops,
                                size_t count, bool *idle)
{
    enum { MAX_OPERANDS = 16 }; /* the most any call has is 9 */
    if (count > MAX_OPERANDS)
        return mf_error(ctx, MOEFUSE_ERR_INTERNAL, "%s: %zu operands to compare", op, count);
    /* the byte range of each operand that touches memory, computed once */
    byte_range range[MAX_OPERANDS];
    bool touches[MAX_OPERANDS];
    *idle = true;
    for (size_t i = 0; i < count; i++) {
        touches[i] = mf_present(ops[i].t) && moefuse_tensor_span_bytes(ops[i].t) != 0;
        if (touches[i])
            range[i] = range_of(ctx, ops[i].t);
        if (touches[i] && ops[i].output)
            *idle = false;
    }
    for (size_t i = 0; i < count; i++) {
        if (!ops[i].output || !touches[i])
            continue;
        for (size_t j = 0; j < count; j++) {
            /* a pair of outputs is looked at once, from its first member */
            if (j == i || !touches[j] || (ops[j].output && j < i))
                continue;
            if (range[j].space == range[i].space && range[j].begin < range[i].end &&
                range[i].begin < range[j].end)
                return mf_error(ctx, MOEFUSE_ERR_OVERLAP,
                                "%s: output %s shares memory with %s %s (their byte ranges from "
                                "first to last element intersect); outputs may not overlap any "
                                "other operand",
                                op, ops[i].name, ops[j].output ? "output" : "input", ops[j].name);
        }
    }
    return MOEFUSE_OK;
}

/* Some dimension is 0 (rank already checked against MOEFUSE_MAX_RANK's arrays). */
static bool has_zero_extent(const moefuse_tensor *t)
{
    for (int32_t d = 0; d < t->rank; d++)
        if (t->shape[d] == 0)
            return true;
    return false;
}

moefuse_status mf_check_tensor(moefuse_context *ctx, const char *op, const char *name,
                               const moefuse_tensor *t, int32_t rank, mf_dtype_set allowed)
{
    char buf[128];
    if (!t)
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op, name);
    if (t->rank != rank)
        return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s has rank %d; expected rank %d", op, name,
                        (int)t->rank, (int)rank);
    /* an empty tensor touches no memory: frameworks give those NULL (torch.empty(0, K)) */
    if (!t->data && !has_zero_extent(t))
        return mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s has NULL data", op, name);
    if ((unsigned)t->dtype >= MOEFUSE_DTYPE_COUNT_ || !(allowed & MF_DT(t->dtype))) {
        return mf_error(ctx, MOEFUSE_ERR_DTYPE, "%s: %s has dtype %s; expected one of: %s", op, name,
                        moefuse_dtype_name(t->dtype), dtype_set_str(buf, sizeof buf, allowed));
    }
    moefuse_status status = check_layout(ctx, op, name, t);
    if (status != MOEFUSE_OK)
        return status;
    if (t->offset < 0)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT, "%s: %s has negative byte offset %lld",
                        op, name, (long long)t->offset);
    size_t esize = moefuse_dtype_size(t->dtype);
    uintptr_t where = (uintptr_t)t->offset;
    if (!ctx->backend->data_is_handle)
        where += (uintptr_t)t->data;
    if (where % esize != 0)
        return mf_error(ctx, MOEFUSE_ERR_ALIGNMENT,
                        "%s: %s data + offset is not aligned to its %zu-byte %s elements", op, name,
                        esize, moefuse_dtype_name(t->dtype));
    if (t->data && ctx->backend->owns_pointer && !ctx->backend->owns_pointer(ctx->state, t->data))
        return mf_error(ctx, MOEFUSE_ERR_WRONG_DEVICE,
                        "%s: %s is not memory of this context's %s device", op, name,
                        ctx->backend->name);
    return check_inside_buffer(ctx, op, name, t);
}

moefuse_status mf_check_optional(moefuse_context *ctx, const char *op, const char *name,
                                 const moefuse_tensor *t, int32_t rank, mf_dtype_set allowed)
{
    return mf_present(t) ? mf_check_tensor(ctx, op, name, t, rank, allowed) : MOEFUSE_OK;
}

moefuse_status mf_expect_shape(moefuse_context *ctx, const char *op, const char *name,
                               const moefuse_tensor *t, const int64_t *want, const char *what)
{
    if (memcmp(t->shape, want, (size_t)t->rank * sizeof *want) == 0)
        return MOEFUSE_OK;
    char have_s[96], want_s[96];
    return mf_error(ctx, MOEFUSE_ERR_SHAPE, "%s: %s has shape %s but %s requires %s", op, name,
                    mf_shape_str(have_s, sizeof have_s, t->rank, t->shape), what,
                    mf_shape_str(want_s, sizeof want_s, t->rank, want));
}
