/*
 * What the files of moefuse._fastcall share (not a public header): the libmoefuse functions it
 * calls and the objects bind() gave (S), the readers of operands and options
 * (_fastcall_operands.c), and one call's session on a Context (_fastcall_session.c), with the
 * macros the entry points (_fastcall_ops_*.c) are written with. _fastcall.c has the overview.
 */
#ifndef MOEFUSE_FASTCALL_H
#define MOEFUSE_FASTCALL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

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
/* What bind(), bind_torch() and bind_workspace() gave; defined in _fastcall.c. */
struct fastcall_state {
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
};
extern struct fastcall_state S;

/* Attribute and method names, interned once (PyInit__fastcall). */
extern PyObject *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_is_cuda, *s_is_cpu,
    *s_get_device, *s_backend, *s_handle, *s_value, *s_lock, *s_stream, *s_acquire, *s_release;

/* ------------------------------------------------------------ operands (_fastcall_operands.c) */

#define PLACE_NONE (-2) /* no tensor seen yet */
#define PLACE_CPU (-1)  /* else a CUDA device index */

/* Each reader returns 1, or 0 when the fast path does not take the call (fall_back drops the
 * Python error met on the way: the ctypes path raises it). */
int fall_back(void);
int read_tensor(PyObject *obj, moefuse_tensor *t, int *place);
int read_tensors(PyObject *const *objs, moefuse_tensor *const *tensors, size_t count, int *place);
const moefuse_tensor *optional(const moefuse_tensor *t);
int read_bool(PyObject *v, int32_t *out);
int read_act(PyObject *const *v, moefuse_act_options *opt);
int read_quant(PyObject *const *v, moefuse_quant_options *opt);
int read_moe(PyObject *const *v, moefuse_moe_options *opt);

/* read_tensors for consecutive arguments from `first` into the tensors listed after place. */
#define READ_TENSORS(first, place, ...)                                                            \
    read_tensors((first), (moefuse_tensor *const[]){__VA_ARGS__},                                  \
                 sizeof((moefuse_tensor *const[]){__VA_ARGS__}) / sizeof(moefuse_tensor *),        \
                 (place))

/* ------------------------------------------------------------ one call (_fastcall_session.c) */

typedef struct session {
    PyObject *ctx;  /* the Context */
    PyObject *lock; /* its _lock, held from enter to leave */
    moefuse_context *handle;
    int device; /* the CUDA device to make current again after the call, or -1 */
} session;

enum { FAILED = -1, FALL_BACK = 0, READY = 1 };

int enter(session *s, PyObject *ctx_arg, int place);
int finish(session *s);
int take_workspace(session *s, int place, moefuse_status query, size_t bytes, PyObject **holder);
PyObject *leave_with(session *s, moefuse_status status, PyObject *holder);
PyObject *not_ready(int state);

/* ------------------------------------------------------------ writing an entry point */

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

/* Enters session s (declared by the caller) on the Context for ctx_arg; returns the entry
 * point's result (False, or NULL with an exception) when the call is not READY. */
#define ENTER(s, ctx_arg, place)                                                                   \
    do {                                                                                           \
        int state_ = enter(&(s), (ctx_arg), (place));                                              \
        if (state_ != READY)                                                                       \
            return not_ready(state_);                                                              \
    } while (0)

/* Runs `expr` (a library call) with the GIL released, then leaves the session (holder: the
 * workspace tensor, or NULL) and returns its result. */
#define RUN_AND_LEAVE(s, expr, holder)                                                             \
    do {                                                                                           \
        moefuse_status status_;                                                                    \
        Py_BEGIN_ALLOW_THREADS                                                                     \
        status_ = (expr);                                                                          \
        Py_END_ALLOW_THREADS                                                                       \
        return leave_with(&(s), status_, (holder));                                                \
    } while (0)

/* For a call that takes no workspace. */
#define RUN(s, expr) RUN_AND_LEAVE(s, expr, NULL)

/* For a call that may take a workspace: `query` (the call's size query, with `&bytes_` as its
 * last argument) runs first, with the GIL held (it only validates). */
#define RUN_WITH_WORKSPACE(s, place, query, expr)                                                  \
    do {                                                                                           \
        size_t bytes_ = 0;                                                                         \
        PyObject *holder_;                                                                         \
        moefuse_status query_ = (place) >= 0 ? (query) : MOEFUSE_OK;                               \
        if (!take_workspace(&(s), (place), query_, bytes_, &holder_)) {                            \
            finish(&(s));                                                                          \
            return NULL;                                                                           \
        }                                                                                          \
        RUN_AND_LEAVE(s, expr, holder_);                                                           \
    } while (0)

/* ------------------------------------------------------------ entry points (_fastcall_ops_*.c) */

#define ENTRY_POINT(name)                                                                          \
    PyObject *fc_##name(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
ENTRY_POINT(act_quant);
ENTRY_POINT(act_quant_masked);
ENTRY_POINT(act_mul);
ENTRY_POINT(quant);
ENTRY_POINT(dequant);
ENTRY_POINT(moe_gate);
ENTRY_POINT(moe_final);
ENTRY_POINT(moe_forward);
ENTRY_POINT(topk_softmax);

#endif
