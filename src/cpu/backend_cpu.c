/* The CPU backend's vtable, state and host memory. */
#include "cpu/cpu_internal.h"
#include "cpu/moe_slots.h"
#include "core/fault.h"
#include "cpu/rows_isa.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>

typedef struct cpu_state {
    char device[128];
} cpu_state;

/* Host memory aligned for a workspace (MOEFUSE_WORKSPACE_ALIGNMENT, a multiple of the 64 bytes
 * the kernels want), the CPU backend's buffers and scratch alike. */
static void *aligned_host_alloc(size_t bytes)
{
    const size_t align = MOEFUSE_WORKSPACE_ALIGNMENT;
    void *p = NULL;
    size_t n = (bytes + align - 1) / align * align;
    if (n < bytes) /* overflow */
        return NULL;
    if (posix_memalign(&p, align, n ? n : align) != 0)
        return NULL;
    return p;
}

void *mf_cpu_alloc(size_t bytes)
{
    return mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : aligned_host_alloc(bytes);
}

void mf_cpu_free(void *p) { free(p); }

moefuse_status mf_cpu_scratch_take(moefuse_context *ctx, const char *op, size_t bytes,
                                   mf_cpu_scratch *out)
{
    mf_region ws;
    bool given;
    MF_TRY(mf_caller_scratch(ctx, op, bytes, &ws, &given));
    if (given) {
        out->mem = (char *)ws.data + ws.offset;
        out->owned = false;
        return MOEFUSE_OK;
    }
    out->mem = mf_cpu_alloc(bytes);
    out->owned = true;
    if (out->mem == NULL)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes of scratch",
                        op, bytes);
    return MOEFUSE_OK;
}

void mf_cpu_scratch_release(mf_cpu_scratch *s)
{
    if (s->owned)
        mf_cpu_free(s->mem);
    s->mem = NULL;
}

static bool cpu_probe(void) { return true; }

static moefuse_status cpu_init(moefuse_context *ctx, const char *device, void **state)
{
    if (device)
        return mf_error(ctx, MOEFUSE_ERR_INVALID_ARGUMENT,
                        "cpu: device '%s': the CPU backend has one device (pass NULL)", device);
    cpu_state *s = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : calloc(1, sizeof *s);
    if (s == NULL)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "cpu: cannot allocate %zu bytes of state",
                        sizeof *s);
    struct utsname u;
    const char *machine = uname(&u) == 0 ? u.machine : "unknown";
    const int n = mf_cpu_max_threads();
    /* the row kernels' instruction-set level, as chosen (or forced by MOEFUSE_CPU_ISA) */
    snprintf(s->device, sizeof s->device, "CPU (%.64s, %d OpenMP thread%s, %s row kernels)",
             machine, n, n == 1 ? "" : "s", mf_cpu_row_kernels_active()->name);
    *state = s;
    return MOEFUSE_OK;
}

static void cpu_release(void *state) { free(state); }

static const char *cpu_device_name(void *state)
{
    return state ? ((const cpu_state *)state)->device : "CPU";
}

static moefuse_status cpu_buffer_alloc(moefuse_context *ctx, void *state, size_t bytes,
                                       void **buffer)
{
    (void)state;
    void *p = mf_fault_hit(MF_FAULT_DEVICE_ALLOC) ? NULL : aligned_host_alloc(bytes);
    if (p == NULL)
        return mf_error(ctx, MOEFUSE_ERR_OUT_OF_MEMORY, "buffer_alloc: cannot allocate %zu bytes",
                        bytes);
    *buffer = p;
    return MOEFUSE_OK;
}

static void cpu_buffer_free(void *state, void *buffer)
{
    (void)state;
    mf_cpu_free(buffer);
}

static moefuse_status cpu_buffer_write(moefuse_context *ctx, void *state, void *buffer,
                                       size_t offset, const void *src, size_t bytes)
{
    (void)ctx;
    (void)state;
    if (bytes)
        memcpy((char *)buffer + offset, src, bytes);
    return MOEFUSE_OK;
}

static moefuse_status cpu_buffer_read(moefuse_context *ctx, void *state, const void *buffer,
                                      size_t offset, void *dst, size_t bytes)
{
    (void)ctx;
    (void)state;
    if (bytes)
        memcpy(dst, (const char *)buffer + offset, bytes);
    return MOEFUSE_OK;
}

const moefuse_backend_i mf_backend_cpu = {
    .name = "cpu",
    .probe = cpu_probe,
    .init = cpu_init,
    .release = cpu_release,
    .device_name = cpu_device_name,
    .set_stream = NULL,
    .get_stream = NULL,
    .synchronize = NULL,
    .buffer_alloc = cpu_buffer_alloc,
    .buffer_free = cpu_buffer_free,
    .buffer_write = cpu_buffer_write,
    .buffer_read = cpu_buffer_read,
    .owns_pointer = NULL,
    .data_is_handle = false,
    .act_quant = mf_cpu_act_quant,
    .act_mul = mf_cpu_act_mul,
    .quant = mf_cpu_quant,
    .dequant = mf_cpu_dequant,
    .topk_route = mf_cpu_topk_route, /* topk_softmax too: its defaults */
    .routing_metadata = mf_cpu_routing_metadata,
    .moe_gate = mf_cpu_moe_gate,
    .moe_final = mf_cpu_moe_final,
    .moe_forward = NULL,
    .moe_shared_routing = mf_cpu_moe_shared_routing,
    .rows_workspace = mf_cpu_rows_workspace,
    .topk_workspace = mf_cpu_topk_workspace,
    .meta_workspace = mf_cpu_meta_workspace,
    .moe_gate_workspace = mf_cpu_moe_gate_workspace,
    .moe_final_workspace = mf_cpu_moe_final_workspace,
    /* FP8: forward and masked run as the gate then the final (the core's fallback) */
    .moe_gate_fp8 = mf_cpu_moe_gate_fp8,
    .moe_final_fp8 = mf_cpu_moe_final_fp8,
    .moe_gate_fp8_workspace = mf_cpu_moe_gate_fp8_workspace,
    .moe_final_fp8_workspace = mf_cpu_moe_final_fp8_workspace,
    .ep_gather = mf_cpu_ep_gather,
    .ep_scatter = mf_cpu_ep_scatter,
    .ep_reduce = mf_cpu_ep_reduce,
    .ep_copy = mf_cpu_ep_copy,
    .ep_ll_pack = mf_cpu_ep_ll_pack,
    .ep_ll_place = mf_cpu_ep_ll_place,
    .ep_ll_partial = mf_cpu_ep_ll_partial,
    .ep_ll_sum = mf_cpu_ep_ll_sum,
};
