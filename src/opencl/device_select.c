/*
 * Which OpenCL device a context uses. The caller's device string
 * (moefuse_context_create_on), else MOEFUSE_OPENCL_DEVICE, may hold "p:d"
 * (platform index, device index within it) or a substring of the device or
 * platform name (case-insensitive). Neither: the first GPU of any platform,
 * else the first device of any kind.
 */
#include "opencl/ocl_internal.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MF_MAX_PLATFORMS 16
#define MF_MAX_DEVICES 64

static cl_uint list_platforms(cl_platform_id *ids)
{
    cl_uint n = 0;
    if (clGetPlatformIDs(MF_MAX_PLATFORMS, ids, &n) != CL_SUCCESS)
        return 0;
    return n > MF_MAX_PLATFORMS ? MF_MAX_PLATFORMS : n;
}

static cl_uint list_devices(cl_platform_id p, cl_device_type type, cl_device_id *ids)
{
    cl_uint n = 0;
    if (clGetDeviceIDs(p, type, MF_MAX_DEVICES, ids, &n) != CL_SUCCESS)
        return 0; /* CL_DEVICE_NOT_FOUND included */
    return n > MF_MAX_DEVICES ? MF_MAX_DEVICES : n;
}

bool mf_ocl_any_gpu(void)
{
    cl_platform_id plats[MF_MAX_PLATFORMS];
    cl_device_id devs[MF_MAX_DEVICES];
    cl_uint np = list_platforms(plats);
    for (cl_uint p = 0; p < np; p++)
        if (list_devices(plats[p], CL_DEVICE_TYPE_GPU, devs) > 0)
            return true;
    return false;
}

/* Case-insensitive substring test. */
static bool contains(const char *hay, const char *needle)
{
    size_t n = strlen(needle);
    for (; *hay; hay++) {
        size_t i = 0;
        while (i < n && hay[i] &&
               tolower((unsigned char)hay[i]) == tolower((unsigned char)needle[i]))
            i++;
        if (i == n)
            return true;
    }
    return n == 0;
}

/* "p:d" with two decimal indices. */
static bool parse_index(const char *s, unsigned long *p, unsigned long *d)
{
    char *end;
    if (!isdigit((unsigned char)*s))
        return false;
    *p = strtoul(s, &end, 10);
    if (*end != ':' || !isdigit((unsigned char)end[1]))
        return false;
    *d = strtoul(end + 1, &end, 10);
    return *end == '\0';
}

moefuse_status mf_ocl_pick_device(moefuse_context *ctx, const char *want, cl_platform_id *platform,
                                  cl_device_id *device)
{
    cl_platform_id plats[MF_MAX_PLATFORMS];
    cl_device_id devs[MF_MAX_DEVICES];
    cl_uint np = list_platforms(plats);
    if (np == 0)
        return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                        "opencl: no OpenCL platform found (is an ICD installed?)");
    const char *from = "device";
    if (!want) {
        want = getenv("MOEFUSE_OPENCL_DEVICE");
        from = "MOEFUSE_OPENCL_DEVICE";
    }
    if (want && *want) {
        unsigned long pi, di;
        if (parse_index(want, &pi, &di)) {
            if (pi >= np)
                return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                                "opencl: %s '%.64s': there are %u platforms", from, want,
                                (unsigned)np);
            cl_uint nd = list_devices(plats[pi], CL_DEVICE_TYPE_ALL, devs);
            if (di >= nd)
                return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                                "opencl: %s '%.64s': platform %lu has %u devices",
                                from, want, pi, (unsigned)nd);
            *platform = plats[pi];
            *device = devs[di];
            return MOEFUSE_OK;
        }
        for (cl_uint p = 0; p < np; p++) {
            char pname[256] = "";
            clGetPlatformInfo(plats[p], CL_PLATFORM_NAME, sizeof pname - 1, pname, NULL);
            cl_uint nd = list_devices(plats[p], CL_DEVICE_TYPE_ALL, devs);
            for (cl_uint d = 0; d < nd; d++) {
                char dname[256] = "";
                clGetDeviceInfo(devs[d], CL_DEVICE_NAME, sizeof dname - 1, dname, NULL);
                if (contains(dname, want) || contains(pname, want)) {
                    *platform = plats[p];
                    *device = devs[d];
                    return MOEFUSE_OK;
                }
            }
        }
        return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                        "opencl: %s '%.64s' matches no platform or device name "
                        "(use \"p:d\" indices or a name substring)",
                        from, want);
    }
    const cl_device_type order[2] = {CL_DEVICE_TYPE_GPU, CL_DEVICE_TYPE_ALL};
    for (int pass = 0; pass < 2; pass++)
        for (cl_uint p = 0; p < np; p++)
            if (list_devices(plats[p], order[pass], devs) > 0) {
                *platform = plats[p];
                *device = devs[0];
                return MOEFUSE_OK;
            }
    return mf_error(ctx, MOEFUSE_ERR_BACKEND_UNAVAILABLE,
                    "opencl: %u platform%s but no device", (unsigned)np, np == 1 ? "" : "s");
}
