/* Every validation rule: the status, a message naming the operation and the
 * argument, and outputs (poisoned) plus canaries untouched (checked by CALL). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static void expect_msg(moefuse_status got, moefuse_status want, const char *op, const char *arg,
                       const char *desc, const char *msg)
{
    HCHECK(got == want, "%s: %s returned %s, want %s (message: \"%s\")", op, desc, moefuse_status_name(got),
           moefuse_status_name(want), msg);
    HCHECK(*msg, "%s: %s: moefuse_last_error is empty", op, desc);
    HCHECK(strstr(msg, op) != NULL, "%s: %s: message \"%s\" does not name the operation", op, desc, msg);
    if (arg) HCHECK(strstr(msg, arg) != NULL, "%s: %s: message \"%s\" does not name \"%s\"", op, desc, msg, arg);
}
/* the message is captured before the canary check (buffer reads succeed and clear it) */
#define EXPECT_CTX(call, want, op, arg, desc, ctx_)                                   \
    do {                                                                          \
        moefuse_status st_ = (call);                                              \
        char m_[1024];                                                            \
        const char *e_ = moefuse_last_error(ctx_);                                \
        snprintf(m_, sizeof m_, "%s", e_ ? e_ : "");                              \
        h_check_all(st_ != MOEFUSE_OK);                                           \
        expect_msg(st_, want, op, arg, desc, m_);                                 \
    } while (0)
#define EXPECT(call, want, op, arg, desc) EXPECT_CTX(call, want, op, arg, desc, g_ctx)


/* ------------------------------------------------------------ act_quant */
static tbuf *X, *RS, *Q, *SC;
static void aq_setup(void)
{
    X = tb_new2("x", MOEFUSE_F32, 4, 256, 0, 1);
    tb_fill_unif(X, -1, 1);
    tb_upload(X);
    RS = tb_new1("row_scale", MOEFUSE_F32, 4, 1);
    tb_fill_unif(RS, 0.5, 1);
    tb_upload(RS);
    Q = tb_new2("q", MOEFUSE_F8_E4M3, 4, 128, 0, 0);
    SC = tb_new2("scales", MOEFUSE_F32, 4, 1, 0, 0);
}
static moefuse_status aq(const moefuse_tensor *x, const moefuse_tensor *rs, const moefuse_tensor *q,
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
    tbuf *x = tb_new3("x", MOEFUSE_BF16, E, Tm, 2 * H, 0, 1);
    tb_fill_unif(x, -1, 1);
    tb_upload(x);
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

/* ------------------------------------------------------------ MoE */
static tbuf *MX, *MW1, *MW2, *MB1, *MB2, *MIDS, *MWT, *MMAP, *MH, *MOUT;
static moefuse_routing MR;
static void moe_setup(void)
{
    const int64_t M = 3, K = 16, I = 8, E = 2, k = 2;
    MX = tb_new2("x", MOEFUSE_F32, M, K, 0, 1);
    MW1 = tb_new3("w1", MOEFUSE_F32, E, 2 * I, K, 0, 1);
    MW2 = tb_new3("w2", MOEFUSE_F32, E, K, I, 0, 1);
    MB1 = tb_new2("b1", MOEFUSE_F32, E, 2 * I, 0, 1);
    MB2 = tb_new2("b2", MOEFUSE_F32, E, K, 0, 1);
    MIDS = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1);
    MWT = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    MMAP = tb_new1("expert_map", MOEFUSE_I32, 4, 1);
    for (int64_t i = 0; i < M * k; i++) tb_set(MIDS, i / k, i % k, 0, (double)(i % 2));
    for (int64_t i = 0; i < 4; i++) tb_set(MMAP, i, 0, 0, (double)(i % 2));
    tb_fill_unif(MX, -1, 1);
    tb_fill_unif(MW1, -1, 1);
    tb_fill_unif(MW2, -1, 1);
    tb_fill_unif(MWT, 0, 1);
    tb_upload(MX); tb_upload(MW1); tb_upload(MW2); tb_upload(MIDS); tb_upload(MMAP); tb_upload(MWT);
    MH = tb_new3("h", MOEFUSE_F32, M, k, I, 0, 0);
    MOUT = tb_new2("out", MOEFUSE_F32, M, K, 0, 0);
    memset(&MR, 0, sizeof MR);
    MR.topk_ids = MIDS->t;
    MR.topk_weights = MWT->t;
    MR.expert_map = MMAP->t;
}

START_TEST(t_moe_gate)
{
    moe_setup();
    const char *op = "moe_gate";
    EXPECT_CTX(moefuse_moe_gate(NULL, T(MX), T(MW1), T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_NULL_POINTER, op, NULL, "ctx NULL", NULL);
#define G(x_, w_, b_, r_, h_, o_) moefuse_moe_gate(g_ctx, x_, w_, b_, r_, h_, o_)
    EXPECT(G(T(MX), T(MW1), T(MB1), NULL, T(MH), NULL), MOEFUSE_ERR_NULL_POINTER, op, NULL, "routing NULL");
    moefuse_routing r = MR;
    r.topk_ids.data = NULL;
    EXPECT(G(T(MX), T(MW1), T(MB1), &r, T(MH), NULL), MOEFUSE_ERR_NULL_POINTER, op, "topk_ids", "topk_ids data NULL");
    EXPECT(G(T(MX), NULL, T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_NULL_POINTER, op, "w1", "w1 NULL");
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, NULL, NULL), MOEFUSE_ERR_NULL_POINTER, op, "h", "h NULL");
    moefuse_tensor t;
    t = MW1->t; t.dtype = MOEFUSE_BF16;
    EXPECT(G(T(MX), &t, T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_DTYPE, op, "w1", "w1 dtype != x");
    t = MX->t; t.dtype = MOEFUSE_I32;
    EXPECT(G(&t, T(MW1), T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_DTYPE, op, "x", "x i32");
    t = MW1->t; t.dtype = MOEFUSE_F8_E4M3;
    EXPECT(G(T(MX), &t, T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_DTYPE, op, NULL, "f8 weights");
    t = MB1->t; t.dtype = MOEFUSE_I8;
    EXPECT(G(T(MX), T(MW1), &t, &MR, T(MH), NULL), MOEFUSE_ERR_DTYPE, op, "b1", "b1 i8");
    t = MH->t; t.dtype = MOEFUSE_I32;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, &t, NULL), MOEFUSE_ERR_DTYPE, op, "h", "h i32");
    r = MR; r.topk_ids.dtype = MOEFUSE_F32;
    EXPECT(G(T(MX), T(MW1), T(MB1), &r, T(MH), NULL), MOEFUSE_ERR_DTYPE, op, "topk_ids", "topk_ids f32");
    r = MR; r.expert_map.dtype = MOEFUSE_F32;
    EXPECT(G(T(MX), T(MW1), T(MB1), &r, T(MH), NULL), MOEFUSE_ERR_DTYPE, op, "expert_map", "expert_map f32");
    r = MR; r.topk_ids.shape[0] = 2;
    EXPECT(G(T(MX), T(MW1), T(MB1), &r, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, "topk_ids", "topk_ids rows");
    t = MW1->t; t.shape[2] = 15;
    EXPECT(G(T(MX), &t, T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, "w1", "w1 K mismatch");
    t = MW1->t; t.shape[1] = 15;
    EXPECT(G(T(MX), &t, T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, "w1", "w1 2I odd");
    t = MH->t; t.shape[2] = 7;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, &t, NULL), MOEFUSE_ERR_SHAPE, op, "h", "h I mismatch");
    t = MB1->t; t.shape[1] = 15;
    EXPECT(G(T(MX), T(MW1), &t, &MR, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, "b1", "b1 shape");
    t = MW1->t; t.shape[0] = 0;
    moefuse_tensor b0 = MB1->t; b0.shape[0] = 0;
    EXPECT(G(T(MX), &t, &b0, &MR, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, NULL, "E = 0");
    t = MW1->t; t.shape[2] = 0;
    moefuse_tensor x0 = MX->t; x0.shape[1] = 0;
    EXPECT(G(&x0, &t, T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, NULL, "K = 0");
    t = MW1->t; t.shape[1] = 0;
    moefuse_tensor h0 = MH->t; h0.shape[2] = 0;
    EXPECT(G(T(MX), &t, NULL, &MR, &h0, NULL), MOEFUSE_ERR_SHAPE, op, NULL, "I = 0");
    r = MR; r.topk_ids.rank = 1; r.topk_ids.shape[0] = 6; r.topk_ids.stride[0] = 1;
    EXPECT(G(T(MX), T(MW1), T(MB1), &r, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, "topk_ids", "topk_ids rank 1");
    r = MR; r.expert_map.rank = 2; r.expert_map.shape[0] = 2; r.expert_map.shape[1] = 2; r.expert_map.stride[0] = 2; r.expert_map.stride[1] = 1;
    EXPECT(G(T(MX), T(MW1), T(MB1), &r, T(MH), NULL), MOEFUSE_ERR_SHAPE, op, "expert_map", "expert_map rank 2");
    t = MH->t; t.shape[1] = 1;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, &t, NULL), MOEFUSE_ERR_SHAPE, op, "h", "h k mismatch");
    t = MW1->t; t.stride[1] = 8;
    EXPECT(G(T(MX), &t, T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_STRIDE, op, "w1", "w1 rows overlap");
    t = MX->t; t.offset += 1;
    EXPECT(G(&t, T(MW1), T(MB1), &MR, T(MH), NULL), MOEFUSE_ERR_ALIGNMENT, op, "x", "x misaligned");
    r = MR; r.topk_ids.offset = -8;
    EXPECT(G(T(MX), T(MW1), T(MB1), &r, T(MH), NULL), MOEFUSE_ERR_INVALID_ARGUMENT, op, "topk_ids", "ids negative offset");
    moefuse_moe_options mo = {0};
    mo.activation = (moefuse_activation)7;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "activation", "activation 7");
    mo.activation = 0;
    mo.limit = NAN;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "limit", "limit NaN");
    mo.limit = 0;
    mo.reserved[1] = 1;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "moe options.reserved[1]", "reserved word");
    mo.reserved[1] = 0;
    mo.order = (moefuse_gate_order)3;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "order", "order 3");
    mo.order = MOEFUSE_GATE_INTERLEAVED;
    mo.alpha = 1.702f; /* with silu */
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "alpha", "alpha with silu");
    mo.activation = MOEFUSE_ACT_SILU_ALPHA;
    mo.alpha = -1.702f;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "alpha", "alpha < 0");
    mo.alpha = INFINITY;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "alpha", "alpha Inf");
    mo.alpha = 0;
    mo.up_offset = NAN;
    EXPECT(G(T(MX), T(MW1), T(MB1), &MR, T(MH), &mo), MOEFUSE_ERR_INVALID_ARGUMENT, op, "up_offset", "up_offset NaN");
#undef G
}
END_TEST

START_TEST(t_moe_final_forward)
{
    moe_setup();
    const char *op = "moe_final";
    tbuf *hin = tb_new3("h_in", MOEFUSE_F32, 3, 2, 8, 0, 1);
    tb_upload(hin);
    EXPECT_CTX(moefuse_moe_final(NULL, T(hin), T(MW2), T(MB2), &MR, T(MOUT), NULL), MOEFUSE_ERR_NULL_POINTER, op, NULL, "ctx NULL", NULL);
#define F(h_, w_, b_, r_, o_) moefuse_moe_final(g_ctx, h_, w_, b_, r_, o_, NULL)
    EXPECT(F(T(hin), T(MW2), T(MB2), NULL, T(MOUT)), MOEFUSE_ERR_NULL_POINTER, op, NULL, "routing NULL");
    moefuse_routing r = MR;
    r.topk_weights.data = NULL;
    EXPECT(F(T(hin), T(MW2), T(MB2), &r, T(MOUT)), MOEFUSE_ERR_NULL_POINTER, op, "topk_weights", "weights data NULL");
    moefuse_tensor t;
    t = MW2->t; t.dtype = MOEFUSE_F16;
    EXPECT(F(T(hin), &t, T(MB2), &MR, T(MOUT)), MOEFUSE_ERR_DTYPE, op, "w2", "w2 dtype != h");
    r = MR; r.topk_weights.dtype = MOEFUSE_BF16;
    EXPECT(F(T(hin), T(MW2), T(MB2), &r, T(MOUT)), MOEFUSE_ERR_DTYPE, op, "topk_weights", "weights bf16");
    t = MOUT->t; t.dtype = MOEFUSE_I32;
    EXPECT(F(T(hin), T(MW2), T(MB2), &MR, &t), MOEFUSE_ERR_DTYPE, op, "out", "out i32");
    t = MB2->t; t.dtype = MOEFUSE_I32;
    EXPECT(F(T(hin), T(MW2), &t, &MR, T(MOUT)), MOEFUSE_ERR_DTYPE, op, "b2", "b2 i32");
    r = MR; r.topk_weights.shape[1] = 1;
    EXPECT(F(T(hin), T(MW2), T(MB2), &r, T(MOUT)), MOEFUSE_ERR_SHAPE, op, "topk_weights", "weights shape");
    t = MOUT->t; t.shape[1] = 15;
    EXPECT(F(T(hin), T(MW2), T(MB2), &MR, &t), MOEFUSE_ERR_SHAPE, op, "out", "out K mismatch");
    t = MW2->t; t.shape[2] = 7;
    EXPECT(F(T(hin), &t, T(MB2), &MR, T(MOUT)), MOEFUSE_ERR_SHAPE, op, "w2", "w2 I mismatch");
    t = MB2->t; t.shape[1] = 15;
    EXPECT(F(T(hin), T(MW2), &t, &MR, T(MOUT)), MOEFUSE_ERR_SHAPE, op, "b2", "b2 shape");
    tbuf *y = tb_new3("y", MOEFUSE_F32, 3, 2, 16, 0, 0);
    t = y->t; t.shape[1] = 1;
    EXPECT(F(T(hin), T(MW2), T(MB2), &MR, &t), MOEFUSE_ERR_SHAPE, op, "out", "unreduced out k mismatch");
    t = hin->t; t.dtype = MOEFUSE_I8;
    moefuse_tensor w8 = MW2->t; w8.dtype = MOEFUSE_I8;
    EXPECT(F(&t, &w8, T(MB2), &MR, T(MOUT)), MOEFUSE_ERR_DTYPE, op, "h", "h i8");
    t = MW2->t; t.dtype = MOEFUSE_F8_E4M3;
    EXPECT(F(T(hin), &t, T(MB2), &MR, T(MOUT)), MOEFUSE_ERR_DTYPE, op, NULL, "f8 weights");
#undef F
    op = "moe_forward";
    EXPECT_CTX(moefuse_moe_forward(NULL, T(MX), T(MW1), T(MW2), T(MB1), T(MB2), &MR, T(MOUT), NULL), MOEFUSE_ERR_NULL_POINTER, op, NULL, "ctx NULL", NULL);
#define W(x_, w1_, w2_, r_, o_) moefuse_moe_forward(g_ctx, x_, w1_, w2_, T(MB1), T(MB2), r_, o_, NULL)
    EXPECT(W(T(MX), T(MW1), T(MW2), NULL, T(MOUT)), MOEFUSE_ERR_NULL_POINTER, op, NULL, "routing NULL");
    t = MW2->t; t.dtype = MOEFUSE_BF16;
    EXPECT(W(T(MX), T(MW1), &t, &MR, T(MOUT)), MOEFUSE_ERR_DTYPE, op, "w2", "w2 dtype != x");
    t = MW1->t; t.dtype = MOEFUSE_F16;
    EXPECT(W(T(MX), &t, T(MW2), &MR, T(MOUT)), MOEFUSE_ERR_DTYPE, op, "w1", "w1 dtype != x");
    t = MOUT->t; t.shape[0] = 2;
    EXPECT(W(T(MX), T(MW1), T(MW2), &MR, &t), MOEFUSE_ERR_SHAPE, op, "out", "out rows");
    t = MW2->t; t.shape[1] = 15;
    EXPECT(W(T(MX), T(MW1), &t, &MR, T(MOUT)), MOEFUSE_ERR_SHAPE, op, "w2", "w2 K mismatch");
    t = MOUT->t; t.stride[1] = 2; t.shape[1] = 8;
    EXPECT(W(T(MX), T(MW1), T(MW2), &MR, &t), MOEFUSE_ERR_STRIDE, op, "out", "out inner stride");
#undef W
}
END_TEST

/* ------------------------------------------------------------ 64-bit byte counts */

/* A tensor's shape, strides and offset, over a small real buffer: refused or it would run wild. */
static moefuse_tensor huge(const tbuf *tb, int32_t rank, const int64_t *shape, const int64_t *stride,
                           int64_t offset)
{
    moefuse_tensor t = moefuse_tensor_strided(tb->buf, tb->t.dtype, rank, shape, stride);
    t.offset = offset;
    return t;
}

/*
 * Shapes, strides and offsets whose byte counts overflow 64 bits: a dimension
 * near INT64_MAX / 2 (elements that fit, bytes that do not), strides whose
 * products overflow, an offset that the span pushes past INT64_MAX; on inputs,
 * outputs and optional operands of every kind of call. Each is refused with
 * MOEFUSE_ERR_SHAPE naming the operand, and nothing is written (EXPECT checks
 * every buffer). Every other operand agrees with the one that overflows, so
 * the overflow is the only thing to refuse; the data pointers are real small
 * buffers, so a check that let one through would write or read far outside them.
 */
START_TEST(t_byte_counts_overflow)
{
    const int64_t BIG = INT64_MAX / 2, QUARTER = INT64_MAX / 4; /* 2^62 - 1, 2^61 - 1 */
    const moefuse_status S = MOEFUSE_ERR_SHAPE;
    aq_setup(); /* x [4, 256] f32, row_scale [4], q [4, 128] f8, scales [4, 1] f32 */
    const char *op = "act_quant";
    moefuse_tensor t;
    int64_t sh[3], st[3];
    /* 2^61 - 1 rows of 2 f32: 2^62 elements fit, their 2^64 bytes do not (q and scales alike) */
    int64_t qs_rows[2] = {QUARTER, 1}, qs_dense[2] = {1, 1};
    moefuse_tensor q_big = huge(Q, 2, qs_rows, qs_dense, Q->t.offset);
    moefuse_tensor s_big = huge(SC, 2, qs_rows, qs_dense, SC->t.offset);
    moefuse_act_quant_options per_row = {0};
    per_row.quant.group_size = 1; /* G = H = 1: shapes that fit every other rule */
    sh[0] = QUARTER, sh[1] = 2, st[0] = 2, st[1] = 1;
    t = huge(X, 2, sh, st, X->t.offset);
    EXPECT(aq(&t, NULL, &q_big, &s_big, &per_row), S, op, "x", "x [2^61 - 1, 2] f32: 2^64 bytes");
    /* 2^62 - 1 rows: the element counts themselves overflow (x, q and scales alike) */
    sh[0] = BIG, sh[1] = 256, st[0] = 256;
    int64_t q_rows[2] = {BIG, 128}, q_dense[2] = {128, 1}, s_rows[2] = {BIG, 1};
    q_big = huge(Q, 2, q_rows, q_dense, Q->t.offset);
    s_big = huge(SC, 2, s_rows, qs_dense, SC->t.offset);
    t = huge(X, 2, sh, st, X->t.offset);
    EXPECT(aq(&t, NULL, &q_big, &s_big, NULL), S, op, "x", "x [2^62 - 1, 256]");
    /* strides: 3 * (2^62 - 1) elements overflow; 3 * (2^61 + 1) fit, but not as f32 bytes */
    sh[0] = 4, sh[1] = 256, st[0] = BIG;
    t = huge(X, 2, sh, st, X->t.offset);
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), S, op, "x", "x row stride 2^62 - 1");
    st[0] = QUARTER + 2;
    t = huge(X, 2, sh, st, X->t.offset);
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), S, op, "x", "x row stride 2^61 + 1 f32");
    /* offset + span: 4096 bytes from an offset 4096 short of 2^63 (still aligned) */
    t = X->t;
    t.offset = INT64_MAX - 4095;
    EXPECT(aq(&t, T(RS), T(Q), T(SC), NULL), S, op, "x", "x offset 2^63 - 4096");
    /* outputs and the optional row_scale */
    t = Q->t;
    t.stride[0] = BIG;
    EXPECT(aq(T(X), T(RS), &t, T(SC), NULL), S, op, "q", "q row stride 2^62 - 1");
    t = SC->t;
    t.offset = INT64_MAX - 3;
    EXPECT(aq(T(X), T(RS), T(Q), &t, NULL), S, op, "scales", "scales offset 2^63 - 4");
    t = RS->t;
    t.offset = INT64_MAX - 7;
    EXPECT(aq(T(X), &t, T(Q), T(SC), NULL), S, op, "row_scale", "row_scale offset 2^63 - 8");

    /* act_mul: x [4, 64] (x's buffer, padded rows) into an f32 out [4, 32] */
    moefuse_tensor x64 = X->t;
    x64.shape[1] = 64;
    tbuf *am = tb_new2("act_mul_out", MOEFUSE_F32, 4, 32, 0, 0);
    t = am->t;
    t.stride[0] = QUARTER + 2;
    EXPECT(moefuse_act_mul(g_ctx, &x64, NULL, &t, NULL), S, "act_mul", "out",
           "out row stride 2^61 + 1 f32");
    /* quant of x [4, 128] into q [4, 128] and scales [4, 4] (G = 32), and dequant back */
    moefuse_quant_options qo = {0};
    qo.group_size = 32;
    tbuf *sc4 = tb_new2("scales_g32", MOEFUSE_F32, 4, 4, 0, 0);
    t = X->t;
    t.shape[1] = 128, t.stride[0] = QUARTER + 2;
    EXPECT(moefuse_quant(g_ctx, &t, T(Q), T(sc4), &qo), S, "quant", "x", "x row stride 2^61 + 1 f32");
    tbuf *dq = tb_new2("dequant_out", MOEFUSE_F32, 4, 128, 0, 0);
    t = dq->t;
    t.offset = INT64_MAX - 3;
    EXPECT(moefuse_dequant(g_ctx, T(Q), T(sc4), &t, &qo), S, "dequant", "out", "out offset 2^63 - 4");

    /* act_quant_masked: a 3-D x whose expert stride overflows, counts at the end of the range */
    tbuf *x3 = tb_new3("x3", MOEFUSE_BF16, 3, 2, 256, 0, 1);
    tbuf *cn = tb_new1("counts", MOEFUSE_I32, 3, 1);
    tbuf *q3 = tb_new3("q3", MOEFUSE_F8_E4M3, 3, 2, 128, 0, 0);
    tbuf *s3 = tb_new3("s3", MOEFUSE_F32, 3, 2, 1, 0, 0);
    tb_upload(x3);
    tb_upload(cn);
    op = "act_quant_masked";
#define MQ(x_, c_, q_, s_) moefuse_act_quant_masked(g_ctx, x_, c_, NULL, NULL, q_, s_, NULL)
    sh[0] = 3, sh[1] = 2, sh[2] = 256, st[0] = BIG, st[1] = 256, st[2] = 1;
    t = huge(x3, 3, sh, st, x3->t.offset);
    EXPECT(MQ(&t, T(cn), T(q3), T(s3)), S, op, "x", "x expert stride 2^62 - 1");
    sh[0] = INT64_C(1) << 40, sh[1] = INT64_C(1) << 20, st[0] = (INT64_C(1) << 20) * 256;
    t = huge(x3, 3, sh, st, x3->t.offset);
    moefuse_tensor c_big = cn->t, q_huge = q3->t, s_huge = s3->t;
    c_big.shape[0] = q_huge.shape[0] = s_huge.shape[0] = sh[0];
    q_huge.shape[1] = s_huge.shape[1] = sh[1];
    q_huge.stride[0] = sh[1] * 128, q_huge.stride[1] = 128, s_huge.stride[0] = sh[1];
    EXPECT(MQ(&t, &c_big, &q_huge, &s_huge), S, op, "x", "x [2^40, 2^20, 256]: 2^68 elements");
    t = cn->t;
    t.offset = INT64_MAX - 7;
    EXPECT(MQ(T(x3), &t, T(q3), T(s3)), S, op, "counts", "counts offset 2^63 - 8");
    t = s3->t;
    t.stride[0] = QUARTER + 2;
    EXPECT(MQ(T(x3), T(cn), T(q3), &t), S, op, "scales", "scales expert stride 2^61 + 1 f32");
#undef MQ

    /* topk_softmax */
    tbuf *lg = tb_new2("logits", MOEFUSE_F32, 4, 6, 0, 1);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, 4, 2, 0, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, 4, 2, 0, 0);
    tb_upload(lg);
    t = w->t;
    t.stride[0] = QUARTER + 2;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 1, T(ids), &t), S, "topk_softmax", "weights",
           "weights row stride 2^61 + 1 f32");
    sh[0] = QUARTER, sh[1] = 2, st[0] = 2, st[1] = 1;
    t = huge(lg, 2, sh, st, lg->t.offset);
    moefuse_tensor ids_big = huge(ids, 2, sh, st, ids->t.offset), w_big = huge(w, 2, sh, st, w->t.offset);
    EXPECT(moefuse_topk_softmax(g_ctx, &t, 1, &ids_big, &w_big), S, "topk_softmax", "logits",
           "logits [2^61 - 1, 2] f32: 2^64 bytes");
}
END_TEST

/* The same for the MoE calls: weights, biases, routing and outputs. */
START_TEST(t_moe_byte_counts_overflow)
{
    const int64_t BIG = INT64_MAX / 2, QUARTER = INT64_MAX / 4;
    const moefuse_status S = MOEFUSE_ERR_SHAPE;
    moe_setup(); /* M = 3, K = 16, I = 8, E = 2, k = 2, f32 */
    const char *op = "moe_gate";
    moefuse_tensor t;
    moefuse_routing r;
    /* w1 [2^56, 16, 16] f32: 2^64 elements */
    int64_t sh[3] = {INT64_C(1) << 56, 16, 16}, st[3] = {256, 16, 1};
    t = huge(MW1, 3, sh, st, MW1->t.offset);
    EXPECT(moefuse_moe_gate(g_ctx, T(MX), &t, NULL, &MR, T(MH), NULL), S, op, "w1", "w1 [2^56, 16, 16]");
    t = MW1->t;
    t.stride[0] = QUARTER + 2;
    EXPECT(moefuse_moe_gate(g_ctx, T(MX), &t, T(MB1), &MR, T(MH), NULL), S, op, "w1",
           "w1 expert stride 2^61 + 1 f32");
    t = MB1->t;
    t.offset = INT64_MAX - 63;
    EXPECT(moefuse_moe_gate(g_ctx, T(MX), T(MW1), &t, &MR, T(MH), NULL), S, op, "b1", "b1 offset 2^63 - 64");
    r = MR;
    r.topk_ids.offset = INT64_MAX - 7;
    EXPECT(moefuse_moe_gate(g_ctx, T(MX), T(MW1), T(MB1), &r, T(MH), NULL), S, op, "topk_ids",
           "topk_ids offset 2^63 - 8");
    r = MR;
    r.expert_map.stride[0] = 1, r.expert_map.offset = INT64_MAX - 15;
    EXPECT(moefuse_moe_gate(g_ctx, T(MX), T(MW1), T(MB1), &r, T(MH), NULL), S, op, "expert_map",
           "expert_map offset 2^63 - 16");
    t = MH->t; /* slots 2^61 + 2 elements apart, tokens further (no overlap): 2^65 bytes */
    t.stride[1] = QUARTER + 2, t.stride[0] = QUARTER + 10;
    EXPECT(moefuse_moe_gate(g_ctx, T(MX), T(MW1), T(MB1), &MR, &t, NULL), S, op, "h",
           "h slot stride 2^61 + 1 f32");

    op = "moe_final";
    tbuf *hin = tb_new3("h_in", MOEFUSE_F32, 3, 2, 8, 0, 1);
    tb_upload(hin);
    t = MW2->t;
    t.stride[1] = QUARTER + 2;
    EXPECT(moefuse_moe_final(g_ctx, T(hin), &t, T(MB2), &MR, T(MOUT), NULL), S, op, "w2",
           "w2 row stride 2^61 + 1 f32");
    r = MR;
    r.topk_weights.stride[0] = BIG;
    EXPECT(moefuse_moe_final(g_ctx, T(hin), T(MW2), T(MB2), &r, T(MOUT), NULL), S, op, "topk_weights",
           "topk_weights row stride 2^62 - 1");
    t = MOUT->t;
    t.offset = INT64_MAX - 191;
    EXPECT(moefuse_moe_final(g_ctx, T(hin), T(MW2), T(MB2), &MR, &t, NULL), S, op, "out", "out offset 2^63 - 192");

    op = "moe_forward";
    t = MB2->t;
    t.stride[0] = QUARTER + 2;
    EXPECT(moefuse_moe_forward(g_ctx, T(MX), T(MW1), T(MW2), T(MB1), &t, &MR, T(MOUT), NULL), S, op, "b2",
           "b2 expert stride 2^61 + 1 f32");
    t = MX->t;
    t.stride[0] = BIG;
    EXPECT(moefuse_moe_forward(g_ctx, &t, T(MW1), T(MW2), T(MB1), T(MB2), &MR, T(MOUT), NULL), S, op, "x",
           "x row stride 2^62 - 1");
}
END_TEST

/* ------------------------------------------------------------ topk, context */
START_TEST(t_topk)
{
    tbuf *lg = tb_new2("logits", MOEFUSE_F32, 4, 6, 0, 1);
    tb_fill_unif(lg, -1, 1);
    tb_upload(lg);
    tbuf *ids = tb_new2("ids", MOEFUSE_I32, 4, 2, 0, 0);
    tbuf *w = tb_new2("weights", MOEFUSE_F32, 4, 2, 0, 0);
    const char *op = "topk_softmax";
    EXPECT_CTX(moefuse_topk_softmax(NULL, T(lg), 0, T(ids), T(w)), MOEFUSE_ERR_NULL_POINTER, op, NULL, "ctx NULL", NULL);
    EXPECT(moefuse_topk_softmax(g_ctx, NULL, 0, T(ids), T(w)), MOEFUSE_ERR_NULL_POINTER, op, "logits", "logits NULL");
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), NULL), MOEFUSE_ERR_NULL_POINTER, op, "weights", "weights NULL");
    moefuse_tensor a = ids->t, b = w->t;
    a.shape[1] = 0; b.shape[1] = 0;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, &a, &b), MOEFUSE_ERR_SHAPE, op, NULL, "k = 0");
    tbuf *ids7 = tb_new2("ids7", MOEFUSE_I32, 4, 7, 0, 0);
    tbuf *w7 = tb_new2("w7", MOEFUSE_F32, 4, 7, 0, 0);
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids7), T(w7)), MOEFUSE_ERR_SHAPE, op, NULL, "k > E");
    a = ids->t; a.dtype = MOEFUSE_F32;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, &a, T(w)), MOEFUSE_ERR_DTYPE, op, "ids", "ids f32");
    b = w->t; b.dtype = MOEFUSE_BF16;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), &b), MOEFUSE_ERR_DTYPE, op, "weights", "weights bf16");
    a = lg->t; a.dtype = MOEFUSE_I32;
    EXPECT(moefuse_topk_softmax(g_ctx, &a, 0, T(ids), T(w)), MOEFUSE_ERR_DTYPE, op, "logits", "logits i32");
    a = ids->t; a.shape[0] = 3;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, &a, T(w)), MOEFUSE_ERR_SHAPE, op, "ids", "ids rows");
    b = w->t; b.shape[1] = 1;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), &b), MOEFUSE_ERR_SHAPE, op, "weights", "weights k");
    a = lg->t; a.rank = 3; a.shape[2] = 1; a.stride[2] = 1;
    EXPECT(moefuse_topk_softmax(g_ctx, &a, 0, T(ids), T(w)), MOEFUSE_ERR_SHAPE, op, "logits", "logits rank 3");
    a = lg->t; a.stride[0] = 3;
    EXPECT(moefuse_topk_softmax(g_ctx, &a, 0, T(ids), T(w)), MOEFUSE_ERR_STRIDE, op, "logits", "logits overlap");
    a = w->t; a.offset += 1;
    EXPECT(moefuse_topk_softmax(g_ctx, T(lg), 0, T(ids), &a), MOEFUSE_ERR_ALIGNMENT, op, "weights", "weights misaligned");
}
END_TEST

/* ---------------------------------------------- empty tensors with NULL data */
/* torch.empty(0, K) has data NULL: an operand with a zero dimension touches no memory,
 * so NULL data is accepted there (an expert-parallel rank may get no tokens), and the
 * non-empty operands are still read as usual; a non-empty NULL stays an error. */
static moefuse_tensor empty_tensor(moefuse_dtype dt, int32_t rank, int64_t d0, int64_t d1,
                                   int64_t d2)
{
    const int64_t shape[3] = {d0, d1, d2};
    return moefuse_tensor_dense(NULL, dt, rank, shape);
}

START_TEST(t_empty_null_data)
{
    const int64_t H = 128, E = 4, k = 2, K = 16, I = 8;
    moefuse_tensor x = empty_tensor(MOEFUSE_BF16, 2, 0, 2 * H, 0);
    moefuse_tensor q = empty_tensor(MOEFUSE_F8_E4M3, 2, 0, H, 0);
    moefuse_tensor sc = empty_tensor(MOEFUSE_F32, 2, 0, 1, 0);
    moefuse_tensor o = empty_tensor(MOEFUSE_BF16, 2, 0, H, 0);
    moefuse_tensor xh = empty_tensor(MOEFUSE_BF16, 2, 0, H, 0);
    moefuse_tensor qh = empty_tensor(MOEFUSE_I8, 2, 0, H, 0);
#define OKCALL(call, what)                                                                     \
    do {                                                                                       \
        moefuse_status st_ = CALL(call);                                                       \
        HCHECK(st_ == MOEFUSE_OK, "%s with NULL empty operands: %s (%s)", what,                \
               moefuse_status_name(st_), moefuse_last_error(g_ctx));                           \
    } while (0)
    OKCALL(moefuse_act_quant(g_ctx, &x, NULL, &q, &sc, NULL), "act_quant T=0");
    moefuse_tensor cs = empty_tensor(MOEFUSE_F32, 2, 1, 0, 0); /* column-major [Gn, Ta = 0] */
    moefuse_act_quant_options col;
    memset(&col, 0, sizeof col);
    col.quant.scale_layout = MOEFUSE_SCALE_COLUMN_MAJOR;
    OKCALL(moefuse_act_quant(g_ctx, &x, NULL, &q, &cs, &col), "act_quant T=0, column-major");
    OKCALL(moefuse_act_mul(g_ctx, &x, NULL, &o, NULL), "act_mul T=0");
    OKCALL(moefuse_quant(g_ctx, &xh, &qh, &sc, NULL), "quant T=0");
    OKCALL(moefuse_dequant(g_ctx, &qh, &sc, &xh, NULL), "dequant T=0");

    /* masked, Tmax = 0: the counts are real memory and still read (and clamped) */
    tbuf *cnt = tb_new1("counts", MOEFUSE_I32, E, 1);
    for (int64_t e = 0; e < E; e++) tb_set(cnt, e, 0, 0, (double)(e - 1));
    tb_upload(cnt);
    moefuse_tensor xm = empty_tensor(MOEFUSE_BF16, 3, E, 0, 2 * H);
    moefuse_tensor qm = empty_tensor(MOEFUSE_F8_E4M3, 3, E, 0, H);
    moefuse_tensor sm = empty_tensor(MOEFUSE_F32, 3, E, 0, 1);
    moefuse_act_quant_options zt;
    memset(&zt, 0, sizeof zt);
    zt.zero_tail = 1;
    OKCALL(moefuse_act_quant_masked(g_ctx, &xm, T(cnt), NULL, NULL, &qm, &sm, &zt),
           "act_quant_masked Tmax=0");

    moefuse_tensor lg = empty_tensor(MOEFUSE_F32, 2, 0, E, 0);
    moefuse_tensor ids = empty_tensor(MOEFUSE_I32, 2, 0, k, 0);
    moefuse_tensor wts = empty_tensor(MOEFUSE_F32, 2, 0, k, 0);
    OKCALL(moefuse_topk_softmax(g_ctx, &lg, 1, &ids, &wts), "topk_softmax M=0");

    /* the MoE calls with M = 0: weights are real, everything per token is empty */
    tbuf *w1 = tb_new3("w1", MOEFUSE_BF16, E, 2 * I, K, 0, 1);
    tbuf *w2 = tb_new3("w2", MOEFUSE_BF16, E, K, I, 0, 1);
    tb_fill_unif(w1, -1, 1);
    tb_fill_unif(w2, -1, 1);
    tb_upload(w1);
    tb_upload(w2);
    moefuse_routing r;
    memset(&r, 0, sizeof r);
    r.topk_ids = ids;
    r.topk_weights = wts;
    moefuse_tensor mx = empty_tensor(MOEFUSE_BF16, 2, 0, K, 0);
    moefuse_tensor mh = empty_tensor(MOEFUSE_BF16, 3, 0, k, I);
    moefuse_tensor mo = empty_tensor(MOEFUSE_BF16, 2, 0, K, 0);
    OKCALL(moefuse_moe_gate(g_ctx, &mx, T(w1), NULL, &r, &mh, NULL), "moe_gate M=0");
    OKCALL(moefuse_moe_final(g_ctx, &mh, T(w2), NULL, &r, &mo, NULL), "moe_final M=0");
    OKCALL(moefuse_moe_forward(g_ctx, &mx, T(w1), T(w2), NULL, NULL, &r, &mo, NULL),
           "moe_forward M=0");
#undef OKCALL

    /* NULL is still refused where there are elements */
    moefuse_tensor w1null = w1->t;
    w1null.data = NULL;
    EXPECT(moefuse_moe_forward(g_ctx, &mx, &w1null, T(w2), NULL, NULL, &r, &mo, NULL),
           MOEFUSE_ERR_NULL_POINTER, "moe_forward", "w1", "w1 data NULL with M = 0");
}
END_TEST

/* moefuse_context_create_on: a device needs a named backend that has devices to choose. */
static void expect_device_refused(const char *backend, const char *device, const char *needle)
{
    moefuse_context *c = (moefuse_context *)0x1;
    const moefuse_status st = moefuse_context_create_on(&c, backend, device);
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_INVALID_ARGUMENT, "create_on(%s, '%s') returned %s",
           backend ? backend : "NULL", device, moefuse_status_name(st));
    HCHECK(c == NULL, "create_on(%s, '%s') failed but left *out set", backend ? backend : "NULL",
           device);
    HCHECK(strstr(msg, needle) != NULL, "create_on(%s, '%s'): message \"%s\" lacks \"%s\"",
           backend ? backend : "NULL", device, msg, needle);
}

START_TEST(t_context_on_device)
{
    expect_device_refused(NULL, "0", "needs a backend name");
    expect_device_refused("auto", "0", "needs a backend name");
    expect_device_refused("cpu", "0", "one device");
    expect_device_refused("cpu", "", "empty");
    moefuse_context *c = NULL;
    const moefuse_status st = moefuse_context_create_on(&c, "cpu", NULL);
    HCHECK(st == MOEFUSE_OK && c != NULL, "create_on(cpu, NULL): %s", moefuse_last_error(NULL));
    HCHECK(strcmp(moefuse_backend_name(c), "cpu") == 0, "create_on(cpu, NULL) gave %s",
           moefuse_backend_name(c));
    moefuse_context_destroy(c);
    HCHECK(moefuse_context_create_on(NULL, "cpu", NULL) == MOEFUSE_ERR_NULL_POINTER,
           "create_on(NULL out) was not refused");
}
END_TEST

/* moefuse_context_create_opencl refuses what it can judge without touching a handle, on every
 * build; a library without OpenCL refuses any handles (never looked at). test_opencl adopts
 * real ones. */
static void expect_adopt_refused(void *context, void *queue, moefuse_status want,
                                 const char *needle)
{
    moefuse_context *c = (moefuse_context *)0x1;
    const moefuse_status st = moefuse_context_create_opencl(&c, context, queue);
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == want, "create_opencl(%p, %p) returned %s, want %s (%s)", context, queue,
           moefuse_status_name(st), moefuse_status_name(want), msg);
    HCHECK(c == NULL, "create_opencl(%p, %p) failed but left *out set", context, queue);
    HCHECK(strstr(msg, "context_create_opencl") && strstr(msg, needle),
           "create_opencl(%p, %p): message \"%s\" should name the call and \"%s\"", context,
           queue, msg, needle);
}

START_TEST(t_context_create_opencl)
{
    int dummy[2];
    HCHECK(moefuse_context_create_opencl(NULL, &dummy[0], &dummy[1]) == MOEFUSE_ERR_NULL_POINTER,
           "create_opencl(NULL out) was not refused");
    HCHECK(strstr(moefuse_last_error(NULL), "out is NULL"), "NULL out: message \"%s\"",
           moefuse_last_error(NULL));
    expect_adopt_refused(NULL, &dummy[1], MOEFUSE_ERR_NULL_POINTER, "cl_context");
    expect_adopt_refused(&dummy[0], NULL, MOEFUSE_ERR_NULL_POINTER, "cl_queue");
    expect_adopt_refused(NULL, NULL, MOEFUSE_ERR_NULL_POINTER, "cl_context");
    if (strstr(moefuse_built_backends(), "opencl") == NULL)
        expect_adopt_refused(&dummy[0], &dummy[1], MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                             "not built");
    else
        fprintf(stderr, "note: OpenCL is built in; the refusal of a library without it is "
                        "tested in builds without it\n");
}
END_TEST

/*
 * moefuse_buffer_import: NULL refused everywhere; on the CPU any host pointer is memory of the
 * device (accepted, untouched); on CUDA device memory is, a host pointer is not; on OpenCL a
 * buffer of the context's own is already known (test_opencl imports the caller's cl_mem).
 */
START_TEST(t_buffer_import)
{
    EXPECT(moefuse_buffer_import(g_ctx, NULL), MOEFUSE_ERR_NULL_POINTER, "buffer_import",
           "buffer is NULL", "a NULL buffer");
    static unsigned char host[64];
    HCHECK(moefuse_buffer_import(NULL, host) == MOEFUSE_ERR_NULL_POINTER,
           "buffer_import(NULL ctx) was not refused");
    const char *be = moefuse_backend_name(g_ctx);
    void *own = NULL;
    HCHECK(moefuse_buffer_alloc(g_ctx, 64, &own) == MOEFUSE_OK, "alloc: %s",
           moefuse_last_error(g_ctx));
    HCHECK(moefuse_buffer_import(g_ctx, own) == MOEFUSE_OK, "import of a buffer of ctx: %s",
           moefuse_last_error(g_ctx));
    if (strcmp(be, "cpu") == 0) {
        memset(host, 0x5C, sizeof host);
        HCHECK(moefuse_buffer_import(g_ctx, host) == MOEFUSE_OK,
               "cpu: import of a host array: %s", moefuse_last_error(g_ctx));
        HCHECK(host[0] == 0x5C && host[63] == 0x5C, "cpu: import changed the array");
        /* and a tensor on it is taken, as before the import */
        int64_t shape[2] = {1, 16};
        moefuse_tensor x = moefuse_tensor_dense(host, MOEFUSE_F32, 2, shape);
        moefuse_tensor q = moefuse_tensor_dense(own, MOEFUSE_F8_E4M3, 2, (int64_t[2]){1, 8});
        moefuse_tensor sc = moefuse_tensor_dense((char *)own + 32, MOEFUSE_F32, 2,
                                                 (int64_t[2]){1, 1});
        moefuse_act_quant_options o = {0};
        o.quant.group_size = 8;
        HCHECK(moefuse_act_quant(g_ctx, &x, NULL, &q, &sc, &o) == MOEFUSE_OK,
               "cpu: act_quant on the imported array: %s", moefuse_last_error(g_ctx));
    } else if (strcmp(be, "cuda") == 0) {
        EXPECT(moefuse_buffer_import(g_ctx, host), MOEFUSE_ERR_WRONG_DEVICE, "buffer_import",
               "not memory", "a host array on cuda");
    }
    moefuse_buffer_free(g_ctx, own);
}
END_TEST

/* The library reports the version of the header it was built with: this build's, here. */
START_TEST(t_version)
{
    HCHECK(moefuse_version() == MOEFUSE_VERSION, "moefuse_version() is %u, the header says %d",
           moefuse_version(), MOEFUSE_VERSION);
    HCHECK(MOEFUSE_VERSION_MINOR < 100 && MOEFUSE_VERSION_PATCH < 100,
           "version %d.%d.%d does not fit MOEFUSE_VERSION's encoding", MOEFUSE_VERSION_MAJOR,
           MOEFUSE_VERSION_MINOR, MOEFUSE_VERSION_PATCH);
}
END_TEST

START_TEST(t_context)
{
    moefuse_context *c = (moefuse_context *)0x1;
    moefuse_status st = moefuse_context_create(&c, "tpu");
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_BACKEND_UNAVAILABLE, "context_create(tpu) returned %s", moefuse_status_name(st));
    HCHECK(c == NULL, "context_create failure left *out non-NULL");
    HCHECK(msg && strstr(msg, "tpu") && strstr(msg, "cpu"), "message \"%s\" should name tpu and list built backends",
           msg ? msg : "(null)");
    HCHECK(strstr(moefuse_built_backends(), "cpu") != NULL, "built backends \"%s\" lacks cpu", moefuse_built_backends());
    st = moefuse_context_create(NULL, "cpu");
    HCHECK(st == MOEFUSE_ERR_NULL_POINTER, "context_create(NULL out) returned %s", moefuse_status_name(st));
    if (strcmp(moefuse_backend_name(g_ctx), "cpu") == 0) {
        int dummy;
        st = moefuse_set_stream(g_ctx, &dummy);
        HCHECK(st == MOEFUSE_ERR_UNSUPPORTED, "set_stream(non-NULL) on cpu returned %s", moefuse_status_name(st));
        HCHECK(moefuse_last_error(g_ctx)[0] != 0, "set_stream: empty message");
        HCHECK(moefuse_set_stream(g_ctx, NULL) == MOEFUSE_OK, "set_stream(NULL) failed");
    }
    HCHECK(moefuse_synchronize(g_ctx) == MOEFUSE_OK, "synchronize failed");
    /* get_stream: a NULL out pointer is refused; the cpu backend has no stream */
    st = moefuse_get_stream(g_ctx, NULL);
    HCHECK(st == MOEFUSE_ERR_NULL_POINTER, "get_stream(ctx, NULL) returned %s", moefuse_status_name(st));
    HCHECK(strstr(moefuse_last_error(g_ctx), "get_stream") != NULL, "get_stream: message \"%s\" does not name the call",
           moefuse_last_error(g_ctx));
    void *stream = &st;
    st = moefuse_get_stream(NULL, &stream);
    HCHECK(st == MOEFUSE_ERR_NULL_POINTER, "get_stream(NULL ctx) returned %s", moefuse_status_name(st));
    HCHECK(moefuse_get_stream(g_ctx, &stream) == MOEFUSE_OK, "get_stream: %s", moefuse_last_error(g_ctx));
    if (strcmp(moefuse_backend_name(g_ctx), "cpu") == 0)
        HCHECK(stream == NULL, "get_stream on cpu gave %p, want NULL", stream);
    else
        HCHECK(stream != NULL && stream != (void *)&st, "get_stream on %s gave %p, want its queue/stream",
               moefuse_backend_name(g_ctx), stream);
    HCHECK(strcmp(moefuse_status_name(MOEFUSE_ERR_SHAPE), "MOEFUSE_ERR_SHAPE") == 0, "status_name");
    HCHECK(strcmp(moefuse_status_name((moefuse_status)999), "unknown status") == 0, "status_name out of range");
    HCHECK(moefuse_dtype_size(MOEFUSE_BF16) == 2 && moefuse_dtype_size(MOEFUSE_U8) == 1, "dtype_size");
}
END_TEST

/* ------------------------------------------------------------- FP8 MoE */
/* M = 4, K = 256, I = 128, E = 2, k = 2: valid operands, then one wrong argument at a time */
START_TEST(t_moe_fp8)
{
    const int64_t M = 4, K = 256, I = 128, E = 2, k = 2;
    tbuf *x = tb_new2("x", MOEFUSE_BF16, M, K, 0, 1);
    tb_fill_unif(x, -1, 1);
    tb_upload(x);
    tbuf *xq = tb_new2("xq", MOEFUSE_F8_E4M3, M, K, 0, 1);
    tb_upload(xq);
    tbuf *xs = tb_new2("x_scales", MOEFUSE_F32, M, K / 128, 0, 1);
    tb_fill_unif(xs, 0.01, 0.02);
    tb_upload(xs);
    tbuf *w1 = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, K, 0, 1);
    tb_upload(w1);
    tbuf *w1s = tb_new3("w1_scales", MOEFUSE_F32, E, 2 * I / 128, K / 128, 0, 1);
    tb_fill_unif(w1s, 0.01, 0.02);
    tb_upload(w1s);
    tbuf *w1s_bad = tb_new3("w1_scales", MOEFUSE_F32, E, 2 * I / 128, K / 64, 0, 1);
    tb_upload(w1s_bad);
    tbuf *w1s_bf = tb_new3("w1_scales", MOEFUSE_BF16, E, 2 * I / 128, K / 128, 0, 1);
    tb_upload(w1s_bf);
    tbuf *w1_k = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, 192, 0, 1); /* K = 192 */
    tb_upload(w1_k);
    tbuf *x_k = tb_new2("x", MOEFUSE_BF16, M, 192, 0, 1);
    tb_fill_unif(x_k, -1, 1);
    tb_upload(x_k);
    tbuf *w1s_k = tb_new3("w1_scales", MOEFUSE_F32, E, 2 * I / 128, 1, 0, 1);
    tb_upload(w1s_k);
    tbuf *w1_i = tb_new3("w1", MOEFUSE_F8_E4M3, E, 128, K, 0, 1); /* I = 64 */
    tb_upload(w1_i);
    tbuf *w1s_i = tb_new3("w1_scales", MOEFUSE_F32, E, 1, K / 128, 0, 1);
    tb_upload(w1s_i);
    tbuf *w2 = tb_new3("w2", MOEFUSE_F8_E4M3, E, K, I, 0, 1);
    tb_upload(w2);
    tbuf *w2s = tb_new3("w2_scales", MOEFUSE_U8, E, K / 128, I / 128, 0, 1);
    tb_upload(w2s);
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 0, 1);
    tbuf *wts = tb_new2("topk_weights", MOEFUSE_F32, M, k, 0, 1);
    h_fill_simple_routing(ids, wts, M, k, E);
    tbuf *h = tb_new3("h", MOEFUSE_F8_E4M3, M, k, I, 0, 0);
    tbuf *hs = tb_new2("h_scales", MOEFUSE_F32, M * k, I / 128, 0, 0);
    tbuf *hs_u8 = tb_new2("h_scales", MOEFUSE_U8, M * k, I / 128, 0, 0);
    tbuf *out = tb_new2("out", MOEFUSE_F32, M, K, 0, 0);
    tbuf *out_bad = tb_new2("out", MOEFUSE_F32, M, K + 128, 0, 0);
    moefuse_routing R = {0};
    R.topk_ids = ids->t;
    R.topk_weights = wts->t;
    moefuse_fp8_moe_options o = {0};
#define G8(x_, xs_, w_, ws_, h_, hs_, o_) moefuse_moe_gate_fp8(g_ctx, x_, xs_, w_, ws_, NULL, &R, h_, hs_, o_)
    EXPECT(G8(T(xq), NULL, T(w1), T(w1s), T(h), T(hs), &o), MOEFUSE_ERR_NULL_POINTER, "moe_gate_fp8",
           "x_scales", "f8 x without x_scales");
    EXPECT(G8(T(x), T(xs), T(w1), T(w1s), T(h), T(hs), &o), MOEFUSE_ERR_INVALID_ARGUMENT, "moe_gate_fp8",
           "x_scales", "x_scales with a bf16 x");
    EXPECT(G8(T(x_k), NULL, T(w1_k), T(w1s_k), T(h), T(hs), &o), MOEFUSE_ERR_SHAPE, "moe_gate_fp8", "w1",
           "K = 192, not a multiple of 128");
    EXPECT(G8(T(x), NULL, T(w1_i), T(w1s_i), T(h), T(hs), &o), MOEFUSE_ERR_SHAPE, "moe_gate_fp8", "I = 64",
           "I = 64, not a multiple of 128");
    EXPECT(G8(T(x), NULL, T(w1), T(w1s_bad), T(h), T(hs), &o), MOEFUSE_ERR_SHAPE, "moe_gate_fp8", "w1_scales",
           "w1_scales of the wrong shape");
    EXPECT(G8(T(x), NULL, T(w1), T(w1s_bf), T(h), T(hs), &o), MOEFUSE_ERR_DTYPE, "moe_gate_fp8", "w1_scales",
           "bf16 w1_scales");
    EXPECT(G8(T(x), NULL, T(w1), T(w1s), T(h), T(hs_u8), &o), MOEFUSE_ERR_DTYPE, "moe_gate_fp8", "h_scales",
           "u8 h_scales without ue8m0");
    moefuse_fp8_moe_options bad = o;
    bad.act.group_size = 64;
    EXPECT(G8(T(x), NULL, T(w1), T(w1s), T(h), T(hs), &bad), MOEFUSE_ERR_INVALID_ARGUMENT, "moe_gate_fp8",
           "group_size", "act.group_size 64");
    bad = o;
    bad.reserved[2] = 1;
    EXPECT(G8(T(x), NULL, T(w1), T(w1s), T(h), T(hs), &bad), MOEFUSE_ERR_INVALID_ARGUMENT, "moe_gate_fp8",
           "reserved", "fp8 options reserved word");
    bad = o;
    bad.act.reserved[0] = 7;
    EXPECT(G8(T(x), NULL, T(w1), T(w1s), T(h), T(hs), &bad), MOEFUSE_ERR_INVALID_ARGUMENT, "moe_gate_fp8",
           "reserved", "act options reserved word");
    bad = o;
    bad.moe.reserved[1] = 3;
    EXPECT(G8(T(x), NULL, T(w1), T(w1s), T(h), T(hs), &bad), MOEFUSE_ERR_INVALID_ARGUMENT, "moe_gate_fp8",
           "reserved", "moe options reserved word");
#undef G8
    EXPECT(moefuse_moe_final_fp8(g_ctx, T(h), T(hs), T(w2), T(w2s), NULL, &R, T(out_bad), &o), MOEFUSE_ERR_SHAPE,
           "moe_final_fp8", "out", "out [M, K + 128]");
    EXPECT(moefuse_moe_forward_fp8(g_ctx, T(x), NULL, T(w1), T(w1s), T(w2), T(w2s), NULL, NULL, &R, T(out_bad), &o),
           MOEFUSE_ERR_SHAPE, "moe_forward_fp8", "out", "out [M, K + 128]");
    EXPECT(moefuse_moe_forward_fp8(g_ctx, T(x), NULL, T(w1), T(w1s), T(w2), T(w1s), NULL, NULL, &R, T(out), &o),
           MOEFUSE_ERR_SHAPE, "moe_forward_fp8", "w2_scales", "w2_scales of w1's shape");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("api_errors");
    TCase *tc = tcase_create("errors");
    tcase_add_checked_fixture(tc, h_setup, h_teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, t_act_quant_pointers);
    tcase_add_test(tc, t_act_quant_shapes);
    tcase_add_test(tc, t_act_quant_dtypes);
    tcase_add_test(tc, t_act_quant_strides_align);
    tcase_add_test(tc, t_act_quant_options);
    tcase_add_test(tc, t_reserved_words);
    tcase_add_test(tc, t_masked);
    tcase_add_test(tc, t_act_mul_quant);
    tcase_add_test(tc, t_moe_gate);
    tcase_add_test(tc, t_moe_final_forward);
    tcase_add_test(tc, t_moe_fp8);
    tcase_add_test(tc, t_byte_counts_overflow);
    tcase_add_test(tc, t_moe_byte_counts_overflow);
    tcase_add_test(tc, t_topk);
    tcase_add_test(tc, t_empty_null_data);
    tcase_add_test(tc, t_version);
    tcase_add_test(tc, t_context_on_device);
    tcase_add_test(tc, t_context_create_opencl);
    tcase_add_test(tc, t_buffer_import);
    tcase_add_test(tc, t_context);
    suite_add_tcase(s, tc);
    return h_run(s);
}
