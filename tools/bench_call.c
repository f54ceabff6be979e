/*
 * One call of `moefuse bench`'s op on the operands its setup made, and the workspace that
 * call takes (for --graph, which must not allocate inside the capture).
 */
#include "bench.h"

#include <string.h>

/* One call of the op; with router=1, moefuse_topk_softmax on the logits first. */
moefuse_status bench_call(bench *b)
{
    const char *n = b->op->name;
    moefuse_context *c = b->ctx;
    if (strcmp(n, "act_quant") == 0)
        return moefuse_act_quant(c, &b->x, NULL, &b->out, &b->scales, &b->aq);
    if (strcmp(n, "act_quant_masked") == 0)
        return moefuse_act_quant_masked(c, &b->x, &b->counts, NULL, NULL, &b->out, &b->scales,
                                        &b->aq);
    if (strcmp(n, "act_mul") == 0)
        return moefuse_act_mul(c, &b->x, NULL, &b->out, &b->ao);
    if (strcmp(n, "quant") == 0)
        return moefuse_quant(c, &b->x, &b->out, &b->scales, &b->qo);
    if (strcmp(n, "dequant") == 0)
        return moefuse_dequant(c, &b->x, &b->scales, &b->out, &b->qo);
    if (strcmp(n, "topk_softmax") == 0)
        return moefuse_topk_softmax(c, &b->x, 1, &b->route.topk_ids, &b->route.topk_weights);
    if (strcmp(n, "topk_route") == 0)
        return moefuse_topk_route(c, &b->x, NULL, b->has_choice_bias ? &b->choice_bias : NULL,
                                  &b->ro, &b->route.topk_ids, &b->route.topk_weights);
    if (strcmp(n, "routing_metadata") == 0)
        return moefuse_routing_metadata(c, &b->route, b->block_size, &b->meta);
    if (b->router) { /* the layer's routing from its logits, as an engine's step runs it */
        moefuse_status st = moefuse_topk_softmax(c, &b->logits, 1, &b->route.topk_ids,
                                                 &b->route.topk_weights);
        if (st != MOEFUSE_OK)
            return st;
    }
    if (strcmp(n, "moe_gate") == 0)
        return moefuse_moe_gate(c, &b->x, &b->w1, NULL, &b->route, &b->h, &b->mo);
    if (strcmp(n, "moe_final") == 0)
        return moefuse_moe_final(c, &b->h, &b->w2, NULL, &b->route, &b->out, &b->mo);
    if (strcmp(n, "moe_forward_fp8") == 0)
        return moefuse_moe_forward_fp8(c, &b->x, b->xs.data ? &b->xs : NULL, &b->w1, &b->w1s,
                                       &b->w2, &b->w2s, NULL, NULL, &b->route, &b->out, &b->fo);
    if (strcmp(n, "moe_masked_fp8") == 0)
        return moefuse_moe_masked_fp8(c, &b->x, NULL, &b->counts, &b->w1, &b->w1s, &b->w2,
                                      &b->w2s, NULL, NULL, &b->out, &b->fo);
    return moefuse_moe_forward(c, &b->x, &b->w1, &b->w2, NULL, NULL, &b->route, &b->out, &b->mo);
}

/* The workspace bench_call takes: the query of each call it makes, the larger of the two. */
moefuse_status bench_workspace_size(bench *b, size_t *bytes)
{
    const char *n = b->op->name;
    moefuse_context *c = b->ctx;
    size_t router = 0;
    moefuse_status st = MOEFUSE_OK;
    if (b->router)
        st = moefuse_topk_softmax_workspace_size(c, &b->logits, 1, &b->route.topk_ids,
                                                 &b->route.topk_weights, &router);
    if (st != MOEFUSE_OK)
        return st;
    if (strcmp(n, "act_quant") == 0)
        st = moefuse_act_quant_workspace_size(c, &b->x, NULL, &b->out, &b->scales, &b->aq, bytes);
    else if (strcmp(n, "act_quant_masked") == 0)
        st = moefuse_act_quant_masked_workspace_size(c, &b->x, &b->counts, NULL, NULL, &b->out,
                                                     &b->scales, &b->aq, bytes);
    else if (strcmp(n, "act_mul") == 0)
        st = moefuse_act_mul_workspace_size(c, &b->x, NULL, &b->out, &b->ao, bytes);
    else if (strcmp(n, "quant") == 0)
        st = moefuse_quant_workspace_size(c, &b->x, &b->out, &b->scales, &b->qo, bytes);
    else if (strcmp(n, "dequant") == 0)
        st = moefuse_dequant_workspace_size(c, &b->x, &b->scales, &b->out, &b->qo, bytes);
    else if (strcmp(n, "topk_softmax") == 0)
        st = moefuse_topk_softmax_workspace_size(c, &b->x, 1, &b->route.topk_ids,
                                                 &b->route.topk_weights, bytes);
    else if (strcmp(n, "topk_route") == 0)
        st = moefuse_topk_route_workspace_size(c, &b->x, NULL,
                                               b->has_choice_bias ? &b->choice_bias : NULL,
                                               &b->ro, &b->route.topk_ids,
                                               &b->route.topk_weights, bytes);
    else if (strcmp(n, "routing_metadata") == 0)
        st = moefuse_routing_metadata_workspace_size(c, &b->route, b->block_size, &b->meta,
                                                     bytes);
    else if (strcmp(n, "moe_gate") == 0)
        st = moefuse_moe_gate_workspace_size(c, &b->x, &b->w1, NULL, &b->route, &b->h, &b->mo,
                                             bytes);
    else if (strcmp(n, "moe_final") == 0)
        st = moefuse_moe_final_workspace_size(c, &b->h, &b->w2, NULL, &b->route, &b->out, &b->mo,
                                              bytes);
    else if (strcmp(n, "moe_forward_fp8") == 0)
        st = moefuse_moe_forward_fp8_workspace_size(c, &b->x, b->xs.data ? &b->xs : NULL, &b->w1,
                                                    &b->w1s, &b->w2, &b->w2s, NULL, NULL,
                                                    &b->route, &b->out, &b->fo, bytes);
    else if (strcmp(n, "moe_masked_fp8") == 0)
        st = moefuse_moe_masked_fp8_workspace_size(c, &b->x, NULL, &b->counts, &b->w1, &b->w1s,
                                                   &b->w2, &b->w2s, NULL, NULL, &b->out, &b->fo,
                                                   bytes);
    else
        st = moefuse_moe_forward_workspace_size(c, &b->x, &b->w1, &b->w2, NULL, NULL, &b->route,
                                                &b->out, &b->mo, bytes);
    if (st == MOEFUSE_OK && router > *bytes)
        *bytes = router;
    return st;
}
