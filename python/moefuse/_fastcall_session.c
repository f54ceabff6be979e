/*
 * moefuse._fastcall: one call on a Context, as _call.py makes it: the Context's lock held,
 * the tensors' CUDA device made current, torch's current stream attached when it is not the
 * one attached last, the scratch taken from torch for a CUDA call, and after the call the
 * device restored, the lock released and a refusal raised as errors.make(status, message).
 */
#include "_fastcall.h"

#include <string.h>

/* torch's default stream is handle 0, which moefuse_set_stream reads as the context's own
 * stream; CUDA names the legacy default stream cudaStreamLegacy, ((cudaStream_t)0x1). */
#define CUDA_STREAM_LEGACY ((void *)1)

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

/* fn(device), a new reference, or NULL with an exception. */
static PyObject *call_with_device(PyObject *fn, int device)
{
    PyObject *index = PyLong_FromLong(device);
    PyObject *r = index ? PyObject_CallOneArg(fn, index) : NULL;
    Py_XDECREF(index);
    return r;
}

static int make_current(int device)
{
    PyObject *r = call_with_device(S.set_device, device);
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

/* Raises the exception for a status the context refused a setup step with (its message). */
static void raise_refusal(moefuse_context *handle, moefuse_status status)
{
    PyObject *message = message_of(handle);
    raise_status(status, message);
    Py_XDECREF(message);
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
int finish(session *s)
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
    PyObject *raw = call_with_device(S.raw_stream, device);
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
        raise_refusal(s->handle, status);
        return 0;
    }
    PyObject *value = PyLong_FromVoidPtr(stream);
    int ok = value && PyObject_SetAttr(s->ctx, s_stream, value) == 0;
    Py_XDECREF(value);
    return ok;
}

/* The Context for ctx_arg (a Context, or None / a backend name through default_context),
 * locked, with the operands' device current and torch's stream attached. */
int enter(session *s, PyObject *ctx_arg, int place)
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
int take_workspace(session *s, int place, moefuse_status query, size_t bytes, PyObject **holder)
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
        raise_refusal(s->handle, status);
        Py_DECREF(t);
        return 0;
    }
    *holder = t;
    return 1;
}

/* After the call: the message of a failure (read while the lock is held), the context's own
 * scratch back and the workspace tensor let go (holder, or NULL), the previous device made
 * current again, the lock released; True, or the call's exception. */
PyObject *leave_with(session *s, moefuse_status status, PyObject *holder)
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

/* The call's result when enter() did not make it READY. */
PyObject *not_ready(int state)
{
    if (state == FAILED)
        return NULL;
    PyErr_Clear();
    Py_RETURN_FALSE;
}
