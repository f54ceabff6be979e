/*
 * Expert parallelism's transport over NCCL (src/ep/transport.h), one rank per process and
 * device. NCCL is loaded at run time (libnccl.so.2, or the file MOEFUSE_NCCL_LIBRARY names),
 * so the library builds and runs without it; a call that needs it and does not find it fails
 * with a message naming what was looked for. The rows move by grouped ncclSend / ncclRecv
 * on the context's stream, or on a stream of the transport's own beside it (events order the
 * two); host exchanges (counts, votes) go through device scratch and wait for the stream.
 */
#include "cuda/cuda_internal.h"
#include "ep/transport.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* NCCL's ABI, the few pieces used here (nccl.h, stable since NCCL 2.0) */
typedef struct {
    char internal[128];
} mf_nccl_id;
typedef void *mf_nccl_comm;
typedef int mf_nccl_result;
#define MF_NCCL_UINT8 1

typedef struct nccl_api {
    mf_nccl_result (*get_unique_id)(mf_nccl_id *id);
    mf_nccl_result (*comm_init_rank)(mf_nccl_comm *comm, int nranks, mf_nccl_id id, int rank);
    mf_nccl_result (*comm_destroy)(mf_nccl_comm comm);
    mf_nccl_result (*send)(const void *buf, size_t count, int type, int peer, mf_nccl_comm comm,
                           cudaStream_t stream);
    mf_nccl_result (*recv)(void *buf, size_t count, int type, int peer, mf_nccl_comm comm,
                           cudaStream_t stream);
    mf_nccl_result (*group_start)(void);
    mf_nccl_result (*group_end)(void);
    const char *(*error_string)(mf_nccl_result r);
} nccl_api;

static pthread_mutex_t nccl_lock = PTHREAD_MUTEX_INITIALIZER;
static nccl_api nccl;
static int nccl_loaded; /* 1 loaded, -1 failed (nccl_why says why) */
static char nccl_why[512];

/* NCCL's functions, loaded once per process. */
static moefuse_status nccl_load(moefuse_context *ctx, const char *op)
{
    pthread_mutex_lock(&nccl_lock);
    if (nccl_loaded == 0) {
        const char *env = getenv("MOEFUSE_NCCL_LIBRARY");
        const char *path = env && *env ? env : "libnccl.so.2";
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            snprintf(nccl_why, sizeof nccl_why, "cannot load NCCL from %s%s: %s", path,
                     env && *env ? " (MOEFUSE_NCCL_LIBRARY)" : "", e ? e : "not found");
            nccl_loaded = -1;
        } else {
            static const char *const names[] = {
                "ncclGetUniqueId", "ncclCommInitRank", "ncclCommDestroy", "ncclSend",
                "ncclRecv",        "ncclGroupStart",   "ncclGroupEnd",    "ncclGetErrorString"};
            void *f[8];
            nccl_loaded = 1;
            for (int i = 0; i < 8 && nccl_loaded == 1; i++)
                if (!(f[i] = dlsym(h, names[i]))) {
                    snprintf(nccl_why, sizeof nccl_why, "%s has no %s (NCCL 2.7 or later needed)",
                             path, names[i]);
                    nccl_loaded = -1;
                }
            if (nccl_loaded == 1) {
                memcpy(&nccl.get_unique_id, &f[0], sizeof f[0]);
                memcpy(&nccl.comm_init_rank, &f[1], sizeof f[1]);
                memcpy(&nccl.comm_destroy, &f[2], sizeof f[2]);
                memcpy(&nccl.send, &f[3], sizeof f[3]);
                memcpy(&nccl.recv, &f[4], sizeof f[4]);
                memcpy(&nccl.group_start, &f[5], sizeof f[5]);
                memcpy(&nccl.group_end, &f[6], sizeof f[6]);
                memcpy(&nccl.error_string, &f[7], sizeof f[7]);
            } else {
                dlclose(h);
            }
        }
    }
    const int ok = nccl_loaded == 1;
    pthread_mutex_unlock(&nccl_lock);
    if (!ok)
        return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE, "%s: %s", op, nccl_why);
    return MOEFUSE_OK;
}

static moefuse_status nccl_fail(moefuse_context *ctx, const char *op, const char *call,
                                mf_nccl_result r)
{
    return mf_error(ctx, MOEFUSE_ERR_BACKEND_FAILURE, "%s: %s failed: %s", op, call,
                    nccl.error_string ? nccl.error_string(r) : "(no message)");
}

/* ----------------------------------------------------------------- transport */

typedef struct nccl_rank {
    const cuda_state *state; /* the context's: its stream, as set_stream leaves it */
    int device;    /* the context's: NCCL's comm and the scratch live there */
    mf_nccl_comm comm;
    int own;       /* the comm is ours to destroy */
    int world;
    void *scratch; /* device memory for host exchanges */
    size_t scratch_bytes;
    cudaStream_t side;         /* all_to_all_beside's, made on first use */
    cudaEvent_t ready, done;   /* the context's work before it; its own end */
} nccl_rank;

static cudaStream_t rank_stream(const nccl_rank *t)
{
    return t->state->stream;
}

/* The context's device made current for a transport call, and the thread's given back. */
static int device_enter(const nccl_rank *t)
{
    int previous = t->device;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != t->device)
        cudaSetDevice(t->device);
    return previous;
}

static void device_leave(const nccl_rank *t, int previous)
{
    if (previous != t->device)
        cudaSetDevice(previous);
}

static moefuse_status cuda_why(cudaError_t e, const char *call, char *why, size_t why_size)
{
    snprintf(why, why_size, "CUDA: %s: %s", call, cudaGetErrorString(e));
    return MOEFUSE_ERR_BACKEND_FAILURE;
}

/* The grouped sends and receives of one collective, queued on `stream`. */
static moefuse_status nccl_exchange_on(nccl_rank *t, cudaStream_t stream, const void *send,
                                       const size_t *send_bytes, const size_t *send_off,
                                       void *recv, const size_t *recv_bytes,
                                       const size_t *recv_off, char *why, size_t why_size)
{
    mf_nccl_result r = nccl.group_start();
    for (int p = 0; p < t->world && r == 0; p++) {
        if (send_bytes[p] > 0)
            r = nccl.send((const char *)send + send_off[p], send_bytes[p], MF_NCCL_UINT8, p,
                          t->comm, stream);
        if (r == 0 && recv_bytes[p] > 0)
            r = nccl.recv((char *)recv + recv_off[p], recv_bytes[p], MF_NCCL_UINT8, p, t->comm,
                          stream);
    }
    const mf_nccl_result end = nccl.group_end();
    r = r ? r : end;
    if (r != 0) {
        snprintf(why, why_size, "NCCL: %s", nccl.error_string(r));
        return MOEFUSE_ERR_BACKEND_FAILURE;
    }
    return MOEFUSE_OK;
}

static moefuse_status nccl_all_to_all(void *tp, const void *send, const size_t *send_bytes,
                                      const size_t *send_off, void *recv,
                                      const size_t *recv_bytes, const size_t *recv_off,
                                      char *why, size_t why_size)
{
    nccl_rank *t = tp;
    const int previous = device_enter(t);
    const moefuse_status st = nccl_exchange_on(t, rank_stream(t), send, send_bytes, send_off,
                                               recv, recv_bytes, recv_off, why, why_size);
    device_leave(t, previous);
    return st;
}

/* The side stream and its two events, made once. */
static moefuse_status side_make(nccl_rank *t, char *why, size_t why_size)
{
    if (t->side)
        return MOEFUSE_OK;
    t->ready = t->done = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&t->ready, cudaEventDisableTiming);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&t->done, cudaEventDisableTiming);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&t->side, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        if (t->ready)
            cudaEventDestroy(t->ready);
        if (t->done)
            cudaEventDestroy(t->done);
        t->ready = t->done = NULL;
        t->side = NULL;
        return cuda_why(e, "cannot make the transport's stream", why, why_size);
    }
    return MOEFUSE_OK;
}

static moefuse_status nccl_all_to_all_beside(void *tp, const void *send,
                                             const size_t *send_bytes, const size_t *send_off,
                                             void *recv, const size_t *recv_bytes,
                                             const size_t *recv_off, char *why, size_t why_size)
{
    nccl_rank *t = tp;
    const int previous = device_enter(t);
    moefuse_status st = side_make(t, why, why_size);
    cudaError_t e = cudaSuccess;
    if (st == MOEFUSE_OK && (e = cudaEventRecord(t->ready, rank_stream(t))) == cudaSuccess)
        e = cudaStreamWaitEvent(t->side, t->ready, 0);
    if (st == MOEFUSE_OK && e != cudaSuccess)
        st = cuda_why(e, "cudaEventRecord / cudaStreamWaitEvent", why, why_size);
    if (st == MOEFUSE_OK)
        st = nccl_exchange_on(t, t->side, send, send_bytes, send_off, recv, recv_bytes,
                              recv_off, why, why_size);
    if (st == MOEFUSE_OK && (e = cudaEventRecord(t->done, t->side)) != cudaSuccess)
        st = cuda_why(e, "cudaEventRecord", why, why_size);
    device_leave(t, previous);
    return st;
}

static moefuse_status nccl_join(void *tp, char *why, size_t why_size)
{
    nccl_rank *t = tp;
    if (!t->side)
        return MOEFUSE_OK;
    const int previous = device_enter(t);
    const cudaError_t e = cudaStreamWaitEvent(rank_stream(t), t->done, 0);
    device_leave(t, previous);
    return e == cudaSuccess ? MOEFUSE_OK : cuda_why(e, "cudaStreamWaitEvent", why, why_size);
}

static moefuse_status nccl_host_exchange(nccl_rank *t, const void *send,
                                         const size_t *send_bytes, const size_t *send_off,
                                         void *recv, const size_t *recv_bytes,
                                         const size_t *recv_off, char *why, size_t why_size)
{
    size_t sent = 0, got = 0;
    for (int p = 0; p < t->world; p++) {
        sent = send_off[p] + send_bytes[p] > sent ? send_off[p] + send_bytes[p] : sent;
        got = recv_off[p] + recv_bytes[p] > got ? recv_off[p] + recv_bytes[p] : got;
    }
    const size_t need = sent + got;
    cudaError_t e = cudaSuccess;
    if (need > t->scratch_bytes) {
        if (t->scratch)
            cudaFree(t->scratch);
        t->scratch = NULL;
        t->scratch_bytes = 0;
        e = cudaMalloc(&t->scratch, need);
        if (e == cudaSuccess)
            t->scratch_bytes = need;
    }
    const cudaStream_t stream = rank_stream(t);
    char *dsend = t->scratch, *drecv = (char *)t->scratch + sent;
    if (e == cudaSuccess && sent > 0)
        e = cudaMemcpyAsync(dsend, send, sent, cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess)
        return cuda_why(e, "cudaMalloc / cudaMemcpyAsync", why, why_size);
    MF_TRY(nccl_all_to_all(t, dsend, send_bytes, send_off, drecv, recv_bytes, recv_off, why,
                           why_size));
    if (got > 0)
        e = cudaMemcpyAsync(recv, drecv, got, cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(stream);
    return e == cudaSuccess ? MOEFUSE_OK
                            : cuda_why(e, "cudaMemcpyAsync / cudaStreamSynchronize", why, why_size);
}

static moefuse_status nccl_all_to_all_host(void *tp, const void *send, const size_t *send_bytes,
                                           const size_t *send_off, void *recv,
                                           const size_t *recv_bytes, const size_t *recv_off,
                                           char *why, size_t why_size)
{
    nccl_rank *t = tp;
    const int previous = device_enter(t);
    const moefuse_status st = nccl_host_exchange(t, send, send_bytes, send_off, recv, recv_bytes,
                                                 recv_off, why, why_size);
    device_leave(t, previous);
    return st;
}

static void nccl_destroy(void *tp)
{
    nccl_rank *t = tp;
    if (!t)
        return;
    if (t->scratch)
        cudaFree(t->scratch);
    if (t->side) {
        cudaStreamSynchronize(t->side);
        cudaStreamDestroy(t->side);
        cudaEventDestroy(t->ready);
        cudaEventDestroy(t->done);
    }
    if (t->own && t->comm)
        nccl.comm_destroy(t->comm);
    free(t);
}

static const mf_ep_transport_i nccl_i = {
    .all_to_all = nccl_all_to_all,
    .all_to_all_beside = nccl_all_to_all_beside,
    .join = nccl_join,
    .all_to_all_host = nccl_all_to_all_host,
    .destroy = nccl_destroy,
};

moefuse_status mf_cuda_ep_unique_id(moefuse_context *ctx, void *state, void *id)
{
    (void)state;
    static const char op[] = "ep_unique_id_create";
    MF_TRY(nccl_load(ctx, op));
    mf_nccl_id u;
    const mf_nccl_result r = nccl.get_unique_id(&u);
    if (r != 0)
        return nccl_fail(ctx, op, "ncclGetUniqueId", r);
    memcpy(id, u.internal, sizeof u.internal);
    return MOEFUSE_OK;
}

moefuse_status mf_cuda_ep_transport(moefuse_context *ctx, void *state, const void *id,
                                    void *comm, int32_t rank, int32_t world,
                                    mf_ep_transport *out)
{
    static const char op[] = "ep_group_create";
    MF_TRY(nccl_load(ctx, op));
    nccl_rank *t = calloc(1, sizeof *t);
    if (!t)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op);
    t->state = (const cuda_state *)state;
    t->device = t->state->device;
    t->world = world;
    if (comm) {
        t->comm = comm;
    } else {
        mf_nccl_id u;
        memcpy(u.internal, id, sizeof u.internal);
        const mf_nccl_result r = nccl.comm_init_rank(&t->comm, world, u, rank);
        if (r != 0) {
            free(t);
            return nccl_fail(ctx, op, "ncclCommInitRank", r);
        }
        t->own = 1;
    }
    out->i = &nccl_i;
    out->t = t;
    return MOEFUSE_OK;
}
