"""Contexts: one backend and device, its stream, its last error; default ones per thread."""

import ctypes
import threading

from . import _capi, errors
from ._capi import lib, text

# torch's default stream is the legacy NULL stream, handle 0, but NULL in
# moefuse_set_stream means the context's own (non-blocking) stream. CUDA's
# handle for the legacy stream is cudaStreamLegacy, ((cudaStream_t)0x1).
CUDA_STREAM_LEGACY = 1


class Context:
    """A moefuse context on one backend: "cpu", "cuda", "opencl" or "auto"
    (None: the MOEFUSE_BACKEND environment variable, else "auto"), on `device`
    when given: a CUDA device index (an int or "1"), or for OpenCL "p:d" or a
    piece of the device or platform name (moefuse_context_create_on).

    Use one context per thread (calls on one context are serialised by a lock).
    `close()` (or a `with` block) frees it and its moe_forward workspace.
    """

    def __init__(self, backend=None, device=None):
        handle = ctypes.c_void_p()
        name = backend.encode() if backend is not None else None
        if device is None:
            status = lib.moefuse_context_create(ctypes.byref(handle), name)
        else:
            status = lib.moefuse_context_create_on(ctypes.byref(handle), name,
                                                   str(device).encode())
        if status != _capi.OK:
            raise errors.make(status, text(lib.moefuse_last_error(None)))
        self._handle = handle
        self._lock = threading.RLock()
        self.backend = text(lib.moefuse_backend_name(handle))
        self.device = text(lib.moefuse_device_name(handle))
        self._stream = None  # what set_stream was last given, to skip repeats
        # Set by default_context for CUDA: the device index the context was created on.
        self.device_index = None

    def __repr__(self):
        state = "closed" if self._handle is None else self.device
        return f"<moefuse.Context {self.backend}: {state}>"

    @property
    def handle(self):
        """The moefuse_context pointer (a ctypes.c_void_p) for direct C calls."""
        if self._handle is None:
            raise errors.make(errors.code_of("MOEFUSE_ERR_NULL_POINTER"), "the context is closed")
        return self._handle

    def check(self, status):
        """Raise the exception for a status returned by a call on this context."""
        if status != _capi.OK:
            raise errors.make(status, text(lib.moefuse_last_error(self.handle)))

    def close(self):
        if self._handle is not None:
            lib.moefuse_context_destroy(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    def synchronize(self):
        """Wait for the work submitted on this context's stream."""
        with self._lock:
            self.check(lib.moefuse_synchronize(self.handle))

    def set_stream(self, stream):
        """Run on a cudaStream_t / cl_command_queue given as an int (None: the context's own)."""
        with self._lock:
            if stream == self._stream:
                return
            self.check(lib.moefuse_set_stream(self.handle, ctypes.c_void_p(stream or None)))
            self._stream = stream

    @property
    def stream(self):
        """The cudaStream_t / cl_command_queue calls run on now, as an int (None on the CPU)."""
        out = ctypes.c_void_p()
        with self._lock:
            self.check(lib.moefuse_get_stream(self.handle, ctypes.byref(out)))
        return out.value

    # Backend memory, used to stage host arrays for the device backends.

    def buffer_alloc(self, nbytes):
        out = ctypes.c_void_p()
        self.check(lib.moefuse_buffer_alloc(self.handle, max(int(nbytes), 1), ctypes.byref(out)))
        return out.value

    def buffer_free(self, buffer):
        self.check(lib.moefuse_buffer_free(self.handle, buffer))

    def buffer_write(self, buffer, offset, address, nbytes):
        self.check(lib.moefuse_buffer_write(self.handle, buffer, offset, address, nbytes))

    def buffer_read(self, buffer, offset, address, nbytes):
        self.check(lib.moefuse_buffer_read(self.handle, buffer, offset, address, nbytes))


def built_backends():
    """The backends compiled into the loaded library, e.g. ["cpu", "opencl"]."""
    return text(lib.moefuse_built_backends()).split(",")


_defaults = threading.local()


def default_context(backend="cpu", device=None):
    """This thread's context for `backend` ("cpu", "cuda", "opencl"), created on first use.

    For "cuda", `device` is the CUDA device index (default: torch's current device
    when torch is imported, else what the library picks: MOEFUSE_CUDA_DEVICE or 0).
    """
    table = getattr(_defaults, "table", None)
    if table is None:
        table = _defaults.table = {}
    key = (backend, device)
    ctx = table.get(key)
    if ctx is None:
        ctx = table[key] = _create(backend, device)
    return ctx


def _create(backend, device):
    if backend != "cuda" or device is None:
        return Context(backend)
    # The CUDA backend takes the calling thread's current device at creation.
    import torch
    with torch.cuda.device(device):
        ctx = Context(backend)
    ctx.device_index = device
    return ctx
