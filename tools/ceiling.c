/* Which backend measures which ceiling: the table `moefuse bench` and `moefuse info` read. */
#include "ceiling.h"

#include <string.h>

/*
 * A backend's ceilings come from its own device and runtime, on the context's stream, so each
 * backend has a provider in its own file, built only when the library has that backend.
 */
static const ceiling_provider *const providers[] = {
    &ceiling_cpu,
#ifdef MOEFUSE_HAVE_OPENCL_CEILING
    &ceiling_opencl,
#endif
#ifdef MOEFUSE_HAVE_CUDA_CEILING
    &ceiling_cuda,
#endif
};

const ceiling_provider *ceiling_provider_for(const char *backend)
{
    for (size_t i = 0; i < sizeof providers / sizeof providers[0]; i++)
        if (strcmp(providers[i]->backend, backend) == 0)
            return providers[i];
    return NULL;
}
