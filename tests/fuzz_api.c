/*
 * fuzz_api: a seeded random driver for the public API, meant to run under
 * ASan + UBSan (CI runs it on the release and the sanitizer builds).
 *
 * All operands of a call live in one arena from moefuse_buffer_alloc, so the
 * same code drives host memory (cpu: data pointer + offset) and a cl_mem
 * (opencl: handle + byte offset). Calls are mostly near-valid: a valid call
 * (random sizes, row padding, odd strides of size-1 dims, offsets, dtypes,
 * options, absent optional operands, empty tensors) with one thing perturbed
 * (a dim, the rank, the dtype, a stride, the offset, an alias onto another
 * operand, NULL, a foreign pointer, a position past the end, an option), so
 * that the kernels really run; some calls are left valid, some get several
 * perturbations.
 *
 * What every call is checked for (include/moefuse.h, docs/API.md):
 *  - refused: no byte of the arena changed, and moefuse_last_error is set;
 *  - accepted: only bytes of elements of its outputs changed, the message is
 *    empty, and nothing was wrong that the API says must be refused (negative
 *    dims, bad strides, offsets or alignment, NULL data, an output sharing a
 *    byte with another operand, a tensor past the end of its OpenCL buffer,
 *    an invalid option, ...);
 *  - a call the generator left valid is accepted;
 *  - every HEALTH_EVERY calls a fixed valid call gives the bytes it gave at
 *    the start (the context keeps working).
 *
 * Environment:
 *  MOEFUSE_TEST_BACKEND   cpu (default), opencl or cuda
 *  MOEFUSE_FUZZ_SEED      seed (default: random; printed)
 *  MOEFUSE_FUZZ_SECONDS   time bound (default 15, or none when only a call count is given)
 *  MOEFUSE_FUZZ_CALLS     call bound (default none)
 *  MOEFUSE_FUZZ_START     index of the first call: each call draws from its own stream, so
 *                         MOEFUSE_FUZZ_START=i MOEFUSE_FUZZ_CALLS=1 replays call i alone
 *  MOEFUSE_FUZZ_VERBOSE   1: describe every call
 * Exit status: 0 clean, 1 on any violation, 77 (Meson's SKIP) when the backend
 * is built but has no device.
 */
#include "fuzz_api.h"

#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define FUZZ_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUZZ_ASAN 1
#endif
#endif
#ifdef FUZZ_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

const char *const op_names[OP_COUNT] = {
    "act_quant", "act_quant_masked", "act_mul",  "quant",       "dequant",
    "topk_softmax", "moe_gate",      "moe_final", "moe_forward", "topk_route",
    "routing_metadata",
};

const char *const violation_names[V_KIND_COUNT] = {
    "accepted overlap", "accepted out of bounds", "accepted invalid", "refused valid",
    "wrote outside outputs", "refused but wrote", "message", "status", "context broke",
};

/* ----------------------------------------------------------------- one call */

static uint64_t current_call = UINT64_MAX; /* for the crash message */

static bool upload_and_snapshot(fuzzer *f)
{
    return moefuse_buffer_write(f->ctx, f->arena, 0, f->image, (size_t)f->arena_bytes) ==
               MOEFUSE_OK &&
           moefuse_buffer_read(f->ctx, f->arena, 0, f->before, (size_t)f->arena_bytes) ==
               MOEFUSE_OK;
}

static void run_call(fuzzer *f, uint64_t index)
{
    rng r = call_rng(f->seed, index);
    fuzz_call c;
    call_record rec = {index, MOEFUSE_OK, ""};
    current_call = index;
    build_call(f, &r, &c);
    verdict v = expected_outcome(f, &c);
    compose_image(f, &r, &c);
    if (!upload_and_snapshot(f)) {
        snprintf(rec.message, sizeof rec.message, "%s", moefuse_last_error(f->ctx));
        violation(f, V_CONTEXT, &c, &rec, "cannot upload the arena");
        return;
    }
    if (f->verbose) { /* before the call, so that a crash shows what it was */
        printf("call %llu: expected %s%s%s\n", (unsigned long long)index,
               v.expect == EXPECT_OK ? "ok" : v.expect == EXPECT_REFUSAL ? "refusal" : "either",
               v.why[0] ? ": " : "", v.why);
        describe_call(&c);
        fflush(stdout);
    }
    rec.status = invoke(f, &c);
    snprintf(rec.message, sizeof rec.message, "%s",
             moefuse_last_error(c.null_context ? NULL : f->ctx));
    moefuse_status sync = moefuse_synchronize(f->ctx);
    moefuse_status read =
        moefuse_buffer_read(f->ctx, f->arena, 0, f->after, (size_t)f->arena_bytes);
    op_stats *s = &f->stats[c.op];
    s->calls++;
    if (rec.status == MOEFUSE_OK)
        s->ok++;
    else
        s->refused++;
    if (f->verbose)
        printf("  -> %s \"%s\"\n", moefuse_status_name(rec.status), rec.message);
    if (sync != MOEFUSE_OK || read != MOEFUSE_OK) {
        violation(f, V_CONTEXT, &c, &rec, "the context broke: synchronize %s, buffer_read %s",
                  moefuse_status_name(sync), moefuse_status_name(read));
        return;
    }
    check_call(f, &c, &rec, &v);
}

/* ----------------------------------------------------------------- the known-good call */

typedef struct health_layout {
    int64_t cursor;
    unsigned char *image;
    void *buffer;
    bool handles;
} health_layout;

/* A dense tensor in the health buffer with deterministic contents (generator seeded per tensor). */
static moefuse_tensor health_tensor(health_layout *h, moefuse_dtype dt, int rank,
                                    const int64_t *shape, uint64_t seed)
{
    moefuse_tensor t = moefuse_tensor_dense(NULL, dt, rank, shape);
    h->cursor = round_up(h->cursor, 64);
    t.data = h->handles ? h->buffer : (unsigned char *)h->buffer + h->cursor;
    t.offset = h->handles ? h->cursor : 0;
    rng r = {seed};
    int64_t n = moefuse_tensor_numel(&t);
    for (int64_t i = 0; i < n; i++) {
        unsigned char *p = h->image + h->cursor + i * (int64_t)moefuse_dtype_size(dt);
        if (dt == MOEFUSE_F32) {
            float v = (float)(rng_unit(&r) * 2.0 - 1.0);
            memcpy(p, &v, 4);
        } else if (dt == MOEFUSE_I32) { /* ids: experts 0..3 */
            int32_t v = (int32_t)rng_int(&r, 0, 3);
            memcpy(p, &v, 4);
        } else {
            *p = (unsigned char)rng_next(&r);
        }
    }
    h->cursor += moefuse_tensor_span_bytes(&t);
    return t;
}

static moefuse_status health_calls(fuzzer *f)
{
    health_layout h = {0, f->health_image, f->health, f->handles};
    moefuse_tensor x = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 256), 1);
    moefuse_tensor q = health_tensor(&h, MOEFUSE_F8_E4M3, 2, SHAPE(4, 128), 2);
    moefuse_tensor s = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 1), 3);
    moefuse_tensor logits = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 8), 4);
    moefuse_tensor top_ids = health_tensor(&h, MOEFUSE_I32, 2, SHAPE(4, 2), 5);
    moefuse_tensor top_w = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(4, 2), 6);
    moefuse_tensor mx = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(3, 16), 7);
    moefuse_tensor w1 = health_tensor(&h, MOEFUSE_F32, 3, SHAPE(4, 16, 16), 8);
    moefuse_tensor w2 = health_tensor(&h, MOEFUSE_F32, 3, SHAPE(4, 16, 8), 9);
    moefuse_routing routing = {.topk_ids = health_tensor(&h, MOEFUSE_I32, 2, SHAPE(3, 2), 10),
                               .topk_weights = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(3, 2), 11)};
    moefuse_tensor out = health_tensor(&h, MOEFUSE_F32, 2, SHAPE(3, 16), 12);
    f->health_bytes = h.cursor;
    moefuse_status st;
    if ((st = moefuse_buffer_write(f->ctx, f->health, 0, f->health_image, (size_t)h.cursor)) ||
        (st = moefuse_act_quant(f->ctx, &x, NULL, &q, &s, NULL)) ||
        (st = moefuse_topk_softmax(f->ctx, &logits, 1, &top_ids, &top_w)) ||
        (st = moefuse_moe_forward(f->ctx, &mx, &w1, &w2, NULL, NULL, &routing, &out, NULL)) ||
        (st = moefuse_synchronize(f->ctx)))
        return st;
    return moefuse_buffer_read(f->ctx, f->health, 0, f->health_now, (size_t)h.cursor);
}

/* The same valid calls give the same bytes as at the start: the context still works. */
static void health_check(fuzzer *f, uint64_t index)
{
    call_record rec = {index, MOEFUSE_OK, ""};
    rec.status = health_calls(f);
    if (rec.status != MOEFUSE_OK) {
        snprintf(rec.message, sizeof rec.message, "%s", moefuse_last_error(f->ctx));
        violation(f, V_CONTEXT, NULL, &rec, "the known-good calls failed after call %llu",
                  (unsigned long long)index);
        return;
    }
    if (!f->health_recorded) {
        memcpy(f->health_reference, f->health_now, (size_t)f->health_bytes);
        f->health_recorded = true;
    } else if (memcmp(f->health_reference, f->health_now, (size_t)f->health_bytes) != 0) {
        violation(f, V_CONTEXT, NULL, &rec,
                  "the known-good calls give other bytes than at the start");
    }
}

/* ----------------------------------------------------------------- setup and main */

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t env_u64(const char *name, uint64_t fallback, bool *given)
{
    const char *s = getenv(name);
    if (given)
        *given = s && *s;
    return s && *s ? strtoull(s, NULL, 0) : fallback;
}

static uint64_t random_seed(void)
{
    uint64_t seed = 0;
    FILE *urandom = fopen("/dev/urandom", "rb");
    if (!urandom || fread(&seed, sizeof seed, 1, urandom) != 1)
        seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    if (urandom)
        fclose(urandom);
    return seed & 0xFFFFFFFFFFFFull;
}

static bool backend_built(const char *name)
{
    const char *list = moefuse_built_backends();
    size_t n = strlen(name);
    for (const char *p = list; (p = strstr(p, name)) != NULL; p += n)
        if ((p == list || p[-1] == ',') && (p[n] == '\0' || p[n] == ','))
            return true;
    return false;
}

/* 0: ready; 77: built but no device (Meson's SKIP); 1: failure. */
static int open_context(fuzzer *f)
{
    moefuse_status st = moefuse_context_create(&f->ctx, f->backend);
    if (st == MOEFUSE_OK) {
        const char *name = moefuse_backend_name(f->ctx);
        f->handles = strcmp(name, "opencl") == 0;
        f->knows_sizes = f->handles;
        f->checks_ownership = strcmp(name, "cpu") != 0;
        return 0;
    }
    if (st == MOEFUSE_ERR_BACKEND_UNAVAILABLE && backend_built(f->backend)) {
        printf("SKIP: backend %s unavailable: %s\n", f->backend, moefuse_last_error(NULL));
        return 77;
    }
    printf("FAIL: no context on backend %s (built: %s): %s: %s\n", f->backend,
           moefuse_built_backends(), moefuse_status_name(st), moefuse_last_error(NULL));
    return 1;
}

static bool allocate(fuzzer *f)
{
    f->arena_bytes = ARENA_BYTES;
    f->image = malloc(ARENA_BYTES);
    f->before = malloc(ARENA_BYTES);
    f->after = malloc(ARENA_BYTES);
    f->writable = malloc(ARENA_BYTES);
    f->health_image = calloc(1, 16384);
    f->health_reference = malloc(16384);
    f->health_now = malloc(16384);
    return f->image && f->before && f->after && f->writable && f->health_image &&
           f->health_reference && f->health_now &&
           moefuse_buffer_alloc(f->ctx, ARENA_BYTES, &f->arena) == MOEFUSE_OK &&
           moefuse_buffer_alloc(f->ctx, 16384, &f->health) == MOEFUSE_OK;
}

static void release(fuzzer *f)
{
    moefuse_buffer_free(f->ctx, f->arena);
    moefuse_buffer_free(f->ctx, f->health);
    moefuse_context_destroy(f->ctx);
    free(f->image);
    free(f->before);
    free(f->after);
    free(f->writable);
    free(f->health_image);
    free(f->health_reference);
    free(f->health_now);
}

static uint64_t crash_seed;
static const char *crash_backend = "";

static void write_text(const char *s) { (void)!write(2, s, strlen(s)); }

static void write_number(uint64_t v)
{
    char digits[24];
    int n = 0;
    do
        digits[n++] = (char)('0' + v % 10);
    while ((v /= 10) && n < 24);
    while (n)
        (void)!write(2, &digits[--n], 1);
}

/* A crash is a failure too: say which call, so that it can be replayed. */
static void report_crash(void)
{
    static volatile sig_atomic_t reported;
    if (reported)
        return; /* ASan's death callback, then its abort */
    reported = 1;
    write_text("\nfuzz_api: crashed in call ");
    write_number(current_call);
    write_text(" (replay: MOEFUSE_TEST_BACKEND=");
    write_text(crash_backend);
    write_text(" MOEFUSE_FUZZ_SEED=");
    write_number(crash_seed);
    write_text(" MOEFUSE_FUZZ_START=");
    write_number(current_call);
    write_text(" MOEFUSE_FUZZ_CALLS=1 MOEFUSE_FUZZ_VERBOSE=1)\n");
}

static void on_fatal_signal(int sig)
{
    report_crash();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_crash_report(const fuzzer *f)
{
    crash_seed = f->seed;
    crash_backend = f->backend;
#ifdef FUZZ_ASAN
    /* keep ASan's own SEGV report; a separate UBSan runtime (gcc) comes through SIGABRT
       when UBSAN_OPTIONS has abort_on_error=1, as tests/meson.build sets */
    __sanitizer_set_death_callback(report_crash);
#else
    signal(SIGSEGV, on_fatal_signal);
    signal(SIGBUS, on_fatal_signal);
    signal(SIGFPE, on_fatal_signal);
    signal(SIGILL, on_fatal_signal);
#endif
    signal(SIGABRT, on_fatal_signal);
}

static void print_summary(const fuzzer *f, double seconds)
{
    op_stats total = {0, 0, 0};
    for (int op = 0; op < OP_COUNT; op++) {
        const op_stats *s = &f->stats[op];
        printf("  %-17s %8llu calls (%llu ok, %llu refused)\n", op_names[op],
               (unsigned long long)s->calls, (unsigned long long)s->ok,
               (unsigned long long)s->refused);
        total.calls += s->calls, total.ok += s->ok, total.refused += s->refused;
    }
    if (f->violations) {
        printf("violations by kind (the first %d of each are described above):", REPORTS_PER_KIND);
        for (int k = 0; k < V_KIND_COUNT; k++)
            if (f->violations_of[k])
                printf(" %s %llu;", violation_names[k], (unsigned long long)f->violations_of[k]);
        printf("\n");
    }
    printf("fuzz_api on %s: %llu calls (%llu ok, %llu refused) in %.1f s, %.0f calls/s, "
           "seed %llu, %llu violations\n",
           f->backend, (unsigned long long)total.calls, (unsigned long long)total.ok,
           (unsigned long long)total.refused, seconds,
           seconds > 0 ? (double)total.calls / seconds : 0.0,
           (unsigned long long)f->seed, (unsigned long long)f->violations);
}

int main(int argc, char **argv)
{
    fuzzer f;
    memset(&f, 0, sizeof f);
    const char *backend = getenv("MOEFUSE_TEST_BACKEND");
    f.backend = backend && *backend ? backend : "cpu";
    f.program = argc > 0 ? argv[0] : "fuzz_api";
    int gate = open_context(&f);
    if (gate != 0)
        return gate;
    if (!allocate(&f)) {
        printf("FAIL: cannot allocate the arena: %s\n", moefuse_last_error(f.ctx));
        return 1;
    }
    bool seed_given, calls_given;
    f.seed = env_u64("MOEFUSE_FUZZ_SEED", 0, &seed_given);
    if (!seed_given)
        f.seed = random_seed();
    uint64_t calls = env_u64("MOEFUSE_FUZZ_CALLS", 0, &calls_given);
    uint64_t start = env_u64("MOEFUSE_FUZZ_START", 0, NULL);
    const char *seconds_text = getenv("MOEFUSE_FUZZ_SECONDS");
    /* a call count alone means exactly that many calls, whatever the time */
    double seconds = seconds_text && *seconds_text ? strtod(seconds_text, NULL)
                     : calls_given                 ? 0.0
                                                   : DEFAULT_SECONDS;
    f.verbose = env_u64("MOEFUSE_FUZZ_VERBOSE", 0, NULL) != 0;
    printf("fuzz_api: backend %s (%s), MOEFUSE_FUZZ_SEED=%llu, from call %llu", f.backend,
           moefuse_device_name(f.ctx), (unsigned long long)f.seed, (unsigned long long)start);
    if (seconds > 0)
        printf(", for %g s", seconds);
    if (calls_given)
        printf(", at most %llu calls", (unsigned long long)calls);
    printf("\n");
    fflush(stdout);
    install_crash_report(&f);

    health_check(&f, start);
    double began = now_seconds();
    uint64_t index = start;
    for (; !calls_given || index - start < calls; index++) {
        if (seconds > 0 && now_seconds() - began >= seconds)
            break;
        run_call(&f, index);
        if ((index + 1) % HEALTH_EVERY == 0)
            health_check(&f, index);
    }
    double elapsed = now_seconds() - began;
    health_check(&f, index);
    print_summary(&f, elapsed);
    release(&f);
    return f.violations ? 1 : 0;
}
