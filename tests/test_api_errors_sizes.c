/* test_api_errors: byte counts past 64 bits, refused before anything runs wild. */
#include "test_api_errors.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

void api_errors_sizes_tests(TCase *tc)
{
    tcase_add_test(tc, t_byte_counts_overflow);
    tcase_add_test(tc, t_moe_byte_counts_overflow);
}
