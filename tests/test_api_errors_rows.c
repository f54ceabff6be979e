/* test_api_errors: act_quant, act_quant_masked, act_mul, quant and dequant. */
#include "test_api_errors.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ act_quant */
tbuf *X, *RS, *Q, *SC;
void aq_setup(void)
{
    X = tb_upload_unif(tb_new2("x", MOEFUSE_F32, 4, 256, 0, 1), -1, 1);
    RS = tb_upload_unif(tb_new1("row_scale", MOEFUSE_F32, 4, 1), 0.5, 1);
    Q = tb_new2("q", MOEFUSE_F8_E4M3, 4, 128, 0, 0);
    SC = tb_new2("scales", MOEFUSE_F32, 4, 1, 0, 0);
}
moefuse_status aq(const moefuse_tensor *x, const moefuse_tensor *rs, const moefuse_tensor *q,
                  const moefuse_tensor *sc, const moefuse_act_quant_options *o)
{
    return moefuse_act_quant(g_ctx, x, rs, q, sc, o);
}

START_TEST(t_act_quant_pointers)
{
    aq_setup();
    EXPECT_CTX(moefuse_act_quant(NULL, T(X), T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_NULL_POINTER, "act_quant", NULL, "ctx NULL", NULL);
    EXPECT(aq(NULL, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_NULL_POINTER, "act_quant", "x", "x NULL");
    EXPECT(aq(T(X), T(RS), NULL, T(SC), NULL), MOEFUSE_ERR_NULL_POINTER, "act_quant", "q", "q NULL");
    EXPECT(aq(T(X), T(RS), T(Q), NULL, NULL), MOEFUSE_ERR_NULL_POINTER, "act_quant", "scales", "scales NULL");
    moefuse_tensor t = X->t;
    t.data = NULL;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_NULL_POINTER, "act_quant", "x", "x data NULL");
    t = Q->t;
    t.data = NULL;
    EXPECT(aq(T(X), T(RS), &t, T(SC), NULL), MOEFUSE_ERR_NULL_POINTER, "act_quant", "q", "q data NULL");
    t = SC->t;
    t.data = NULL;
    EXPECT(aq(T(X), T(RS), T(Q), &t, NULL), MOEFUSE_ERR_NULL_POINTER, "act_quant", "scales", "scales data NULL");
    /* a valid call still works and row_scale data NULL means absent */
    t = RS->t;
    t.data = NULL;
    HCHECK(CALL(aq(T(X), &t, T(Q), T(SC), NULL)) == MOEFUSE_OK, "act_quant valid call failed: %s", moefuse_last_error(g_ctx));
    HCHECK(moefuse_last_error(g_ctx) && moefuse_last_error(g_ctx)[0] == 0, "last_error not empty after success");
}
END_TEST

START_TEST(t_act_quant_shapes)
{
    aq_setup();
    moefuse_tensor t;
    t = X->t; t.rank = 3; t.shape[2] = 1; t.stride[2] = 1;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_SHAPE, "act_quant", "x", "x rank 3");
    t = X->t; t.shape[1] = 255;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_SHAPE, "act_quant", "x", "x width odd");
    t = X->t; t.shape[1] = 0;
    moefuse_tensor q0 = Q->t; q0.shape[1] = 0;
    EXPECT(aq(&t, T(RS), &q0, T(SC), NULL), MOEFUSE_ERR_SHAPE, "act_quant", NULL, "H = 0");
    t = X->t; t.shape[0] = -1;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_SHAPE, "act_quant", "x", "x negative dim");
    t = Q->t; t.shape[1] = 127;
    EXPECT(aq(T(X), T(RS), &t, T(SC), NULL), MOEFUSE_ERR_SHAPE, "act_quant", "q", "q width mismatch");
    t = Q->t; t.shape[0] = 3;
    EXPECT(aq(T(X), T(RS), &t, T(SC), NULL), MOEFUSE_ERR_SHAPE, "act_quant", "q", "q rows mismatch");
    t = SC->t; t.shape[0] = 3;
    EXPECT(aq(T(X), T(RS), T(Q), &t, NULL), MOEFUSE_ERR_SHAPE, "act_quant", "scales", "scales rows");
    t = RS->t; t.shape[0] = 3;
    EXPECT(aq(T(X), &t, T(Q), T(SC), NULL), MOEFUSE_ERR_SHAPE, "act_quant", "row_scale", "row_scale length");
    /* column-major scales must be [Gn, round_up(T,4)] */
    moefuse_act_quant_options o = {0};
    o.quant.scale_layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    t = SC->t; /* [4,1]: wrong for column-major ([1,4]) */
    EXPECT(aq(T(X), T(RS), T(Q), &t, &o), MOEFUSE_ERR_SHAPE, "act_quant", "scales", "column-major shape");
    /* H % G != 0: H = 96 with G = 64 and with the default 128 */
    moefuse_tensor x96 = X->t, q96 = Q->t;
    x96.shape[1] = 192;
    q96.shape[1] = 96;
    o.quant.scale_layout = MOEFUSE_SCALE_ROW_MAJOR;
    o.quant.group_size = 64;
    EXPECT(aq(&x96, T(RS), &q96, T(SC), &o), MOEFUSE_ERR_SHAPE, "act_quant", NULL, "H % G (G=64, H=96)");
    o.quant.group_size = 0;
    EXPECT(aq(&x96, T(RS), &q96, T(SC), &o), MOEFUSE_ERR_SHAPE, "act_quant", NULL, "H % G (G=128, H=96)");
}
END_TEST

START_TEST(t_act_quant_dtypes)
{
    aq_setup();
    moefuse_tensor t;
    moefuse_dtype bad_x[] = {MOEFUSE_I32, MOEFUSE_F8_E4M3, MOEFUSE_I8, MOEFUSE_U8};
    for (int i = 0; i < 4; i++) {
        t = X->t; t.dtype = bad_x[i];
        EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_DTYPE, "act_quant", "x", "x dtype");
    }
    moefuse_dtype bad_q[] = {MOEFUSE_F16, MOEFUSE_U8, MOEFUSE_F32};
    for (int i = 0; i < 3; i++) {
        t = Q->t; t.dtype = bad_q[i];
        if (bad_q[i] == MOEFUSE_F32) t.shape[1] = 32; /* stays inside the buffer */
        EXPECT(aq(T(X), T(RS), &t, T(SC), NULL), MOEFUSE_ERR_DTYPE, "act_quant", "q", "q dtype");
    }
    t = SC->t; t.dtype = MOEFUSE_F16;
    EXPECT(aq(T(X), T(RS), T(Q), &t, NULL), MOEFUSE_ERR_DTYPE, "act_quant", "scales", "scales f16");
    t = SC->t; t.dtype = MOEFUSE_U8;
    EXPECT(aq(T(X), T(RS), T(Q), &t, NULL), MOEFUSE_ERR_DTYPE, "act_quant", "scales", "scales u8 without ue8m0");
    t = SC->t; t.dtype = MOEFUSE_I32;
    EXPECT(aq(T(X), T(RS), T(Q), &t, NULL), MOEFUSE_ERR_DTYPE, "act_quant", "scales", "scales i32 row-major");
    moefuse_act_quant_options o = {0};
    o.quant.scale_layout = MOEFUSE_SCALE_PACKED_UE8M0;
    tbuf *pk = tb_new2("packed", MOEFUSE_F32, 1, 4, 0, 0); /* right shape, wrong dtype */
    EXPECT(aq(T(X), T(RS), T(Q), T(pk), &o), MOEFUSE_ERR_DTYPE, "act_quant", "scales", "packed scales f32");
    t = RS->t; t.dtype = MOEFUSE_BF16;
    EXPECT(aq(T(X), &t, T(Q), T(SC), NULL), MOEFUSE_ERR_DTYPE, "act_quant", "row_scale", "row_scale bf16");
}
END_TEST

START_TEST(t_act_quant_strides_align)
{
    aq_setup();
    moefuse_tensor t;
    t = X->t; t.stride[1] = 2; t.shape[1] = 128;
    moefuse_tensor q64 = Q->t; q64.shape[1] = 64;
    EXPECT(aq(&t, T(RS), &q64, T(SC), NULL), MOEFUSE_ERR_STRIDE, "act_quant", "x", "x inner stride 2");
    t = X->t; t.stride[0] = 100;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_STRIDE, "act_quant", "x", "x rows overlap");
    t = X->t; t.stride[0] = -256;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_STRIDE, "act_quant", "x", "x negative stride");
    t = Q->t; t.stride[0] = 64;
    EXPECT(aq(T(X), T(RS), &t, T(SC), NULL), MOEFUSE_ERR_STRIDE, "act_quant", "q", "q rows overlap");
    t = X->t; t.offset += 2;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_ALIGNMENT, "act_quant", "x", "x misaligned");
    t = SC->t; t.offset -= 1;
    EXPECT(aq(T(X), T(RS), T(Q), &t, NULL), MOEFUSE_ERR_ALIGNMENT, "act_quant", "scales", "scales misaligned");
    t = RS->t; t.offset += 3;
    EXPECT(aq(T(X), &t, T(Q), T(SC), NULL), MOEFUSE_ERR_ALIGNMENT, "act_quant", "row_scale", "row_scale misaligned");
    t = X->t; t.offset = -4;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), MOEFUSE_ERR_INVALID_ARGUMENT, "act_quant", "x", "x negative offset");
}
END_TEST

START_TEST(t_act_quant_options)
{
    aq_setup();
    struct { const char *arg; int field; double v; } cases[] = {
        {"activation", 0, 4}, {"activation", 0, -1}, {"order", 1, 3}, {"intermediate", 2, 2},
        {"scale_layout", 3, 3}, {"group_size", 4, 48}, {"group_size", 4, -128}, {"group_size", 4, 256},
        {"limit", 5, -1}, {"limit", 5, NAN}, {"eps", 6, -1}, {"eps", 6, INFINITY}, {"eps", 6, NAN},
        {"alpha", 7, 1.702}, {"alpha", 8, -1}, {"alpha", 8, NAN}, {"alpha", 8, INFINITY},
        {"up_offset", 9, NAN}, {"up_offset", 9, -INFINITY},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moefuse_act_quant_options o = {0};
        switch (cases[i].field) {
        case 0: o.act.activation = (moefuse_activation)(int)cases[i].v; break;
        case 1: o.act.order = (moefuse_gate_order)(int)cases[i].v; break;
        case 2: o.act.intermediate = (moefuse_rounding)(int)cases[i].v; break;
        case 3: o.quant.scale_layout = (moefuse_scale_layout)(int)cases[i].v; break;
        case 4: o.quant.group_size = (int64_t)cases[i].v; break;
        case 5: o.act.limit = (float)cases[i].v; break;
        case 6: o.quant.eps = (float)cases[i].v; break;
        case 7: o.act.alpha = (float)cases[i].v; break; /* silu takes no alpha */
        case 8:
            o.act.activation = MOEFUSE_ACT_SILU_ALPHA;
            o.act.alpha = (float)cases[i].v;
            break;
        case 9: o.act.up_offset = (float)cases[i].v; break;
        }
        EXPECT(aq(T(X), T(RS), T(Q), T(SC), &o), MOEFUSE_ERR_INVALID_ARGUMENT, "act_quant", cases[i].arg,
               h_fmt("option %s = %g", cases[i].arg, cases[i].v));
    }
    /* ue8m0 / packed with int8 output */
    tbuf *qi = tb_new2("q_i8", MOEFUSE_I8, 4, 128, 0, 0);
    tbuf *su = tb_new2("scales_u8", MOEFUSE_U8, 4, 1, 0, 0);
    moefuse_act_quant_options o = {0};
    o.quant.ue8m0 = 1;
    EXPECT(aq(T(X), T(RS), T(qi), T(su), &o), MOEFUSE_ERR_INVALID_ARGUMENT, "act_quant", NULL, "ue8m0 with int8");
    o.quant.ue8m0 = 0;
    o.quant.scale_layout = MOEFUSE_SCALE_PACKED_UE8M0;
    tbuf *pk = tb_new2("packed", MOEFUSE_I32, 1, 4, 0, 0);
    EXPECT(aq(T(X), T(RS), T(qi), T(pk), &o), MOEFUSE_ERR_INVALID_ARGUMENT, "act_quant", NULL, "packed with int8");
}
END_TEST

/* Reserved words of every option struct: a non-zero one is refused, naming the struct and the
 * word, before anything is written (an option of a newer moefuse this one does not know). */
START_TEST(t_reserved_words)
{
    aq_setup();
    tbuf *xq = tb_new2("xq", MOEFUSE_F32, 4, 128, 0, 1);
    tb_upload(xq);
    for (int word = 0; word < 4; word++) {
        moefuse_act_quant_options o = {0};
        o.reserved[word] = 1;
        EXPECT(aq(T(X), T(RS), T(Q), T(SC), &o), MOEFUSE_ERR_INVALID_ARGUMENT, "act_quant",
               h_fmt("act_quant options.reserved[%d]", word), "act_quant options reserved");
        o = (moefuse_act_quant_options){0};
        if (word < 2) { /* the act options have two */
            o.act.reserved[word] = 7;
            EXPECT(aq(T(X), T(RS), T(Q), T(SC), &o), MOEFUSE_ERR_INVALID_ARGUMENT, "act_quant",
                   h_fmt("act options.reserved[%d]", word), "act options reserved");
        }
        o = (moefuse_act_quant_options){0};
        o.quant.reserved[word] = 0x80000000u;
        EXPECT(aq(T(X), T(RS), T(Q), T(SC), &o), MOEFUSE_ERR_INVALID_ARGUMENT, "act_quant",
               h_fmt("quant options.reserved[%d]", word), "quant options reserved");
        EXPECT(moefuse_quant(g_ctx, T(xq), T(Q), T(SC), &o.quant), MOEFUSE_ERR_INVALID_ARGUMENT,
               "quant", h_fmt("quant options.reserved[%d]", word), "quant options reserved");
    }
    /* the 2-D call has no use for zero_tail, but its reserved words are still checked */
    moefuse_act_quant_options o = {0};
    o.zero_tail = 1;
    HCHECK(aq(T(X), T(RS), T(Q), T(SC), &o) == MOEFUSE_OK, "act_quant with zero_tail: %s",
           moefuse_last_error(g_ctx));
}
END_TEST

/* ------------------------------------------------------------ masked */
START_TEST(t_masked)
{
    const int64_t E = 3, Tm = 5, H = 64;
    tbuf *x = tb_upload_unif(tb_new3("x", MOEFUSE_BF16, E, Tm, 2 * H, 0, 1), -1, 1);
    tbuf *cn = tb_new1("counts", MOEFUSE_I32, E, 1);
    tb_upload(cn);
    tbuf *rs = tb_new2("row_scale", MOEFUSE_F32, E, Tm, 0, 1);
    tb_upload(rs);
    tbuf *es = tb_new1("expert_scale", MOEFUSE_F32, E, 1);
    tb_upload(es);
    tbuf *q = tb_new3("q", MOEFUSE_F8_E4M3, E, Tm, H, 0, 0);
    tbuf *sc = tb_new3("scales", MOEFUSE_F32, E, Tm, 1, 0, 0);
    moefuse_act_quant_options o = {0};
    o.quant.group_size = 64;
    o.zero_tail = 1;
    const char *op = "act_quant_masked";
#define MQ(X_, C_, R_, S_, Q_, SC_) moefuse_act_quant_masked(g_ctx, X_, C_, R_, S_, Q_, SC_, &o)
    HCHECK(CALL(MQ(T(x), T(cn), T(rs), T(es), T(q), T(sc))) == MOEFUSE_OK, "masked valid call: %s", moefuse_last_error(g_ctx));
    /* the valid call wrote (zeros); re-poison and re-upload as baseline */
    tb_free_all();
    x = tb_new3("x", MOEFUSE_BF16, E, Tm, 2 * H, 0, 1);
    cn = tb_new1("counts", MOEFUSE_I32, E, 1);
    rs = tb_new2("row_scale", MOEFUSE_F32, E, Tm, 0, 1);
    es = tb_new1("expert_scale", MOEFUSE_F32, E, 1);
    q = tb_new3("q", MOEFUSE_F8_E4M3, E, Tm, H, 0, 0);
    sc = tb_new3("scales", MOEFUSE_F32, E, Tm, 1, 0, 0);
    EXPECT_CTX(moefuse_act_quant_masked(NULL, T(x), T(cn), T(rs), T(es), T(q), T(sc), &o), MOEFUSE_ERR_NULL_POINTER, op, NULL, "ctx NULL", NULL);
    EXPECT(MQ(T(x), NULL, T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_NULL_POINTER, op, "counts", "counts NULL");
    moefuse_tensor t = cn->t;
    t.data = NULL;
    EXPECT(MQ(T(x), &t, T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_NULL_POINTER, op, "counts", "counts data NULL");
    t = cn->t; t.dtype = MOEFUSE_F32;
    EXPECT(MQ(T(x), &t, T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_DTYPE, op, "counts", "counts f32");
    t = cn->t; t.shape[0] = 2;
    EXPECT(MQ(T(x), &t, T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_SHAPE, op, "counts", "counts length");
    t = es->t; t.dtype = MOEFUSE_F16;
    EXPECT(MQ(T(x), T(cn), T(rs), &t, T(q), T(sc)), MOEFUSE_ERR_DTYPE, op, "expert_scale", "expert_scale f16");
    t = es->t; t.shape[0] = 2;
    EXPECT(MQ(T(x), T(cn), T(rs), &t, T(q), T(sc)), MOEFUSE_ERR_SHAPE, op, "expert_scale", "expert_scale length");
    t = rs->t; t.shape[1] = 4;
    EXPECT(MQ(T(x), T(cn), &t, T(es), T(q), T(sc)), MOEFUSE_ERR_SHAPE, op, "row_scale", "row_scale shape");
    t = rs->t; t.dtype = MOEFUSE_BF16;
    EXPECT(MQ(T(x), T(cn), &t, T(es), T(q), T(sc)), MOEFUSE_ERR_DTYPE, op, "row_scale", "row_scale bf16");
    t = x->t; t.rank = 2; t.shape[0] = E * Tm; t.shape[1] = 2 * H; t.stride[0] = 2 * H; t.stride[1] = 1;
    EXPECT(MQ(&t, T(cn), T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_SHAPE, op, "x", "x rank 2");
    t = q->t; t.shape[0] = 2;
    EXPECT(MQ(T(x), T(cn), T(rs), T(es), &t, T(sc)), MOEFUSE_ERR_SHAPE, op, "q", "q experts");
    t = sc->t; t.shape[1] = 4;
    EXPECT(MQ(T(x), T(cn), T(rs), T(es), T(q), &t), MOEFUSE_ERR_SHAPE, op, "scales", "scales shape");
    t = x->t; t.stride[0] = 2 * H; /* experts overlap */
    EXPECT(MQ(&t, T(cn), T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_STRIDE, op, "x", "x experts overlap");
    t = cn->t; t.offset += 2;
    EXPECT(MQ(T(x), &t, T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_ALIGNMENT, op, "counts", "counts misaligned");
    t = x->t; t.shape[2] = 127;
    EXPECT(MQ(&t, T(cn), T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_SHAPE, op, "x", "x width odd");
    t = q->t; t.shape[1] = 4;
    EXPECT(MQ(T(x), T(cn), T(rs), T(es), &t, T(sc)), MOEFUSE_ERR_SHAPE, op, "q", "q Tmax mismatch");
    t = cn->t; t.rank = 2; t.shape[1] = 1; t.stride[1] = 1; t.stride[0] = 1;
    EXPECT(MQ(T(x), &t, T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_SHAPE, op, "counts", "counts rank 2");
    moefuse_act_quant_options o2 = o;
    o.quant.group_size = 96;
    EXPECT(MQ(T(x), T(cn), T(rs), T(es), T(q), T(sc)), MOEFUSE_ERR_INVALID_ARGUMENT, op, "group_size", "group_size 96");
    o = o2;
#undef MQ
}
END_TEST

/* ------------------------------------------------------------ act_mul, quant, dequant */
START_TEST(t_act_mul_quant)
{
    tbuf *x = tb_new2("x", MOEFUSE_F16, 3, 64, 0, 1);
    tb_upload(x);
    tbuf *out = tb_new2("out", MOEFUSE_F16, 3, 32, 0, 0);
    moefuse_tensor t;
    EXPECT_CTX(moefuse_act_mul(NULL, T(x), NULL, T(out), NULL), MOEFUSE_ERR_NULL_POINTER, "act_mul", NULL, "ctx NULL", NULL);
    EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, NULL, NULL), MOEFUSE_ERR_NULL_POINTER, "act_mul", "out", "out NULL");
    t = out->t; t.dtype = MOEFUSE_BF16;
    EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, &t, NULL), MOEFUSE_ERR_DTYPE, "act_mul", "out", "out dtype != x");
    t = out->t; t.shape[1] = 31;
    EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, &t, NULL), MOEFUSE_ERR_SHAPE, "act_mul", "out", "out width");
    t = x->t; t.shape[1] = 63;
    EXPECT(moefuse_act_mul(g_ctx, &t, NULL, T(out), NULL), MOEFUSE_ERR_SHAPE, "act_mul", "x", "x odd width");
    moefuse_act_options ao = {0};
    ao.limit = -2;
    EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, T(out), &ao), MOEFUSE_ERR_INVALID_ARGUMENT, "act_mul", "limit", "limit < 0");
    ao.limit = 0;
    ao.activation = MOEFUSE_ACT_COUNT_;
    EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, T(out), &ao), MOEFUSE_ERR_INVALID_ARGUMENT, "act_mul", "activation", "activation");
    /* alpha belongs to SILU_ALPHA, finite and > 0; up_offset finite */
    const moefuse_activation no_alpha[3] = {MOEFUSE_ACT_SILU, MOEFUSE_ACT_GELU, MOEFUSE_ACT_GELU_TANH};
    for (int i = 0; i < 3; i++) {
        ao = (moefuse_act_options){.activation = no_alpha[i], .alpha = 1.702f};
        EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, T(out), &ao), MOEFUSE_ERR_INVALID_ARGUMENT, "act_mul", "alpha",
               "alpha with an activation that takes none");
    }
    const float bad_alpha[4] = {-1.702f, NAN, INFINITY, -0x1p-149f};
    for (int i = 0; i < 4; i++) {
        ao = (moefuse_act_options){.activation = MOEFUSE_ACT_SILU_ALPHA, .alpha = bad_alpha[i]};
        EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, T(out), &ao), MOEFUSE_ERR_INVALID_ARGUMENT, "act_mul", "alpha",
               h_fmt("alpha %g", (double)bad_alpha[i]));
    }
    const float bad_offset[3] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3; i++) {
        ao = (moefuse_act_options){.activation = MOEFUSE_ACT_SILU_ALPHA, .up_offset = bad_offset[i]};
        EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, T(out), &ao), MOEFUSE_ERR_INVALID_ARGUMENT, "act_mul", "up_offset",
               h_fmt("up_offset %g", (double)bad_offset[i]));
    }
    ao = (moefuse_act_options){.order = (moefuse_gate_order)3};
    EXPECT(moefuse_act_mul(g_ctx, T(x), NULL, T(out), &ao), MOEFUSE_ERR_INVALID_ARGUMENT, "act_mul", "order", "order 3");
    ao = (moefuse_act_options){0};

    tbuf *rs16 = tb_new1("row_scale_f16", MOEFUSE_F16, 3, 1);
    tb_upload(rs16);
    EXPECT(moefuse_act_mul(g_ctx, T(x), T(rs16), T(out), NULL), MOEFUSE_ERR_DTYPE, "act_mul", "row_scale", "row_scale f16");

    /* quant: x [3, 64] f16 */
    tbuf *q = tb_new2("q", MOEFUSE_I8, 3, 64, 0, 0);
    tbuf *sc = tb_new2("scales", MOEFUSE_F32, 3, 2, 0, 0);
    moefuse_quant_options qo = {0};
    qo.group_size = 32;
    EXPECT_CTX(moefuse_quant(NULL, T(x), T(q), T(sc), &qo), MOEFUSE_ERR_NULL_POINTER, "quant", NULL, "ctx NULL", NULL);
    EXPECT(moefuse_quant(g_ctx, T(x), T(q), T(sc), NULL), MOEFUSE_ERR_SHAPE, "quant", NULL, "H=64 % default 128");
    t = q->t; t.dtype = MOEFUSE_I32; t.shape[1] = 16;
    EXPECT(moefuse_quant(g_ctx, T(x), &t, T(sc), &qo), MOEFUSE_ERR_DTYPE, "quant", "q", "q i32");
    t = x->t; t.shape[1] = 0;
    moefuse_tensor q0 = q->t; q0.shape[1] = 0;
    EXPECT(moefuse_quant(g_ctx, &t, &q0, T(sc), &qo), MOEFUSE_ERR_SHAPE, "quant", NULL, "H = 0");
    qo.ue8m0 = 1;
    EXPECT(moefuse_quant(g_ctx, T(x), T(q), T(sc), &qo), MOEFUSE_ERR_INVALID_ARGUMENT, "quant", NULL, "ue8m0 int8");
    qo.ue8m0 = 0;
    qo.eps = -1e-3f;
    EXPECT(moefuse_quant(g_ctx, T(x), T(q), T(sc), &qo), MOEFUSE_ERR_INVALID_ARGUMENT, "quant", "eps", "eps < 0");
    qo.eps = 0;
    tbuf *su = tb_new2("scales_u8", MOEFUSE_U8, 3, 2, 0, 0);
    tbuf *q8 = tb_new2("q_f8", MOEFUSE_F8_E4M3, 3, 64, 0, 0);
    EXPECT(moefuse_quant(g_ctx, T(x), T(q8), T(su), &qo), MOEFUSE_ERR_DTYPE, "quant", "scales", "u8 scales without ue8m0");
    qo.scale_layout = MOEFUSE_SCALE_PACKED_UE8M0 + 1;
    EXPECT(moefuse_quant(g_ctx, T(x), T(q8), T(sc), &qo), MOEFUSE_ERR_INVALID_ARGUMENT, "quant", "scale_layout", "scale_layout 3");
    qo.scale_layout = 0;

    /* dequant */
    tbuf *dq = tb_new2("dq", MOEFUSE_F32, 3, 64, 0, 0);
    t = dq->t; t.dtype = MOEFUSE_I8;
    EXPECT(moefuse_dequant(g_ctx, T(q), T(sc), &t, &qo), MOEFUSE_ERR_DTYPE, "dequant", "out", "dequant out i8");
    t = dq->t; t.shape[0] = 2;
    EXPECT(moefuse_dequant(g_ctx, T(q), T(sc), &t, &qo), MOEFUSE_ERR_SHAPE, "dequant", "out", "dequant out rows");
    EXPECT(moefuse_dequant(g_ctx, T(q), NULL, T(dq), &qo), MOEFUSE_ERR_NULL_POINTER, "dequant", "scales", "scales NULL");
    t = q->t; t.dtype = MOEFUSE_U8;
    EXPECT(moefuse_dequant(g_ctx, &t, T(sc), T(dq), &qo), MOEFUSE_ERR_DTYPE, "dequant", "q", "dequant q u8");
}
END_TEST

void api_errors_rows_tests(TCase *tc)
{
    tcase_add_test(tc, t_act_quant_pointers);
    tcase_add_test(tc, t_act_quant_shapes);
    tcase_add_test(tc, t_act_quant_dtypes);
    tcase_add_test(tc, t_act_quant_strides_align);
    tcase_add_test(tc, t_act_quant_options);
    tcase_add_test(tc, t_reserved_words);
    tcase_add_test(tc, t_masked);
    tcase_add_test(tc, t_act_mul_quant);
}
