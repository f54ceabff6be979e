"""One C call: choose the context, turn operands into moefuse_tensor structs, run, raise.

Where the memory is decides what happens to an operand:
- host memory on the cpu backend, CUDA memory on the cuda backend, a moefuse.Buffer
  of the same context: passed as is;
- host memory on a device backend (opencl, or cuda): copied into a backend buffer
  through moefuse_buffer_* before the call, and outputs copied back after it
  (a synchronous copy, for convenience and tests; keep data on the device for speed);
- CUDA memory on another backend: refused.
"""

import contextlib
import sys

from . import _capi, _tensors, errors
from .context import CUDA_STREAM_LEGACY, Context, default_context


# The calls that can take scratch on CUDA (docs/API.md, Workspace); the others take none there.
_CUDA_SCRATCH_CALLS = frozenset(("moefuse_act_quant_masked", "moefuse_moe_gate",
                                 "moefuse_moe_final", "moefuse_moe_forward",
                                 "moefuse_moe_gate_fp8", "moefuse_moe_final_fp8",
                                 "moefuse_moe_forward_fp8", "moefuse_moe_masked_fp8"))


def resolve_context(ctx, operands):
    """The Context to run on: `ctx` itself, a backend name's default context, or
    (ctx None) the cuda context of the first CUDA operand's device, else cpu."""
    if isinstance(ctx, Context):
        return ctx
    buffers = [o for o in operands if o is not None and o.device == _tensors.BUFFER]
    if ctx is None and buffers:
        return buffers[0].obj.ctx
    cuda = [o for o in operands if o is not None and o.device == _tensors.CUDA]
    if ctx is None:
        backend = "cuda" if cuda else "cpu"
    elif isinstance(ctx, str):
        backend = ctx
    else:
        raise TypeError(f"moefuse: ctx must be a Context, a backend name or None, "
                        f"not {type(ctx).__name__}")
    device = cuda[0].device_index if backend == "cuda" and cuda else None
    return default_context(backend, device)


def _wrong_device(op, operand, backend):
    return errors.WrongDeviceError(
        errors.code_of("MOEFUSE_ERR_WRONG_DEVICE"),
        f"{op}: {operand.name} is CUDA memory but the context's backend is {backend}")


class Call:
    """Use as `with Call(ctx, op) as call:`; staged buffers are freed on the way out."""

    def __init__(self, ctx, op):
        self.ctx = ctx
        self.op = op
        self._staged = []       # (buffer, operand, low byte, bytes, is output)
        self._keep = []         # operands (and their DLPack capsules) in use by C
        self._cuda_index = None
        self._cuda_source = None  # "torch" when a torch CUDA tensor takes part

    def __enter__(self):
        self.ctx._lock.acquire()  # staging, the call and its message belong together
        return self

    def __exit__(self, *exc):
        try:
            for buffer, *_ in self._staged:
                try:
                    self.ctx.buffer_free(buffer)
                except errors.Error:
                    pass  # the call's own error, if any, is the one to report
        finally:
            self._staged.clear()
            self._keep.clear()
            self.ctx._lock.release()

    def tensor(self, operand, output=False):
        """The moefuse_tensor for an Operand (an absent tensor for None)."""
        if operand is None:
            return _capi.Tensor()
        if output and not operand.writable:
            raise ValueError(f"moefuse {self.op}: {operand.name} is read-only")
        backend = self.ctx.backend
        if operand.device == _tensors.BUFFER:
            if operand.obj.ctx is not self.ctx:
                raise errors.WrongDeviceError(
                    errors.code_of("MOEFUSE_ERR_WRONG_DEVICE"),
                    f"{self.op}: {operand.name} is a Buffer of another context")
            data, offset = operand.address, 0
        elif operand.device == _tensors.CUDA:
            if backend != "cuda":
                raise _wrong_device(self.op, operand, backend)
            self._cuda_index = operand.device_index
            if operand.framework == "torch":
                self._cuda_source = "torch"
            data, offset = operand.address, 0
        elif backend == "cpu":
            data, offset = operand.address, 0
        else:
            data, offset = self._stage(operand, output)
        self._keep.append(operand)
        # a rank above 4 is the C API's to refuse: only the first 4 dimensions travel
        return _capi.Tensor(data or None, offset, _capi.DTYPE_CODES[operand.dtype],
                            len(operand.shape), operand.shape[:_capi.MAX_RANK],
                            operand.strides[:_capi.MAX_RANK])

    def _stage(self, operand, output):
        itemsize = _capi.DTYPE_SIZES[operand.dtype]
        low, high = operand.byte_span(itemsize)
        if output:
            for _, other, other_low, other_bytes, other_out in self._staged:
                start = other.address + other_low
                if other_out and start < operand.address + high and \
                        operand.address + low < start + other_bytes:
                    raise ValueError(f"moefuse {self.op}: outputs {other.name} and "
                                     f"{operand.name} share memory; copying them back would "
                                     f"overwrite one with the other")
        buffer = self.ctx.buffer_alloc(high - low)
        self._staged.append((buffer, operand, low, high - low, output))
        if high > low:
            self.ctx.buffer_write(buffer, 0, operand.address + low, high - low)
        return buffer, -low  # element 0 sits -low bytes into the buffer

    def _device_guard(self):
        torch = sys.modules.get("torch")
        if self._cuda_index is None or torch is None or \
                torch.cuda.current_device() == self._cuda_index:
            return contextlib.nullcontext()
        return torch.cuda.device(self._cuda_index)  # kernels launch on the current device

    def _stream(self):
        if self._cuda_source == "torch":
            import torch
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object
            handle = (raw(self._cuda_index) if raw else
                      torch.cuda.current_stream(self._cuda_index).cuda_stream)
            return handle or CUDA_STREAM_LEGACY
        # DLPack exports made with stream=None are ordered on the legacy stream.
        return CUDA_STREAM_LEGACY

    def _workspace(self, fn, args):
        """For a torch CUDA call that takes scratch: a uint8 tensor of the exact size from
        torch's caching allocator (on the current stream), handed to the context; else None.
        fn's size query is libmoefuse's moefuse_<call>_workspace_size."""
        if self._cuda_source != "torch" or fn.__name__ not in _CUDA_SCRATCH_CALLS:
            return None
        query = getattr(_capi.lib, fn.__name__ + "_workspace_size")
        import ctypes
        import torch
        nbytes = ctypes.c_size_t(0)
        if query(self.ctx.handle, *args, ctypes.byref(nbytes)) != 0 or nbytes.value == 0:
            return None  # a refused query: the call refuses alike, with its message
        ws = torch.empty(nbytes.value, dtype=torch.uint8,
                         device=torch.device("cuda", self._cuda_index))
        t = _capi.Tensor(ws.data_ptr(), 0, _capi.DTYPE_CODES["u8"], 1, (nbytes.value,), (1,))
        self.ctx.check(_capi.lib.moefuse_set_workspace(self.ctx.handle, ctypes.byref(t)))
        return ws

    def run(self, fn, *args):
        """Call fn(ctx, *args); raise on failure; copy staged outputs back on success.
        A torch CUDA call takes its scratch from torch's allocator (_workspace)."""
        ctx = self.ctx
        with self._device_guard():
            if self._cuda_index is not None:
                ctx.set_stream(self._stream())
            ws = self._workspace(fn, args)
            try:
                ctx.check(fn(ctx.handle, *args))
            finally:
                if ws is not None:  # torch reuses it in stream order, after the call
                    _capi.lib.moefuse_set_workspace(ctx.handle, None)
            for buffer, operand, low, nbytes, output in self._staged:
                if output and nbytes:
                    ctx.buffer_read(buffer, 0, operand.address + low, nbytes)
