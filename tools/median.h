/* The median of timed runs, as every figure and ceiling of `moefuse bench` reports it. */
#ifndef MOEFUSE_TOOLS_MEDIAN_H
#define MOEFUSE_TOOLS_MEDIAN_H

#include <stddef.h>
#include <stdlib.h>

static int median_cmp(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v[0..n) ascending (n >= 1) and returns its median. */
static inline double median_sort(double *v, size_t n)
{
    qsort(v, n, sizeof *v, median_cmp);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
