/*
 * The in-process transport: the ranks are threads of one program, each with its own context
 * and group, sharing one world. A collective posts each rank's buffers, waits for every rank,
 * copies what the others send it, and waits again so that no rank reuses its buffers while
 * another still reads them. Rows in backend memory go through the backend's ep_copy, after
 * each rank has waited for its own queued work (contexts on one device share its memory);
 * the tests' transport.
 */
#include "core/core.h"
#include "ep/ep_internal.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct inproc_post {
    const char *send;
    const size_t *send_bytes, *send_off;
    const size_t *recv_bytes;
} inproc_post;

struct mf_ep_inproc_world {
    int32_t world;
    pthread_mutex_t lock;
    pthread_cond_t turn;
    int32_t arrived;
    unsigned long generation;
    inproc_post *post; /* [world] */
};

typedef struct inproc_rank {
    mf_ep_inproc_world *w;
    int32_t rank;
    moefuse_context *ctx; /* the rank's context: its backend copies the rows */
} inproc_rank;

mf_ep_inproc_world *mf_ep_inproc_world_create(int32_t world)
{
    if (world < 1)
        return NULL;
    mf_ep_inproc_world *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->post = calloc((size_t)world, sizeof *w->post);
    if (!w->post) {
        free(w);
        return NULL;
    }
    w->world = world;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->turn, NULL);
    return w;
}

void mf_ep_inproc_world_destroy(mf_ep_inproc_world *w)
{
    if (!w)
        return;
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->turn);
    free(w->post);
    free(w);
}

/* Every rank arrives before any leaves. */
static void inproc_barrier(mf_ep_inproc_world *w)
{
    pthread_mutex_lock(&w->lock);
    const unsigned long gen = w->generation;
    if (++w->arrived == w->world) {
        w->arrived = 0;
        w->generation++;
        pthread_cond_broadcast(&w->turn);
    } else {
        while (gen == w->generation)
            pthread_cond_wait(&w->turn, &w->lock);
    }
    pthread_mutex_unlock(&w->lock);
}

/* The collective, copying with memcpy (host) or the backend's ep_copy (rows). */
static moefuse_status inproc_exchange(inproc_rank *me, bool rows, const void *send,
                                      const size_t *send_bytes, const size_t *send_off,
                                      void *recv, const size_t *recv_bytes,
                                      const size_t *recv_off, char *why, size_t why_size)
{
    mf_ep_inproc_world *w = me->w;
    const int32_t r = me->rank;
    moefuse_context *ctx = me->ctx;
    moefuse_status st = MOEFUSE_OK;
    if (rows && ctx->backend->synchronize) /* this rank's send rows are written */
        st = ctx->backend->synchronize(ctx, ctx->state);
    w->post[r] = (inproc_post){send, send_bytes, send_off, recv_bytes};
    inproc_barrier(w);
    /* sizes checked pairwise both ways, so that both ends of a mismatch fail */
    int32_t bad = -1;
    for (int32_t p = 0; p < w->world && bad < 0; p++)
        if (w->post[p].send_bytes[r] != recv_bytes[p] || send_bytes[p] != w->post[p].recv_bytes[r])
            bad = p;
    for (int32_t p = 0; p < w->world && bad < 0 && st == MOEFUSE_OK; p++) {
        if (recv_bytes[p] == 0)
            continue;
        char *dst = (char *)recv + recv_off[p];
        const char *src = w->post[p].send + w->post[p].send_off[r];
        if (rows)
            st = ctx->backend->ep_copy(ctx, ctx->state, dst, src, recv_bytes[p]);
        else
            memcpy(dst, src, recv_bytes[p]);
    }
    inproc_barrier(w); /* the others have read this rank's send buffer */
    if (bad >= 0) {
        snprintf(why, why_size,
                 "rank %d and rank %d disagree on the bytes between them (in-process transport)",
                 (int)r, (int)bad);
        return MOEFUSE_ERR_INTERNAL;
    }
    if (st != MOEFUSE_OK)
        snprintf(why, why_size, "a copy between ranks failed: %s", moefuse_last_error(ctx));
    return st;
}

static moefuse_status inproc_all_to_all(void *t, const void *send, const size_t *send_bytes,
                                        const size_t *send_off, void *recv,
                                        const size_t *recv_bytes, const size_t *recv_off,
                                        char *why, size_t why_size)
{
    return inproc_exchange(t, true, send, send_bytes, send_off, recv, recv_bytes, recv_off, why,
                           why_size);
}

static moefuse_status inproc_all_to_all_host(void *t, const void *send,
                                             const size_t *send_bytes, const size_t *send_off,
                                             void *recv, const size_t *recv_bytes,
                                             const size_t *recv_off, char *why, size_t why_size)
{
    return inproc_exchange(t, false, send, send_bytes, send_off, recv, recv_bytes, recv_off, why,
                           why_size);
}

static void inproc_destroy(void *t)
{
    free(t);
}

static const mf_ep_transport_i inproc_i = {
    .all_to_all = inproc_all_to_all,
    .all_to_all_host = inproc_all_to_all_host,
    .destroy = inproc_destroy,
};

moefuse_status mf_ep_group_create_inproc(moefuse_context *ctx, mf_ep_inproc_world *w,
                                         const moefuse_ep_config *config,
                                         moefuse_ep_group **out)
{
    static const char op[] = "ep_group_create";
    MF_TRY(mf_enter(ctx, op));
    if (out)
        *out = NULL;
    if (!w || !config || !out)
        return mf_leave(ctx, mf_error(ctx, MOEFUSE_ERR_NULL_POINTER, "%s: %s is NULL", op,
                                      !w ? "world" : !config ? "config" : "out"));
    if (config->world != w->world)
        return mf_leave(ctx, mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                                      "%s: config.world is %d; the in-process world has %d ranks",
                                      op, (int)config->world, (int)w->world));
    inproc_rank *me = malloc(sizeof *me);
    if (!me)
        return mf_leave(ctx, mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate", op));
    me->w = w;
    me->rank = config->rank;
    me->ctx = ctx;
    mf_ep_transport tr = {&inproc_i, me};
    moefuse_status st = mf_ep_group_make(ctx, op, config, tr, out);
    if (st != MOEFUSE_OK)
        free(me);
    return mf_leave(ctx, st);
}
