/*
 * moefuse._fastcall: reading a call's arguments, as _tensors.py and _options.py do: torch
 * tensors into moefuse_tensor (through their Python attributes), and the keyword options into
 * the C option structs. Each reader returns 1, or 0 when the fast path does not take the call.
 */
#include "_fastcall.h"

#include <string.h>

/* ------------------------------------------------------------ operands */

/* The fast path does not take this call: any Python error met on the way is dropped, since the
 * ctypes path reads the same objects again and raises what it finds. */
int fall_back(void)
{
    PyErr_Clear();
    return 0;
}

static int is_torch_tensor(PyObject *obj)
{
    for (int i = 0; i < S.tensor_type_count; i++)
        if (Py_TYPE(obj) == S.tensor_types[i])
            return 1;
    return 0;
}

/* A tuple of up to MAX_RANK ints into dims; the rank is the tuple's length (the C API refuses
 * a rank above 4, as it does through ctypes, which passes the first 4 dimensions). */
static int read_dims(PyObject *tuple, int64_t *dims, int32_t *rank)
{
    if (tuple == NULL || !PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) > INT32_MAX)
        return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    for (Py_ssize_t i = 0; i < n && i < MOEFUSE_MAX_RANK; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
        if (v == -1 && PyErr_Occurred())
            return 0;
        dims[i] = v;
    }
    *rank = (int32_t)n;
    return 1;
}

/* Where a tensor lives: PLACE_CPU, a CUDA index, or PLACE_NONE for another device. */
static int read_place(PyObject *obj)
{
    PyObject *flag = PyObject_GetAttr(obj, s_is_cuda);
    if (flag == NULL)
        return PLACE_NONE;
    int cuda = flag == Py_True;
    Py_DECREF(flag);
    if (!cuda) {
        flag = PyObject_GetAttr(obj, s_is_cpu);
        if (flag == NULL)
            return PLACE_NONE;
        int cpu = flag == Py_True;
        Py_DECREF(flag);
        return cpu ? PLACE_CPU : PLACE_NONE;
    }
    PyObject *index = PyObject_CallMethodNoArgs(obj, s_get_device);
    if (index == NULL)
        return PLACE_NONE;
    long i = PyLong_AsLong(index);
    Py_DECREF(index);
    return i >= 0 && i < INT32_MAX ? (int)i : PLACE_NONE;
}

/* Fills t for a torch tensor, or as absent for None; 0 when the fast path cannot read obj or
 * it lives elsewhere than the operands before it (*place). */
int read_tensor(PyObject *obj, moefuse_tensor *t, int *place)
{
    memset(t, 0, sizeof *t);
    if (obj == Py_None)
        return 1;
    if (!is_torch_tensor(obj))
        return 0;

    PyObject *dtype = PyObject_GetAttr(obj, s_dtype);
    if (dtype == NULL)
        return fall_back();
    int code = -1;
    for (int i = 0; i < MOEFUSE_DTYPE_COUNT_; i++)
        if (dtype == S.dtypes[i])
            code = i;
    Py_DECREF(dtype);
    if (code < 0) /* a dtype moefuse has not: the ctypes path says so */
        return 0;
    t->dtype = (moefuse_dtype)code;

    int where = read_place(obj);
    if (where == PLACE_NONE || (*place != PLACE_NONE && *place != where))
        return fall_back();
    *place = where;

    PyObject *ptr = PyObject_CallMethodNoArgs(obj, s_data_ptr);
    if (ptr == NULL)
        return fall_back();
    t->data = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    if (t->data == NULL && PyErr_Occurred())
        return fall_back();

    int32_t rank = 0, stride_rank = 0;
    PyObject *shape = PyObject_GetAttr(obj, s_shape);
    int ok = read_dims(shape, t->shape, &rank);
    Py_XDECREF(shape);
    if (!ok)
        return fall_back();
    PyObject *stride = PyObject_CallMethodNoArgs(obj, s_stride);
    ok = read_dims(stride, t->stride, &stride_rank);
    Py_XDECREF(stride);
    if (!ok || stride_rank != rank)
        return fall_back();
    t->rank = rank;
    return 1;
}

/* read_tensor for objs[0 .. count), into tensors[0 .. count), in that order. */
int read_tensors(PyObject *const *objs, moefuse_tensor *const *tensors, size_t count, int *place)
{
    for (size_t i = 0; i < count; i++)
        if (!read_tensor(objs[i], tensors[i], place))
            return 0;
    return 1;
}

/* An optional operand: NULL when absent, or empty with no data (as _ref in ops.py). */
const moefuse_tensor *optional(const moefuse_tensor *t)
{
    return t->data ? t : NULL;
}

/* ------------------------------------------------------------ options (as _options.py) */

/* An enum option: one of the names (a tuple from _capi) or a raw int, not a bool. */
static int read_enum(PyObject *v, PyObject *names, int *out)
{
    if (PyLong_Check(v) && !PyBool_Check(v)) {
        long raw = PyLong_AsLong(v);
        if ((raw == -1 && PyErr_Occurred()) || raw < INT_MIN || raw > INT_MAX)
            return fall_back();
        *out = (int)raw;
        return 1;
    }
    if (!PyUnicode_Check(v))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (name == v || (PyUnicode_Check(name) && PyUnicode_Compare(name, v) == 0)) {
            *out = (int)i;
            return 1;
        }
    }
    return fall_back(); /* unknown: the ctypes path raises its InvalidArgumentError */
}

/* float(v or 0.0), for an int or a float. */
static int read_float(PyObject *v, float *out)
{
    double d;
    if (v == Py_None)
        d = 0.0;
    else if (PyFloat_Check(v))
        d = PyFloat_AS_DOUBLE(v);
    else if (PyLong_Check(v)) {
        d = PyLong_AsDouble(v);
        if (d == -1.0 && PyErr_Occurred())
            return fall_back();
    } else
        return 0;
    *out = d == 0.0 ? 0.0f : (float)d; /* -0.0 is falsy in Python: `or` gives +0.0 */
    return 1;
}

/* int(v or 0), for an int. */
static int read_int64(PyObject *v, int64_t *out)
{
    if (v == Py_None) {
        *out = 0;
        return 1;
    }
    if (!PyLong_Check(v))
        return 0;
    long long n = PyLong_AsLongLong(v);
    if (n == -1 && PyErr_Occurred())
        return fall_back();
    *out = n;
    return 1;
}

/* int(bool(v)). */
int read_bool(PyObject *v, int32_t *out)
{
    int truth = PyObject_IsTrue(v);
    if (truth < 0)
        return fall_back();
    *out = truth;
    return 1;
}

/* act(activation, order, limit, intermediate, alpha, up_offset); intermediate None is
 * "none". */
int read_act(PyObject *const *v, moefuse_act_options *opt)
{
    int activation, order, rounding = 0;
    if (!read_enum(v[0], S.activations, &activation) || !read_enum(v[1], S.orders, &order) ||
        !read_float(v[2], &opt->limit) ||
        (v[3] != Py_None && !read_enum(v[3], S.roundings, &rounding)) ||
        !read_float(v[4], &opt->alpha) || !read_float(v[5], &opt->up_offset))
        return 0;
    opt->activation = (moefuse_activation)activation;
    opt->order = (moefuse_gate_order)order;
    opt->intermediate = (moefuse_rounding)rounding;
    return 1;
}

/* quant(group_size, scale_layout, ue8m0, eps). */
int read_quant(PyObject *const *v, moefuse_quant_options *opt)
{
    int layout;
    if (!read_int64(v[0], &opt->group_size) || !read_enum(v[1], S.layouts, &layout) ||
        !read_bool(v[2], &opt->ue8m0) || !read_float(v[3], &opt->eps))
        return 0;
    opt->scale_layout = (moefuse_scale_layout)layout;
    return 1;
}

/* moe(activation, order, limit, alpha, up_offset). */
int read_moe(PyObject *const *v, moefuse_moe_options *opt)
{
    int activation, order;
    if (!read_enum(v[0], S.activations, &activation) || !read_enum(v[1], S.orders, &order) ||
        !read_float(v[2], &opt->limit) || !read_float(v[3], &opt->alpha) ||
        !read_float(v[4], &opt->up_offset))
        return 0;
    opt->activation = (moefuse_activation)activation;
    opt->order = (moefuse_gate_order)order;
    return 1;
}
