/*
 * Cross-backend agreement (docs/NUMERICS.md, "Agreement between backends").
 * Every operation runs on the CPU golden backend (g_ref) and on the backend
 * under test (g_ctx) over identical buffers (tb_twin: same bytes, canaries and
 * poison), from fresh random data every run. Results are compared element by
 * element with the bounds of that section; every other byte of the two
 * buffers (row padding, untouched tails, canaries) must be equal, and
 * h_check_all checks each side's canaries after each call. The GEMMs are also
 * compared with the float64 oracle (oracle.c).
 *
 * With MOEFUSE_TEST_BACKEND=cpu both sides are CPU contexts. The program then
 * checks its own cases and comparisons, and that two CPU contexts agree bit for
 * bit, in seconds: cheap enough to run on every build, and a broken
 * comparison shows up before anyone runs it on a GPU.
 *
 * What must agree:
 *  - act_mul, act_quant, act_quant_masked, quant, dequant, topk_softmax:
 *    every byte, bit for bit (every backend runs the library's own exp, erf
 *    and tanh and IEEE f32 arithmetic in the documented order). The one
 *    exception: a NaN from act(g) * u where both are NaN may carry either
 *    operand's sign (f8 NaN code 0x7F or 0xFF, act_mul's NaN sign).
 *  - GEMMs: relative error <= 1e-5 (f32), 8e-3 (bf16), 4e-3 (f16, oracle.h), each element's
 *    error first less half a subnormal step of its dtype (NUMERICS.md)
 *    against the oracle on both backends, and between the two backends.
 */
#include <string.h>

#include "test_cross_backend.h"

static void setup(void)
{
    h_setup_cross();
    memset(&seen, 0, sizeof seen);
}

int main(void)
{
    Suite *s = suite_create("cross_backend");
    TCase *tc = h_add_tcase(s, "cross_backend", setup, 240);
    cross_backend_quant_tests(tc);
    cross_backend_rows_tests(tc);
    cross_backend_moe_tests(tc);
    return h_run(s);
}
