/*
 * A program as an integrator writes it: built against the installed moefuse (its header and
 * its shared library, found by pkg-config or by CMake's find_package), never against the
 * source tree. CI builds it both ways (.ci/run). It routes one token on the CPU backend and
 * checks the answer, and that the library is the version of the header.
 */
#include <math.h>
#include <moefuse.h>
#include <stdio.h>

static int fail(moefuse_context *ctx, const char *what, moefuse_status st)
{
    fprintf(stderr, "consumer: %s: %s: %s\n", what, moefuse_status_name(st),
            moefuse_last_error(ctx));
    return 1;
}

int main(void)
{
    if (moefuse_version() != MOEFUSE_VERSION) {
        fprintf(stderr, "consumer: library version %u, header %d\n", moefuse_version(),
                MOEFUSE_VERSION);
        return 1;
    }
    moefuse_context *ctx = NULL;
    moefuse_status st = moefuse_context_create(&ctx, "cpu");
    if (st != MOEFUSE_OK)
        return fail(NULL, "moefuse_context_create", st);
    /* one token, four experts: expert 2 then expert 0 */
    float logits[4] = {1.0f, -2.0f, 3.0f, 0.5f};
    int32_t ids[2] = {-1, -1};
    float weights[2] = {0.0f, 0.0f};
    const int64_t lshape[2] = {1, 4}, kshape[2] = {1, 2};
    const moefuse_tensor tl = moefuse_tensor_dense(logits, MOEFUSE_F32, 2, lshape);
    const moefuse_tensor ti = moefuse_tensor_dense(ids, MOEFUSE_I32, 2, kshape);
    const moefuse_tensor tw = moefuse_tensor_dense(weights, MOEFUSE_F32, 2, kshape);
    st = moefuse_topk_softmax(ctx, &tl, 1, &ti, &tw);
    if (st != MOEFUSE_OK)
        return fail(ctx, "moefuse_topk_softmax", st);
    moefuse_context_destroy(ctx);
    /* renormalised over the two: e^3 / (e^3 + e^1) and e^1 / (e^3 + e^1) */
    const double w0 = 1.0 / (1.0 + exp(-2.0));
    if (ids[0] != 2 || ids[1] != 0 || fabs(weights[0] - w0) > 1e-6 ||
        fabs(weights[1] - (1.0 - w0)) > 1e-6) {
        fprintf(stderr, "consumer: routed to %d (%g) and %d (%g), expected 2 (%g) and 0 (%g)\n",
                ids[0], weights[0], ids[1], weights[1], w0, 1.0 - w0);
        return 1;
    }
    const unsigned v = moefuse_version();
    printf("consumer: moefuse %u.%u.%u, routing checked\n", v / 10000, v / 100 % 100, v % 100);
    return 0;
}
