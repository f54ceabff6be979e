/*
 * moefuse._fastcall entry points for the MoE layer and its routing: moe_gate, moe_final,
 * moe_forward, topk_softmax. Each reads its operands and options, enters the Context and runs
 * the library call; False when the fast path does not take it (_fastcall.c). Shared experts
 * are not read here: ops.py sends calls with them through ctypes.
 */
#include "_fastcall.h"

#include <string.h>

/* moe_gate(ctx, x, w1, b1, topk_ids, expert_map, h, activation, order, limit, alpha,
 *          up_offset) */
PyObject *fc_moe_gate(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("moe_gate", 12);
    int place = PLACE_NONE;
    moefuse_tensor x, w1, b1, h;
    moefuse_routing route;
    moefuse_moe_options opt = {0};
    memset(&route, 0, sizeof route);
    if (!READ_TENSORS(args + 1, &place, &x, &w1, &b1, &route.topk_ids, &route.expert_map, &h) ||
        !read_moe(args + 7, &opt))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN_WITH_WORKSPACE(s, place,
                       S.moe_gate_workspace_size(s.handle, &x, &w1, optional(&b1), &route, &h,
                                                 &opt, &bytes_),
                       S.moe_gate(s.handle, &x, &w1, optional(&b1), &route, &h, &opt));
}

/* moe_final(ctx, h, w2, b2, topk_ids, topk_weights, expert_map, out) */
PyObject *fc_moe_final(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("moe_final", 8);
    int place = PLACE_NONE;
    moefuse_tensor h, w2, b2, out;
    moefuse_routing route;
    moefuse_moe_options opt = {0}; /* moe_final's options are the defaults (ops.py) */
    memset(&route, 0, sizeof route);
    if (!READ_TENSORS(args + 1, &place, &h, &w2, &b2, &route.topk_ids, &route.topk_weights,
                      &route.expert_map, &out))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN_WITH_WORKSPACE(s, place,
                       S.moe_final_workspace_size(s.handle, &h, &w2, optional(&b2), &route, &out,
                                                  &opt, &bytes_),
                       S.moe_final(s.handle, &h, &w2, optional(&b2), &route, &out, &opt));
}

/* moe_forward(ctx, x, w1, w2, b1, b2, topk_ids, topk_weights, expert_map, out,
 *             activation, order, limit, alpha, up_offset) */
PyObject *fc_moe_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("moe_forward", 15);
    int place = PLACE_NONE;
    moefuse_tensor x, w1, w2, b1, b2, out;
    moefuse_routing route;
    moefuse_moe_options opt = {0};
    memset(&route, 0, sizeof route);
    if (!READ_TENSORS(args + 1, &place, &x, &w1, &w2, &b1, &b2, &route.topk_ids,
                      &route.topk_weights, &route.expert_map, &out) ||
        !read_moe(args + 10, &opt))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN_WITH_WORKSPACE(s, place,
                       S.moe_forward_workspace_size(s.handle, &x, &w1, &w2, optional(&b1),
                                                    optional(&b2), &route, &out, &opt, &bytes_),
                       S.moe_forward(s.handle, &x, &w1, &w2, optional(&b1), optional(&b2), &route,
                                     &out, &opt));
}

/* topk_softmax(ctx, logits, renormalize, ids, weights) */
PyObject *fc_topk_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("topk_softmax", 5);
    int place = PLACE_NONE;
    moefuse_tensor logits, ids, weights;
    int32_t renormalize;
    /* in argument order: renormalize is read between the tensors */
    if (!read_tensor(args[1], &logits, &place) || !read_bool(args[2], &renormalize) ||
        !READ_TENSORS(args + 3, &place, &ids, &weights))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN(s, S.topk_softmax(s.handle, &logits, renormalize, &ids, &weights));
}
