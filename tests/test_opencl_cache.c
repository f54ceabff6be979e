/* test_opencl: the on-disk cache of program binaries (MOEFUSE_OPENCL_CACHE). */
#include "test_opencl.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------ binary cache */

enum { CQ_T = 4, CQ_H = 256, CQ_BYTES = CQ_T * CQ_H + CQ_T * 2 * 4 };

/* quant of a fixed input on ctx (T = 4, H = 256, G = 128): codes then scales. */
static void quant_on(moefuse_context *ctx, unsigned char *out)
{
    static float x[CQ_T * CQ_H];
    for (int i = 0; i < CQ_T * CQ_H; i++) x[i] = (float)((i * 37 % 1001) - 500) * 0.37f;
    void *xb = NULL, *qb = NULL, *sb = NULL;
    int64_t xs[2] = {CQ_T, CQ_H}, ss[2] = {CQ_T, 2};
    HCHECK(moefuse_buffer_alloc(ctx, sizeof x, &xb) == MOEFUSE_OK &&
               moefuse_buffer_alloc(ctx, CQ_T * CQ_H, &qb) == MOEFUSE_OK &&
               moefuse_buffer_alloc(ctx, CQ_T * 2 * 4, &sb) == MOEFUSE_OK,
           "alloc: %s", moefuse_last_error(ctx));
    HCHECK(moefuse_buffer_write(ctx, xb, 0, x, sizeof x) == MOEFUSE_OK, "write: %s", moefuse_last_error(ctx));
    moefuse_tensor xt = moefuse_tensor_dense(xb, MOEFUSE_F32, 2, xs);
    moefuse_tensor qt = moefuse_tensor_dense(qb, MOEFUSE_F8_E4M3, 2, xs);
    moefuse_tensor st = moefuse_tensor_dense(sb, MOEFUSE_F32, 2, ss);
    HCHECK(moefuse_quant(ctx, &xt, &qt, &st, NULL) == MOEFUSE_OK, "quant: %s", moefuse_last_error(ctx));
    HCHECK(moefuse_buffer_read(ctx, qb, 0, out, CQ_T * CQ_H) == MOEFUSE_OK &&
               moefuse_buffer_read(ctx, sb, 0, out + CQ_T * CQ_H, CQ_T * 2 * 4) == MOEFUSE_OK,
           "read: %s", moefuse_last_error(ctx));
    moefuse_buffer_free(ctx, xb);
    moefuse_buffer_free(ctx, qb);
    moefuse_buffer_free(ctx, sb);
}

/* Files in dir: how many, and the path of the last "*.bin" (entries) or any (all). */
static int count_files(const char *dir, int bins_only, char *last, size_t size)
{
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *nm = e->d_name;
        size_t len = strlen(nm);
        if (strcmp(nm, ".") == 0 || strcmp(nm, "..") == 0) continue;
        if (bins_only && (len < 4 || strcmp(nm + len - 4, ".bin") != 0)) continue;
        n++;
        if (last) snprintf(last, size, "%s/%s", dir, nm);
    }
    closedir(d);
    return n;
}

/* A context built with the cache as it is now: was its program loaded from it? Its quant must equal `want`. */
static int context_from_cache(const unsigned char *want, const char *step)
{
    moefuse_context *c = NULL;
    HCHECK(moefuse_context_create(&c, "opencl") == MOEFUSE_OK, "%s: context_create: %s", step,
           moefuse_last_error(NULL));
    int cached = strstr(moefuse_device_name(c), "cached binary") != NULL;
    unsigned char got[CQ_BYTES];
    quant_on(c, got);
    moefuse_context_destroy(c);
    HCHECK(memcmp(got, want, CQ_BYTES) == 0, "%s: quant differs from the context built from source", step);
    return cached;
}

static long file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (long)sb.st_size : -1;
}

/* Rewrite the entry: garbage of the same size, the first half only, or one payload byte flipped. */
static void damage(const char *path, int how)
{
    long size = file_size(path);
    unsigned char *b = malloc((size_t)size);
    FILE *f = fopen(path, "rb");
    HCHECK(f && fread(b, 1, (size_t)size, f) == (size_t)size, "cannot read %s", path);
    fclose(f);
    if (how == 0)
        for (long i = 0; i < size; i++) b[i] = (unsigned char)h_rand();
    if (how == 2) b[size - 1] ^= 0x40; /* past the 32-byte header: the checksum must catch it */
    f = fopen(path, "wb");
    HCHECK(f && fwrite(b, 1, (size_t)(how == 1 ? size / 2 : size), f) == (size_t)(how == 1 ? size / 2 : size),
           "cannot write %s", path);
    fclose(f);
    free(b);
}

/* rm -r; stops at the first thing it cannot remove */
static int remove_tree(const char *dir)
{
    char path[1200];
    while (count_files(dir, 0, path, sizeof path) > 0) {
        struct stat sb;
        int gone = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode) ? remove_tree(path) : remove(path) == 0;
        if (!gone) break;
    }
    return rmdir(dir) == 0;
}

static void temp_dir(char *out, size_t size, const char *what)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(out, size, "%s/moefuse-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", what);
    HCHECK(mkdtemp(out) != NULL, "mkdtemp %s failed", out);
}

START_TEST(t_program_cache)
{
    saved_env cache = env_save("MOEFUSE_OPENCL_CACHE"), xdg = env_save("XDG_CACHE_HOME"),
              home = env_save("HOME");
    char root[512], dir[600], entry[1200];
    temp_dir(root, sizeof root, "cache");
    snprintf(dir, sizeof dir, "%s/not/yet/there", root); /* created on first use */
    setenv("MOEFUSE_OPENCL_CACHE", dir, 1);

    unsigned char want[CQ_BYTES];
    moefuse_context *c = NULL;
    HCHECK(moefuse_context_create(&c, "opencl") == MOEFUSE_OK, "first context: %s", moefuse_last_error(NULL));
    HCHECK(strstr(moefuse_device_name(c), "cached binary") == NULL, "first context on an empty cache: \"%s\"",
           moefuse_device_name(c));
    quant_on(c, want);
    moefuse_context_destroy(c);
    HCHECK(count_files(dir, 0, entry, sizeof entry) == 1 && count_files(dir, 1, entry, sizeof entry) == 1,
           "the first context should leave exactly one entry (*.bin) in %s", dir);
    if (strstr(moefuse_device_name(g_ctx), "division not correctly rounded") == NULL) {
        moefuse_context *cpu = NULL;
        unsigned char ref[CQ_BYTES];
        HCHECK(moefuse_context_create(&cpu, "cpu") == MOEFUSE_OK, "cpu: %s", moefuse_last_error(NULL));
        quant_on(cpu, ref);
        moefuse_context_destroy(cpu);
        HCHECK(memcmp(ref, want, CQ_BYTES) == 0,
               "quant from the source-built program differs from the cpu backend");
    }
    HCHECK(context_from_cache(want, "second context"), "the second context did not load the cached binary");

    static const char *const damages[3] = {"garbage", "truncated", "one payload byte flipped"};
    for (int how = 0; how < 3; how++) {
        damage(entry, how);
        HCHECK(!context_from_cache(want, damages[how]), "a %s entry was loaded", damages[how]);
        HCHECK(count_files(dir, 0, NULL, 0) == 1, "%s: the rebuild should leave one file", damages[how]);
        HCHECK(context_from_cache(want, damages[how]), "%s: the entry was not rewritten valid", damages[how]);
    }

    /* off: nothing written, not under XDG_CACHE_HOME or HOME, nor in a folder named "off"
     * (run from inside the empty folder so a relative one would show) */
    char elsewhere[512], cwd[1024];
    temp_dir(elsewhere, sizeof elsewhere, "home");
    setenv("MOEFUSE_OPENCL_CACHE", "off", 1);
    setenv("XDG_CACHE_HOME", elsewhere, 1);
    setenv("HOME", elsewhere, 1);
    HCHECK(getcwd(cwd, sizeof cwd) && chdir(elsewhere) == 0, "cannot enter %s", elsewhere);
    int cached = context_from_cache(want, "cache off");
    HCHECK(chdir(cwd) == 0, "cannot go back to %s", cwd);
    HCHECK(!cached, "MOEFUSE_OPENCL_CACHE=off loaded a cached binary");
    HCHECK(count_files(elsewhere, 0, NULL, 0) == 0, "MOEFUSE_OPENCL_CACHE=off wrote into %s", elsewhere);
    HCHECK(count_files(dir, 0, NULL, 0) == 1, "MOEFUSE_OPENCL_CACHE=off changed %s", dir);

    env_restore(&cache);
    env_restore(&xdg);
    env_restore(&home);
    remove_tree(elsewhere);
    remove_tree(root);
}
END_TEST

void opencl_cache_tests(TCase *tc)
{
    tcase_add_test(tc, t_program_cache);
}
