#!/usr/bin/env python3
"""moefuse next to PyTorch on one CUDA device, all in one process, one table.

For the shapes of docs/PERFORMANCE.md, times moefuse (CUDA backend on torch tensors,
OpenCL backend on moefuse.Buffers), PyTorch eager and torch.compile of the same
reference (bench/torch_reference.py), and torch._grouped_mm for the MoE layer; checks
every result against the reference; and sets each time next to ceilings measured in
this run: the device-to-device copy bandwidth (torch copy_ of 1 GiB) and, for the MoE
layer, the dense bf16 GEMM of the same FLOPs (torch.matmul).

    python3 bench/compare_torch.py [--quick] [--ops act_quant,moe_forward] [--models qwen3]
    MOEFUSE_LIBRARY=build/src/libmoefuse.so python3 bench/compare_torch.py   # without pip

Times are per call: the median over samples of back-to-back calls (ten, or fewer when
one call takes over BATCH_SECONDS), --seconds of samples after warm-up, each sample
timed with CUDA events on torch's current stream (host clock plus synchronize for
OpenCL). Where Python's per-call overhead exceeds the device time, the figure is that
overhead: what a caller without CUDA graphs gets; the "moefuse cuda, CUDA graph" rows
replay the same call captured in a graph, which leaves the device time. Implementations run one at a time:
the device is drained (torch's stream and the OpenCL queue, which on an NVIDIA
OpenCL platform shares the GPU) before each is timed.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # torch_reference
if os.environ.get("MOEFUSE_LIBRARY"):  # a build tree: the binding from the same tree
    sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

import moefuse  # noqa: E402
import torch_reference as tref  # noqa: E402

BF16 = torch.bfloat16
DEV = "cuda"   # --smoke: "cpu", to try the script where there is no GPU
SHRINK = 1     # --smoke: token and expert counts divided by this
NARROW = 1     # --smoke: widths (H, K, I) divided by this
MODELS = {  # E experts, k per token, K model width, I expert width
    "mixtral": dict(name="Mixtral-8x7B", E=8, k=2, K=4096, I=14336),
    "qwen3": dict(name="Qwen3-30B-A3B", E=128, k=8, K=2048, I=768),
    "deepseek": dict(name="DeepSeek-V3", E=256, k=8, K=7168, I=2048),
}
M_ALL = (1, 32, 512, 4096)
ROW_OPS = ("act_quant", "act_quant_masked", "quant", "act_mul", "topk_softmax")
QUICK = dict(ops=("act_quant", "act_quant_masked", "moe_forward"), models=("qwen3", "mixtral"),
             M=(32, 512))


# ------------------------------------------------------------------ timing


BATCH = 10              # calls per sample, as `moefuse bench --batch 10`
BATCH_SECONDS = 2e-3    # a call this long is timed alone: its launch cost is noise


def _batch(first):
    return max(1, min(BATCH, round(BATCH_SECONDS / max(first, 1e-9))))


def timed_cuda(fn, seconds, warmup=2):
    """Median seconds per call over samples of back-to-back calls, CUDA events around each."""
    if DEV != "cuda":
        return timed_host(fn, lambda: None, seconds, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()

    def sample(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n

    n = _batch(sample(1))
    runs = max(5, min(100, int(seconds / max(sample(n) * n, 1e-6))))
    return statistics.median(sample(n) for _ in range(runs))


def timed_host(fn, sync, seconds, warmup=2):
    """Median seconds per call over samples of back-to-back fn() then one sync(), host clock
    (OpenCL work is not on torch's stream)."""
    for _ in range(warmup):
        fn()
    sync()

    def sample(n):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t) / n

    n = _batch(sample(1))
    runs = max(5, min(100, int(seconds / max(sample(n) * n, 1e-6))))
    return statistics.median(sample(n) for _ in range(runs))


# ------------------------------------------------------------------ ceilings


def copy_bandwidth():
    """Bytes read + written per second by a 1 GiB device-to-device copy_, best of 5."""
    n = (1 << 30) // SHRINK
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed_cuda(lambda: dst.copy_(src), 0.0, warmup=1) for _ in range(5))
    return 2 * n / best


def gemm_rate(m, k, n, dtype=BF16):
    """FLOP/s of torch.matmul [m, k] x [k, n] (median)."""
    a = torch.randn(m, k, device=DEV).to(dtype)
    b = torch.randn(k, n, device=DEV).to(dtype)
    t = timed_cuda(lambda: torch.matmul(a, b), 0.2)
    return 2 * m * k * n / t


def _empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ checks


def check_codes(q, s, q_ref, s_ref):
    """docs/NUMERICS.md, "Agreement between backends": codes equal or one apart on at most 0.01%, never a sign flip; scales
    within a few ulp (torch's silu is x * sigmoid(x), moefuse's g / (1 + e^-g))."""
    a, b = q.view(torch.uint8).int(), q_ref.view(torch.uint8).int()
    diff = ((a & 0x7F) - (b & 0x7F)).abs()
    flips = (((a ^ b) & 0x80) != 0) & (((a | b) & 0x7F) != 0)
    off = (diff != 0).float().mean().item()
    srel = ((s.float() - s_ref.float()).abs() / s_ref.float().abs().clamp(min=1e-30)).max().item()
    ok = diff.max().item() <= 1 and off <= 1e-4 and not flips.any().item() and srel <= 1e-6
    return ok, f"codes {off:.4%} off by 1, scales {srel:.1e}"


def check_close(out, ref, mantissa_bits=7):
    """Elementwise within one ulp of the output dtype (bf16: 7 stored mantissa bits)."""
    ref = ref.float()
    _, exponent = torch.frexp(ref)  # ref = m * 2^exponent, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(ref), exponent - 1 - mantissa_bits)
    err = ((out.float() - ref).abs() / ulp).max().item()
    return err <= 1.0, f"{err:.2f} ulp"


def check_rel(out, ref, tol=8e-3):
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    return rel <= tol, f"rel {rel:.1e}"


def check_topk(ids, w, ids_ref, w_ref):
    same = (ids.long() == ids_ref.long()).float().mean().item()
    werr = (w - w_ref).abs().max().item()
    return same >= 0.999 and werr <= 1e-5, f"ids {same:.3%} equal, weights {werr:.1e}"


# ------------------------------------------------------------------ the table


class Table:
    def __init__(self, copy_bw):
        self.rows = []
        self.copy_bw = copy_bw

    def add(self, op, shape, impl, seconds=None, work=None, kind="bytes", floor=None,
            check=None, note=None):
        row = dict(op=op, shape=shape, impl=impl, seconds=seconds, work=work, kind=kind,
                   floor=floor, check=check, note=note)
        self.rows.append(row)
        print(self.format(row), flush=True)

    def _eager(self, row):
        for r in self.rows:
            if r["op"] == row["op"] and r["shape"] == row["shape"] and \
                    r["impl"] == "torch eager" and r["seconds"]:
                return r["seconds"]
        return None

    def format(self, row):
        if row["seconds"] is None:
            return f"| {row['op']} | {row['shape']} | {row['impl']} | {row['note']} | | | | | |"
        t = row["seconds"]
        if row["kind"] == "bytes":
            rate = row["work"] / t
            figure, ceiling = f"{_3(rate / 1e9)} GB/s", f"copy {_3(self.copy_bw / 1e9)} GB/s"
            ratio = rate / self.copy_bw
        else:
            figure, ceiling = f"{_3(row['work'] / t / 1e12)} TFLOP/s", \
                f"floor {_ms(row['floor'])}"
            ratio = row["floor"] / t
        eager = self._eager(row)
        speedup = f"{eager / t:.2f}x" if eager else ""
        ok, text = row["check"] if row["check"] else (True, "")
        mark = "" if not row["check"] else ("ok, " if ok else "FAIL, ")
        return (f"| {row['op']} | {row['shape']} | {row['impl']} | {_ms(t)} | {figure} | "
                f"{ceiling} | {ratio:.1%} | {speedup} | {mark}{text} |")

    HEADER = ("| op | shape | implementation | median | figure | ceiling | of ceiling | "
              "vs eager | vs reference |\n| --- | --- | --- | ---: | ---: | ---: | ---: | ---: "
              "| --- |")

    def markdown(self):
        return "\n".join([self.HEADER] + [self.format(r) for r in self.rows])


def _3(value):
    """Three significant digits, without exponents."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _ms(seconds):
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"


# ------------------------------------------------------------------ runners


class Runner:
    def __init__(self, args, table):
        self.args = args
        self.table = table
        self.cl = None
        if "opencl" in args.backends:
            try:
                self.cl = moefuse.Context("opencl")
            except moefuse.Error as exc:
                print(f"(no OpenCL rows: {exc})")

    def _try(self, op, shape, impl, run):
        """run() -> (seconds, check); failures become a row that says so."""
        try:
            return run()
        except Exception as exc:  # one failing implementation must not end the run
            self.table.add(op, shape, impl, note=f"failed: {type(exc).__name__}: "
                                                  f"{str(exc).splitlines()[0][:120]}")
            return None

    def compare(self, op, shape, work, kind, ref_out, check, impls, floor=None):
        """impls: name -> (call, result getter or None, host sync or None)."""
        for name, (call, result, sync) in impls.items():
            self.drain()  # the last implementation's work must not overlap this one's

            def run():
                t = (timed_host(call, sync, self.args.seconds) if sync
                     else timed_cuda(call, self.args.seconds))
                got = result() if result else call()
                return t, check(got, ref_out)
            done = self._try(op, shape, name, run)
            if done:
                self.table.add(op, shape, name, done[0], work, kind, floor, done[1])

    def drain(self):
        if DEV == "cuda":
            torch.cuda.synchronize()
        if self.cl:
            self.cl.synchronize()

    @staticmethod
    def graphed(call):
        """call() captured in a CUDA graph (after a warm-up call): replays time the device
        work alone, without Python's per-call cost. Same outputs, as call writes into out=."""
        state = {}

        def replay():
            if "graph" not in state:
                state["result"] = call()  # the out= tensors the replays write
                torch.cuda.synchronize()
                state["graph"] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(state["graph"]):
                    call()
            state["graph"].replay()
            return state["result"]
        return replay

    def torch_rows(self, impls, ref, *args):
        """The "torch eager" and (unless --no-compile) "torch.compile" rows: ref(*args)."""
        impls["torch eager"] = (lambda: ref(*args), None, None)
        c = self.compiled(ref)
        if c:
            impls["torch.compile"] = (lambda: c(*args), None, None)

    def compiled(self, fn):
        return torch.compile(fn) if self.args.compile else None

    def cl_buffers(self, *tensors):
        return [moefuse.Buffer.from_array(t.cpu(), self.cl) for t in tensors]

    def moefuse_impls(self, op, shape, cuda_call, opencl_setup):
        """The moefuse rows: cuda_call() on torch tensors; opencl_setup() uploads the inputs
        to Buffers and returns (call, result getter)."""
        impls = {}
        if "cuda" in self.args.backends:
            impls["moefuse cuda"] = (cuda_call, None, None)
            if DEV == "cuda":
                impls["moefuse cuda, CUDA graph"] = (self.graphed(cuda_call), None, None)
        if self.cl:
            try:
                call, result = opencl_setup()
                impls["moefuse opencl"] = (call, result, self.cl.synchronize)
            except Exception as exc:
                self.table.add(op, shape, "moefuse opencl",
                               note=f"failed: {type(exc).__name__}: {exc}")
        return impls

    # ---- row operations

    def act_quant(self):
        T, H = 4096 // SHRINK, 7168 // NARROW
        x = torch.randn(T, 2 * H, device=DEV).to(BF16)
        q = torch.empty(T, H, dtype=tref.FP8, device=DEV)
        s = torch.empty(T, H // 128, device=DEV)
        shape = f"T={T} H={H} bf16->fp8 G=128"

        def opencl():
            xb, = self.cl_buffers(x)
            qb, sb = moefuse.act_quant(xb)
            return lambda: moefuse.act_quant(xb, out=qb, scales=sb), lambda: _download(qb, sb)

        impls = self.moefuse_impls("act_quant", shape,
                                   lambda: moefuse.act_quant(x, out=q, scales=s), opencl)
        self.torch_rows(impls, tref.act_quant, x)
        self.compare("act_quant", shape, x.nbytes + q.nbytes + s.nbytes, "bytes",
                     tref.act_quant(x), lambda got, ref: check_codes(*got, *ref), impls)

    def act_quant_masked(self):
        E, Tmax, H = 256 // SHRINK, 128, 7168 // NARROW
        x = torch.randn(E, Tmax, 2 * H, device=DEV).to(BF16)
        counts = torch.full((E,), Tmax, dtype=torch.int32, device=DEV)  # every row valid
        q = torch.empty(E, Tmax, H, dtype=tref.FP8, device=DEV)
        s = torch.empty(E, Tmax, H // 128, device=DEV)
        shape = f"E={E} Tmax={Tmax} H={H}, all rows valid"

        def opencl():
            xb, cb = self.cl_buffers(x, counts)
            qb, sb = moefuse.act_quant_masked(xb, cb)
            return (lambda: moefuse.act_quant_masked(xb, cb, out=qb, scales=sb),
                    lambda: _download(qb, sb))

        impls = self.moefuse_impls(
            "act_quant_masked", shape,
            lambda: moefuse.act_quant_masked(x, counts, out=q, scales=s), opencl)
        self.torch_rows(impls, tref.act_quant_masked, x, counts)
        self.compare("act_quant_masked", shape, x.nbytes + q.nbytes + s.nbytes, "bytes",
                     tref.act_quant_masked(x, counts), lambda got, ref: check_codes(*got, *ref),
                     impls)

    def quant(self):
        T, H = 4096 // SHRINK, 7168 // NARROW
        x = torch.randn(T, H, device=DEV).to(BF16)
        q = torch.empty(T, H, dtype=tref.FP8, device=DEV)
        s = torch.empty(T, H // 128, device=DEV)
        shape = f"T={T} H={H} bf16->fp8 G=128"

        def opencl():
            xb, = self.cl_buffers(x)
            qb, sb = moefuse.quant(xb)
            return lambda: moefuse.quant(xb, out=qb, scales=sb), lambda: _download(qb, sb)

        impls = self.moefuse_impls("quant", shape, lambda: moefuse.quant(x, out=q, scales=s),
                                   opencl)
        self.torch_rows(impls, tref.quant, x)
        self.compare("quant", shape, x.nbytes + q.nbytes + s.nbytes, "bytes", tref.quant(x),
                     lambda got, ref: check_codes(*got, *ref), impls)

    def act_mul(self):
        T, H = 4096 // SHRINK, 7168 // NARROW
        x = torch.randn(T, 2 * H, device=DEV).to(BF16)
        out = torch.empty(T, H, dtype=BF16, device=DEV)
        shape = f"T={T} H={H} bf16"

        def opencl():
            xb, = self.cl_buffers(x)
            ob = moefuse.act_mul(xb)
            return lambda: moefuse.act_mul(xb, out=ob), lambda: _download(ob)[0]

        impls = self.moefuse_impls("act_mul", shape, lambda: moefuse.act_mul(x, out=out), opencl)
        self.torch_rows(impls, tref.act_mul, x)
        self.compare("act_mul", shape, x.nbytes + out.nbytes, "bytes", tref.act_mul(x),
                     check_close, impls)

    def topk_softmax(self):
        M, E, k = 4096 // SHRINK, 128, 8
        logits = torch.randn(M, E, device=DEV)
        ids = torch.empty(M, k, dtype=torch.int32, device=DEV)
        w = torch.empty(M, k, device=DEV)
        shape = f"M={M} E={E} k={k} f32"

        def opencl():
            lb, = self.cl_buffers(logits)
            ib, wb = moefuse.topk_softmax(lb, k)
            return (lambda: moefuse.topk_softmax(lb, k, ids=ib, weights=wb),
                    lambda: _download(ib, wb))

        impls = self.moefuse_impls(
            "topk_softmax", shape, lambda: moefuse.topk_softmax(logits, k, ids=ids, weights=w),
            opencl)
        self.torch_rows(impls, tref.topk_softmax, logits, k)
        self.compare("topk_softmax", shape, logits.nbytes + ids.nbytes + w.nbytes, "bytes",
                     tref.topk_softmax(logits, k), lambda got, ref: check_topk(*got, *ref), impls)

    # ---- the MoE layer

    def moe_forward(self, model):
        cfg = MODELS[model]
        E, k, K, I = cfg["E"], cfg["k"], cfg["K"] // NARROW, cfg["I"] // NARROW
        w1 = torch.randn(E, 2 * I, K, device=DEV, dtype=BF16) * 0.02
        w2 = torch.randn(E, K, I, device=DEV, dtype=BF16) * 0.02
        w_cl = None
        if self.cl:
            try:  # uploaded once per model: on the host, then into OpenCL buffers
                w_cl = self.cl_buffers(w1, w2)
            except Exception as exc:
                self.table.add("moe_forward", cfg["name"], "moefuse opencl",
                               note=f"failed: {type(exc).__name__}: {exc}")
        ffn = torch.compile(tref.expert_ffn, dynamic=True) if self.args.compile else None
        for M in self.args.M:
            x = torch.randn(M, K, device=DEV).to(BF16)
            ids, weights = tref.topk_softmax(torch.randn(M, E, device=DEV), k)
            out = torch.empty(M, K, dtype=BF16, device=DEV)
            flops = 2 * M * k * (2 * I * K + K * I)
            touched = torch.unique(ids).numel()
            weight_bytes = touched * 3 * I * K * 2
            floor = max(flops / gemm_rate(M * k, K, 3 * I), weight_bytes / self.table.copy_bw)
            shape = f"{cfg['name']} M={M} (E={E} k={k} K={K} I={I}) bf16"

            def opencl():
                if not w_cl:
                    raise RuntimeError("no OpenCL weights")
                xb, ib, wb = self.cl_buffers(x, ids, weights)
                ob = moefuse.moe_forward(xb, *w_cl, ib, wb)
                return (lambda: moefuse.moe_forward(xb, *w_cl, ib, wb, out=ob),
                        lambda: _download(ob)[0])

            impls = self.moefuse_impls(
                "moe_forward", shape,
                lambda: moefuse.moe_forward(x, w1, w2, ids, weights, out=out), opencl)
            impls["torch eager"] = (lambda: tref.moe_forward(x, w1, w2, ids, weights),
                                    None, None)
            if ffn:
                impls["torch.compile"] = (lambda: tref.moe_forward(x, w1, w2, ids, weights,
                                                                   ffn=ffn), None, None)
            if hasattr(torch, "_grouped_mm"):
                impls["torch._grouped_mm"] = (
                    lambda: tref.moe_forward_grouped_mm(x, w1, w2, ids, weights), None, None)
            else:
                self.table.add("moe_forward", shape, "torch._grouped_mm",
                               note="n/a: this torch has no _grouped_mm")
            ref = tref.moe_forward(x, w1, w2, ids, weights, compute=torch.float32)
            self.compare("moe_forward", shape, flops, "flops", ref, check_rel, impls, floor)
            impls = ref = None  # this M's tensors go before the next M's are made
            _empty_cache()


def _download(*buffers):
    """OpenCL results as torch tensors on DEV, for the checks (numpy has no bf16/fp8: via ints)."""
    out = []
    for b in buffers:
        host = b.download()
        if b.dtype == "bf16":
            t = torch.from_numpy(host.view("int16")).view(BF16)
        elif b.dtype == "f8_e4m3":
            t = torch.from_numpy(host.view("uint8")).view(tref.FP8)
        else:
            t = torch.from_numpy(host)
        out.append(t.to(DEV))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="act_quant, act_quant_masked and a few MoE shapes (Qwen3, Mixtral at "
                         "M = 32, 512)")
    ap.add_argument("--ops", help="comma list of: " + ", ".join(ROW_OPS + ("moe_forward",)))
    ap.add_argument("--models", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--M", help="comma list of token counts (default 1,32,512,4096)")
    ap.add_argument("--backends", default="cuda,opencl", help="moefuse backends to time")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="leave out torch.compile (its compilation takes minutes)")
    ap.add_argument("--seconds", type=float, default=0.3, help="timed seconds per row (min 5 runs)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--smoke", action="store_true",
                    help="try the script without a GPU: CPU tensors on the cpu backend (labelled "
                         "'moefuse cuda'), small sizes; the numbers mean nothing")
    args = ap.parse_args()
    if args.smoke:
        global DEV, SHRINK, NARROW
        DEV, SHRINK, NARROW = "cpu", 16, 4
    pick = (lambda given, default: tuple(given.split(",")) if given else default)
    args.ops = pick(args.ops, QUICK["ops"] if args.quick else ROW_OPS + ("moe_forward",))
    args.models = pick(args.models, QUICK["models"] if args.quick else tuple(MODELS))
    args.M = tuple(int(m) for m in pick(args.M, QUICK["M"] if args.quick else M_ALL))
    args.backends = args.backends.split(",")

    if DEV == "cuda" and not torch.cuda.is_available():
        sys.exit("compare_torch.py needs a CUDA device (--smoke tries it on the CPU)")
    torch.backends.cuda.matmul.allow_tf32 = False
    if DEV == "cuda":
        prop = torch.cuda.get_device_properties(0)
        device = f"{prop.name} ({prop.multi_processor_count} SMs, sm_{prop.major}{prop.minor})"
    else:
        device = "CPU (--smoke: not a measurement)"
    started = datetime.datetime.now(datetime.timezone.utc)
    copy_bw = copy_bandwidth()
    peak = gemm_rate(*(3 * (8192 // SHRINK,)))
    print(f"# moefuse vs PyTorch, {started:%Y-%m-%d %H:%M} UTC, {device}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); moefuse {moefuse.library_path}"
          f" (backends: {', '.join(moefuse.built_backends())})")
    print(f"ceilings, this run: copy {copy_bw / 1e9:.0f} GB/s (1 GiB copy_, read + write, best "
          f"of 5); dense bf16 GEMM {peak / 1e12:.0f} TFLOP/s (torch.matmul 8192^3); MoE floor = "
          f"max(FLOPs at torch.matmul's rate for [M*k, K] x [K, 3I], routed weights / copy)")
    table = Table(copy_bw)
    runner = Runner(args, table)
    if runner.cl:
        print(f"OpenCL: {runner.cl.device}")
    if "cuda" not in args.backends:
        print("(moefuse cuda rows left out by --backends)")
    print(Table.HEADER, flush=True)
    for op in args.ops:
        for model in (args.models if op == "moe_forward" else (None,)):
            try:
                runner.moe_forward(model) if model else getattr(runner, op)()
            except Exception as exc:  # report, and go on with the next shape
                table.add(op, model or "", "(setup or reference)",
                          note=f"failed: {type(exc).__name__}: {exc}")
            _empty_cache()
    print(f"\n## Table ({(datetime.datetime.now(datetime.timezone.utc) - started).seconds} s)\n")
    print(table.markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, date=started.isoformat(), copy_bw=copy_bw,
                           gemm_peak=peak, torch=torch.__version__, rows=table.rows), f,
                      indent=1, default=str)


if __name__ == "__main__":
    main()
