/*
 * vmm.c: the stand-in's HIP virtual memory management calls
 * (hipMemGetAllocationGranularity, hipMemAddressReserve / hipMemAddressFree,
 * hipMemCreate / hipMemRelease, hipMemMap / hipMemUnmap, hipMemSetAccess).
 * The imitation and its rules are common/sq_vmm.c's (compiled here, by the
 * #include below), written from the CUDA driver API whose calls HIP's
 * mirror and from HIP's reference (Virtual Memory Management) and
 * programming guide ("Virtual memory management"); this file fills its
 * table with HIP's names and codes and keeps the exported entry points,
 * which decode ROCm's structs and call it.
 *
 * HIP's side of the documented differences:
 * - hipMemMap: "offset: offset into the memory, currently must be zero"
 *   (a nonzero one is hipErrorInvalidValue).
 * - A failing hipMemUnmap or hipMemRelease (MEMGOV_STANDIN_HIP_
 *   FAIL_UNMAP_AT=N, and the FAIL_ENTRY knob below) returns
 *   hipErrorInvalidValue, the reference's failure code for both, leaving
 *   the mapping or handle as it was.
 * - A copy may have two device sides (hipMemcpyAsync's kinds):
 *   libamdhip64.c names both; one in a reservation and the other device
 *   memory of another kind aborts (not imitated).
 * - hipMemGenericAllocationHandle_t is a pointer to a struct the header
 *   declares opaque: the stand-in's handle is the address of its record.
 *
 * - MEMGOV_STANDIN_HIP_FAIL_ENTRY=<entry point>:<N>: the Nth call of that
 *   entry point (counting the calls that pass its argument checks) fails
 *   and changes nothing, with the codes FAIL_VMM_AT uses (hipMemCreate
 *   hipErrorOutOfMemory, hipMemMap and hipMemSetAccess hipErrorInvalidValue);
 *   hipMemUnmap and hipMemRelease with hipErrorInvalidValue (the
 *   reference's failure code for both), leaving the mapping or handle as
 *   it was (a later call on it succeeds); graph.c's hipStreamBeginCapture
 *   and hipStreamEndCapture as it says; libamdhip64.c's hipHostMalloc
 *   with hipErrorOutOfMemory, nothing allocated, and hipGetDevice with
 *   hipErrorInvalidDevice, nothing read.
 *   memgov_standin_hip_fail_entry(fn,
 *   N) sets the same at run time (the count starts again), so that one
 *   process runs many fault cells.
 * - memgov_standin_hip_vmm() reports what is held, for tests.
 */
#define _GNU_SOURCE
#define __HIP_PLATFORM_AMD__ 1
#include <hip/hip_runtime_api.h>

#include "graph.h"
#include "vmm.h"

#include "sq_vmm.h"

#include <stddef.h>
#include <stdint.h>

int hip_standin_entry_fault(const char *fn) {
    return sq_entry_fault("MEMGOV_STANDIN_HIP_FAIL_ENTRY", fn);
}

static struct sq_vmm_access access_of(const void *desc, size_t i) {
    const hipMemAccessDesc *d = (const hipMemAccessDesc *)desc + i;
    return (struct sq_vmm_access){.on_device = d->location.type == hipMemLocationTypeDevice,
                                  .device = d->location.id,
                                  .flags = (int)d->flags};
}

_Static_assert((int)hipMemAccessFlagsProtNone == SQ_VMM_PROT_NONE &&
                   (int)hipMemAccessFlagsProtRead == SQ_VMM_PROT_READ &&
                   (int)hipMemAccessFlagsProtReadWrite == SQ_VMM_PROT_READWRITE,
               "hipMemAccessFlags numbered as sq_vmm.c reads them");
_Static_assert(hipMemAllocationGranularityMinimum == 0 &&
                   hipMemAllocationGranularityRecommended == 1,
               "hipMemAllocationGranularity_flags numbered as sq_vmm.c reads them");

static const struct sq_vmm_vendor HIP_VMM = {
    .create = "hipMemCreate", .release = "hipMemRelease", .map = "hipMemMap",
    .set_access = "hipMemSetAccess", .unmap = "hipMemUnmap", .address_free = "hipMemAddressFree",
    .prefix = "MEMGOV_STANDIN_HIP", .memfd_name = "memgov-standin-hip-vmm",
    .success = hipSuccess, .invalid_value = hipErrorInvalidValue,
    .out_of_memory = hipErrorOutOfMemory, .invalid_device = hipErrorInvalidDevice,
    /* hipMemUnmap's and hipMemRelease's references list hipErrorInvalidValue. */
    .unmap_failure = hipErrorInvalidValue, .release_failure = hipErrorInvalidValue,
    /* hipMemMap: "offset - offset into the memory, currently must be zero". */
    .map_offset_must_be_zero = 1,
    .devices = hip_standin_devices, .capacity = hip_standin_capacity,
    .sticky = sq_knobs_sticky, .entry_fault = hip_standin_entry_fault, .access_of = access_of,
    .unsafe_during_capture = graph_unsafe, .capture_unsupported = hipErrorStreamCaptureUnsupported,
};

#include "sq_vmm.c"

/* For tests (standin.h, exported through libamdhip64.map):
 * memgov_standin_hip_fail_entry(fn, n): from now on the Nth call of `fn`
 * fails (counting from this call; N = 0 or fn = NULL: none), as
 * MEMGOV_STANDIN_HIP_FAIL_ENTRY says at process start (1 for a name too
 * long, else 0); memgov_standin_hip_pause_entry(fn, n), for tests that
 * force an interleaving: from now on the Nth call of `fn` (any entry
 * point, at its entry) blocks before it changes anything, until
 * memgov_standin_hip_resume_entry(); memgov_standin_hip_entry_paused()
 * says whether one is held. */
SQ_ENTRY_TEST_HOOKS(hip)

#define VMM_ENTER(fn) HIP_STANDIN_CALL(fn)

static const struct sq_vmm_prop *prop_of(const hipMemAllocationProp *p, struct sq_vmm_prop *out) {
    if (p == NULL) return NULL;
    *out = (struct sq_vmm_prop){.pinned = p->type == hipMemAllocationTypePinned,
                                .on_device = p->location.type == hipMemLocationTypeDevice,
                                .device = p->location.id};
    return out;
}

hipError_t hipMemGetAllocationGranularity(size_t *granularity, const hipMemAllocationProp *prop,
                                          hipMemAllocationGranularity_flags option) {
    VMM_ENTER("hipMemGetAllocationGranularity");
    struct sq_vmm_prop p;
    return (hipError_t)sq_vmm_granularity(&HIP_VMM, granularity, prop_of(prop, &p), (int)option);
}

hipError_t hipMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr,
                                unsigned long long flags) {
    VMM_ENTER("hipMemAddressReserve");
    (void)addr; /* a hint only */
    uint64_t base;
    hipError_t r =
        (hipError_t)sq_vmm_reserve(&HIP_VMM, ptr != NULL ? &base : NULL, size, alignment, flags);
    if (r == hipSuccess) *ptr = (void *)(uintptr_t)base;
    return r;
}

hipError_t hipMemAddressFree(void *devPtr, size_t size) {
    VMM_ENTER("hipMemAddressFree");
    return (hipError_t)sq_vmm_address_free(&HIP_VMM, (uint64_t)(uintptr_t)devPtr, size);
}

hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *handle, size_t size,
                        const hipMemAllocationProp *prop, unsigned long long flags) {
    VMM_ENTER("hipMemCreate");
    struct sq_vmm_prop p;
    uint64_t h;
    hipError_t r = (hipError_t)sq_vmm_create(&HIP_VMM, handle != NULL ? &h : NULL, size,
                                             prop_of(prop, &p), flags);
    if (r == hipSuccess) *handle = (hipMemGenericAllocationHandle_t)(uintptr_t)h;
    return r;
}

hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
    VMM_ENTER("hipMemRelease");
    return (hipError_t)sq_vmm_release(&HIP_VMM, (uint64_t)(uintptr_t)handle);
}

hipError_t hipMemMap(void *va, size_t size, size_t offset, hipMemGenericAllocationHandle_t handle,
                     unsigned long long flags) {
    VMM_ENTER("hipMemMap");
    return (hipError_t)sq_vmm_map(&HIP_VMM, (uint64_t)(uintptr_t)va, size, offset,
                                  (uint64_t)(uintptr_t)handle, flags);
}

hipError_t hipMemSetAccess(void *va, size_t size, const hipMemAccessDesc *desc, size_t count) {
    VMM_ENTER("hipMemSetAccess");
    return (hipError_t)sq_vmm_set_access(&HIP_VMM, (uint64_t)(uintptr_t)va, size, desc, count);
}

hipError_t hipMemUnmap(void *va, size_t size) {
    VMM_ENTER("hipMemUnmap");
    return (hipError_t)sq_vmm_unmap(&HIP_VMM, (uint64_t)(uintptr_t)va, size);
}

int vmm_copy(const char *fn, int dst_device, int src_device, void *dst, const void *src,
             size_t bytes, struct sq_queue *q) {
    return sq_vmm_copy(&HIP_VMM, fn, dst_device, src_device, dst, src, bytes, q);
}

uint64_t vmm_physical_bytes(void) { return sq_vmm_physical_bytes(); }

/* For tests: what the process holds, as {reservations, reserved bytes,
 * allocation handles (released but still mapped included), physical bytes,
 * mappings, mapped bytes}. Returns 0. */
int memgov_standin_hip_vmm(unsigned long long out[6]);
int memgov_standin_hip_vmm(unsigned long long out[6]) { return sq_vmm_held(out); }
