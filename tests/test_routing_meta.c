/*
 * routing_metadata against an oracle that lists each expert's slots by scanning them all:
 * counts, padded offsets, the order (padding and tail -1), each slot's position and masked row,
 * every entry exact. Invalid ids, expert_map, empty experts, 0 and 1 tokens, block sizes 1 to
 * 128, each output alone, canaries around all; refusals write nothing. Backends without the
 * call must refuse it (MOEFUSE_ERR_UNSUPPORTED).
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* Every backend has the call (a new one may refuse it until it does). */
static int meta_here(void)
{
    return 1;
}

/* The local expert of a global id, as NUMERICS.md's MoE section says (-1: invalid). */
static int64_t local_of(int64_t id, const int32_t *map, int64_t Eg, int64_t E)
{
    if (id < 0 || id >= Eg)
        return -1;
    if (!map)
        return id;
    return map[id] >= 0 && map[id] < E ? map[id] : -1;
}

/* which: bit 0 offsets, 1 order, 2 position, 3 masked_row (counts always). */
static void run(int64_t M, int64_t k, int64_t E, int64_t Eg, int use_map, int block,
                int64_t extra, int which)
{
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, M, k, 1, 1);
    int32_t *map = NULL;
    tbuf *mapt = NULL;
    if (use_map) {
        mapt = tb_new1("expert_map", MOEFUSE_I32, Eg, 1);
        map = malloc(sizeof(int32_t) * (size_t)Eg);
        for (int64_t g = 0; g < Eg; g++) {
            map[g] = h_randint(0, 3) == 0 ? -1 : (int32_t)h_randint(0, E - 1);
            if (h_randint(0, 19) == 0)
                map[g] = (int32_t)(E + h_randint(0, 3)); /* out of range: invalid */
            tb_set(mapt, g, 0, 0, map[g]);
        }
        tb_upload(mapt);
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < k; j++) {
            int64_t id = h_randint(0, Eg - 1);
            const int64_t r = h_randint(0, 15);
            if (r == 0)
                id = -1 - h_randint(0, 5);
            else if (r == 1)
                id = Eg + h_randint(0, 5);
            else if (r < 4)
                id = 0; /* a busy expert */
            tb_set(ids, m, j, 0, (double)id);
        }
    tb_upload(ids);
    const int64_t S = M * k, L = S + E * (block - 1) + extra;
    tbuf *counts = tb_new1("counts", MOEFUSE_I32, E, 0);
    tbuf *offsets = which & 1 ? tb_new1("offsets", MOEFUSE_I32, E + 1, 0) : NULL;
    tbuf *order = which & 2 ? tb_new1("order", MOEFUSE_I32, L, 0) : NULL;
    tbuf *pos = which & 4 ? tb_new2("position", MOEFUSE_I32, M, k, 2, 0) : NULL;
    tbuf *row = which & 8 ? tb_new2("masked_row", MOEFUSE_I32, M, k, 0, 0) : NULL;
    moefuse_routing routing;
    memset(&routing, 0, sizeof routing);
    routing.topk_ids = *T(ids);
    if (mapt)
        routing.expert_map = *T(mapt);
    moefuse_routing_meta meta;
    memset(&meta, 0, sizeof meta);
    meta.counts = *T(counts);
    if (offsets)
        meta.offsets = *T(offsets);
    if (order)
        meta.order = *T(order);
    if (pos)
        meta.position = *T(pos);
    if (row)
        meta.masked_row = *T(row);
    const moefuse_status st = CALL(moefuse_routing_metadata(g_ctx, &routing, block, &meta));
    if (!meta_here()) {
        HCHECK(st == MOEFUSE_ERR_UNSUPPORTED, "routing_metadata: %s, expected UNSUPPORTED",
               moefuse_status_name(st));
        free(map);
        tb_free_all();
        return;
    }
    HCHECK(st == MOEFUSE_OK, "routing_metadata: %s (%s)", moefuse_status_name(st),
           moefuse_last_error(g_ctx));
    const char *what = h_fmt("M=%lld k=%lld E=%lld Eg=%lld map=%d block=%d which=%d",
                             (long long)M, (long long)k, (long long)E, (long long)Eg, use_map,
                             block, which);
    /* the oracle, expert by expert */
    int64_t start = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = 0;
        if (offsets)
            HCHECK((int64_t)tb_get(offsets, e, 0, 0) == start, "%s: offsets[%lld] %lld, want %lld",
                   what, (long long)e, (long long)tb_get(offsets, e, 0, 0), (long long)start);
        for (int64_t s = 0; s < S; s++) {
            const int64_t id = (int64_t)tb_get(ids, s / k, s % k, 0);
            if (local_of(id, map, use_map ? Eg : E, E) != e)
                continue;
            if (order)
                HCHECK((int64_t)tb_get(order, start + n, 0, 0) == s,
                       "%s: order[%lld] %lld, want slot %lld", what, (long long)(start + n),
                       (long long)tb_get(order, start + n, 0, 0), (long long)s);
            if (pos)
                HCHECK((int64_t)tb_get(pos, s / k, s % k, 0) == start + n,
                       "%s: position of slot %lld is %lld, want %lld", what, (long long)s,
                       (long long)tb_get(pos, s / k, s % k, 0), (long long)(start + n));
            if (row)
                HCHECK((int64_t)tb_get(row, s / k, s % k, 0) == n,
                       "%s: masked row of slot %lld is %lld, want %lld", what, (long long)s,
                       (long long)tb_get(row, s / k, s % k, 0), (long long)n);
            n++;
        }
        HCHECK((int64_t)tb_get(counts, e, 0, 0) == n, "%s: counts[%lld] %lld, want %lld", what,
               (long long)e, (long long)tb_get(counts, e, 0, 0), (long long)n);
        const int64_t padded = (n + block - 1) / block * block;
        if (order)
            for (int64_t p = start + n; p < start + padded; p++)
                HCHECK((int64_t)tb_get(order, p, 0, 0) == -1, "%s: padding order[%lld] is %lld",
                       what, (long long)p, (long long)tb_get(order, p, 0, 0));
        start += padded;
    }
    if (offsets)
        HCHECK((int64_t)tb_get(offsets, E, 0, 0) == start, "%s: offsets[E] %lld, want %lld", what,
               (long long)tb_get(offsets, E, 0, 0), (long long)start);
    if (order)
        for (int64_t p = start; p < L; p++)
            HCHECK((int64_t)tb_get(order, p, 0, 0) == -1, "%s: tail order[%lld] is %lld", what,
                   (long long)p, (long long)tb_get(order, p, 0, 0));
    for (int64_t s = 0; s < S; s++) { /* invalid slots: -1 */
        const int64_t id = (int64_t)tb_get(ids, s / k, s % k, 0);
        if (local_of(id, map, use_map ? Eg : E, E) >= 0)
            continue;
        if (pos)
            HCHECK((int64_t)tb_get(pos, s / k, s % k, 0) == -1, "%s: invalid slot %lld at %lld",
                   what, (long long)s, (long long)tb_get(pos, s / k, s % k, 0));
        if (row)
            HCHECK((int64_t)tb_get(row, s / k, s % k, 0) == -1,
                   "%s: invalid slot %lld in masked row %lld", what, (long long)s,
                   (long long)tb_get(row, s / k, s % k, 0));
    }
    free(map);
    tb_free_all();
}

START_TEST(t_shapes)
{
    run(37, 8, 16, 16, 0, 1, 0, 15);
    run(37, 8, 16, 16, 0, 16, 5, 15);
    run(200, 2, 8, 8, 0, 64, 0, 15);
    run(64, 8, 256, 256, 0, 128, 3, 15);
    run(1, 1, 4, 4, 0, 16, 0, 15);   /* one token, one slot */
    run(0, 4, 6, 6, 0, 16, 2, 15);   /* no tokens: counts 0, order all -1 */
    run(9, 3, 1, 1, 0, 4, 0, 15);    /* one expert */
    run(50, 6, 32, 32, 0, 7, 0, 15); /* a block size no power of two */
    run(4096, 8, 256, 256, 0, 1, 0, 15); /* DeepSeek-V3 at M=4096: a chunk of slots per warp */
    run(10000, 8, 64, 64, 0, 4, 5, 15); /* 80,000 slots: more spans than the most blocks */
    run(1024, 8, 64, 64, 0, 8, 0, 15);    /* 8192 slots: one round a warp of CUDA's 8 blocks */
    run(1025, 8, 256, 256, 0, 16, 1, 15); /* 8200 slots: 16 blocks (8: two rounds) */
    run(2048, 8, 256, 256, 0, 1, 3, 15);  /* 16384: 16 blocks' one round, 8 blocks' two */
    run(2049, 8, 64, 64, 0, 4, 0, 15);    /* 16392 slots: two rounds of 16 (8: the spans) */
    run(4096, 8, 1024, 1024, 0, 3, 2, 15); /* the most experts and slots of one cluster */
    run(4097, 8, 256, 256, 0, 1, 1, 15);  /* 32776 slots: past the cluster, the spans */
    run(100, 4, 1024, 1024, 0, 3, 2, 15); /* CUDA's most experts in one cluster */
    run(300, 4, 1100, 1100, 0, 3, 0, 15);   /* many experts, padded */
    run(300, 4, 2000, 2000, 0, 3, 0, 15);   /* few histogram rows a block */
    run(120, 5, 13000, 13000, 0, 2, 4, 15); /* more experts than one block's histogram holds */
}
END_TEST

START_TEST(t_expert_map)
{
    run(41, 8, 8, 64, 1, 16, 0, 15); /* a rank's 8 of 64 experts */
    run(13, 4, 3, 40, 1, 1, 1, 15);
}
END_TEST

START_TEST(t_each_output_alone)
{
    for (int which = 0; which < 16; which++)
        run(23, 4, 12, 12, which & 1, 8, 0, which);
    for (int which = 1; which < 16; which <<= 1) /* and alone in CUDA's clusters of 16 */
        run(3000, 8, 256, 256, 0, 4, 1, which);
}
END_TEST

START_TEST(t_refusals)
{
    tbuf *ids = tb_new2("topk_ids", MOEFUSE_I32, 4, 2, 0, 1);
    for (int64_t m = 0; m < 4; m++)
        for (int64_t j = 0; j < 2; j++)
            tb_set(ids, m, j, 0, (double)(m + j));
    tb_upload(ids);
    tbuf *counts = tb_new1("counts", MOEFUSE_I32, 6, 0);
    tbuf *fcounts = tb_new1("f32 counts", MOEFUSE_F32, 6, 0);
    tbuf *order = tb_new1("short order", MOEFUSE_I32, 8 + 6 * 3 - 1, 0);
    tbuf *pos = tb_new2("wide position", MOEFUSE_I32, 4, 3, 0, 0);
    tbuf *offs = tb_new1("offsets", MOEFUSE_I32, 6, 0);
    moefuse_routing routing;
    memset(&routing, 0, sizeof routing);
    routing.topk_ids = *T(ids);
    struct {
        int block;
        moefuse_tensor *counts, *order, *pos, *offs;
        moefuse_status want;
        const char *names;
    } cases[] = {
        {0, T(counts), NULL, NULL, NULL, MOEFUSE_ERR_INVALID_ARGUMENT, "block_size"},
        {4, T(counts), T(order), NULL, NULL, MOEFUSE_ERR_SHAPE, "meta.order"},
        {1, T(fcounts), NULL, NULL, NULL, MOEFUSE_ERR_DTYPE, "meta.counts"},
        {1, T(counts), NULL, T(pos), NULL, MOEFUSE_ERR_SHAPE, "meta.position"},
        {1, T(counts), NULL, NULL, T(offs), MOEFUSE_ERR_SHAPE, "meta.offsets"},
        {1 << 30, T(counts), NULL, NULL, NULL, MOEFUSE_ERR_SHAPE, "2^31"}, /* i32 indices */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        moefuse_routing_meta meta;
        memset(&meta, 0, sizeof meta);
        meta.counts = *cases[c].counts;
        if (cases[c].order)
            meta.order = *cases[c].order;
        if (cases[c].pos)
            meta.position = *cases[c].pos;
        if (cases[c].offs)
            meta.offsets = *cases[c].offs;
        const moefuse_status st = moefuse_routing_metadata(g_ctx, &routing, cases[c].block, &meta);
        char msg[512];
        snprintf(msg, sizeof msg, "%s", moefuse_last_error(g_ctx));
        HCHECK(st == cases[c].want, "case %zu: %s, want %s (%s)", c, moefuse_status_name(st),
               moefuse_status_name(cases[c].want), msg);
        HCHECK(strstr(msg, cases[c].names) != NULL, "case %zu: the message \"%s\" does not name %s",
               c, msg, cases[c].names);
        h_check_all(1);
    }
    const moefuse_status st = moefuse_routing_metadata(g_ctx, &routing, 1, NULL);
    HCHECK(st == MOEFUSE_ERR_NULL_POINTER, "meta NULL: %s", moefuse_status_name(st));
    tb_free_all();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("routing_meta");
    TCase *tc = h_add_tcase(s, "routing_meta", h_setup, 60);
    tcase_add_test(tc, t_shapes);
    tcase_add_test(tc, t_expert_map);
    tcase_add_test(tc, t_each_output_alone);
    tcase_add_test(tc, t_refusals);
    return h_run(s);
}
