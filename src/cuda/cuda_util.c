/* Error conversion, launch checks and stream-ordered scratch of the CUDA backend. */
#include "cuda/cuda_internal.h"

moefuse_status mf_cuda_fail(moefuse_context *ctx, cudaError_t err, const char *op,
                            const char *call)
{
    /* a sticky error (an earlier kernel faulted) poisons the context: say so */
    moefuse_status status = err == cudaErrorMemoryAllocation ? MOEFUSE_ERR_OUT_OF_MEMORY
                                                             : MOEFUSE_ERR_BACKEND_FAILURE;
    cudaGetLastError(); /* clear a non-sticky error so the next call starts clean */
    return mf_error(ctx, status, "%s%s%s failed: %s: %s", op ? op : "cuda", ": ", call,
                    cudaGetErrorName(err), cudaGetErrorString(err));
}

moefuse_status mf_cuda_launched(moefuse_context *ctx, const char *op, const char *kernel)
{
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return MOEFUSE_OK;
    return mf_error(ctx, MOEFUSE_ERR_BACKEND_FAILURE, "%s: launching %s failed: %s: %s", op,
                    kernel, cudaGetErrorName(e), cudaGetErrorString(e));
}

int mf_cuda_scratch_kept(moefuse_context *ctx, const cuda_state *s)
{
    mf_region ws;
    if (mf_caller_workspace(ctx, &ws))
        return 1;
    enum cudaStreamCaptureStatus capture;
    return cudaStreamIsCapturing(s->stream, &capture) == cudaSuccess &&
           capture == cudaStreamCaptureStatusNone;
}

moefuse_status mf_cuda_scratch(moefuse_context *ctx, cuda_state *s, size_t bytes, const char *op,
                               void **out)
{
    mf_region ws;
    bool given;
    MF_TRY(mf_caller_scratch(ctx, op, bytes, &ws, &given));
    if (given) {
        *out = (char *)ws.data + ws.offset;
        return MOEFUSE_OK;
    }
    enum cudaStreamCaptureStatus capture;
    cudaError_t e = cudaStreamIsCapturing(s->stream, &capture);
    if (e != cudaSuccess)
        return mf_cuda_fail(ctx, e, op, "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
        if (s->capture_scratch) /* a second request would leave the first unfreed in the graph */
            return mf_error(ctx, MOEFUSE_ERR_BACKEND_FAILURE,
                            "%s: internal error: two scratch requests in one captured call", op);
        /* becomes an allocation node of the graph, freed by mf_cuda_end_call's node */
        e = mf_fault_hit(MF_FAULT_SCRATCH_GROW)
                ? cudaErrorMemoryAllocation
                : cudaMallocAsync(&s->capture_scratch, bytes ? bytes : 256, s->stream);
        if (e != cudaSuccess) {
            s->capture_scratch = NULL;
            return mf_cuda_fail(ctx, e, op, "cudaMallocAsync(scratch, during graph capture)");
        }
        *out = s->capture_scratch;
        return MOEFUSE_OK;
    }
    if (s->scratch_stream && s->scratch_stream != s->stream) {
        /* the last user ran on another stream: start after it, without a host wait */
        e = cudaStreamWaitEvent(s->stream, s->scratch_free, 0);
        if (e != cudaSuccess)
            return mf_cuda_fail(ctx, e, op, "cudaStreamWaitEvent(scratch)");
    }
    if (bytes > s->scratch_bytes || !s->scratch) {
        if (s->scratch) {
            e = cudaFreeAsync(s->scratch, s->stream);
            s->scratch = NULL;
            s->scratch_bytes = 0;
            if (e != cudaSuccess)
                return mf_cuda_fail(ctx, e, op, "cudaFreeAsync(scratch)");
        }
        /* grow by half again, so a slowly rising M does not reallocate every call */
        size_t want = bytes + bytes / 2;
        e = mf_fault_hit(MF_FAULT_SCRATCH_GROW)
                ? cudaErrorMemoryAllocation
                : cudaMallocAsync(&s->scratch, want ? want : 256, s->stream);
        if (e != cudaSuccess) {
            s->scratch = NULL;
            return mf_cuda_fail(ctx, e, op, "cudaMallocAsync(scratch)");
        }
        s->scratch_bytes = want;
    }
    s->scratch_used = 1;
    *out = s->scratch;
    return MOEFUSE_OK;
}

moefuse_status mf_cuda_end_call(moefuse_context *ctx, cuda_state *s, const char *op,
                                moefuse_status status)
{
    cudaError_t e = cudaSuccess;
    const char *call = NULL;
    if (s->capture_scratch) {
        e = cudaFreeAsync(s->capture_scratch, s->stream);
        call = "cudaFreeAsync(scratch, during graph capture)";
        s->capture_scratch = NULL;
    }
    if (s->scratch_used) {
        s->scratch_used = 0;
        cudaError_t r = cudaEventRecord(s->scratch_free, s->stream);
        if (r == cudaSuccess) {
            s->scratch_stream = s->stream;
        } else if (e == cudaSuccess) {
            e = r;
            call = "cudaEventRecord(scratch)";
        }
    }
    if (e != cudaSuccess && status == MOEFUSE_OK)
        return mf_cuda_fail(ctx, e, op, call);
    return status;
}
