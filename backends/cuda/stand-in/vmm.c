/*
 * vmm.c: the stand-in's CUDA virtual memory management calls
 * (cuMemGetAllocationGranularity, cuMemAddressReserve / cuMemAddressFree,
 * cuMemCreate / cuMemRelease, cuMemMap / cuMemUnmap, cuMemSetAccess). The
 * imitation and its rules are common/sq_vmm.c's (compiled here, by the
 * #include below); this file fills its table with the driver API's names
 * and codes and keeps the exported entry points, which decode the CUDA
 * structs and call it.
 *
 * CUDA's side of the documented differences (CUDA Driver API, Virtual
 * Memory Management):
 * - cuMemMap maps from `offset` into the handle's memory, any multiple of
 *   the granularity within it.
 * - A failing cuMemUnmap or cuMemRelease (MEMGOV_STANDIN_CUDA_
 *   FAIL_UNMAP_AT=N, and the FAIL_ENTRY knob below) returns
 *   CUDA_ERROR_UNKNOWN, leaving the mapping or handle as it was.
 * - A copy has one device side (cuMemcpyHtoDAsync, cuMemcpyDtoHAsync):
 *   libcuda.c names its device address.
 *
 * - MEMGOV_STANDIN_CUDA_FAIL_ENTRY=<entry point>:<N>: the Nth call of that
 *   entry point (counting the calls that pass its argument checks) fails:
 *   cuMemCreate, cuMemMap and cuMemSetAccess with the codes FAIL_VMM_AT
 *   uses (sq_vmm.c), changing nothing; cuMemUnmap and cuMemRelease with
 *   CUDA_ERROR_UNKNOWN, leaving the mapping or handle as it was (a later
 *   call on it succeeds); graph.c's cuStreamBeginCapture_v2 and
 *   cuStreamEndCapture as it says; libcuda.c's cuMemHostAlloc with
 *   CUDA_ERROR_OUT_OF_MEMORY, nothing allocated, and cuCtxPushCurrent_v2
 *   with CUDA_ERROR_INVALID_CONTEXT, nothing pushed.
 *   memgov_standin_cuda_fail_entry(fn, N) sets the same at run time (the
 *   count starts again), so that one process runs many fault cells.
 * - memgov_standin_cuda_vmm() reports what is held, for tests.
 */
#define _GNU_SOURCE
#include "vmm.h"
#include "graph.h"

#include "sq_vmm.h"

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_UNKNOWN = 999,
};

#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1

/* As laid out by the CUDA 12 headers. */
struct CUmemLocation_st {
    int type;
    int id;
};
struct CUmemAllocationProp_st {
    int type;
    int requestedHandleTypes;
    struct CUmemLocation_st location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType, gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
};
struct CUmemAccessDesc_st {
    struct CUmemLocation_st location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_{NONE,READ,READWRITE}: 0, 1, 3 */
};

int standin_entry_fault(const char *fn) {
    return sq_entry_fault("MEMGOV_STANDIN_CUDA_FAIL_ENTRY", fn);
}

static struct sq_vmm_access access_of(const void *desc, size_t i) {
    const struct CUmemAccessDesc_st *d = (const struct CUmemAccessDesc_st *)desc + i;
    return (struct sq_vmm_access){.on_device = d->location.type == CU_MEM_LOCATION_TYPE_DEVICE,
                                  .device = d->location.id,
                                  .flags = d->flags};
}

static const struct sq_vmm_vendor CUDA_VMM = {
    .create = "cuMemCreate", .release = "cuMemRelease", .map = "cuMemMap",
    .set_access = "cuMemSetAccess", .unmap = "cuMemUnmap", .address_free = "cuMemAddressFree",
    .prefix = "MEMGOV_STANDIN_CUDA", .memfd_name = "memgov-standin-vmm",
    .success = CUDA_SUCCESS, .invalid_value = CUDA_ERROR_INVALID_VALUE,
    .out_of_memory = CUDA_ERROR_OUT_OF_MEMORY, .invalid_device = CUDA_ERROR_INVALID_DEVICE,
    /* cuMemUnmap's and cuMemRelease's references list CUDA_ERROR_UNKNOWN. */
    .unmap_failure = CUDA_ERROR_UNKNOWN, .release_failure = CUDA_ERROR_UNKNOWN,
    /* cuMemMap: "offset - Offset into the memory represented by handle". */
    .map_offset_must_be_zero = 0,
    .devices = cuda_standin_devices, .capacity = cuda_standin_capacity,
    .sticky = cuda_standin_sticky, .entry_fault = standin_entry_fault, .access_of = access_of,
    .unsafe_during_capture = graph_unsafe,
    .capture_unsupported = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
};

#include "sq_vmm.c"

/* For tests (standin.h): memgov_standin_cuda_fail_entry(fn, n): from now
 * on the Nth call of `fn` fails (counting from this call; N = 0 or fn =
 * NULL: none), as MEMGOV_STANDIN_CUDA_FAIL_ENTRY says at process start, so
 * that one process runs many fault cells; memgov_standin_cuda_pause_entry
 * (fn, n), for tests that force an interleaving: from now on the Nth call
 * of `fn` (any entry point, at its entry; and the point named
 * "cuCtxSynchronize:waits", after a context synchronize took its snapshot
 * of the queues and before it waits on them) blocks before it changes
 * anything, until memgov_standin_cuda_resume_entry();
 * memgov_standin_cuda_entry_paused() says whether one is held. */
SQ_ENTRY_TEST_HOOKS(cuda)

#define VMM_ENTER(fn) CUDA_STANDIN_CALL(fn)

static const struct sq_vmm_prop *prop_of(const struct CUmemAllocationProp_st *p,
                                        struct sq_vmm_prop *out) {
    if (p == NULL) return NULL;
    *out = (struct sq_vmm_prop){.pinned = p->type == CU_MEM_ALLOCATION_TYPE_PINNED,
                                .on_device = p->location.type == CU_MEM_LOCATION_TYPE_DEVICE,
                                .device = p->location.id};
    return out;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity,
                                       const struct CUmemAllocationProp_st *prop, int option) {
    VMM_ENTER("cuMemGetAllocationGranularity");
    struct sq_vmm_prop p;
    return sq_vmm_granularity(&CUDA_VMM, granularity, prop_of(prop, &p), option);
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    VMM_ENTER("cuMemAddressReserve");
    (void)addr; /* a hint only */
    uint64_t base;
    CUresult r = sq_vmm_reserve(&CUDA_VMM, ptr != NULL ? &base : NULL, size, alignment, flags);
    if (r == CUDA_SUCCESS) *ptr = base;
    return r;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    VMM_ENTER("cuMemAddressFree");
    return sq_vmm_address_free(&CUDA_VMM, ptr, size);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const struct CUmemAllocationProp_st *prop, unsigned long long flags) {
    VMM_ENTER("cuMemCreate");
    struct sq_vmm_prop p;
    uint64_t h;
    CUresult r =
        sq_vmm_create(&CUDA_VMM, handle != NULL ? &h : NULL, size, prop_of(prop, &p), flags);
    if (r == CUDA_SUCCESS) *handle = h;
    return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    VMM_ENTER("cuMemRelease");
    return sq_vmm_release(&CUDA_VMM, handle);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    VMM_ENTER("cuMemMap");
    return sq_vmm_map(&CUDA_VMM, ptr, size, offset, handle, flags);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const struct CUmemAccessDesc_st *desc,
                        size_t count) {
    VMM_ENTER("cuMemSetAccess");
    return sq_vmm_set_access(&CUDA_VMM, ptr, size, desc, count);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    VMM_ENTER("cuMemUnmap");
    return sq_vmm_unmap(&CUDA_VMM, ptr, size);
}

/* vmm.h: libcuda.c's copies name their one device side, `addr`. */
int vmm_copy(const char *fn, uint64_t addr, size_t bytes, struct sq_queue *q, void *dst,
             const void *src) {
    int dst_is_device = (uint64_t)(uintptr_t)dst == addr;
    return sq_vmm_copy(&CUDA_VMM, fn, dst_is_device, !dst_is_device, dst, src, bytes, q);
}

uint64_t vmm_physical_bytes(void) { return sq_vmm_physical_bytes(); }

/* For tests: what the process holds, as {reservations, reserved bytes,
 * allocation handles (released but still mapped included), physical bytes,
 * mappings, mapped bytes}. Returns 0. */
int memgov_standin_cuda_vmm(unsigned long long out[6]) { return sq_vmm_held(out); }
