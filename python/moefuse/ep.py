"""Expert parallelism (include/moefuse_ep.h): a group of ranks that share a MoE layer's experts.

    group = moefuse.EpGroup.from_process_group("cuda:0", num_experts=64)  # torch.distributed
    out = group.moe_forward_fp8(x, w1, w1_scales, w2, w2_scales, topk_ids, topk_weights)

Every rank (one process per GPU) makes its group and calls every method in the same order with
matching arguments: the C calls are collective. Operands are those of ops.py and ops_fp8.py
(numpy arrays, torch tensors, DLPack objects, moefuse.Buffer), run on the group's context and,
for torch CUDA tensors, on torch's current stream; failures raise moefuse.Error subclasses with
the library's message. A group's calls have no compiled fast path: each one exchanges data
between ranks, which costs far more than the binding. `group.id` names the group to
torch.ops.moefuse.ep_* (torch_ops_ep.py).
"""

import ctypes
import itertools
import sys
import weakref

from . import _capi_ep, _ep_pg, _options, _tensors, errors
from ._call import Call
from .context import Context
from .ops import _dims, _ref, _result, _routing
from .ops_fp8 import GROUP, _given, _h_scales_dtype, _out_dtype, _ue8m0

_open = weakref.WeakValueDictionary()  # group.id -> EpGroup, for torch.ops.moefuse.ep_*
_ids = itertools.count(1)


def _error(status, message):
    return errors.make(errors.code_of(status), message)


def _fn(name):
    """A bound moefuse_ep_* function; UnsupportedError from a library without them."""
    if _capi_ep.missing:
        raise _error("MOEFUSE_ERR_UNSUPPORTED", _capi_ep.missing)
    return _capi_ep.functions[name]


def group_by_id(gid):
    """The open EpGroup whose `id` is gid (how torch.ops.moefuse.ep_* name a group)."""
    group = _open.get(int(gid))
    if group is None:
        raise _error("MOEFUSE_ERR_INVALID_ARGUMENT",
                     f"no open moefuse.EpGroup has id {gid} in this process (closed, collected, "
                     f"or never made here)")
    return group


def context_of(where):
    """(Context, owned) for a moefuse.Context (used as is), a CUDA device index, a torch.device,
    "cuda:N", a backend name ("cuda": torch's current device when torch is imported), or None
    (torch's current CUDA device, else the cpu backend, which refuses groups with its message)."""
    if isinstance(where, Context):
        return where, False
    torch = sys.modules.get("torch")
    if where is None:
        cuda = torch is not None and torch.cuda.is_available()
        where = torch.cuda.current_device() if cuda else "cpu"
    if type(where).__module__.startswith("torch"):  # a torch.device
        where = str(where)
    if isinstance(where, bool) or not isinstance(where, (int, str)):
        raise TypeError(f"moefuse EpGroup: the context is a moefuse.Context, a device index, a "
                        f"torch.device or a backend name, not {type(where).__name__}")
    if isinstance(where, int):
        backend, index = "cuda", where
    else:
        backend, _, index = where.partition(":")
        index = int(index) if index else None
        if backend == "cuda" and index is None and torch is not None and \
                torch.cuda.is_available():
            index = torch.cuda.current_device()
    ctx = Context(backend, index)
    ctx.device_index = index if backend == "cuda" else None
    return ctx, True


def _int32(value, what):
    """An int that fits the C struct's int32_t (ctypes would wrap it silently)."""
    value = int(value)
    if not -2 ** 31 <= value < 2 ** 31:
        raise _error("MOEFUSE_ERR_INVALID_ARGUMENT", f"EpGroup: {what} is {value}, past int32")
    return value


def _placement(num_experts, expert_owner):
    """(num_experts, owner list or None), checked as far as C cannot: the owner's length."""
    num_experts = _int32(num_experts, "num_experts")
    if expert_owner is None:
        return num_experts, None
    values = expert_owner.tolist() if hasattr(expert_owner, "tolist") else expert_owner
    owner = [_int32(v, "an expert_owner entry") for v in values]
    if len(owner) != num_experts:
        raise _error("MOEFUSE_ERR_INVALID_ARGUMENT",
                     f"EpGroup: expert_owner has {len(owner)} entries; it needs num_experts = "
                     f"{num_experts}, the rank of each global expert")
    return num_experts, owner


def _config(rank, world, placement):
    """The moefuse_ep_config, and the owner array it points to (kept alive by the caller)."""
    num_experts, owner = placement
    rank, world = _int32(rank, "rank"), _int32(world, "world")
    array = (ctypes.c_int32 * len(owner))(*owner) if owner is not None else None
    config = _capi_ep.Config(rank=rank, world=world, num_experts=num_experts,
                             expert_owner=array)
    return config, array


def mode_code(mode):
    return _options._choice(mode, _capi_ep.MODES, "mode")


def dispatch_options(mode="normal", quantize=False, scale_layout="row_major", ue8m0=False,
                     eps=None, max_tokens=0):
    """moefuse_ep_dispatch_options (activation scales in groups of 128, the only size taken)."""
    return _capi_ep.DispatchOptions(mode=mode_code(mode), quantize=int(bool(quantize)),
                                    act=_options.quant(GROUP, scale_layout, ue8m0, eps),
                                    max_tokens=_int32(max_tokens or 0, "max_tokens"))


class EpGroup:
    """One rank's expert-parallel group (moefuse_ep_group) on one moefuse context.

    Made by EpGroup.from_process_group (torch.distributed), EpGroup.create (a unique id passed
    by the caller) or EpGroup.adopt (the caller's ncclComm_t). `close()` (or a `with` block)
    frees it, then the context when the group made it; a group is closed before the context
    it was made on. rank, world, num_experts and expert_owner are the placement it was made
    with; local_experts() and local_expert_ids() say which experts are this rank's.
    """

    def __init__(self, ctx, owned, handle, rank, world, placement):
        self.ctx = ctx
        self._owned = owned
        self._handle = handle
        self.rank, self.world = int(rank), int(world)
        self.num_experts = placement[0]
        self.expert_owner = tuple(placement[1]) if placement[1] is not None else None
        self.id = next(_ids)
        self._op_handles = {}  # handle key -> EpHandle, for torch.ops.moefuse.ep_combine
        self._op_keys = itertools.count(1)
        _open[self.id] = self

    # ---------------------------------------------------------------- making one

    @staticmethod
    def unique_id(ctx_or_device=None):
        """A new NCCL unique id, 128 bytes (moefuse_ep_unique_id_create): rank 0 makes it and
        passes it to every rank for EpGroup.create."""
        ctx, owned = context_of(ctx_or_device)
        try:
            made = _capi_ep.UniqueId()
            with ctx._lock:
                ctx.check(_fn("moefuse_ep_unique_id_create")(ctx.handle, ctypes.byref(made)))
            return bytes(made)
        finally:
            if owned:
                ctx.close()

    @classmethod
    def _make(cls, ctx, owned, make, rank, world, placement):
        """The group make(ctx handle, &config, &out) creates; an owned ctx is closed when it
        fails."""
        try:
            config, keep = _config(rank, world, placement)
            out = ctypes.c_void_p()
            with ctx._lock:
                ctx.check(make(ctx.handle, ctypes.byref(config), ctypes.byref(out)))
            del keep  # the group copied the owner array
        except BaseException:
            if owned:
                ctx.close()
            raise
        return cls(ctx, owned, out, rank, world, placement)

    @classmethod
    def create(cls, ctx_or_device, unique_id, rank, world, num_experts, expert_owner=None):
        """Rank `rank` of `world`'s group over NCCL (moefuse_ep_group_create) from the 128-byte
        id rank 0 made (EpGroup.unique_id) and passed to every rank; collective."""
        raw = bytes(unique_id)
        if len(raw) != _capi_ep.UNIQUE_ID_BYTES:
            raise _error("MOEFUSE_ERR_INVALID_ARGUMENT",
                         f"EpGroup.create: unique_id has {len(raw)} bytes; NCCL's id has "
                         f"{_capi_ep.UNIQUE_ID_BYTES}")
        uid = _capi_ep.UniqueId.from_buffer_copy(raw)
        placement = _placement(num_experts, expert_owner)
        create = _fn("moefuse_ep_group_create")
        ctx, owned = context_of(ctx_or_device)
        return cls._make(ctx, owned,
                         lambda c, config, out: create(c, ctypes.byref(uid), config, out),
                         rank, world, placement)

    @classmethod
    def adopt(cls, ctx_or_device, nccl_comm, rank, world, num_experts, expert_owner=None):
        """The group over the caller's communicator (moefuse_ep_group_adopt): nccl_comm is an
        ncclComm_t of `world` ranks on the context's device, as an int address, from the NCCL
        library moefuse loads (libnccl.so.2 or MOEFUSE_NCCL_LIBRARY); the group uses it and
        does not destroy it, so it outlives the group."""
        address = nccl_comm.value if isinstance(nccl_comm, ctypes.c_void_p) else int(nccl_comm)
        comm = ctypes.c_void_p(address or None)
        placement = _placement(num_experts, expert_owner)
        adopt = _fn("moefuse_ep_group_adopt")
        ctx, owned = context_of(ctx_or_device)
        return cls._make(ctx, owned, lambda c, config, out: adopt(c, comm, config, out),
                         rank, world, placement)

    @classmethod
    def from_process_group(cls, ctx_or_device, num_experts, process_group=None,
                           expert_owner=None):
        """This rank's group over NCCL, the ranks and world those of a torch.distributed process
        group (None: the default one): rank 0 makes the unique id and one all_gather on the
        group passes it to every rank (a CUDA tensor when the group's backend is NCCL), then
        every rank makes its group. Collective over the process group; every rank passes the
        same num_experts and expert_owner. A rank that refuses (its arguments, a context that
        has no NCCL) makes every rank raise, the others naming it."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("moefuse EpGroup.from_process_group: torch.distributed is not "
                               "initialized (call torch.distributed.init_process_group first)")
        rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
        if rank < 0:
            raise ValueError("moefuse EpGroup.from_process_group: this process is not a "
                             "member of process_group")
        create = _fn("moefuse_ep_group_create")
        ctx, owned = context_of(ctx_or_device)
        try:
            try:
                placement = _placement(num_experts, expert_owner)
            except Exception as exc:  # every rank must hear of it: raised after the exchange
                placement = exc
            record, own = _ep_pg.local_record(ctx, rank, placement)
            uid = _ep_pg.decide(rank, own, _ep_pg.exchange(record, process_group))
        except BaseException:
            if owned:
                ctx.close()
            raise
        return cls._make(ctx, owned,
                         lambda c, config, out: create(c, ctypes.byref(uid), config, out),
                         rank, world, placement)

    # ---------------------------------------------------------------- state

    def __repr__(self):
        state = "closed" if self._handle is None else f"{self.local_experts()} local experts"
        return (f"<moefuse.EpGroup id {self.id}: rank {self.rank} of {self.world}, "
                f"{self.num_experts} experts, {state}, on {self.ctx!r}>")

    @property
    def handle(self):
        """The moefuse_ep_group pointer (a ctypes.c_void_p) for direct C calls."""
        if self._handle is None:
            raise _error("MOEFUSE_ERR_NULL_POINTER", f"EpGroup {self.id} is closed")
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def local_experts(self):
        """E_local: the number of experts this rank holds (moefuse_ep_local_experts)."""
        return int(_fn("moefuse_ep_local_experts")(self.handle))

    def local_expert_ids(self):
        """The global ids of this rank's experts, ascending: its local experts 0 .. E_local - 1
        (slice the layer's weights with them, e.g. w1[group.local_expert_ids()])."""
        E, W, r = self.num_experts, self.world, self.rank
        if self.expert_owner is None:
            return list(range(r * (E // W), (r + 1) * (E // W)))
        return [g for g, owner in enumerate(self.expert_owner) if owner == r]

    def close(self):
        """Free the group (and the handles torch.ops dispatches left), then an owned context."""
        if self._handle is None:
            return
        for h in list(self._op_handles.values()):
            h.close()
        self._op_handles.clear()
        _open.pop(self.id, None)
        handle, self._handle = self._handle, None
        if self.ctx._handle is not None:
            _fn("moefuse_ep_group_destroy")(handle)
        # else the context was closed first: the group is leaked, not freed through memory
        # that is gone
        if self._owned:
            self.ctx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass

    # ---------------------------------------------------------------- calls

    def dispatch(self, x, topk_ids, topk_weights, recv_x=None, recv_counts=None, *, tmax=None,
                 x_scales=None, recv_scales=None, quantize=False, scale_layout="row_major",
                 ue8m0=None, eps=None, scale_dtype=None, mode="normal", max_tokens=0):
        """Send each valid slot's row x[m] to the rank holding expert topk_ids[m, j]
        (moefuse_ep_dispatch); collective. Returns an EpHandle with the received rows.

        x [M, K] f32/f16/bf16, or f8_e4m3 with x_scales; topk_ids [M, k] i32 (global ids),
        topk_weights [M, k] f32 (kept for combine). recv_x [E_local, Tmax, K], recv_counts
        [E_local] i32 and (FP8 rows: quantize=True, or an f8 x) recv_scales in the 3-D layout
        of scale_layout are written; those not given are allocated like x (zeroed), recv_x
        with `tmax` rows per expert (low-latency mode: world * max_tokens by default).
        mode "normal" or "low_latency" (max_tokens: the most tokens any rank dispatches)."""
        code = mode_code(mode)
        ops = [_tensors.describe(a, n) for a, n in ((x, "x"), (x_scales, "x_scales"),
                                                    (topk_ids, "topk_ids"),
                                                    (topk_weights, "topk_weights"),
                                                    (recv_x, "recv_x"),
                                                    (recv_scales, "recv_scales"),
                                                    (recv_counts, "recv_counts"))]
        xo, xso, io, wo, rxo, rso, rco = ops
        E, K = self.local_experts(), _dims(xo, 2)[1]
        x_dtype = xo.dtype if xo is not None else "f32"  # no x: C names it
        fp8 = bool(quantize) or x_dtype == "f8_e4m3"
        if rxo is None:
            if tmax is None and code == 1 and max_tokens:
                tmax = self.world * int(max_tokens)
            if tmax is None:
                raise TypeError("moefuse EpGroup.dispatch: give recv_x, or tmax (the rows each "
                                "local expert can receive) to allocate it")
            recv_x, rxo = _result(None, "recv_x", xo, (E, int(tmax), K),
                                  "f8_e4m3" if fp8 else x_dtype, zero=True)
        rows = _dims(rxo, 3)[1]
        if fp8 and rso is None:
            recv_scales, rso = _result(
                None, "recv_scales", xo, _options.scales_shape(scale_layout, rows, K, GROUP, E),
                _h_scales_dtype(scale_layout, scale_dtype, xso), zero=True)
        if rco is None:
            recv_counts, rco = _result(None, "recv_counts", xo, (E,), "i32", zero=True)
        opt = dispatch_options(code, quantize, scale_layout, _ue8m0(ue8m0, xso, rso), eps,
                               max_tokens)
        out = ctypes.c_void_p()
        with Call(self.ctx, "ep_dispatch") as call:
            tx, txs = call.tensor(xo), call.tensor(xso)
            trx, trs = call.tensor(rxo, output=True), call.tensor(rso, output=True)
            tc = call.tensor(rco, output=True)
            route = _routing(call, io, wo, None)
            call.run(_fn("moefuse_ep_dispatch"), self.handle, ctypes.byref(tx),
                     _given(txs, xso), ctypes.byref(route), ctypes.byref(trx),
                     _given(trs, rso), ctypes.byref(tc), ctypes.byref(opt), ctypes.byref(out))
        return EpHandle(self, out, recv_x, recv_scales if fp8 else None, recv_counts,
                        _dims(xo, 2)[0], K, _capi_ep.MODES[code])

    def combine(self, handle, y, out=None, *, dtype=None):
        """out [M, K] on the tokens' ranks = the weighted top-k sum of the local experts'
        outputs y [E_local, Tmax, K] (f32/f16/bf16) for the rows `handle`'s dispatch wrote
        (moefuse_ep_combine); collective. out is allocated like y, in dtype (default y's),
        when not given."""
        if not isinstance(handle, EpHandle):
            raise TypeError(f"moefuse EpGroup.combine: handle is the EpHandle dispatch "
                            f"returned, not {type(handle).__name__}")
        yo = _tensors.describe(y, "y")
        out, oo = _result(out, "out", yo, (handle.tokens, handle.model_dim),
                          dtype or (yo.dtype if yo is not None else "f32"))
        with Call(self.ctx, "ep_combine") as call:
            ty, to = call.tensor(yo), call.tensor(oo, output=True)
            call.run(_fn("moefuse_ep_combine"), self.handle, handle.pointer, ctypes.byref(ty),
                     ctypes.byref(to))
        return out

    def moe_forward(self, x, w1, w2, topk_ids, topk_weights, *, b1=None, b2=None,
                    activation="silu", order="gate_first", limit=0.0, dtype=None, out=None,
                    alpha=0.0, up_offset=0.0, n_shared=0, shared_scale=0.0,
                    shared_weights=None):
        """The whole layer over the group (moefuse_ep_moe_forward): this rank's tokens x [M, K]
        and routing (global expert ids), its experts w1 [E_local, 2I, K], w2 [E_local, K, I]
        (shared experts after them), options as moefuse.moe_forward; out [M, K]. Collective."""
        ops = [_tensors.describe(a, n) for a, n in ((x, "x"), (w1, "w1"), (w2, "w2"),
                                                    (b1, "b1"), (b2, "b2"),
                                                    (topk_ids, "topk_ids"),
                                                    (topk_weights, "topk_weights"),
                                                    (shared_weights, "shared_weights"))]
        xo, w1o, w2o, b1o, b2o, io, wto, swo = ops
        out, oo = _result(out, "out", xo, _dims(xo, 2),
                          dtype or (xo.dtype if xo is not None else "f32"))
        opt = _options.moe(activation, order, limit, alpha, up_offset)
        with Call(self.ctx, "ep_moe_forward") as call:
            tx, t1, t2 = call.tensor(xo), call.tensor(w1o), call.tensor(w2o)
            tb1, tb2 = call.tensor(b1o), call.tensor(b2o)
            route = _routing(call, io, wto, None, n_shared, shared_scale, swo)
            to = call.tensor(oo, output=True)
            call.run(_fn("moefuse_ep_moe_forward"), self.handle, ctypes.byref(tx),
                     ctypes.byref(t1), ctypes.byref(t2), _ref(tb1), _ref(tb2),
                     ctypes.byref(route), ctypes.byref(to), ctypes.byref(opt))
        return out

    def moe_forward_fp8(self, x, w1, w1_scales, w2, w2_scales, topk_ids, topk_weights, *,
                        x_scales=None, b1=None, b2=None, activation="silu", order="gate_first",
                        limit=0.0, scale_layout="row_major", ue8m0=None, eps=None, dtype=None,
                        out=None, alpha=0.0, up_offset=0.0, n_shared=0, shared_scale=0.0,
                        shared_weights=None):
        """The whole FP8 layer over the group (moefuse_ep_moe_forward_fp8): operands as
        moefuse.moe_forward_fp8 takes them, this rank's experts only; a float x is quantized
        before it is sent. out [M, K], dtype default x's (bf16 for an f8 x). Collective."""
        ops = [_tensors.describe(a, n) for a, n in (
            (x, "x"), (x_scales, "x_scales"), (w1, "w1"), (w1_scales, "w1_scales"), (w2, "w2"),
            (w2_scales, "w2_scales"), (b1, "b1"), (b2, "b2"), (topk_ids, "topk_ids"),
            (topk_weights, "topk_weights"), (shared_weights, "shared_weights"))]
        xo, xso, w1o, w1so, w2o, w2so, b1o, b2o, io, wto, swo = ops
        out, oo = _result(out, "out", xo, _dims(xo, 2),
                          _out_dtype(dtype, xo.dtype if xo is not None else None))
        opt = _options.fp8_moe(activation, order, limit, scale_layout, _ue8m0(ue8m0, xso), eps,
                               alpha, up_offset)
        with Call(self.ctx, "ep_moe_forward_fp8") as call:
            tx, txs, t1, t1s, t2, t2s, tb1, tb2 = (
                call.tensor(o) for o in (xo, xso, w1o, w1so, w2o, w2so, b1o, b2o))
            route = _routing(call, io, wto, None, n_shared, shared_scale, swo)
            to = call.tensor(oo, output=True)
            call.run(_fn("moefuse_ep_moe_forward_fp8"), self.handle, ctypes.byref(tx),
                     _given(txs, xso), ctypes.byref(t1), ctypes.byref(t1s), ctypes.byref(t2),
                     ctypes.byref(t2s), _ref(tb1), _ref(tb2), ctypes.byref(route),
                     ctypes.byref(to), ctypes.byref(opt))
        return out


class EpHandle:
    """What one EpGroup.dispatch returns: the rows received (recv_x, recv_scales for FP8 rows,
    else None, recv_counts) and the C handle (moefuse_ep_handle) that EpGroup.combine takes.
    `close()` (or a `with` block, or collection) frees the handle. tokens and model_dim are
    the dispatch's M and K; mode its mode."""

    def __init__(self, group, pointer, recv_x, recv_scales, recv_counts, tokens, model_dim,
                 mode):
        self.group = group
        self._pointer = pointer
        self.recv_x, self.recv_scales, self.recv_counts = recv_x, recv_scales, recv_counts
        self.tokens, self.model_dim, self.mode = int(tokens), int(model_dim), mode

    def __repr__(self):
        state = "closed" if self._pointer is None else f"{self.tokens} tokens"
        return f"<moefuse.EpHandle of EpGroup {self.group.id}: {self.mode}, {state}>"

    @property
    def pointer(self):
        """The moefuse_ep_handle pointer (a ctypes.c_void_p)."""
        if self._pointer is None:
            raise _error("MOEFUSE_ERR_NULL_POINTER", "the EpHandle is closed")
        return self._pointer

    def close(self):
        if self._pointer is not None:
            pointer, self._pointer = self._pointer, None
            _fn("moefuse_ep_handle_destroy")(pointer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
