/* test_api_errors's parts: how each file expects a refusal, and what they give each other. */
#ifndef MOEFUSE_TEST_API_ERRORS_H
#define MOEFUSE_TEST_API_ERRORS_H

#include <stdio.h>

#include "harness.h"

/* the status; the message names the operation (op) and, when not NULL, the argument */
void expect_msg(moefuse_status got, moefuse_status want, const char *op, const char *arg,
                const char *desc, const char *msg);

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
/* test_api_errors_rows.c: aq_setup's valid act_quant operands, and the call */
extern tbuf *X, *RS, *Q, *SC;
void aq_setup(void);
moefuse_status aq(const moefuse_tensor *x, const moefuse_tensor *rs, const moefuse_tensor *q,
                  const moefuse_tensor *sc, const moefuse_act_quant_options *o);

/* test_api_errors_moe.c: moe_setup's valid MoE operands and routing */
extern tbuf *MX, *MW1, *MW2, *MB1, *MB2, *MIDS, *MWT, *MMAP, *MH, *MOUT;
extern moefuse_routing MR;
void moe_setup(void);

void api_errors_rows_tests(TCase *tc); /* test_api_errors_rows.c */
void api_errors_moe_tests(TCase *tc); /* test_api_errors_moe.c */
void api_errors_sizes_tests(TCase *tc); /* test_api_errors_sizes.c */

#endif
