"""The compiled fast path (moefuse._fastcall) against the ctypes path it stands in for.

Every case runs once through the fast path, checked to have been taken (its call counter moves),
and once with it switched off, through ctypes: the results must be the same bits, and failed
calls must raise the same class with the same message. CUDA cases run where there is a device
and the cuda backend; the CPU ones everywhere torch is installed. Skipped without torch.
"""

import os
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="the fast path reads torch tensors; no torch here")

import moefuse  # noqa: E402
from moefuse import _fast  # noqa: E402


FP8 = torch.float8_e4m3fn


from torch_devices import DEVICES, cuda_ready as _cuda_ready  # noqa: E402


@pytest.fixture(autouse=True)
def fast_path():
    """Needs the extension; leaves the switch as it found it."""
    if _fast.call is None:
        pytest.skip(f"the fast path is not available: {_fast.problem}")
    was = _fast.set_enabled(True)
    yield
    _fast.set_enabled(was)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def randn(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def ids_for(gen, M, k, E, device, low=0):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]) if M else \
        torch.empty(0, k, dtype=torch.int64)
    if low < 0:  # some invalid ids
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.2, torch.full_like(ids, low),
                          ids)
    return ids.to(torch.int32).to(device)


def bits(t):
    """The tensor's bytes as integers (FP8 NaN codes compare equal, -0.0 differs from 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def both_paths(run, calls=1):
    """run() through the fast path (checked to take its `calls` calls) and through ctypes."""
    before = _fast.call.calls()
    fast = run()
    assert _fast.call.calls() - before == calls, "the fast path did not take the call"
    _fast.set_enabled(False)
    try:
        slow = run()
    finally:
        _fast.set_enabled(True)
    assert _fast.call.calls() - before == calls, "the ctypes path went through the fast path"
    return fast, slow


def assert_same(fast, slow):
    fast = fast if isinstance(fast, tuple) else (fast,)
    slow = slow if isinstance(slow, tuple) else (slow,)
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        assert a.device == b.device and a.stride() == b.stride()
        assert torch.equal(bits(a), bits(b))


# Each case: (name, build(gen, device) -> run), run() making fresh results each time.

def _topk(M, E, k, dtype, renormalize, given=False):
    def build(gen, device):
        logits = randn(gen, (M, E + 8), dtype, device, 2.0)[:, 8:]  # padded rows, in place
        if not given:
            return lambda: moefuse.topk_softmax(logits, k, renormalize=renormalize)

        def run():
            ids = torch.full((M, k), -7, dtype=torch.int32, device=device)
            weights = torch.full((M, k + 3), -1.0, device=device)[:, :k]
            return moefuse.topk_softmax(logits, ids=ids, weights=weights)
        return run
    return build


def _act_quant(T, H, x_dtype, given=False, **options):
    def build(gen, device):
        x = randn(gen, (T, 2 * H), x_dtype, device, 3.0)
        rs = (torch.rand(T, generator=gen) + 0.5).to(device) if given else None
        if not given:
            return lambda: moefuse.act_quant(x, **options)
        q0, s0 = moefuse.act_quant(x, row_scale=rs, **options)  # the results' dtypes and shapes

        def run():
            q = torch.zeros(T, H + 32, dtype=torch.uint8, device=device).view(q0.dtype)
            return moefuse.act_quant(x, row_scale=rs, out=q[:, 16:16 + H],
                                     scales=torch.full_like(s0, 3), **options)
        return run
    return build


def _masked(zero_tail, given):
    def build(gen, device):
        E, Tmax, H = 6, 20, 256
        x = randn(gen, (E, Tmax, 2 * H), torch.bfloat16, device, 2.0)
        counts = torch.tensor([0, 20, 5, 31, -2, 13], dtype=torch.int32, device=device)
        es = (torch.rand(E, generator=gen) + 0.5).to(torch.bfloat16).to(device)
        rs = (torch.rand(E, Tmax, generator=gen) + 0.5).to(device)
        options = dict(row_scale=rs, expert_scale=es, zero_tail=zero_tail, group_size=64,
                       scale_layout="column_major")
        if not given:
            return lambda: moefuse.act_quant_masked(x, counts, **options)

        def run():
            q = torch.full((E, Tmax, H), 0x33, dtype=torch.uint8, device=device).view(FP8)
            s = torch.full((E, H // 64, Tmax), -1.0, device=device)
            return moefuse.act_quant_masked(x, counts, out=q, scales=s, **options)
        return run
    return build


def _act_mul(dtype, given, **options):
    def build(gen, device):
        x = randn(gen, (19, 2 * 384), dtype, device, 2.0)
        rs = (torch.rand(19, generator=gen) + 0.5).to(device)
        if not given:
            return lambda: moefuse.act_mul(x, row_scale=rs, **options)
        return lambda: moefuse.act_mul(x, out=torch.full((19, 384), 5.0, dtype=dtype,
                                                         device=device), **options)
    return build


def _quant_dequant(dtype, **options):
    def build(gen, device):
        x = randn(gen, (23, 1024), torch.bfloat16, device, 30.0)

        def run():
            q, s = moefuse.quant(x, dtype=dtype, **options)
            return q, s, moefuse.dequant(q, s, dtype="bf16", scale_layout=options.get(
                "scale_layout", "row_major"))
        return run
    return build


def _quant_once(**options):
    def build(gen, device):
        x = randn(gen, (9, 512), torch.float32, device, 5.0)
        return lambda: moefuse.quant(x, **options)
    return build


def _dequant_once(quant_options, **options):
    def build(gen, device):
        q, s = moefuse.quant(randn(gen, (9, 512), torch.float32, device, 5.0), **quant_options)
        return lambda: moefuse.dequant(q, s, **options)
    return build


def _moe(M, op, given=False, parameters=False):
    def build(gen, device):
        K, I, E, k, E_global = 128, 64, 6, 2, 9
        x = randn(gen, (M, K), torch.bfloat16, device)
        w1 = randn(gen, (E, 2 * I, K), torch.bfloat16, device, 0.1)
        w2 = randn(gen, (E, K, I), torch.bfloat16, device, 0.1)
        if parameters:  # nn.Parameter weights, as in a module
            w1, w2 = torch.nn.Parameter(w1, False), torch.nn.Parameter(w2, False)
        b1 = randn(gen, (E, 2 * I), torch.bfloat16, device)
        b2 = randn(gen, (E, K), torch.float32, device)
        emap = torch.tensor([3, -1, 0, 5, -1, 1, 2, -1, 4], dtype=torch.int32, device=device)
        ids = ids_for(gen, M, k, E_global, device, low=-1)
        weights = torch.rand(M, k, generator=gen).to(device)
        h = moefuse.moe_gate(x, w1, ids, b1=b1, expert_map=emap)
        runs = {
            "gate": lambda: moefuse.moe_gate(x, w1, ids, b1=b1, expert_map=emap, limit=5.0,
                                             activation="gelu", dtype="f32"),
            "final": lambda: moefuse.moe_final(h, w2, ids, weights, b2=b2, expert_map=emap),
            "final_unreduced": lambda: moefuse.moe_final(h, w2, ids, b2=b2, expert_map=emap,
                                                         reduce=False),
            "forward": lambda: moefuse.moe_forward(
                x, w1, w2, ids, weights, b1=b1, b2=b2, expert_map=emap,
                out=torch.full((M, K), 9.0, dtype=torch.bfloat16, device=device)
                if given else None),
        }
        return runs[op]
    return build


CASES = {
    "topk_softmax": _topk(50, 64, 6, torch.bfloat16, False),
    "topk_softmax_renormalized_given": _topk(33, 128, 8, torch.float32, True, given=True),
    "topk_softmax_no_tokens": _topk(0, 64, 4, torch.float32, False),
    "act_quant": _act_quant(67, 1024, torch.bfloat16),
    "act_quant_given_gelu_column_ue8m0_u8": _act_quant(
        40, 512, torch.bfloat16, given=True, activation="gelu", group_size=64,
        scale_layout="column_major", ue8m0=True, scale_dtype="u8"),
    "act_quant_packed_f16_bf16_intermediate": _act_quant(
        13, 1024, torch.float16, scale_layout="packed_ue8m0", ue8m0=True, intermediate="bf16",
        limit=7.0, order="up_first"),
    "act_quant_i8_f32_raw_enums": _act_quant(9, 256, torch.float32, dtype="i8", activation=2,
                                             scale_layout=1, eps=1e-4),
    "act_quant_no_tokens": _act_quant(0, 512, torch.bfloat16),
    "act_quant_masked": _masked(False, False),
    "act_quant_masked_given_zero_tail": _masked(True, True),
    "act_mul_f16_gelu_tanh": _act_mul(torch.float16, False, activation="gelu_tanh"),
    "act_mul_given_f32_limit": _act_mul(torch.float32, True, limit=1.5),
    "quant_dequant_fp8": _quant_dequant("f8_e4m3"),
    "quant_dequant_i8_column": _quant_dequant("i8", scale_layout="column_major"),
    "quant_ue8m0_u8": _quant_once(ue8m0=True, scale_dtype="u8", group_size=32),
    # ue8m0=None (the default) means "when the scales are u8"
    "dequant_u8_scales": _dequant_once(dict(ue8m0=True, scale_dtype="u8")),
    "dequant_packed": _dequant_once(dict(scale_layout="packed_ue8m0"),
                                    scale_layout="packed_ue8m0", ue8m0=True, dtype="f16"),
    "moe_gate": _moe(37, "gate"),
    "moe_final": _moe(37, "final"),
    "moe_final_unreduced": _moe(37, "final_unreduced"),
    "moe_forward_parameters": _moe(5, "forward", parameters=True),
    "moe_forward_given": _moe(21, "forward", given=True),
    "moe_forward_no_tokens": _moe(0, "forward"),
}


@pytest.mark.parametrize("case", CASES)
def test_same_bits_as_the_ctypes_path(device, case):
    gen = torch.Generator().manual_seed(sum(case.encode()))
    run = CASES[case](gen, device)
    fast, slow = both_paths(run, calls=2 if case.startswith("quant_dequant") else 1)
    assert_same(fast, slow)
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- errors

def _raised(run):
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - the exception itself is what is compared
        return exc
    pytest.fail("no exception")


# (name, build(device) -> run, whether the fast path takes the call: library errors come from
# the fast path, the binding's own checks from the ctypes path after the fast path declines)
def _x(device, shape=(3, 512), dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=device)


def _closed():
    ctx = moefuse.Context("cpu")
    ctx.close()
    return ctx


ERRORS = {
    "shape": (lambda d: lambda: moefuse.act_quant(
        _x(d), out=torch.zeros(3, 255, dtype=torch.uint8, device=d).view(FP8)), True),
    "group_size": (lambda d: lambda: moefuse.act_quant(_x(d), group_size=48), True),
    "i8_ue8m0": (lambda d: lambda: moefuse.act_quant(_x(d), dtype="i8", ue8m0=True), True),
    "u8_scales_without_ue8m0": (lambda d: lambda: moefuse.quant(_x(d), scale_dtype="u8"), True),
    "q_dtype": (lambda d: lambda: moefuse.act_quant(_x(d), dtype="bf16"), True),
    "negative_limit": (lambda d: lambda: moefuse.act_mul(_x(d), limit=-1.0), True),
    "stride": (lambda d: lambda: moefuse.act_mul(_x(d, (4, 1024))[:, ::2]), True),
    "topk_k_above_E": (lambda d: lambda: moefuse.topk_softmax(_x(d, (2, 4)), 8), True),
    "moe_ids_dtype": (lambda d: lambda: moefuse.moe_forward(
        _x(d, (2, 64)), _x(d, (4, 64, 64)), _x(d, (4, 64, 32)),
        torch.zeros(2, 2, device=d), torch.zeros(2, 2, device=d)), True),
    "dequant_without_scales": (lambda d: lambda: moefuse.dequant(
        torch.zeros(2, 256, dtype=torch.uint8, device=d).view(FP8), None), True),
    "unknown_activation": (lambda d: lambda: moefuse.act_mul(_x(d), activation="swish"), False),
    "unknown_layout": (lambda d: lambda: moefuse.quant(_x(d), scale_layout="col"), False),
    "unknown_dtype_name": (lambda d: lambda: moefuse.act_quant(_x(d), dtype="f4"), False),
    "float64_tensor": (lambda d: lambda: moefuse.act_mul(_x(d, dtype=torch.float64)), False),
    "numpy_output": (lambda d: lambda: moefuse.act_mul(_x(d), out=__import__("numpy").zeros(
        (3, 255), "float32")), False),
    "bad_ctx": (lambda d: lambda: moefuse.act_mul(_x(d), ctx=42), False),
    "closed_context": (lambda d: lambda: moefuse.act_mul(_x(d), ctx=_closed()), False),
    "topk_without_k_or_ids": (lambda d: lambda: moefuse.topk_softmax(_x(d, (2, 8))), False),
}


@pytest.mark.parametrize("case", ERRORS)
def test_same_errors_as_the_ctypes_path(device, case):
    build, taken = ERRORS[case]
    if case == "numpy_output" and device.type == "cuda":
        pytest.skip("a host output of a CUDA call is staged, not refused")
    before = _fast.call.calls()
    fast = _raised(build(device))
    assert _fast.call.calls() - before == int(taken)
    _fast.set_enabled(False)
    try:
        slow = _raised(build(device))
    finally:
        _fast.set_enabled(True)
    assert type(fast) is type(slow) and str(fast) == str(slow)
    if isinstance(fast, moefuse.Error):
        assert (fast.status, fast.code, fast.message) == (slow.status, slow.code, slow.message)


def test_unbuilt_backend_raises_as_the_ctypes_path():
    if "cuda" in moefuse.built_backends():
        pytest.skip("the cuda backend is built")
    fast = _raised(lambda: moefuse.act_mul(_x("cpu"), ctx="cuda"))
    _fast.set_enabled(False)
    try:
        slow = _raised(lambda: moefuse.act_mul(_x("cpu"), ctx="cuda"))
    finally:
        _fast.set_enabled(True)
    assert isinstance(fast, moefuse.BackendUnavailableError)
    assert type(fast) is type(slow) and str(fast) == str(slow)


# ---------------------------------------------------------------- what it takes, and how

def test_other_operands_take_the_ctypes_path():
    """A numpy operand beside a torch one, a tensor subclass: ctypes, with the same result."""
    np = pytest.importorskip("numpy")
    x = torch.randn(4, 512)

    class Sub(torch.Tensor):
        pass

    want = moefuse.act_mul(x)
    before = _fast.call.calls()
    out = np.zeros((4, 256), np.float32)
    moefuse.act_mul(x, out=out)
    got_sub = moefuse.act_mul(x.as_subclass(Sub))
    assert _fast.call.calls() == before
    assert torch.equal(torch.from_numpy(out), want) and torch.equal(got_sub, want)


def test_switched_off_nothing_goes_through_it(device):
    x = torch.randn(4, 512, device=device)
    assert _fast.active()
    _fast.set_enabled(False)
    try:
        assert not _fast.active()
        before = _fast.call.calls()
        moefuse.act_quant(x)
        moefuse.topk_softmax(x, 2)
        assert _fast.call.calls() == before
    finally:
        _fast.set_enabled(True)


def test_environment_switch_turns_it_off():
    code = ("import torch, moefuse; from moefuse import _fast; "
            "moefuse.act_mul(torch.zeros(2, 256)); "
            "print(_fast.active(), _fast.call is not None and _fast.call.calls())")
    where = os.path.dirname(os.path.dirname(os.path.abspath(moefuse.__file__)))
    path = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))
    outputs = []
    for switch in ("0", "1"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": path, _fast.SWITCH: switch})
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout.split())
    assert outputs == [["False", "0"], ["True", "1"]]


def test_torch_imported_after_moefuse_is_bound_on_first_sight():
    code = ("import moefuse; from moefuse import _fast; assert not _fast.TENSORS; "
            "import torch; moefuse.act_mul(torch.zeros(2, 256)); print(_fast.call.calls())")
    where = os.path.dirname(os.path.dirname(os.path.abspath(moefuse.__file__)))
    path = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1"]


def test_calls_hold_the_context_lock():
    """One call at a time per Context from Python threads: a fast call waits for the lock."""
    ctx = moefuse.Context("cpu")
    x = torch.randn(8, 512)
    done = threading.Event()
    ctx._lock.acquire()
    try:
        worker = threading.Thread(target=lambda: (moefuse.act_mul(x, ctx=ctx), done.set()))
        worker.start()
        assert not done.wait(0.3), "the call ran while another thread held the context's lock"
    finally:
        ctx._lock.release()
    worker.join(30)
    assert done.is_set()
    ctx.close()


def test_the_gil_is_released_during_the_library_call():
    """As ctypes does: other Python threads run while the C library works. A thread notes the
    time every half millisecond; with the GIL held through the call it could note none in it."""
    gen = torch.Generator().manual_seed(1)
    M, K, I, E, k = 256, 1024, 512, 8, 4
    x = torch.randn(M, K, generator=gen)
    w1 = torch.randn(E, 2 * I, K, generator=gen) * 0.05
    w2 = torch.randn(E, K, I, generator=gen) * 0.05
    ids = ids_for(gen, M, k, E, "cpu")
    weights = torch.rand(M, k, generator=gen)
    out = moefuse.moe_forward(x, w1, w2, ids, weights)  # warm: scratch allocated
    seen, stop = [], threading.Event()

    def note():
        while not stop.is_set():
            now = time.perf_counter()
            if not seen or now - seen[-1] > 5e-4:
                seen.append(now)
    noter = threading.Thread(target=note)
    noter.start()
    try:
        time.sleep(0.02)
        before = _fast.call.calls()
        t0 = time.perf_counter()
        moefuse.moe_forward(x, w1, w2, ids, weights, out=out)  # no allocation, no torch call
        t1 = time.perf_counter()
    finally:
        stop.set()
        noter.join()
    assert _fast.call.calls() - before == 1
    if t1 - t0 < 0.02:
        pytest.skip(f"the call took {(t1 - t0) * 1e3:.1f} ms: too short to tell")
    middle = [t for t in seen if t0 + 0.2 * (t1 - t0) < t < t1 - 0.2 * (t1 - t0)]
    assert middle, f"no other thread ran in the middle of a {(t1 - t0) * 1e3:.0f} ms call"


# ---------------------------------------------------------------- CUDA specifics


@pytest.fixture
def cuda():
    if not _cuda_ready():
        pytest.skip("needs a CUDA device and the cuda backend")
    return torch.device("cuda")


def test_fast_path_attaches_torchs_current_stream(cuda):
    x = torch.randn(64, 1024, device=cuda, dtype=torch.bfloat16)
    ctx = moefuse.default_context("cuda", torch.cuda.current_device())
    before = _fast.call.calls()
    moefuse.act_mul(x)
    legacy = torch.cuda.current_stream().cuda_stream == 0
    assert ctx.stream == (1 if legacy else torch.cuda.current_stream().cuda_stream)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2
        out = moefuse.act_mul(y)
        assert ctx.stream == side.cuda_stream
    ctx.set_stream(None)  # set from Python: the next fast call must attach torch's stream again
    moefuse.act_mul(x)
    assert ctx.stream == (1 if legacy else torch.cuda.current_stream().cuda_stream)
    assert _fast.call.calls() - before == 3
    _fast.set_enabled(False)
    try:
        with torch.cuda.stream(side):
            slow = moefuse.act_mul(y)
    finally:
        _fast.set_enabled(True)
    side.synchronize()
    assert torch.equal(bits(out), bits(slow))


def test_cuda_tensors_on_the_cpu_backend_are_left_to_ctypes(cuda):
    before = _fast.call.calls()
    with pytest.raises(moefuse.WrongDeviceError, match="x is CUDA memory but the context's "
                                                       "backend is cpu"):
        moefuse.act_mul(torch.zeros(4, 256, device=cuda), ctx="cpu")
    assert _fast.call.calls() == before


def test_fast_path_runs_on_the_tensors_device(cuda):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    x = torch.randn(16, 1024, device="cuda:1")
    with torch.cuda.device(0):
        before = _fast.call.calls()
        out = moefuse.act_mul(x)
        assert torch.cuda.current_device() == 0, "the previous device was not made current"
        assert _fast.call.calls() - before == 1
        assert out.device == x.device
    _fast.set_enabled(False)
    try:
        with torch.cuda.device(0):
            slow = moefuse.act_mul(x)
    finally:
        _fast.set_enabled(True)
    torch.cuda.synchronize(1)
    assert torch.equal(out, slow)


# ---------------------------------------------------------------- CUDA logic, without a GPU

class StandInCudaTensor:
    """What the fast path reads of a CUDA tensor on device `index`, over a CPU tensor's memory."""

    is_cuda, is_cpu = True, False

    def __init__(self, t, index):
        self.t, self.index, self.dtype, self.shape = t, index, t.dtype, t.shape

    def get_device(self):
        return self.index

    def data_ptr(self):
        return self.t.data_ptr()

    def stride(self):
        return self.t.stride()


@pytest.fixture
def stand_in_cuda():
    """The fast path bound to StandInCudaTensor and to stand-ins of torch's device and stream
    functions that log their calls; a cpu context that says it is "cuda" (so the library
    refuses any stream but runs the call on host memory). Rebinds torch afterwards."""
    from moefuse import _capi, _dtypes
    state = {"device": 0, "log": [], "fail_set": None}

    def get_device():
        state["log"].append("get")
        return state["device"]

    def set_device(index):
        state["log"].append(("set", index))
        if state["fail_set"] == index:
            raise RuntimeError(f"stand-in: cannot set device {index}")
        state["device"] = index

    def raw_stream(index):
        state["log"].append(("stream", index))
        return 0  # torch's default stream: the legacy stream, handle 1 for moefuse

    dtypes = tuple(getattr(torch, _dtypes._TORCH[name]) for name in _capi.DTYPE_NAMES)
    _fast._bind_torch(torch)  # now, or a first torch tensor would bind it over the stand-ins
    _fast.call.bind_torch((StandInCudaTensor,), dtypes, get_device, set_device, raw_stream)
    ctx = moefuse.Context("cpu")
    ctx.backend = "cuda"
    try:
        yield state, ctx
    finally:
        ctx.close()
        _fast._bind_torch(torch)


def _lock_is_free(ctx):
    """Whether another thread can take the context's lock (an RLock: this one always could)."""
    free = []

    def take():
        free.append(ctx._lock.acquire(timeout=5))
        if free[0]:
            ctx._lock.release()
    t = threading.Thread(target=take)
    t.start()
    t.join()
    return free[0]


def _stand_in_act_mul(ctx, x, out):
    return _fast.call.act_mul(ctx, StandInCudaTensor(x, 1), None, StandInCudaTensor(out, 1),
                              "silu", "gate_first", 0.0, None, 0.0, 0.0)


def test_cuda_device_is_switched_for_the_call_and_back(stand_in_cuda):
    state, ctx = stand_in_cuda
    x, out = torch.randn(4, 512), torch.zeros(4, 256)
    ctx._stream = 1  # as if torch's legacy stream were attached: no moefuse_set_stream
    assert _stand_in_act_mul(ctx, x, out) is True
    assert state["log"] == ["get", ("set", 1), ("stream", 1), ("set", 0)]
    assert torch.equal(out, moefuse.act_mul(x))
    state["log"].clear()
    state["device"] = 1  # already current: no switch
    assert _stand_in_act_mul(ctx, x, out) is True
    assert state["log"] == ["get", ("stream", 1)]
    assert _lock_is_free(ctx)


def test_cuda_stream_refused_raises_the_library_error_and_cleans_up(stand_in_cuda):
    state, ctx = stand_in_cuda
    x, out = torch.randn(4, 512), torch.zeros(4, 256)
    with pytest.raises(moefuse.UnsupportedError) as info:
        _stand_in_act_mul(ctx, x, out)  # ctx._stream is None: the legacy stream is set
    with pytest.raises(moefuse.UnsupportedError) as ctypes_info:
        ctx.set_stream(1)  # what the ctypes path raises for it
    assert str(info.value) == str(ctypes_info.value)
    assert state["log"] == ["get", ("set", 1), ("stream", 1), ("set", 0)]
    assert ctx._stream is None and _lock_is_free(ctx) and not torch.any(out)


def test_cuda_call_failure_restores_the_device(stand_in_cuda):
    state, ctx = stand_in_cuda
    ctx._stream = 1
    with pytest.raises(moefuse.ShapeError, match="out"):
        _stand_in_act_mul(ctx, torch.randn(4, 512), torch.zeros(4, 255))
    assert state["log"][-1] == ("set", 0) and state["device"] == 0 and _lock_is_free(ctx)


def test_cuda_device_that_cannot_be_set(stand_in_cuda):
    state, ctx = stand_in_cuda
    ctx._stream = 1
    x, out = torch.randn(4, 512), torch.zeros(4, 256)
    state["fail_set"] = 1  # switching to the tensors' device fails: nothing runs
    with pytest.raises(RuntimeError, match="cannot set device 1"):
        _stand_in_act_mul(ctx, x, out)
    assert not torch.any(out) and _lock_is_free(ctx)
    state.update(fail_set=0, device=0)  # the call runs; making device 0 current again fails
    with pytest.raises(RuntimeError, match="cannot set device 0"):
        _stand_in_act_mul(ctx, x, out)
    assert torch.equal(out, moefuse.act_mul(x)) and _lock_is_free(ctx)


def test_cuda_operands_on_two_devices_are_left_to_ctypes(stand_in_cuda):
    state, ctx = stand_in_cuda
    x, out = torch.randn(4, 512), torch.zeros(4, 256)
    taken = _fast.call.act_mul(ctx, StandInCudaTensor(x, 0), None, StandInCudaTensor(out, 1),
                               "silu", "gate_first", 0.0, None, 0.0, 0.0)
    assert taken is False and state["log"] == [] and _lock_is_free(ctx)
