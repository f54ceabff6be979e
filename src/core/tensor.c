/* Tensor descriptors and dtype facts. */
#include "core/core.h"

#include <stdio.h>
#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtype_info[MOEFUSE_DTYPE_COUNT_] = {
    [MOEFUSE_F32] = {"f32", 4},     [MOEFUSE_F16] = {"f16", 2}, [MOEFUSE_BF16] = {"bf16", 2},
    [MOEFUSE_F8_E4M3] = {"f8_e4m3", 1}, [MOEFUSE_I8] = {"i8", 1}, [MOEFUSE_I32] = {"i32", 4},
    [MOEFUSE_U8] = {"u8", 1},
};

size_t moefuse_dtype_size(moefuse_dtype dtype)
{
    return (unsigned)dtype < MOEFUSE_DTYPE_COUNT_ ? dtype_info[dtype].size : 0;
}

const char *moefuse_dtype_name(moefuse_dtype dtype)
{
    return (unsigned)dtype < MOEFUSE_DTYPE_COUNT_ ? dtype_info[dtype].name : "unknown dtype";
}

moefuse_tensor moefuse_tensor_strided(void *data, moefuse_dtype dtype, int32_t rank,
                                      const int64_t *shape, const int64_t *stride)
{
    moefuse_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    t.rank = rank;
    for (int32_t d = 0; d < rank && d < MOEFUSE_MAX_RANK; d++) {
        t.shape[d] = shape[d];
        t.stride[d] = stride[d];
    }
    return t;
}

moefuse_tensor moefuse_tensor_dense(void *data, moefuse_dtype dtype, int32_t rank,
                                    const int64_t *shape)
{
    int64_t stride[MOEFUSE_MAX_RANK] = {0};
    uint64_t step = 1; /* unsigned: a shape too large wraps here and validation refuses it */
    for (int32_t d = (rank < MOEFUSE_MAX_RANK ? rank : MOEFUSE_MAX_RANK) - 1; d >= 0; d--) {
        stride[d] = (int64_t)step;
        step *= shape[d] > 0 ? (uint64_t)shape[d] : 1u;
    }
    return moefuse_tensor_strided(data, dtype, rank, shape, stride);
}

int64_t moefuse_tensor_numel(const moefuse_tensor *t)
{
    int64_t n = 1;
    for (int32_t d = 0; d < t->rank && d < MOEFUSE_MAX_RANK; d++)
        if (__builtin_mul_overflow(n, t->shape[d], &n))
            return -1;
    return n;
}

int64_t moefuse_tensor_span_bytes(const moefuse_tensor *t)
{
    int64_t last = 0, reach;
    for (int32_t d = 0; d < t->rank && d < MOEFUSE_MAX_RANK; d++)
        if (t->shape[d] <= 0)
            return 0; /* empty, whatever the other dims and strides say */
    for (int32_t d = 0; d < t->rank && d < MOEFUSE_MAX_RANK; d++) {
        if (__builtin_mul_overflow(t->shape[d] - 1, t->stride[d], &reach) ||
            __builtin_add_overflow(last, reach, &last))
            return -1;
    }
    if (__builtin_add_overflow(last, 1, &last) ||
        __builtin_mul_overflow(last, (int64_t)moefuse_dtype_size(t->dtype), &last))
        return -1;
    return last;
}

bool mf_present(const moefuse_tensor *t)
{
    return t && t->data;
}

moefuse_tensor mf_absent(void)
{
    moefuse_tensor t;
    memset(&t, 0, sizeof t);
    return t;
}

moefuse_tensor mf_with_leading_unit(const moefuse_tensor *t)
{
    moefuse_tensor u = *t;
    u.rank = t->rank + 1;
    u.shape[0] = 1;
    /* the unit dimension is never stepped: any value will do when the product overflows
     * (an empty tensor may have any strides) */
    if (t->rank == 0 || __builtin_mul_overflow(t->shape[0], t->stride[0], &u.stride[0]))
        u.stride[0] = t->rank > 0 ? 0 : 1;
    for (int32_t d = 0; d < t->rank; d++) {
        u.shape[d + 1] = t->shape[d];
        u.stride[d + 1] = t->stride[d];
    }
    return u;
}

const char *mf_shape_str(char *buf, size_t size, int32_t rank, const int64_t *shape)
{
    size_t used = 0;
    buf[0] = '\0';
    used += (size_t)snprintf(buf, size, "[");
    for (int32_t d = 0; d < rank && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (used < size)
        snprintf(buf + used, size - used, "]");
    return buf;
}

moefuse_tensor mf_tensor_lift3(const moefuse_tensor *t)
{
    moefuse_tensor r = *t;
    if (t->rank == 2) {
        r.rank = 3;
        r.shape[0] = 1, r.shape[1] = t->shape[0], r.shape[2] = t->shape[1];
        r.stride[0] = 0, r.stride[1] = t->stride[0], r.stride[2] = t->stride[1];
    }
    return r;
}
