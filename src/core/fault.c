/* Per-thread fault injection counters (see fault.h). */
#include "core/fault.h"

static _Thread_local unsigned armed;                          /* bit per kind: the fast test */
static _Thread_local int64_t hits_left[MF_FAULT_KIND_COUNT_]; /* down to the one that fails */
static _Thread_local bool fired[MF_FAULT_KIND_COUNT_];

static bool valid(mf_fault_kind kind) { return (unsigned)kind < MF_FAULT_KIND_COUNT_; }

void mf_fault_arm(mf_fault_kind kind, int64_t nth)
{
    if (!valid(kind))
        return;
    hits_left[kind] = nth > 0 ? nth : 0;
    fired[kind] = false;
    if (nth > 0)
        armed |= 1u << kind;
    else
        armed &= ~(1u << kind);
}

void mf_fault_disarm_all(void)
{
    for (int k = 0; k < MF_FAULT_KIND_COUNT_; k++) {
        hits_left[k] = 0;
        fired[k] = false;
    }
    armed = 0;
}

bool mf_fault_fired(mf_fault_kind kind) { return valid(kind) && fired[kind]; }

const char *mf_fault_kind_name(mf_fault_kind kind)
{
    static const char *const names[MF_FAULT_KIND_COUNT_] = {
        [MF_FAULT_HOST_ALLOC] = "host allocation",
        [MF_FAULT_DEVICE_ALLOC] = "device allocation",
        [MF_FAULT_SCRATCH_GROW] = "scratch growth",
        [MF_FAULT_PROGRAM_BUILD] = "program build",
    };
    return valid(kind) ? names[kind] : "unknown fault kind";
}

bool mf_fault_hit(mf_fault_kind kind)
{
    if (!armed) /* the only work done outside tests */
        return false;
    if (!(armed & (1u << kind)) || --hits_left[kind] > 0)
        return false;
    armed &= ~(1u << kind);
    fired[kind] = true;
    return true;
}
