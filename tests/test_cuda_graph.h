/* test_cuda_graph's parts (test_cuda_graph.c says what it checks): checks, agreement with the
 * CPU, capture, and what each file gives the others. */
#ifndef MOEFUSE_TEST_CUDA_GRAPH_H
#define MOEFUSE_TEST_CUDA_GRAPH_H

#include <cuda_runtime.h>

#include "harness.h"

#define CU(call)                                                                                 \
    do {                                                                                         \
        cudaError_t e_ = (call);                                                                 \
        HCHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                      \
    } while (0)

#define OK(call)                                                                                 \
    do {                                                                                         \
        moefuse_status s_ = (call);                                                              \
        HCHECK(s_ == MOEFUSE_OK, "%s: %s (%s)", #call, moefuse_status_name(s_),                  \
               moefuse_last_error(g_ctx));                                                       \
    } while (0)

/* HCHECK inside loops over elements: Check records every assertion that passes, which is slow. */
#define EXPECT(cond, ...)                                                                        \
    do {                                                                                         \
        if (!(cond))                                                                             \
            HCHECK(0, __VA_ARGS__);                                                              \
    } while (0)

/* Two tensors made alike (same shape, pads and dtype): every element byte equal. */
/* ------------------------------------------------- agreement with the CPU */

/* A device output against the CPU's: bytes judged by a tolerance, all other element bytes equal. */
typedef struct {
    tbuf *dev, *cpu;
    unsigned char *judged;
    char what[96]; /* a copy: h_fmt's buffers are reused */
} versus;

/* ------------------------------------------------------------------ capture */

typedef moefuse_status (*issue_fn)(void *arg, int graph);
/* The same calls on one side (EAGER, GRAPH or CPU: below). */
typedef moefuse_status (*side_fn)(void *arg, int side);

/* --------------------------------------------------------------- the layer */

typedef struct {
    int64_t M, E, k, K, I;
    tbuf *x, *w1, *w2, *ids, *wts, *out_eager, *out_graph;
    tbuf *out_cpu; /* the CPU's result from the inputs' twins */
    moefuse_routing R, R_cpu;
} layer;

/* ---------------------------------------------------------- the row operations */

/* Where a row operation runs: the device eagerly, the device in a graph, the CPU golden backend. */
enum { EAGER, GRAPH, CPU, SIDES };
extern const char *const side_name[2]; /* EAGER and GRAPH, for messages */

/* test_cuda_graph_common.c */
void same_bytes(tbuf *got, tbuf *want, const char *what);
void repoison(tbuf *tb);
versus versus_new(tbuf *dev, tbuf *cpu, const char *what);
void versus_end(versus *v);
void same_as_cpu(tbuf *dev, tbuf *cpu, const char *what);
void cmp_act_quant_rows(versus *qs, versus *scs, int sides, tbuf *x, int64_t e, int64_t n,
                        int64_t H, int64_t G);
void cmp_act_mul(tbuf *dev, tbuf *cpu, int64_t Tn, int64_t H, const char *what);
void cmp_topk_weights(tbuf *dev, tbuf *cpu, int64_t M, int64_t k, const char *what);
void cmp_gemm(tbuf *dev, tbuf *cpu, int64_t M, int64_t K, const char *what);
cudaStream_t new_stream(void);
cudaGraph_t capture_graph(cudaStream_t cs, issue_fn issue, void *arg);
cudaGraphExec_t capture(cudaStream_t cs, issue_fn issue, void *arg);
void replay(cudaGraphExec_t exec, cudaStream_t cs);
void replay_eager_cpu(cudaGraphExec_t exec, cudaStream_t cs, side_fn run, void *arg,
                      const char *what);
void graph_done(cudaGraphExec_t exec, cudaStream_t cs);

/* test_cuda_graph_layer.c */
layer layer_new(int64_t M, int64_t E, int64_t k, int64_t K, int64_t I);
moefuse_status layer_issue(void *arg, int graph);
void layer_vs_cpu(layer *L, tbuf *out, const char *what);
tbuf *in(tbuf *input, int side);
tbuf *cpu_output(tbuf *dev, const char *what);
void side_outputs(tbuf *out[SIDES], const char *what, moefuse_dtype dt, int rank,
                  const int64_t *shape);

void cuda_graph_layer_tests(TCase *tc); /* test_cuda_graph_layer.c */
void cuda_graph_decode_tests(TCase *tc); /* test_cuda_graph_decode.c */

#endif
