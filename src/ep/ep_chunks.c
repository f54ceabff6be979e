/* The layer's chunks of experts (ep_chunks.h): sizes, starts and the experts' order. A rank
   numbers its local experts in global order (ep_group.c), so runs sorted by either agree. */
#include "ep/ep_chunks.h"

#include "core/core.h"

#include <stdlib.h>
#include <string.h>

void mf_ep_chunks_free(mf_ep_chunks *c)
{
    free(c->rows);
    free(c->order);
    memset(c, 0, sizeof *c);
}

moefuse_status mf_ep_chunks_make(moefuse_context *ctx, const char *op, const moefuse_ep_group *g,
                                 const mf_ep_route *r, int32_t count, mf_ep_chunks *c)
{
    memset(c, 0, sizeof *c);
    const int32_t W = g->world, C = count;
    const int64_t R = r->n_recv, cw = (int64_t)C * W;
    c->count = C;
    c->world = W;
    c->rows = calloc((size_t)(4 * cw + W), sizeof *c->rows);
    c->order = malloc((sizeof *c->order + sizeof *c->expert) * (size_t)(R > 0 ? R : 1));
    if (!c->rows || !c->order) {
        mf_ep_chunks_free(c);
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate the chunks", op);
    }
    c->start = c->rows + cw;
    c->back = c->start + cw;
    c->back_at = c->back + cw;
    int64_t *local = c->back_at + cw; /* [W]: each rank's local experts */
    c->expert = (int32_t *)(c->order + (R > 0 ? R : 1));
    for (int32_t e = 0; e < g->experts; e++)
        local[g->owner[e]]++;
    /* rows in: by source, then local expert (ep_route.c), counted per chunk */
    int64_t i = 0;
    for (int32_t p = 0; p < W; p++)
        for (int64_t n = 0; n < (int64_t)r->received[p]; n++, i++)
            c->rows[(int64_t)mf_ep_chunk_of(r->recv_expert[i], g->local_experts, C) * W + p]++;
    for (int64_t q = 0, at = 0; q < cw; q++) { /* chunk-major, then source */
        c->start[q] = at;
        at += c->rows[q];
    }
    int64_t *next = c->back; /* borrowed as the fill of each run, then cleared */
    memcpy(next, c->start, sizeof *next * (size_t)cw);
    i = 0;
    for (int32_t p = 0; p < W; p++)
        for (int64_t n = 0; n < (int64_t)r->received[p]; n++, i++) {
            const int32_t e = r->recv_expert[i];
            const int64_t at = next[(int64_t)mf_ep_chunk_of(e, g->local_experts, C) * W + p]++;
            c->order[i] = at;
            c->expert[at] = e;
        }
    memset(next, 0, sizeof *next * (size_t)cw);
    /* rows out: this rank's slots per global expert, by the expert's rank and chunk there */
    for (int32_t e = 0; e < g->experts; e++) {
        const int32_t p = g->owner[e];
        c->back[(int64_t)mf_ep_chunk_of(g->local[e], local[p], C) * W + p] += r->per_expert[e];
    }
    size_t sent_at = 0;
    for (int32_t p = 0; p < W; p++) { /* each rank's run, sorted by its local expert */
        int64_t at = (int64_t)sent_at;
        for (int32_t k = 0; k < C; k++) {
            c->back_at[(int64_t)k * W + p] = at;
            at += c->back[(int64_t)k * W + p];
        }
        sent_at += r->sent[p];
    }
    return MOEFUSE_OK;
}
