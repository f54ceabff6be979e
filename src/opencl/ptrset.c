/*
 * The set of cl_mem handles this context allocated. Ownership checks look
 * here instead of asking OpenCL: clGetMemObjectInfo on something that is not
 * a cl_mem (a host pointer from a cpu context, say) would make the ICD loader
 * jump through garbage, and a wrong handle must give an error, not a crash.
 * Open addressing with linear probing; deleted slots keep a tombstone.
 */
#include "opencl/ptrset.h"
#include "core/fault.h"

#include <stdint.h>
#include <stdlib.h>

#define TOMB ((const void *)(uintptr_t)1)

static size_t slot_of(const void *p, size_t cap)
{
    uintptr_t h = (uintptr_t)p;
    h ^= h >> 33;
    h *= (uintptr_t)0xff51afd7ed558ccdull;
    h ^= h >> 29;
    return (size_t)h & (cap - 1);
}

static bool grow(mf_ptrset *s)
{
    size_t cap = s->cap ? s->cap * 2 : 64;
    const void **slots = mf_fault_hit(MF_FAULT_HOST_ALLOC) ? NULL : calloc(cap, sizeof *slots);
    if (!slots)
        return false;
    for (size_t i = 0; i < s->cap; i++) {
        const void *p = s->slots[i];
        if (p && p != TOMB) {
            size_t j = slot_of(p, cap);
            while (slots[j])
                j = (j + 1) & (cap - 1);
            slots[j] = p;
        }
    }
    free(s->slots);
    s->slots = slots;
    s->cap = cap;
    s->used = s->count;
    return true;
}

bool mf_ptrset_add(mf_ptrset *s, const void *p)
{
    if ((s->used + 1) * 2 > s->cap && !grow(s)) /* keep the load under one half */
        return false;
    size_t j = slot_of(p, s->cap);
    while (s->slots[j] && s->slots[j] != TOMB)
        j = (j + 1) & (s->cap - 1);
    if (!s->slots[j])
        s->used++;
    s->slots[j] = p;
    s->count++;
    return true;
}

static size_t find(const mf_ptrset *s, const void *p)
{
    if (!s->cap || !p)
        return SIZE_MAX;
    size_t j = slot_of(p, s->cap);
    for (size_t n = 0; n < s->cap && s->slots[j]; n++, j = (j + 1) & (s->cap - 1))
        if (s->slots[j] == p)
            return j;
    return SIZE_MAX;
}

bool mf_ptrset_has(const mf_ptrset *s, const void *p) { return find(s, p) != SIZE_MAX; }

bool mf_ptrset_remove(mf_ptrset *s, const void *p)
{
    size_t j = find(s, p);
    if (j == SIZE_MAX)
        return false;
    s->slots[j] = TOMB;
    s->count--;
    return true;
}

const void *mf_ptrset_at(const mf_ptrset *s, size_t i)
{
    const void *p = i < s->cap ? s->slots[i] : NULL;
    return p == TOMB ? NULL : p;
}

void mf_ptrset_free(mf_ptrset *s)
{
    free(s->slots);
    s->slots = NULL;
    s->cap = s->count = s->used = 0;
}
