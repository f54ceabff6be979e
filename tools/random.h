/*
 * Fast, reproducible random numbers for the tools: splitmix64 seeds one
 * xorshift64* stream. Filling a gigabyte of weights must take a second, not a
 * minute, so there is no libc rand() here.
 */
#ifndef MOEFUSE_TOOLS_RANDOM_H
#define MOEFUSE_TOOLS_RANDOM_H

#include <stdint.h>

typedef struct rng {
    uint64_t s;
} rng;

static inline uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline rng rng_seed(uint64_t seed)
{
    rng r;
    r.s = splitmix64(&seed);
    if (r.s == 0)
        r.s = 1; /* xorshift must not start from 0 */
    return r;
}

static inline uint64_t rng_next(rng *r)
{
    uint64_t x = r->s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    r->s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* Uniform in [-1, 1), 24 random bits. */
static inline float rng_uniform(rng *r)
{
    return (float)(int32_t)(rng_next(r) >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

/* Uniform integer in [0, n). */
static inline uint32_t rng_below(rng *r, uint32_t n)
{
    return (uint32_t)(((rng_next(r) >> 32) * (uint64_t)n) >> 32);
}

#endif
