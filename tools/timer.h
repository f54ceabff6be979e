/* Monotonic wall-clock time for the benchmarks. */
#ifndef MOEFUSE_TOOLS_TIMER_H
#define MOEFUSE_TOOLS_TIMER_H

#include <time.h>

/* Seconds since an arbitrary origin, from CLOCK_MONOTONIC (not affected by clock changes). */
static inline double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#endif
