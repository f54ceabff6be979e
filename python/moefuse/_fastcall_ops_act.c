/*
 * moefuse._fastcall entry points for the activation and quantization calls: act_quant,
 * act_quant_masked, act_mul, quant, dequant. Each reads its operands and options, enters the
 * Context and runs the library call; False when the fast path does not take it (_fastcall.c).
 */
#include "_fastcall.h"

/* act_quant(ctx, x, row_scale, q, scales, activation, order, limit, intermediate, alpha,
 *           up_offset, group_size, scale_layout, ue8m0, eps) */
PyObject *fc_act_quant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("act_quant", 15);
    int place = PLACE_NONE;
    moefuse_tensor x, rs, q, sc;
    moefuse_act_quant_options opt = {0};
    if (!READ_TENSORS(args + 1, &place, &x, &rs, &q, &sc) || !read_act(args + 5, &opt.act) ||
        !read_quant(args + 11, &opt.quant))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN(s, S.act_quant(s.handle, &x, optional(&rs), &q, &sc, &opt));
}

/* act_quant_masked(ctx, x, counts, row_scale, expert_scale, q, scales, activation, order,
 *                  limit, intermediate, alpha, up_offset, group_size, scale_layout, ue8m0, eps,
 *                  zero_tail) */
PyObject *fc_act_quant_masked(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("act_quant_masked", 18);
    int place = PLACE_NONE;
    moefuse_tensor x, counts, rs, es, q, sc;
    moefuse_act_quant_options opt = {0};
    if (!READ_TENSORS(args + 1, &place, &x, &counts, &rs, &es, &q, &sc) ||
        !read_act(args + 7, &opt.act) || !read_quant(args + 13, &opt.quant) ||
        !read_bool(args[17], &opt.zero_tail))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN_WITH_WORKSPACE(s, place,
                       S.act_quant_masked_workspace_size(s.handle, &x, &counts, optional(&rs),
                                                         optional(&es), &q, &sc, &opt, &bytes_),
                       S.act_quant_masked(s.handle, &x, &counts, optional(&rs), optional(&es),
                                          &q, &sc, &opt));
}

/* act_mul(ctx, x, row_scale, out, activation, order, limit, intermediate, alpha, up_offset) */
PyObject *fc_act_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("act_mul", 10);
    int place = PLACE_NONE;
    moefuse_tensor x, rs, out;
    moefuse_act_options opt = {0};
    if (!READ_TENSORS(args + 1, &place, &x, &rs, &out) || !read_act(args + 4, &opt))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN(s, S.act_mul(s.handle, &x, optional(&rs), &out, &opt));
}

/* quant(ctx, x, q, scales, group_size, scale_layout, ue8m0, eps) */
PyObject *fc_quant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("quant", 8);
    int place = PLACE_NONE;
    moefuse_tensor x, q, sc;
    moefuse_quant_options opt = {0};
    if (!READ_TENSORS(args + 1, &place, &x, &q, &sc) || !read_quant(args + 4, &opt))
        return not_ready(FALL_BACK);
    session s;
    ENTER(s, args[0], place);
    RUN(s, S.quant(s.handle, &x, &q, &sc, &opt));
}

/* dequant(ctx, q, scales, out, group_size, scale_layout, ue8m0, eps); ue8m0 None: the scales
 * are u8 exponents. */
PyObject *fc_dequant(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    CHECK_ARGS("dequant", 8);
    int place = PLACE_NONE;
    moefuse_tensor q, sc, out;
    moefuse_quant_options opt = {0};
    PyObject *quant_args[4] = {args[4], args[5], args[6] == Py_None ? Py_False : args[6], args[7]};
    if (!READ_TENSORS(args + 1, &place, &q, &sc, &out) || !read_quant(quant_args, &opt))
        return not_ready(FALL_BACK);
    if (args[6] == Py_None)
        opt.ue8m0 = args[2] != Py_None && sc.dtype == MOEFUSE_U8;
    session s;
    ENTER(s, args[0], place);
    /* scales is required: NULL only when not given (an empty one may have no data) */
    RUN(s, S.dequant(s.handle, &q, args[2] != Py_None ? &sc : NULL, &out, &opt));
}
