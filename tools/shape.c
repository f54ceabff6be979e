/* Parsing and checking of `moefuse bench --shape` strings. */
#include "shape.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int shape_parse(const char *text, shape_spec *out)
{
    memset(out, 0, sizeof *out);
    const char *p = text;
    if (*p == '\0') {
        fprintf(stderr, "moefuse bench: --shape is empty (example: T=4096,H=7168)\n");
        return -1;
    }
    while (*p) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        if (!eq || eq == p || eq == p + len - 1) {
            fprintf(stderr, "moefuse bench: --shape item '%.*s' is not key=value "
                            "(example: T=4096,H=7168)\n", (int)len, p);
            return -1;
        }
        size_t klen = (size_t)(eq - p), vlen = len - klen - 1;
        if (out->count == SHAPE_MAX_KEYS || klen >= sizeof out->key[0] ||
            vlen >= sizeof out->value[0]) {
            fprintf(stderr, "moefuse bench: --shape item '%.*s' is too long, or too many items\n",
                    (int)len, p);
            return -1;
        }
        for (int i = 0; i < out->count; i++)
            if (strlen(out->key[i]) == klen && memcmp(out->key[i], p, klen) == 0) {
                fprintf(stderr, "moefuse bench: --shape gives '%.*s' twice\n", (int)klen, p);
                return -1;
            }
        memcpy(out->key[out->count], p, klen);
        memcpy(out->value[out->count], eq + 1, vlen);
        out->count++;
        p += len;
        if (*p == ',') {
            p++;
            if (*p == '\0') {
                fprintf(stderr, "moefuse bench: --shape ends with a comma\n");
                return -1;
            }
        }
    }
    return 0;
}

const char *shape_get(shape_spec *s, const char *key)
{
    for (int i = 0; i < s->count; i++)
        if (strcmp(s->key[i], key) == 0) {
            s->used[i] = 1;
            return s->value[i];
        }
    return NULL;
}

static int shape_int_from(shape_spec *s, const char *op, const char *key, int64_t fallback,
                          int64_t min, int64_t max, int64_t *value)
{
    const char *v = shape_get(s, key);
    if (!v) {
        if (fallback < 0) {
            fprintf(stderr, "moefuse bench: --op %s needs %s= in --shape\n", op, key);
            return -1;
        }
        *value = fallback;
        return 0;
    }
    char *end = NULL;
    errno = 0;
    long long n = strtoll(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0') {
        fprintf(stderr, "moefuse bench: --shape %s=%s is not an integer\n", key, v);
        return -1;
    }
    if (n < min || n > max) {
        fprintf(stderr, "moefuse bench: --shape %s=%s is out of range [%lld, %lld]\n", key, v,
                (long long)min, (long long)max);
        return -1;
    }
    *value = (int64_t)n;
    return 0;
}

int shape_int(shape_spec *s, const char *op, const char *key, int64_t fallback, int64_t max,
              int64_t *value)
{
    return shape_int_from(s, op, key, fallback, 1, max, value);
}

int shape_count(shape_spec *s, const char *op, const char *key, int64_t max, int64_t *value)
{
    return shape_int_from(s, op, key, 0, 0, max, value);
}

/* Whether `key` is one of the words of the list "T, H, G". */
static int in_list(const char *key, const char *keys)
{
    const size_t n = strlen(key);
    for (const char *p = keys; (p = strstr(p, key)) != NULL; p += n)
        if ((p == keys || p[-1] == ' ') && (p[n] == ',' || p[n] == '\0'))
            return 1;
    return 0;
}

int shape_check_keys(const shape_spec *s, const char *op, const char *keys)
{
    for (int i = 0; i < s->count; i++)
        if (!in_list(s->key[i], keys)) {
            fprintf(stderr, "moefuse bench: --op %s does not take '%s' in --shape (it takes: %s)\n",
                    op, s->key[i], keys);
            return -1;
        }
    return 0;
}

int shape_check_unused(const shape_spec *s, const char *op, const char *keys)
{
    for (int i = 0; i < s->count; i++)
        if (!s->used[i]) {
            fprintf(stderr, "moefuse bench: --op %s does not take '%s' in --shape (it takes: %s)\n",
                    op, s->key[i], keys);
            return -1;
        }
    return 0;
}
