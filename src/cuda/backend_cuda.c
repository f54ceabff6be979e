/*
 * The CUDA backend's vtable: device choice, stream lifetime, the caller's
 * stream, buffers and pointer ownership. Tensors are device pointers.
 */
#include "cuda/cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool cuda_probe(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* no driver or no device: not sticky, clear it */
        return false;
    }
    return n > 0;
}

/* `want` (the caller's device index), else MOEFUSE_CUDA_DEVICE, else the calling thread's
 * current device. */
static moefuse_status pick_device(moefuse_context *ctx, const char *want, int *device)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        cudaGetLastError();
        return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE, "cuda: no CUDA device (%s)",
                        e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
    }
    const char *from = "device";
    if (!want) {
        want = getenv("MOEFUSE_CUDA_DEVICE");
        from = "MOEFUSE_CUDA_DEVICE";
    }
    if (want && *want) {
        char *end;
        long d = strtol(want, &end, 10);
        if (*end != '\0' || d < 0 || d >= n)
            return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                            "cuda: %s '%.64s' is not a device index in [0, %d)", from, want, n);
        *device = (int)d;
        return MOEFUSE_OK;
    }
    e = cudaGetDevice(device);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, NULL, "cudaGetDevice");
}

/* The calling thread's current device, or -1 (none yet, no driver). */
static int current_device(void)
{
    int device;
    if (cudaGetDevice(&device) == cudaSuccess)
        return device;
    cudaGetLastError();
    return -1;
}

static void release_state(cuda_state *s)
{
    cudaSetDevice(s->device);
    if (s->scratch && s->own_stream) {
        /* on our own stream: the caller's may be capturing a graph right now */
        if (s->scratch_stream)
            cudaStreamWaitEvent(s->own_stream, s->scratch_free, 0);
        cudaFreeAsync(s->scratch, s->own_stream);
    }
    if (s->own_stream)
        cudaStreamSynchronize(s->own_stream);
    if (s->act_tables)
        cudaFree(s->act_tables);
    if (s->scratch_free)
        cudaEventDestroy(s->scratch_free);
    if (s->own_stream)
        cudaStreamDestroy(s->own_stream);
    free(s);
}

/* Like creation, release leaves the calling thread on the device it was on. */
static void cuda_release(void *state)
{
    if (!state)
        return;
    const int previous = current_device();
    release_state(state);
    if (previous >= 0)
        cudaSetDevice(previous);
}

/* A driver API function through the runtime (the library does not link libcuda), or NULL. */
static void *driver_entry(const char *name)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
        fn = NULL;
    cudaGetLastError();
    return fn;
}

/* Driver entry points. Without the first two, tensors are not checked against their
 * allocation's end, as on the cpu; without the encoder, no TMA (moe_ws.cu). */
static void resolve_address_range(cuda_state *s)
{
    s->address_range = (int (*)(unsigned long long *, size_t *,
                                unsigned long long))driver_entry("cuMemGetAddressRange");
    s->pointer_attributes = (int (*)(unsigned, int *, void **,
                                     unsigned long long))driver_entry("cuPointerGetAttributes");
    s->tensor_map_encode = (void (*)(void))driver_entry("cuTensorMapEncodeTiled");
}

static moefuse_status init_state(moefuse_context *ctx, const char *device, void **state)
{
    cuda_state *s = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : calloc(1, sizeof *s);
    if (!s)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "cuda: cannot allocate %zu bytes of state",
                        sizeof *s);
    moefuse_status st = pick_device(ctx, device, &s->device);
    if (st != MOEFUSE_OK) {
        free(s);
        return st;
    }
    s->forced_gemm = mf_cuda_gemm_from_env();
    if (s->forced_gemm == -2) {
        free(s);
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "cuda: MOEFUSE_CUDA_GEMM=%.64s is none of simt16, simt64, mma_s, mma_m, "
                        "mma_l, wgmma, ws, decode",
                        getenv("MOEFUSE_CUDA_GEMM"));
    }
    s->forced_split = mf_cuda_split_from_env();
    if (s->forced_split < 0) {
        free(s);
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "cuda: MOEFUSE_CUDA_SPLIT=%.64s is not an integer from 1 to 8",
                        getenv("MOEFUSE_CUDA_SPLIT"));
    }
    s->fp8_gemm = mf_cuda_fp8_gemm_from_env();
    if (s->fp8_gemm < 0) {
        free(s);
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "cuda: MOEFUSE_CUDA_FP8=%.64s is none of portable, wgmma, decode",
                        getenv("MOEFUSE_CUDA_FP8"));
    }
    s->fp8_a = mf_cuda_fp8_a_from_env();
    if (s->fp8_a < 0) {
        free(s);
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "cuda: MOEFUSE_CUDA_FP8_A=%.64s is neither tma nor gather",
                        getenv("MOEFUSE_CUDA_FP8_A"));
    }
    s->forced_router = mf_cuda_router_from_env();
    if (s->forced_router < 0) {
        free(s);
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "cuda: MOEFUSE_CUDA_ROUTER=%.64s is none of block, lanes, warp, thread",
                        getenv("MOEFUSE_CUDA_ROUTER"));
    }
    s->forced_meta = mf_cuda_meta_from_env();
    if (s->forced_meta < 0) {
        free(s);
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "cuda: MOEFUSE_CUDA_META=%.64s is none of cluster16, cluster8, spans, "
                        "reference",
                        getenv("MOEFUSE_CUDA_META"));
    }
    cudaError_t e = cudaSetDevice(s->device);
    struct cudaDeviceProp prop;
    if (e == cudaSuccess)
        e = cudaGetDeviceProperties(&prop, s->device);
    if (e != cudaSuccess) {
        free(s);
        return mf_cuda_fail(ctx, e, NULL, "cudaGetDeviceProperties");
    }
    s->sm_count = prop.multiProcessorCount;
    s->cc_major = prop.major;
    s->cc_minor = prop.minor;
    s->smem_optin = prop.sharedMemPerBlockOptin;
    s->l2_bytes = (size_t)prop.l2CacheSize;
    snprintf(s->device_name, sizeof s->device_name, "%.200s (CUDA device %d, sm_%d%d, %d SMs)",
             prop.name, s->device, prop.major, prop.minor, prop.multiProcessorCount);
    /* non-blocking: no implicit ordering with the legacy default stream */
    e = cudaStreamCreateWithFlags(&s->own_stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        s->own_stream = NULL;
        cuda_release(s);
        return mf_cuda_fail(ctx, e, NULL, "cudaStreamCreateWithFlags");
    }
    s->stream = s->own_stream;
    resolve_address_range(s);
    e = cudaEventCreateWithFlags(&s->scratch_free, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        s->scratch_free = NULL;
        cuda_release(s);
        return mf_cuda_fail(ctx, e, NULL, "cudaEventCreateWithFlags");
    }
    mf_cuda_probe_pdl(s);
    /* the table kernels of rows.cu, unless MOEFUSE_CUDA_ACT_TABLE=0 keeps the computed ones
     * (the same bits: for comparison and for the tests of the computed path) */
    const char *tables = getenv("MOEFUSE_CUDA_ACT_TABLE");
    if (!(tables && strcmp(tables, "0") == 0)) {
        st = mf_cuda_build_act_tables(ctx, s);
        if (st != MOEFUSE_OK) {
            cuda_release(s);
            return st;
        }
    }
    *state = s;
    return MOEFUSE_OK;
}

/* Creating a context leaves the creating thread on the device it was on. */
static moefuse_status cuda_init(moefuse_context *ctx, const char *device, void **state)
{
    const int previous = current_device();
    moefuse_status status = init_state(ctx, device, state);
    if (previous >= 0)
        cudaSetDevice(previous);
    return status;
}

static const char *cuda_device_name(void *state)
{
    return state ? ((const cuda_state *)state)->device_name : "CUDA";
}

/*
 * The caller's stream (or NULL for our own). Nothing is waited for: scratch
 * orders itself across streams with an event (mf_cuda_scratch). A stream
 * being captured into a CUDA graph is taken as it is; it cannot be queried.
 */
static moefuse_status cuda_set_stream(moefuse_context *ctx, void *state, void *stream)
{
    cuda_state *s = state;
    cudaStream_t next = stream ? (cudaStream_t)stream : s->own_stream;
    if (next == s->stream)
        return MOEFUSE_OK;
    enum cudaStreamCaptureStatus capture;
    cudaError_t e = cudaStreamIsCapturing(next, &capture);
    if (e == cudaSuccess && capture == cudaStreamCaptureStatusNone) {
        e = cudaStreamQuery(next); /* a stream of another device answers with an error */
        if (e == cudaErrorNotReady)
            e = cudaSuccess;
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "set_stream: the stream is not usable on this device (%s)",
                        cudaGetErrorString(e));
    }
    s->stream = next;
    return MOEFUSE_OK;
}

static void *cuda_get_stream(void *state) { return ((cuda_state *)state)->stream; }

static moefuse_status cuda_synchronize(moefuse_context *ctx, void *state)
{
    cudaError_t e = cudaStreamSynchronize(((cuda_state *)state)->stream);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, "synchronize", "cudaStreamSynchronize");
}

/*
 * Kernels launch and cudaMalloc allocates on the calling thread's current device, which
 * need not be the context's (another thread may use it; init set its creator's). Each
 * call that depends on it switches to the context's device and gives the thread its own
 * back: a cudaGetDevice, a thread-local read, when they already agree.
 */
static moefuse_status enter_device(moefuse_context *ctx, const cuda_state *s, const char *op,
                                   int *previous)
{
    cudaError_t e = cudaGetDevice(previous);
    if (e == cudaSuccess && *previous != s->device)
        e = cudaSetDevice(s->device);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, op, "cudaSetDevice");
}

static moefuse_status leave_device(const cuda_state *s, int previous, moefuse_status status)
{
    if (previous != s->device)
        cudaSetDevice(previous);
    return status;
}

static moefuse_status alloc_on_device(moefuse_context *ctx, size_t bytes, void **buffer)
{
    cudaError_t e = mf_fault_hit(MF_FAULT_DEVICE_ALLOC) ? cudaErrorMemoryAllocation
                                                        : cudaMalloc(buffer, bytes ? bytes : 1);
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError();
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY,
                        "buffer_alloc: cudaMalloc of %zu bytes: out of device memory", bytes);
    }
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, "buffer_alloc", "cudaMalloc");
}

static moefuse_status cuda_buffer_alloc(moefuse_context *ctx, void *state, size_t bytes,
                                        void **buffer)
{
    int previous;
    MF_TRY(enter_device(ctx, state, "buffer_alloc", &previous));
    return leave_device(state, previous, alloc_on_device(ctx, bytes, buffer));
}

static void cuda_buffer_free(void *state, void *buffer)
{
    (void)state;
    cudaFree(buffer); /* synchronises the device: buffers are not freed on hot paths */
}

/* Copies are ordered after the work already enqueued on the stream, then waited for. */
static moefuse_status copy(moefuse_context *ctx, cuda_state *s, void *dst, const void *src,
                           size_t bytes, enum cudaMemcpyKind kind, const char *op)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, s->stream);
    if (e != cudaSuccess)
        return mf_cuda_fail(ctx, e, op, "cudaMemcpyAsync");
    e = cudaStreamSynchronize(s->stream);
    return e == cudaSuccess ? MOEFUSE_OK : mf_cuda_fail(ctx, e, op, "cudaStreamSynchronize");
}

static moefuse_status cuda_buffer_write(moefuse_context *ctx, void *state, void *buffer,
                                        size_t offset, const void *src, size_t bytes)
{
    return copy(ctx, state, (char *)buffer + offset, src, bytes, cudaMemcpyHostToDevice,
                "buffer_write");
}

static moefuse_status cuda_buffer_read(moefuse_context *ctx, void *state, const void *buffer,
                                       size_t offset, void *dst, size_t bytes)
{
    return copy(ctx, state, dst, (const char *)buffer + offset, bytes, cudaMemcpyDeviceToHost,
                "buffer_read");
}

/*
 * Device or managed memory of our device; any cudaMalloc'd pointer counts,
 * so callers may pass their own allocations (framework tensors). Host
 * pointers are answered by the runtime without touching them.
 */
static bool cuda_owns_pointer(void *state, const void *data)
{
    cuda_state *s = state;
    s->checked_ptr = NULL;
    if (s->pointer_attributes) {
        /* CU_POINTER_ATTRIBUTE_ MEMORY_TYPE, DEVICE_ORDINAL, IS_MANAGED, RANGE_START_ADDR,
         * RANGE_SIZE: one driver call answers this check and the bounds check after it (not a
         * CUDA pointer: CUDA_SUCCESS with every attribute 0) */
        int attributes[5] = {2, 9, 8, 11, 12};
        unsigned int type = 0;
        int ordinal = -1;
        unsigned int managed = 0;
        unsigned long long base = 0;
        size_t size = 0;
        void *out[5] = {&type, &ordinal, &managed, &base, &size};
        if (s->pointer_attributes(5, attributes, out, (unsigned long long)(uintptr_t)data) != 0)
            return false;
        const bool ours = (type == 2 /* CU_MEMORYTYPE_DEVICE */ || managed) && ordinal == s->device;
        if (ours && size > 0) {
            s->checked_ptr = data;
            s->checked_base = base;
            s->checked_size = size;
        }
        return ours;
    }
    struct cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, data) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) &&
           attr.device == s->device;
}

/* Bytes from data to the end of the device allocation it lies in (any allocation: a
 * framework's caching allocator hands out pieces of larger blocks, bounded by the block). */
static bool cuda_buffer_extent(void *state, const void *data, uint64_t *bytes)
{
    cuda_state *s = state;
    unsigned long long base = 0, ptr = (unsigned long long)(uintptr_t)data;
    size_t size = 0;
    if (s->checked_ptr == data) { /* the ownership check just asked the driver */
        base = s->checked_base;
        size = s->checked_size;
        s->checked_ptr = NULL;
    } else if (!s->address_range || s->address_range(&base, &size, ptr) != 0) {
        return false;
    }
    if (ptr < base || ptr - base > size)
        return false;
    *bytes = size - (ptr - base);
    return true;
}

/* Every operation runs on the context's device and ends in mf_cuda_end_call (scratch
 * bookkeeping, see cuda_internal.h). */
#define MF_CUDA_OP(name, args_type)                                                            \
    static moefuse_status cuda_##name(moefuse_context *ctx, void *state, const args_type *a)    \
    {                                                                                          \
        int previous;                                                                          \
        MF_TRY(enter_device(ctx, state, #name, &previous));                                    \
        moefuse_status status =                                                                \
            mf_cuda_end_call(ctx, state, #name, mf_cuda_##name(ctx, state, a));                \
        return leave_device(state, previous, status);                                          \
    }
MF_CUDA_OP(act_quant, mf_rows_args)
MF_CUDA_OP(act_mul, mf_rows_args)
MF_CUDA_OP(quant, mf_rows_args)
MF_CUDA_OP(dequant, mf_dequant_args)
MF_CUDA_OP(topk_softmax, mf_topk_args)
MF_CUDA_OP(topk_route, mf_topk_args)
MF_CUDA_OP(routing_metadata, mf_meta_args)
MF_CUDA_OP(moe_shared_routing, mf_shared_args)
MF_CUDA_OP(moe_gate, mf_moe_args)
MF_CUDA_OP(moe_final, mf_moe_args)
MF_CUDA_OP(moe_forward, mf_moe_args)
MF_CUDA_OP(moe_gate_fp8, mf_moe_args)
MF_CUDA_OP(moe_final_fp8, mf_moe_args)
MF_CUDA_OP(ep_gather, mf_ep_rows_args)
MF_CUDA_OP(ep_scatter, mf_ep_rows_args)
MF_CUDA_OP(ep_reduce, mf_ep_reduce_args)
MF_CUDA_OP(ep_ll_pack, mf_ep_ll_args)
MF_CUDA_OP(ep_ll_place, mf_ep_ll_args)
MF_CUDA_OP(ep_ll_partial, mf_ep_ll_args)
MF_CUDA_OP(ep_ll_sum, mf_ep_ll_args)
#undef MF_CUDA_OP

static moefuse_status cuda_ep_copy(moefuse_context *ctx, void *state, void *dst, const void *src,
                                   size_t bytes)
{
    int previous;
    MF_TRY(enter_device(ctx, state, "ep_copy", &previous));
    return leave_device(state, previous, mf_cuda_ep_copy(ctx, state, dst, src, bytes));
}

static moefuse_status cuda_ep_unique_id(moefuse_context *ctx, void *state, void *id)
{
    int previous;
    MF_TRY(enter_device(ctx, state, "ep_unique_id_create", &previous));
    return leave_device(state, previous, mf_cuda_ep_unique_id(ctx, state, id));
}

static moefuse_status cuda_ep_transport(moefuse_context *ctx, void *state, const void *id,
                                        void *comm, int32_t rank, int32_t world,
                                        mf_ep_transport *out)
{
    int previous;
    MF_TRY(enter_device(ctx, state, "ep_group_create", &previous));
    return leave_device(state, previous,
                        mf_cuda_ep_transport(ctx, state, id, comm, rank, world, out));
}

const moefuse_backend_i mf_backend_cuda = {
    .name = "cuda",
    .probe = cuda_probe,
    .init = cuda_init,
    .release = cuda_release,
    .device_name = cuda_device_name,
    .set_stream = cuda_set_stream,
    .get_stream = cuda_get_stream,
    .synchronize = cuda_synchronize,
    .buffer_alloc = cuda_buffer_alloc,
    .buffer_free = cuda_buffer_free,
    .buffer_write = cuda_buffer_write,
    .buffer_read = cuda_buffer_read,
    .owns_pointer = cuda_owns_pointer,
    .buffer_extent = cuda_buffer_extent,
    .data_is_handle = false,
    .act_quant = cuda_act_quant,
    .act_mul = cuda_act_mul,
    .quant = cuda_quant,
    .dequant = cuda_dequant,
    .topk_softmax = cuda_topk_softmax,
    .topk_route = cuda_topk_route,
    .routing_metadata = cuda_routing_metadata,
    .moe_shared_routing = cuda_moe_shared_routing,
    .moe_gate = cuda_moe_gate,
    .moe_final = cuda_moe_final,
    .moe_forward = cuda_moe_forward,
    .rows_workspace = mf_cuda_rows_workspace,
    .meta_workspace = mf_cuda_meta_workspace,
    .moe_gate_workspace = mf_cuda_moe_gate_workspace,
    .moe_final_workspace = mf_cuda_moe_final_workspace,
    .moe_forward_workspace = mf_cuda_moe_forward_workspace,
    /* FP8: gate and final; the core runs a whole layer as the two (h in its workspace) */
    .moe_gate_fp8 = cuda_moe_gate_fp8,
    .moe_final_fp8 = cuda_moe_final_fp8,
    .moe_gate_fp8_workspace = mf_cuda_moe_gate_fp8_workspace,
    .moe_final_fp8_workspace = mf_cuda_moe_final_fp8_workspace,
    .ep_gather = cuda_ep_gather,
    .ep_scatter = cuda_ep_scatter,
    .ep_reduce = cuda_ep_reduce,
    .ep_copy = cuda_ep_copy,
    .ep_ll_pack = cuda_ep_ll_pack,
    .ep_ll_place = cuda_ep_ll_place,
    .ep_ll_partial = cuda_ep_ll_partial,
    .ep_ll_sum = cuda_ep_ll_sum,
    .ep_unique_id = cuda_ep_unique_id,
    .ep_transport = cuda_ep_transport,
};
