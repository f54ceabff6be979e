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
 * its functions, so the process holds one copy of the library. moefuse.h gives the layouts.
 *
 * The files: this one binds the library, torch and the binding's helpers and defines the
 * module; _fastcall_operands.c reads tensors and options, _fastcall_session.c makes one call on
 * a Context (lock, device, stream, workspace, errors), and _fastcall_ops_act.c and
 * _fastcall_ops_moe.c hold the entry points, by operation; _fastcall.h is what they share.
 */
#include "_fastcall.h"

#include <string.h>

struct fastcall_state S;

PyObject *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_is_cuda, *s_is_cpu, *s_get_device,
    *s_backend, *s_handle, *s_value, *s_lock, *s_stream, *s_acquire, *s_release;

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
