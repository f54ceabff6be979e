/*
 * moefuse._fastcall: the binding's per-call work done in C, for torch tensors.
 *
 * ops.py offers a call here first when its first input is a torch tensor. Each function reads
 * its torch.Tensor / nn.Parameter operands through their Python attributes (data_ptr(), shape,
 * stride(), dtype, is_cuda, get_device()), turns the keyword options into the C option structs,
 * and then does what _call.py does: takes the Context's lock, makes the tensors' CUDA device
 * current, attaches torch's current stream when it is not the one attached last, and calls
 * libmoefuse with the GIL released (as ctypes does).
 *
 * It returns True when the call ran, False when it does not take the call: an operand of
 * another kind or device, an option it does not read, a Context of another backend or closed.
 * ops.py then goes through ctypes, which gives the same results and raises the usual errors.
 * A call the library refuses raises errors.make(status, moefuse_last_error(ctx)), as ctypes.
 *
 * The module does not link libmoefuse: ctypes loaded it, and bind() receives the addresses of
 * its functions, so the process holds one copy of the library. The header gives the layouts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "moefuse.h"

/* ------------------------------------------------------------ library functions */

/* Each pointer type is checked against the header's prototype at compile time; _Generic does
 * not evaluate its operand, so no symbol of libmoefuse is referenced. */
#define LIBRARY_FUNCTIONS(X)                                                                       \
    X(act_quant, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,                  \
      const moefuse_tensor *, const moefuse_tensor *, const moefuse_act_quant_options *)          \
    X(act_quant_masked, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,           \
      const moefuse_tensor *, const moefuse_tensor *, const moefuse_tensor *,                     \
      const moefuse_tensor *, const moefuse_act_quant_options *)                                  \
    X(act_mul, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,                    \
      const moefuse_tensor *, const moefuse_act_options *)                                        \
    X(quant, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,                      \
      const moefuse_tensor *, const moefuse_quant_options *)                                      \
    X(dequant, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,                    \
      const moefuse_tensor *, const moefuse_quant_options *)                                      \
    X(moe_gate, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,                   \
      const moefuse_tensor *, const moefuse_routing *, const moefuse_tensor *,                    \
      const moefuse_moe_options *)                                                                \
    X(moe_final, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,                  \
      const moefuse_tensor *, const moefuse_routing *, const moefuse_tensor *,                    \
      const moefuse_moe_options *)                                                                \
    X(moe_forward, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,                \
      const moefuse_tensor *, const moefuse_tensor *, const moefuse_tensor *,                     \
      const moefuse_routing *, const moefuse_tensor *, const moefuse_moe_options *)               \
    X(topk_softmax, moefuse_status, const moefuse_tensor *, int32_t, const moefuse_tensor *,      \
      const moefuse_tensor *)                                                                     \
    X(set_stream, moefuse_status, void *)                                                        \
    X(set_workspace, moefuse_status, const moefuse_tensor *)                                     \
    X(act_quant_masked_workspace_size, moefuse_status, const moefuse_tensor *,                    \
      const moefuse_tensor *, const moefuse_tensor *, const moefuse_tensor *,                     \
      const moefuse_tensor *, const moefuse_tensor *, const moefuse_act_quant_options *,          \
      size_t *)                                                                                   \
    X(moe_gate_workspace_size, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,    \
      const moefuse_tensor *, const moefuse_routing *, const moefuse_tensor *,                    \
      const moefuse_moe_options *, size_t *)                                                      \
    X(moe_final_workspace_size, moefuse_status, const moefuse_tensor *, const moefuse_tensor *,   \
      const moefuse_tensor *, const moefuse_routing *, const moefuse_tensor *,                    \
      const moefuse_moe_options *, size_t *)                                                      \
    X(moe_forward_workspace_size, moefuse_status, const moefuse_tensor *,                         \
      const moefuse_tensor *, const moefuse_tensor *, const moefuse_tensor *,                     \
      const moefuse_tensor *, const moefuse_routing *, const moefuse_tensor *,                    \
      const moefuse_moe_options *, size_t *)

#define DECLARE(name, ret, ...)                                                                    \
    typedef ret (*name##_fn)(moefuse_context *, __VA_ARGS__);                                     \
    _Static_assert(_Generic(&moefuse_##name, name##_fn: 1, default: 0),                           \
                   "moefuse_" #name " does not match its prototype in moefuse.h");
LIBRARY_FUNCTIONS(DECLARE)
#undef DECLARE

typedef const char *(*last_error_fn)(const moefuse_context *);
_Static_assert(_Generic(&moefuse_last_error, last_error_fn: 1, default: 0), "last_error");
typedef unsigned (*version_fn)(void);
_Static_assert(_Generic(&moefuse_version, version_fn: 1, default: 0), "version");

#define MAX_TENSOR_TYPES 4

static struct {
#define FIELD(name, ...) name##_fn name;
    LIBRARY_FUNCTIONS(FIELD)
#undef FIELD
    last_error_fn last_error;

    /* From the binding (bind): what a Context is, how to get a default one, how to make the
     * exception for a status, and the option names in enum order. */
    PyObject *context_type, *resolve, *make_error;
    PyObject *activations, *orders, *roundings, *layouts;

    /* From torch (bind_torch): the tensor types read here, the dtypes in moefuse_dtype order,
     * and the CUDA device and stream functions (NULL in a torch without CUDA). */
    PyTypeObject *tensor_types[MAX_TENSOR_TYPES];
    int tensor_type_count;
    PyObject *dtypes[MOEFUSE_DTYPE_COUNT_];
    PyObject *get_device, *set_device, *raw_stream;
    /* From the binding (bind_workspace): alloc(nbytes, device) -> a torch uint8 CUDA tensor
     * from torch's caching allocator on the current stream, or NULL: the context's scratch. */
    PyObject *alloc_workspace;

    unsigned long long calls; /* calls made through here, for tests and the benchmark */
} S;

/* Attribute and method names, interned once. */
static PyObject *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_is_cuda, *s_is_cpu,
    *s_get_device, *s_backend, *s_handle, *s_value, *s_lock, *s_stream, *s_acquire, *s_release;

/* torch's default stream is handle 0, which moefuse_set_stream reads as the context's own
 * stream; CUDA names the legacy default stream cudaStreamLegacy, ((cudaStream_t)0x1). */
#define CUDA_STREAM_LEGACY ((void *)1)

/* ------------------------------------------------------------ operands */

#define PLACE_NONE (-2) /* no tensor seen yet */
#define PLACE_CPU (-1)  /* else a CUDA device index */

/* The fast path does not take this call: any Python error met on the way is dropped, since the
 * ctypes path reads the same objects again and raises what it finds. */
static int fall_back(void)
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
static int read_tensor(PyObject *obj, moefuse_tensor *t, int *place)
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

/* An optional operand: NULL when absent, or empty with no data (as _ref in ops.py). */
static const moefuse_tensor *optional(const moefuse_tensor *t)
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
static int read_bool(PyObject *v, int32_t *out)
{
    int truth = PyObject_IsTrue(v);
    if (truth < 0)
        return fall_back();
    *out = truth;
    return 1;
}

/* act(activation, order, limit, intermediate, alpha, up_offset); intermediate None is
 * "none". */
static int read_act(PyObject *const *v, moefuse_act_options *opt)
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
static int read_quant(PyObject *const *v, moefuse_quant_options *opt)
{
    int layout;
    if (!read_int64(v[0], &opt->group_size) || !read_enum(v[1], S.layouts, &layout) ||
        !read_bool(v[2], &opt->ue8m0) || !read_float(v[3], &opt->eps))
        return 0;
    opt->scale_layout = (moefuse_scale_layout)layout;
    return 1;
}

/* moe(activation, order, limit, alpha, up_offset). */
static int read_moe(PyObject *const *v, moefuse_moe_options *opt)
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

/* ------------------------------------------------------------ one call on a context */

typedef struct session {
    PyObject *ctx;  /* the Context */
    PyObject *lock; /* its _lock, held from enter to leave */
    moefuse_context *handle;
    int device; /* the CUDA device to make current again after the call, or -1 */
} session;

enum { FAILED = -1, FALL_BACK = 0, READY = 1 };

static PyObject *call0(PyObject *obj, PyObject *method)
{
    return PyObject_CallMethodNoArgs(obj, method);
}

/* torch's current CUDA device (torch._C._cuda_getDevice), or -1 with an exception. */
static int current_device(void)
{
    PyObject *r = PyObject_CallNoArgs(S.get_device);
    if (r == NULL)
        return -1;
    long d = PyLong_AsLong(r);
    Py_DECREF(r);
    if ((d < 0 || d > INT32_MAX) && !PyErr_Occurred())
        PyErr_Format(PyExc_RuntimeError, "moefuse: torch gave CUDA device %ld", d);
    return d < 0 || d > INT32_MAX ? -1 : (int)d;
}

static int make_current(int device)
{
    PyObject *index = PyLong_FromLong(device);
    PyObject *r = index ? PyObject_CallOneArg(S.set_device, index) : NULL;
    Py_XDECREF(index);
    Py_XDECREF(r);
    return r != NULL;
}

/* The context's message for its last failed call, as str (Context.check); read it while the
 * lock is held: the next call on the context replaces it. */
static PyObject *message_of(moefuse_context *handle)
{
    const char *text = S.last_error(handle);
    return PyUnicode_DecodeUTF8(text ? text : "", text ? (Py_ssize_t)strlen(text) : 0,
                                "replace");
}

/* Raises errors.make(status, message), the exception the ctypes path raises. */
static void raise_status(moefuse_status status, PyObject *message)
{
    if (message == NULL)
        return;
    PyObject *exc = PyObject_CallFunction(S.make_error, "iO", (int)status, message);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
}

/* The pending exception, cleared (NULL when none): Python may not be called while one is set,
 * and the cleanup after a failure calls torch and the lock. */
static PyObject *set_aside(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (type == NULL)
        return NULL;
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(value, traceback);
    Py_DECREF(type);
    Py_XDECREF(traceback);
    return value;
#endif
}

/* Raises exc again (a reference set_aside gave). */
static void put_back(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyObject *type = (PyObject *)Py_TYPE(exc);
    Py_INCREF(type);
    PyErr_Restore(type, exc, PyException_GetTraceback(exc));
#endif
}

/* Makes the previous device current again and releases the lock. An exception already set
 * stays the one raised; 0 when restoring the device failed (its exception is then set). */
static int finish(session *s)
{
    PyObject *earlier = set_aside(), *failure = NULL;
    if (s->device >= 0 && !make_current(s->device))
        failure = set_aside();
    PyObject *r = call0(s->lock, s_release);
    if (r == NULL) /* a lock this thread acquired: release cannot fail */
        PyErr_WriteUnraisable(s->lock);
    Py_XDECREF(r);
    Py_DECREF(s->lock);
    Py_DECREF(s->ctx);
    if (earlier != NULL) {
        if (failure != NULL) { /* report the second failure without hiding the first */
            put_back(failure);
            PyErr_WriteUnraisable(NULL);
        }
        put_back(earlier);
        return 1;
    }
    if (failure != NULL) {
        put_back(failure);
        return 0;
    }
    return 1;
}

/* The stream torch runs on for `device`, attached to the context unless it already is
 * (Context._stream remembers what Context.set_stream was given last, for both paths). */
static int attach_stream(session *s, int device)
{
    PyObject *index = PyLong_FromLong(device);
    PyObject *raw = index ? PyObject_CallOneArg(S.raw_stream, index) : NULL;
    Py_XDECREF(index);
    if (raw == NULL)
        return 0;
    void *stream = PyLong_AsVoidPtr(raw);
    Py_DECREF(raw);
    if (stream == NULL && PyErr_Occurred())
        return 0;
    if (stream == NULL)
        stream = CUDA_STREAM_LEGACY;

    PyObject *last = PyObject_GetAttr(s->ctx, s_stream);
    if (last == NULL)
        return 0;
    int same = PyLong_Check(last) && PyLong_AsVoidPtr(last) == stream;
    Py_DECREF(last);
    PyErr_Clear(); /* a _stream that is no pointer is simply not the same */
    if (same)
        return 1;

    moefuse_status status;
    Py_BEGIN_ALLOW_THREADS
    status = S.set_stream(s->handle, stream);
    Py_END_ALLOW_THREADS
    if (status != MOEFUSE_OK) {
        PyObject *message = message_of(s->handle);
        raise_status(status, message);
        Py_XDECREF(message);
        return 0;
    }
    PyObject *value = PyLong_FromVoidPtr(stream);
    int ok = value && PyObject_SetAttr(s->ctx, s_stream, value) == 0;
    Py_XDECREF(value);
    return ok;
}

/* The Context for ctx_arg (a Context, or None / a backend name through default_context),
 * locked, with the operands' device current and torch's stream attached. */
static int enter(session *s, PyObject *ctx_arg, int place)
{
    if (place == PLACE_NONE || (place >= 0 && S.raw_stream == NULL))
        return FALL_BACK;
    PyObject *ctx;
    if (PyObject_TypeCheck(ctx_arg, (PyTypeObject *)S.context_type)) {
        ctx = ctx_arg;
        Py_INCREF(ctx);
    } else if (ctx_arg == Py_None || PyUnicode_Check(ctx_arg)) {
        PyObject *device = place >= 0 ? PyLong_FromLong(place) : Py_None;
        ctx = device ? PyObject_CallFunctionObjArgs(S.resolve, ctx_arg, device, NULL) : NULL;
        if (place >= 0)
            Py_XDECREF(device);
        if (ctx == NULL) /* default_context's error, as the ctypes path would raise it */
            return FAILED;
    } else
        return FALL_BACK;

    /* A context of the operands' backend, not closed; anything else is the ctypes path's. */
    PyObject *backend = PyObject_GetAttr(ctx, s_backend);
    PyObject *handle = PyObject_GetAttr(ctx, s_handle);
    PyObject *address = handle && handle != Py_None ? PyObject_GetAttr(handle, s_value) : NULL;
    int usable = backend && PyUnicode_Check(backend) && address && PyLong_Check(address) &&
                 PyUnicode_CompareWithASCIIString(backend, place >= 0 ? "cuda" : "cpu") == 0;
    s->handle = usable ? PyLong_AsVoidPtr(address) : NULL;
    Py_XDECREF(backend);
    Py_XDECREF(handle);
    Py_XDECREF(address);
    if (s->handle == NULL) {
        Py_DECREF(ctx);
        return fall_back();
    }

    s->ctx = ctx;
    s->device = -1;
    s->lock = PyObject_GetAttr(ctx, s_lock);
    PyObject *acquired = s->lock ? call0(s->lock, s_acquire) : NULL;
    if (acquired == NULL) {
        Py_XDECREF(s->lock);
        Py_DECREF(ctx);
        return FAILED;
    }
    Py_DECREF(acquired);

    if (place >= 0) { /* kernels launch on the current device: make it the tensors' */
        int current = current_device();
        if (current < 0 || (current != place && !make_current(place)))
            goto failed;
        if (current != place)
            s->device = current;
        if (!attach_stream(s, place))
            goto failed;
    }
    return READY;

failed:
    finish(s); /* keeps the exception that got here */
    return FAILED;
}

/*
 * A CUDA call's scratch from torch's caching allocator: the exact bytes its query gave (`query`
 * its status), handed to the context for this call only, so the memory is torch's to count and
 * reuse in the order of the current stream. *holder keeps the tensor until leave_with. Nothing
 * to do for CPU calls, calls that take none, or a refused query (the call then refuses alike,
 * with its own message). 0 with an exception set.
 */
static int take_workspace(session *s, int place, moefuse_status query, size_t bytes,
                          PyObject **holder)
{
    *holder = NULL;
    if (place < 0 || query != MOEFUSE_OK || bytes == 0 || S.alloc_workspace == NULL)
        return 1;
    PyObject *n = PyLong_FromSize_t(bytes), *device = PyLong_FromLong(place);
    PyObject *t = n && device ? PyObject_CallFunctionObjArgs(S.alloc_workspace, n, device, NULL)
                              : NULL;
    Py_XDECREF(n);
    Py_XDECREF(device);
    PyObject *address = t ? call0(t, s_data_ptr) : NULL;
    void *data = address ? PyLong_AsVoidPtr(address) : NULL;
    Py_XDECREF(address);
    if (data == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "moefuse: the workspace tensor has no data");
        Py_XDECREF(t);
        return 0;
    }
    const moefuse_tensor ws = {data, 0, MOEFUSE_U8, 1, {(int64_t)bytes}, {1}};
    moefuse_status status = S.set_workspace(s->handle, &ws);
    if (status != MOEFUSE_OK) {
        PyObject *message = message_of(s->handle);
        if (message != NULL)
            raise_status(status, message);
        Py_XDECREF(message);
        Py_DECREF(t);
        return 0;
    }
    *holder = t;
    return 1;
}

/* After the call: the message of a failure (read while the lock is held), the context's own
 * scratch back and the workspace tensor let go (holder, or NULL), the previous device made
 * current again, the lock released; True, or the call's exception. */
static PyObject *leave_with(session *s, moefuse_status status, PyObject *holder)
{
    PyObject *message = status != MOEFUSE_OK ? message_of(s->handle) : NULL;
    if (holder != NULL) { /* after the message: a call on the context clears it */
        S.set_workspace(s->handle, NULL); /* cannot fail: the lock keeps the context ours */
        Py_DECREF(holder); /* torch reuses it in stream order, after the call's kernels */
    }
    int restored = finish(s);
    S.calls++;
    if (status == MOEFUSE_OK) {
        if (!restored)
            return NULL;
        Py_RETURN_TRUE;
    }
    if (message == NULL) /* decoding it failed: that exception is set */
        return NULL;
    if (!restored) /* the call's failure is the one to raise; show the other */
        PyErr_WriteUnraisable(NULL);
    raise_status(status, message);
    Py_DECREF(message);
    return NULL;
}

static PyObject *leave(session *s, moefuse_status status) { return leave_with(s, status, NULL); }

/* The call's result when enter() did not make it READY. */
static PyObject *not_ready(int state)
{
    if (state == FAILED)
        return NULL;
    PyErr_Clear();
    Py_RETURN_FALSE;
}

#define CHECK_ARGS(name, n)                                                                        \
    do {                                                                                           \
        if (!S.context_type || !S.tensor_type_count) {                                             \
            PyErr_SetString(PyExc_RuntimeError, "moefuse._fastcall: not bound");                   \
            return NULL;                                                                           \
        }                                                                                          \
        if (nargs != (n)) {                                                                        \
            PyErr_Format(PyExc_TypeError, "moefuse._fastcall." name " takes %d arguments", (n));   \
            return NULL;                                                                           \
        }                                                                                          \
    } while (0)

/* Runs `expr` (a library call) with the GIL released, then leaves the session. */
#define RUN(s, expr)                                                                               \
    do {                                                                                           \
        moefuse_status status_;                                                                    \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        status_ = (expr);                                                                          \
        Py_END_ALLOW_THREADS                                                                       \
        return leave(&(s), status_);                                                               \
    } while (0)

/* The same for a call that may take a workspace: `query` (the call's size query, with
 * `&bytes_` as its last argument) runs first, with the GIL held (it only validates). */
#define RUN_WITH_WORKSPACE(s, place, query, expr)                                                  \
    do {                                                                                           \
        size_t bytes_ = 0;                                                                         \
        PyObject *holder_;                                                                         \
        moefuse_status query_ = (place) >= 0 ? (query) : MOEFUSE_OK;                               \
        if (!take_workspace(&(s), (place), query_, bytes_, &holder_)) {                            \
            finish(&(s));                                                                          \
            return NULL;                                                                           \
        }                                                                                          \
        moefuse_status status_;                                                                    \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        status_ = (expr);                                                                          \
        Py_END_ALLOW_THREADS                                                                       \
        return leave_with(&(s), status_, holder_);                                                 \
    } while (0)

/* ------------------------------------------------------------ the operations */

/* act_quant(ctx, x, row_scale, q, scales, activation, order, limit, intermediate, alpha,
 *           up_offset, group_size, scale_layout, ue8m0, eps) */
static PyObject *fc_act_quant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("act_quant", 15);
    int place = PLACE_NONE;
    moefuse_tensor x, rs, q, sc;
    moefuse_act_quant_options opt = {0};
    if (!read_tensor(args[1], &x, &place) || !read_tensor(args[2], &rs, &place) ||
        !read_tensor(args[3], &q, &place) || !read_tensor(args[4], &sc, &place) ||
        !read_act(args + 5, &opt.act) || !read_quant(args + 11, &opt.quant))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN(s, S.act_quant(s.handle, &x, optional(&rs), &q, &sc, &opt));
}

/* act_quant_masked(ctx, x, counts, row_scale, expert_scale, q, scales, activation, order,
 *                  limit, intermediate, alpha, up_offset, group_size, scale_layout, ue8m0, eps,
 *                  zero_tail) */
static PyObject *fc_act_quant_masked(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("act_quant_masked", 18);
    int place = PLACE_NONE;
    moefuse_tensor x, counts, rs, es, q, sc;
    moefuse_act_quant_options opt = {0};
    if (!read_tensor(args[1], &x, &place) || !read_tensor(args[2], &counts, &place) ||
        !read_tensor(args[3], &rs, &place) || !read_tensor(args[4], &es, &place) ||
        !read_tensor(args[5], &q, &place) || !read_tensor(args[6], &sc, &place) ||
        !read_act(args + 7, &opt.act) || !read_quant(args + 13, &opt.quant) ||
        !read_bool(args[17], &opt.zero_tail))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN_WITH_WORKSPACE(s, place,
                       S.act_quant_masked_workspace_size(s.handle, &x, &counts, optional(&rs),
                                                         optional(&es), &q, &sc, &opt, &bytes_),
                       S.act_quant_masked(s.handle, &x, &counts, optional(&rs), optional(&es),
                                          &q, &sc, &opt));
}

/* act_mul(ctx, x, row_scale, out, activation, order, limit, intermediate, alpha, up_offset) */
static PyObject *fc_act_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("act_mul", 10);
    int place = PLACE_NONE;
    moefuse_tensor x, rs, out;
    moefuse_act_options opt = {0};
    if (!read_tensor(args[1], &x, &place) || !read_tensor(args[2], &rs, &place) ||
        !read_tensor(args[3], &out, &place) || !read_act(args + 4, &opt))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN(s, S.act_mul(s.handle, &x, optional(&rs), &out, &opt));
}

/* quant(ctx, x, q, scales, group_size, scale_layout, ue8m0, eps) */
static PyObject *fc_quant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("quant", 8);
    int place = PLACE_NONE;
    moefuse_tensor x, q, sc;
    moefuse_quant_options opt = {0};
    if (!read_tensor(args[1], &x, &place) || !read_tensor(args[2], &q, &place) ||
        !read_tensor(args[3], &sc, &place) || !read_quant(args + 4, &opt))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN(s, S.quant(s.handle, &x, &q, &sc, &opt));
}

/* dequant(ctx, q, scales, out, group_size, scale_layout, ue8m0, eps); ue8m0 None: the scales
 * are u8 exponents. */
static PyObject *fc_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("dequant", 8);
    int place = PLACE_NONE;
    moefuse_tensor q, sc, out;
    moefuse_quant_options opt = {0};
    PyObject *quant_args[4] = {args[4], args[5], args[6] == Py_None ? Py_False : args[6], args[7]};
    if (!read_tensor(args[1], &q, &place) || !read_tensor(args[2], &sc, &place) ||
        !read_tensor(args[3], &out, &place) || !read_quant(quant_args, &opt))
        return not_ready(FALL_BACK);
    if (args[6] == Py_None)
        opt.ue8m0 = args[2] != Py_None && sc.dtype == MOEFUSE_U8;
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    /* scales is required: NULL only when not given (an empty one may have no data) */
    RUN(s, S.dequant(s.handle, &q, args[2] != Py_None ? &sc : NULL, &out, &opt));
}

/* moe_gate(ctx, x, w1, b1, topk_ids, expert_map, h, activation, order, limit, alpha,
 *          up_offset) */
static PyObject *fc_moe_gate(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("moe_gate", 12);
    int place = PLACE_NONE;
    moefuse_tensor x, w1, b1, h;
    moefuse_routing route;
    moefuse_moe_options opt = {0};
    memset(&route, 0, sizeof route);
    if (!read_tensor(args[1], &x, &place) || !read_tensor(args[2], &w1, &place) ||
        !read_tensor(args[3], &b1, &place) || !read_tensor(args[4], &route.topk_ids, &place) ||
        !read_tensor(args[5], &route.expert_map, &place) || !read_tensor(args[6], &h, &place) ||
        !read_moe(args + 7, &opt))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN_WITH_WORKSPACE(s, place,
                       S.moe_gate_workspace_size(s.handle, &x, &w1, optional(&b1), &route, &h,
                                                 &opt, &bytes_),
                       S.moe_gate(s.handle, &x, &w1, optional(&b1), &route, &h, &opt));
}

/* moe_final(ctx, h, w2, b2, topk_ids, topk_weights, expert_map, out) */
static PyObject *fc_moe_final(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("moe_final", 8);
    int place = PLACE_NONE;
    moefuse_tensor h, w2, b2, out;
    moefuse_routing route;
    moefuse_moe_options opt = {0}; /* moe_final's options are the defaults (ops.py) */
    memset(&route, 0, sizeof route); /* no shared experts: ops.py sends those through ctypes */
    if (!read_tensor(args[1], &h, &place) || !read_tensor(args[2], &w2, &place) ||
        !read_tensor(args[3], &b2, &place) || !read_tensor(args[4], &route.topk_ids, &place) ||
        !read_tensor(args[5], &route.topk_weights, &place) ||
        !read_tensor(args[6], &route.expert_map, &place) || !read_tensor(args[7], &out, &place))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN_WITH_WORKSPACE(s, place,
                       S.moe_final_workspace_size(s.handle, &h, &w2, optional(&b2), &route, &out,
                                                  &opt, &bytes_),
                       S.moe_final(s.handle, &h, &w2, optional(&b2), &route, &out, &opt));
}

/* moe_forward(ctx, x, w1, w2, b1, b2, topk_ids, topk_weights, expert_map, out,
 *             activation, order, limit, alpha, up_offset) */
static PyObject *fc_moe_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("moe_forward", 15);
    int place = PLACE_NONE;
    moefuse_tensor x, w1, w2, b1, b2, out;
    moefuse_routing route;
    moefuse_moe_options opt = {0};
    memset(&route, 0, sizeof route); /* no shared experts: ops.py sends those through ctypes */
    if (!read_tensor(args[1], &x, &place) || !read_tensor(args[2], &w1, &place) ||
        !read_tensor(args[3], &w2, &place) || !read_tensor(args[4], &b1, &place) ||
        !read_tensor(args[5], &b2, &place) || !read_tensor(args[6], &route.topk_ids, &place) ||
        !read_tensor(args[7], &route.topk_weights, &place) ||
        !read_tensor(args[8], &route.expert_map, &place) || !read_tensor(args[9], &out, &place) ||
        !read_moe(args + 10, &opt))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN_WITH_WORKSPACE(s, place,
                       S.moe_forward_workspace_size(s.handle, &x, &w1, &w2, optional(&b1),
                                                    optional(&b2), &route, &out, &opt, &bytes_),
                       S.moe_forward(s.handle, &x, &w1, &w2, optional(&b1), optional(&b2), &route,
                                     &out, &opt));
}

/* topk_softmax(ctx, logits, renormalize, ids, weights) */
static PyObject *fc_topk_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("topk_softmax", 5);
    int place = PLACE_NONE;
    moefuse_tensor logits, ids, weights;
    int32_t renormalize;
    if (!read_tensor(args[1], &logits, &place) || !read_bool(args[2], &renormalize) ||
        !read_tensor(args[3], &ids, &place) || !read_tensor(args[4], &weights, &place))
        return not_ready(FALL_BACK);
    session s;
    int state = enter(&s, args[0], place);
    if (state != READY)
        return not_ready(state);
    RUN(s, S.topk_softmax(s.handle, &logits, renormalize, &ids, &weights));
}

/* ------------------------------------------------------------ binding */

static void replace(PyObject **slot, PyObject *value)
{
    Py_XINCREF(value);
    Py_XSETREF(*slot, value);
}

static int function_address(PyObject *addresses, const char *name, void *fn, size_t size)
{
    PyObject *value = PyDict_GetItemString(addresses, name); /* borrowed */
    void *address = value ? PyLong_AsVoidPtr(value) : NULL;
    if (address == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_KeyError, "moefuse._fastcall.bind: no address for %s", name);
        return 0;
    }
    memcpy(fn, &address, size); /* ISO C has no cast from an object to a function pointer */
    return 1;
}

/* bind(addresses, version, context_type, resolve, make_error, activations, orders, roundings,
 *      layouts): addresses maps "moefuse_act_quant" and so on to the loaded library's
 * functions; version is its moefuse_version(), which must be this header's. */
static PyObject *fc_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 9 || !PyDict_Check(args[0]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "moefuse._fastcall.bind: bad arguments");
        return NULL;
    }
    for (int i = 5; i < 9; i++)
        if (!PyTuple_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "moefuse._fastcall.bind: names must be tuples");
            return NULL;
        }
    unsigned long version = PyLong_AsUnsignedLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (version != MOEFUSE_VERSION) {
        PyErr_Format(PyExc_ImportError,
                     "moefuse._fastcall was built with moefuse.h version %d, the library is %lu",
                     MOEFUSE_VERSION, version);
        return NULL;
    }
#define ADDRESS(name, ...)                                                                         \
    if (!function_address(args[0], "moefuse_" #name, &S.name, sizeof S.name))                     \
        return NULL;
    LIBRARY_FUNCTIONS(ADDRESS)
    ADDRESS(last_error, const char *)
#undef ADDRESS
    replace(&S.context_type, args[2]);
    replace(&S.resolve, args[3]);
    replace(&S.make_error, args[4]);
    replace(&S.activations, args[5]);
    replace(&S.orders, args[6]);
    replace(&S.roundings, args[7]);
    replace(&S.layouts, args[8]);
    Py_RETURN_NONE;
}

/* bind_torch(tensor_types, dtypes, get_device, set_device, raw_stream): the exact tensor types
 * to read, torch's dtypes in moefuse_dtype order, and torch._C's _cuda_getDevice,
 * _cuda_setDevice and _cuda_getCurrentRawStream (None each: CUDA tensors take ctypes).
 * An empty tensor_types turns the fast path off. */
static PyObject *fc_bind_torch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1]) ||
        PyTuple_GET_SIZE(args[0]) > MAX_TENSOR_TYPES ||
        PyTuple_GET_SIZE(args[1]) != MOEFUSE_DTYPE_COUNT_) {
        PyErr_SetString(PyExc_TypeError, "moefuse._fastcall.bind_torch: bad arguments");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[0]); i++)
        if (!PyType_Check(PyTuple_GET_ITEM(args[0], i))) {
            PyErr_SetString(PyExc_TypeError, "moefuse._fastcall.bind_torch: not a type");
            return NULL;
        }
    int cuda = args[2] != Py_None && args[3] != Py_None && args[4] != Py_None;
    for (int i = 0; i < S.tensor_type_count; i++)
        Py_CLEAR(S.tensor_types[i]);
    S.tensor_type_count = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[0]); i++) {
        PyObject *type = PyTuple_GET_ITEM(args[0], i);
        Py_INCREF(type);
        S.tensor_types[S.tensor_type_count++] = (PyTypeObject *)type;
    }
    for (int i = 0; i < MOEFUSE_DTYPE_COUNT_; i++)
        replace(&S.dtypes[i], PyTuple_GET_ITEM(args[1], i));
    replace(&S.get_device, cuda ? args[2] : NULL);
    replace(&S.set_device, cuda ? args[3] : NULL);
    replace(&S.raw_stream, cuda ? args[4] : NULL);
    Py_RETURN_NONE;
}

/* bind_workspace(alloc): alloc(nbytes, device) gives a torch uint8 tensor on that CUDA device,
 * from which CUDA calls take their scratch; None: they use the context's own. */
static PyObject *fc_bind_workspace(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 1 || (args[0] != Py_None && !PyCallable_Check(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "moefuse._fastcall.bind_workspace: a callable or None");
        return NULL;
    }
    replace(&S.alloc_workspace, args[0] == Py_None ? NULL : args[0]);
    Py_RETURN_NONE;
}

static PyObject *fc_calls(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(S.calls);
}

#define OP(name, doc) {#name, (PyCFunction)(void (*)(void))fc_##name, METH_FASTCALL, doc}
static PyMethodDef methods[] = {
    OP(bind, "Bind the loaded libmoefuse's functions and the binding's helpers."),
    OP(bind_torch, "Bind torch's tensor types, dtypes and CUDA device and stream functions."),
    OP(bind_workspace, "Bind the allocator CUDA calls take their workspace from (or None)."),
    {"calls", fc_calls, METH_NOARGS, "How many calls ran through the fast path."},
    OP(act_quant, "moefuse_act_quant on torch tensors; False: not taken."),
    OP(act_quant_masked, "moefuse_act_quant_masked on torch tensors; False: not taken."),
    OP(act_mul, "moefuse_act_mul on torch tensors; False: not taken."),
    OP(quant, "moefuse_quant on torch tensors; False: not taken."),
    OP(dequant, "moefuse_dequant on torch tensors; False: not taken."),
    OP(moe_gate, "moefuse_moe_gate on torch tensors; False: not taken."),
    OP(moe_final, "moefuse_moe_final on torch tensors; False: not taken."),
    OP(moe_forward, "moefuse_moe_forward on torch tensors; False: not taken."),
    OP(topk_softmax, "moefuse_topk_softmax on torch tensors; False: not taken."),
    {NULL, NULL, 0, NULL},
};
#undef OP

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "moefuse._fastcall",
    "The binding's per-call work in C for torch tensors (see _fastcall.c and docs/PYTHON.md).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_data_ptr, "data_ptr"}, {&s_shape, "shape"},     {&s_stride, "stride"},
        {&s_dtype, "dtype"},       {&s_is_cuda, "is_cuda"}, {&s_is_cpu, "is_cpu"},
        {&s_get_device, "get_device"}, {&s_backend, "backend"}, {&s_handle, "_handle"},
        {&s_value, "value"},       {&s_lock, "_lock"},      {&s_stream, "_stream"},
        {&s_acquire, "acquire"},   {&s_release, "release"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].slot == NULL && !(*names[i].slot = PyUnicode_InternFromString(names[i].text)))
            return NULL;
    return PyModule_Create(&module);
}
