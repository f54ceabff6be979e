/*
 * The table of compiled-in backends. A new backend adds one line here (behind
 * its MOEFUSE_WITH_* define) and its sources in src/meson.build.
 */
#include "core/core.h"

#include <string.h>

static const moefuse_backend_i *const backends[] = {
#ifdef MOEFUSE_WITH_CUDA
    &mf_backend_cuda,
#endif
#ifdef MOEFUSE_WITH_OPENCL
    &mf_backend_opencl,
#endif
    &mf_backend_cpu,
};
#define BACKEND_COUNT (sizeof backends / sizeof backends[0])

const moefuse_backend_i *mf_backend_find(const char *name)
{
    for (size_t i = 0; i < BACKEND_COUNT; i++)
        if (strcmp(backends[i]->name, name) == 0)
            return backends[i];
    return NULL;
}

/* Table order is the preference order: cuda, then opencl (GPU only, per its probe), then cpu. */
const moefuse_backend_i *mf_backend_auto(void)
{
    for (size_t i = 0; i < BACKEND_COUNT; i++)
        if (!backends[i]->probe || backends[i]->probe())
            return backends[i];
    return &mf_backend_cpu;
}

const char *moefuse_built_backends(void)
{
    static const char list[] =
#ifdef MOEFUSE_WITH_CUDA
        "cuda,"
#endif
#ifdef MOEFUSE_WITH_OPENCL
        "opencl,"
#endif
        "cpu";
    return list;
}
