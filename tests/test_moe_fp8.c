/*
 * FP8 MoE (moe_gate_fp8, moe_final_fp8, moe_forward_fp8, moe_masked_fp8) against a float64
 * oracle written here from docs/NUMERICS.md "FP8 MoE": codes and scales decoded exactly,
 * block sums exact, the activation and the quantization of h in double. The CPU backend, the
 * reference, is held to tight bounds (see CPU_H_BOUND); backends that form p_b exactly (opencl,
 * and cuda with MOEFUSE_CUDA_FP8=portable) must equal it bit for bit, and all of these meet the
 * 2e-2 output bound of "Agreement between backends" end to end. CUDA's Hopper paths (the wgmma
 * kernel, the decode kernel) are held as NUMERICS.md says: h element by element (a code step
 * and the block sums' error), and the final against the final of their own h
 * (HOPPER_BLOCK_BOUND). A backend without FP8 MoE makes the program exit with SKIP.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_moe_fp8.h"

/* ---------------------------------------------------------------- driver */

/*
 * Whether the backend under test has FP8 MoE: a one-slot gate on zeros. MOEFUSE_ERR_UNSUPPORTED
 * makes the program report SKIP; any other failure runs the suite, which then reports it.
 */
static int fp8_probe(void)
{
    moefuse_context *ctx = NULL;
    if (moefuse_context_create(&ctx, h_backend()) != MOEFUSE_OK) return 1; /* h_run reports it */
    void *buf = NULL;
    int ok = 1;
    const size_t need = 512 + 2 * BLK * BLK + 64 + 64 + 256 + 64;
    if (moefuse_buffer_alloc(ctx, need, &buf) == MOEFUSE_OK) {
        unsigned char *zeros = calloc(1, need);
        moefuse_buffer_write(ctx, buf, 0, zeros, need);
        free(zeros);
        const int64_t xsh[2] = {1, BLK}, ws[3] = {1, 2 * BLK, BLK}, wss[3] = {1, 2, 1}, ids[2] = {1, 1},
                      hsh[3] = {1, 1, BLK}, hss[2] = {1, 1};
        moefuse_tensor x = moefuse_tensor_dense(buf, MOEFUSE_F32, 2, xsh);
        moefuse_tensor w1 = moefuse_tensor_dense(buf, MOEFUSE_F8_E4M3, 3, ws);
        w1.offset = 512;
        moefuse_tensor w1s = moefuse_tensor_dense(buf, MOEFUSE_F32, 3, wss);
        w1s.offset = 512 + 2 * BLK * BLK;
        moefuse_tensor id = moefuse_tensor_dense(buf, MOEFUSE_I32, 2, ids);
        id.offset = w1s.offset + 64;
        moefuse_tensor h = moefuse_tensor_dense(buf, MOEFUSE_F8_E4M3, 3, hsh);
        h.offset = id.offset + 64;
        moefuse_tensor hs = moefuse_tensor_dense(buf, MOEFUSE_F32, 2, hss);
        hs.offset = h.offset + 256;
        moefuse_routing r = {0};
        r.topk_ids = id;
        const moefuse_status st = moefuse_moe_gate_fp8(ctx, &x, NULL, &w1, &w1s, NULL, &r, &h, &hs, NULL);
        if (st == MOEFUSE_ERR_UNSUPPORTED) {
            printf("SKIP: backend %s has no FP8 MoE: %s\n", h_backend(), moefuse_last_error(ctx));
            ok = 0;
        }
        moefuse_buffer_free(ctx, buf);
    }
    moefuse_context_destroy(ctx);
    return ok;
}

/* The probe runs in a child process: an OpenMP team started before Check forks its tests
 * would not survive the fork. */
static int fp8_supported(void)
{
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) _exit(fp8_probe() ? 0 : 3);
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid) return 1;
    return !(WIFEXITED(status) && WEXITSTATUS(status) == 3);
}

static void setup(void)
{
    init_f8();
    if (is_cpu()) h_setup();
    else h_setup_cross();
}

int main(void)
{
    if (!fp8_supported()) return 77;
    Suite *s = suite_create("moe_fp8");
    TCase *tc = h_add_tcase(s, "core", setup, 600);
    moe_fp8_routed_tests(tc);
    moe_fp8_masked_tests(tc);
    return h_run(s);
}
