/* `--shape` strings of `moefuse bench`: comma-separated key=value pairs. */
#ifndef MOEFUSE_TOOLS_SHAPE_H
#define MOEFUSE_TOOLS_SHAPE_H

#include <stdint.h>

#define SHAPE_MAX_KEYS 16

typedef struct shape_spec {
    int count;
    char key[SHAPE_MAX_KEYS][16];
    char value[SHAPE_MAX_KEYS][32];
    int used[SHAPE_MAX_KEYS];
} shape_spec;

/* Split "T=4096,H=7168" into pairs; -1 with a message on stderr when malformed. */
int shape_parse(const char *text, shape_spec *out);
/* Value of `key`, or NULL. Marks the key as used. */
const char *shape_get(shape_spec *s, const char *key);
/*
 * Integer value of `key` in [1, max]: `fallback` when absent (fallback < 0: the key is
 * required). -1 with a message when missing, malformed or out of range.
 */
int shape_int(shape_spec *s, const char *op, const char *key, int64_t fallback, int64_t max,
              int64_t *value);
/* The same for a count that may be 0: in [0, max], 0 when absent. */
int shape_count(shape_spec *s, const char *op, const char *key, int64_t max, int64_t *value);
/* -1 with a message naming the first key that is not in `keys` ("T, H, G"). */
int shape_check_keys(const shape_spec *s, const char *op, const char *keys);
/* -1 with a message naming the first key no one asked for. */
int shape_check_unused(const shape_spec *s, const char *op, const char *keys);

#endif
