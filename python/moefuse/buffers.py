"""Arrays in a backend's own memory (moefuse_buffer_*): OpenCL operands kept on the device.

An OpenCL tensor must be a cl_mem of the same context, so numpy arrays and torch
tensors cannot be passed to that backend as they are: the operations copy them
through a temporary Buffer on every call. To run without those copies, upload
once and pass Buffers:

    ctx = moefuse.Context("opencl")
    x = moefuse.Buffer.from_array(x_numpy, ctx)
    q, scales = moefuse.act_quant(x)        # results are Buffers of the same context
    ctx.synchronize(); q.download()         # -> numpy
"""

import math

from . import _capi, _dtypes


class Buffer:
    """A dense, row-major array of `shape` and moefuse `dtype` in `ctx`'s backend memory."""

    def __init__(self, ctx, shape, dtype):
        from ._call import resolve_context
        self.ctx = resolve_context(ctx, [])  # a Context or a backend name
        self.shape = tuple(int(n) for n in shape)
        self.dtype = _dtypes.resolve(dtype)
        self.nbytes = math.prod(self.shape) * _capi.DTYPE_SIZES[self.dtype]
        self.handle = self.ctx.buffer_alloc(self.nbytes)

    def __repr__(self):
        return f"<moefuse.Buffer {list(self.shape)} {self.dtype} on {self.ctx.backend}>"

    @property
    def strides(self):
        """Dense row-major strides, in elements."""
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        return tuple(reversed(strides))

    @classmethod
    def from_array(cls, array, ctx):
        """A new Buffer holding a copy of a host numpy array or CPU torch tensor."""
        host = _host_bytes(array)
        buf = cls(ctx, host.shape, _dtypes.from_numpy(host.dtype))
        buf.upload(host)
        return buf

    def upload(self, array):
        """Copy a host array of the same shape and dtype into the buffer (synchronous)."""
        host = _host_bytes(array)
        if host.shape != self.shape or _dtypes.from_numpy(host.dtype) != self.dtype:
            raise ValueError(f"moefuse Buffer.upload: array is {host.shape} "
                             f"{host.dtype}, the buffer {self.shape} {self.dtype}")
        self.ctx.buffer_write(self.handle, 0, host.ctypes.data, self.nbytes)

    def download(self, out=None):
        """The buffer's contents as a numpy array (synchronous; waits for work before it)."""
        import numpy as np
        if out is None:
            out = np.empty(self.shape, dtype=_dtypes.numpy_dtype(self.dtype))
        if not out.flags.c_contiguous or out.nbytes != self.nbytes:
            raise ValueError("moefuse Buffer.download: out must be C-contiguous and "
                             f"{self.nbytes} bytes")
        self.ctx.buffer_read(self.handle, 0, out.ctypes.data, self.nbytes)
        return out

    def free(self):
        if self.handle is not None and self.ctx._handle is not None:
            self.ctx.buffer_free(self.handle)
        self.handle = None

    def __del__(self):
        try:
            self.free()
        except Exception:  # interpreter shutdown
            pass


def _host_bytes(array):
    """A C-contiguous numpy view (or copy) of a host numpy array or CPU torch tensor."""
    import numpy as np
    if _dtypes.is_torch_tensor(array):
        import torch
        if array.device.type != "cpu":
            raise ValueError("moefuse Buffer: pass host data (a CPU tensor or a numpy array)")
        t = array.detach().contiguous()
        name = _dtypes.resolve(t.dtype)  # raises for dtypes moefuse has not
        # numpy has no bf16 or fp8 of its own: view through the integer of the same width
        same_width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
        return t.view(same_width).numpy().view(_dtypes.numpy_dtype(name))
    host = np.ascontiguousarray(array)
    _dtypes.resolve(host.dtype)  # raises for dtypes moefuse has not
    return host
