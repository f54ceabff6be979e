/*
 * On-disk cache of program binaries, so a context does not recompile the
 * kernels every time (seconds on some drivers). One file per key; the key
 * hashes everything that changes the binary: platform and device names and
 * versions, driver version, build options and the embedded source's hash.
 * Entries carry a checksum; anything that does not check out, or that the
 * driver refuses, is rebuilt from source and rewritten, never trusted.
 *
 * Location: MOEFUSE_OPENCL_CACHE (a directory; "off" disables the cache),
 * else $XDG_CACHE_HOME/moefuse/opencl, else $HOME/.cache/moefuse/opencl.
 */
#include "opencl/ocl_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char magic[8] = {'M', 'F', 'C', 'L', 'B', 'I', 'N', '1'};

static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001B3ull;
    }
    return h;
}

static uint64_t hash_info(uint64_t h, cl_int (*get)(void *, cl_uint, size_t, void *, size_t *),
                          void *obj, cl_uint what)
{
    char buf[512] = "";
    get(obj, what, sizeof buf - 1, buf, NULL);
    return fnv1a(h, buf, strlen(buf) + 1);
}

/* Adapters so one helper hashes platform and device strings. */
static cl_int plat_info(void *o, cl_uint w, size_t n, void *v, size_t *r)
{
    return clGetPlatformInfo((cl_platform_id)o, w, n, v, r);
}
static cl_int dev_info(void *o, cl_uint w, size_t n, void *v, size_t *r)
{
    return clGetDeviceInfo((cl_device_id)o, w, n, v, r);
}

static uint64_t cache_key(const ocl_state *s, const char *options)
{
    uint64_t h = 0xCBF29CE484222325ull;
    h = hash_info(h, plat_info, s->platform, CL_PLATFORM_NAME);
    h = hash_info(h, plat_info, s->platform, CL_PLATFORM_VERSION);
    h = hash_info(h, dev_info, s->device, CL_DEVICE_NAME);
    h = hash_info(h, dev_info, s->device, CL_DEVICE_VERSION);
    h = hash_info(h, dev_info, s->device, CL_DRIVER_VERSION);
    h = fnv1a(h, options, strlen(options) + 1);
    return fnv1a(h, mf_ocl_source_hash, strlen(mf_ocl_source_hash));
}

/* mkdir -p; true when the directory exists afterwards. */
static bool make_dirs(char *path)
{
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        int r = mkdir(path, 0755);
        *p = '/';
        if (r != 0 && errno != EEXIST)
            return false;
    }
    return mkdir(path, 0755) == 0 || errno == EEXIST;
}

/* File of this key, creating the directory; false when there is no cache. */
static bool cache_path(uint64_t key, char *out, size_t size)
{
    char dir[1024];
    const char *env = getenv("MOEFUSE_OPENCL_CACHE");
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    if (env && strcmp(env, "off") == 0)
        return false;
    if (env && *env)
        snprintf(dir, sizeof dir, "%s", env);
    else if (xdg && *xdg)
        snprintf(dir, sizeof dir, "%s/moefuse/opencl", xdg);
    else if (home && *home)
        snprintf(dir, sizeof dir, "%s/.cache/moefuse/opencl", home);
    else
        return false;
    if (!make_dirs(dir))
        return false;
    int n = snprintf(out, size, "%s/%016llx.bin", dir, (unsigned long long)key);
    return n > 0 && (size_t)n < size;
}

/* A program built from a cached binary, or NULL (missing, corrupt, refused). */
static cl_program load(ocl_state *s, const char *path, uint64_t key, const char *options)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char m[8];
    uint64_t hdr[3]; /* key, payload bytes, payload checksum */
    unsigned char *bin = NULL;
    cl_program prog = NULL;
    if (fread(m, 1, 8, f) != 8 || memcmp(m, magic, 8) != 0 || fread(hdr, 8, 3, f) != 3 ||
        hdr[0] != key || hdr[1] == 0 || hdr[1] > ((uint64_t)1 << 30))
        goto done;
    bin = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : malloc((size_t)hdr[1]);
    if (!bin || fread(bin, 1, (size_t)hdr[1], f) != hdr[1] || fgetc(f) != EOF ||
        fnv1a(0xCBF29CE484222325ull, bin, (size_t)hdr[1]) != hdr[2])
        goto done;
    size_t len = (size_t)hdr[1];
    const unsigned char *bins[1] = {bin};
    cl_int bstatus = CL_SUCCESS, e;
    prog = clCreateProgramWithBinary(s->context, 1, &s->device, &len, bins, &bstatus, &e);
    if (e != CL_SUCCESS || bstatus != CL_SUCCESS) {
        if (prog)
            clReleaseProgram(prog);
        prog = NULL;
        goto done;
    }
    /* a binary the driver will not build is rebuilt from source, as a corrupt one */
    if (mf_fault_hit(MF_FAULT_PROGRAM_BUILD) ||
        clBuildProgram(prog, 1, &s->device, options, NULL, NULL) != CL_SUCCESS) {
        clReleaseProgram(prog);
        prog = NULL;
    }
done:
    free(bin);
    fclose(f);
    return prog;
}

/* Best effort: a failure to write only costs the next context a rebuild. */
static void store(ocl_state *s, const char *path, uint64_t key)
{
    size_t len = 0;
    if (clGetProgramInfo(s->program, CL_PROGRAM_BINARY_SIZES, sizeof len, &len, NULL) !=
            CL_SUCCESS ||
        len == 0)
        return;
    unsigned char *bin = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : malloc(len);
    if (!bin)
        return;
    unsigned char *bins[1] = {bin};
    if (clGetProgramInfo(s->program, CL_PROGRAM_BINARIES, sizeof bins, bins, NULL) == CL_SUCCESS) {
        char tmp[1100];
        snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
        FILE *f = fopen(tmp, "wb");
        if (f) {
            uint64_t hdr[3] = {key, (uint64_t)len, fnv1a(0xCBF29CE484222325ull, bin, len)};
            bool ok = fwrite(magic, 1, 8, f) == 8 && fwrite(hdr, 8, 3, f) == 3 &&
                      fwrite(bin, 1, len, f) == len;
            ok = fclose(f) == 0 && ok;
            /* rename is atomic: readers see the old entry or the whole new one */
            if (!ok || rename(tmp, path) != 0)
                remove(tmp);
        }
    }
    free(bin);
}

bool mf_ocl_cache_load(ocl_state *s, const char *options, char *path, size_t size)
{
    const uint64_t key = cache_key(s, options);
    if (!cache_path(key, path, size)) {
        path[0] = '\0';
        return false;
    }
    s->program = load(s, path, key, options);
    return s->program != NULL;
}

void mf_ocl_cache_store(ocl_state *s, const char *options, const char *path)
{
    if (path[0])
        store(s, path, cache_key(s, options));
}
