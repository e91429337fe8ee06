/*
 * sq_vmm.h: the virtual memory management imitation the CUDA and HIP
 * stand-ins share (sq_vmm.c), parameterised by a table each vendor fills
 * with its entry points' names, its error codes and its documented
 * differences.
 *
 * CUDA's driver API (Virtual Memory Management: cuMemAddressReserve,
 * cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease,
 * cuMemAddressFree) and HIP's runtime API (the same calls, hipMem*, which
 * HIP's reference documents as mirroring them) follow one model: a
 * reservation of address space, physical memory behind a handle, a mapping
 * of the handle into the reservation, access set on the mapping. The rules
 * below are written once; each vendor's virtual memory section (of its one
 * stand-in file) keeps only its exported entry points, which decode their
 * arguments (the vendor's structs and handle types) and call these.
 *
 * sq_vmm.c is compiled as part of the vendor's virtual memory section
 * (which includes it after filling its table), not as a library of its
 * own: a stand-in built without that section (CUDA:
 * -DMEMGOV_STANDIN_CUDA_PARTIAL; HIP: without vmm.c, the selector that
 * compiles it) lacks the whole imitation, as the partial builds that
 * imitate a driver lacking these calls rely on (the vendor's other
 * sections reach it only through weak hooks they test for NULL).
 */
#ifndef MEMGOV_STANDIN_SQ_VMM_H
#define MEMGOV_STANDIN_SQ_VMM_H

#include "standin.h"

#include <stddef.h>
#include <stdint.h>

/* An access descriptor's protection, as both vendors number it
 * (CU_MEM_ACCESS_FLAGS_PROT_* and hipMemAccessFlagsProt* are 0, 1 and 3). */
enum { SQ_VMM_PROT_NONE = 0, SQ_VMM_PROT_READ = 1, SQ_VMM_PROT_READWRITE = 3 };

/* An allocation's properties, decoded by the vendor from its own struct
 * (CUmemAllocationProp, hipMemAllocationProp). */
struct sq_vmm_prop {
    int pinned;    /* the type is the vendor's "pinned" allocation type */
    int on_device; /* the location's type is the vendor's "device" */
    int device;    /* the location's id */
};

/* One access descriptor (CUmemAccessDesc, hipMemAccessDesc), decoded. */
struct sq_vmm_access {
    int on_device;
    int device;
    int flags; /* the vendor's flags value, compared with SQ_VMM_PROT_* */
};

struct sq_vmm_vendor {
    /* Entry point names, for the messages and the FAIL_ENTRY knob. */
    const char *create, *release, *map, *set_access, *unmap, *address_free;
    /* The knobs' prefix: <prefix>_FAIL_VMM_AT, <prefix>_FAIL_UNMAP_AT,
     * <prefix>_EXIT_CHECK (e.g. "MEMGOV_STANDIN_CUDA"). */
    const char *prefix;
    /* The name of each handle's memfd (seen in /proc/<pid>/maps). */
    const char *memfd_name;

    /* Codes. */
    int success;
    int invalid_value;
    int out_of_memory;
    int invalid_device;
    /* What a failing unmap or release returns (the FAIL_UNMAP_AT and
     * FAIL_ENTRY knobs): a code the vendor's reference lists for the call. */
    int unmap_failure;
    int release_failure;

    /* Documented differences. */
    /* The map call's offset into the handle "currently must be zero"
     * (HIP); else it is any multiple of the granularity within the handle
     * (CUDA). */
    int map_offset_must_be_zero;

    /* Hooks into the vendor's library. */
    int (*devices)(void);
    uint64_t (*capacity)(void); /* bytes the stand-in may hand out */
    int (*sticky)(void);        /* the device is in the sticky error state */
    int (*entry_fault)(const char *fn); /* the FAIL_ENTRY knob says this call fails */
    /* The graph section's graph_unsafe (weak: NULL in a build without it): a
     * create, release, map or unmap is a potentially unsafe call, which a
     * capture under way may prohibit (nonzero: refused with
     * capture_unsupported, the capture invalidated). */
    int (*unsafe_during_capture)(const char *fn, int alloc);
    int capture_unsupported;
    /* Decodes access descriptor i of the array the set-access call got. */
    struct sq_vmm_access (*access_of)(const void *desc, size_t i);
};

#endif
