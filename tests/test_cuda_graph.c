/*
 * The CUDA backend under CUDA graphs and foreign streams:
 *  - every operation captured into a graph (global capture mode, with no eager
 *    call before it) replays to the same bits as the eager call, again after
 *    the inputs change and after the context's scratch has been regrown;
 *  - the eager call and every replay agree with the CPU golden backend run on
 *    the same inputs (tb_twin), as NUMERICS.md's agreement section requires:
 *    the row ops and the router bit-equal, the bf16 MoE layer within a relative
 *    error of 8e-3; every other element byte equal. So an eager call and a graph that both write nothing, or both
 *    compute the same wrong thing, fail;
 *  - the stream is attached while it is capturing, as torch.cuda.graph does;
 *  - a whole decode layer (the router's topk_softmax, then moe_forward on its
 *    ids and weights) captured as one graph replays as the eager calls do, with
 *    its inputs rewritten by cudaMemcpyAsync on the stream before each replay;
 *  - calls alternating between streams, with no host wait between them, give
 *    the results of calls on one stream (the scratch orders itself);
 *  - the testing switches MOEFUSE_CUDA_GEMM and MOEFUSE_CUDA_SPLIT refuse
 *    values they do not know at context creation;
 *  - moefuse_context_create_on chooses the device by index.
 * Outputs are poisoned again before each replay, so a replay that writes
 * nothing cannot pass on what an earlier one left. Runs on "cuda" only;
 * skipped without a device (h_run).
 */
#include <stdlib.h>
#include <string.h>

#include "test_cuda_graph.h"
/* ------------------------------------------------------------ two streams */

/* A large call on stream a, a small one on stream b right after (same scratch,
 * no host wait), then both again on the context's own stream: same bits. */
START_TEST(streams_switch_without_waiting)
{
    cudaStream_t a = new_stream(), b = new_stream();
    layer big = layer_new(2048, 8, 2, 512, 256);
    layer small = layer_new(96, 8, 2, 512, 256);
    for (int round = 0; round < 3; round++) {
        OK(moefuse_set_stream(g_ctx, a));
        OK(layer_issue(&big, 1));
        OK(moefuse_set_stream(g_ctx, b));
        OK(layer_issue(&small, 1));
        OK(moefuse_set_stream(g_ctx, a));
        OK(layer_issue(&small, 0)); /* b may still be routing in the scratch */
    }
    CU(cudaStreamSynchronize(a));
    CU(cudaStreamSynchronize(b));
    OK(moefuse_set_stream(g_ctx, NULL));
    h_check_all(0);
    same_bytes(small.out_eager, small.out_graph, "the small layer on stream a after stream b");
    layer_vs_cpu(&small, small.out_graph, "the small layer on stream b");
    layer_vs_cpu(&small, small.out_eager, "the small layer on stream a after stream b");
    tbuf *one_stream = tb_new2("big_one_stream", MOEFUSE_BF16, 2048, 512, 0, 0);
    OK(moefuse_moe_forward(g_ctx, T(big.x), T(big.w1), T(big.w2), NULL, NULL, &big.R,
                           T(one_stream), NULL));
    OK(moefuse_synchronize(g_ctx));
    h_check_all(0);
    same_bytes(big.out_graph, one_stream, "the large layer on stream a, against one stream");
    layer_vs_cpu(&big, big.out_graph, "the large layer on stream a");
    CU(cudaStreamDestroy(a));
    CU(cudaStreamDestroy(b));
    tb_free_all();
}
END_TEST

/* A testing switch with a value it does not know refuses context creation, naming itself;
 * the switch's own value (a variant of this program sets one) is restored after. */
static void refused_switch(const char *name, const char *value)
{
    const char *was = getenv(name);
    char *saved = was ? strdup(was) : NULL;
    setenv(name, value, 1);
    moefuse_context *c = NULL;
    const moefuse_status st = moefuse_context_create(&c, "cuda");
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_INVALID_ARGUMENT && c == NULL,
           "%s=%s: context creation gave %s", name, value, moefuse_status_name(st));
    HCHECK(strstr(msg, name) != NULL, "%s=%s: the message does not name it: %s", name, value,
           msg);
    if (c)
        moefuse_context_destroy(c);
    if (saved)
        setenv(name, saved, 1);
    else
        unsetenv(name);
    free(saved);
}

/* moefuse_context_create_on picks the CUDA device by index over MOEFUSE_CUDA_DEVICE, and
 * refuses an index no device has, naming it. */
START_TEST(device_by_index)
{
    const char *was = getenv("MOEFUSE_CUDA_DEVICE");
    char *saved = was ? strdup(was) : NULL;
    setenv("MOEFUSE_CUDA_DEVICE", "no-such-device", 1); /* the argument must win */
    moefuse_context *c = NULL;
    moefuse_status st = moefuse_context_create_on(&c, "cuda", "0");
    HCHECK(st == MOEFUSE_OK && c, "create_on(cuda, 0): %s", moefuse_last_error(NULL));
    HCHECK(strstr(moefuse_device_name(c), "CUDA device 0") != NULL, "device 0 is \"%s\"",
           moefuse_device_name(c));
    moefuse_context_destroy(c);
    c = (moefuse_context *)&c;
    st = moefuse_context_create_on(&c, "cuda", "99");
    const char *msg = moefuse_last_error(NULL);
    HCHECK(st == MOEFUSE_ERR_BACKEND_UNAVAILABLE && c == NULL, "create_on(cuda, 99) gave %s",
           moefuse_status_name(st));
    HCHECK(strstr(msg, "device") && strstr(msg, "99"), "create_on(cuda, 99): message \"%s\"", msg);
    if (saved)
        setenv("MOEFUSE_CUDA_DEVICE", saved, 1);
    else
        unsetenv("MOEFUSE_CUDA_DEVICE");
    free(saved);
}
END_TEST

START_TEST(unknown_switch_values_refused)
{
    refused_switch("MOEFUSE_CUDA_GEMM", "wgmma2");
    refused_switch("MOEFUSE_CUDA_SPLIT", "0");
    refused_switch("MOEFUSE_CUDA_SPLIT", "9");
    refused_switch("MOEFUSE_CUDA_SPLIT", "2x");
}
END_TEST

static void setup(void)
{
    h_setup_cross(); /* g_ref: the CPU golden backend */
}

static Suite *suite(void)
{
    Suite *s = suite_create("cuda_graph");
    TCase *tc = h_add_tcase(s, "cuda_graph", setup, 120);
    cuda_graph_layer_tests(tc);
    cuda_graph_decode_tests(tc);
    tcase_add_test(tc, streams_switch_without_waiting);
    tcase_add_test(tc, unknown_switch_values_refused);
    tcase_add_test(tc, device_by_index);
    return s;
}

int main(void) { return h_run(suite()); }
