/* test_api_errors: moe_gate, moe_final, moe_forward and the FP8 MoE calls. */
#include "test_api_errors.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ MoE */
tbuf *MX, *MW1, *MW2, *MB1, *MB2, *MIDS, *MWT, *MMAP, *MH, *MOUT;
moefuse_routing MR;
void moe_setup(void)
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

/* ------------------------------------------------------------- FP8 MoE */
/* M = 4, K = 256, I = 128, E = 2, k = 2: valid operands, then one wrong argument at a time */
START_TEST(t_moe_fp8)
{
    const int64_t M = 4, K = 256, I = 128, E = 2, k = 2;
    tbuf *x = tb_upload_unif(tb_new2("x", MOEFUSE_BF16, M, K, 0, 1), -1, 1);
    tbuf *xq = tb_new2("xq", MOEFUSE_F8_E4M3, M, K, 0, 1);
    tb_upload(xq);
    tbuf *xs = tb_upload_unif(tb_new2("x_scales", MOEFUSE_F32, M, K / 128, 0, 1), 0.01, 0.02);
    tbuf *w1 = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, K, 0, 1);
    tb_upload(w1);
    tbuf *w1s = tb_upload_unif(tb_new3("w1_scales", MOEFUSE_F32, E, 2 * I / 128, K / 128, 0, 1),
                               0.01, 0.02);
    tbuf *w1s_bad = tb_new3("w1_scales", MOEFUSE_F32, E, 2 * I / 128, K / 64, 0, 1);
    tb_upload(w1s_bad);
    tbuf *w1s_bf = tb_new3("w1_scales", MOEFUSE_BF16, E, 2 * I / 128, K / 128, 0, 1);
    tb_upload(w1s_bf);
    tbuf *w1_k = tb_new3("w1", MOEFUSE_F8_E4M3, E, 2 * I, 192, 0, 1); /* K = 192 */
    tb_upload(w1_k);
    tbuf *x_k = tb_upload_unif(tb_new2("x", MOEFUSE_BF16, M, 192, 0, 1), -1, 1);
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

void api_errors_moe_tests(TCase *tc)
{
    tcase_add_test(tc, t_moe_gate);
    tcase_add_test(tc, t_moe_final_forward);
    tcase_add_test(tc, t_moe_fp8);
}
