/* A small set of pointers (the cl_mem handles a context allocated). */
#ifndef MOEFUSE_OPENCL_PTRSET_H
#define MOEFUSE_OPENCL_PTRSET_H

#include <stdbool.h>
#include <stddef.h>

typedef struct mf_ptrset {
    const void **slots;
    size_t cap;   /* power of two, or 0 */
    size_t count; /* live entries */
    size_t used;  /* live entries plus tombstones */
} mf_ptrset;

bool mf_ptrset_add(mf_ptrset *s, const void *p); /* false when out of memory */
bool mf_ptrset_has(const mf_ptrset *s, const void *p);
bool mf_ptrset_remove(mf_ptrset *s, const void *p); /* false when absent */
/* Entry in slot i (0 <= i < cap), NULL when the slot is empty: for walking the set. */
const void *mf_ptrset_at(const mf_ptrset *s, size_t i);
void mf_ptrset_free(mf_ptrset *s);

#endif /* MOEFUSE_OPENCL_PTRSET_H */
